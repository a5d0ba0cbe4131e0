"""Version 2 of the manifest: the structure in ``tddist.json``, the per-rank columns in ``tddist.idx``.

The JSON holds what is the same for every save of the same state (keys,
dtypes, global shapes, placements, node batch sizes) and a few numbers per
leaf; the index holds what grows with the world size (every rank's rows and
every chunk's checksum), as little-endian 8-byte integers that load as numpy
views without parsing. The index's size and checksum are in the JSON, so a
damaged or swapped index is refused before anything is read from it.

Index sections, in order (``docs/format.md`` section 5):

1. each batched node's rows per rank (int64[world]), nodes in order;
2. each sharded leaf with ``"rows": "own"``: its length along the shard dim
   per rank (int64[world]), leaves in order;
3. every leaf's chunk checksums (uint64[chunks]), leaves in order;
4. each ``boxes`` leaf's chunk ranks (int64[n]), offsets and sizes
   (int64[n * ndim] each, row-major), leaves in order.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
import xxhash

from .. import format as fmt
from ..core.finite import is_floating
from ..core.sharding import Boxes, PerRank, Placement, Replicate, Shard, box_tiling_problems
from ..core.types import Key, ManifestFiles
from ..errors import InvalidDataError, ManifestError
from .checksum import seal
from .chunks import FINITE, BoxChunks, ChunkTable, LeafStats, ReplicaChunks, ShardChunks, starts_of
from .model import (
    MAX_INDEX_BYTES,
    MAX_MANIFEST_BYTES,
    IndexSource,
    Leaf,
    Manifest,
    ObjectLeaf,
    Parser,
    RankMagnitudes,
    add_leaf,
    parse_nodes,
)
from .refs import LeafRefs, holders_member, leaf_section, parse_holders, read_leaf_refs, refs_index_size

_I8 = np.dtype("<i8")
_U8 = np.dtype("<u8")
_F8 = np.dtype("<f8")
PACKINGS = ("packed", "memmap")


def encode(m: Manifest) -> ManifestFiles:
    """The files of manifest ``m`` (see the module docstring and docs/format.md)."""
    node_rows = {k: _rows_to_encode(m, k) for k, b in m.nodes.items() if b}
    rows = [r.tobytes() for r in node_rows.values()]
    own_rows: list[bytes] = []
    sums: list[bytes] = []
    boxes: list[bytes] = []
    stats: list[bytes] = []
    leaves = []
    for leaf in m.leaves.values():
        entry: dict[str, Any] = {"key": list(leaf.key), "dtype": leaf.dtype_name, "shape": list(leaf.shape)}
        t = leaf.table
        if isinstance(leaf.placement, PerRank):
            assert isinstance(t, ShardChunks)  # the ranks' values stacked along dim 0, one row each
            entry["placement"] = {"type": "per_rank"}
            sums.append(np.ascontiguousarray(t.checksums, dtype=_U8).tobytes())
        elif isinstance(t, ShardChunks):
            entry["placement"] = {"type": "shard", "dim": t.dim}
            parent = node_rows.get(leaf.key[:-1])
            from_node = t.dim == 0 and parent is not None and np.array_equal(t.lengths, parent)
            entry["rows"] = "node" if from_node else "own"
            if not from_node:
                own_rows.append(np.ascontiguousarray(t.lengths, dtype=_I8).tobytes())
            sums.append(np.ascontiguousarray(t.checksums, dtype=_U8).tobytes())
        elif isinstance(t, ReplicaChunks):
            entry["placement"] = {"type": "replicate"}
            entry["writer"] = t.writer
            sums.append(np.array([t.checksum], dtype=_U8).tobytes())
        else:
            entry["placement"] = {"type": "boxes"}
            entry["chunks"] = len(t)
            sums.append(np.ascontiguousarray(t.checksums, dtype=_U8).tobytes())
            for a in (t.ranks, t.offsets, t.sizes):
                boxes.append(np.ascontiguousarray(a, dtype=_I8).tobytes())
        stats += _counts_of(leaf, entry)
        leaves.append(entry)
    stats += _magnitudes_of(m)
    index = b"".join(rows + own_rows + sums + boxes + stats + _refs_section(m))
    obj: dict[str, Any] = {
        "format": fmt.FORMAT_NAME,
        "version": fmt.FORMAT_VERSION,
        "tddist_version": m.tddist_version,
        "created": m.created,
        "world_size": m.world_size,
        "layout": m.layout,
        "packing": m.packing,
        "robust_key": m.robust_key,
        "checksum": {"algorithm": fmt.CHECKSUM_ALGORITHM, "block_size": fmt.CHECKSUM_BLOCK},
        "structure_digest": m.structure_digest,
        **({"rank_magnitudes": True} if m.largest is not None else {}),
        **_holders_member(m),
        "index": {"size": len(index), "checksum": xxhash.xxh3_64_hexdigest(index)},
        "metadata": m.metadata,
        "nodes": [{"key": list(k), "batch_size": list(b)} for k, b in m.nodes.items()],
        "leaves": leaves,
        "objects": [_object_entry(o) for o in m.objects.values()],
    }
    raw = seal(fmt.dumps(obj))  # version 3: the checksum of its own bytes first
    _check_writable(raw, obj)
    return ManifestFiles(raw, index)


def _holders_member(m: Manifest) -> dict[str, Any]:
    """An incremental checkpoint's ``holders`` (section 5.10), early in the JSON: a clean-up finds them in the
    first bytes of a manifest, whatever its size."""
    return {} if m.holders is None else {"holders": holders_member(m.holders)}


def _refs_section(m: Manifest) -> list[bytes]:
    """The index's section 7 (an incremental checkpoint only): every leaf's chunks' holders and identities."""
    if m.holders is None:
        return []
    out: list[bytes] = []
    for leaf in m.leaves.values():
        n = len(leaf.table)
        refs = leaf.refs or LeafRefs(np.zeros(n, dtype=_I8), np.zeros((n, 2), dtype=_U8))
        out += leaf_section(refs)
    return out


def _magnitudes_of(m: Manifest) -> list[bytes]:
    """The index's section 6 (when recorded): each rank's largest finite magnitude, then its leaf's position."""
    if m.largest is None:
        return []
    return [
        np.ascontiguousarray(m.largest.values, _F8).tobytes(),
        np.ascontiguousarray(m.largest.leaves, _I8).tobytes(),
    ]


def _counts_of(leaf: Leaf, entry: dict[str, Any]) -> list[bytes]:
    """A counted leaf's members (``finite_stats``, ``non_finite_chunks``) into its JSON ``entry``, and its part
    of the index's section 5: its chunks that hold non-finite values, their NaN and Inf counts (none if clean)."""
    stats = leaf.stats
    if stats is None or not is_floating(leaf.dtype_name):
        return []
    entry["finite_stats"] = True
    if stats.finite:
        return []
    entry["non_finite_chunks"] = len(stats.chunks)
    return [
        np.ascontiguousarray(a, dtype=d).tobytes() for a, d in ((stats.chunks, _I8), (stats.nan, _U8), (stats.inf, _U8))
    ]


def _check_writable(raw: bytes, obj: dict[str, Any]) -> None:
    """Refuse to write a manifest larger than readers accept (``MAX_MANIFEST_BYTES``): it could never be loaded."""
    if len(raw) <= MAX_MANIFEST_BYTES:
        return
    parts = {name: len(fmt.dumps(obj[name])) for name in ("metadata", "nodes", "leaves", "objects")}
    biggest = ", ".join(f"{name} {size} bytes" for name, size in sorted(parts.items(), key=lambda kv: -kv[1]))
    raise InvalidDataError(
        f"the manifest of this save would have {len(raw)} bytes, more than the {MAX_MANIFEST_BYTES} bytes "
        f"({MAX_MANIFEST_BYTES >> 20} MiB) tddist reads ({biggest}); nothing was committed: store large non-tensor "
        f"values and metadata as tensors, or save fewer leaves per checkpoint"
    )


def _object_entry(o: ObjectLeaf) -> dict[str, Any]:
    entry: dict[str, Any] = {"key": list(o.key), "placement": o.placement, "values": o.values}
    if o.declared:
        entry["declared"] = True
    return entry


def _rows_to_encode(m: Manifest, key: Key) -> np.ndarray:
    rows = m.rows_of(key)
    if rows is None:
        raise ManifestError(
            f"node {list(key)} has batch dims but the checkpoint does not record its rows per rank (a version-1 "
            f"manifest without them and without a leaf sharded along dim 0); it cannot be written as version 2"
        )
    return np.asarray(rows, dtype=_I8)


@dataclass(frozen=True, slots=True)
class _LeafEntry:
    key: Key
    dtype: str
    shape: tuple[int, ...]
    placement: Placement
    own_rows: bool = False
    writer: int = 0
    chunks: int = 0
    stats: bool = False  # version 4: its values were counted (``finite_stats``)
    non_finite: int = 0  # version 4: how many of its chunks hold non-finite values (the index's section 5)


@dataclass(frozen=True)
class _IndexRows:
    """The rows per rank read from the index (sections 1 and 2), which sharded leaves split by.

    Attributes:
        nodes: each batched node's rows per rank.
        totals: each batched node's rows in all (its ``batch_size[0]``, which its rows sum to).
        starts: where each batched node's ranks' rows start, made on first use (its leaves share them).
        own: each sharded leaf's own lengths along its shard dim per rank (``"rows": "own"``).
    """

    nodes: dict[Key, np.ndarray]
    totals: dict[Key, int]
    own: dict[Key, np.ndarray]
    starts: dict[Key, np.ndarray] = field(default_factory=dict)  # each node's ``starts_of`` its rows, once made


def parse_body(p: Parser, obj: dict[str, Any], m: Manifest, index: IndexSource) -> None:
    """Nodes and leaves of a version-2 manifest and its index into ``m``.

    The index is read only once the JSON is checked and says how large it
    must be; its sections are then taken as numpy views and checked a whole
    section at a time, not leaf by leaf.
    """
    world = m.world_size
    _parse_packing_and_digest(p, obj, m)
    parse_nodes(p, obj, m)
    p.check(not m.node_rows, "lists node rows in the JSON; version 2 keeps them in the index")
    p.check(() in m.nodes, "has no root node (key [])")
    entries = [_with_stats(p, e, _leaf_entry(p, e, world), m.version, world) for e in p.list_of(obj, "leaves")]
    magnitudes = _has_magnitudes(p, obj, m.version)
    batched = [k for k, b in m.nodes.items() if b]
    own = [e for e in entries if e.own_rows]
    m.holders = parse_holders(obj, p.fail) if m.version >= 4 else None
    extra = 0 if m.holders is None else 8 * refs_index_size(sum(_chunk_count(e, world) for e in entries))
    data = _checked_index(p, obj, index, _index_size(entries, len(batched), world, magnitudes) + extra)
    cursor = _Cursor(data)
    node_block = cursor.take(_I8, world * len(batched)).reshape(len(batched), world)  # the index's sections
    own_block = cursor.take(_I8, world * len(own)).reshape(len(own), world)
    sums = cursor.take(_U8, sum(_chunk_count(e, world) for e in entries))
    totals = {k: m.nodes[k][0] for k in batched}
    _check_rows(p, node_block, list(totals.values()), batched, "has invalid rows for node {key!r}")
    _check_rows(p, own_block, [e.shape[_dim(e)] for e in own], [e.key for e in own], "leaf {key!r} has rows")
    rows = _IndexRows(dict(zip(batched, node_block)), totals, {e.key: r for e, r in zip(own, own_block)})
    m.node_rows.update(zip(batched, node_block.tolist()))
    tables = _Tables(p, world, rows, sums, cursor)
    built = [(e, tables.table(e)) for e in entries]
    for e, table in built:  # section 5 follows every leaf's boxes
        add_leaf(p, m, Leaf(e.key, e.dtype, e.shape, e.placement, table, _stats(p, e, table, cursor)))
    if magnitudes:  # section 6
        m.largest = _magnitudes(p, entries, cursor.take(_F8, world), cursor.take(_I8, world))
    if m.holders is not None:  # section 7
        for (e, table), r in zip(built, _refs(p, [t for _e, t in built], m, cursor)):
            leaf = m.leaves[e.key]
            m.leaves[e.key] = Leaf(e.key, e.dtype, e.shape, e.placement, table, leaf.stats, r)
    p.check(cursor.pos == len(data), "has bytes left over at the end of its index")


def _refs(p: Parser, tables: list[ChunkTable], m: Manifest, cursor: _Cursor) -> list[LeafRefs | None]:
    """Every leaf's part of section 7 (an incremental checkpoint), or None for each leaf of any other."""
    if m.holders is None:
        return [None] * len(tables)
    n = len(m.holders)
    return [read_leaf_refs(cursor.take, len(t), n, p.fail) for t in tables]


def _with_stats(p: Parser, raw: Any, e: _LeafEntry, version: int, world: int) -> _LeafEntry:
    """``e`` with its ``finite_stats`` and ``non_finite_chunks`` members (version 4; members older versions do
    not know are ignored)."""
    if version < 4:
        return e
    counted, k = raw.get("finite_stats", False), raw.get("non_finite_chunks", 0)
    if counted is False and k == 0:
        return e
    if counted is not True or not is_floating(e.dtype):
        p.fail(f"leaf {e.key!r} has an invalid finite_stats {counted!r} (only true, only on a floating dtype)")
    if type(k) is not int or not 0 <= k <= _chunk_count(e, world):
        p.fail(f"leaf {e.key!r} has an invalid non_finite_chunks {k!r} (a count of its chunks)")
    # the constructor, not dataclasses.replace: 5 times faster, and every floating leaf of a manifest comes here
    return _LeafEntry(e.key, e.dtype, e.shape, e.placement, e.own_rows, e.writer, e.chunks, True, k)


def _has_magnitudes(p: Parser, obj: dict[str, Any], version: int) -> bool:
    """Whether the index ends with the ranks' largest magnitudes (``rank_magnitudes``, version 4)."""
    flag = obj.get("rank_magnitudes", False) if version >= 4 else False
    p.check(flag is True or flag is False, f"has an invalid rank_magnitudes {flag!r} (only true)")
    return bool(flag)


def _stats(p: Parser, e: _LeafEntry, table: ChunkTable, cursor: _Cursor) -> LeafStats | None:
    """A leaf's counts of non-finite values from section 5, checked: chunks that exist, in increasing order,
    each with at least one non-finite value and no more than its values."""
    if not e.stats:
        return None
    if not e.non_finite:
        return FINITE
    k = e.non_finite
    stats = LeafStats(cursor.take(_I8, k), cursor.take(_U8, k), cursor.take(_U8, k))
    ok = bool((stats.chunks >= 0).all() and (stats.chunks < len(table)).all() and (np.diff(stats.chunks) > 0).all())
    if ok:
        nbytes = table.columns().nbytes[stats.chunks]
        values = (nbytes // fmt.dtype_itemsize(e.dtype) * (2 if e.dtype.startswith("complex") else 1)).astype(_U8)
        # 1 <= nan + inf <= values without a sum that could wrap: inf <= values, then nan <= values - inf
        ok = bool((stats.inf <= values).all()) and bool((stats.nan <= values - np.minimum(stats.inf, values)).all())
        ok = ok and bool(((stats.nan > 0) | (stats.inf > 0)).all())
    p.check(ok, f"leaf {e.key!r} has invalid counts of non-finite values")
    return stats


def _magnitudes(p: Parser, entries: list[_LeafEntry], values: np.ndarray, leaves: np.ndarray) -> RankMagnitudes:
    """The ranks' largest finite magnitudes (section 6), checked: finite, not negative, each naming a floating
    leaf (or -1 with a magnitude of 0)."""
    ok = bool(np.isfinite(values).all() and (values >= 0).all())
    ok = ok and bool(((leaves >= -1) & (leaves < len(entries))).all()) and bool(((leaves == -1) == (values == 0)).all())
    if ok:
        named = {int(i) for i in np.unique(leaves) if i >= 0}
        ok = all(is_floating(entries[i].dtype) for i in named)
    p.check(ok, "has invalid largest magnitudes of its ranks")
    return RankMagnitudes(values, leaves)


def _dim(e: _LeafEntry) -> int:
    """The shard dim of a sharded leaf's entry."""
    assert isinstance(e.placement, Shard)
    return e.placement.dim


def _check_rows(p: Parser, block: np.ndarray, totals: list[int], keys: list[Key], what: str) -> None:
    """Each row of ``block`` (one per node or leaf ``keys[i]``, one number per rank) is non-negative and sums to
    its total; ``what`` (formatted with the key) begins the message refusing a row.

    Sums are partial sums (numpy's int64): the numbers are non-negative, so
    a partial sum only grows, and one that wrapped past 2^63 turns negative.
    """
    if not len(block):
        return
    partial = np.cumsum(block, axis=1, dtype=np.int64)
    ok = (block >= 0).all(axis=1) & (partial >= 0).all(axis=1) & (partial[:, -1] == np.asarray(totals, np.int64))
    if not ok.all():
        bad = int(np.argmin(ok))
        p.fail(f"{what.format(key=keys[bad])} that are negative or do not sum to {totals[bad]}")


class _Tables:
    """Builds each leaf's chunk table from its JSON entry and the index's columns, in the order of the leaves."""

    def __init__(self, p: Parser, world: int, rows: _IndexRows, sums: np.ndarray, cursor: _Cursor):
        self.p, self.world, self.rows, self.sums, self.cursor = p, world, rows, sums, cursor
        self.pos = 0  # into ``sums``: each leaf's checksums follow the previous leaf's
        self.ones: np.ndarray | None = None  # a per-rank leaf's lengths: one row per rank (shared, read-only)

    def table(self, e: _LeafEntry) -> ChunkTable:
        """The chunk table of ``e``, the next leaf."""
        p, world = self.p, self.world
        n = _chunk_count(e, world)
        sums = self.sums[self.pos : self.pos + n]
        self.pos += n
        itemsize = fmt.dtype_itemsize(e.dtype)
        if isinstance(e.placement, Shard):
            return _shard_table(p, e, e.placement.dim, self.rows, itemsize, sums)
        if isinstance(e.placement, Replicate):
            return ReplicaChunks(e.shape, itemsize, e.writer, int(sums[0]))
        if isinstance(e.placement, PerRank):
            if not (len(e.shape) >= 1 and e.shape[0] == world):
                p.fail(f"per-rank leaf {e.key!r} has shape {list(e.shape)}, which does not start with {world} ranks")
            if self.ones is None:
                self.ones = np.ones(world, dtype=_I8)
                self.ones.flags.writeable = False
            return ShardChunks(e.shape, 0, itemsize, self.ones, sums)
        return _boxes(p, e, self.cursor, itemsize, world, sums)


def _parse_packing_and_digest(p: Parser, obj: dict[str, Any], m: Manifest) -> None:
    """The packing (an archive's is always "memmap") and the structure digest into ``m``."""
    m.packing = obj.get("packing", "")
    p.check(m.packing in PACKINGS, f"has unknown packing {m.packing!r}")
    p.check(m.layout == "directory" or m.packing == "memmap", "is an archive, whose packing must be 'memmap'")
    digest = obj.get("structure_digest", "")
    p.check(isinstance(digest, str) and len(digest) <= 64, "has an invalid structure_digest")
    m.structure_digest = digest


def _index_size(entries: list[_LeafEntry], batched_nodes: int, world: int, magnitudes: bool) -> int:
    """The bytes of the index that the JSON's structure implies (its six sections, 8 bytes a number).

    Python integers: a hostile world size or chunk count makes this large, never wrong.
    """
    return 8 * (
        world * batched_nodes
        + sum(world for e in entries if e.own_rows)
        + sum(_chunk_count(e, world) for e in entries)
        + sum(e.chunks * (1 + 2 * len(e.shape)) for e in entries if isinstance(e.placement, Boxes))
        + sum(3 * e.non_finite for e in entries)
        + (2 * world if magnitudes else 0)
    )


def _checked_index(p: Parser, obj: dict[str, Any], index: IndexSource, expected: int) -> bytes:
    """The index, read once its size (declared, implied by the JSON, bounded) is known; then its checksum.

    Nothing is read from a store before the declared size equals the implied
    one and is within ``MAX_INDEX_BYTES``; the store reads exactly that many
    bytes, after checking the file's size. A damaged or swapped index is
    refused here, before anything is built from it.
    """
    meta = obj.get("index")
    p.check(isinstance(meta, dict) and type(meta.get("size")) is int, "has no index size")
    assert isinstance(meta, dict)
    p.check(meta["size"] == expected, f"declares an index of {meta['size']} bytes, its structure needs {expected}")
    p.check(
        expected <= MAX_INDEX_BYTES,
        f"needs an index of {expected} bytes, more than the {MAX_INDEX_BYTES} bytes ({MAX_INDEX_BYTES >> 30} GiB) "
        f"tddist reads",
    )
    data = index.read_index(expected)
    if data is None:
        p.fail(f"has no index ({fmt.INDEX_NAME})")
    p.check(len(data) == expected, f"has an index of {len(data)} bytes, expected {expected} (truncated?)")
    p.check(xxhash.xxh3_64_hexdigest(data) == meta.get("checksum"), "has an index that fails its checksum")
    return data


def _shard_table(p: Parser, e: _LeafEntry, dim: int, rows: _IndexRows, itemsize: int, sums: np.ndarray) -> ShardChunks:
    """A sharded leaf's table: its own rows per rank, or its node's (``"rows": "node"``, dim 0 only).

    Both were checked against their totals a section at a time (``_check_rows``).
    Own rows along dim 0 must equal the node's where the node has rows: a
    TensorDict's leaves split their batch dim as the node does.
    """
    rows_of = rows.own.get(e.key)
    parent_rows = rows.nodes.get(e.key[:-1])
    if rows_of is not None:
        if dim == 0 and parent_rows is not None and not np.array_equal(rows_of, parent_rows):
            p.fail(f"leaf {e.key!r} has rows per rank that differ from those of its node {e.key[:-1]!r}")
        return ShardChunks(e.shape, dim, itemsize, rows_of, sums)
    if parent_rows is None:  # the messages are formatted only on failure: this runs per leaf
        p.fail(f"leaf {e.key!r} takes its rows from a node without rows")
    if dim != 0:
        p.fail(f"leaf {e.key!r} takes its rows from a node but is sharded along dim {dim}, not 0")
    parent = e.key[:-1]
    if e.shape[0] != rows.totals[parent]:
        p.fail(f"leaf {e.key!r} has rows that are negative or do not sum to {e.shape[0]}")
    starts = rows.starts.get(parent)
    if starts is None:
        starts = rows.starts[parent] = starts_of(parent_rows)
    return ShardChunks(e.shape, dim, itemsize, parent_rows, sums, starts)


def _chunk_count(e: _LeafEntry, world: int) -> int:
    if isinstance(e.placement, (Shard, PerRank)):
        return world
    return 1 if isinstance(e.placement, Replicate) else e.chunks


#: Placements without arguments, shared by every leaf that has them (they are immutable).
_REPLICATE, _PER_RANK, _BOXES = Replicate(), PerRank(), Boxes()
_SHARDS = [Shard(d) for d in range(64)]  # a shape has at most 64 dims


def _leaf_entry(p: Parser, e: Any, world: int) -> _LeafEntry:
    """A leaf's JSON entry, checked (its messages formatted only when a check fails: this runs per leaf)."""
    if not isinstance(e, dict):
        p.fail("has a leaf that is not an object")
    key = p.key(e.get("key"), allow_empty=False)
    dtype = e.get("dtype")
    if not fmt.is_dtype_name(dtype):
        p.fail(f"leaf {key!r} has unknown dtype {dtype!r}")
    shape = p.shape_of(e.get("shape"), lambda: f"leaf {key!r} shape")
    pl = e.get("placement")
    kind = pl.get("type") if isinstance(pl, dict) else None
    if kind == "shard":
        assert isinstance(pl, dict)
        dim, rows = pl.get("dim"), e.get("rows")
        if not (type(dim) is int and 0 <= dim < len(shape)):
            p.fail(f"leaf {key!r} is sharded on invalid dim {dim!r}")
        if rows != "node" and rows != "own":
            p.fail(f"leaf {key!r} has invalid rows {rows!r}")
        return _LeafEntry(key, dtype, shape, _SHARDS[dim], own_rows=rows == "own")
    if kind == "replicate":
        writer = e.get("writer")
        if not (type(writer) is int and 0 <= writer < world):
            p.fail(f"leaf {key!r} has an invalid writer {writer!r}")
        return _LeafEntry(key, dtype, shape, _REPLICATE, writer=writer)
    if kind == "per_rank":
        return _LeafEntry(key, dtype, shape, _PER_RANK)
    if kind == "boxes":
        n = e.get("chunks")
        if not (type(n) is int and 0 <= n <= world):
            p.fail(f"leaf {key!r} has an invalid chunk count {n!r}")
        return _LeafEntry(key, dtype, shape, _BOXES, chunks=n)
    p.fail(f"leaf {key!r} has unknown placement {pl!r}")


def _boxes(p: Parser, e: _LeafEntry, cursor: _Cursor, itemsize: int, world: int, sums: np.ndarray) -> BoxChunks:
    n, d = e.chunks, len(e.shape)
    ranks = cursor.take(_I8, n)
    offsets = cursor.take(_I8, n * d).reshape(n, d)
    sizes = cursor.take(_I8, n * d).reshape(n, d)
    ok = bool((ranks >= 0).all() and (ranks < world).all()) and len(np.unique(ranks)) == n
    p.check(ok, f"leaf {e.key!r} lists an invalid or repeated rank")
    p.check(bool((offsets >= 0).all() and (sizes >= 0).all()), f"leaf {e.key!r} has a negative chunk box")
    table = BoxChunks(itemsize, ranks, offsets, sizes, sums)
    problems = box_tiling_problems(e.shape, offsets, sizes)
    p.check(not problems, f"leaf {e.key!r} chunks do not tile shape {list(e.shape)}: {'; '.join(problems)}")
    return table


class _Cursor:
    """Reads consecutive arrays from the index as numpy views (no copy)."""

    def __init__(self, data: bytes):
        self.data, self.pos = data, 0

    def take(self, dtype: np.dtype, count: int) -> np.ndarray:
        out = np.frombuffer(self.data, dtype=dtype, count=count, offset=self.pos)
        self.pos += 8 * count
        return out
