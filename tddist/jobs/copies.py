"""Copies of a local part and their records: which files, of what size and checksum, replicated where.

A part (``local_tier``: one rank's one-rank checkpoint of a step) may exist
as its owner's own copy and as a replica on another node. Each committed copy
has a record beside it, ``<part>.copy.json``: the part's files with their
sizes and checksums (tddist's own, ``checksum.Hasher``), and for an own copy the rank and node that
confirmed its replica. A replica's record is written last, after its files
were fsynced and their checksums checked: a replica without one is not
complete and is never used. The record is JSON, checked field by field when
read; an invalid one counts as no record.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass

from .._fs import fsync_path, write_durable
from ..checksum import Hasher
from ..core.types import Key

#: What a copy's record is named after: ``<part>`` + this.
RECORD_SUFFIX = ".copy.json"
#: Bytes read at a time when hashing a file.
READ_BLOCK = 4 << 20


@dataclass(frozen=True, order=True)
class PartId:
    """One rank's part of a step: ``step-<step>/rank-<rank>-of-<world>``."""

    step: int
    rank: int
    world: int

    @property
    def name(self) -> str:
        """``rank-<rank>-of-<world>``."""
        return f"rank-{self.rank}-of-{self.world}"


@dataclass(frozen=True)
class FileSum:
    """One file of a copy: its path relative to the copy, its size and its checksum."""

    name: str
    size: int
    digest: str


@dataclass(frozen=True)
class LeafSpan:
    """A leaf stored whole as one chunk of a part: where its bytes lie, as the sender's manifest says.

    Attributes:
        name: the file (the part's data file).
        offset: where its bytes begin in the file.
        nbytes: how many.
        key: the leaf's key.
        dtype: its dtype's manifest name.
        shape: its shape.
    """

    name: str
    offset: int
    nbytes: int
    key: Key
    dtype: str
    shape: tuple[int, ...]


@dataclass(frozen=True)
class Shipment:
    """One copy of a part sent from ``src`` to ``dst``: its files with their sizes and checksums, and (a
    restore's) where its whole leaves lie in them (``direct``: the bounds its messages are cut at)."""

    src: int
    dst: int
    part: PartId
    files: tuple[FileSum, ...]
    spans: tuple[LeafSpan, ...] = ()

    @property
    def size(self) -> int:
        """Its bytes."""
        return sum(f.size for f in self.files)


@dataclass(frozen=True)
class CopyRecord:
    """The record of a committed copy (``<part>.copy.json``).

    Attributes:
        part: the part it is a copy of.
        files: its files, sorted by name.
        peer_rank: for an own copy, the rank that confirmed its replica (None: none yet).
        peer_node: that rank's node.
    """

    part: PartId
    files: tuple[FileSum, ...]
    peer_rank: int | None = None
    peer_node: str | None = None

    @property
    def size(self) -> int:
        """The bytes of all its files."""
        return sum(f.size for f in self.files)


def file_names(path: str) -> list[str]:
    """The files under the directory ``path``, relative to it, sorted."""
    out: list[str] = []
    for dirpath, _dirs, files in os.walk(path):
        out.extend(os.path.relpath(os.path.join(dirpath, f), path) for f in files)
    return sorted(out)


def digest_file(path: str) -> str:
    """The checksum of a file's bytes (``checksum.Hasher``: the one tddist's manifests record)."""
    h = Hasher()
    with open(path, "rb") as f:
        while block := f.read(READ_BLOCK):
            h.update(block)
    return h.hexdigest()


def digest_files(path: str) -> tuple[FileSum, ...]:
    """Every file of the directory ``path`` with its size and checksum (reads them all)."""
    return tuple(
        FileSum(n, os.path.getsize(os.path.join(path, n)), digest_file(os.path.join(path, n))) for n in file_names(path)
    )


def mismatch(path: str, files: tuple[FileSum, ...]) -> str | None:
    """Why the directory ``path`` does not hold exactly ``files`` (a missing, resized or changed file), or None."""
    names = file_names(path) if os.path.isdir(path) else []
    if names != [f.name for f in files]:
        return f"{path} holds files {names[:5]}, its record names {[f.name for f in files][:5]}"
    for f in files:
        full = os.path.join(path, f.name)
        if os.path.getsize(full) != f.size:
            return f"{full} has {os.path.getsize(full)} bytes, its record says {f.size}"
        if digest_file(full) != f.digest:
            return f"{full} fails its checksum ({digest_file(full)}, recorded {f.digest})"
    return None


def record_path(copy: str) -> str:
    """Where the record of the copy at ``copy`` is."""
    return copy.rstrip(os.sep) + RECORD_SUFFIX


def write_record(copy: str, record: CopyRecord) -> None:
    """Write the record of ``copy`` atomically and durably (a temporary file, fsynced, renamed, directory fsynced)."""
    target = record_path(copy)
    tmp = f"{target}.tmp-{os.getpid()}"
    write_durable(tmp, json.dumps(asdict(record), sort_keys=True).encode())
    os.replace(tmp, target)
    fsync_path(os.path.dirname(target))


def read_record(copy: str) -> CopyRecord | None:
    """The record of the copy at ``copy``, or None when it has none or an invalid one."""
    try:
        with open(record_path(copy), "rb") as f:
            raw = json.loads(f.read())
        return _parse(raw)
    except (OSError, ValueError, TypeError, KeyError):
        return None


def _parse(raw: dict) -> CopyRecord | None:
    p = raw["part"]
    part = PartId(_int(p["step"]), _int(p["rank"]), _int(p["world"]))
    files = tuple(FileSum(str(f["name"]), _int(f["size"]), str(f["digest"])) for f in raw["files"])
    peer_rank = raw.get("peer_rank")
    peer_node = raw.get("peer_node")
    if peer_rank is not None:
        peer_rank = _int(peer_rank)
    if peer_node is not None and not isinstance(peer_node, str):
        return None
    return CopyRecord(part, files, peer_rank, peer_node)


def _int(value: object) -> int:
    if type(value) is not int or value < 0:
        raise ValueError(f"not a non-negative int: {value!r}")
    return value
