"""The eager copies of a deferred save: the leaves copied before ``save`` returns (``deferred.eager_keys``).

At 672 leaves about 420 are small (biases, their moments, step counters):
``torch._foreach_copy_`` into a buffer per leaf cost about a microsecond per
leaf on the caller's thread. Leaves of one dtype are copied instead by one
``torch.cat`` into a flat buffer (``SnapshotBuffers.flat``) whose views are
their snapshot buffers: about half of that. The leaves' flattened views are
made once with the plan (``deferred_plan``), which is reused only while each
leaf keeps its storage address, shape, strides and dtype, so a view always
reads the leaf's own bytes. Leaves that are not contiguous keep a buffer each
(``SnapshotBuffers.snapshot``) and are copied by ``torch._foreach_copy_``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from ..core.types import Key
from .snapshot import SnapshotBuffers


@dataclass(frozen=True, slots=True)
class EagerCopies:
    """How a plan's eager leaves are copied: per dtype, the leaves flattened (``cat_sources``) and the flat buffer
    they are concatenated into (``cat_out``); the rest one by one (``one_buffers`` from ``one_sources``)."""

    buffers: dict[Key, torch.Tensor]  # each eager leaf's snapshot buffer (a view of a flat one, or its own)
    cat_sources: tuple[list[torch.Tensor], ...]
    cat_out: tuple[torch.Tensor, ...]
    one_buffers: list[torch.Tensor]
    one_sources: list[torch.Tensor]

    def copy(self) -> None:
        """Copy every eager leaf into its buffer (the caller's thread, before ``save`` returns)."""
        for sources, out in zip(self.cat_sources, self.cat_out):
            torch.cat(sources, out=out)
        if self.one_buffers:
            torch._foreach_copy_(self.one_buffers, self.one_sources)


def eager_copies(buffers: SnapshotBuffers, leaves: Sequence[tuple[Key, torch.Tensor]]) -> EagerCopies:
    """The buffers of ``leaves`` (host tensors, as the stream reads them) and how they are copied; nothing is
    copied yet. Kept buffers are reused (``SnapshotBuffers``): no memory is allocated by a save of the same
    leaves."""
    by_dtype: dict[torch.dtype, list[tuple[Key, torch.Tensor]]] = {}
    one_keys: list[Key] = []
    one_sources: list[torch.Tensor] = []
    for k, t in leaves:
        if t.is_contiguous():
            by_dtype.setdefault(t.dtype, []).append((k, t))
        else:
            one_keys.append(k)
            one_sources.append(t)
    out: dict[Key, torch.Tensor] = {}
    cat_sources, cat_out = [], []
    for dtype, group in by_dtype.items():
        flat = buffers.flat(dtype, sum(t.numel() for _k, t in group))
        at = 0
        for k, t in group:
            out[k] = flat[at : at + t.numel()].view(t.shape)
            at += t.numel()
        cat_sources.append([t.view(-1) for _k, t in group])
        cat_out.append(flat)
    one_buffers = [buffers.snapshot(k, t) for k, t in zip(one_keys, one_sources)]
    out.update(zip(one_keys, one_buffers))
    return EagerCopies(out, tuple(cat_sources), tuple(cat_out), one_buffers, one_sources)
