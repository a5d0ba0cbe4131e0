"""``load(into=target)``: check a target against the checkpoint, then fill it in place.

Every leaf of the target keeps its own placement and mesh: a DTensor receives
the box of its local shard, whatever the saved placements were; a plain
tensor receives the whole leaf, or its share of the rows if it has the shape
of one. Nothing in the target is touched before every key has been checked.
"""

from __future__ import annotations

from collections.abc import Mapping, MutableMapping
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
    if not (isinstance(target, (TensorDictBase, Mapping)) or is_tensorclass(target)):
        raise InvalidArgumentError(
            f"rank {rank}: load(into=...) fills a TensorDict, a tensorclass or a nested dict of tensors in place, "
            f"got {type(target).__name__}; for a model and its optimizer pass tddist.get_state(model, optimizer) "
            f"and apply it with tddist.set_state (or let CheckpointManager.restore do both)"
        )
    _nodes, tensors, objects = flatten(target)
    where = f"the checkpoint at {root!r}"
    if options.exclude:
        check_exclude(
            options.exclude, [*manifest.nodes, *manifest.leaves, *manifest.objects, *tensors, *objects], where
        )
    if options.keys is not None:
        for w in options.keys:
            if not any(k[: len(w)] == w for k in [*manifest.leaves, *manifest.objects, *tensors, *objects]):
                raise InvalidArgumentError(
                    f"rank {rank}: keys names {list(w)}, which is neither in {where} nor in the target"
                )

    def scope(key: Key) -> bool:
        return in_scope(key, options.keys, options.exclude)

    report = compare(manifest, tensors, objects, lambda t: t.shape, scope)
    for key in [*tensors, *objects]:
        if not scope(key) and (key in manifest.leaves or key in manifest.objects):
            report.skipped[key] = (
                "excluded" if options.keys is None or in_scope(key, options.keys, ()) else "not in keys"
            )
    shard = _rows_of_plain_targets(options.shard)  # a per-rank target gets its own value unless it holds the stack
    res = pr.resolve(
        manifest, [k for k in [*tensors, *objects] if scope(k)], shard, options.per_rank, rank, size, where
    )
    report.skipped.update({k: why for k, why in res.dropped.items() if k in tensors or k in objects})
    requests = []
    for key, t in tensors.items():
        leaf = manifest.leaves.get(key)
        if leaf is None or key in report.mismatched or not scope(key) or key in res.dropped:
            continue
        if isinstance(leaf.placement, PerRank):
            if is_dtensor(t):
                report.mismatched[key] = f"{list(key)} is a DTensor in the target but per-rank state in the checkpoint"
                continue
            whole = tuple(t.shape) == tuple(leaf.shape) and tuple(leaf.shape[1:]) != tuple(leaf.shape)
            requests.append((key, t, leaf, [full_box(leaf.shape)] if whole else pr.boxes_to_read(leaf, res), whole))
            continue
        box = _target_box(key, t, leaf, options.shard, rank, size)
        if box is None:
            report.mismatched[key] = (
                f"{list(key)} has shape {list(t.shape)} in the target, which is neither the whole leaf "
                f"{list(leaf.shape)} nor this rank's share of its rows"
            )
            continue
        requests.append((key, t, leaf, [box], True))
    if strict and not report.ok:
        raise IncompatibleCheckpointError(
            f"rank {rank}: the checkpoint at {root!r} does not match the target: {report.describe()}; "
            f"fix the target, or pass strict=False to load what matches"
        )
    flat = [(leaf, box) for _k, _t, leaf, boxes, _plain in requests for box in boxes]
    read = iter(read_leaves(pinned or root, manifest, flat, options.num_threads, options.verify))
    with torch.no_grad():
        for key, t, leaf, boxes, plain in requests:
            got = [next(read) for _box in boxes]
            value = got[0] if plain else pr.tensor_value(key, leaf, got, res, rank, size)
            if value is None:
                report.skipped[key] = "the per_rank callable returned None"
                continue
            local = t.to_local() if is_dtensor(t) else t
            local.copy_(value)
            report.loaded.append(key)
    for key in objects:
        if not scope(key) or key in res.dropped:
            continue
        obj = manifest.objects.get(key)
        if obj is not None and obj.declared and key not in report.mismatched:
            found, value = pr.object_value(obj, res, options.allow_pickle, rank, size)
            if found:
                _set_object(target, key, value)
                report.loaded.append(key)
            else:
                report.skipped[key] = "the per_rank callable returned None"
        elif key in manifest.objects and key not in report.mismatched:
            kind, value = object_value(
                manifest.objects[key], _rows_of_plain_targets(options.shard), rank, size, options.allow_pickle
            )
            _set_object(target, key, stack_of(value, key) if kind == "stack" else value)
            report.loaded.append(key)
    return report


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
