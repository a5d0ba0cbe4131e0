"""The manifest model: merging the ranks' fragments, validating, (de)serialising.

A *fragment* is what one rank reports after writing its shard (its vote): the
nodes (sub-TensorDicts) it holds and, for each leaf, its local shape,
placement, and, if it wrote the leaf, the byte size and checksum. Rank 0
merges the fragments into a ``Manifest``; readers parse it back with
``parse_manifest``, which trusts nothing in the file.
"""

from __future__ import annotations

import datetime
import math
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, NoReturn

from . import format as fmt
from .errors import ManifestError, ShardingError
from .sharding import Box, Boxes, Placement, Replicate, Shard, full_box, shard_box, tiling_problems
from .types import Fragment, FragmentLeaf, Key, StoredBytes

if TYPE_CHECKING:
    import torch

_HEX16 = re.compile(r"^[0-9a-f]{16}$")
_MAX_ELEMENTS = 1 << 56


@dataclass(frozen=True)
class Chunk:
    """One stored piece of a leaf: who wrote it, where it lies in the global tensor, its bytes.

    Attributes:
        rank: The rank that wrote the piece (its file is in that rank's directory).
        box: ``(offsets, sizes)`` of the piece in the leaf's global tensor.
        nbytes: The stored size in bytes (0 for an empty piece, which has no file).
        checksum: The piece's checksum (see ``format.CHECKSUM_ALGORITHM``).
    """

    rank: int
    box: Box
    nbytes: int
    checksum: str


@dataclass(frozen=True)
class Leaf:
    """One tensor leaf of the checkpoint: its global shape, placement and stored chunks.

    Attributes:
        key: The leaf's key, one string per nesting level.
        dtype_name: The dtype's manifest name (``"float32"``); ``dtype`` gives the torch dtype.
        shape: The global shape (all ranks' pieces together).
        placement: How the ranks' pieces make up the global tensor.
        chunks: The stored pieces; together they tile ``shape`` exactly.
    """

    key: Key
    dtype_name: str  # see format.dtype_name; kept as a name so reading a manifest needs no torch
    shape: tuple[int, ...]
    placement: Placement
    chunks: list[Chunk]

    @property
    def dtype(self) -> torch.dtype:
        """The leaf's torch dtype (imports torch)."""
        return fmt.torch_dtype(self.dtype_name)


@dataclass
class ObjectLeaf:
    """A non-tensor leaf. ``placement``: "replicate" (one value, written once), "per_rank"
    (one value per saving rank) or "shard" (a stack: one list of row values per rank).

    Attributes:
        key: The leaf's key, one string per nesting level.
        placement: "replicate", "per_rank" or "shard", as above.
        values: The encoded values (see ``format.encode_object``): one, or one per rank.
    """

    key: Key
    placement: str
    values: list[Any]  # encoded values (see format.encode_object)


@dataclass
class Manifest:
    """What a committed checkpoint holds: its structure, every leaf's chunks, metadata.

    ``tddist.read_manifest`` returns it without reading any tensor data; it is
    the parsed and validated ``tddist.json`` (see docs/format.md).

    Attributes:
        world_size: How many ranks saved the checkpoint.
        nodes: Each (sub-)TensorDict's global batch size, by key; the root is ``()``.
        leaves: Every tensor leaf, by key.
        objects: Every non-tensor leaf, by key.
        metadata: The ``metadata=`` given to ``save`` (JSON values).
        robust_key: Whether file names percent-encode the keys (``robust_key=True`` of ``save``).
        created: When the checkpoint was committed (ISO 8601, UTC).
        tddist_version: The tddist version that wrote it.
        version: The format version.
        layout: "directory" or "archive".
        node_rows: For each batched node, the dim-0 rows each rank saved, in rank order.
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


# --- fragments -----------------------------------------------------------------


def merge_fragments(
    fragments: list[Fragment],
    *,
    metadata: Mapping[str, Any] | None,
    robust_key: bool,
    version: str,
    layout: str = "directory",
) -> Manifest:
    """Validate the ranks' fragments against each other and build the manifest (rank 0).

    Raises ShardingError naming the keys and ranks that disagree.
    """
    world = len(fragments)
    first = fragments[0]
    node_keys = [k for k, _ in first.nodes]
    leaf_keys = [e.key for e in first.leaves]
    for f in fragments[1:]:
        if [k for k, _ in f.nodes] != node_keys or [e.key for e in f.leaves] != leaf_keys:
            _raise_structure_mismatch(first, f)

    nodes: dict[Key, tuple[int, ...]] = {}
    node_rows: dict[Key, list[int]] = {}
    for i, key in enumerate(node_keys):
        sizes = [f.nodes[i][1] for f in fragments]
        if any(len(s) != len(sizes[0]) or s[1:] != sizes[0][1:] for s in sizes):
            raise ShardingError(
                f"the TensorDict at {_show(key)} has batch sizes that differ beyond dim 0 across ranks: "
                f"{_by_rank(sizes)}; only dim 0 may differ (it is the sharded batch dim)"
            )
        nodes[key] = (sum(s[0] for s in sizes), *sizes[0][1:]) if sizes[0] else ()
        if sizes[0]:
            node_rows[key] = [s[0] for s in sizes]

    leaves: dict[Key, Leaf] = {}
    for i, key in enumerate(leaf_keys):
        leaves[key] = _merge_leaf(key, [f.leaves[i] for f in fragments])
    return Manifest(
        world_size=world,
        nodes=nodes,
        leaves=leaves,
        node_rows=node_rows,
        objects=_merge_objects(fragments),
        metadata=dict(metadata or {}),
        robust_key=robust_key,
        created=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        tddist_version=version,
        layout=layout,
    )


def _placement_kind(e: FragmentLeaf) -> tuple[str, int | None]:
    """What must be equal across ranks about a leaf's placement."""
    return (type(e.placement).__name__, getattr(e.placement, "dim", None))


def _merge_leaf(key: Key, entries: list[FragmentLeaf]) -> Leaf:
    e0 = entries[0]
    if isinstance(e0.placement, Boxes):
        return _merge_boxes(key, entries)
    if any(e.dtype != e0.dtype for e in entries):
        raise ShardingError(
            f"leaf {_show(key)} has a different dtype on different ranks: "
            f"{_by_rank([e.dtype for e in entries])}; every rank must save the same dtype"
        )
    if any(_placement_kind(e) != _placement_kind(e0) for e in entries):
        raise ShardingError(
            f"leaf {_show(key)} has a different placement on different ranks: "
            f"{_by_rank([e.placement for e in entries])}; every rank must save the same placement"
        )
    shapes = [e.shape for e in entries]
    if isinstance(e0.placement, Replicate):
        if any(s != shapes[0] for s in shapes):
            raise ShardingError(
                f"replicated leaf {_show(key)} has different shapes on different ranks: {_by_rank(shapes)}; "
                f"make them equal, or shard it with placements={{{_show(key)}: tddist.Shard(0)}}"
            )
        writers = [(r, e.stored) for r, e in enumerate(entries) if e.stored is not None]
        expected = writers[0][1].checksum
        differing = [r for r, e in enumerate(entries) if e.replica_checksum not in (None, expected)]
        if differing:
            raise ShardingError(
                f"replicated leaf {_show(key)} differs between ranks: rank(s) {differing[:16]} hold other values "
                f"than rank {writers[0][0]}, whose copy would be written; make the replicas equal, or shard the leaf"
            )
        chunks = [Chunk(r, full_box(shapes[0]), s.nbytes, s.checksum) for r, s in writers]
        return Leaf(key, e0.dtype, shapes[0], Replicate(), chunks)
    assert isinstance(e0.placement, Shard)
    dim = e0.placement.dim
    ndims = {len(s) for s in shapes}
    if ndims != {len(shapes[0])} or dim >= len(shapes[0]):
        raise ShardingError(
            f"leaf {_show(key)} is sharded along dim {dim} but has shapes {_by_rank(shapes)}; "
            f"every rank needs a tensor with more than {dim} dims and the same number of dims"
        )
    others = {s[:dim] + s[dim + 1 :] for s in shapes}
    if len(others) != 1:
        raise ShardingError(
            f"leaf {_show(key)} is sharded along dim {dim}, but its shapes differ in other dims across ranks: "
            f"{_by_rank(shapes)}; only dim {dim} may differ"
        )
    total = sum(s[dim] for s in shapes)
    gshape = shapes[0][:dim] + (total,) + shapes[0][dim + 1 :]
    chunks, start = [], 0
    for r, (e, s) in enumerate(zip(entries, shapes)):
        stored = _stored(key, r, e)
        chunks.append(Chunk(r, shard_box(gshape, dim, start, start + s[dim]), stored.nbytes, stored.checksum))
        start += s[dim]
    return Leaf(key, e0.dtype, gshape, Shard(dim), chunks)


def _stored(key: Key, rank: int, e: FragmentLeaf) -> StoredBytes:
    if e.stored is None:
        raise ShardingError(f"rank {rank} did not store its shard of leaf {_show(key)}")
    return e.stored


def _merge_boxes(key: Key, entries: list[FragmentLeaf]) -> Leaf:
    """A DTensor leaf: each writing rank's box; together they must tile the global shape."""

    def kind(e: FragmentLeaf) -> tuple[str, str, tuple[int, ...] | None]:
        return (e.dtype, type(e.placement).__name__, e.dtensor.global_shape if e.dtensor else None)

    kinds = {kind(e) for e in entries}
    if len(kinds) != 1 or entries[0].dtensor is None:
        raise ShardingError(
            f"DTensor leaf {_show(key)} differs across ranks in dtype, placement kind or global shape: "
            f"{_by_rank([kind(e) for e in entries])}"
        )
    gshape = entries[0].dtensor.global_shape
    chunks = [
        Chunk(r, e.dtensor.box, e.stored.nbytes, e.stored.checksum)
        for r, e in enumerate(entries)
        if e.stored is not None and e.dtensor is not None
    ]
    problems = tiling_problems(gshape, [c.box for c in chunks])
    if problems:
        raise ShardingError(
            f"the ranks' shards of DTensor leaf {_show(key)} do not tile its global shape {list(gshape)}: "
            f"{'; '.join(problems)}"
        )
    return Leaf(key, entries[0].dtype, gshape, Boxes(), chunks)


def _merge_objects(fragments: list[Fragment]) -> dict[Key, ObjectLeaf]:
    """Non-tensor leaves: equal values on all ranks are stored once, others per rank; stacks are sharded."""
    keys = [(o.key, o.kind) for o in fragments[0].objects]
    out: dict[Key, ObjectLeaf] = {}
    for f in fragments[1:]:
        theirs = [(o.key, o.kind) for o in f.objects]
        if theirs != keys:
            raise ShardingError(
                f"rank 0 and rank {f.rank} save different non-tensor entries ({keys[:5]} vs {theirs[:5]}); "
                f"every rank must pass a TensorDict with the same structure"
            )
    for i, (key, kind) in enumerate(keys):
        values = [f.objects[i].value for f in fragments]
        encoded = [fmt.dumps(v) for v in values]  # 1, 1.0 and True are ==, but not the same value
        if kind == "stack":
            out[key] = ObjectLeaf(key, "shard", values)
        elif all(e == encoded[0] for e in encoded):
            out[key] = ObjectLeaf(key, "replicate", values[:1])
        else:
            out[key] = ObjectLeaf(key, "per_rank", values)
    return out


def _raise_structure_mismatch(a: Fragment, b: Fragment) -> None:
    ka = {e.key for e in a.leaves} | {("<node>", *k) for k, _ in a.nodes}
    kb = {e.key for e in b.leaves} | {("<node>", *k) for k, _ in b.nodes}
    only_a = sorted(_show(k) for k in ka - kb)[:5]
    only_b = sorted(_show(k) for k in kb - ka)[:5]
    raise ShardingError(
        f"rank {a.rank} and rank {b.rank} save different keys (only on rank {a.rank}: {only_a}, "
        f"only on rank {b.rank}: {only_b}, or the same keys in another order); every rank must pass "
        f"a TensorDict with the same structure"
    )


def _by_rank(values: list[Any]) -> str:
    shown = ", ".join(f"rank {r}: {v}" for r, v in list(enumerate(values))[:8])
    return shown + (", ..." if len(values) > 8 else "")


def _show(key: Key) -> str:
    return repr(key[0]) if len(key) == 1 else repr(tuple(key))


# --- JSON ---------------------------------------------------------------------


def to_json(m: Manifest) -> dict[str, Any]:
    """The manifest as written to disk (see docs/format.md)."""
    leaves = []
    for leaf in m.leaves.values():
        if isinstance(leaf.placement, Shard):
            d = leaf.placement.dim
            placement = {"type": "shard", "dim": d}
            chunks = [[c.rank, c.box[0][d], c.box[1][d], c.nbytes, c.checksum] for c in leaf.chunks]
        elif isinstance(leaf.placement, Boxes):
            placement = {"type": "boxes"}
            chunks = [[c.rank, list(c.box[0]), list(c.box[1]), c.nbytes, c.checksum] for c in leaf.chunks]
        else:
            placement = {"type": "replicate"}
            chunks = [[c.rank, c.nbytes, c.checksum] for c in leaf.chunks]
        leaves.append(
            {
                "key": list(leaf.key),
                "dtype": leaf.dtype_name,
                "shape": list(leaf.shape),
                "placement": placement,
                "chunks": chunks,
            }
        )
    return {
        "format": fmt.FORMAT_NAME,
        "version": m.version,
        "tddist_version": m.tddist_version,
        "created": m.created,
        "world_size": m.world_size,
        "layout": m.layout,
        "robust_key": m.robust_key,
        "checksum": {"algorithm": fmt.CHECKSUM_ALGORITHM, "block_size": fmt.CHECKSUM_BLOCK},
        "metadata": m.metadata,
        "nodes": [
            {"key": list(k), "batch_size": list(b), **({"rows": m.node_rows[k]} if k in m.node_rows else {})}
            for k, b in m.nodes.items()
        ],
        "leaves": leaves,
        "objects": [{"key": list(o.key), "placement": o.placement, "values": o.values} for o in m.objects.values()],
    }


def parse_manifest(obj: Any, where: str = "manifest") -> Manifest:
    """Build a Manifest from parsed JSON, validating every field (the file is untrusted)."""
    p = _Parser(where)
    p.check(isinstance(obj, dict), "is not a JSON object")
    p.check(obj.get("format") == fmt.FORMAT_NAME, f"has format {obj.get('format')!r}, expected {fmt.FORMAT_NAME!r}")
    version = obj.get("version")
    p.check(type(version) is int, "has no integer 'version'")
    if version > fmt.FORMAT_VERSION:
        raise ManifestError(
            f"{where} has format version {version}, newer than this tddist reads ({fmt.FORMAT_VERSION}); "
            f"upgrade tddist to load it"
        )
    p.check(version >= 1, f"has invalid version {version}")
    world = obj.get("world_size")
    p.check(type(world) is int and world >= 1, f"has invalid world_size {world!r}")
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

    nodes: dict[Key, tuple[int, ...]] = {}
    node_rows: dict[Key, list[int]] = {}
    for n in p.list_of(obj, "nodes"):
        p.check(isinstance(n, dict), "has a node that is not an object")
        key = p.key(n.get("key"), allow_empty=True)
        p.check(key not in nodes, f"lists node {key!r} twice")
        p.check(not key or key[:-1] in nodes, f"has node {key!r} whose parent node is not listed (before it)")
        nodes[key] = p.shape(n.get("batch_size"), f"node {key!r} batch_size")
        if "rows" in n:
            rows = n["rows"]
            ok = isinstance(rows, list) and len(rows) == world and all(type(r) is int and r >= 0 for r in rows)
            p.check(
                ok and nodes[key] != () and sum(rows) == nodes[key][0], f"has invalid rows {rows!r} for node {key!r}"
            )
            node_rows[key] = rows

    p.check(() in nodes, "has no root node (key [])")
    leaves: dict[Key, Leaf] = {}
    for e in p.list_of(obj, "leaves"):
        p.check(isinstance(e, dict), "has a leaf that is not an object")
        leaf = _parse_leaf(p, e, world)
        p.check(leaf.key not in leaves, f"lists leaf {leaf.key!r} twice")
        p.check(leaf.key not in nodes, f"has {leaf.key!r} both as a node and as a leaf")
        p.check(leaf.key[:-1] in nodes, f"has leaf {leaf.key!r} whose parent node is not listed")
        leaves[leaf.key] = leaf
    objects: dict[Key, ObjectLeaf] = {}
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
        objects[key] = ObjectLeaf(key, placement, values)
    if not robust:
        for key in [*nodes, *leaves, *objects]:
            for part in key:
                why = fmt.verbatim_key_problem(part)
                p.check(why is None, f"has key {list(key)}, unusable as a file name with robust_key=false: {why}")
    return Manifest(
        world_size=world,
        nodes=nodes,
        leaves=leaves,
        node_rows=node_rows,
        objects=objects,
        metadata=metadata,
        robust_key=robust,
        created=str(obj.get("created", "")),
        tddist_version=str(obj.get("tddist_version", "")),
        version=version,
        layout=obj["layout"],
    )


def _parse_leaf(p: _Parser, e: dict[str, Any], world: int) -> Leaf:
    key = p.key(e.get("key"), allow_empty=False)
    dtype = e.get("dtype")
    if not fmt.is_dtype_name(dtype):
        p.fail(f"leaf {key!r} has unknown dtype {dtype!r}")
    shape = p.shape(e.get("shape"), f"leaf {key!r} shape")
    itemsize = fmt.dtype_itemsize(dtype)
    pl = e.get("placement")
    if not isinstance(pl, dict):
        p.fail(f"leaf {key!r} has no placement object")
    raw_chunks = p.list_of(e, "chunks")
    chunks = []
    if pl.get("type") == "shard":
        dim = pl.get("dim")
        if not (type(dim) is int and 0 <= dim < len(shape)):
            p.fail(f"leaf {key!r} is sharded on invalid dim {dim!r}")
        placement: Placement = Shard(dim)
        for c in raw_chunks:
            p.check(isinstance(c, list) and len(c) == 5, f"leaf {key!r} has a malformed chunk {c!r}")
            rank, start, length, nbytes, checksum = c
            p.check(all(type(v) is int for v in (start, length)), f"leaf {key!r} has a malformed chunk {c!r}")
            p.check(start >= 0 and length >= 0, f"leaf {key!r} has a negative chunk offset or size {c!r}")
            chunks.append(
                _chunk(p, key, rank, shard_box(shape, dim, start, start + length), nbytes, checksum, world, itemsize)
            )
    elif pl.get("type") == "boxes":
        placement = Boxes()
        for c in raw_chunks:
            p.check(isinstance(c, list) and len(c) == 5, f"leaf {key!r} has a malformed chunk {c!r}")
            rank, offs, sizes, nbytes, checksum = c
            ok = all(
                isinstance(v, list) and len(v) == len(shape) and all(type(x) is int and x >= 0 for x in v)
                for v in (offs, sizes)
            )
            p.check(ok, f"leaf {key!r} has a malformed chunk box {c!r}")
            chunks.append(_chunk(p, key, rank, (tuple(offs), tuple(sizes)), nbytes, checksum, world, itemsize))
    elif pl.get("type") == "replicate":
        placement = Replicate()
        for c in raw_chunks:
            p.check(isinstance(c, list) and len(c) == 3, f"leaf {key!r} has a malformed chunk {c!r}")
            chunks.append(_chunk(p, key, c[0], full_box(shape), c[1], c[2], world, itemsize))
        p.check(len(chunks) == 1, f"replicated leaf {key!r} must have exactly one chunk, has {len(chunks)}")
    else:
        p.fail(f"leaf {key!r} has unknown placement {pl!r}")
    p.check(len({c.rank for c in chunks}) == len(chunks), f"leaf {key!r} lists a rank twice")
    problems = tiling_problems(shape, [c.box for c in chunks])
    p.check(not problems, f"leaf {key!r} chunks do not tile shape {list(shape)}: {'; '.join(problems)}")
    if isinstance(placement, Shard):
        p.check(
            [c.rank for c in chunks] == list(range(world)), f"leaf {key!r} must list one chunk per rank, in rank order"
        )
    return Leaf(key, dtype, shape, placement, chunks)


def _chunk(p: _Parser, key: Key, rank: Any, box: Box, nbytes: Any, checksum: Any, world: int, itemsize: int) -> Chunk:
    p.check(type(rank) is int and 0 <= rank < world, f"leaf {key!r} has a chunk of invalid rank {rank!r}")
    expected = math.prod(box[1]) * itemsize
    p.check(
        type(nbytes) is int and nbytes == expected,
        f"leaf {key!r} rank {rank} declares {nbytes!r} bytes, its shape needs {expected}",
    )
    p.check(
        isinstance(checksum, str) and _HEX16.match(checksum) is not None,
        f"leaf {key!r} rank {rank} has a malformed checksum",
    )
    return Chunk(rank, box, nbytes, checksum)


class _Parser:
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

    def key(self, v: Any, allow_empty: bool) -> Key:
        ok = isinstance(v, list) and all(isinstance(k, str) for k in v) and (allow_empty or v)
        self.check(bool(ok) or (allow_empty and v == []), f"has an invalid key {v!r}")
        return tuple(v)

    def shape(self, v: Any, what: str) -> tuple[int, ...]:
        self.check(
            isinstance(v, list) and len(v) <= 64 and all(type(s) is int and 0 <= s < _MAX_ELEMENTS for s in v),
            f"has invalid {what} {v!r}",
        )
        self.check(math.prod(v) < _MAX_ELEMENTS, f"has absurd {what} {v!r}")
        return tuple(v)
