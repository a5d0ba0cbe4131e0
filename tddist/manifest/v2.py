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

from dataclasses import dataclass
from typing import Any

import numpy as np
import xxhash

from .. import format as fmt
from ..core.sharding import Boxes, PerRank, Placement, Replicate, Shard, box_tiling_problems
from ..core.types import Key, ManifestFiles
from ..errors import ManifestError
from .checksum import seal
from .chunks import BoxChunks, ChunkTable, ReplicaChunks, ShardChunks
from .model import Leaf, Manifest, ObjectLeaf, Parser, add_leaf, parse_nodes

_I8 = np.dtype("<i8")
_U8 = np.dtype("<u8")
PACKINGS = ("packed", "memmap")


def encode(m: Manifest) -> ManifestFiles:
    """The files of manifest ``m`` (see the module docstring and docs/format.md)."""
    node_rows = {k: _rows_to_encode(m, k) for k, b in m.nodes.items() if b}
    rows = [r.tobytes() for r in node_rows.values()]
    own_rows: list[bytes] = []
    sums: list[bytes] = []
    boxes: list[bytes] = []
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
        leaves.append(entry)
    index = b"".join(rows + own_rows + sums + boxes)
    obj = {
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
        "index": {"size": len(index), "checksum": xxhash.xxh3_64_hexdigest(index)},
        "metadata": m.metadata,
        "nodes": [{"key": list(k), "batch_size": list(b)} for k, b in m.nodes.items()],
        "leaves": leaves,
        "objects": [_object_entry(o) for o in m.objects.values()],
    }
    return ManifestFiles(seal(fmt.dumps(obj)), index)  # version 3: the checksum of its own bytes first


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


@dataclass(frozen=True)
class _IndexRows:
    """The rows per rank read from the index (sections 1 and 2), which sharded leaves split by.

    Attributes:
        nodes: each batched node's rows per rank.
        own: each sharded leaf's own lengths along its shard dim per rank (``"rows": "own"``).
    """

    nodes: dict[Key, np.ndarray]
    own: dict[Key, np.ndarray]


def parse_body(p: Parser, obj: dict[str, Any], m: Manifest, index: bytes | None) -> None:
    """Nodes and leaves of a version-2 manifest and its index into ``m``."""
    world = m.world_size
    _parse_packing_and_digest(p, obj, m)
    parse_nodes(p, obj, m)
    p.check(not m.node_rows, "lists node rows in the JSON; version 2 keeps them in the index")
    p.check(() in m.nodes, "has no root node (key [])")
    entries = [_leaf_entry(p, e, world) for e in p.list_of(obj, "leaves")]
    batched = [k for k, b in m.nodes.items() if b]
    data = _checked_index(p, obj, index, _index_size(entries, len(batched), world))
    cursor = _Cursor(data)
    node_rows = _node_rows(p, m, cursor, batched)  # the index's sections, in order
    own_rows = {e.key: cursor.take(_I8, world) for e in entries if e.own_rows}
    sums = {e.key: cursor.take(_U8, _chunk_count(e, world)) for e in entries}
    rows = _IndexRows(nodes=node_rows, own=own_rows)
    for e in entries:
        table = _leaf_table(p, e, world, rows, sums[e.key], cursor)
        add_leaf(p, m, Leaf(e.key, e.dtype, e.shape, e.placement, table))
    p.check(cursor.pos == len(data), "has bytes left over at the end of its index")


def _parse_packing_and_digest(p: Parser, obj: dict[str, Any], m: Manifest) -> None:
    """The packing (an archive's is always "memmap") and the structure digest into ``m``."""
    m.packing = obj.get("packing", "")
    p.check(m.packing in PACKINGS, f"has unknown packing {m.packing!r}")
    p.check(m.layout == "directory" or m.packing == "memmap", "is an archive, whose packing must be 'memmap'")
    digest = obj.get("structure_digest", "")
    p.check(isinstance(digest, str) and len(digest) <= 64, "has an invalid structure_digest")
    m.structure_digest = digest


def _index_size(entries: list[_LeafEntry], batched_nodes: int, world: int) -> int:
    """The bytes of the index that the JSON's structure implies (its four sections, 8 bytes a number)."""
    return 8 * (
        world * batched_nodes
        + sum(world for e in entries if e.own_rows)
        + sum(_chunk_count(e, world) for e in entries)
        + sum(e.chunks * (1 + 2 * len(e.shape)) for e in entries if isinstance(e.placement, Boxes))
    )


def _checked_index(p: Parser, obj: dict[str, Any], index: bytes | None, expected: int) -> bytes:
    """The index, once its size (as declared and as read) and its checksum match what the JSON says.

    A damaged or swapped index is refused here, before anything is read from it.
    """
    meta = obj.get("index")
    p.check(isinstance(meta, dict) and type(meta.get("size")) is int, "has no index size")
    assert isinstance(meta, dict)
    p.check(meta["size"] == expected, f"declares an index of {meta['size']} bytes, its structure needs {expected}")
    if index is None:
        p.fail(f"has no index ({fmt.INDEX_NAME})")
    p.check(len(index) == expected, f"has an index of {len(index)} bytes, expected {expected} (truncated?)")
    p.check(xxhash.xxh3_64_hexdigest(index) == meta.get("checksum"), "has an index that fails its checksum")
    return index


def _node_rows(p: Parser, m: Manifest, cursor: _Cursor, batched: list[Key]) -> dict[Key, np.ndarray]:
    """Each batched node's rows per rank (index section 1), checked against its batch size and kept in ``m``."""
    node_rows: dict[Key, np.ndarray] = {}
    for k in batched:
        rows = node_rows[k] = cursor.take(_I8, m.world_size)
        p.check(bool((rows >= 0).all()) and int(rows.sum()) == m.nodes[k][0], f"has invalid rows for node {k!r}")
        m.node_rows[k] = rows.tolist()
    return node_rows


def _leaf_table(
    p: Parser, e: _LeafEntry, world: int, rows: _IndexRows, sums: np.ndarray, cursor: _Cursor
) -> ChunkTable:
    """A leaf's chunk table from its JSON entry and its index columns (a DTensor's boxes read from ``cursor``)."""
    itemsize = fmt.dtype_itemsize(e.dtype)
    if isinstance(e.placement, Shard):
        return _shard_table(p, e, e.placement.dim, rows, itemsize, sums)
    if isinstance(e.placement, PerRank):
        ok = len(e.shape) >= 1 and e.shape[0] == world
        p.check(ok, f"per-rank leaf {e.key!r} has shape {list(e.shape)}, which does not start with {world} ranks")
        return ShardChunks(e.shape, 0, itemsize, np.ones(world, dtype=_I8), sums)
    if isinstance(e.placement, Replicate):
        return ReplicaChunks(e.shape, itemsize, e.writer, int(sums[0]))
    return _boxes(p, e, cursor, itemsize, world, sums)


def _shard_table(p: Parser, e: _LeafEntry, dim: int, rows: _IndexRows, itemsize: int, sums: np.ndarray) -> ShardChunks:
    """A sharded leaf's table: its own rows per rank, or its node's (``"rows": "node"``, dim 0 only).

    Own rows along dim 0 must equal the node's where the node has rows: a
    TensorDict's leaves split their batch dim as the node does.
    """
    rows_of = rows.own.get(e.key)
    parent_rows = rows.nodes.get(e.key[:-1])
    if rows_of is not None and dim == 0 and parent_rows is not None:
        p.check(
            bool(np.array_equal(rows_of, parent_rows)),
            f"leaf {e.key!r} has rows per rank that differ from those of its node {e.key[:-1]!r}",
        )
    if rows_of is None:
        parent = rows.nodes.get(e.key[:-1])
        p.check(parent is not None, f"leaf {e.key!r} takes its rows from a node without rows")
        p.check(dim == 0, f"leaf {e.key!r} takes its rows from a node but is sharded along dim {dim}, not 0")
        assert parent is not None
        rows_of = parent
    ok = bool((rows_of >= 0).all()) and int(rows_of.sum()) == e.shape[dim]
    p.check(ok, f"leaf {e.key!r} has rows that are negative or do not sum to {e.shape[dim]}")
    return ShardChunks(e.shape, dim, itemsize, rows_of, sums)


def _chunk_count(e: _LeafEntry, world: int) -> int:
    if isinstance(e.placement, (Shard, PerRank)):
        return world
    return 1 if isinstance(e.placement, Replicate) else e.chunks


def _leaf_entry(p: Parser, e: Any, world: int) -> _LeafEntry:
    p.check(isinstance(e, dict), "has a leaf that is not an object")
    key = p.key(e.get("key"), allow_empty=False)
    dtype = e.get("dtype")
    if not fmt.is_dtype_name(dtype):
        p.fail(f"leaf {key!r} has unknown dtype {dtype!r}")
    shape = p.shape(e.get("shape"), f"leaf {key!r} shape")
    pl = e.get("placement")
    kind = pl.get("type") if isinstance(pl, dict) else None
    if kind == "shard":
        assert isinstance(pl, dict)
        dim = pl.get("dim")
        if not (type(dim) is int and 0 <= dim < len(shape)):
            p.fail(f"leaf {key!r} is sharded on invalid dim {dim!r}")
        p.check(e.get("rows") in ("node", "own"), f"leaf {key!r} has invalid rows {e.get('rows')!r}")
        return _LeafEntry(key, dtype, shape, Shard(dim), own_rows=e["rows"] == "own")
    if kind == "replicate":
        writer = e.get("writer")
        p.check(type(writer) is int and 0 <= writer < world, f"leaf {key!r} has an invalid writer {writer!r}")
        return _LeafEntry(key, dtype, shape, Replicate(), writer=writer)
    if kind == "per_rank":
        return _LeafEntry(key, dtype, shape, PerRank())
    if kind == "boxes":
        n = e.get("chunks")
        p.check(type(n) is int and 0 <= n <= world, f"leaf {key!r} has an invalid chunk count {n!r}")
        return _LeafEntry(key, dtype, shape, Boxes(), chunks=n)
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
