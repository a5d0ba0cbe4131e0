"""Background saves: one persistent worker thread and one private channel per communicator.

``save(return_early=True)`` snapshots the data (``early.start_early``),
then hands the writing and the whole two-phase commit to the channel's
worker thread through a queue,
over a duplicate of the communicator, so its messages never interleave with
the caller's own collectives or with a later foreground save. At most one
save per communicator is in flight.

The worker is started once, before the first snapshot, and then waits on its
queue (without the interpreter lock): handing a save over is one queue put,
so the caller never waits for a thread to start or for a pool to accept
work while the previous commit's threads hold the lock. Writing runs on the
worker itself unless ``num_threads`` asks for more, so the background adds
two Python threads (the worker and the copy helper, ``Channel.help_copy``),
not one per block.

The worker is a daemon thread, but an exit hook waits for an in-flight save
before the interpreter shuts down, so the save commits or aborts cleanly
instead of being cut off halfway (a killed process leaves only a staging
directory, which ``recover`` removes).
"""

from __future__ import annotations

import logging
import os
import queue
import threading
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from .._compat import register_exit_hook
from ..comm.base import Communicator, default_timeout
from ..core.types import Key
from ..errors import InvalidArgumentError, SaveInProgressError
from ..manifest.merge import MergeCache
from .arena import Arena
from .deferred_plan import DeferredPlan
from .prepare import PlacementCache
from .slots import pipeline_slot, whole_state_budget
from .snapshot import SnapshotBuffers
from .stream import Stream
from .writer_process import ProcessWriter

if TYPE_CHECKING:
    import torch

logger = logging.getLogger(__name__)


#: How long stopping a worker waits for its thread to end (its queue is empty by then: only the job's clean-up).
STOP_TIMEOUT = 10.0


class SaveFuture(Future):
    """The Future of a ``return_early`` save, with ``wait_snapshot`` for state changed outside a guarded step.

    ``result()`` and ``exception()`` return only once the worker that resolved it holds nothing of the save
    (``released``, which ``Worker._run`` sets before the job's clean-ups, so the caller never waits for
    those): the caller is then the only holder of what the save returned (a TensorDict that maps the
    checkpoint's files), so its maps go when the caller drops it. Without this wait the worker's last
    references could outlive the caller's for a moment, and the maps with them.
    """

    _snapshot: Callable[[], None] | None = None

    def __init__(self, resolver: int | None = None) -> None:
        super().__init__()
        #: set by the worker once it holds no reference to this save (its job, its function, its value)
        self.released = threading.Event()
        self._resolver = resolver  # the worker thread's ident: it must never wait for itself

    def result(self, timeout: float | None = None) -> Any:
        value = super().result(timeout)
        self._wait_released()
        return value

    def exception(self, timeout: float | None = None) -> BaseException | None:
        error = super().exception(timeout)
        self._wait_released()
        return error

    def _wait_released(self) -> None:
        """Wait for the worker to let go of the save: a moment after it resolved the future (the rest of its
        job's function returning), never on the worker's own thread (a done-callback runs there)."""
        if threading.get_ident() != self._resolver:
            self.released.wait(STOP_TIMEOUT)  # bounded: a worker that never got there must not hang the caller

    def set_snapshot(self, wait: Callable[[], None]) -> None:
        """(the save, before it returns) What ``wait_snapshot`` waits for: a deferred snapshot's copy."""
        self._snapshot = wait

    def wait_snapshot(self) -> None:
        """Block until the save's snapshot is copied: then the state may change, though the save may still be
        writing. Returns at once unless the save was ``snapshot="deferred"`` (the others copy before ``save``
        returns). A deferred copy that found a leaf changed still returns; ``result()`` raises the error."""
        if self._snapshot is not None:
            self._snapshot()


@dataclass(frozen=True)
class _Job:
    """A submitted save: its function, the caller's Future (the value) and the channel's (only the outcome)."""

    fn: Callable[[], Any]
    future: SaveFuture
    done: Future


class Worker:
    """A persistent daemon thread that runs the submitted jobs one after the other.

    ``background`` lowers its CPU priority (``yield_cpu_to_training``): the commit's worker. The copy
    helper keeps the training's priority, since the caller waits for its copies.
    """

    def __init__(self, name: str, background: bool = True) -> None:
        self._queue: queue.SimpleQueue[_Job | None] = queue.SimpleQueue()
        self._deferred: list[Callable[[], None]] = []  # the running job's clean-ups (``defer``)
        self.background = background
        self.pid = os.getpid()
        self.thread = threading.Thread(target=self._run, name=name, daemon=True)
        self.thread.start()

    def alive(self) -> bool:
        """False in a forked child (threads do not survive ``fork``) or once stopped."""
        return self.pid == os.getpid() and self.thread.is_alive()

    def submit(self, fn: Callable[[], Any]) -> tuple[SaveFuture, Future]:
        """Queue ``fn``; return its Future and a second one that carries only its outcome (None or the error).

        Only the caller holds the value (a saved TensorDict maps the checkpoint's files): the worker and
        the channel keep neither, so the maps go when the caller drops them, not at some later save.
        """
        job = _Job(fn, SaveFuture(self.thread.ident), Future())
        self._queue.put(job)
        return job.future, job.done

    def defer(self, clean_up: Callable[[], None]) -> None:
        """(the worker's thread, inside a job) Run ``clean_up`` once the job's futures are resolved, before the
        next job: the removal of the checkpoint a save replaced (``commit.two_phase_commit``), which the
        caller need not wait for. An error there is logged; a stop waits for it like for a job."""
        self._deferred.append(clean_up)

    def stop(self) -> None:
        """Let the thread end once its queue is empty, and wait for it (a few seconds at most).

        Joined, so that it never runs during the interpreter's finalization: a thread that frees a
        tensor then is ended inside torch's destructor and the process aborts ("terminate called
        without an active exception").
        """
        self._queue.put(None)
        if self.thread is not threading.current_thread():
            self.thread.join(STOP_TIMEOUT)

    def _run(self) -> None:
        if self.background:
            yield_cpu_to_training()
        while True:
            job = self._queue.get()
            if job is None:
                return
            released = job.future.released
            _run_job(job)
            del job  # nothing of the save stays referenced while the worker waits for the next one
            released.set()  # the caller's result() returns now: it alone holds what the save returned
            while self._deferred:  # in a call, so that no local keeps the save's writer (and its leaves)
                _run_clean_up(self._deferred.pop(0))


def _run_clean_up(clean_up: Callable[[], None]) -> None:
    try:
        clean_up()
    except Exception as e:  # the save is resolved already: only a warning is left to give
        logger.warning("a clean-up after a background save failed: %s", e)


def _run_job(job: _Job) -> None:
    if not job.future.set_running_or_notify_cancel():
        job.done.set_result(None)
        return
    try:
        value = job.fn()
    except BaseException as e:  # the caller sees it through the future
        job.future.set_exception(e)
        job.done.set_exception(e)
    else:
        job.future.set_result(value)
        job.done.set_result(None)


#: How much lower than the training's the background saves' CPU priority is (``nice`` steps, 0-19). Writing,
#: hashing and committing in the background compete with the training loop for cores; where cores are short
#: (ranks that share them, a Python-heavy step), the scheduler then gives the training first call. An idle core
#: still runs the background at full speed, so a save's completion is delayed only while the training is busy.
BACKGROUND_NICENESS = 10


def yield_cpu_to_training() -> None:
    """Lower the calling thread's CPU priority by ``BACKGROUND_NICENESS`` (threads it starts inherit it).

    Linux keeps a nice value per thread, so this leaves the training thread
    untouched; raising it needs no privilege. Elsewhere, or where refused, the
    priority stays as it is.
    """
    try:
        tid = threading.get_native_id()
        now = os.getpriority(os.PRIO_PROCESS, tid)
        os.setpriority(os.PRIO_PROCESS, tid, min(19, now + BACKGROUND_NICENESS))
    except (AttributeError, OSError) as e:
        logger.debug("background saves keep the training's CPU priority: %s", e)


class Channel:
    """Per-communicator state of asynchronous saves."""

    def __init__(self, comm: Communicator):
        self.comm = comm
        self.buffers = SnapshotBuffers()
        self.arena: Arena | None = None  # the slots of streamed saves (stream.py)
        self.arena_allocations = 0  # how many arenas this channel allocated (a reused one is not counted again)
        self.merges = MergeCache()  # the cached path of the next save's merge (see merge.py)
        self.placements = PlacementCache()  # what the latest saves derived from their structures (prepare.py)
        self.deferred_plan: DeferredPlan | None = None  # the latest deferred save's plan (deferred_plan.py)
        self.pending: Future | None = None
        self._bg_comm: Communicator | None = None
        self._worker: Worker | None = None
        # Threads at the training's priority: "copy" copies a pipelined save beside the caller (``Stream.help``),
        # "early-write" writes its copied slots meanwhile (``Stream.write_early``).
        self._helpers: dict[str, Worker] = {}
        self._process: ProcessWriter | None = None
        self._generation = 0  # writer processes started by this channel (their groups' prefixes)

    def background_comm(self) -> Communicator:
        """The duplicate communicator used by background commits (collective on first use).

        Also starts the worker thread, so that no thread starts between the
        snapshot and the return of ``save``.
        """
        if self._bg_comm is None:
            dup = getattr(self.comm, "dup", None)
            if dup is None:
                raise InvalidArgumentError(
                    f"return_early=True needs a communicator with dup(); {type(self.comm).__name__} has none"
                )
            self._bg_comm = dup()
        self._ensure_worker()
        return self._bg_comm

    def arena_for(self, budget: int, pin: bool, slot: int | None = None) -> Arena:
        """The reusable slots of a streamed save (re-allocated only when the budget, slots or pinning change)."""
        a = self.arena
        if a is None or a.budget != budget or a.pinned != pin or (slot is not None and a.slot_bytes != slot):
            self.arena = a = None  # free the old one first (a budget bounds the memory)
            a = self.arena = Arena(budget, pin, slot)
            self.arena_allocations += 1
        return a

    def pipeline_arena(self, items: list[tuple[Key, torch.Tensor]]) -> Arena:
        """The arena of a pipelined whole-state save of ``items`` (no ``snapshot_budget``).

        The channel's arena is kept when there is nothing to copy, or when its
        slots are at least as large as this state's and it holds the state
        without being more than twice what a new one would be: saves that
        alternate between two states on one communicator, or a rank that
        writes nothing in every other save, reuse one arena instead of faulting
        a new one in each time (tens of milliseconds on the caller's thread
        per 64 MiB).
        """
        slot = pipeline_slot(items)
        need = whole_state_budget(items, slot)
        a = self.arena
        if a is not None and not a.pinned:
            if not any(t.numel() for _k, t in items):
                return a
            if a.slot_bytes >= slot and whole_state_budget(items, a.slot_bytes) <= a.budget <= 2 * need:
                return a
        return self.arena_for(need, False, slot)

    def process_writer(self) -> ProcessWriter:
        """This rank's writer process, started at the first process save and after one broke."""
        self._ensure_worker()
        # A writer found dead here is not replaced: this save fails on every rank (its peers lose it),
        # and every rank replaces its writer at the next save, so the ranks' writers stay one group.
        if self._process is None or self._process.broken or self._process.peer_died():
            if self._process is not None:
                self._process.close()
            self._generation += 1
            timeout = float(getattr(self.comm, "timeout", None) or default_timeout())
            self._process = ProcessWriter(self.comm, timeout, self._generation)
        return self._process

    def _ensure_worker(self) -> Worker:
        if self._worker is None or not self._worker.alive():
            self._worker = Worker(f"tddist-save-rank{self.comm.rank}")
        return self._worker

    def help_copy(self, stream: Stream) -> None:
        """Have the copy helper thread copy ``stream``'s slots from the last one back (``Stream.help``),
        while the caller copies from the first one on.

        Not the commit's worker: that one runs at a lower CPU priority, and
        where ranks share cores (4 ranks on 2 here) the training threads of the
        other ranks starve it, so the caller waited for its last slot (1.5x the
        plain copy's time at N=4). Here the helper runs only while the caller is
        inside ``save``, so it takes no time from training steps (a deferred
        snapshot's copy, ``copy_deferred``, is the one that overlaps them).
        """
        helper = self._foreground("copy")
        if helper is not None:
            helper.submit(stream.help)

    def write_early(self, stream: Stream) -> None:
        """Have ``stream``'s writer hash and write the slots the caller has copied on the early writer thread,
        while the copy goes on (``Stream.write_early``).

        A thread at the training's priority, not the commit's worker: where
        ranks share cores, the worker's lower priority starved it during the
        copy (4 ranks on 2 cores), and the disk stayed idle until the copy
        ended. It runs only while the caller is inside ``save``, and writes
        only as fast as the disk drains the page cache.
        """
        writer = self._foreground("early-write")
        if writer is not None:
            stream.early_writes = lambda fn: writer.submit(fn)[0]

    def copy_deferred(self, stream: Stream) -> None:
        """Have the copy helper thread copy all of a deferred snapshot's slots (``Stream.produce_deferred``),
        at the training's priority, after ``save`` returned; the caller's thread when no helper can start."""
        helper = self._foreground("copy")
        if helper is None:
            stream.produce_deferred()
        else:
            helper.submit(stream.produce_deferred)

    def _foreground(self, role: str) -> Worker | None:
        """The channel's thread ``tddist-<role>-rank<r>`` at the training's priority ("copy": the copy helper,
        "early-write": the early writer), started on first use and again after a fork; None where none can start."""
        name = f"tddist-{role}-rank{self.comm.rank}"
        try:
            w = self._helpers.get(role)
            if w is None or not w.alive():
                w = self._helpers[role] = Worker(name, background=False)
        except RuntimeError as e:  # no thread could start: the caller copies, the worker writes, alone
            logger.warning("rank %d: no %s thread (%s); saving without it", self.comm.rank, name, e)
            return None
        return w

    def wait_idle(self, wait: bool, target: str) -> None:
        """Block until no save is in flight (or raise if ``wait`` is False)."""
        pending = self.pending
        if pending is None or pending.done():
            return
        if not wait:
            raise SaveInProgressError(
                f"rank {self.comm.rank}: a save is still in flight on this communicator; saving to {target!r} "
                f"would need to wait for it. Call .result() on the previous future first, or pass "
                f"wait_for_pending=True"
            )
        logger.info("rank %d: waiting for the in-flight save before saving %s", self.comm.rank, target)
        try:
            pending.result()
        except Exception:  # reported by that save's own future
            pass

    def defer(self, clean_up: Callable[[], None]) -> None:
        """(the worker's thread, inside a save) Run ``clean_up`` after the save's future is resolved
        (``Worker.defer``)."""
        assert self._worker is not None
        self._worker.defer(clean_up)

    def submit(self, fn: Callable[[], Any]) -> SaveFuture:
        """Hand ``fn`` to the worker thread; return its Future (its outcome becomes the pending save)."""
        fut, self.pending = self._ensure_worker().submit(fn)
        return fut

    def stop(self) -> None:
        for w in (self._worker, *self._helpers.values()):
            if w is not None and w.alive():
                w.stop()
        self._worker = None
        self._helpers.clear()
        if self._process is not None:
            self._process.close()
            self._process = None


_channels: dict[int, Channel] = {}
_lock = threading.Lock()


def wait_all() -> None:
    """Wait for every in-flight save of this process; log the ones that failed; stop the workers."""
    for ch in list(_channels.values()):
        fut = ch.pending
        if fut is not None and not fut.done():  # a finished save's outcome is its caller's to see
            logger.warning("rank %d: waiting for an in-flight tddist save before exiting", ch.comm.rank)
            try:
                fut.result()
            except Exception as e:
                logger.error("rank %d: an asynchronous tddist save failed while exiting: %s", ch.comm.rank, e)
        ch.stop()


register_exit_hook(wait_all)  # in-flight saves finish before thread pools refuse work


def channel(comm: Communicator) -> Channel:
    """The channel of ``comm`` (communicators are cached by ``comm.resolve``, so identity is stable)."""
    with _lock:
        ch = _channels.get(id(comm))
        if ch is None or ch.comm is not comm:
            ch = _channels[id(comm)] = Channel(comm)
        return ch
