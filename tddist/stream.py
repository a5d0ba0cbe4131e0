"""Asynchronous saves in bounded host memory (``save(..., snapshot_budget=BYTES)``).

When this rank's bytes exceed the budget, they are not snapshotted whole: the
caller's thread copies them, in file order, into the slots of one reusable
arena of at most ``budget`` bytes, and the background writer hashes and writes
each filled slot into the rank's packed data file, then hands the slot back.
``save`` returns once the last byte is copied, so it blocks only until the
rest of the state fits in the budget (about ``state - budget`` bytes have
then been written), and the checkpoint holds the state as of the call: every
byte is copied before ``save`` returns, i.e. before the training loop can
change it again.

Only the packed directory layout streams: its offsets are known before any
byte is written (``merge.packed_offsets``), so slots are written at their
place in any order the writer likes, while an archive hashes and compresses
each entry before the staging area exists.
"""

from __future__ import annotations

import logging
import os
import queue
from dataclasses import dataclass

import numpy as np
import torch
import xxhash

from . import format as fmt
from .checksum import combine_digests
from .layouts.directory import DirectoryWriter
from .merge import PlanCache, packed_offsets
from .snapshot import local_source
from .types import Fragment, Key, LocalShard, SaveOptions, Staging, StoredBytes

logger = logging.getLogger(__name__)

#: The smallest budget accepted: two slots of half a MiB.
MIN_BUDGET = 1024 * 1024
_WRITE_STEP = 8 * 1024 * 1024


class StreamSources:
    """A ``snapshot.Snapshotter`` that copies nothing: it keeps each leaf's source and hands back a
    stand-in with the leaf's shape and dtype (on the ``meta`` device, so nothing can read it by mistake)."""

    def __init__(self) -> None:
        self.sources: dict[Key, torch.Tensor] = {}

    def snapshot(self, key: Key, t: torch.Tensor) -> torch.Tensor:
        t = local_source(t)
        self.sources[key] = t
        return torch.empty(t.shape, dtype=t.dtype, device="meta")

    def synchronize(self) -> None:
        pass

    def retain_only(self, keys: set[Key]) -> None:
        pass


#: The slot size of a pipelined whole-state save: the writer starts once the first slot is copied.
PIPELINE_SLOT = 4 * 1024 * 1024


def whole_state_budget(items: list[tuple[Key, torch.Tensor]], slot: int) -> int:
    """An arena budget of ``slot``-sized slots that holds every byte of ``items`` as packed, padding included.

    A slot closes early when the padding before the next leaf does not fit in
    it (less than ``PACK_ALIGN`` bytes lost), so one spare slot per
    ``slot // PACK_ALIGN`` leaves, and one more, cover every layout.
    """
    sizes = np.array([t.numel() * t.element_size() for _k, t in items], dtype=np.int64)
    _offsets, end = packed_offsets(sizes)
    nslots = -(-int(end) // slot) + len(items) * fmt.PACK_ALIGN // slot + 2
    return nslots * slot


def pipeline_slot(items: list[tuple[Key, torch.Tensor]]) -> int:
    """The slot size of a pipelined save of ``items``: ``PIPELINE_SLOT``, or less for a small state
    (a quarter of it, so that the writer still starts before the copy ends; never under ``PACK_ALIGN``)."""
    nbytes = sum(t.numel() * t.element_size() for _k, t in items)
    quarter = -(-nbytes // 4 // fmt.PACK_ALIGN) * fmt.PACK_ALIGN
    return max(fmt.PACK_ALIGN, min(PIPELINE_SLOT, quarter))


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
        self._view = self.memory.numpy().data
        self._slots = self.memory.view(self.nslots, slot).unbind()  # made once, reused by every save

    def slot(self, i: int) -> torch.Tensor:
        return self._slots[i]

    def slot_view(self, i: int, nbytes: int) -> memoryview:
        lo = i * self.slot_bytes
        return self._view[lo : lo + nbytes]


@dataclass(frozen=True, slots=True)
class _Filled:
    """A slot ready to be written: the file range it holds and the leaf pieces in it (for the checksums)."""

    slot: int
    file_start: int
    nbytes: int
    pieces: tuple[tuple[int, int, int, int], ...]  # (leaf index, offset in the leaf, offset in the slot, bytes)


_END = "end"


class _Cancelled(Exception):
    pass


class Stream:
    """One budgeted save: the caller's thread ``produce``s slots, the writer ``consume``s them."""

    def __init__(self, arena: Arena, items: list[tuple[Key, torch.Tensor]], rank: int) -> None:
        self.arena = arena
        self.rank = rank
        self.keys = [k for k, _t in items]
        self.sources = []
        for _k, t in items:
            if not t.is_contiguous():  # a temporary of this leaf's size; documented
                t = t.contiguous()
            self.sources.append(t.reshape(-1).view(torch.uint8))
        sizes = np.array([s.numel() for s in self.sources], dtype=np.int64)
        offsets, end = packed_offsets(sizes)
        self.offsets = [int(o) for o in offsets.tolist()]
        self.total = int(end)
        self._free: queue.SimpleQueue[int] = queue.SimpleQueue()
        for i in range(arena.nslots):
            self._free.put(i)
        self._ready: queue.SimpleQueue[_Filled | str | BaseException] = queue.SimpleQueue()
        self._cancelled = False

    @property
    def nbytes(self) -> int:
        return sum(s.numel() for s in self.sources)

    # --- the caller's thread ------------------------------------------------------------------

    def produce(self) -> None:
        """Copy every byte into slots, in file order; return when the last one is copied (or the writer gave up)."""
        try:
            self._produce()
        except _Cancelled:
            logger.info("rank %d: the background save failed; stopped copying its data", self.rank)
        except BaseException as e:
            self._ready.put(e)  # the writer raises it: this rank's vote fails, so every rank's save does
            raise

    def _produce(self) -> None:
        cb, size = fmt.CHECKSUM_BLOCK, self.arena.slot_bytes
        slot, start, fill = -1, 0, 0
        pieces: list[tuple[int, int, int, int]] = []
        for idx, (src, offset) in enumerate(zip(self.sources, self.offsets)):
            n, pos = src.numel(), 0
            while pos < n:
                if slot < 0:
                    slot, start, fill, pieces = self._take(), offset + pos, 0, []
                gap = offset + pos - (start + fill)  # padding before an aligned chunk
                if gap >= size - fill:
                    self._ready.put(_Filled(slot, start, fill, tuple(pieces)))
                    slot = -1
                    continue
                mem = self.arena.slot(slot)
                if gap:
                    mem[fill : fill + gap].zero_()
                    fill += gap
                k = min(n - pos, size - fill, (pos // cb + 1) * cb - pos)  # a piece stays in one checksum block
                mem[fill : fill + k].copy_(src if k == n else src[pos : pos + k])
                pieces.append((idx, pos, fill, k))
                fill += k
                pos += k
                if fill == size:
                    self._ready.put(_Filled(slot, start, fill, tuple(pieces)))
                    slot = -1
        if slot >= 0:
            self._ready.put(_Filled(slot, start, fill, tuple(pieces)))
        self._ready.put(_END)

    def _take(self) -> int:
        i = self._free.get()
        if i < 0 or self._cancelled:
            raise _Cancelled()
        return i

    # --- the writer's thread ------------------------------------------------------------------

    def cancel(self) -> None:
        """Wake the caller's thread if it waits for a slot: the save failed (idempotent)."""
        if not self._cancelled:
            self._cancelled = True
            self._free.put(-1)

    def consume(self, path: str) -> dict[Key, StoredBytes]:
        """Write every slot into the data file at ``path``, durably; return what each leaf stored."""
        cb = fmt.CHECKSUM_BLOCK
        digests: list[list[int]] = [[0] * ((s.numel() + cb - 1) // cb) for s in self.sources]
        hashers: dict[tuple[int, int], xxhash.xxh3_64] = {}
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        try:
            if self.total:
                os.posix_fallocate(fd, 0, self.total)
            while True:
                msg = self._ready.get()
                if msg == _END:
                    break
                if isinstance(msg, BaseException):
                    raise msg
                assert isinstance(msg, _Filled)
                view = self.arena.slot_view(msg.slot, msg.nbytes)
                for idx, at, lo, k in msg.pieces:
                    block, n = at // cb, self.sources[idx].numel()
                    h = hashers.get((idx, block))
                    if h is None:
                        h = hashers[(idx, block)] = xxhash.xxh3_64()
                    h.update(view[lo : lo + k])
                    if (at + k) % cb == 0 or at + k == n:
                        digests[idx][block] = h.intdigest()
                        del hashers[(idx, block)]
                pos = 0
                while pos < msg.nbytes:
                    pos += os.pwrite(fd, view[pos : pos + _WRITE_STEP], msg.file_start + pos)
                self._free.put(msg.slot)
            os.fsync(fd)
        finally:
            os.close(fd)
        return {k: StoredBytes(s.numel(), combine_digests(d)) for k, s, d in zip(self.keys, self.sources, digests)}


class StreamingWriter(DirectoryWriter):
    """A packed directory writer whose bytes come from a ``Stream`` instead of snapshot buffers."""

    def __init__(
        self, options: SaveOptions, rank: int, shard: LocalShard | Exception, cache: PlanCache | None, stream: Stream
    ) -> None:
        super().__init__(options, rank, shard, cache)
        self.stream = stream

    def write(self, staging: Staging) -> Fragment:
        try:
            self.check_reference(staging)
            stored = self.stream.consume(os.path.join(staging.path, fmt.rank_data_name(self.rank)))
        except BaseException:
            self.stream.cancel()
            raise
        return self.fragment(stored)
