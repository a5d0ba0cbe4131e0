"""Where a rank's leaves lie in its packed data file, and how their bytes fill the slots of an arena.

A streamed save (``stream.Stream``) copies the leaves into the slots of an
arena (``arena.Arena``) and writes each slot at its place in the data file.
This module plans it from the leaves' sizes alone: the packed offsets
(``manifest.locate.packed_offsets``), the file ranges of the slots and the
leaf pieces in each (``fill_slots``, cached per sizes by ``assign_slots``),
and the slot size and arena budget of a whole-state save.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np
import torch

from .. import format as fmt
from ..core.types import Key
from ..manifest.locate import packed_offsets

#: The slot size of a pipelined whole-state save: the unit the caller and the worker share the copying in.
PIPELINE_SLOT = 4 * 1024 * 1024


def whole_state_budget(items: list[tuple[Key, torch.Tensor]], slot: int) -> int:
    """An arena budget of ``slot``-sized slots that holds every byte of ``items`` as packed, padding included.

    A slot closes early when the padding before the next leaf does not fit in
    it (less than ``PACK_ALIGN`` bytes lost), so one spare slot per
    ``slot // PACK_ALIGN`` leaves, and one more, cover every arrangement of the leaves.
    """
    sizes = np.array([t.numel() * t.element_size() for _k, t in items], dtype=np.int64)
    _offsets, end = packed_offsets(sizes)
    nslots = -(-int(end) // slot) + len(items) * fmt.PACK_ALIGN // slot + 2
    return nslots * slot


def pipeline_slot(items: list[tuple[Key, torch.Tensor]]) -> int:
    """The slot size of a pipelined save of ``items``: ``PIPELINE_SLOT``, or less for a small state
    (a quarter of it, so that the worker still has slots to copy when it joins; never under ``PACK_ALIGN``)."""
    nbytes = sum(t.numel() * t.element_size() for _k, t in items)
    quarter = -(-nbytes // 4 // fmt.PACK_ALIGN) * fmt.PACK_ALIGN
    return max(fmt.PACK_ALIGN, min(PIPELINE_SLOT, quarter))


@dataclass(frozen=True, slots=True)
class SlotFill:
    """A slot's worth of the data file: the file range it holds and the leaf pieces in it (also for the
    checksums). In an assignment (``fill_slots``) ``slot`` is -1; once copied it is the arena slot that holds it."""

    slot: int
    file_start: int
    nbytes: int
    pieces: tuple[tuple[int, int, int, int], ...]  # (leaf index, offset in the leaf, offset in the slot, bytes)


@dataclass(frozen=True, slots=True)
class SlotAssignment:
    """Where leaves of some sizes lie in a packed data file and how they fill slots (``assign_slots``)."""

    offsets: tuple[int, ...]
    total: int
    fills: tuple[SlotFill, ...]


def assign_slots(sizes: tuple[int, ...], slot_bytes: int) -> SlotAssignment:
    """The packed offsets, file size and slot assignment of leaves of ``sizes`` (bytes), made once per sizes: a
    training loop saves the same sizes every time, and planning costs about 1 us a leaf."""
    return _assign_slots(sizes, slot_bytes, fmt.PACK_ALIGN, fmt.CHECKSUM_BLOCK)


@functools.lru_cache(maxsize=8)
def _assign_slots(sizes: tuple[int, ...], slot_bytes: int, _align: int, _block: int) -> SlotAssignment:
    """``assign_slots``, cached by everything the assignment depends on (the format's alignment and block too)."""
    offsets, end = packed_offsets(np.array(sizes, dtype=np.int64))
    offsets_list = [int(o) for o in offsets.tolist()]
    return SlotAssignment(tuple(offsets_list), int(end), tuple(fill_slots(list(sizes), offsets_list, slot_bytes)))


def fill_slots(sizes: list[int], offsets: list[int], slot_bytes: int) -> list[SlotFill]:
    """How the bytes of leaves of ``sizes`` at packed ``offsets`` fill slots of ``slot_bytes``, in file order.

    Each slot holds one contiguous range of the data file: leaf pieces and
    the zero padding between them. A slot closes early when the padding before
    the next leaf does not fit in it (that padding is never written: the file
    is allocated, so it reads as zeros), and a piece never crosses a checksum
    block of its leaf, so the writer can hash blocks incrementally.
    """
    cb, out = fmt.CHECKSUM_BLOCK, []
    pieces: list[tuple[int, int, int, int]] = []
    start, fill, open_ = 0, 0, False
    for idx, (n, offset) in enumerate(zip(sizes, offsets)):
        pos = 0
        while pos < n:
            if not open_:
                start, fill, pieces, open_ = offset + pos, 0, [], True
            gap = offset + pos - (start + fill)  # padding before an aligned chunk
            if gap >= slot_bytes - fill:
                out.append(SlotFill(-1, start, fill, tuple(pieces)))
                open_ = False
                continue
            fill += gap
            k = min(n - pos, slot_bytes - fill, (pos // cb + 1) * cb - pos)
            pieces.append((idx, pos, fill, k))
            fill += k
            pos += k
            if fill == slot_bytes:
                out.append(SlotFill(-1, start, fill, tuple(pieces)))
                open_ = False
    if open_:
        out.append(SlotFill(-1, start, fill, tuple(pieces)))
    return out


def _bytes_of(t: torch.Tensor) -> torch.Tensor:
    """``t``'s bytes as a flat ``uint8`` tensor (a view; a copy only when ``t`` is not contiguous).

    ``view(torch.uint8)`` first, then flat only when needed: ``reshape(-1)``
    of a 1-D tensor costs 3.5 us for nothing, 3.5 ms per save at 1,000 leaves.
    """
    if not t.is_contiguous():  # a temporary of this leaf's size; documented
        t = t.contiguous()
    if t.dim() == 0:
        t = t.reshape(1)
    b = t.view(torch.uint8)
    return b if b.dim() == 1 else b.reshape(-1)


@dataclass(frozen=True, slots=True)
class StreamLayout:
    """What a ``Stream`` derives from its leaves alone: their keys, bytes (flat ``uint8`` views), host addresses
    (None for a device leaf) and slot assignment. The same leaves, unchanged (the same tensors, storages and
    shapes), have the same layout: a deferred save of an unchanged state reuses it (``deferred_plan``)."""

    keys: list[Key]
    sources: list[torch.Tensor]
    addresses: list[int | None]
    slot_bytes: int
    assigned: SlotAssignment


def stream_layout(items: list[tuple[Key, torch.Tensor]], slot_bytes: int) -> StreamLayout:
    """The layout of ``items`` in slots of ``slot_bytes``."""
    sources = [_bytes_of(t) for _k, t in items]
    # Host leaves are copied by address (``arena.copy_bytes``); device leaves (None) by ``copy_``.
    addresses = [s.data_ptr() if s.is_cpu else None for s in sources]
    assigned = assign_slots(tuple(s.numel() for s in sources), slot_bytes)
    return StreamLayout([k for k, _t in items], sources, addresses, slot_bytes, assigned)
