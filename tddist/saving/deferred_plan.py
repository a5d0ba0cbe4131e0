"""A deferred save's plan, kept per channel: the next save of the same leaves skips the planning.

A training loop saves the same state again and again: the same tensors
(``get_state`` hands out the same ones while the structure holds), the same
storages and shapes. Everything a deferred save derives from them before it
returns (the placements, the stand-ins of the prepared shard, which leaves are
copied now, the snapshot buffers they go into, the arena, the slot
assignment and each leaf's bytes and address) is then the same, and cost
about 7 ms at 672 leaves. ``DeferredPlan`` keeps it; ``matches`` checks in
O(leaves) cheap steps that the save in hand is the same: its settings and
guard, its nodes, keys and non-tensor kinds, each leaf the same tensor
object with the same storage address, shape, strides, dtype and device, and
the channel's arena and snapshot buffers untouched since. Whatever changes
with the values is done at every save: the non-tensor values are encoded,
the small leaves copied, and each leaf's version counter read for the proof
(``deferred.Proof``, one pass over the plan's ``watched_tensors``). Its storage is the plan's: the plan holds
that storage (its byte view, ``StreamLayout``), so no other storage can have
the address the leaf still has, and the same address is the same storage.

The plan holds the leaves it was made for (so an identity is never reused
while it is compared) until a save of another structure replaces it.
"""

from __future__ import annotations

import operator
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
from tensordict import NonTensorData, TensorDict

from ..core.types import Key, LocalShard
from .arena import Arena
from .deferred import Watched
from .eager import EagerCopies
from .slots import StreamLayout
from .snapshot import SnapshotBuffers
from .stream import StreamSources


@dataclass(frozen=True, slots=True)
class PlanSettings:
    """The arguments of a save that its plan depends on (a ``placements=`` mapping as its items)."""

    rank: int
    world: int
    placements: tuple[tuple[Any, Any], ...] | None
    robust_key: bool
    allow_pickle: bool
    copy_existing: bool
    check_replicas: bool
    guard: tuple[Any, ...] | None  # as given: None chooses among the optimizers ``get_state`` saw


@dataclass(frozen=True, slots=True)
class DeferredPlan:
    """What a deferred save of a packed directory derived from its leaves (see the module docstring)."""

    settings: PlanSettings
    seen: tuple[Any, ...]  # the optimizers get_state had seen (the default guard chose among them)
    guard: tuple[Any, ...]  # the optimizers that guard the save
    nodes: Mapping[Key, tuple[int, ...]]
    keys: tuple[Key, ...]
    given: tuple[torch.Tensor, ...]  # each leaf as the caller's state holds it
    meta: TensorMeta  # the leaves' metadata (``TensorMeta.same``)
    object_kinds: tuple[tuple[Key, str], ...]
    objects_per_rank: tuple[bool, ...]
    shard: LocalShard  # its non-tensor values are encoded again at every save
    sources: StreamSources
    eager: EagerCopies  # the leaves copied before save returns: their buffers, and how they are copied
    hashes_replicas: bool  # whether this rank's vote hashes a replica it does not write (copied at every save)
    written: list[tuple[Key, torch.Tensor]]  # what the stream copies: a snapshot buffer, or the leaf itself
    watched: list[Watched | None]  # per written leaf: what the proof checks, or None (copied eagerly)
    watched_tensors: tuple[torch.Tensor, ...]  # the watched leaves' tensors, in order (their versions: per save)
    watched_at: list[int]  # per written leaf: its place in ``watched_tensors`` (-1: copied eagerly)
    layout: StreamLayout
    arena: Arena
    buffers_generation: int
    tree: list[TreeNode] | None  # the state's nodes when it is TensorDicts only (``same_tree``)

    def matches(
        self,
        settings: PlanSettings,
        seen: tuple[Any, ...],
        nodes: Mapping[Key, tuple[int, ...]],
        leaves: Mapping[Key, torch.Tensor],
        objects: Mapping[Key, tuple[str, Any]],
        arena: Arena | None,
        buffers: SnapshotBuffers,
    ) -> bool:
        """Whether a save of these settings, nodes, leaves and non-tensor values has this plan."""
        return (
            settings == self.settings
            and arena is self.arena
            and buffers.generation == self.buffers_generation
            and (settings.guard is not None or _same_objects(seen, self.seen))
            and len(leaves) == len(self.given)
            and _same_objects(tuple(leaves.values()), self.given)
            and tuple(leaves) == self.keys
            and nodes == self.nodes
            and tuple((k, kind) for k, (kind, _v) in objects.items()) == self.object_kinds
            and self.meta.same(self.given)
        )

    def values_if_same(
        self, settings: PlanSettings, seen: tuple[Any, ...], data: Any, arena: Arena | None, buffers: SnapshotBuffers
    ) -> list[Any] | None:
        """``matches`` without flattening ``data`` (a state of TensorDicts only: ``tree``): its non-tensor values
        when it has this plan, else None (``matches`` then decides)."""
        if self.tree is None or not (
            settings == self.settings
            and arena is self.arena
            and buffers.generation == self.buffers_generation
            and (settings.guard is not None or _same_objects(seen, self.seen))
        ):
            return None
        values = same_tree(data, self.tree)
        if values is None or not self.meta.same(self.given):
            return None
        return values


#: In a ``TreeNode``'s entries: a sub-node (visited next, depth first) or a non-tensor value (encoded again).
NODE, VALUE = "node", "value"


@dataclass(frozen=True, slots=True)
class TreeNode:
    """One node of a state made only of TensorDicts, tensors and ``NonTensorData`` values, as ``tree`` found it:
    its batch size, its keys, and per key the leaf tensor itself, ``NODE`` or ``VALUE``."""

    batch_size: torch.Size
    keys: tuple[str, ...]
    entries: tuple[Any, ...]
    tensors_only: bool = False  # every entry a leaf tensor: compared by identity in one pass


def tree(data: Any) -> list[TreeNode] | None:
    """``data``'s nodes, depth first in ``flatten``'s order, or None when it holds anything else (a dict, a
    tensorclass, a stack, a tensor subclass): such a state is compared through ``flatten`` instead."""
    out: list[TreeNode] = []
    return out if _tree(data, out) else None


def _tree(node: Any, out: list[TreeNode]) -> bool:
    if type(node) is not TensorDict:
        return False
    d = node._tensordict
    entries: list[Any] = []
    out.append(TreeNode(node.batch_size, tuple(d), ()))
    at = len(out) - 1
    for v in d.values():
        if type(v) in _PLAIN:
            entries.append(v)
        elif type(v) is NonTensorData:
            entries.append(VALUE)
        elif type(v) is TensorDict:
            entries.append(NODE)
            if not _tree(v, out):
                return False
        else:
            return False
    plain = not any(e is NODE or e is VALUE for e in entries)
    out[at] = TreeNode(out[at].batch_size, out[at].keys, tuple(entries), plain)
    return True


def same_tree(data: Any, nodes: list[TreeNode]) -> list[Any] | None:
    """The non-tensor values of ``data`` (in ``flatten``'s order) when it has exactly the nodes, keys and leaf
    tensors (the same objects) of ``nodes``; else None."""
    values: list[Any] = []
    return values if _same(data, nodes, 0, values) == len(nodes) else None


def _same(node: Any, nodes: list[TreeNode], at: int, values: list[Any]) -> int:
    """Compare ``node`` with ``nodes[at]`` and its sub-nodes; the index after them, or -1."""
    if at >= len(nodes) or type(node) is not TensorDict:
        return -1
    expected, d = nodes[at], node._tensordict
    if len(d) != len(expected.keys) or tuple(d) != expected.keys or node.batch_size != expected.batch_size:
        return -1
    at += 1
    if expected.tensors_only:
        return at if all(map(operator.is_, d.values(), expected.entries)) else -1
    for v, e in zip(d.values(), expected.entries):
        if e is NODE:
            at = _same(v, nodes, at, values)
            if at < 0:
                return -1
        elif e is VALUE:
            if type(v) is not NonTensorData:
                return -1
            values.append(v.data)
        elif v is not e:
            return -1
    return at


def _same_objects(a: tuple[Any, ...], b: tuple[Any, ...]) -> bool:
    return len(a) == len(b) and all(map(operator.is_, a, b))


_PLAIN = (torch.Tensor, torch.nn.Parameter)


_DATA_PTR = torch.Tensor.data_ptr
_IS_SET_TO = torch.Tensor.is_set_to
_DTYPE = operator.attrgetter("dtype")


@dataclass(frozen=True, slots=True)
class TensorMeta:
    """What a plan depends on besides each leaf's identity: where its bytes are, their shape and type.

    ``aliases`` are new tensors on each leaf's storage, offset, shape and strides: ``is_set_to`` compares all
    four in one call (the same storage object is on the same device); the address catches a storage that
    moved (``resize_`` keeps the storage object), the dtype a ``.data =`` of another dtype on the same bytes.
    Compared an attribute at a time over all the leaves (``map`` runs in C: a tuple per leaf cost twice as
    much, on the blocking path of every save)."""

    addresses: list[int]
    aliases: tuple[torch.Tensor, ...]
    dtypes: list[torch.dtype]

    @staticmethod
    def of(tensors: tuple[torch.Tensor, ...]) -> TensorMeta:
        return TensorMeta(list(map(_DATA_PTR, tensors)), tuple(t.detach() for t in tensors), list(map(_DTYPE, tensors)))

    def same(self, tensors: tuple[torch.Tensor, ...]) -> bool:
        return (
            list(map(_DATA_PTR, tensors)) == self.addresses
            and all(map(_IS_SET_TO, tensors, self.aliases))
            and list(map(_DTYPE, tensors)) == self.dtypes
        )


def keepable(given: Mapping[Key, torch.Tensor], sources: Mapping[Key, torch.Tensor]) -> bool:
    """Whether a plan of these leaves can be reused: plain contiguous host tensors whose saved bytes are their
    own (no DTensor, no copy resolving a conjugate or a negation, no contiguous copy)."""
    for k, g in given.items():
        s = sources[k]
        if type(g) not in (torch.Tensor, torch.nn.Parameter) or not s.is_cpu or not s.is_contiguous():
            return False
        if s.data_ptr() != g.data_ptr():
            return False
    return True
