"""The structure of a save: what every rank must have in common, with a digest.

Keys, dtypes, placements, every dim of a local shape except the one it is
sharded along, a DTensor's global shape, the batch dims of each node after the
first, and the keys of non-tensor values. Every rank computes its own
``Structure`` from its prepared shard; equal digests mean equal structures,
so rank 0 compares digests instead of every rank's keys and shapes, and a
rank whose digest differs from rank 0's explains the difference itself
(``describe_difference``), naming the keys.
"""

from __future__ import annotations

import xxhash

from .. import format as fmt
from ..errors import ShardingError
from .sharding import Boxes, PerRank, Placement, Replicate, Shard
from .types import VARIES, Key, LeafSpec, LocalShard, NodeSpec, ObjectSpec, Structure


def _placement_code(p: Placement) -> list:
    if isinstance(p, Shard):
        return ["shard", p.dim]
    if isinstance(p, PerRank):
        return ["per_rank"]
    return ["boxes"] if isinstance(p, Boxes) else ["replicate"]


def structure_of(shard: LocalShard) -> Structure:
    """This rank's structure and its digest."""
    nodes = tuple(NodeSpec(k, (VARIES, *b[1:]) if b else ()) for k, b in shard.nodes.items())
    leaves = []
    for item in shard.items:
        shape = tuple(item.tensor.shape)
        if isinstance(item.placement, Shard):
            shape = shape[: item.placement.dim] + (VARIES,) + shape[item.placement.dim + 1 :]
        elif isinstance(item.placement, Boxes):
            shape = tuple(VARIES for _ in shape)  # a DTensor's local shape differs between ranks
        gshape = item.dtensor.global_shape if item.dtensor is not None else None
        leaves.append(LeafSpec(item.key, fmt.dtype_name(item.tensor.dtype), shape, item.placement, gshape))
    objects = tuple(ObjectSpec(k, o.kind, o.per_rank) for k, o in shard.objects.items())
    canonical = fmt.dumps(
        [
            [[list(n.key), list(n.batch)] for n in nodes],
            [[list(s.key), s.dtype, list(s.shape), _placement_code(s.placement), s.global_shape] for s in leaves],
            [[list(o.key), o.kind, *(["per_rank"] if o.per_rank else [])] for o in objects],
        ]
    )
    return Structure(nodes, tuple(leaves), objects, xxhash.xxh3_64_hexdigest(canonical))


def describe_difference(mine: Structure, rank: int, reference: Structure) -> ShardingError:
    """Why this rank's structure differs from rank 0's ``reference``, naming the keys."""
    mkeys = [s.key for s in mine.leaves] + [("<node>", *n.key) for n in mine.nodes]
    rkeys = [s.key for s in reference.leaves] + [("<node>", *n.key) for n in reference.nodes]
    if mkeys != rkeys:
        only_r = sorted(_show(k) for k in set(rkeys) - set(mkeys))[:5]
        only_m = sorted(_show(k) for k in set(mkeys) - set(rkeys))[:5]
        return ShardingError(
            f"rank 0 and rank {rank} save different keys (only on rank 0: {only_r}, only on rank {rank}: "
            f"{only_m}, or the same keys in another order); every rank must pass a TensorDict with the same "
            f"structure"
        )
    for mn, rn in zip(mine.nodes, reference.nodes):
        if mn.batch != rn.batch:
            return ShardingError(
                f"the TensorDict at {_show(mn.key)} has batch sizes that differ beyond dim 0 across ranks: "
                f"rank 0: {_masked(rn.batch)}, rank {rank}: {_masked(mn.batch)}; only dim 0 may differ (it is the "
                f"sharded batch dim)"
            )
    for ml, rl in zip(mine.leaves, reference.leaves):
        why = _leaf_difference(ml, rl, rank)
        if why:
            return ShardingError(why)
    if [(o.key, o.kind, o.per_rank) for o in mine.objects] != [(o.key, o.kind, o.per_rank) for o in reference.objects]:
        theirs = [(o.key, o.kind) for o in reference.objects][:5]
        ours = [(o.key, o.kind) for o in mine.objects][:5]
        return ShardingError(
            f"rank 0 and rank {rank} save different non-tensor entries ({theirs} vs {ours}); every rank must "
            f"pass a TensorDict with the same structure"
        )
    return ShardingError(f"rank {rank}'s structure differs from rank 0's in a way tddist cannot name")


def _leaf_difference(m: LeafSpec, r: LeafSpec, rank: int) -> str | None:
    key = _show(m.key)
    if isinstance(m.placement, Boxes) or isinstance(r.placement, Boxes):
        if (m.dtype, type(m.placement), m.global_shape) != (r.dtype, type(r.placement), r.global_shape):
            return (
                f"DTensor leaf {key} differs across ranks in dtype, placement kind or global shape: "
                f"rank 0: {(r.dtype, _placement_code(r.placement), r.global_shape)}, "
                f"rank {rank}: {(m.dtype, _placement_code(m.placement), m.global_shape)}"
            )
        return None
    if m.dtype != r.dtype:
        return (
            f"leaf {key} has a different dtype on different ranks: rank 0: {r.dtype}, rank {rank}: {m.dtype}; "
            f"every rank must save the same dtype"
        )
    if m.placement != r.placement:
        return (
            f"leaf {key} has a different placement on different ranks: rank 0: {r.placement}, rank {rank}: "
            f"{m.placement}; every rank must save the same placement"
        )
    if m.shape == r.shape:
        return None
    if isinstance(m.placement, PerRank):
        return (
            f"per-rank leaf {key} has different shapes on different ranks: rank 0: {list(r.shape)}, rank {rank}: "
            f"{list(m.shape)}; a PerRank() leaf needs the same shape on every rank (pad it to one shape)"
        )
    if isinstance(m.placement, Replicate):
        return (
            f"replicated leaf {key} has different shapes on different ranks: rank 0: {list(r.shape)}, rank "
            f"{rank}: {list(m.shape)}; make them equal, or shard it with placements={{{key}: tddist.Shard(0)}}"
        )
    dim = m.placement.dim if isinstance(m.placement, Shard) else 0
    if len(m.shape) != len(r.shape):
        return (
            f"leaf {key} is sharded along dim {dim} but has shapes rank 0: {_masked(r.shape)}, rank {rank}: "
            f"{_masked(m.shape)}; every rank needs a tensor with more than {dim} dims and the same number of dims"
        )
    return (
        f"leaf {key} is sharded along dim {dim}, but its shapes differ in other dims across ranks: rank 0: "
        f"{_masked(r.shape)}, rank {rank}: {_masked(m.shape)}; only dim {dim} may differ"
    )


def _masked(shape: tuple[int, ...]) -> str:
    return "[" + ", ".join("*" if s == VARIES else str(s) for s in shape) + "]"


def _show(key: Key) -> str:
    return repr(key[0]) if len(key) == 1 else repr(tuple(key))
