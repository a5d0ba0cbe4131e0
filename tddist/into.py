"""``load(into=target)``: check a target against the checkpoint, then fill it in place.

Every leaf of the target keeps its own placement and mesh: a DTensor receives
the box of its local shard, whatever the saved placements were; a plain
tensor receives the whole leaf, or its share of the rows if it has the shape
of one. Nothing in the target is touched before every key has been checked.
"""

from __future__ import annotations

from collections.abc import MutableMapping
from typing import Any

import torch
from tensordict import NonTensorStack, TensorDictBase

from .errors import IncompatibleCheckpointError
from .manifest import Leaf, Manifest
from .plan import LoadReport, compare, leaf_box, object_value
from .reader import read_leaves
from .sharding import Box, full_box
from .tree import dtensor_box, flatten, is_dtensor
from .types import AllRows, EvenRows, Key, LoadOptions, ShardRequest


def _target_box(key: Key, t: Any, leaf: Leaf, shard: ShardRequest, rank: int, size: int) -> Box | None:
    if is_dtensor(t):
        box, _writes = dtensor_box(t, key)
        return box
    if tuple(t.shape) == tuple(leaf.shape):
        return full_box(leaf.shape)
    box = leaf_box(leaf, _rows_of_plain_targets(shard), rank, size)
    return box if tuple(box[1]) == tuple(t.shape) else None


def fill(
    manifest: Manifest, root: str, target: Any, *, strict: bool, options: LoadOptions, rank: int, size: int
) -> LoadReport:
    """Fill ``target`` (TensorDict or nested dict of tensors/DTensors) from the checkpoint at ``root``."""
    _nodes, tensors, objects = flatten(target)
    report = compare(manifest, tensors, objects, lambda t: t.shape)
    requests = []
    for key, t in tensors.items():
        leaf = manifest.leaves.get(key)
        if leaf is None or key in report.mismatched:
            continue
        box = _target_box(key, t, leaf, options.shard, rank, size)
        if box is None:
            report.mismatched[key] = (
                f"{list(key)} has shape {list(t.shape)} in the target, which is neither the whole leaf "
                f"{list(leaf.shape)} nor this rank's share of its rows"
            )
            continue
        requests.append((key, t, leaf, box))
    if strict and not report.ok:
        raise IncompatibleCheckpointError(
            f"rank {rank}: the checkpoint at {root!r} does not match the target: {report.describe()}; "
            f"fix the target, or pass strict=False to load what matches"
        )
    values = read_leaves(
        root, manifest, [(leaf, box) for _k, _t, leaf, box in requests], options.num_threads, options.verify
    )
    with torch.no_grad():
        for (key, t, _leaf, _box), value in zip(requests, values):
            local = t.to_local() if is_dtensor(t) else t
            local.copy_(value)
            report.loaded.append(key)
    for key in objects:
        if key in manifest.objects and key not in report.mismatched:
            kind, value = object_value(
                manifest.objects[key], _rows_of_plain_targets(options.shard), rank, size, options.allow_pickle
            )
            _set_object(target, key, NonTensorStack.from_list(value) if kind == "stack" else value)
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
