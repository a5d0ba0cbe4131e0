"""Finding and reading the manifest of a checkpoint, a directory or an archive, without torch.

Reading a manifest needs only the standard library (``json``, ``zipfile``), so
the ``tddist`` command can list and describe checkpoints without importing
torch. The bytes are untrusted: ``parse_manifest`` validates them.
"""

from __future__ import annotations

import os
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
    m = parse_manifest(obj, where=where, index=index)
    if archive and m.layout != "archive":
        raise ManifestError(
            f"{where} declares layout {m.layout!r}, but the checkpoint is an archive; it was tampered with"
        )
    return m  # a directory may hold an extracted archive: the tree is the same


def _directory_manifest(path: str) -> tuple[bytes, bytes | None, str]:
    manifest = os.path.join(path, fmt.MANIFEST_NAME)
    try:
        with open(manifest, "rb") as f:
            raw = f.read()
        index_path = os.path.join(path, fmt.INDEX_NAME)
        try:
            with open(index_path, "rb") as f:
                index = f.read()
        except FileNotFoundError:
            index = None  # version 1 has none; a version-2 manifest without one is refused
        except OSError as e:
            raise ManifestError(f"cannot read the index {index_path!r} ({e}); the checkpoint is damaged") from None
        return raw, index, f"manifest {manifest!r}"
    except (FileNotFoundError, NotADirectoryError):
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
        raise CheckpointNotFoundError(f"checkpoint {path!r} {what}{hint}") from None


def _archive_manifest(path: str) -> tuple[bytes, bytes | None, str]:
    if not zipfile.is_zipfile(path):
        raise CheckpointNotFoundError(
            f"{path!r} is a file but not a tddist archive; pass a checkpoint directory or a .tdz archive"
        )
    try:
        with zipfile.ZipFile(path) as zf:
            names = set(zf.namelist())
            found = fmt.MANIFEST_NAME in names
            raw = zf.read(fmt.MANIFEST_NAME) if found else b""
            index = zf.read(fmt.INDEX_NAME) if fmt.INDEX_NAME in names else None
    except (zipfile.BadZipFile, OSError, ValueError, EOFError) as e:
        raise CorruptCheckpointError(
            f"{path!r} is not a readable zip archive ({e}); the checkpoint is damaged"
        ) from None
    if not found:
        raise CheckpointNotFoundError(
            f"archive {path!r} has no {fmt.MANIFEST_NAME} entry; it is not a tddist checkpoint"
        )
    return raw, index, f"manifest of archive {path!r}"


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
