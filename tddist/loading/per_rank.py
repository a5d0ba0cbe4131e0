"""Per-rank state: which keys a ``PerRank()`` placement covers on save, and what each rank gets back on load.

A per-rank leaf holds one value per saving rank (an RNG state, a sampler's
position). Its tensors are stored as the ranks' values stacked along a new
dim 0 (``docs/format.md``); its non-tensor values as "per_rank" entries
marked ``declared``. On the saving world size each rank gets its own value
back. On another world size nothing says which value a rank should get, so
``load(per_rank=...)`` decides, and by default the load is refused, naming
the keys, instead of handing out someone else's state silently. No I/O:
the callers read the boxes asked for.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from .. import format as fmt
from ..core.sharding import Box, PerRank, full_box, shard_box
from ..core.types import AllRows, Key, PerRankPolicy, ShardRequest
from ..errors import IncompatibleCheckpointError, InvalidArgumentError, InvalidDataError
from ..manifest.model import Leaf, Manifest, ObjectLeaf

#: ``per_rank(key, values, rank, size)``: this rank's value of a per-rank leaf from every saving rank's
#: (tensors for a tensor leaf, decoded values for a non-tensor one), or None to leave the key out.
PerRankFn = Callable[[Key, list[Any], int, int], Any]

POLICIES = ("drop", "rank0")


def policy(value: Any) -> PerRankPolicy:
    """The typed policy of ``load(per_rank=...)``: None, "drop", "rank0" or a callable."""
    if value is None:
        return PerRankPolicy()
    if isinstance(value, str) and value in POLICIES:
        return PerRankPolicy("drop" if value == "drop" else "rank0")
    if callable(value):
        return PerRankPolicy("call", value)
    raise InvalidArgumentError(
        f"per_rank={value!r} is not supported; use None (refuse another world size), 'drop', 'rank0', or a "
        f"callable(key, values, rank, size) returning this rank's value (None leaves the key out)"
    )


# --- save ------------------------------------------------------------------------------------------


def normalize_overrides(overrides: Mapping[Any, Any] | None) -> tuple[dict[Any, Any], dict[Key, bool]]:
    """Split ``placements=`` into the overrides ``tree.resolve_placements`` knows and the keys given a placement.

    Returns (the overrides without ``PerRank``, {key: whether its placement is ``PerRank``} for every key).
    """
    others: dict[Any, Any] = {}
    marked: dict[Key, bool] = {}
    for k, p in (overrides or {}).items():
        key = (k,) if isinstance(k, str) else tuple(k)
        marked[key] = isinstance(p, PerRank)
        if not isinstance(p, PerRank):
            others[k] = p
    return others, marked


def covered(key: Key, marked: Mapping[Key, bool]) -> bool:
    """Whether the nearest placement given for ``key`` or a node above it is ``PerRank``."""
    for i in range(len(key), -1, -1):
        if key[:i] in marked:
            return marked[key[:i]]
    return False


def check_marked_keys(marked: Mapping[Key, bool], known: Iterable[Key]) -> None:
    """A ``PerRank()`` placement must name a key of the data (a leaf, a node or a non-tensor value)."""
    keys = set(known)
    for key, is_per_rank in marked.items():
        if is_per_rank and key not in keys:
            shown = sorted("/".join(k) for k in keys if k)[:8]
            raise InvalidArgumentError(
                f"placements names key {list(key)} with tddist.PerRank(), which is not in the data; known keys: {shown}"
            )


def refuse_dtensor(key: Key) -> InvalidDataError:
    return InvalidDataError(
        f"leaf {list(key)} is a DTensor under a tddist.PerRank() placement; a DTensor keeps its own placements "
        f"(save each rank's value as a plain tensor, or leave the DTensor out of the PerRank() node)"
    )


def refuse_stack(key: Key) -> InvalidDataError:
    return InvalidDataError(
        f"non-tensor leaf {list(key)} is a NonTensorStack under a tddist.PerRank() placement; a stack is sharded "
        f"with its rows: store the rank's values as one NonTensorData (a list) instead"
    )


# --- load ------------------------------------------------------------------------------------------


def per_rank_keys(manifest: Manifest) -> list[Key]:
    """Every per-rank key of the checkpoint: tensor leaves, then declared non-tensor values."""
    leaves = [k for k, leaf in manifest.leaves.items() if isinstance(leaf.placement, PerRank)]
    return leaves + [k for k, o in manifest.objects.items() if o.declared]


@dataclass(frozen=True, slots=True)
class Resolution:
    """How this rank loads the per-rank keys of a checkpoint.

    ``own``: each rank reads the value of the rank with its own number (same
    world size, or ``shard="saved"``). ``source``: the saving rank whose value
    this rank gets ("rank0": 0), else None. ``whole``: the stack of every
    rank's values (``shard=None``). ``dropped``: the keys to leave out, with
    why. ``fn``: a callable policy, which needs every saving rank's value.
    """

    source: int | None
    whole: bool
    dropped: Mapping[Key, str]
    fn: PerRankFn | None = None


def resolve(
    manifest: Manifest, wanted: Iterable[Key], shard: ShardRequest, pol: PerRankPolicy, rank: int, size: int, where: str
) -> Resolution:
    """Decide, before anything is read, what this rank gets of the per-rank keys in ``wanted``.

    Raises:
        IncompatibleCheckpointError: another world size with the default policy (naming the keys).
    """
    keys = [k for k in per_rank_keys(manifest) if k in set(wanted)]
    saved = manifest.world_size
    if isinstance(shard, AllRows):
        return Resolution(None, True, {})
    if saved == size or not keys:
        return Resolution(rank, False, {})
    if pol.kind == "error":
        shown = ["/".join(k) for k in keys[:10]] + (["..."] if len(keys) > 10 else [])
        raise IncompatibleCheckpointError(
            f"rank {rank}: {where} was saved by {saved} ranks and holds per-rank state {shown} (one value per "
            f"saving rank), but this job has {size} ranks, so no value is this rank's own; pass per_rank='drop' to "
            f"leave it out (keeping the live values), per_rank='rank0' to give every rank rank 0's value, or "
            f"per_rank=callable(key, values, rank, size) to choose each rank's value"
        )
    if pol.kind == "drop":
        why = f"per-rank state saved by {saved} ranks, loaded on {size} (per_rank='drop')"
        return Resolution(None, False, {k: why for k in keys})
    if pol.kind == "rank0":
        return Resolution(0, False, {})
    return Resolution(None, False, {}, pol.fn)


def row_box(leaf: Leaf, source: int) -> Box:
    """The box of ``source``'s value in a per-rank leaf's stack (one row of dim 0)."""
    return shard_box(leaf.shape, 0, source, source + 1)


def value_shape(leaf: Leaf) -> tuple[int, ...]:
    """The shape of one rank's value of a per-rank leaf (its stack without dim 0)."""
    return tuple(leaf.shape[1:])


def choose(fn: PerRankFn, key: Key, values: list[Any], rank: int, size: int) -> Any:
    """A callable policy's value for this rank; its own exception is wrapped to name the key."""
    try:
        return fn(key, values, rank, size)
    except Exception as e:
        raise InvalidArgumentError(
            f"rank {rank}: the per_rank callable failed on key {list(key)} ({type(e).__name__}: {e}); fix the "
            f"callable, or pass per_rank='drop' or 'rank0'"
        ) from e


def boxes_to_read(leaf: Leaf, res: Resolution) -> list[Box]:
    """The boxes of a per-rank leaf this rank reads: the whole stack, one rank's row, or every row (a callable)."""
    if res.whole:
        return [full_box(leaf.shape)]
    if res.source is not None:
        return [row_box(leaf, res.source)]
    return [row_box(leaf, r) for r in range(leaf.shape[0])]


def tensor_value(key: Key, leaf: Leaf, read: list[torch.Tensor], res: Resolution, rank: int, size: int) -> Any:
    """This rank's value of a per-rank leaf from what ``boxes_to_read`` asked for; None: leave it out."""
    if res.whole:
        return read[0]
    shape = value_shape(leaf)
    if res.source is not None:
        return read[0].reshape(shape)
    assert res.fn is not None
    value = choose(res.fn, key, [t.reshape(shape) for t in read], rank, size)
    if value is not None and not (isinstance(value, torch.Tensor) and tuple(value.shape) == shape):
        raise InvalidArgumentError(
            f"rank {rank}: the per_rank callable returned {type(value).__name__} "
            f"{list(value.shape) if isinstance(value, torch.Tensor) else ''} for per-rank leaf {list(key)}; it must "
            f"return a tensor of shape {list(shape)} (one rank's value) or None"
        )
    return value


def object_value(obj: ObjectLeaf, res: Resolution, allow_pickle: bool, rank: int, size: int) -> tuple[bool, Any]:
    """(found, value) of a declared per-rank non-tensor leaf for this rank; found is False to leave it out."""
    where = f"non-tensor leaf {list(obj.key)}"
    values = [fmt.decode_object(v, allow_pickle, where) for v in obj.values] if res.source is None else []
    if res.whole:
        return True, values
    if res.source is not None:
        return True, fmt.decode_object(obj.values[res.source], allow_pickle, where)
    assert res.fn is not None
    value = choose(res.fn, obj.key, values, rank, size)
    return value is not None, value
