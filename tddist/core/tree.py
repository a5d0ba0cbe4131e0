"""Between user data and flat keys: flatten what ``save`` gets, rebuild what ``load`` returns.

Nodes are (sub-)TensorDicts, keyed by tuples of strings; leaves are tensors.
A nested ``dict`` is a node with no batch dims.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping
from typing import TYPE_CHECKING, Any, TypeGuard

import torch
from tensordict import NonTensorData, NonTensorStack, TensorDict, TensorDictBase, is_tensorclass

from .. import format as fmt
from .._compat import dtensor_local, dtensor_local_box
from ..errors import InvalidArgumentError, InvalidDataError, ManifestError
from .sharding import Box, Boxes, Placement, Replicate, Shard, consistent_batch

if TYPE_CHECKING:
    from torch.distributed.tensor import DTensor

Key = tuple[str, ...]


def flatten(data: Any) -> tuple[dict[Key, tuple[int, ...]], dict[Key, torch.Tensor], dict[Key, tuple[str, Any]]]:
    """``(nodes, leaves, objects)`` of a TensorDict, tensorclass or nested dict, in insertion order.

    ``objects`` holds the non-tensor leaves as ``("data", value)`` (one value,
    a ``NonTensorData`` or a plain Python value in a dict) or ``("stack",
    [values])`` (a ``NonTensorStack``: one value per row).
    """
    if is_tensorclass(data):
        data = data._tensordict
    if not isinstance(data, (TensorDictBase, Mapping)):
        raise InvalidDataError(
            f"save() takes a TensorDict, a tensorclass or a nested dict of tensors, got {type(data).__name__}"
        )
    nodes: dict[Key, tuple[int, ...]] = {}
    leaves: dict[Key, torch.Tensor] = {}
    objects: dict[Key, tuple[str, Any]] = {}
    _walk(data, (), nodes, leaves, objects)
    return nodes, leaves, objects


def _walk(
    node: Any,
    key: Key,
    nodes: dict[Key, tuple[int, ...]],
    leaves: dict[Key, torch.Tensor],
    objects: dict[Key, tuple[str, Any]],
) -> None:
    if isinstance(node, TensorDictBase):
        if not isinstance(node, TensorDict):
            node = node.to_tensordict()
        nodes[key] = tuple(node.batch_size)
        items = node.items(include_nested=False, leaves_only=False)
    else:
        nodes[key] = ()
        items = node.items()
    for name, value in items:
        if not isinstance(name, str):
            raise InvalidDataError(f"key {name!r} under {list(key)} is not a string; use string keys")
        if name in fmt.TD_META_RESERVED:
            raise InvalidDataError(
                f"key {name!r} under {list(key)} clashes with a field of tensordict's meta.json; rename it"
            )
        child = key + (name,)
        if type(value) in _PLAIN_TENSORS:  # the common case first: a tensor is none of the kinds below
            leaves[child] = value
        elif isinstance(value, NonTensorData):
            objects[child] = ("data", value.data)
        elif isinstance(value, NonTensorStack):
            if value.batch_dims != 1:
                raise InvalidDataError(
                    f"leaf {list(child)} is a NonTensorStack with {value.batch_dims} batch dims; only stacks "
                    f"along one dim are saved (flatten it, or store it as a NonTensorData)"
                )
            objects[child] = ("stack", value.tolist())
        elif is_tensorclass(value):
            _walk(value._tensordict, child, nodes, leaves, objects)
        elif isinstance(value, (TensorDictBase, Mapping)):
            _walk(value, child, nodes, leaves, objects)
        elif isinstance(value, torch.Tensor):
            if not (_is_plain_tensor(value) or is_dtensor(value)):
                raise InvalidDataError(
                    f"leaf {list(child)} is a {type(value).__name__}; tddist saves plain tensors and DTensors "
                    f"(convert it to one of those)"
                )
            leaves[child] = value
        else:
            objects[child] = ("data", value)


_PLAIN_TENSORS = (torch.Tensor, torch.nn.Parameter)


def _is_plain_tensor(t: torch.Tensor) -> bool:
    return type(t) in _PLAIN_TENSORS or type(t).__name__ == "MemoryMappedTensor"


def is_dtensor(t: object) -> TypeGuard[DTensor]:
    return type(t).__name__ == "DTensor" and hasattr(t, "device_mesh")


def dtensor_box(d: Any, key: Key) -> tuple[Box | None, bool]:
    """This rank's box of a DTensor in its global tensor, and whether this rank writes it.

    Of the ranks holding the same replica (Replicate on a mesh dim), only the
    one at coordinate 0 of those mesh dims writes. A rank outside the mesh has no box.
    """
    kinds = [type(p).__name__ for p in d.placements]
    if "Partial" in kinds:
        raise InvalidDataError(
            f"DTensor leaf {list(key)} has a Partial placement {d.placements}: its local values are not the "
            f"tensor's values yet; call .redistribute() to Replicate or Shard before saving"
        )
    coord = d.device_mesh.get_coordinate()
    if coord is None:
        return None, False
    box = dtensor_local_box(d)
    writes = all(c == 0 for c, k in zip(coord, kinds) if k == "Replicate")
    return box, writes


def local_bytes(t: torch.Tensor) -> torch.Tensor:
    """A contiguous CPU tensor with ``t``'s (local) values (a copy only when needed)."""
    if is_dtensor(t):
        t = dtensor_local(t)
    t = t.detach()
    if t.device.type != "cpu":
        t = t.cpu()
    if t.is_conj():
        t = t.resolve_conj()
    if t.is_neg():
        t = t.resolve_neg()
    return t.contiguous()


def local_bytes_source(t: torch.Tensor) -> int:
    """The address of the storage ``local_bytes(t)`` starts from (a DTensor's local shard's): equal to the
    result's when ``local_bytes`` made no copy."""
    if is_dtensor(t):
        t = dtensor_local(t)
    return int(t.untyped_storage().data_ptr())


def resolve_placements(
    nodes: dict[Key, tuple[int, ...]], leaves: dict[Key, torch.Tensor], overrides: Mapping[Any, Any] | None
) -> dict[Key, Placement]:
    """Each leaf's placement: Boxes for a DTensor (it keeps its own placements); else the override
    for it or its nearest node, else Shard(0) under batch dims, else Replicate."""
    norm: dict[Key, Shard | Replicate] = {}
    for k, p in (overrides or {}).items():
        key = (k,) if isinstance(k, str) else tuple(k)
        if key not in leaves and key not in nodes:
            raise InvalidArgumentError(
                f"placements names key {k!r}, which is not in the data; known keys: {_some(leaves)}"
            )
        norm[key] = _placement(p, k)
    out: dict[Key, Placement] = {}
    for key, t in leaves.items():
        if is_dtensor(t):
            if key in norm:
                raise InvalidArgumentError(
                    f"placements names DTensor leaf {list(key)}; a DTensor keeps its own placements "
                    f"({t.placements}); redistribute it instead"
                )
            out[key] = Boxes()
            continue
        p = next((norm[key[:i]] for i in range(len(key), -1, -1) if key[:i] in norm), None)
        if p is None:
            p = Shard(0) if nodes[key[:-1]] else Replicate()
        if isinstance(p, Shard) and not 0 <= p.dim < t.dim():
            raise InvalidDataError(
                f"leaf {list(key)} of shape {list(t.shape)} cannot be sharded along dim {p.dim}; "
                f"give it placements={{{key!r}: tddist.Replicate()}} or a valid dim"
            )
        out[key] = p
    return out


def _placement(p: Any, name: object) -> Shard | Replicate:
    if isinstance(p, (Shard, Replicate)):
        return p
    cls = type(p).__name__
    if cls == "Shard" and hasattr(p, "dim"):  # torch.distributed.tensor.Shard
        return Shard(int(p.dim))
    if cls == "Replicate":
        return Replicate()
    raise InvalidArgumentError(f"placement {p!r} for {name!r} is not tddist.Shard(dim) or tddist.Replicate()")


def _some(d: Collection[Any]) -> str:
    keys = [k[0] if len(k) == 1 else k for k in list(d)[:8]]
    return f"{keys}{' ...' if len(d) > 8 else ''}"


def normalize_keys(keys: Any) -> tuple[Key, ...] | None:
    """The public ``keys=`` value (a key, a tuple key, or a list of them; None: all) as a tuple of keys."""
    if keys is None:
        return None
    return tuple((k,) if isinstance(k, str) else tuple(k) for k in ([keys] if isinstance(keys, (str, tuple)) else keys))


def select(
    leaf_keys: list[Key], nodes: Mapping[Key, tuple[int, ...]], wanted: tuple[Key, ...] | None
) -> tuple[list[Key], list[Key]]:
    """(leaf keys, node keys) named by ``wanted``: a leaf, or a node meaning everything under it."""
    if wanted is None:
        return list(leaf_keys), list(nodes)
    out: list[Key] = []
    for w in wanted:
        hits = [k for k in leaf_keys if k[: len(w)] == w]
        if not hits and w not in nodes:
            raise InvalidArgumentError(f"key {w!r} is not in the checkpoint; it holds {_some(leaf_keys)}")
        out.extend(h for h in hits if h not in out)
    chosen = set(out) | {w for w in wanted if w in nodes}
    node_keys = [n for n in nodes if not n or any(c[: len(n)] == n for c in chosen)]
    return out, node_keys


def build(
    nodes: dict[Key, tuple[int, ...]],
    leaves: dict[Key, torch.Tensor],
    node_rows: Callable[[Key, tuple[int, ...]], int],
    device: torch.device | str | None = None,
    objects: dict[Key, tuple[str, Any]] | None = None,
    share_non_tensor: bool = False,
) -> TensorDict:
    """A TensorDict from loaded leaves and non-tensor objects (as ``flatten`` returns them).

    A node's batch size is its saved one with dim 0 set to
    ``node_rows(key, batch)``, shortened until every child fits.
    ``share_non_tensor`` puts non-tensor values in shared memory, as
    tensordict's ``memmap(share_non_tensor=True)`` does.
    """
    children: dict[Key, dict[str, Any]] = {k: {} for k in nodes}
    for key, t in leaves.items():
        children[key[:-1]][key[-1]] = t
    node_objects: dict[Key, dict[str, tuple[str, Any]]] = {k: {} for k in nodes}
    for key, obj in (objects or {}).items():
        node_objects[key[:-1]][key[-1]] = obj
    root = None
    for key in sorted(nodes, key=len, reverse=True):
        batch = nodes[key]
        if batch:
            batch = (node_rows(key, batch), *batch[1:])
        source = children[key]
        shapes = [v.batch_size if isinstance(v, TensorDictBase) else v.shape for v in source.values()]
        shapes += [(len(v),) for kind, v in node_objects[key].values() if kind == "stack"]
        root = TensorDict(source, batch_size=consistent_batch(batch, shapes), device=device)
        for name, (kind, value) in node_objects[key].items():
            if kind == "stack":
                root.set(name, stack_of(value, (*key, name)))
            else:
                root.set_non_tensor(name, value)
            if share_non_tensor:
                root.get(name).share_memory_()
        if key:
            children[key[:-1]][key[-1]] = root
    assert root is not None  # ``nodes`` always holds the root key (), built last
    return root


def stack_of(rows: list[Any], key: Key) -> NonTensorStack:
    """The saved rows of the non-tensor stack ``key`` as a ``NonTensorStack``.

    Raises:
        ManifestError: rows that tensordict cannot stack (a damaged or crafted manifest).
    """
    try:
        return NonTensorStack.from_list(rows)
    except (RuntimeError, ValueError, TypeError) as e:
        raise ManifestError(
            f"non-tensor stack {list(key)} has rows that cannot be stacked ({str(e)[:200]}); the checkpoint is damaged"
        ) from None
