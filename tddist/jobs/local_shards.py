"""DTensor leaves in the node-local tier: each rank keeps its local shard, the promotion puts the DTensor back.

A DTensor (FSDP2 parameters and optimizer state) is a shard of a tensor
spread over the ranks; a rank's one-rank local checkpoint can only hold its
own shard. So before the local save each DTensor leaf is replaced by its
local tensor (``split``), and the layout it came from (mesh, placements,
global shape and stride) is kept in this process. The promotion rebuilds the
DTensors around the local copy's memory maps (``join``), so the collective
save to the root sees exactly what a direct save would; a local restore fills
the local tensors of the state's DTensors in place (``split`` of the target).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
from tensordict import TensorDictBase, is_tensorclass

from .._compat import dtensor_local
from ..core.tree import flatten, is_dtensor
from ..core.types import Key


@dataclass(frozen=True)
class DTensorLayout:
    """Where one DTensor leaf came from, to rebuild it around its local shard.

    Attributes:
        key: the leaf's key.
        mesh: its ``DeviceMesh`` (in this process only; never sent to other ranks).
        placements: its placements.
        shape: its global shape.
        stride: its global stride.
    """

    key: Key
    mesh: Any
    placements: tuple[Any, ...]
    shape: tuple[int, ...]
    stride: tuple[int, ...]


def split(data: Any) -> tuple[Any, tuple[DTensorLayout, ...]]:
    """``data`` with every DTensor leaf replaced by its local tensor (sharing its memory), and their layouts.

    ``data`` itself is not modified: its containers are copied (not its
    tensors). Without DTensor leaves, ``data`` is returned as is.
    """
    _nodes, leaves, _objects = flatten(data)
    found = {k: t for k, t in leaves.items() if is_dtensor(t)}
    if not found:
        return data, ()
    out = _copy_containers(data)
    layouts = []
    for key, t in found.items():
        _set(out, key, dtensor_local(t))
        layouts.append(DTensorLayout(key, t.device_mesh, tuple(t.placements), tuple(t.shape), tuple(t.stride())))
    return out, tuple(layouts)


def join(data: Any, layouts: tuple[DTensorLayout, ...]) -> Any:
    """``data`` (a TensorDict read back from a local copy) with each local shard wrapped as its DTensor again."""
    if not layouts:
        return data
    from torch.distributed.tensor import DTensor

    for layout in layouts:
        local = data.get(layout.key)
        d = DTensor.from_local(
            local, layout.mesh, layout.placements, run_check=False, shape=torch.Size(layout.shape), stride=layout.stride
        )
        data.set(layout.key, d)
    return data


def _copy_containers(node: Any) -> Any:
    if is_tensorclass(node):
        node = node._tensordict
    if isinstance(node, TensorDictBase):
        return node.clone(recurse=False)  # new nodes, the same tensors
    if isinstance(node, Mapping):
        return {k: _copy_containers(v) if isinstance(v, (Mapping, TensorDictBase)) or is_tensorclass(v) else v
                for k, v in node.items()}  # fmt: skip
    return node


def _set(root: Any, key: Key, value: torch.Tensor) -> None:
    node = root
    for name in key[:-1]:
        node = node[name]
    node[key[-1]] = value
