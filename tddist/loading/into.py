"""``load(into=target)``: check a target against the checkpoint, then fill it in place.

Every leaf of the target keeps its own placement and mesh: a DTensor receives
the box of its local shard, whatever the saved placements were; a plain
tensor receives the whole leaf, or its share of the rows if it has the shape
of one. Nothing in the target is touched before every key has been checked.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, MutableMapping
from dataclasses import dataclass
from typing import Any

import torch
from tensordict import NonTensorStack, TensorDictBase, is_tensorclass

from ..core.sharding import Box, PerRank, full_box
from ..core.tree import dtensor_box, flatten, is_dtensor, stack_of
from ..core.types import AllRows, EvenRows, Key, LoadOptions, ShardRequest
from ..errors import IncompatibleCheckpointError, InvalidArgumentError
from ..manifest.model import Leaf, Manifest
from ..storage.opened import OpenedCheckpoint
from . import per_rank as pr
from .read import read_leaves
from .share import LoadReport, check_exclude, compare, in_scope, leaf_box, object_value


def _target_box(key: Key, t: Any, leaf: Leaf, shard: ShardRequest, rank: int, size: int) -> Box | None:
    if is_dtensor(t):
        box, _writes = dtensor_box(t, key)
        return box
    if tuple(t.shape) == tuple(leaf.shape):
        return full_box(leaf.shape)
    box = leaf_box(leaf, _rows_of_plain_targets(shard), rank, size)
    return box if tuple(box[1]) == tuple(t.shape) else None


@dataclass(frozen=True)
class _FillContext:
    """What every step of one ``fill`` consults: the checkpoint's manifest, the load's options and this rank."""

    manifest: Manifest
    options: LoadOptions
    rank: int
    size: int

    def selects(self, key: Key) -> bool:
        """True when ``key`` is under ``options.keys`` (all keys when None) and not under ``options.exclude``."""
        return in_scope(key, self.options.keys, self.options.exclude)


@dataclass(frozen=True)
class _TensorRead:
    """One target tensor to fill in place, and the boxes of its leaf read for it.

    Attributes:
        key: the key of the tensor.
        target: the tensor or DTensor of the target, filled in place.
        leaf: the checkpoint's leaf of ``key``.
        boxes: the boxes of ``leaf`` read for it, in order.
        as_read: the value is the one box read; else (per-rank state) ``per_rank.tensor_value``
            builds it from the boxes read.
    """

    key: Key
    target: Any
    leaf: Leaf
    boxes: list[Box]
    as_read: bool


def fill(
    manifest: Manifest,
    root: str,
    target: Any,
    *,
    strict: bool,
    options: LoadOptions,
    rank: int,
    size: int,
    pinned: OpenedCheckpoint | None = None,
) -> LoadReport:
    """Fill ``target`` (TensorDict or nested dict of tensors/DTensors) from the checkpoint at ``root``.

    Only keys under ``options.keys`` (all when None) and not under
    ``options.exclude`` are compared and filled; per-rank leaves follow
    ``options.per_rank``, and those it drops are reported as skipped.
    """
    _check_target_type(target, rank)
    _nodes, tensors, objects = flatten(target)
    ctx = _FillContext(manifest=manifest, options=options, rank=rank, size=size)
    where = f"the checkpoint at {root!r}"
    target_keys = [*tensors, *objects]
    _check_key_filters(ctx, target_keys, where)
    report = compare(manifest, tensors, objects, lambda t: t.shape, ctx.selects)
    _skip_unselected(ctx, target_keys, report)
    shard = _rows_of_plain_targets(options.shard)  # a per-rank target gets its own value unless it holds the stack
    res = pr.resolve(manifest, [k for k in target_keys if ctx.selects(k)], shard, options.per_rank, rank, size, where)
    report.skipped.update({k: why for k, why in res.dropped.items() if k in tensors or k in objects})
    reads = _tensor_reads(ctx, tensors, res, report)
    if strict and not report.ok:
        raise IncompatibleCheckpointError(
            f"rank {rank}: the checkpoint at {root!r} does not match the target: {report.describe()}; "
            f"fix the target, or pass strict=False to load what matches"
        )
    flat = [(r.leaf, box) for r in reads for box in r.boxes]
    read = read_leaves(pinned or root, manifest, flat, options.num_threads, options.verify)
    _copy_tensors(ctx, reads, iter(read), res, report)
    _set_objects(ctx, target, objects, res, report)
    return report


def _check_target_type(target: Any, rank: int) -> None:
    """Refuse a target that cannot be filled in place (a model, an optimizer, a tensor), naming what to pass instead."""
    if not (isinstance(target, (TensorDictBase, Mapping)) or is_tensorclass(target)):
        raise InvalidArgumentError(
            f"rank {rank}: load(into=...) fills a TensorDict, a tensorclass or a nested dict of tensors in place, "
            f"got {type(target).__name__}; for a model and its optimizer pass tddist.get_state(model, optimizer) "
            f"and apply it with tddist.set_state (or let CheckpointManager.restore do both)"
        )


def _check_key_filters(ctx: _FillContext, target_keys: list[Key], where: str) -> None:
    """Refuse ``exclude`` and ``keys`` entries that name nothing in the checkpoint or the target (likely a typo)."""
    m, options = ctx.manifest, ctx.options
    if options.exclude:
        check_exclude(options.exclude, [*m.nodes, *m.leaves, *m.objects, *target_keys], where)
    if options.keys is not None:
        for w in options.keys:
            if not any(k[: len(w)] == w for k in [*m.leaves, *m.objects, *target_keys]):
                raise InvalidArgumentError(
                    f"rank {ctx.rank}: keys names {list(w)}, which is neither in {where} nor in the target"
                )


def _skip_unselected(ctx: _FillContext, target_keys: list[Key], report: LoadReport) -> None:
    """Report the keys in both that ``keys``/``exclude`` leave out as skipped, with which of the two did."""
    options = ctx.options
    for key in target_keys:
        if not ctx.selects(key) and (key in ctx.manifest.leaves or key in ctx.manifest.objects):
            report.skipped[key] = (
                "excluded" if options.keys is None or in_scope(key, options.keys, ()) else "not in keys"
            )


def _tensor_reads(
    ctx: _FillContext, tensors: dict[Key, Any], res: pr.Resolution, report: LoadReport
) -> list[_TensorRead]:
    """What to read for each selected target tensor that matches its leaf, before anything is read.

    A target whose shape fits neither the whole leaf nor this rank's share,
    or a DTensor for per-rank state, is reported as mismatched instead.
    """
    reads = []
    for key, t in tensors.items():
        leaf = ctx.manifest.leaves.get(key)
        if leaf is None or key in report.mismatched or not ctx.selects(key) or key in res.dropped:
            continue
        if isinstance(leaf.placement, PerRank):
            if is_dtensor(t):
                report.mismatched[key] = f"{list(key)} is a DTensor in the target but per-rank state in the checkpoint"
                continue
            whole = tuple(t.shape) == tuple(leaf.shape) and tuple(leaf.shape[1:]) != tuple(leaf.shape)
            boxes = [full_box(leaf.shape)] if whole else pr.boxes_to_read(leaf, res)
            reads.append(_TensorRead(key=key, target=t, leaf=leaf, boxes=boxes, as_read=whole))
            continue
        box = _target_box(key, t, leaf, ctx.options.shard, ctx.rank, ctx.size)
        if box is None:
            report.mismatched[key] = (
                f"{list(key)} has shape {list(t.shape)} in the target, which is neither the whole leaf "
                f"{list(leaf.shape)} nor this rank's share of its rows"
            )
            continue
        reads.append(_TensorRead(key=key, target=t, leaf=leaf, boxes=[box], as_read=True))
    return reads


def _copy_tensors(
    ctx: _FillContext, reads: list[_TensorRead], read: Iterator[torch.Tensor], res: pr.Resolution, report: LoadReport
) -> None:
    """Copy what was read (``read``: the boxes of ``reads``, in order) into the target tensors, in place."""
    with torch.no_grad():
        for r in reads:
            got = [next(read) for _box in r.boxes]
            value = got[0] if r.as_read else pr.tensor_value(r.key, r.leaf, got, res, ctx.rank, ctx.size)
            if value is None:
                report.skipped[r.key] = "the per_rank callable returned None"
                continue
            local = r.target.to_local() if is_dtensor(r.target) else r.target
            local.copy_(value)
            report.loaded.append(r.key)


def _set_objects(
    ctx: _FillContext, target: Any, objects: dict[Key, Any], res: pr.Resolution, report: LoadReport
) -> None:
    """Set the selected non-tensor values of the target: per-rank ones as ``per_rank`` chooses, others as stored."""
    for key in objects:
        if not ctx.selects(key) or key in res.dropped:
            continue
        obj = ctx.manifest.objects.get(key)
        if obj is not None and obj.declared and key not in report.mismatched:
            found, value = pr.object_value(obj, res, ctx.options.allow_pickle, ctx.rank, ctx.size)
            if found:
                _set_object(target, key, value)
                report.loaded.append(key)
            else:
                report.skipped[key] = "the per_rank callable returned None"
        elif key in ctx.manifest.objects and key not in report.mismatched:
            kind, value = object_value(
                ctx.manifest.objects[key],
                _rows_of_plain_targets(ctx.options.shard),
                ctx.rank,
                ctx.size,
                ctx.options.allow_pickle,
            )
            _set_object(target, key, stack_of(value, key) if kind == "stack" else value)
            report.loaded.append(key)


def _rows_of_plain_targets(shard: ShardRequest) -> ShardRequest:
    """A plain target tensor of a row share gets the even share when the whole checkpoint was asked for."""
    return EvenRows() if isinstance(shard, AllRows) else shard


def _set_object(target: Any, key: Key, value: Any) -> None:
    if isinstance(target, TensorDictBase):
        if isinstance(value, NonTensorStack):
            target.set(key, value)
        else:
            target.set_non_tensor(key, value)
        return
    node: MutableMapping[str, Any] = target
    for k in key[:-1]:
        node = node[k]
    node[key[-1]] = value
