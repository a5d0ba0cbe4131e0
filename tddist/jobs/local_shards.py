"""DTensor leaves in the node-local tier: each rank keeps its local shard, the promotion puts the DTensor back.

A DTensor (FSDP2 parameters and optimizer state) is a shard of a tensor
spread over the ranks; a rank's one-rank local checkpoint can only hold its
own shard. So before the local save each DTensor leaf is replaced by its
local tensor (``split``), and the layout it came from (mesh, placements,
global shape and stride) is kept in this process. The promotion rebuilds the
DTensors around the local copy's memory maps (``join``), so the collective
save to the root sees exactly what a direct save would; a local restore fills
the local tensors of the state's DTensors in place (``split`` of the target).

Each part also records where its DTensor shards lie in their global tensors
(``LeafBox``, in the part's metadata under ``BOXES_KEY``), so that the parts
can be resharded onto another world size without the processes that saved
them (``peer_restore``, ``box_reshard``).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
from tensordict import TensorDictBase, is_tensorclass

from .._compat import dtensor_local, dtensor_local_box
from ..core.sharding import Box
from ..core.tree import flatten, is_dtensor
from ..core.types import Key

#: The key of a local part's metadata that holds its DTensor leaves' boxes (``encode``); absent in parts
#: saved before they were recorded.
BOXES_KEY = "tddist-dtensor-boxes"


@dataclass(frozen=True)
class DTensorLayout:
    """Where one DTensor leaf came from, to rebuild it around its local shard.

    Attributes:
        key: the leaf's key.
        mesh: its ``DeviceMesh`` (in this process only; never sent to other ranks).
        placements: its placements.
        shape: its global shape.
        stride: its global stride.
        offsets: where this rank's local shard starts in the global tensor.
        sizes: the local shard's sizes.
    """

    key: Key
    mesh: Any
    placements: tuple[Any, ...]
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    offsets: tuple[int, ...] = ()
    sizes: tuple[int, ...] = ()


@dataclass(frozen=True)
class LeafBox:
    """Where one rank's shard of a DTensor leaf lies in the global tensor (sent to other ranks, JSON in a part).

    Attributes:
        key: the leaf's key.
        offsets: the shard's first index in each dimension of the global tensor.
        sizes: the shard's sizes.
        shape: the global tensor's shape.
    """

    key: Key
    offsets: tuple[int, ...]
    sizes: tuple[int, ...]
    shape: tuple[int, ...]

    @property
    def box(self) -> Box:
        """``(offsets, sizes)``, as ``core.sharding`` takes a box."""
        return self.offsets, self.sizes


def boxes(layouts: tuple[DTensorLayout, ...]) -> tuple[LeafBox, ...]:
    """The boxes of the local shards of the DTensor leaves ``layouts`` describe."""
    return tuple(LeafBox(lay.key, lay.offsets, lay.sizes, lay.shape) for lay in layouts)


def encode(found: tuple[LeafBox, ...]) -> list[dict[str, list[Any]]]:
    """``found`` as JSON (a part's metadata): one object per leaf, its key a list of names."""
    return [{"key": list(b.key), "offsets": list(b.offsets), "sizes": list(b.sizes), "shape": list(b.shape)}
            for b in found]  # fmt: skip


def decode(raw: object) -> tuple[LeafBox, ...] | None:
    """The boxes ``encode`` wrote, or None when ``raw`` is absent or not valid (the part cannot be resharded)."""
    if not isinstance(raw, list):
        return None
    out = []
    try:
        for item in raw:
            key = tuple(item["key"])
            dims = [tuple(item[f]) for f in ("offsets", "sizes", "shape")]
            if not all(isinstance(k, str) for k in key) or len({len(d) for d in dims}) != 1:
                return None
            if not all(type(x) is int and x >= 0 for d in dims for x in d):
                return None
            out.append(LeafBox(key, *dims))
    except (TypeError, KeyError):
        return None
    return tuple(out)


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
        offsets, sizes = dtensor_local_box(t)
        layouts.append(
            DTensorLayout(key, t.device_mesh, tuple(t.placements), tuple(t.shape), tuple(t.stride()), offsets, sizes)
        )
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
