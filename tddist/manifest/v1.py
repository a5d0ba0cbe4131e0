"""Reading a version-1 manifest: every chunk of every leaf listed in the JSON.

Version 1 is read forever (``docs/format.md``, section 10); tddist writes
version 2. The chunks become the same columnar tables a version-2 manifest
gives, so nothing after parsing knows the version.
"""

from __future__ import annotations

import math
import re
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


def _parse_leaf(p: Parser, e: dict[str, Any], world: int) -> Leaf:
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
        position = 0
        for c in chunks:  # tiling allows any order; the columns need rank order
            start, length = c.box[0][placement.dim], c.box[1][placement.dim]
            p.check(
                length == 0 or start == position,
                f"leaf {key!r} has chunks that are not in rank order along dim {placement.dim}",
            )
            position += length
    kind = "shard" if isinstance(placement, Shard) else "boxes" if isinstance(placement, Boxes) else "replicate"
    dim = placement.dim if isinstance(placement, Shard) else None
    return Leaf(key, dtype, shape, placement, table_from_chunks(shape, dim, itemsize, kind, chunks))


def _chunk(p: Parser, key: Key, rank: Any, box: Box, nbytes: Any, checksum: Any, world: int, itemsize: int) -> Chunk:
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
