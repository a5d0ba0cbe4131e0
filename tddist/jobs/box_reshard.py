"""DTensor leaves of the node-local copies onto another world size: which parts a rank needs, and filling from them.

Each local part records the box of every DTensor shard it holds
(``local_shards.LeafBox``: offsets and sizes in the global tensor). On
another world size a rank's DTensor leaves have boxes of their own (from the
live DTensors of the state it restores); it needs every part holding a box
that intersects one of them, and copies each intersection, an n-dimensional
slice, from the part's shard into its own. Parts holding the same box (a
Replicate placement) are interchangeable: one of them is read. A box of the
global tensor is held by at most one distinct box of each part set (DTensor
shards tile the global tensor), so a target box is covered exactly when the
volumes of its intersections add up to its own; when they do not, the leaf is
named in the error.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

import torch

from ..core.sharding import Box, intersect, volume
from ..core.types import Key
from ..errors import IncompatibleCheckpointError
from .local_shards import LeafBox


def holders(sources: Sequence[tuple[LeafBox, ...]], key: Key) -> dict[Box, list[int]]:
    """For leaf ``key``, each distinct box the parts hold and the parts (in order) that hold it."""
    out: dict[Box, list[int]] = {}
    for k, found in enumerate(sources):
        for b in found:
            if b.key == key:
                out.setdefault(b.box, []).append(k)
    return out


def overlapping(sources: Sequence[tuple[LeafBox, ...]], targets: tuple[LeafBox, ...], rank: int,
                chosen: set[int]) -> set[int]:  # fmt: skip
    """The parts a rank with DTensor boxes ``targets`` reads, ``sources[k]`` being part ``k``'s boxes.

    Of the parts holding the same box, one already in ``chosen`` (read for
    another leaf) is taken, else the part of this rank's number, else the first.
    """
    want = set(chosen)
    for target in targets:
        for box, parts in holders(sources, target.key).items():
            if intersect(box, target.box) is not None:
                want.add(min(parts, key=lambda k: (k not in want, k != rank, k)))
    return want - chosen


def fill(
    leaves: Mapping[Key, torch.Tensor],
    targets: tuple[LeafBox, ...],
    sources: Mapping[int, tuple[LeafBox, ...]],
    read: Callable[[int, Key], torch.Tensor],
    where: str,
) -> None:
    """Fill each DTensor leaf's local shard ``leaves[key]`` (its box in ``targets``) from the parts read.

    ``sources``: the boxes of the parts this rank read; ``read(k, key)``: part
    ``k``'s shard of leaf ``key``. ``where`` (rank and step) starts the messages.

    Raises:
        IncompatibleCheckpointError: a leaf's global shape differs from the parts', a part's shard is not the
            size its box says, or the parts read do not cover every element of a target box.
    """
    order = sorted(sources)
    for target in targets:
        local = leaves[target.key]
        name = "/".join(target.key)
        covered = 0
        found = holders([sources[k] for k in order], target.key)
        for box, parts in found.items():
            k = order[parts[0]]
            shape = next(b.shape for b in sources[k] if b.key == target.key)
            if shape != target.shape:
                raise IncompatibleCheckpointError(
                    f"{where}: DTensor {name} has the global shape {list(target.shape)}, the node-local copies "
                    f"hold one of {list(shape)}; restore into a state of the saved shapes"
                )
            inter = intersect(box, target.box)
            if inter is None:
                continue
            src = read(k, target.key)
            if tuple(src.shape) != box[1]:
                raise IncompatibleCheckpointError(
                    f"{where}: the node-local part {k} holds a shard of DTensor {name} of shape {list(src.shape)}, "
                    f"its recorded box has sizes {list(box[1])}"
                )
            local[_slices(inter, target.box)].copy_(src[_slices(inter, box)])
            covered += volume(inter)
        if covered != volume(target.box):
            raise IncompatibleCheckpointError(
                f"{where}: the node-local copies hold {covered} of the {volume(target.box)} elements of this rank's "
                f"shard of DTensor {name} (offsets {list(target.offsets)}, sizes {list(target.sizes)}); "
                f"restore it from the shared root"
            )


def _slices(inner: Box, outer: Box) -> tuple[slice, ...]:
    """The slices of ``inner`` in a tensor holding ``outer`` (``inner`` lies within it)."""
    return tuple(slice(io - oo, io - oo + size) for io, oo, size in zip(inner[0], outer[0], inner[1]))
