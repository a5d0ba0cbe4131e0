"""The on-disk layout: names, version, key escaping, dtypes, JSON encoding.

This is the only module that knows file names. ``docs/format.md`` is the
public specification of what is written here; change both together.
"""

from __future__ import annotations

import base64
import hashlib
import json
import os
import pickle
import re
import uuid
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any, TypeGuard

from .errors import InvalidArgumentError, InvalidDataError, ManifestError

if TYPE_CHECKING:
    import torch

FORMAT_NAME = "tddist"
#: The version tddist writes; every earlier one stays readable (docs/format.md, section 10).
FORMAT_VERSION = 4
MANIFEST_NAME = "tddist.json"
#: Version 2: the per-rank columns of the manifest (rows, checksums, boxes), binary.
INDEX_NAME = "tddist.idx"
#: Version 2, packing "packed": one data file per rank, its chunks at multiples of PACK_ALIGN.
DATA_SUFFIX = ".data"
PACK_ALIGN = 64
ARCHIVE_SUFFIX = ".tdz"
TD_META_NAME = "meta.json"
LEAF_SUFFIX = ".memmap"

#: Checksum of one file: xxh3-64 of each block of ``CHECKSUM_BLOCK`` bytes,
#: then xxh3-64 of the concatenated 8-byte big-endian block digests. Blocks let
#: several threads hash (and verify) one large file in parallel.
CHECKSUM_ALGORITHM = "xxh3-64-blocks"
CHECKSUM_BLOCK = 32 * 1024 * 1024

_STAGING_TAG = ".tddist-staging-"
_TRASH_TAG = ".tddist-trash-"
_BACKUP_TAG = ".tddist-backup-"
_PIN_TAG = ".tddist-pin-"
_PIN_RE = re.compile(r"^\.(?P<base>.+)\.tddist-pin-[0-9a-f]{32}$")
_DELETING_TAG = ".tddist-deleting-"
_SIDE_RE = re.compile(r"^\.(?P<base>.+)\.tddist-(?P<kind>staging|trash|backup)-(?P<uid>[0-9a-f]{32})$")

#: Top-level names of tensordict's meta.json; a key with one of these names
#: would clash with them, so ``save`` refuses it.
TD_META_RESERVED = frozenset({"shape", "device", "_type", "_format_version", "_class", "_names"})

# Same unsafe set as tensordict's memmap writer, so each rank directory stays
# loadable by ``TensorDict.load_memmap``. Kept here (not imported from
# tensordict's private module) because the layout is our public contract.
_UNSAFE = set('/<>:"|?*\\ \0%') | {chr(i) for i in range(32)} | {chr(127)}
_ENCODE_TABLE = str.maketrans({c: f"%{ord(c):02X}" for c in _UNSAFE})
_SAFE_VERBATIM_RE = re.compile(r'^[^/<>:"|?*\\\x00-\x1f\x7f%]+$')

#: The dtypes a checkpoint may hold: manifest name -> bytes per element. Kept as
#: names (not torch objects) so that reading and validating a manifest needs no torch.
_DTYPE_SIZES: dict[str, int] = {
    "float64": 8,
    "float32": 4,
    "float16": 2,
    "bfloat16": 2,
    "complex64": 8,
    "complex128": 16,
    "int64": 8,
    "int32": 4,
    "int16": 2,
    "int8": 1,
    "uint8": 1,
    "uint16": 2,
    "uint32": 4,
    "uint64": 8,
    "bool": 1,
    "float8_e4m3fn": 1,
    "float8_e5m2": 1,
}


def dtype_name(dtype: torch.dtype) -> str:
    """The manifest's name of a torch dtype (``torch.float32`` -> ``float32``); KeyError if not supported."""
    name = str(dtype).removeprefix("torch.")
    if name not in _DTYPE_SIZES:
        raise KeyError(name)
    return name


def is_dtype_name(name: object) -> TypeGuard[str]:
    """True if ``name`` is a dtype name a manifest may use."""
    return isinstance(name, str) and name in _DTYPE_SIZES


def dtype_itemsize(name: str) -> int:
    """Bytes per element of the dtype called ``name`` (KeyError if not supported)."""
    return _DTYPE_SIZES[name]


def torch_dtype(name: str) -> torch.dtype:
    """The torch dtype called ``name``; raises KeyError for anything not whitelisted (imports torch)."""
    import torch

    if name not in _DTYPE_SIZES:
        raise KeyError(name)
    dtype: torch.dtype = getattr(torch, name)
    return dtype


def encode_key(key: str, robust: bool = True) -> str:
    """File-name form of one key component (tensordict's percent-encoding)."""
    if not robust:
        return key
    if not key:
        return "%"
    if key in (".", ".."):
        return "%2E" * len(key)
    return key.translate(_ENCODE_TABLE)


def verbatim_key_problem(key: str) -> str | None:
    """Why ``key`` cannot be a file name verbatim (``robust_key=False``), or None."""
    if key in ("", ".", ".."):
        return f"{key!r} does not name a file"
    if not _SAFE_VERBATIM_RE.match(key):
        return f"{key!r} contains a character that is unsafe in a file name"
    if len(os.fsencode(key)) + len(LEAF_SUFFIX) > 255:
        return f"{key[:40]!r}... is too long for a file name"
    return None


def rank_dir(rank: int) -> str:
    """Name of the directory holding what ``rank`` wrote."""
    return f"rank-{rank:05d}"


_RANK_DIR_RE = re.compile(r"^rank-\d{5,}$")


_RANK_DATA_RE = re.compile(r"^rank-\d{5,}\.data$")


def rank_data_name(rank: int) -> str:
    """Name of the file holding every chunk ``rank`` wrote (packing "packed")."""
    return rank_dir(rank) + DATA_SUFFIX


def data_file_rank(name: str) -> int | None:
    """The rank whose packed data file ``name`` is (``rank-NNNNN.data``), or None for any other name."""
    return int(name[len("rank-") : -len(DATA_SUFFIX)]) if _RANK_DATA_RE.match(name) else None


def is_checkpoint_entry_name(name: str) -> bool:
    """True if ``name`` is something tddist writes at the top of a checkpoint directory."""
    return (
        name in (MANIFEST_NAME, INDEX_NAME)
        or _RANK_DIR_RE.match(name) is not None
        or _RANK_DATA_RE.match(name) is not None
    )


def node_relpath(rank: int, key: tuple[str, ...], robust: bool = True) -> str:
    """Relative path of the directory of the (sub-)TensorDict at ``key``."""
    return os.path.join(rank_dir(rank), *(encode_key(k, robust) for k in key))


def leaf_relpath(rank: int, key: tuple[str, ...], robust: bool = True) -> str:
    """Relative path of the file that holds ``rank``'s chunk of leaf ``key``."""
    *parents, name = key
    return os.path.join(node_relpath(rank, tuple(parents), robust), encode_key(name, robust) + LEAF_SUFFIX)


def td_meta(
    batch_size: Iterable[int],
    leaves: dict[str, tuple[list[int], str]],
    children: list[str],
    objects: dict[str, str] | None = None,
) -> dict[str, Any]:
    """The meta.json that ``TensorDict.load_memmap`` reads for one node."""
    meta: dict[str, Any] = {}
    for name, (shape, dtype) in leaves.items():
        meta[name] = {"device": "cpu", "shape": list(shape), "dtype": str(dtype), "is_nested": False}
    for name in children:
        meta[name] = {"type": "TensorDict"}
    for name, type_name in (objects or {}).items():
        meta[name] = {"type": type_name}
    meta.update(
        shape=list(batch_size),
        device="cpu",
        _type="<class 'tensordict._td.TensorDict'>",
        _format_version=1,
        _class="tensordict:TensorDict",
    )
    return meta


def encode_object(value: object, allow_pickle: bool, where: str) -> dict[str, Any]:
    """A non-tensor value as stored in the manifest: ``{"json": v}``, or ``{"pickle": base64}`` if allowed.

    A value is stored as JSON only if it comes back from JSON equal and of the
    same type (a tuple would come back a list, so it needs pickle).
    """
    try:
        if json.loads(json.dumps(value, allow_nan=False)) == value and _same_types(value):
            return {"json": value}
    except (TypeError, ValueError, RecursionError):
        pass
    if not allow_pickle:
        raise InvalidDataError(
            f"{where} holds a {type(value).__name__}, which JSON cannot represent exactly; convert it to JSON "
            f"types (str, int, float, bool, None, list, dict with str keys), or pass allow_pickle=True to save "
            f"and load it with pickle (never load pickled checkpoints from untrusted sources)"
        )
    return {"pickle": base64.b64encode(pickle.dumps(value, protocol=4)).decode("ascii")}


_JSON_SCALARS = frozenset((str, int, float, bool, type(None)))


def _same_types(value: object) -> bool:
    """Whether ``value`` holds only lists, dicts with str keys and JSON scalars (exact types). A list or a dict
    whose items are all scalars is checked in one pass in C (a param group's hundreds of parameter names)."""
    if isinstance(value, (list,)):
        return set(map(type, value)) <= _JSON_SCALARS or all(map(_same_types, value))
    if isinstance(value, dict):
        return all(type(k) is str for k in value) and (
            set(map(type, value.values())) <= _JSON_SCALARS or all(map(_same_types, value.values()))
        )
    return type(value) in _JSON_SCALARS


def decode_object(enc: object, allow_pickle: bool, where: str) -> Any:
    """Inverse of ``encode_object``; pickled values are refused unless ``allow_pickle``."""
    if isinstance(enc, dict) and len(enc) == 1 and "json" in enc:
        return enc["json"]
    if isinstance(enc, dict) and len(enc) == 1 and isinstance(enc.get("pickle"), str):
        if not allow_pickle:
            raise InvalidArgumentError(
                f"{where} was saved with pickle; loading it would execute code from the checkpoint. Pass "
                f"allow_pickle=True only if you trust where the checkpoint comes from"
            )
        try:
            return pickle.loads(base64.b64decode(enc["pickle"], validate=True))
        except Exception as e:  # binascii.Error, UnpicklingError, a missing class: whatever the bytes raise
            raise ManifestError(
                f"{where} cannot be unpickled ({type(e).__name__}: {str(e)[:200]}); the checkpoint is damaged, or "
                f"the value's class cannot be imported here"
            ) from None
    raise ManifestError(f"{where} has a malformed value {str(enc)[:80]!r}; the checkpoint is damaged")


def td_object_meta(kind: str, enc: Any) -> dict[str, Any] | None:
    """tensordict's meta.json of a NonTensorData ("data") or NonTensorStack ("stack") leaf,
    or None if its value is pickled (tensordict would need a pickle file)."""
    if kind == "stack":
        if not all("json" in e for e in enc):
            return None
        return {
            "_type": "<class 'tensordict.tensorclass.NonTensorStack'>",
            "_format_version": 1,
            "_class": "tensordict:NonTensorStack",
            "stack_dim": 0,
            "device": None,
            "data": [e["json"] for e in enc],
        }
    if "json" not in enc:
        return None
    return {
        "_type": "<class 'tensordict.tensorclass.NonTensorData'>",
        "data": enc["json"],
        "_metadata": None,
        "_is_non_tensor": True,
    }


def dumps(obj: object) -> bytes:
    """Compact JSON (no NaN, UTF-8) as written to disk."""
    return json.dumps(obj, separators=(",", ":"), ensure_ascii=False, allow_nan=False).encode("utf-8")


def loads(data: bytes | str) -> Any:
    """Parse JSON written by ``dumps``."""
    return json.loads(data)


# --- names beside the target -------------------------------------------------


def _side_name(target: str, tag: str, uid: str | None = None) -> str:
    parent, base = os.path.split(os.path.abspath(target))
    return os.path.join(parent, _entry_name(base, tag, uid))


def _entry_name(name: str, tag: str, uid: str | None = None) -> str:
    """``.<name><tag><32 hex digits>``: an entry beside the checkpoint ``name`` (section 7)."""
    return f".{name}{tag}{uid or uuid.uuid4().hex}"


def staging_path(target: str, seed: str | None = None) -> str:
    """A fresh staging name beside ``target``, on the same file system.

    With ``seed``, the name's 32 hex digits are a hash of it: every rank that
    knows the seed derives the same name without a message (the commit's
    one-round path); without, they are a random UUID.
    """
    uid = None if seed is None else hashlib.blake2b(seed.encode(), digest_size=16).hexdigest()
    return _side_name(target, _STAGING_TAG, uid)


def trash_path(target: str) -> str:
    """A fresh name for an old checkpoint being removed after a replace."""
    return _side_name(target, _TRASH_TAG)


def backup_path(target: str) -> str:
    """A fresh name for the old checkpoint while it is replaced without RENAME_EXCHANGE."""
    return _side_name(target, _BACKUP_TAG)


def side_entry_kind(name: str) -> tuple[str, str] | None:
    """(base name, kind) if ``name`` is a staging/trash/backup entry of some target, else None."""
    m = _SIDE_RE.match(name)
    return (m.group("base"), m.group("kind")) if m else None


def side_entries(target: str) -> list[tuple[str, str]]:
    """(kind, path) of every staging/trash/backup entry that belongs to ``target``."""
    parent, base = os.path.split(os.path.abspath(target))
    found: list[tuple[str, str]] = []
    try:
        names = os.listdir(parent)
    except FileNotFoundError:
        return []
    for name in names:
        m = _SIDE_RE.match(name)
        if m and m.group("base") == base:
            found.append((m.group("kind"), os.path.join(parent, name)))
    return sorted(found)


def holder_path(checkpoint: str, name: str) -> str:
    """Where the holder ``name`` of an incremental checkpoint lies: beside ``checkpoint`` (the same
    directory, or the same parent prefix of an ``s3://`` URL)."""
    if checkpoint.startswith("s3://"):
        return checkpoint.rstrip("/").rsplit("/", 1)[0] + "/" + name
    return os.path.join(os.path.dirname(os.path.abspath(checkpoint)), name)


def pin_path(target: str) -> str:
    """A fresh name for a pin of ``target`` (a file beside it): an incremental save in progress references it."""
    return _side_name(target, _PIN_TAG)


def pin_name(name: str) -> str:
    """A fresh name for a pin of the checkpoint ``name``, beside it (``.<name>.tddist-pin-<32 hex digits>``)."""
    return _entry_name(name, _PIN_TAG)


def pins_prefix(name: str) -> str:
    """What the name of every pin of the checkpoint ``name`` starts with."""
    return f".{name}{_PIN_TAG}"


def deletion_name(name: str) -> str:
    """A fresh name for the marker of a deletion of the checkpoint ``name`` on object storage
    (``.<name>.tddist-deleting-<32 hex digits>``, section 13.3)."""
    return _entry_name(name, _DELETING_TAG)


def deletions_prefix(name: str) -> str:
    """What the name of every deletion marker of the checkpoint ``name`` starts with."""
    return f".{name}{_DELETING_TAG}"


def pin_entries(target: str) -> list[str]:
    """The pins of ``target`` beside it."""
    parent, base = os.path.split(os.path.abspath(target))
    try:
        names = os.listdir(parent)
    except (FileNotFoundError, NotADirectoryError):
        return []
    return sorted(os.path.join(parent, n) for n in names if (m := _PIN_RE.match(n)) and m.group("base") == base)
