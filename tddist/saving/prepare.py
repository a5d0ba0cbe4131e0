"""Preparing this rank's shard for a save: flatten, check the keys and the data, choose placements,
encode non-tensor values, and take the local bytes (or a snapshot of them).

Every check that can fail on one rank runs here, before any collective: the
error is returned as the rank's vote, so every rank still meets in the commit
and all of them raise the same error instead of some waiting forever.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from .. import format as fmt
from .._compat import dtensor_local, dtensor_signature
from ..core.sharding import Boxes, PerRank, Placement, Replicate, Shard, replica_writers
from ..core.tree import dtensor_box, flatten, is_dtensor, local_bytes, local_bytes_source, resolve_placements
from ..core.types import DTensorBox, EncodedObject, Key, LocalShard, SaveItem
from ..errors import InvalidDataError
from ..loading.per_rank import check_marked_keys, covered, normalize_overrides, refuse_dtensor, refuse_stack
from .memmaps import mapped_files
from .snapshot import SnapshotBuffers


@dataclass(frozen=True, slots=True)
class LeafPlacement:
    """What a save derives for one tensor leaf from the structure alone: its placement, whether this
    rank writes it, and a DTensor's box."""

    placement: Placement
    writes: bool
    dtensor: DTensorBox | None


@dataclass(frozen=True, slots=True)
class ShardPlacements:
    """What ``prepare_shard`` derives from a save's structure, in the order of ``flatten``'s leaves and
    non-tensor values: the keys passed their checks, each leaf's ``LeafPlacement``, and whether each
    non-tensor value is per-rank (``PerRank()``)."""

    leaves: tuple[LeafPlacement, ...]
    objects_per_rank: tuple[bool, ...]


class PlacementCache:
    """The placements of a communicator's latest saves, by structure signature, so that a save of the same
    structure skips the key checks and placement choices (about 20 us a leaf; 22 ms of blocking at
    1,000 leaves, 41 ms with DTensors).

    A signature holds everything the placements depend on: the rank and world
    size, ``placements=`` and ``robust_key``, every node's key and batch
    size, every leaf's key, shape, dtype and device (a DTensor's spec: its
    mesh, placements and global shape), and every non-tensor value's key and
    kind. Values are never part of the placements; they are checked and encoded at
    every save. Used on the caller's thread only.
    """

    #: Layouts kept: a loop that saves a few states in turn (model, optimizer) on one communicator.
    SIZE = 4

    def __init__(self) -> None:
        self._kept: list[tuple[tuple, ShardPlacements]] = []
        self.hits = 0  # saves that reused kept placements (tests read it)

    def get(self, signature: tuple) -> ShardPlacements | None:
        for i, (sig, placements) in enumerate(self._kept):
            if sig == signature:  # tuples compare their items by identity first: a steady state is cheap
                self._kept.insert(0, self._kept.pop(i))
                self.hits += 1
                return placements
        return None

    def put(self, signature: tuple, placements: ShardPlacements) -> None:
        self._kept.insert(0, (signature, placements))
        del self._kept[self.SIZE :]

    def placements_of(self, structure: SavedStructure) -> ShardPlacements:
        """``structure``'s placements: a kept one of the same signature, else derived (and kept when it has one)."""
        signature = structure.signature()
        placements = None if signature is None else self.get(signature)
        if placements is None:
            placements = structure.derive_placements()
            if signature is not None:
                self.put(signature, placements)
        return placements


@dataclass(frozen=True, slots=True)
class SavedStructure:
    """What a save's ``ShardPlacements`` is derived from: the flattened data (``tree.flatten``), this rank's
    place in the world, and the options that choose placements and file names."""

    nodes: Mapping[Key, tuple[int, ...]]
    leaves: Mapping[Key, torch.Tensor]
    objects: Mapping[Key, tuple[str, Any]]
    rank: int
    world: int
    placements: Mapping[Any, Any] | None
    robust_key: bool

    def signature(self) -> tuple | None:
        """What the placements depend on (``PlacementCache``); None when ``placements=`` cannot be compared (an
        unhashable key or placement): such a save derives its placements every time."""
        overrides = tuple(self.placements.items()) if self.placements else ()
        try:
            hash(overrides)
        except TypeError:
            return None
        leaves, objects = self.leaves, self.objects
        shapes = tuple(dtensor_signature(t) if is_dtensor(t) else (t.shape, t.dtype, t.device) for t in leaves.values())
        kinds = tuple(kind for kind, _value in objects.values())
        nodes = tuple(self.nodes.items())
        return (self.rank, self.world, self.robust_key, overrides, nodes, tuple(leaves), shapes, tuple(objects), kinds)

    def derive_placements(self) -> ShardPlacements:
        """Check the keys and choose each leaf's placement, writer and DTensor box (raises on bad input)."""
        nodes, leaves, objects, rank = self.nodes, self.leaves, self.objects, self.rank
        if not self.robust_key:
            _check_verbatim_keys(nodes, {**leaves, **objects})
        _check_file_names(nodes, leaves, objects, self.robust_key)
        others, marked = normalize_overrides(self.placements)
        check_marked_keys(marked, [*nodes, *leaves, *objects])
        chosen: dict[Key, Placement] = dict(resolve_placements(dict(nodes), dict(leaves), others))
        for k, t in leaves.items():
            if covered(k, marked):
                if is_dtensor(t):
                    raise refuse_dtensor(k)
                chosen[k] = PerRank()
        objects_per_rank = []
        for k, (kind, _value) in objects.items():
            own = covered(k, marked)
            if kind == "stack" and own:
                raise refuse_stack(k)
            objects_per_rank.append(own)
        writers = replica_writers(
            {k: t.numel() * t.element_size() for k, t in leaves.items() if isinstance(chosen[k], Replicate)},
            self.world,
        )
        out = []
        for k, t in leaves.items():
            dtensor = None
            if isinstance(chosen[k], Boxes):
                box, writes = dtensor_box(t, k)
                dtensor = DTensorBox(box or ((0,) * t.dim(), (0,) * t.dim()), tuple(t.shape))
            else:
                writes = isinstance(chosen[k], (Shard, PerRank)) or writers[k] == rank
            out.append(LeafPlacement(chosen[k], writes, dtensor))
        return ShardPlacements(tuple(out), tuple(objects_per_rank))


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
    placement_cache: PlacementCache | None = None,
) -> LocalShard | Exception:
    """Flatten and check the data; with ``buffers``, snapshot it (asynchronous save).

    ``placement_cache``: reuse what an earlier save of the same structure derived
    (``PlacementCache``). Errors are returned, not raised: every rank must still
    take part in the commit so that all of them raise the same error instead
    of some hanging.
    """
    try:
        nodes, leaves, objects = flatten(data)
        _check_materialised(leaves, rank)
        structure = SavedStructure(nodes, leaves, objects, rank, world, placements, robust_key)
        derived = structure.derive_placements() if placement_cache is None else placement_cache.placements_of(structure)
        if not copy_existing:
            _check_not_mapped(leaves, rank)
        encoded = encode_objects(objects, derived.objects_per_rank, rank, allow_pickle)
        items = []
        for (k, t), leaf in zip(leaves.items(), derived.leaves):
            local = buffers.snapshot(k, t) if buffers is not None else local_bytes(t)
            own = buffers is None and local.untyped_storage().data_ptr() == local_bytes_source(t)
            items.append(SaveItem(k, local, leaf.placement, leaf.writes, leaf.dtensor, own))
        if buffers is not None:
            buffers.synchronize()
            buffers.retain_only(set(leaves))
        return LocalShard(nodes, tuple(items), encoded)
    except Exception as e:
        return e


def encode_objects(
    objects: Mapping[Key, tuple[str, Any]], per_rank: tuple[bool, ...], rank: int, allow_pickle: bool
) -> dict[Key, EncodedObject]:
    """The non-tensor values of a save, encoded (at every save: values change where the structure does not)."""
    encoded = {}
    for (k, (kind, value)), own in zip(objects.items(), per_rank):
        where = f"rank {rank}: non-tensor leaf {list(k)}"
        if kind == "stack":
            encoded[k] = EncodedObject("stack", [fmt.encode_object(v, allow_pickle, where) for v in value])
        else:
            encoded[k] = EncodedObject("data", fmt.encode_object(value, allow_pickle, where), own)
    return encoded


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
