"""Reading a version-1 manifest: every chunk of every leaf listed in the JSON.

Version 1 is read forever (``docs/format.md``, section 10); tddist writes
version 2. The chunks become the same columnar tables a version-2 manifest
gives, so nothing after parsing knows the version.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Any

from .. import format as fmt
from ..core.sharding import Box, Boxes, Placement, Replicate, Shard, full_box, shard_box, tiling_problems
from ..core.types import Key
from .chunks import Chunk, table_from_chunks
from .model import Leaf, Manifest, Parser, add_leaf, parse_nodes

_HEX16 = re.compile(r"^[0-9a-f]{16}$")


def parse_body(p: Parser, obj: dict[str, Any], m: Manifest) -> None:
    """Nodes and leaves of a version-1 manifest into ``m``."""
    parse_nodes(p, obj, m)
    p.check(() in m.nodes, "has no root node (key [])")
    for e in p.list_of(obj, "leaves"):
        p.check(isinstance(e, dict), "has a leaf that is not an object")
        leaf = _parse_leaf(p, e, m.world_size)
        rows = m.node_rows.get(leaf.key[:-1])
        if rows is not None and isinstance(leaf.placement, Shard) and leaf.placement.dim == 0:
            lengths = [c.box[1][0] for c in leaf.chunks]
            p.check(lengths == rows, f"leaf {leaf.key!r} has rows per rank that differ from those of its node")
        add_leaf(p, m, leaf)


@dataclass(frozen=True)
class _LeafHead:
    """What every chunk of a version-1 leaf is checked against.

    Attributes:
        key: the leaf's key (named in every message).
        shape: its global shape.
        itemsize: the bytes per element of its dtype.
        world: the world size of the save (a chunk's rank is below it).
    """

    key: Key
    shape: tuple[int, ...]
    itemsize: int
    world: int


def _parse_leaf(p: Parser, e: dict[str, Any], world: int) -> Leaf:
    """One leaf of a version-1 manifest, every chunk checked, as the columnar table a version-2 one gives."""
    key = p.key(e.get("key"), allow_empty=False)
    dtype = e.get("dtype")
    if not fmt.is_dtype_name(dtype):
        p.fail(f"leaf {key!r} has unknown dtype {dtype!r}")
    shape = p.shape_of(e.get("shape"), lambda: f"leaf {key!r} shape")
    head = _LeafHead(key=key, shape=shape, itemsize=fmt.dtype_itemsize(dtype), world=world)
    pl = e.get("placement")
    if not isinstance(pl, dict):
        p.fail(f"leaf {key!r} has no placement object")
    raw_chunks = p.list_of(e, "chunks")
    placement = _placement(p, key, pl, len(shape))
    chunks = _parse_chunks(p, head, placement, raw_chunks)
    _check_chunks(p, head, placement, chunks)
    kind = "shard" if isinstance(placement, Shard) else "boxes" if isinstance(placement, Boxes) else "replicate"
    dim = placement.dim if isinstance(placement, Shard) else None
    return Leaf(key, dtype, shape, placement, table_from_chunks(shape, dim, head.itemsize, kind, chunks))


def _placement(p: Parser, key: Key, pl: dict[str, Any], ndim: int) -> Placement:
    """A version-1 leaf's placement: sharded (on a dim of its shape), boxes (a DTensor's) or replicated."""
    kind = pl.get("type")
    if kind == "shard":
        dim = pl.get("dim")
        if not (type(dim) is int and 0 <= dim < ndim):
            p.fail(f"leaf {key!r} is sharded on invalid dim {dim!r}")
        return Shard(dim)
    if kind == "boxes":
        return Boxes()
    if kind == "replicate":
        return Replicate()
    p.fail(f"leaf {key!r} has unknown placement {pl!r}")


def _parse_chunks(p: Parser, head: _LeafHead, placement: Placement, raw_chunks: list[Any]) -> list[Chunk]:
    """The leaf's chunks, each in the JSON form of its placement; a replicated leaf has exactly one."""
    if isinstance(placement, Shard):
        return [_shard_chunk(p, head, placement.dim, c) for c in raw_chunks]
    if isinstance(placement, Boxes):
        return [_box_chunk(p, head, c) for c in raw_chunks]
    chunks = [_replica_chunk(p, head, c) for c in raw_chunks]
    p.check(len(chunks) == 1, f"replicated leaf {head.key!r} must have exactly one chunk, has {len(chunks)}")
    return chunks


def _shard_chunk(p: Parser, head: _LeafHead, dim: int, c: Any) -> Chunk:
    """A sharded leaf's chunk ``[rank, start, length, nbytes, checksum]``: a slab along ``dim``."""
    key = head.key
    p.check(isinstance(c, list) and len(c) == 5, f"leaf {key!r} has a malformed chunk {c!r}")
    rank, start, length, nbytes, checksum = c
    p.check(all(type(v) is int for v in (start, length)), f"leaf {key!r} has a malformed chunk {c!r}")
    p.check(start >= 0 and length >= 0, f"leaf {key!r} has a negative chunk offset or size {c!r}")
    return _chunk(p, head, rank, shard_box(head.shape, dim, start, start + length), nbytes, checksum)


def _box_chunk(p: Parser, head: _LeafHead, c: Any) -> Chunk:
    """A DTensor leaf's chunk ``[rank, offsets, sizes, nbytes, checksum]``: any box of its shape."""
    p.check(isinstance(c, list) and len(c) == 5, f"leaf {head.key!r} has a malformed chunk {c!r}")
    rank, offs, sizes, nbytes, checksum = c
    ok = all(
        isinstance(v, list) and len(v) == len(head.shape) and all(type(x) is int and x >= 0 for x in v)
        for v in (offs, sizes)
    )
    p.check(ok, f"leaf {head.key!r} has a malformed chunk box {c!r}")
    return _chunk(p, head, rank, (tuple(offs), tuple(sizes)), nbytes, checksum)


def _replica_chunk(p: Parser, head: _LeafHead, c: Any) -> Chunk:
    """A replicated leaf's chunk ``[rank, nbytes, checksum]``: the whole leaf, written by ``rank``."""
    p.check(isinstance(c, list) and len(c) == 3, f"leaf {head.key!r} has a malformed chunk {c!r}")
    return _chunk(p, head, c[0], full_box(head.shape), c[1], c[2])


def _check_chunks(p: Parser, head: _LeafHead, placement: Placement, chunks: list[Chunk]) -> None:
    """The chunks tile the leaf, one per rank at most; a sharded leaf's are one per rank, in rank order.

    Tiling allows any order, but the columnar table a sharded leaf becomes
    holds one length per rank, read in rank order.
    """
    key = head.key
    p.check(len({c.rank for c in chunks}) == len(chunks), f"leaf {key!r} lists a rank twice")
    problems = tiling_problems(head.shape, [c.box for c in chunks])
    p.check(not problems, f"leaf {key!r} chunks do not tile shape {list(head.shape)}: {'; '.join(problems)}")
    if isinstance(placement, Shard):
        p.check(
            [c.rank for c in chunks] == list(range(head.world)),
            f"leaf {key!r} must list one chunk per rank, in rank order",
        )
        position = 0
        for c in chunks:  # tiling allows any order; the columns need rank order
            start, length = c.box[0][placement.dim], c.box[1][placement.dim]
            p.check(
                length == 0 or start == position,
                f"leaf {key!r} has chunks that are not in rank order along dim {placement.dim}",
            )
            position += length


def _chunk(p: Parser, head: _LeafHead, rank: Any, box: Box, nbytes: Any, checksum: Any) -> Chunk:
    """One chunk of ``box`` written by ``rank``, whose size is that of its box and whose checksum is 16 hex digits."""
    key = head.key
    p.check(type(rank) is int and 0 <= rank < head.world, f"leaf {key!r} has a chunk of invalid rank {rank!r}")
    expected = math.prod(box[1]) * head.itemsize
    p.check(
        type(nbytes) is int and nbytes == expected,
        f"leaf {key!r} rank {rank} declares {nbytes!r} bytes, its shape needs {expected}",
    )
    p.check(
        isinstance(checksum, str) and _HEX16.match(checksum) is not None,
        f"leaf {key!r} rank {rank} has a malformed checksum",
    )
    return Chunk(rank, box, nbytes, checksum)
