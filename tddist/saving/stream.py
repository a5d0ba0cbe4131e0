"""Asynchronous saves through one reusable arena: bounded host memory, or the whole state copied by two threads.

**Bounded** (``save(..., snapshot_budget=BYTES)``, when this rank's bytes
exceed the budget): the state is not snapshotted whole. The caller's thread
copies it, in file order, into the slots of one reusable arena of at most
``budget`` bytes, and the background writer hashes and writes each filled
slot into the rank's packed data file, then hands the slot back. ``save``
returns once the last byte is copied, so it blocks only until the rest of
the state fits in the budget (about ``state - budget`` bytes have then been
written).

**Whole** (a ``return_early`` save of a packed directory without a budget):
the arena holds the whole state, reused by the next save. The caller and
the background writer share the copying (see ``Stream``), then the writer
hashes and writes every slot.

Either way the checkpoint holds the state as of the call: every byte is
copied before ``save`` returns, i.e. before the training loop can change it
again. Only the packed directory streams: its offsets are known
before any byte is written (``manifest.locate.packed_offsets``), so slots are written
at their place in any order the writer likes, while an archive hashes and
compresses each entry before the staging area exists.

The plan of the slots is ``slots.py``'s, the arena and the copy into it
``arena.py``'s; this module runs a save through them.
"""

from __future__ import annotations

import functools
import logging
import os
import queue
import threading
from collections import deque
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING

import torch
import xxhash

from .. import format as fmt
from .._fs import WRITE_STEP, wait_for_writeback, write_and_start_writeback
from ..checksum import combine_digests
from ..core.finite import StatsCounter, counter_for
from ..core.types import Fragment, Key, LocalShard, SaveOptions, Staging, StoredBytes
from ..manifest.merge import MergeCache
from ..storage.directory import DirectoryWriter
from .arena import Arena, copy_bytes
from .slots import SlotFill, StreamLayout, stream_layout
from .snapshot import local_source

if TYPE_CHECKING:
    from .deferred import Proof

logger = logging.getLogger(__name__)


class StreamSources:
    """A ``snapshot.Snapshotter`` that copies nothing: it keeps each leaf's source and hands back a
    stand-in with the leaf's shape and dtype (on the ``meta`` device, so nothing can read it by mistake)."""

    def __init__(self) -> None:
        self.sources: dict[Key, torch.Tensor] = {}
        self.given: dict[Key, torch.Tensor] = {}  # each leaf as the caller's state holds it (a deferred save's proof)

    def snapshot(self, key: Key, t: torch.Tensor) -> torch.Tensor:
        self.given[key] = t
        t = local_source(t)
        self.sources[key] = t
        return _stand_in(t.shape, t.dtype)

    def synchronize(self) -> None:
        pass

    def retain_only(self, keys: set[Key]) -> None:
        pass


@functools.lru_cache(maxsize=4096)
def _stand_in(shape: torch.Size, dtype: torch.dtype) -> torch.Tensor:
    """A ``meta`` tensor of ``shape`` and ``dtype``, made once and shared: nothing writes into a stand-in, and
    a training state has few distinct shapes, so each save no longer makes one per leaf (4 us each)."""
    return torch.empty(shape, dtype=dtype, device="meta")


#: The most slots written while the caller copies whose write-back may still be in flight (``Stream.write_early``):
#: 16 MiB of 4 MiB slots, a few milliseconds of a disk's write.
EARLY_IN_FLIGHT = 4
#: The smallest whole-state stream written while it is copied: below it the copy lasts a few milliseconds and
#: handing the first slots to another thread costs more than their early write gains.
EARLY_WRITE_MIN = 64 * 1024 * 1024


_END = "end"


class _Cancelled(Exception):
    pass


class Stream:
    """One streamed save: the caller's thread ``produce``s slots, the writer ``consume``s them.

    Two modes, decided by the arena's size. **Bounded** (the arena is smaller
    than the data, ``snapshot_budget``): the caller copies each slot as one is
    free and the writer writes and frees slots meanwhile, so ``save`` returns
    once the rest fits. **Whole** (every slot of the assignment has its own place in
    the arena, a pipelined save): the two threads share the copying, the
    caller from the first slot on and a helper thread (``Channel.help_copy``)
    from the last slot back. The copy is what the training thread waits for,
    so both threads work on it (two threads copy about 1.4x faster than one
    here). Meanwhile, where ``early_writes`` is set, a third thread writes the
    slots the caller has copied, in file order, no faster than the disk
    takes them (``write_early``), so that the disk works during the copy
    instead of after it; the writer writes the rest once every byte is copied.
    """

    def __init__(
        self, arena: Arena, items: list[tuple[Key, torch.Tensor]], rank: int, layout: StreamLayout | None = None
    ) -> None:
        self.arena = arena
        self.rank = rank
        # The leaves' tensors (the detached views ``prepare_shard`` made) stay referenced until the stream
        # goes, on the worker's thread: freed as the caller returned from ``save`` they took it 8-9 ms at
        # 1,000 leaves while the commit's thread ran (1 ms of CPU, the rest waiting), longer than a copy.
        self._items = items
        if layout is None or layout.slot_bytes != arena.slot_bytes:
            layout = stream_layout(items, arena.slot_bytes)
        self.layout = layout
        self.keys, self.sources, self._addresses = layout.keys, layout.sources, layout.addresses
        # Each floating leaf's counts of non-finite values, made in the hashing pass (``consume``).
        self.counters: list[StatsCounter | None] = []
        assigned = layout.assigned
        self.offsets, self.total, self.fills = assigned.offsets, assigned.total, assigned.fills
        self.whole = len(self.fills) <= arena.nslots
        if self.whole:
            arena.zero_gaps(self.fills)
        else:
            arena.forget_zeroed_gaps()
        self._free: queue.SimpleQueue[int] = queue.SimpleQueue()
        for i in range(arena.nslots):
            self._free.put(i)
        self._ready: queue.SimpleQueue[SlotFill | str | BaseException] = queue.SimpleQueue()
        self._cancelled = False
        # The whole mode's shared state: the fills not yet taken are [_front, _back); _left are not copied.
        self._lock = threading.Lock()
        self._front, self._back, self._left = 0, len(self.fills), len(self.fills)
        self._copied = threading.Event()  # every byte copied, or the save failed
        # The caller is done with the stream (``produce`` returned or raised) or the save failed: the writer
        # waits for this, not for ``_copied``, so that it does not wake with the caller and take the
        # interpreter lock while the caller returns from ``save`` (0.7 ms per save measured).
        self._handed_over = threading.Event()
        self.proof: Proof | None = None  # a deferred save's: checked after each slot's copy (``produce_deferred``)
        # Runs ``write_early`` on a thread at the training's priority while the caller copies (the whole mode;
        # ``Channel.write_early``); None: the writer waits for the whole copy before it writes.
        self.early_writes: Callable[[Callable[[], list[SlotFill]]], Future[list[SlotFill]]] | None = None
        if self.whole and not self.fills:
            self._ready.put(_END)
            self._copied.set()

    @property
    def nbytes(self) -> int:
        return sum(s.numel() for s in self.sources)

    # --- the caller's thread ------------------------------------------------------------------

    def produce(self) -> None:
        """Copy every byte into slots; return when the last one is copied (or the writer gave up)."""
        try:
            if self.whole:
                while (i := self._take_assigned(front=True)) is not None:
                    self._fill_shared(i)
                self._copied.wait()  # the writer's last slot
                if self._cancelled:
                    raise _Cancelled()
            else:
                for entry in self.fills:
                    self._fill(entry, self._take())
                self._ready.put(_END)
        except _Cancelled:
            logger.info("rank %d: the background save failed; stopped copying its data", self.rank)
        except BaseException as e:
            self._ready.put(e)  # the writer raises it: this rank's vote fails, so every rank's save does
            self._copied.set()
            raise
        finally:
            self._handed_over.set()

    def produce_deferred(self) -> None:
        """(the copy helper, after ``save`` returned: a deferred snapshot) Copy every slot, checking the proof
        after each one; stop at the first changed leaf. The proof is sealed before the writer and the guard
        are let go, so a failure is known to both (the writer then votes it instead of writing)."""
        assert self.whole and self.proof is not None
        try:
            while (i := self._take_assigned(front=True)) is not None:
                self._fill_shared(i)
                if self.proof.failure is not None:
                    self.cancel()
        except BaseException as e:
            self._ready.put(e)  # the writer raises it: this rank's vote fails, so every rank's save does
            self.cancel()
            raise
        finally:
            self.proof.seal()
            self._handed_over.set()

    def _take(self) -> int:
        i = self._free.get()
        if i < 0 or self._cancelled:
            raise _Cancelled()
        return i

    def _take_assigned(self, front: bool) -> int | None:
        """The next fill to copy, from the front (the caller) or the back (the writer); None when all are taken."""
        with self._lock:
            if self._cancelled or self._front >= self._back:
                return None
            if front:
                self._front += 1
                return self._front - 1
            self._back -= 1
            return self._back

    def _fill_shared(self, i: int) -> None:
        """Copy fill ``i`` into slot ``i`` (the whole mode); the thread that copies the last one says so."""
        self._fill(self.fills[i], i)
        with self._lock:
            self._left -= 1
            last = self._left == 0
        if last:
            self._ready.put(_END)
            self._copied.set()

    def _fill(self, entry: SlotFill, slot: int) -> None:
        """Copy the fill ``entry`` into ``slot`` and hand it to the writer (the whole mode's gaps are already zero)."""
        if not self.whole:
            mem, fill = self.arena.slot_array(slot), 0
            for _idx, _at, lo, k in entry.pieces:
                if lo > fill:
                    mem[fill:lo] = 0
                fill = lo + k
        base = slot * self.arena.slot_bytes
        if self.proof is not None:
            self.proof.before(idx for idx, _at, _lo, _k in entry.pieces)
        for idx, at, lo, k in entry.pieces:
            address = self._addresses[idx]
            if address is not None:
                copy_bytes(self.arena.address + base + lo, address + at, k)
            else:  # a device leaf into pinned slots
                src = self.sources[idx]
                self.arena.memory[base + lo : base + lo + k].copy_(src if k == src.numel() else src[at : at + k])
        if self.proof is not None and not self.proof.check(idx for idx, _at, _lo, _k in entry.pieces):
            return  # the save fails (``produce_deferred``): nothing more is handed to the writer
        self._ready.put(SlotFill(slot, entry.file_start, entry.nbytes, entry.pieces))

    # --- the writer's thread ------------------------------------------------------------------

    def help(self) -> None:
        """(a helper thread, while the caller copies) Copy fills from the last one back while the
        caller copies from the first one on, until none is left (the whole mode; otherwise nothing to do).

        An error here fails the save as the caller's own would, and wakes the caller.
        """
        if not self.whole:
            return
        try:
            while (i := self._take_assigned(front=False)) is not None:
                self._fill_shared(i)
        except BaseException as e:
            self._ready.put(e)  # the writer raises it
            self.cancel()
            raise

    def wait_copied(self) -> None:
        """(the writer's thread) Wait until the caller has every byte copied and is done with the stream, or
        the save failed (the whole mode)."""
        if self.whole:
            self._handed_over.wait()

    def cancel(self) -> None:
        """Wake the caller's thread if it waits for a slot or for the writer's copies: the save failed (idempotent)."""
        if not self._cancelled:
            self._cancelled = True
            self._free.put(-1)
            self._copied.set()
            self._handed_over.set()

    def _filled(self) -> Iterator[SlotFill]:
        """The copied slots, in file order (a block's pieces are hashed in order), each as soon as it and every
        slot before it are copied; raises the caller's error.

        The whole mode's two threads fill slots from both ends: a slot the
        helper copied waits here until the caller's copies reach it.
        """
        if not self.whole:
            while (msg := self._ready.get()) != _END:
                if isinstance(msg, BaseException):
                    raise msg
                assert isinstance(msg, SlotFill)
                yield msg
            return
        pending: dict[int, SlotFill] = {}
        for i in range(len(self.fills)):
            while i not in pending:
                msg = self._ready.get()
                if isinstance(msg, BaseException):
                    raise msg
                if msg == _END:  # every copy is done, and fill i is not among them: the copy was stopped
                    raise _Cancelled(f"rank {self.rank}: the snapshot's copy stopped before slot {i}")
                assert isinstance(msg, SlotFill)
                pending[msg.slot] = msg
            yield pending.pop(i)

    def consume(self, path: str, num_threads: int = 1) -> dict[Key, StoredBytes]:
        """Write every slot into the data file at ``path``, durably; return what each leaf stored.

        This thread hashes the slots in file order (a checksum block spans
        several slots) and writes each one (``pwrite``, then the start of its
        write-back, ``_fs.start_writeback``) before handing it back; with
        ``num_threads`` > 1, that many threads write the hashed slots meanwhile,
        as a synchronous save writes from several threads. One thread is the
        default of ``return_early`` (``num_threads=0``): the fewest threads
        competing with the training loop for the cores and the interpreter.
        With ``early_writes``, the slots copied before the copy ends are
        written on that thread first (``write_early``); once the copy is over,
        the rest is handed to the writes at once and this thread hashes every
        slot meanwhile.
        """
        cb = fmt.CHECKSUM_BLOCK
        self.counters = [counter_for(fmt.dtype_name(t.dtype)) for _k, t in self._items]
        digests: list[list[int]] = [[0] * ((s.numel() + cb - 1) // cb) for s in self.sources]
        hashers: dict[tuple[int, int], xxhash.xxh3_64] = {}

        def hashed(msg: SlotFill) -> memoryview:
            """Hash (and count the non-finite values of) the pieces of a slot; return its bytes to write."""
            view = self.arena.slot_view(msg.slot, msg.nbytes)
            for idx, at, lo, k in msg.pieces:
                block, n = at // cb, self.sources[idx].numel()
                h = hashers.get((idx, block))
                if h is None:
                    h = hashers[(idx, block)] = xxhash.xxh3_64()
                h.update(view[lo : lo + k])
                counter = self.counters[idx]
                if counter is not None:
                    counter(view[lo : lo + k])
                if (at + k) % cb == 0 or at + k == n:
                    digests[idx][block] = h.intdigest()
                    del hashers[(idx, block)]
            return view

        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        writes: list[Future[None]] = []
        try:
            if self.total:
                os.posix_fallocate(fd, 0, self.total)
            slots = self._filled()
            written: list[SlotFill] = []
            if self.early_writes is not None:
                written = self.early_writes(functools.partial(self.write_early, fd, slots)).result()
            pool = (
                ThreadPoolExecutor(num_threads, thread_name_prefix="tddist-stream-write") if num_threads > 1 else None
            )

            def write(msg: SlotFill, view: memoryview) -> None:
                if pool is None:
                    self._write_slot(fd, msg.slot, view, msg.file_start)
                else:
                    writes.append(pool.submit(self._write_slot, fd, msg.slot, view, msg.file_start))

            try:
                if written:  # the copy is over: the rest is handed to the writes first, then all is hashed
                    rest = list(slots)
                    for msg in rest:
                        write(msg, self.arena.slot_view(msg.slot, msg.nbytes))
                    for msg in written + rest:
                        hashed(msg)
                else:
                    for msg in slots:
                        write(msg, hashed(msg))
            finally:
                if pool is not None:
                    pool.shutdown()  # every write submitted ends before the descriptor closes, an error or not
            for w in writes:
                w.result()  # the first write error
            os.fsync(fd)
        finally:
            os.close(fd)
        return {
            k: StoredBytes(s.numel(), combine_digests(d), None if c is None else c.result())
            for k, s, d, c in zip(self.keys, self.sources, digests, self.counters)
        }

    def write_early(self, fd: int, slots: Iterator[SlotFill]) -> list[SlotFill]:
        """(a thread at the training's priority, while the caller copies) Write the copied slots in file order
        until every byte is copied; return those written. ``consume`` writes the rest and hashes them all.

        Written one by one, each only once the write-back of the slot
        ``EARLY_IN_FLIGHT`` before it is done (``wait_for_writeback``): the
        page cache then gets the slots as fast as the disk drains them, which
        keeps the disk busy during the copy at the smallest cost in cores and
        memory bandwidth to the copy the caller waits for (writing as fast as
        the cores allow slowed it by 1.3-1.9x; 1 GiB on 1, 2 and 4 ranks).
        Nothing is hashed here for the same reason: after the copy the disk,
        not the cores, sets the pace, and the hashing overlaps the last writes.
        """
        in_flight: deque[SlotFill] = deque()
        written: list[SlotFill] = []
        while not self._copied.is_set():
            msg = next(slots, None)
            if msg is None:
                break
            if len(in_flight) == EARLY_IN_FLIGHT:
                done = in_flight.popleft()
                wait_for_writeback(fd, done.file_start, done.nbytes)
            self._write_slot(fd, msg.slot, self.arena.slot_view(msg.slot, msg.nbytes), msg.file_start)
            in_flight.append(msg)
            written.append(msg)
        return written

    def _write_slot(self, fd: int, slot: int, view: memoryview, at: int) -> None:
        """(a write thread) Write one slot and hand it back; on an error, stop the caller and the hashing
        loop (which would otherwise wait for slots this one never frees)."""
        try:
            write_and_start_writeback(fd, view, at, WRITE_STEP)
        except BaseException as e:
            self._ready.put(e)
            self.cancel()
            raise
        self._free.put(slot)


class StreamingWriter(DirectoryWriter):
    """A packed directory writer whose bytes come from a ``Stream`` instead of snapshot buffers."""

    def __init__(
        self, options: SaveOptions, rank: int, shard: LocalShard | Exception, cache: MergeCache | None, stream: Stream
    ) -> None:
        super().__init__(options, rank, shard, cache)
        self.stream = stream

    def write(self, staging: Staging) -> Fragment:
        try:
            self.check_reference(staging)
            path = os.path.join(staging.path, fmt.rank_data_name(self.rank))
            stored = self.stream.consume(path, self.options.num_threads)
        except BaseException:
            self.stream.cancel()
            raise
        return self.fragment(stored)
