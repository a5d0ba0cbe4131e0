"""Finding and reading the manifest of a checkpoint, a directory or an archive, without torch.

Reading a manifest needs only the standard library (``json``, ``zipfile``), so
the ``tddist`` command can list and describe checkpoints without importing
torch. The bytes are untrusted: ``parse_manifest`` validates them.
"""

from __future__ import annotations

import os
import stat
import zipfile
from typing import Any

from . import format as fmt
from . import manifest_v1, manifest_v2
from .errors import CheckpointNotFoundError, CorruptCheckpointError, ManifestError
from .manifest import Manifest, Parser, check_keys, parse_header, parse_objects


def read_manifest(path: str) -> Manifest:
    """Read and validate the manifest of the committed checkpoint (directory or archive) at ``path``.

    Args:
        path: a checkpoint directory or a ``.tdz`` archive.

    Returns:
        The validated manifest; no tensor data is read.

    Raises:
        CheckpointNotFoundError: nothing committed is at ``path``.
        ManifestError: the manifest is not valid JSON or fails validation.
        CorruptCheckpointError: an archive that is not a readable zip file.
    """
    path = os.fspath(path)
    archive = os.path.isfile(path)
    raw, index, where = _archive_manifest(path) if archive else _directory_manifest(path)
    try:
        obj = fmt.loads(raw)
    except (ValueError, UnicodeDecodeError) as e:
        raise ManifestError(f"{where} is not valid JSON ({e}); the checkpoint is damaged") from None
    except RecursionError:
        raise ManifestError(f"{where} is JSON nested too deeply to be a tddist manifest; refusing it") from None
    m = parse_manifest(obj, where=where, index=index)
    if archive and m.layout != "archive":
        raise ManifestError(
            f"{where} declares layout {m.layout!r}, but the checkpoint is an archive; it was tampered with"
        )
    return m  # a directory may hold an extracted archive: the tree is the same


#: The largest manifest and index tddist reads (a version-1 manifest of 4,096 ranks x 1,000 leaves
#: is about 150 MiB; version 2 keeps the JSON small and the index at 16 bytes per chunk).
MAX_MANIFEST_BYTES = 1 << 30
MAX_INDEX_BYTES = 16 << 30


def _read_regular(path: str, limit: int, what: str) -> bytes | None:
    """The bytes of the regular file ``path`` (None if it does not exist), read with one bounded read.

    A FIFO, a device, a directory or a symbolic link is refused before it is
    opened for reading (a FIFO would block, ``/dev/zero`` never ends), as is
    a file larger than ``limit``.
    """
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return None
    if not stat.S_ISREG(st.st_mode):
        kind = "a symbolic link" if stat.S_ISLNK(st.st_mode) else "not a regular file"
        raise ManifestError(f"{what} {path!r} is {kind}; the checkpoint is damaged or was tampered with")
    if st.st_size > limit:
        raise ManifestError(f"{what} {path!r} has {st.st_size} bytes, more than tddist reads ({limit}); refusing it")
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    try:
        data = os.read(fd, st.st_size + 1) if st.st_size < (1 << 31) - 1 else _read_all(fd, st.st_size + 1)
    finally:
        os.close(fd)
    if len(data) != st.st_size:
        raise ManifestError(f"{what} {path!r} changed size while it was read; retry")
    return data


def _read_all(fd: int, n: int) -> bytes:
    parts, got = [], 0
    while got < n:
        chunk = os.read(fd, min(n - got, 1 << 30))
        if not chunk:
            break
        parts.append(chunk)
        got += len(chunk)
    return b"".join(parts)


def _directory_manifest(path: str) -> tuple[bytes, bytes | None, str]:
    manifest = os.path.join(path, fmt.MANIFEST_NAME)
    try:
        raw = _read_regular(manifest, MAX_MANIFEST_BYTES, "manifest")
    except NotADirectoryError:
        raw = None
    if raw is None:
        side = fmt.side_entries(path)
        hint = (
            f"; leftovers of an interrupted save exist beside it ({len(side)}), run tddist.recover({path!r})"
            if side
            else ""
        )
        what = (
            "does not exist"
            if not os.path.exists(path)
            else "has no manifest (it is not a committed tddist checkpoint)"
        )
        raise CheckpointNotFoundError(f"checkpoint {path!r} {what}{hint}")
    index = _read_regular(os.path.join(path, fmt.INDEX_NAME), MAX_INDEX_BYTES, "index")
    return raw, index, f"manifest {manifest!r}"  # no index: version 1 (a version-2 manifest without one is refused)


def _archive_manifest(path: str) -> tuple[bytes, bytes | None, str]:
    if not zipfile.is_zipfile(path):
        raise CheckpointNotFoundError(
            f"{path!r} is a file but not a tddist archive; pass a checkpoint directory or a .tdz archive"
        )
    try:
        with zipfile.ZipFile(path) as zf:
            infos = {zi.filename: zi for zi in zf.infolist()}
            found = fmt.MANIFEST_NAME in infos
            raw = _read_entry(zf, infos[fmt.MANIFEST_NAME], MAX_MANIFEST_BYTES, path) if found else b""
            index = _read_entry(zf, infos[fmt.INDEX_NAME], MAX_INDEX_BYTES, path) if fmt.INDEX_NAME in infos else None
    except (zipfile.BadZipFile, OSError, ValueError, EOFError) as e:
        raise CorruptCheckpointError(
            f"{path!r} is not a readable zip archive ({e}); the checkpoint is damaged"
        ) from None
    if not found:
        raise CheckpointNotFoundError(
            f"archive {path!r} has no {fmt.MANIFEST_NAME} entry; it is not a tddist checkpoint"
        )
    return raw, index, f"manifest of archive {path!r}"


def _read_entry(zf: zipfile.ZipFile, zi: zipfile.ZipInfo, limit: int, path: str) -> bytes:
    """A manifest or index entry: stored (never compressed, as the format requires) and bounded."""
    if zi.compress_type != zipfile.ZIP_STORED:
        raise ManifestError(
            f"archive {path!r}: entry {zi.filename!r} is compressed (method {zi.compress_type}); the format stores "
            f"it uncompressed, so the archive was not written by tddist or was tampered with"
        )
    if zi.file_size > limit or zi.compress_size != zi.file_size:
        raise ManifestError(f"archive {path!r}: entry {zi.filename!r} declares {zi.file_size} bytes; refusing it")
    return zf.read(zi)


def parse_manifest(obj: Any, where: str = "manifest", index: bytes | None = None) -> Manifest:
    """Build a Manifest from parsed JSON (and, from version 2 on, the index bytes), validating everything.

    Args:
        obj: The parsed ``tddist.json``.
        where: How to name the file in error messages.
        index: The bytes of ``tddist.idx`` (version 2).

    Returns:
        The validated manifest, whatever its version.

    Raises:
        ManifestError: anything malformed, inconsistent, or of a newer version.
    """
    p = Parser(where)
    m = parse_header(p, obj)
    if m.version == 1:
        manifest_v1.parse_body(p, obj, m)
    else:
        manifest_v2.parse_body(p, obj, m, index)
    parse_objects(p, obj, m)
    check_keys(p, m)
    return m
