"""A checkpoint opened once, so that one load reads one generation whole.

An overwrite replaces a checkpoint with a rename (``RENAME_EXCHANGE`` swaps
the directory entries, then the old tree is removed). A reader that opened
files by path could read the manifest of one generation and the data of the
next. Here the checkpoint directory, or the archive file, is opened once;
the manifest, the index and every data file are then opened relative to that
descriptor (``dir_fd``), one path component at a time without following
symbolic links, so they all belong to the inode that was at the path when
the load began, whatever renames happen meanwhile. A file stays readable
once opened, even after it is unlinked; a file that the removal of the old
generation unlinked before it could be opened is reported as
``CheckpointChangedError`` (retry the load), never as corruption.

Linux only, as the commit is: a mapped file is reopened through
``/proc/self/fd`` because ``torch.from_file`` and ``zipfile`` take a path.
"""

from __future__ import annotations

import errno
import fcntl
import logging
import os
import stat
import struct
import time
import zipfile
import zlib
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

from .. import format as fmt
from ..errors import (
    CheckpointChangedError,
    CheckpointNotFoundError,
    CorruptCheckpointError,
    ManifestError,
    StorageError,
    TddistError,
)
from ..manifest.parse import check_manifest_size, paused_gc
from .opened import ManifestBytes

_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_FILE_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC  # a FIFO must not block the open

logger = logging.getLogger(__name__)

#: The longest a save waits, before removing the checkpoint it replaced, for another save that is still
#: reading that checkpoint back (``PinnedCheckpoint.hold_off_removal``); reading back maps files: milliseconds.
READERS_GRACE = 10.0


class PinnedCheckpoint:
    """The descriptor of a checkpoint directory or archive, opened once; files inside are opened through it.

    Use as a context manager (or call ``close``). The descriptor only pins
    what a reader sees; it locks nothing, so writers are never delayed, except
    for a save reading back what it committed: ``hold_off_removal`` then
    keeps a concurrent save from removing it (``wait_for_readers``) until it
    is closed.

    ``opened_as``: open this path instead (a save's staging entry, which
    becomes ``path`` when it is published); ``path`` names it in messages.
    """

    def __init__(self, path: str, opened_as: str | None = None) -> None:
        self.path = path
        self.fd = -1
        #: an archive's central directory, as ``open_local`` read it (``ArchiveFiles`` validates it)
        self.zip_entries: list[zipfile.ZipInfo] | None = None
        try:
            # the checkpoint path itself may be a symbolic link (a "latest" link, say); what is inside may not
            self.fd = os.open(opened_as or path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
        except FileNotFoundError:
            raise CheckpointNotFoundError(f"checkpoint {path!r} does not exist") from None
        except NotADirectoryError:
            raise CheckpointNotFoundError(f"checkpoint {path!r} does not exist (a parent is not a directory)") from None
        except OSError as e:
            raise storage_failed(path, e) from e
        st = os.fstat(self.fd)
        self.inode = (st.st_dev, st.st_ino)
        self.archive = stat.S_ISREG(st.st_mode)
        if not (self.archive or stat.S_ISDIR(st.st_mode)):
            self.close()  # once: ``__del__`` closes it again otherwise, maybe another file's descriptor by then
            raise CheckpointNotFoundError(
                f"{path!r} is neither a directory nor a regular file, so it is not a tddist checkpoint; pass a "
                f"checkpoint directory or a .tdz archive"
            )

    def hold_off_removal(self) -> bool:
        """Take a shared lock on the pinned directory or archive, so that a save that replaces it waits for
        this reader before removing it (``wait_for_readers``); released by ``close``. False where the file
        system has no ``flock`` (the reader then relies on its pin alone)."""
        try:
            fcntl.flock(self.fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
            return True
        except OSError as e:
            logger.debug("%s: no shared lock (%s); a concurrent save may remove it while it is read", self.path, e)
            return False

    def read_at(self, offset: int, n: int) -> bytes:
        """``n`` bytes of the pinned archive from ``offset`` (fewer at its end)."""
        return read_exactly(self.fd, n, offset)

    @property
    def fd_path(self) -> str:
        """A path that opens the pinned directory or archive itself, whatever is at ``path`` now."""
        return f"/proc/self/fd/{self.fd}"

    def read_regular(self, relpath: str, what: str, size: int | None = None) -> bytes | None:
        """The bytes of the regular file ``relpath`` inside (None if absent), its size checked before it is read.

        A FIFO, a device, a directory or a symbolic link is refused (a FIFO
        would block, ``/dev/zero`` never ends). ``size``: the size the file
        must have (the index: what its manifest implies), else the manifest's
        bound (``check_manifest_size``); exactly that many bytes are read.
        """
        shown = os.path.join(self.path, relpath)
        try:
            fd = self.open_file(relpath)
        except CorruptCheckpointError as e:
            raise ManifestError(f"{what} {shown!r}: {e}") from None
        if fd is None:
            return None
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                raise ManifestError(
                    f"{what} {shown!r} is not a regular file; the checkpoint is damaged or was tampered with"
                )
            if size is None:
                check_manifest_size(st.st_size, f"{what} {shown!r}")
            elif st.st_size != size:
                raise ManifestError(
                    f"{what} {shown!r} has {st.st_size} bytes, its manifest implies {size}; the checkpoint is "
                    f"damaged or was tampered with (restore it from a copy)"
                )
            data = read_exactly(fd, st.st_size)
        except OSError as e:
            raise storage_failed(shown, e) from e
        finally:
            os.close(fd)
        if len(data) != st.st_size:
            raise ManifestError(f"{what} {shown!r} changed size while it was read; retry")
        return data

    def open_file(self, relpath: str) -> int | None:
        """A read-only descriptor of ``relpath`` inside the pinned directory, or None if it does not exist.

        Raises:
            CorruptCheckpointError: the name leaves the directory, or a component is a symbolic link.
        """
        parts = relpath.split("/")
        if any(p in ("", ".", "..") for p in parts) or "\0" in relpath:
            raise CorruptCheckpointError(f"{relpath!r} is not a plain relative name inside the checkpoint; refusing it")
        fds = []
        try:
            parent = self.fd
            for part in parts[:-1]:
                parent = os.open(part, _DIR_FLAGS, dir_fd=parent)
                fds.append(parent)
            return os.open(parts[-1], _FILE_FLAGS, dir_fd=parent)
        except FileNotFoundError:
            return None
        except OSError as e:
            if e.errno in (errno.ELOOP, errno.ENOTDIR):
                raise CorruptCheckpointError(
                    f"{relpath!r} is a symbolic link or passes through one (it could lead outside the checkpoint), not a "
                    f"regular file inside it; "
                    f"refusing it"
                ) from None
            raise storage_failed(os.path.join(self.path, relpath), e) from e
        finally:
            for fd in fds:
                os.close(fd)

    def replaced(self) -> bool:
        """Whether ``path`` names another directory or file now (an overwrite committed meanwhile), or nothing."""
        try:
            st = os.stat(self.path)
        except OSError:
            return True
        return (st.st_dev, st.st_ino) != self.inode

    def missing(self, relpath: str, what: str) -> Exception:
        """The error for a file the manifest names but the pinned directory lacks: changed, or damaged."""
        if self.replaced():
            return CheckpointChangedError(
                f"checkpoint {self.path!r} was replaced while it was being read ({what} of the old one is gone); "
                f"load it again"
            )
        return CorruptCheckpointError(
            f"{what} {os.path.join(self.path, relpath)!r} is missing; the checkpoint is damaged"
        )

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1

    def __del__(self) -> None:
        self.close()

    def __enter__(self) -> PinnedCheckpoint:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def storage_failed(path: str, e: OSError) -> StorageError:
    """The error for an I/O failure reading ``path`` of a checkpoint: the storage failed, not the checkpoint."""
    return StorageError(
        f"reading {path!r} failed: {e.strerror or e} (errno {e.errno}); the storage failed, which does not mean the "
        f"checkpoint is damaged: check the file system (its mount, the kernel log, permissions) and load it again "
        f"once it is readable"
    )


def read_exactly(fd: int, n: int, offset: int = 0) -> bytes:
    """``n`` bytes of ``fd`` from ``offset`` (fewer only at the end of the file), never more: ``os.pread``
    returns at most 2 GiB at once."""
    parts, got = [], 0
    while got < n:
        chunk = os.pread(fd, min(n - got, 1 << 30), offset + got)
        if not chunk:
            break
        parts.append(chunk)
        got += len(chunk)
    return b"".join(parts)


def wait_for_readers(path: str, limit: float = READERS_GRACE) -> None:
    """Before ``path`` (a replaced checkpoint) is removed: wait until no save holds it for reading back
    (an exclusive ``flock`` over their shared ones), at most ``limit`` seconds. Never raises: the removal
    goes on anyway, and a reader still there sees ``CheckpointChangedError``."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError:
        return  # gone already, or not openable: nothing to wait for
    try:
        deadline = time.monotonic() + limit
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                return
            except BlockingIOError:
                if time.monotonic() > deadline:
                    logger.warning("%s is still being read back after %.0f s; removing it anyway", path, limit)
                    return
                time.sleep(0.005)
            except OSError:
                return  # no flock on this file system
    finally:
        os.close(fd)


def pin_and_read(pin: PinnedCheckpoint) -> ManifestBytes:
    """The manifest and index bytes of the checkpoint ``pin`` holds (not validated here); closes it if it fails."""
    try:
        return _archive_manifest(pin) if pin.archive else _directory_manifest(pin)
    except BaseException:
        pin.close()
        raise


#: A zip local file header (signature, version, flags, method, time, date, CRC-32, sizes, name and extra lengths).
_LOCAL = struct.Struct("<4s5H3I2H")


def read_stored_entry(read_at: Callable[[int, int], bytes], zi: zipfile.ZipInfo, size: int, where: str) -> bytes:
    """Exactly ``size`` bytes of the stored archive entry ``zi``, its declared sizes checked first.

    ``read_at(offset, n)`` reads ``n`` bytes of the archive (a file, or an
    object by ranged GETs). The manifest and the index are stored entries
    (never compressed); one that declares another size than expected is
    refused before any of it is read, and the bytes read are checked
    against the local header and the CRC-32, as ``zipfile`` would.

    Raises:
        ManifestError: the entry is compressed, or declares another size.
        CorruptCheckpointError: its local header or its bytes are damaged.
    """
    name = zi.filename
    if zi.compress_type != zipfile.ZIP_STORED:
        raise ManifestError(
            f"{where}: entry {name!r} is compressed (method {zi.compress_type}); the format stores it "
            f"uncompressed, so the archive was not written by tddist or was tampered with"
        )
    if zi.file_size != size or zi.compress_size != size:
        raise ManifestError(
            f"{where}: entry {name!r} declares {zi.file_size} bytes ({zi.compress_size} stored), its manifest "
            f"implies {size}; the archive is damaged or was tampered with: refusing it"
        )
    encoded = name.encode("utf-8" if zi.flag_bits & 0x800 else "cp437", "replace")
    head = read_at(zi.header_offset, _LOCAL.size + len(encoded))
    if len(head) != _LOCAL.size + len(encoded) or head[:4] != b"PK\x03\x04" or head[_LOCAL.size :] != encoded:
        raise CorruptCheckpointError(f"{where}: entry {name!r} has a bad local header; the checkpoint is damaged")
    *_fields, name_len, extra_len = _LOCAL.unpack(head[: _LOCAL.size])
    if name_len != len(encoded):
        raise CorruptCheckpointError(f"{where}: entry {name!r} has a bad local header; the checkpoint is damaged")
    start = zi.header_offset + _LOCAL.size
    data = read_at(start + name_len + extra_len, size) if size else b""
    if len(data) != size or zlib.crc32(data) != zi.CRC:
        raise CorruptCheckpointError(
            f"{where}: entry {name!r} is truncated or fails its CRC-32; the checkpoint is damaged"
        )
    return data


def open_local(path: str) -> ManifestBytes:
    """Pin the committed directory or archive at ``path`` and read its manifest and index (not validated here).

    Raises:
        CheckpointNotFoundError: nothing committed is at ``path``.
        ManifestError: the manifest or index is not a bounded regular file or stored entry.
        CorruptCheckpointError: an archive that is not a readable zip file.
    """
    try:
        pin = PinnedCheckpoint(path)
    except CheckpointNotFoundError:
        if os.path.lexists(path):  # a FIFO, a device: the pin's own message says what it is
            raise
        raise _not_found(path, "does not exist") from None
    return pin_and_read(pin)


def _not_found(path: str, what: str) -> CheckpointNotFoundError:
    side = fmt.side_entries(path)
    hint = (
        f"; leftovers of an interrupted save exist beside it ({len(side)}), run tddist.recover({path!r})"
        if side
        else ""
    )
    return CheckpointNotFoundError(f"checkpoint {path!r} {what}{hint}")


def _directory_manifest(pin: PinnedCheckpoint) -> ManifestBytes:
    manifest = os.path.join(pin.path, fmt.MANIFEST_NAME)
    raw = pin.read_regular(fmt.MANIFEST_NAME, "manifest")
    if raw is None:
        if pin.replaced():  # the old generation's tree was removed between the open and this read
            raise pin.missing(fmt.MANIFEST_NAME, "the manifest")
        raise _not_found(pin.path, "has no manifest (it is not a committed tddist checkpoint)")
    return ManifestBytes(pin, raw, _DirectoryIndex(pin), f"manifest {manifest!r}")


@dataclass(frozen=True)
class _DirectoryIndex:
    """``tddist.idx`` of a pinned directory (an ``IndexSource``): its size checked, then exactly that many bytes."""

    pin: PinnedCheckpoint

    def read_index(self, size: int) -> bytes | None:
        index = self.pin.read_regular(fmt.INDEX_NAME, "index", size)
        if index is None and self.pin.replaced():
            raise self.pin.missing(fmt.INDEX_NAME, "the index")
        return index  # None: the parser refuses a version-2 manifest without one


def _archive_manifest(pin: PinnedCheckpoint) -> ManifestBytes:
    path = pin.path
    try:
        os.pread(pin.fd, 4, 0)  # is_zipfile would call a file it cannot read "not a zip file"
    except OSError as e:
        raise storage_failed(path, e) from e
    if not zipfile.is_zipfile(pin.fd_path):
        raise CheckpointNotFoundError(
            f"{path!r} is a file but not a tddist archive; pass a checkpoint directory or a .tdz archive"
        )
    with _zip_errors(path):
        with paused_gc(), zipfile.ZipFile(pin.fd_path) as zf:
            pin.zip_entries = zf.infolist()
            infos = {zi.filename: zi for zi in pin.zip_entries}
        found = infos.get(fmt.MANIFEST_NAME)
        if found is None:
            raise CheckpointNotFoundError(
                f"archive {path!r} has no {fmt.MANIFEST_NAME} entry; it is not a tddist checkpoint"
            )
        check_manifest_size(found.file_size, f"archive {path!r}: entry {found.filename!r}")
        raw = read_stored_entry(pin.read_at, found, found.file_size, f"archive {path!r}")
    return ManifestBytes(pin, raw, _ArchiveIndex(pin, infos.get(fmt.INDEX_NAME)), f"manifest of archive {path!r}")


@dataclass(frozen=True)
class _ArchiveIndex:
    """The ``tddist.idx`` entry of a pinned archive (an ``IndexSource``): its declared sizes first."""

    pin: PinnedCheckpoint
    entry: zipfile.ZipInfo | None

    def read_index(self, size: int) -> bytes | None:
        if self.entry is None:
            return None
        with _zip_errors(self.pin.path):
            return read_stored_entry(self.pin.read_at, self.entry, size, f"archive {self.pin.path!r}")


@contextmanager
def _zip_errors(path: str) -> Iterator[None]:
    """What reading an archive's records raises, as tddist's errors: a damaged archive, or the storage failing."""
    try:
        yield
    except TddistError:  # CheckpointNotFoundError is an OSError too: it is no storage failure
        raise
    except OSError as e:
        if e.errno == errno.EINVAL:  # zipfile seeking to a negative offset that a damaged record gave it
            raise CorruptCheckpointError(
                f"{path!r} is not a readable zip archive (a record points outside the file: {e}); the checkpoint "
                f"is damaged"
            ) from None
        raise storage_failed(path, e) from e
    except (zipfile.BadZipFile, ValueError, EOFError, NotImplementedError) as e:  # NotImplemented: a zip version
        raise CorruptCheckpointError(
            f"{path!r} is not a readable zip archive ({e}); the checkpoint is damaged"
        ) from None
