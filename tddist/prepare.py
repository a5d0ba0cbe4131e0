"""Preparing this rank's shard for a save: flatten, check the keys and the data, choose placements,
encode non-tensor values, and take the local bytes (or a snapshot of them).

Every check that can fail on one rank runs here, before any collective: the
error is returned as the rank's vote, so every rank still meets in the commit
and all of them raise the same error instead of some waiting forever.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

import torch

from . import format as fmt
from ._compat import dtensor_local
from ._memmaps import mapped_files
from .errors import InvalidDataError
from .per_rank import check_marked_keys, covered, normalize_overrides, refuse_dtensor, refuse_stack
from .sharding import Boxes, PerRank, Placement, Replicate, Shard, replica_writers
from .snapshot import SnapshotBuffers
from .tree import dtensor_box, flatten, is_dtensor, local_bytes, resolve_placements
from .types import DTensorBox, EncodedObject, Key, LocalShard, SaveItem


def prepare_shard(
    data: Any,
    rank: int,
    world: int,
    buffers: SnapshotBuffers | None,
    *,
    placements: Mapping[Any, Any] | None,
    robust_key: bool,
    allow_pickle: bool,
    copy_existing: bool,
) -> LocalShard | Exception:
    """Flatten and check the data; with ``buffers``, snapshot it (asynchronous save).

    Errors are returned, not raised: every rank must still take part in the
    commit so that all of them raise the same error instead of some hanging.
    """
    try:
        nodes, leaves, objects = flatten(data)
        _check_materialised(leaves, rank)
        if not robust_key:
            _check_verbatim_keys(nodes, {**leaves, **objects})
        _check_file_names(nodes, leaves, objects, robust_key)
        if not copy_existing:
            _check_not_mapped(leaves, rank)
        others, marked = normalize_overrides(placements)
        check_marked_keys(marked, [*nodes, *leaves, *objects])
        chosen: dict[Key, Placement] = dict(resolve_placements(nodes, leaves, others))
        for k, t in leaves.items():
            if covered(k, marked):
                if is_dtensor(t):
                    raise refuse_dtensor(k)
                chosen[k] = PerRank()
        encoded = {}
        for k, (kind, value) in objects.items():
            where = f"rank {rank}: non-tensor leaf {list(k)}"
            own = covered(k, marked)
            if kind == "stack":
                if own:
                    raise refuse_stack(k)
                encoded[k] = EncodedObject("stack", [fmt.encode_object(v, allow_pickle, where) for v in value])
            else:
                encoded[k] = EncodedObject("data", fmt.encode_object(value, allow_pickle, where), own)
        writers = replica_writers(
            {k: t.numel() * t.element_size() for k, t in leaves.items() if isinstance(chosen[k], Replicate)}, world
        )
        items = []
        for k, t in leaves.items():
            dtensor = None
            if isinstance(chosen[k], Boxes):
                box, writes = dtensor_box(t, k)
                dtensor = DTensorBox(box or ((0,) * t.dim(), (0,) * t.dim()), tuple(t.shape))
            else:
                writes = isinstance(chosen[k], (Shard, PerRank)) or writers[k] == rank
            local = buffers.snapshot(k, t) if buffers is not None else local_bytes(t)
            items.append(SaveItem(k, local, chosen[k], writes, dtensor))
        if buffers is not None:
            buffers.synchronize()
            buffers.retain_only(set(leaves))
        return LocalShard(nodes, tuple(items), encoded)
    except Exception as e:
        return e


def _check_materialised(leaves: Mapping[Key, torch.Tensor], rank: int) -> None:
    """A tensor on the meta device has a shape but no data: refuse it before anything tries to copy it."""
    for k, t in leaves.items():
        local: torch.Tensor = dtensor_local(t) if is_dtensor(t) else t
        if local.is_meta:
            raise InvalidDataError(
                f"rank {rank}: leaf {list(k)} is a tensor on the meta device (a shape without data, for example "
                f"a model built under torch.device('meta')); materialise it before saving (model.to_empty("
                f"device=...) and initialise or load its values)"
            )


def _check_not_mapped(leaves: Mapping[Key, torch.Tensor], rank: int) -> None:
    local = {k: dtensor_local(t) if is_dtensor(t) else t for k, t in leaves.items()}  # DTensor: its local shard
    mapped = mapped_files(local)
    if mapped:
        k, path = next(iter(mapped.items()))
        raise InvalidDataError(
            f"rank {rank}: leaf {list(k)} is memory-mapped from {path!r} (for example, loaded from a "
            f"checkpoint); pass copy_existing=True to copy its data into the new checkpoint"
        )


def _check_verbatim_keys(nodes: Mapping[Key, Any], leaves: Mapping[Key, Any]) -> None:
    for key in list(nodes) + list(leaves):
        for part in key:
            why = fmt.verbatim_key_problem(part)
            if why:
                raise InvalidDataError(
                    f"key {list(key)} cannot be used verbatim as a file name with robust_key=False: {why}; "
                    f"use robust_key=True (the default) or rename the key"
                )


def _check_file_names(
    nodes: Mapping[Key, Any], leaves: Mapping[Key, Any], objects: Mapping[Key, Any], robust_key: bool
) -> None:
    """Refuse keys whose files would collide in a rank directory (with each other or with meta.json),
    or whose encoded names are too long for a file system."""
    taken: dict[Key, dict[str, Key | None]] = {k: {fmt.TD_META_NAME: None} for k in nodes}
    entries = [(k, fmt.encode_key(k[-1], robust_key)) for k in nodes if k]
    entries += [(k, fmt.encode_key(k[-1], robust_key) + fmt.LEAF_SUFFIX) for k in leaves]
    entries += [(k, fmt.encode_key(k[-1], robust_key)) for k in objects]
    for key, name in entries:
        if len(os.fsencode(name)) > 255:
            raise InvalidDataError(
                f"key {list(key)[:3]}... is stored as a file name of more than 255 bytes; shorten it"
            )
        names = taken[key[:-1]]
        if name in names:
            other = names[name]
            clash = "tensordict's meta.json" if other is None else f"the file of key {list(other)}"
            raise InvalidDataError(
                f"key {list(key)} would be stored as {name!r}, which clashes with {clash}; rename it"
            )
        names[name] = key
