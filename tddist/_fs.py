"""File-system primitives the commit needs: fsync, atomic renames, removal; dropping a mapped file's pages.

``renameat2`` is not exposed by Python's ``os`` module, so it is reached through
ctypes (glibc >= 2.28). RENAME_EXCHANGE swaps two directory entries in one
atomic step, which is how an existing checkpoint is replaced without a moment
where neither the old nor the new one is at the target path. Nor is
``sync_file_range``, which starts the write-back of what was just written
(``start_writeback``).
"""

from __future__ import annotations

import ctypes
import errno
import mmap
import os
import shutil
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from functools import partial
from typing import Literal, TypeVar

from ._faults import fault_point

T = TypeVar("T")

_AT_FDCWD = -100
RENAME_NOREPLACE = 1
RENAME_EXCHANGE = 2

_libc: ctypes.CDLL | Literal[False] | None = None  # False: tried, and it cannot be loaded


def pwrite_all(fd: int, data: memoryview, at: int, step: int = 1 << 30) -> None:
    """Write all of ``data`` at offset ``at`` of ``fd``: positioned writes of at most ``step`` bytes, until done
    (a write may write less than asked; Linux writes at most about 2 GiB at once)."""
    done = 0
    while done < len(data):
        done += os.pwrite(fd, data[done : done + step], at + done)


#: sync_file_range's flag that starts the write-back of the range's dirty pages and returns without waiting.
SYNC_FILE_RANGE_WRITE = 2
#: sync_file_range's flags that wait for the range's write-back in flight before and after starting its own.
SYNC_FILE_RANGE_WAIT_BEFORE = 1
SYNC_FILE_RANGE_WAIT_AFTER = 4
_sync_file_range: Callable[..., int] | Literal[False] | None = None  # False: not in this C library


def start_writeback(fd: int, at: int, nbytes: int) -> None:
    """Start writing ``nbytes`` at ``at`` of ``fd`` to the disk now, without waiting: a hint, never durability.

    A checkpoint's data is written into the page cache and made durable by
    one fsync at the end. Below the kernel's dirty thresholds (10% of memory
    by default) nothing reaches the disk before that fsync, so the disk sits
    idle while the data is copied into the cache, then works alone. Starting
    each block's write-back as soon as it is written lets the two overlap
    (1 GiB on an ext4 virtual disk: 1.75 s instead of 2.0-2.5 s to durable).
    Where the call is missing or refused (not Linux, a pipe) nothing happens:
    the fsync that follows still writes everything and reports any error.
    """
    fn = _range_sync()
    if fn and nbytes > 0:
        fn(fd, at, nbytes, SYNC_FILE_RANGE_WRITE)


def wait_for_writeback(fd: int, at: int, nbytes: int) -> None:
    """Wait until the disk has the ``nbytes`` at ``at`` of ``fd`` (written and their write-back started): a
    throttle, never durability (no metadata, no device cache flush; the fsync that follows gives both).

    A writer that runs beside work it must not slow down (``stream.Stream``'s
    writes while the caller copies) waits here for an earlier block before it
    writes the next one, so it copies into the page cache no faster than the
    disk drains it. Where the call is missing it returns at once
    (``waits_for_writeback`` says so beforehand); an error is left to that fsync.
    """
    fn = _range_sync()
    if fn and nbytes > 0:
        fn(fd, at, nbytes, SYNC_FILE_RANGE_WAIT_BEFORE | SYNC_FILE_RANGE_WRITE | SYNC_FILE_RANGE_WAIT_AFTER)


def waits_for_writeback() -> bool:
    """Whether ``wait_for_writeback`` can wait here (Linux's ``sync_file_range`` is in the C library)."""
    return bool(_range_sync())


def _range_sync() -> Callable[..., int] | Literal[False]:
    """The C library's ``sync_file_range``, looked up once; False where it has none."""
    global _sync_file_range
    if _sync_file_range is None:
        fn = getattr(_load_libc(), "sync_file_range", None)
        if fn is not None:
            fn.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint]
        _sync_file_range = fn or False
    return _sync_file_range or False


#: The smallest write whose write-back is started at once; smaller ones (headers, batches of tiny leaves) wait
#: for the fsync rather than cost a system call each.
WRITEBACK_MIN = 1024 * 1024
#: The most bytes the data writers (``writer.py``, ``stream.py``) hand to one ``pwrite``.
WRITE_STEP = 8 * 1024 * 1024


def write_and_start_writeback(fd: int, data: memoryview, at: int, step: int = 1 << 30) -> None:
    """``pwrite_all``, then ``start_writeback`` of what it wrote: the writers' block write before their fsync."""
    pwrite_all(fd, data, at, step)
    if len(data) >= WRITEBACK_MIN:
        start_writeback(fd, at, len(data))


def _load_libc() -> ctypes.CDLL | None:
    """The C library through ctypes, or None where it cannot be loaded."""
    global _libc
    if _libc is None:
        try:
            _libc = ctypes.CDLL(None, use_errno=True)
        except OSError:
            _libc = False
    return _libc or None


#: ``madvise``'s advice that drops a range's pages from the process (they are read from the file again if touched).
MADV_DONTNEED = 4


def drop_pages(address: int, nbytes: int) -> None:
    """Drop the pages of ``[address, address + nbytes)`` from this process (``madvise(MADV_DONTNEED)``).

    For a range of one file mapped copy-on-write whose pages were never
    written: the kernel takes back the pages, which count in the process's
    resident memory while mapped; a later read maps them from the file again,
    with the same bytes. So a reader that streams a mapped file keeps about
    what it is reading resident, not all it has read. The range is widened to
    whole pages (a mapping starts on a page, so they stay inside it). Never
    call it on anonymous memory (its pages would read back as zeros) or on
    pages written since the map: the writes would be lost. Does nothing where
    ``madvise`` cannot be reached (an advice, not a requirement).
    """
    madvise = getattr(_load_libc(), "madvise", None)
    if madvise is None or nbytes <= 0:
        return
    start = address - address % mmap.PAGESIZE
    end = address + nbytes
    end += -end % mmap.PAGESIZE
    madvise(ctypes.c_void_p(start), ctypes.c_size_t(end - start), MADV_DONTNEED)


def available_memory() -> int | None:
    """Bytes of memory the kernel can give without swapping (``MemAvailable`` of ``/proc/meminfo``), None where
    it does not say."""
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


#: ``madvise``'s advice that faults a range's pages in and waits for them (Linux 5.14+); Python 3.11's ``mmap`` lacks
#: the name.
MADV_POPULATE_READ = getattr(mmap, "MADV_POPULATE_READ", 22)


def read_into_page_cache(fd: int, start: int, stop: int) -> None:
    """Read bytes ``[start, stop)`` of the file open at ``fd`` into the page cache and wait for them, leaving them
    mapped nowhere: a read-only map of the range for the duration of ``madvise(MADV_POPULATE_READ)``, which reads
    it in large sequential requests without copying a byte. A kernel without that advice (EINVAL) gets
    ``POSIX_FADV_WILLNEED``, which starts the same reads without waiting for them.
    """
    lo = start // mmap.ALLOCATIONGRANULARITY * mmap.ALLOCATIONGRANULARITY
    if stop <= lo:
        return
    with mmap.mmap(fd, stop - lo, access=mmap.ACCESS_READ, offset=lo) as m:
        try:
            m.madvise(MADV_POPULATE_READ)
        except OSError as e:
            if e.errno != errno.EINVAL:
                raise
            os.posix_fadvise(fd, lo, stop - lo, os.POSIX_FADV_WILLNEED)


#: ``madvise``'s advice that backs a range with transparent huge pages where the kernel allows them.
MADV_HUGEPAGE = 14
#: The size of a transparent huge page on x86-64 and arm64 (4 KiB pages).
HUGE_PAGE = 2 << 20


def advise_huge_pages(address: int, nbytes: int) -> None:
    """Ask for huge pages under the fresh anonymous memory ``[address, address + nbytes)``
    (``madvise(MADV_HUGEPAGE)`` on the whole huge pages inside it).

    For a large buffer written once at once (bytes received from a peer):
    the first write of each 4 KiB page faults, and a fault costs more than
    its copy (measured: 64 MiB written into fresh memory in about twice the
    time with 4 KiB pages as with huge pages, in a VM). Does nothing where
    ``madvise`` cannot be reached or refuses (an advice, not a requirement).
    """
    madvise = getattr(_load_libc(), "madvise", None)
    start = address + -address % HUGE_PAGE
    end = (address + nbytes) - (address + nbytes) % HUGE_PAGE
    if madvise is not None and end > start:
        madvise(ctypes.c_void_p(start), ctypes.c_size_t(end - start), MADV_HUGEPAGE)


def _renameat2_fn() -> Callable[..., int] | None:
    fn = getattr(_load_libc(), "renameat2", None)
    if fn is not None:
        fn.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    return fn


def renameat2(src: str, dst: str, flags: int) -> bool:
    """Rename with flags. Returns False when the kernel/file system lacks support."""
    fn = _renameat2_fn()
    if fn is None:
        return False
    rc = fn(_AT_FDCWD, os.fsencode(src), _AT_FDCWD, os.fsencode(dst), flags)
    if rc == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.EINVAL, errno.ENOSYS, errno.ENOTSUP):
        return False
    raise OSError(err, os.strerror(err), src, None, dst)


def exchange(a: str, b: str) -> bool:
    """Atomically swap the entries ``a`` and ``b``; False if unsupported here."""
    return renameat2(a, b, RENAME_EXCHANGE)


def rename_noreplace(src: str, dst: str) -> None:
    """Rename ``src`` to ``dst``, failing with FileExistsError if ``dst`` exists."""
    if renameat2(src, dst, RENAME_NOREPLACE):
        return
    # Fallback without kernel support: check then rename (racy only against
    # a concurrent writer of the same target, which the commit forbids).
    if os.path.lexists(dst):
        raise FileExistsError(errno.EEXIST, "target exists", dst)
    os.rename(src, dst)


def fsync_path(path: str) -> None:
    """fsync a file or a directory by path."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _kernel_at_least(major: int, minor: int) -> bool:
    try:
        parts = os.uname().release.split(".")
        return (int(parts[0]), int(parts[1].split("-")[0])) >= (major, minor)
    except (ValueError, IndexError):
        return False


def syncfs(path: str) -> bool:
    """Flush the whole file system holding ``path`` (one call instead of one fsync per file).

    Returns False where ``syncfs`` is not available, so the caller fsyncs file by file.
    """
    fn = getattr(_load_libc(), "syncfs", None)
    if fn is None or not _kernel_at_least(5, 8):  # older kernels do not report writeback errors from syncfs
        return False
    fd = os.open(path, os.O_RDONLY)
    try:
        if fn(fd) != 0:
            err = ctypes.get_errno()
            raise OSError(err, os.strerror(err), path)
        return True
    finally:
        os.close(fd)


def makedirs_durable(path: str) -> None:
    """``os.makedirs``, fsyncing the parent of every directory it creates, so a
    checkpoint committed inside them survives a power loss."""
    top = makedirs_top(path)
    if top is not None:
        sync_created(top, path)


def makedirs_top(path: str) -> str | None:
    """``os.makedirs(path, exist_ok=True)``; the top-most directory it created, None if ``path`` existed.

    Several processes may create the same directories at once: one that
    another created first is not reported (that one reports it).
    """
    missing = []
    p = os.path.abspath(path)
    while not os.path.isdir(p):
        missing.append(p)
        p = os.path.dirname(p)
    top = None
    for d in reversed(missing):
        try:
            os.mkdir(d)
        except FileExistsError:
            continue
        top = top or d
    return top


def sync_created(top: str, path: str) -> None:
    """fsync the parent of every directory from ``top`` down to ``path`` (which ``makedirs_top`` created)."""
    chain = []
    d = os.path.abspath(path)
    while True:
        chain.append(d)
        if d == top or os.path.dirname(d) == d:
            break
        d = os.path.dirname(d)
    for d in reversed(chain):
        fsync_path(os.path.dirname(d))


def fsync_tree_dirs(root: str) -> None:
    """fsync every directory under ``root`` (files are fsynced by their writer)."""
    for dirpath, _dirs, _files in os.walk(root, topdown=False):
        fsync_path(dirpath)


def write_durable(path: str, data: bytes | memoryview, sync: bool = True) -> None:
    """Write ``data`` to a new file and fsync it (unless ``sync`` is False: the caller syncs later)."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        write_all(fd, data)
        if sync:
            os.fsync(fd)
    finally:
        os.close(fd)


def write_all(fd: int, data: bytes | memoryview) -> None:
    """Write all of ``data`` at ``fd``'s position (``os.write`` may write part of it)."""
    view = memoryview(data)
    while view:
        n = os.write(fd, view)
        view = view[n:]


_SYNC_POOL: ThreadPoolExecutor | None = None
_SYNC_POOL_LOCK = threading.Lock()


def _forget_sync_pool() -> None:
    """(in a forked child) The parent's pool has no threads here: a fresh one is made on first use."""
    global _SYNC_POOL, _SYNC_POOL_LOCK
    _SYNC_POOL, _SYNC_POOL_LOCK = None, threading.Lock()


os.register_at_fork(after_in_child=_forget_sync_pool)


def in_background(fn: Callable[[], T]) -> Future[T]:
    """Run ``fn`` on one of a few threads kept for file-system calls that wait in the kernel (fsyncs, file
    creations), so the caller goes on meanwhile."""
    global _SYNC_POOL
    with _SYNC_POOL_LOCK:
        if _SYNC_POOL is None:
            _SYNC_POOL = ThreadPoolExecutor(4, thread_name_prefix="tddist-fsync")
        pool = _SYNC_POOL
    return pool.submit(fn)


def fsync_together(paths: Sequence[str | int]) -> None:
    """fsync every file or directory in ``paths`` (a path, or a descriptor open on it), all at once from a few
    threads.

    A journaling file system commits the metadata of fsyncs that wait at the
    same time in one journal commit, so three concurrent fsyncs cost about
    one; one after the other, each waits for its own commit. Raises the first
    failure once every fsync has ended.
    """
    if len(paths) < 2:
        for p in paths:
            _fsync(p)
        return
    futures = [in_background(partial(_fsync, p)) for p in paths]
    errors = [f.exception() for f in futures]
    for e in errors:
        if e is not None:
            raise e


def _fsync(path_or_fd: str | int) -> None:
    if isinstance(path_or_fd, int):
        os.fsync(path_or_fd)
    else:
        fsync_path(path_or_fd)


def remove_tree(path: str) -> None:
    """Remove a file or directory tree, ignoring a path that is already gone.

    A directory loses its first entry (by name) first, then the rest: the
    fault point ``discard`` lies between, so tests can crash a removal (of an
    old checkpoint, say) with part of the tree gone.
    """
    try:
        if os.path.isdir(path) and not os.path.islink(path):
            first = min(os.listdir(path), default=None)
            if first is not None:
                _remove_entry(os.path.join(path, first))
            fault_point("discard", 0)
            shutil.rmtree(path)
        else:
            fault_point("discard", 0)
            os.unlink(path)
    except FileNotFoundError:
        pass


def _remove_entry(path: str) -> None:
    if os.path.isdir(path) and not os.path.islink(path):
        shutil.rmtree(path)
    else:
        os.unlink(path)


def is_inside(real_root: str, path: str) -> bool:
    """True if ``path`` resolves (symbolic links followed) to ``real_root`` or below it.

    ``real_root`` must already be resolved (``os.path.realpath``): readers
    resolve the checkpoint once and check every directory they open against it.
    """
    real = os.path.realpath(path)
    return real == real_root or real.startswith(real_root + os.sep)
