"""Helpers shared by the benchmark programs: memory high-water marks, the page
cache, fsync, file-system facts and summary statistics. No torch import here,
so ``run.py`` stays light.
"""

from __future__ import annotations

import contextlib
import ctypes
import hashlib
import mmap
import os
import platform
import shutil
import statistics
import time
from collections.abc import Iterator
from pathlib import Path

MIB = 1024 * 1024
GIB = 1024 * MIB


# --- memory -----------------------------------------------------------------------


def _status_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    return 0


def rss_kib() -> int:
    """Current resident set size of this process (KiB)."""
    return _status_kib("VmRSS")


def hwm_kib() -> int:
    """Peak resident set size since the last ``reset_hwm`` (KiB)."""
    return _status_kib("VmHWM")


def reset_hwm() -> bool:
    """Reset this process's peak RSS (Linux >= 4.0: ``echo 5 > /proc/self/clear_refs``).

    Returns False where that is not permitted; the peak is then the process's
    lifetime peak and the "added" figures are lower bounds of nothing useful.
    """
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


#: The kernel's free page reporting (virtio-balloon, CONFIG_PAGE_REPORTING): free blocks of this order and up
#: are handed back to the host, and the guest's next use of such a page faults it in again from the host.
PAGE_REPORTING_ORDER = "/sys/module/page_reporting/parameters/page_reporting_order"
#: An order no free block reaches (the buddy allocator's largest is 10): nothing is reported.
_NO_REPORTING_ORDER = "11"


def meminfo_bytes(field: str) -> int:
    """A ``/proc/meminfo`` field (``MemTotal``, ``MemAvailable``) in bytes; 0 where it cannot be read."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def _touch_free_memory(reserve: int = 2 * GIB) -> int:
    """Write every byte of all but ``reserve`` of the available memory, then free it. Returns the bytes.

    A page the host took back is faulted in again at its first write (about
    2 s per GiB on the machine the published runs come from, against 0.3 s
    for a page the guest kept); touching it once here moves that cost out of
    every measurement.
    """
    chunks, total = [], max(0, meminfo_bytes("MemAvailable") - reserve)
    try:
        for _ in range(total // GIB):
            m = mmap.mmap(-1, GIB)
            ctypes.memset(ctypes.addressof(ctypes.c_char.from_buffer(m)), 1, GIB)
            chunks.append(m)
    finally:
        for m in chunks:
            m.close()
    return len(chunks) * GIB


@contextlib.contextmanager
def host_memory_kept(enabled: bool = True) -> Iterator[str]:
    """Keep the memory a run frees in this machine: free page reporting off, every free page touched once.

    Yields one line saying what was done, for the results. On a virtual
    machine with free page reporting (a virtio balloon), every page the
    kernel frees (page cache of a removed checkpoint, a staging copy, a
    snapshot) goes back to the host, and whichever save next allocates it
    pays a fault from the host: a 1 GiB save that takes 0.45 s took 2.0-2.3 s
    when it followed DCP's default staging, which frees 1 GiB every save.
    That is the host's cost, not the code's, and it lands on whichever
    implementation comes next. The setting is put back at exit (root only;
    elsewhere nothing changes and the line says so). ``enabled=False`` (the
    ``--quick`` runs of the tests) changes nothing.
    """
    if not enabled:
        yield "host memory settings left as they are"
        return
    try:
        with open(PAGE_REPORTING_ORDER) as f:
            before = f.read().strip()
    except OSError:
        yield "no free page reporting in this kernel"
        return
    try:
        with open(PAGE_REPORTING_ORDER, "w") as f:
            f.write(_NO_REPORTING_ORDER)
    except OSError as e:
        yield f"free page reporting left on (order {before}: {e.strerror or e}); saves may fault pages in from the host"
        return
    try:
        t0 = time.perf_counter()
        touched = _touch_free_memory()
        yield (
            f"free page reporting off for the run (order {before} -> {_NO_REPORTING_ORDER}), "
            f"{touched / GIB:.0f} GiB of free memory touched first in {time.perf_counter() - t0:.0f} s"
        )
    finally:
        with open(PAGE_REPORTING_ORDER, "w") as f:
            f.write(before)


# --- page cache and durability ------------------------------------------------------


def drop_page_cache() -> tuple[bool, str]:
    """``sync; echo 3 > /proc/sys/vm/drop_caches``. Returns (done, why not)."""
    os.sync()
    try:
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
        return True, ""
    except OSError as e:
        return False, f"{type(e).__name__}: {e.strerror or e}"


def fsync_path(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_tree(root: str) -> None:
    """fsync every file and directory under ``root`` (then ``root`` itself)."""
    for dirpath, _dirs, files in os.walk(root, topdown=False):
        for name in files:
            fsync_path(os.path.join(dirpath, name))
        fsync_path(dirpath)


def _sync_file_range():
    """glibc's ``sync_file_range`` through ctypes (Python's ``os`` has no binding), or None."""
    try:
        fn = ctypes.CDLL(None, use_errno=True).sync_file_range
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint]
    fn.restype = ctypes.c_int
    return fn


_SYNC_FILE_RANGE = _sync_file_range()
_SYNC_FILE_RANGE_WRITE = 2  # <linux/fs.h>: start writeback of the range's dirty pages, do not wait


def start_writeback(fd: int, offset: int, nbytes: int) -> bool:
    """Start writing ``nbytes`` at ``offset`` of ``fd`` back to disk now, without waiting for it.

    ``sync_file_range(fd, offset, nbytes, SYNC_FILE_RANGE_WRITE)``: the disk
    starts on a block as soon as it is in the page cache, instead of when the
    final fsync asks for everything at once (below the dirty thresholds the
    kernel would otherwise wait up to 30 s). Not a durability guarantee by
    itself: the fsync still follows. Returns False where it is not available
    (not Linux, or a file system that refuses it); the fsync then does all the work.
    """
    if _SYNC_FILE_RANGE is None:
        return False
    return _SYNC_FILE_RANGE(fd, offset, nbytes, _SYNC_FILE_RANGE_WRITE) == 0


def write_random_file(path: str, nbytes: int, seed: int, chunk: int = 16 * MIB) -> None:
    """Write ``nbytes`` of pseudo-random bytes to ``path`` and fsync it (an incompressible source)."""
    import numpy as np

    rng = np.random.default_rng(seed)
    with open(path, "wb") as f:
        left = nbytes
        while left > 0:
            n = min(chunk, left)
            f.write(rng.bytes(n))
            left -= n
        f.flush()
        os.fsync(f.fileno())


def cycle_page_cache(path: str, nbytes: int, chunk: int = 16 * MIB) -> None:
    """Write ``nbytes`` to ``path``, fsync it and remove it: the page cache pages it used are free again.

    On this project's virtual machine the first write into memory the system has not used for a
    while (after a cache drop, or at a job's start) waits for the host to back each page: a 1 GiB
    save took 6-8 s instead of 2-3 s in the first timed save of a job, whichever implementation
    ran first. Cycling as many bytes through the page cache before the timed saves moves that
    cost out of them.
    """
    block = b"\xa5" * min(chunk, max(nbytes, 1))
    with open(path, "wb") as f:
        left = nbytes
        while left > 0:
            left -= f.write(block[: min(len(block), left)])
        f.flush()
        os.fsync(f.fileno())
    os.unlink(path)


def warm_file(path: str, chunk: int = 16 * MIB) -> int:
    """Read ``path`` once so its pages are in the page cache; returns the bytes read."""
    buf = bytearray(chunk)
    total = 0
    with open(path, "rb", buffering=0) as f:
        while n := f.readinto(buf):
            total += n
    return total


def remove(path: str) -> None:
    if os.path.isdir(path) and not os.path.islink(path):
        shutil.rmtree(path, ignore_errors=True)
    elif os.path.lexists(path):
        os.unlink(path)


# --- the code under test ----------------------------------------------------------------


def source_files(tddist_dir: Path, bench_dir: Path) -> dict[str, str]:
    """Every ``.py`` file of the tddist package and of the benchmarks, ``"tddist/api.py"`` style path ->
    the first 16 hex digits of its sha256. A results table holds numbers of exactly this code."""
    out = {}
    for top, name in ((tddist_dir, "tddist"), (bench_dir, "benchmarks")):
        for f in sorted(Path(top).rglob("*.py")):
            if "__pycache__" not in f.parts:
                out[f"{name}/{f.relative_to(top).as_posix()}"] = hashlib.sha256(f.read_bytes()).hexdigest()[:16]
    return out


def source_digest(files: dict[str, str]) -> str:
    """One digest of ``source_files``: 16 hex digits that change when any file is added, removed or edited."""
    h = hashlib.sha256()
    for path in sorted(files):
        h.update(f"{path}\0{files[path]}\n".encode())
    return h.hexdigest()[:16]


def changed_files(then: dict[str, str], now: dict[str, str]) -> list[str]:
    """The files that differ between two ``source_files`` results, each marked (changed, new, removed)."""
    out = []
    for path in sorted(set(then) | set(now)):
        if path not in now:
            out.append(f"{path} (removed)")
        elif path not in then:
            out.append(f"{path} (new)")
        elif then[path] != now[path]:
            out.append(f"{path} (changed)")
    return out


# --- machine facts --------------------------------------------------------------------


def filesystem_of(path: str) -> dict:
    """Mount point, type, device and options of the file system holding ``path``."""
    real = os.path.realpath(path)
    best = {"mountpoint": "?", "type": "?", "device": "?", "options": ""}
    best_len = -1
    try:
        with open("/proc/mounts") as f:
            for line in f:
                dev, mnt, fstype, opts, *_ = line.split()
                mnt = mnt.replace("\\040", " ")
                inside = real == mnt or real.startswith(mnt.rstrip("/") + "/")
                if inside and len(mnt) > best_len:
                    best = {"mountpoint": mnt, "type": fstype, "device": dev, "options": opts}
                    best_len = len(mnt)
    except OSError:
        pass
    return best


def machine_info(path: str) -> dict:
    mem = meminfo_bytes("MemTotal")
    fs = filesystem_of(path)
    return {
        "cpus": os.cpu_count(),
        "memory_gib": round(mem / GIB, 1),
        "kernel": platform.release(),
        "python": platform.python_version(),
        "filesystem": fs["type"],
        "filesystem_device": fs["device"],
        "load_average_at_start": list(os.getloadavg()),
    }


# --- statistics ---------------------------------------------------------------------------


def summarize(samples: list[float]) -> dict:
    return {
        "median": statistics.median(samples),
        "min": min(samples),
        "max": max(samples),
        "n": len(samples),
    }


def fmt_seconds(s: float | None) -> str:
    if s is None:
        return "-"
    if s < 1e-3:
        return f"{s * 1e6:.0f} us"
    if s < 1.0:
        return f"{s * 1e3:.1f} ms"
    return f"{s:.2f} s"
