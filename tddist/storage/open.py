"""Finding and reading the manifest of a checkpoint, a directory or an archive, without torch.

Reading a manifest needs only the standard library (``json``, ``zipfile``), so
the ``tddist`` command can list and describe checkpoints without importing
torch. The bytes are untrusted: ``parse_manifest`` validates them.
"""

from __future__ import annotations

import errno
import os
import zipfile
from dataclasses import dataclass

from .. import format as fmt
from ..errors import CheckpointNotFoundError, CorruptCheckpointError, ManifestError
from ..manifest import checksum as manifest_checksum
from ..manifest.model import Manifest
from ..manifest.parse import MAX_INDEX_BYTES, MAX_MANIFEST_BYTES, parse_manifest
from .pinned import PinnedCheckpoint, storage_failed
from .s3.pin import S3Pin, open_s3
from .s3.url import is_s3


@dataclass(frozen=True)
class OpenedCheckpoint:
    """A committed checkpoint opened once: its validated manifest, its generation, and the pinned descriptor.

    Every file a load reads is opened through ``pin``, so manifest and data
    come from one generation even while an overwrite replaces the checkpoint.
    Close it (or use it as a context manager) when the data is mapped.
    """

    pin: PinnedCheckpoint | S3Pin  # S3Pin: a checkpoint on object storage (``s3.pin``)
    manifest: Manifest
    #: the manifest's checksum (version 3) or the hash of its bytes: equal generations hold equal data
    generation: str

    @property
    def path(self) -> str:
        return self.pin.path

    def close(self) -> None:
        self.pin.close()

    def __enter__(self) -> OpenedCheckpoint:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def open_checkpoint(path: str) -> OpenedCheckpoint:
    """Open the committed checkpoint (directory or archive) at ``path`` once and read its manifest.

    Raises:
        CheckpointNotFoundError: nothing committed is at ``path``.
        ManifestError: the manifest is not valid JSON, fails its checksum or its validation.
        CorruptCheckpointError: an archive that is not a readable zip file.
    """
    path = os.fspath(path)
    if is_s3(path):
        found = open_s3(path, MAX_MANIFEST_BYTES, MAX_INDEX_BYTES)
        return _opened(found.pin, found.raw, found.index, found.where)
    try:
        pin = PinnedCheckpoint(path)
    except CheckpointNotFoundError:
        raise _not_found(path, "does not exist") from None
    try:
        raw, index, where = _archive_manifest(pin) if pin.archive else _directory_manifest(pin)
        return _opened(pin, raw, index, where)
    except BaseException:
        pin.close()
        raise


def _opened(pin: PinnedCheckpoint | S3Pin, raw: bytes, index: bytes | None, where: str) -> OpenedCheckpoint:
    """Check the manifest's own checksum, parse and validate it (with its index)."""
    gen, sealed = manifest_checksum.generation(raw, where)
    try:
        obj = fmt.loads(raw)
    except (ValueError, UnicodeDecodeError) as e:
        raise ManifestError(f"{where} is not valid JSON ({e}); the checkpoint is damaged") from None
    except RecursionError:
        raise ManifestError(f"{where} is JSON nested too deeply to be a tddist manifest; refusing it") from None
    m = parse_manifest(obj, where=where, index=index)
    if m.version >= 3 and not sealed:
        raise ManifestError(f"{where} (format version {m.version}) lacks its manifest_checksum; it was tampered with")
    if pin.archive and m.layout != "archive":
        raise ManifestError(
            f"{where} declares layout {m.layout!r}, but the checkpoint is an archive; it was tampered with"
        )
    return OpenedCheckpoint(pin, m, gen)  # a directory may hold an extracted archive: the tree is the same


def read_manifest(path: str) -> Manifest:
    """Read and validate the manifest of the committed checkpoint (directory or archive) at ``path``.

    Args:
        path: a checkpoint directory or a ``.tdz`` archive.

    Returns:
        The validated manifest; no tensor data is read.

    Raises:
        CheckpointNotFoundError: nothing committed is at ``path``.
        ManifestError: the manifest is not valid JSON, fails its checksum or its validation.
        CorruptCheckpointError: an archive that is not a readable zip file.
    """
    with open_checkpoint(path) as opened:
        return opened.manifest


def _not_found(path: str, what: str) -> CheckpointNotFoundError:
    side = fmt.side_entries(path)
    hint = (
        f"; leftovers of an interrupted save exist beside it ({len(side)}), run tddist.recover({path!r})"
        if side
        else ""
    )
    return CheckpointNotFoundError(f"checkpoint {path!r} {what}{hint}")


def _directory_manifest(pin: PinnedCheckpoint) -> tuple[bytes, bytes | None, str]:
    manifest = os.path.join(pin.path, fmt.MANIFEST_NAME)
    raw = pin.read_regular(fmt.MANIFEST_NAME, MAX_MANIFEST_BYTES, "manifest")
    if raw is None:
        if pin.replaced():  # the old generation's tree was removed between the open and this read
            raise pin.missing(fmt.MANIFEST_NAME, "the manifest")
        raise _not_found(pin.path, "has no manifest (it is not a committed tddist checkpoint)")
    index = pin.read_regular(fmt.INDEX_NAME, MAX_INDEX_BYTES, "index")
    if index is None and pin.replaced():
        raise pin.missing(fmt.INDEX_NAME, "the index")
    return raw, index, f"manifest {manifest!r}"  # no index: version 1 (a version-2 manifest without one is refused)


def _archive_manifest(pin: PinnedCheckpoint) -> tuple[bytes, bytes | None, str]:
    path = pin.path
    try:
        os.pread(pin.fd, 4, 0)  # is_zipfile would call a file it cannot read "not a zip file"
    except OSError as e:
        raise storage_failed(path, e) from e
    if not zipfile.is_zipfile(pin.fd_path):
        raise CheckpointNotFoundError(
            f"{path!r} is a file but not a tddist archive; pass a checkpoint directory or a .tdz archive"
        )
    try:
        with zipfile.ZipFile(pin.fd_path) as zf:
            infos = {zi.filename: zi for zi in zf.infolist()}
            found = fmt.MANIFEST_NAME in infos
            raw = _read_entry(zf, infos[fmt.MANIFEST_NAME], MAX_MANIFEST_BYTES, path) if found else b""
            index = _read_entry(zf, infos[fmt.INDEX_NAME], MAX_INDEX_BYTES, path) if fmt.INDEX_NAME in infos else None
    except OSError as e:
        if e.errno == errno.EINVAL:  # zipfile seeking to a negative offset that a damaged record gave it
            raise CorruptCheckpointError(
                f"{path!r} is not a readable zip archive (a record points outside the file: {e}); the checkpoint "
                f"is damaged"
            ) from None
        raise storage_failed(path, e) from e
    except (
        zipfile.BadZipFile,
        ValueError,
        EOFError,
        NotImplementedError,
    ) as e:  # NotImplemented: a zip version
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
