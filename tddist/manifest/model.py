"""The manifest model, and the validation of an untrusted manifest of any format version.

A ``Manifest`` is what a committed checkpoint holds: its nodes, every tensor
leaf with its chunks (in columns, ``chunks.py``), the non-tensor values and
the metadata. ``merge.merge_fragments`` builds one on rank 0 from the ranks'
votes; ``parse.parse_manifest`` builds one from a file, trusting nothing in it:
``v1`` reads version 1 (every chunk in the JSON), ``v2``
reads and writes version 2 (the structure in the JSON, the per-rank columns
in a binary index). No torch is needed.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, NoReturn, Protocol

import numpy as np

from .. import format as fmt
from ..core.finite import is_floating
from ..core.sharding import Box, Placement
from ..core.types import Holder, Key
from ..errors import ManifestError
from .chunks import Chunk, ChunkTable, LeafStats, ShardChunks
from .refs import LeafRefs

if TYPE_CHECKING:
    import torch

__all__ = ["Chunk", "LargestMagnitude", "Leaf", "Manifest", "NonFiniteLeaf", "ObjectLeaf", "RankMagnitudes"]

MAX_ELEMENTS = 1 << 56
#: The newest format version this tddist reads.
READS_UP_TO = 4
#: The most ranks a manifest may name: far beyond any job, and small enough that an array of one number per
#: rank (128 MiB at most) never exhausts memory before the files that should back it are checked.
MAX_WORLD_SIZE = 1 << 24
#: The most bytes of tensor data a checkpoint may hold (4 EiB): every sum of chunk sizes, padding included,
#: then fits in int64, so no offset computed from the manifest can wrap.
MAX_TOTAL_BYTES = 1 << 62
#: The largest ``tddist.json`` tddist reads or writes, of any version. Version 1 lists every chunk in the
#: JSON: 4,096 ranks x 1,000 leaves is about 150 MiB. Versions 2 and 3 keep the per-chunk numbers in the
#: index; their JSON grows with the leaves (about 200 bytes each: a million leaves are about 200 MiB), the
#: nodes and the non-tensor values (one per rank for a per-rank value: a pickled Python RNG state of 3.4 KB
#: per rank is 55 MiB at 16,384 ranks). The format bounds none of these, so the bound is a size no real
#: manifest reaches; ``v2.encode`` refuses to write a larger one, so tddist never writes what it cannot read.
MAX_MANIFEST_BYTES = 256 << 20
#: The largest ``tddist.idx`` tddist reads (16,384 ranks x 10,000 sharded leaves need 2.5 GiB); its size is
#: the one the JSON implies, checked before it is read.
MAX_INDEX_BYTES = 16 << 30


class IndexSource(Protocol):
    """Where a store reads a checkpoint's index from, once the JSON says how large it must be (a store
    implements it; ``parse.parse_manifest`` calls it after the JSON is checked, and nothing is read before)."""

    def read_index(self, size: int) -> bytes | None:
        """Exactly ``size`` bytes: the whole index, or None when the checkpoint has none.

        The size of the file (object, archive entry) is checked before
        anything is read from it: an index of any other size is refused.

        Raises:
            ManifestError: the index has another size, or is not a regular file or stored entry.
        """
        ...


@dataclass(frozen=True)
class IndexBytes:
    """An index already in memory (or None: none), as an ``IndexSource``."""

    data: bytes | None

    def read_index(self, size: int) -> bytes | None:
        """The bytes, whatever their length: the parser compares it with ``size``."""
        return self.data


def check_manifest_size(size: int, where: str) -> None:
    """Refuse a ``tddist.json`` of more than ``MAX_MANIFEST_BYTES``, before it is read.

    Raises:
        ManifestError: naming the size and the limit.
    """
    if size > MAX_MANIFEST_BYTES:
        raise ManifestError(
            f"{where} has {size} bytes, more than the {MAX_MANIFEST_BYTES} bytes ({MAX_MANIFEST_BYTES >> 20} MiB) "
            f"tddist reads for a manifest; tddist never writes one that large, so it is damaged or was not written "
            f"by tddist: refusing it"
        )


@dataclass(frozen=True, slots=True)
class Leaf:
    """One tensor leaf of the checkpoint: its global shape, placement and stored chunks.

    Attributes:
        key: The leaf's key, one string per nesting level.
        dtype_name: The dtype's manifest name (``"float32"``); ``dtype`` gives the torch dtype.
        shape: The global shape (all ranks' pieces together).
        placement: How the ranks' pieces make up the global tensor.
        table: The stored pieces, in columns; together they tile ``shape`` exactly.
        stats: For a floating leaf, its chunks' counts of non-finite values (format version 4; only the
            chunks that hold any); None when they were not recorded (other dtypes, older versions).
        refs: In an incremental checkpoint, which checkpoint holds each chunk's bytes and each chunk's
            identity (``refs.LeafRefs``); None in any other.
    """

    key: Key
    dtype_name: str  # see format.dtype_name; kept as a name so reading a manifest needs no torch
    shape: tuple[int, ...]
    placement: Placement
    table: ChunkTable
    stats: LeafStats | None = None
    refs: LeafRefs | None = None

    def holder_of(self, i: int) -> int:
        """Which checkpoint holds chunk ``i``'s bytes: 0 this one, ``h`` the manifest's ``holders[h - 1]``."""
        return 0 if self.refs is None else int(self.refs.holders[i])

    @property
    def dtype(self) -> torch.dtype:
        """The leaf's torch dtype (imports torch)."""
        return fmt.torch_dtype(self.dtype_name)

    @property
    def chunks(self) -> list[Chunk]:
        """Every stored piece as a ``Chunk`` (built on demand: a leaf of many ranks has many)."""
        return [self.table.chunk(i) for i in range(len(self.table))]

    def overlapping(self, box: Box) -> list[Chunk]:
        """The chunks that share elements with ``box`` (only those are built)."""
        return [self.table.chunk(i) for i in self.table.overlapping(box)]

    def chunk_of_rank(self, rank: int) -> Chunk | None:
        """The chunk ``rank`` stored, if any."""
        i = self.table.index_of_rank(rank)
        return None if i is None else self.table.chunk(i)


@dataclass
class ObjectLeaf:
    """A non-tensor leaf. ``placement``: "replicate" (one value, written once), "per_rank"
    (one value per saving rank) or "shard" (a stack: one list of row values per rank).

    Attributes:
        key: The leaf's key, one string per nesting level.
        placement: "replicate", "per_rank" or "shard", as above.
        values: The encoded values (see ``format.encode_object``): one, or one per rank.
        declared: "per_rank" because it was saved under a ``PerRank()`` placement (not only because
            the ranks' values differ): loading it on another world size follows ``load(per_rank=...)``.
    """

    key: Key
    placement: str
    values: list[Any]  # encoded values (see format.encode_object)
    declared: bool = False


@dataclass(frozen=True)
class NonFiniteLeaf:
    """A floating leaf whose chunks hold NaN or infinite values (format version 4 records them).

    Attributes:
        key: the leaf's key.
        nan: how many of its values are NaN (complex: components); inf: how many are infinite.
        ranks: the ranks that stored the chunks holding them, in chunk order.
    """

    key: Key
    nan: int
    inf: int
    ranks: tuple[int, ...]


@dataclass(frozen=True)
class RankMagnitudes:
    """Each rank's largest finite magnitude among the values of the counted chunks it stored (format version 4):
    one number per rank, not per chunk, so a manifest at thousands of ranks stays small.

    Attributes:
        values: float64[world_size], in rank order (0.0: the rank stored no nonzero counted value).
        leaves: int64[world_size]: the position, in ``Manifest.leaves``, of the leaf whose chunk holds it (-1
            where the value is 0.0).
    """

    values: np.ndarray
    leaves: np.ndarray


@dataclass(frozen=True)
class LargestMagnitude:
    """The checkpoint's largest finite magnitude, where it is (``Manifest.largest_magnitude``).

    Attributes:
        value: the magnitude; key: the leaf that holds it; rank: the rank that stored that chunk.
    """

    value: float
    key: Key
    rank: int


@dataclass
class Manifest:
    """What a committed checkpoint holds: its structure, every leaf's chunks, metadata.

    ``tddist.read_manifest`` returns it without reading any tensor data; it is
    the parsed and validated ``tddist.json`` (see docs/format.md).

    Attributes:
        world_size: How many ranks saved the checkpoint.
        nodes: Each (sub-)TensorDict's global batch size, by key; the root is ``()``.
        leaves: Every tensor leaf, by key, in the order they are stored.
        objects: Every non-tensor leaf, by key.
        metadata: The ``metadata=`` given to ``save`` (JSON values).
        robust_key: Whether file names percent-encode the keys (``robust_key=True`` of ``save``).
        created: When the checkpoint was committed (ISO 8601, UTC).
        tddist_version: The tddist version that wrote it.
        version: The format version.
        layout: "directory" or "archive".
        node_rows: For each batched node, the dim-0 rows each rank saved, in rank order.
        packing: "packed" (one data file per rank) or "memmap" (one file per leaf and rank).
        structure_digest: The digest of the saved structure (version 2; "" before).
        largest: Each rank's largest finite magnitude and its leaf (version 4; None when not recorded).
        holders: An incremental checkpoint's holders: the checkpoints beside it that hold the bytes of the
            chunks it references (version 4); None for a checkpoint saved without a base.
    """

    world_size: int
    nodes: dict[Key, tuple[int, ...]]  # node key -> global batch size
    leaves: dict[Key, Leaf]
    objects: dict[Key, ObjectLeaf] = field(default_factory=dict)
    metadata: dict[str, Any] = field(default_factory=dict)
    robust_key: bool = True
    created: str = ""
    tddist_version: str = ""
    version: int = fmt.FORMAT_VERSION
    layout: str = "directory"
    node_rows: dict[Key, list[int]] = field(default_factory=dict)  # batched node -> its dim-0 rows per rank
    packing: str = "memmap"
    structure_digest: str = ""
    largest: RankMagnitudes | None = None
    holders: tuple[Holder, ...] | None = None

    def referenced(self) -> tuple[Holder, ...]:
        """The checkpoints this one references (empty when it references none)."""
        return self.holders or ()

    def non_finite(self) -> list[NonFiniteLeaf]:
        """Every leaf whose recorded counts show a NaN or an infinite value, in leaf order."""
        out = []
        for leaf in self.leaves.values():
            if leaf.stats is not None and not leaf.stats.finite:
                ranks = leaf.table.columns().ranks[leaf.stats.chunks]
                nan, inf = leaf.stats.total()
                out.append(NonFiniteLeaf(leaf.key, nan, inf, tuple(int(r) for r in ranks)))
        return out

    def uncounted(self) -> list[Key]:
        """The floating leaves without recorded counts (checkpoints of format versions before 4)."""
        return [k for k, leaf in self.leaves.items() if leaf.stats is None and is_floating(leaf.dtype_name)]

    def largest_magnitude(self) -> LargestMagnitude | None:
        """The largest finite magnitude the ranks recorded, its leaf and rank; None when none was recorded
        (format versions before 4) or every counted value is zero."""
        if self.largest is None or not len(self.largest.values):
            return None
        rank = int(np.argmax(self.largest.values))
        at = int(self.largest.leaves[rank])
        if at < 0:
            return None
        return LargestMagnitude(float(self.largest.values[rank]), list(self.leaves)[at], rank)

    def rows_of(self, node_key: Key) -> list[int] | None:
        """The dim-0 rows each rank saved of a batched node: recorded, or (manifests of version 1 written
        before rows were recorded) those of a leaf under it sharded along dim 0; None if neither exists."""
        rows = self.node_rows.get(tuple(node_key))
        if rows is not None:
            return rows
        for leaf in self.leaves.values():
            if (
                leaf.key[: len(node_key)] == tuple(node_key)
                and isinstance(leaf.table, ShardChunks)
                and leaf.table.dim == 0
            ):
                return [int(x) for x in leaf.table.lengths]
        return None


def parse_header(p: Parser, obj: Any) -> Manifest:
    """The members every version has, validated; nodes and leaves are left to the version's parser.

    Raises:
        ManifestError: anything malformed, or a version newer than this tddist reads.
    """
    p.check(isinstance(obj, dict), "is not a JSON object")
    p.check(obj.get("format") == fmt.FORMAT_NAME, f"has format {obj.get('format')!r}, expected {fmt.FORMAT_NAME!r}")
    version = obj.get("version")
    p.check(type(version) is int, "has no integer 'version'")
    if version > READS_UP_TO:
        raise ManifestError(
            f"{p.where} has format version {version}, newer than this tddist reads ({READS_UP_TO}); "
            f"upgrade tddist to load it"
        )
    p.check(version >= 1, f"has invalid version {version}")
    world = obj.get("world_size")
    p.check(type(world) is int and world >= 1, f"has invalid world_size {world!r}")
    p.check(
        world <= MAX_WORLD_SIZE,
        f"has world_size {world}, more than the {MAX_WORLD_SIZE} ranks tddist reads (no job has that many)",
    )
    p.check(obj.get("layout") in ("directory", "archive"), f"has unknown layout {obj.get('layout')!r}")
    cs = obj.get("checksum")
    p.check(
        cs == {"algorithm": fmt.CHECKSUM_ALGORITHM, "block_size": fmt.CHECKSUM_BLOCK},
        f"uses unknown checksum settings {cs!r}",
    )
    robust = obj.get("robust_key", True)
    p.check(isinstance(robust, bool), "has a non-boolean 'robust_key'")
    metadata = obj.get("metadata", {})
    p.check(isinstance(metadata, dict), "has non-object 'metadata'")
    return Manifest(
        world_size=world,
        nodes={},
        leaves={},
        metadata=metadata,
        robust_key=robust,
        created=str(obj.get("created", "")),
        tddist_version=str(obj.get("tddist_version", "")),
        version=version,
        layout=obj["layout"],
    )


def check_keys(p: Parser, m: Manifest) -> None:
    """With ``robust_key=False`` every key must be usable as a file name."""
    if not m.robust_key:
        for key in [*m.nodes, *m.leaves, *m.objects]:
            for part in key:
                why = fmt.verbatim_key_problem(part)
                p.check(why is None, f"has key {list(key)}, unusable as a file name with robust_key=false: {why}")


def check_total_bytes(p: Parser, m: Manifest) -> None:
    """The leaves hold at most ``MAX_TOTAL_BYTES`` together, so offsets derived from their sizes never wrap."""
    total = sum(math.prod(leaf.shape) * fmt.dtype_itemsize(leaf.dtype_name) for leaf in m.leaves.values())
    p.check(
        total <= MAX_TOTAL_BYTES,
        f"declares {total} bytes of tensor data, more than the {MAX_TOTAL_BYTES} bytes a checkpoint can hold",
    )


def parse_nodes(p: Parser, obj: dict[str, Any], m: Manifest) -> None:
    """The ``nodes`` list (version 1 also gives each batched node's rows per rank)."""
    for n in p.list_of(obj, "nodes"):
        p.check(isinstance(n, dict), "has a node that is not an object")
        key = p.key(n.get("key"), allow_empty=True)
        p.check(key not in m.nodes, f"lists node {key!r} twice")
        p.check(not key or key[:-1] in m.nodes, f"has node {key!r} whose parent node is not listed (before it)")
        m.nodes[key] = p.shape_of(n.get("batch_size"), lambda: f"node {key!r} batch_size")
        if "rows" in n:
            rows = n["rows"]
            ok = isinstance(rows, list) and len(rows) == m.world_size and all(type(r) is int and r >= 0 for r in rows)
            p.check(
                ok and m.nodes[key] != () and sum(rows) == m.nodes[key][0],
                f"has invalid rows {rows!r} for node {key!r}",
            )
            m.node_rows[key] = rows


def add_leaf(p: Parser, m: Manifest, leaf: Leaf) -> None:
    """Add a parsed leaf, refusing duplicates and orphans."""
    key = leaf.key
    if key in m.leaves:
        p.fail(f"lists leaf {key!r} twice")
    if key in m.nodes:
        p.fail(f"has {key!r} both as a node and as a leaf")
    if key[:-1] not in m.nodes:
        p.fail(f"has leaf {key!r} whose parent node is not listed")
    m.leaves[key] = leaf


def parse_objects(p: Parser, obj: dict[str, Any], m: Manifest) -> None:
    """The non-tensor values (the same in every version)."""
    nodes, leaves, world = m.nodes, m.leaves, m.world_size
    objects = m.objects
    for o in obj.get("objects", []) if isinstance(obj.get("objects", []), list) else p.fail("has a non-list 'objects'"):
        p.check(isinstance(o, dict), "has a non-tensor entry that is not an object")
        key = p.key(o.get("key"), allow_empty=False)
        p.check(key not in objects and key not in leaves and key not in nodes, f"lists {key!r} twice")
        p.check(key[:-1] in nodes, f"has non-tensor entry {key!r} whose parent node is not listed")
        placement, values = o.get("placement"), o.get("values")
        p.check(
            placement in ("replicate", "per_rank", "shard"),
            f"has non-tensor entry {key!r} with unknown placement {placement!r}",
        )
        p.check(
            isinstance(values, list) and len(values) == (1 if placement == "replicate" else world),
            f"has non-tensor entry {key!r} with the wrong number of values",
        )
        if placement == "shard":
            p.check(all(isinstance(v, list) for v in values), f"has non-tensor stack {key!r} with non-list values")
        declared = o.get("declared", False)
        p.check(
            declared is False or (declared is True and placement == "per_rank"),
            f"has non-tensor entry {key!r} with an invalid 'declared' {declared!r} (only true on a per_rank entry)",
        )
        objects[key] = ObjectLeaf(key, placement, values, declared)


class Parser:
    """Small helper that turns every malformed field into one ManifestError."""

    def __init__(self, where: str):
        self.where = where

    def fail(self, why: str) -> NoReturn:
        raise ManifestError(
            f"{self.where} {why}; the checkpoint is damaged or was tampered with (restore it from a copy)"
        )

    def check(self, ok: bool, why: str) -> None:
        if not ok:
            self.fail(why)

    def list_of(self, obj: dict[str, Any], name: str) -> list[Any]:
        v = obj.get(name)
        if not isinstance(v, list):
            self.fail(f"has no list {name!r}")
        return v

    # The checks below run once per key and leaf: their messages are formatted only when they fail.

    def key(self, v: Any, allow_empty: bool) -> Key:
        """A key: a list of strings (empty only where ``allow_empty``), as a tuple."""
        if isinstance(v, list) and (v or allow_empty) and all(isinstance(k, str) for k in v):
            return tuple(v)
        self.fail(f"has an invalid key {v!r}")

    def shape(self, v: Any, what: str) -> tuple[int, ...]:
        """A shape or batch size (named ``what`` in errors): at most 64 non-negative integers below 2^56, with a
        product below 2^56."""
        return self.shape_of(v, lambda: what)

    def shape_of(self, v: Any, what: Callable[[], str]) -> tuple[int, ...]:
        """``shape``, with the name made only if the check fails (``what()``)."""
        if not (isinstance(v, list) and len(v) <= 64 and all(type(s) is int and 0 <= s < MAX_ELEMENTS for s in v)):
            self.fail(f"has invalid {what()} {v!r}")
        if math.prod(v) >= MAX_ELEMENTS:
            self.fail(f"has absurd {what()} {v!r}")
        return tuple(v)
