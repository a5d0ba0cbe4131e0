"""The host memory of streamed saves (``arena.Arena``), and the copy of host bytes into it (``copy_bytes``).

One arena per channel of asynchronous saves, allocated by the first streamed
save and reused by the next ones: a ``return_early`` save of a packed
directory copies the whole state into it (``stream.Stream``, the whole mode),
a save with ``snapshot_budget`` streams through it, and a writer process
shares one with its trainer (``writer_process``).
"""

from __future__ import annotations

import ctypes

import numpy as np
import torch

from .. import format as fmt
from .slots import SlotFill

#: The smallest budget accepted: two slots of half a MiB.
MIN_BUDGET = 1024 * 1024


class Arena:
    """The host memory of streamed saves: ``nslots`` slots of ``slot_bytes``, at most ``budget`` bytes in all.

    One per channel, allocated at the first streamed save and reused by the next ones. ``slot`` fixes
    the slot size (a pipelined whole-state save); by default it is a checksum block or half the budget.
    """

    def __init__(self, budget: int, pin: bool = False, slot: int | None = None) -> None:
        if slot is None:
            slot = min(fmt.CHECKSUM_BLOCK, budget // 2 // fmt.PACK_ALIGN * fmt.PACK_ALIGN)
        self.budget = budget
        self.slot_bytes = slot
        self.nslots = budget // slot
        self.pinned = pin
        self.memory = torch.empty(self.nslots * slot, dtype=torch.uint8, pin_memory=pin)
        self.address = self.memory.data_ptr()
        self._array = self.memory.numpy()
        self._view = self._array.data
        self._zeroed_for: tuple[SlotFill, ...] | None = None

    def slot_array(self, i: int) -> np.ndarray:
        """Slot ``i`` as a numpy array (the arena's own memory)."""
        lo = i * self.slot_bytes
        return self._array[lo : lo + self.slot_bytes]

    def zero_gaps(self, fills: tuple[SlotFill, ...]) -> None:
        """Zero the padding between the pieces of a whole-mode ``fills`` (entry ``i`` in slot ``i``).

        Done once for the latest assignment (``assign_slots`` hands the same ``fills``
        object to saves of the same sizes): zeroing a gap costs microseconds,
        milliseconds per save at 1,000 leaves on the caller's thread. Copies of
        the same fills never write into its gaps, so they stay zero until a
        bounded save uses the slots (``forget_zeroed_gaps``).
        """
        if self._zeroed_for is not fills:
            for i, e in enumerate(fills):
                mem, fill = self.slot_array(i), 0
                for _idx, _at, lo, k in e.pieces:
                    if lo > fill:
                        mem[fill:lo] = 0
                    fill = lo + k
            self._zeroed_for = fills

    def forget_zeroed_gaps(self) -> None:
        """A bounded save fills any slot with any entry: the gaps of the latest assignment may no longer be zero."""
        self._zeroed_for = None

    def slot_view(self, i: int, nbytes: int) -> memoryview:
        lo = i * self.slot_bytes
        return self._view[lo : lo + nbytes]


def copy_bytes(destination: int, source: int, nbytes: int) -> None:
    """Copy ``nbytes`` from address ``source`` into address ``destination`` (host memory; no overlap).

    libc's ``memmove`` through ctypes, which drops the interpreter lock for
    the call, so the caller and the copy helper copy in parallel. Written by
    hand because neither library copies host bytes as well with nothing else
    to it: torch's ``copy_`` costs 2-3 us a piece against 0.5 us (a state of
    many small leaves), and on one thread it copied 1 GiB in 4 MiB pieces in
    32 ms against ``memmove``'s 57 (AMD EPYC, 2 cores) but two threads of
    either took 34-35 ms (the memory bandwidth), and with it the
    ``return_early`` benchmark's blocking and completion were no better at 1,
    2 and 4 ranks; numpy's ``copyto`` (``memmove`` again) needs the leaf
    exported to numpy, which marks the caller's storage not resizable for
    good. Addresses come from ``data_ptr()`` of tensors the stream holds
    while it copies, and ranges from the assignment (``fill_slots``), which
    never crosses a leaf's end or a slot's.
    """
    ctypes.memmove(destination, source, nbytes)
