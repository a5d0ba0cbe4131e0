"""Ranks as threads of one process (``ThreadComm``, ``run_threads``): fast multi-rank tests and examples.

The collectives exchange objects through shared slots under a barrier
written here (see ``_ThreadGroup``), so a rank that raised leaves its group
at once and its peers fail instead of waiting their timeout out.
"""

from __future__ import annotations

import pickle
import threading
from collections.abc import Callable
from typing import Any

from ..errors import CommError, CommTimeoutError
from .base import default_timeout


class _ThreadGroup:
    """The shared state of a group of thread-ranks: the exchange slots and a barrier per collective step.

    The barrier is written here rather than taken from ``threading.Barrier``: a
    rank whose function raised has left the group for good, and its peers
    must be told at once (as a real transport tells them that a peer's
    connection closed) instead of waiting their timeout out. ``Barrier.abort``
    cannot do that safely: it also fails waiters that the last arrival had
    already released but that had not woken up yet.
    """

    def __init__(self, size: int, timeout: float, departed: dict[int, str] | None = None) -> None:
        self.size = size
        self.timeout = timeout
        self.slots: list[Any] = [None] * size
        self.dups: list[_ThreadGroup] = []
        self.lock = threading.Lock()
        self._cond = threading.Condition()
        self._arrived = 0
        self._generation = 0
        self._timed_out = False
        self._departed = {} if departed is None else departed  # rank -> why it left; shared with the dups

    def dup(self) -> _ThreadGroup:
        """A new group of the same ranks (a rank that left this one has left it too)."""
        return _ThreadGroup(self.size, self.timeout, self._departed)

    def step(self) -> str | None:
        """Wait until every rank has arrived; None, or why the step cannot complete.

        A step that times out breaks the group: every later step fails at once, as
        with ``threading.Barrier``.
        """
        with self._cond:
            gen = self._generation
            if not self._timed_out and not self._departed:
                self._arrived += 1
                if self._arrived == self.size:
                    self._arrived, self._generation = 0, gen + 1
                    self._cond.notify_all()
                    return None
                completed = self._cond.wait_for(
                    lambda: self._generation != gen or self._timed_out or bool(self._departed), self.timeout
                )
                if self._generation != gen:
                    return None
                if not completed:
                    self._timed_out = True
                    self._cond.notify_all()
            if self._departed:
                rank, why = min(self._departed.items())
                return f"its peer thread-rank {rank} left the group ({why})"
            return "timeout"

    def depart(self, rank: int, why: str) -> None:
        """Rank ``rank`` will take no further step, here or in any dup (its function raised): fail the
        steps that wait for it."""
        with self._cond:
            self._departed[rank] = why
            self._cond.notify_all()
        with self.lock:
            dups = list(self.dups)
        for d in dups:
            d.depart(rank, why)


class ThreadComm:
    """One rank of a group of threads in this process (tests and in-process use).

    Objects are pickled on the way, as a real transport would, so what works
    here also works across processes. Make the ranks with ``create`` (or run
    a function on them with ``run_threads``); each thread uses its own.
    A collective that some rank does not reach within the group's timeout
    raises ``CommTimeoutError`` on the others; one that waits for a rank whose
    function raised (in ``run_threads``) raises ``CommError`` at once, as a
    real transport reports a peer that went away.

    Args:
        group: The group's shared state (from ``create``).
        rank: This thread's rank in the group.
    """

    def __init__(self, group: _ThreadGroup, rank: int) -> None:
        self._g = group
        self.rank = rank
        self.size = group.size
        self._ndups = 0

    @staticmethod
    def create(size: int, timeout: float | None = None) -> list[ThreadComm]:
        """The ranks of a new group of ``size`` thread-ranks, to hand one to each thread.

        Args:
            size: The number of ranks.
            timeout: Seconds a collective waits for every rank before it fails (default: ``TDDIST_TIMEOUT``
                or 600).

        Returns:
            One communicator per rank, in rank order.
        """
        group = _ThreadGroup(size, default_timeout() if timeout is None else timeout)
        return [ThreadComm(group, r) for r in range(size)]

    def _wait(self, op: str) -> None:
        why = self._g.step()
        if why is None:
            return
        outcome = (
            "during a save, the target holds the previous checkpoint or, if rank 0 committed before the "
            "failure, the new one"
        )
        if why == "timeout":
            raise CommTimeoutError(
                f"rank {self.rank}: {op} did not complete within {self._g.timeout:.0f}s (another thread-rank "
                f"failed or hung); {outcome}"
            )
        raise CommError(f"rank {self.rank}: {op} cannot complete: {why}; {outcome}")

    def _exchange(self, obj: Any, op: str) -> list[Any]:
        self._g.slots[self.rank] = pickle.dumps(obj)
        self._wait(op)
        out = [pickle.loads(s) for s in self._g.slots]
        self._wait(op)
        return out

    def barrier(self) -> None:
        """See ``Communicator.barrier``.

        Raises:
            CommTimeoutError: a rank did not arrive within the group's timeout.
        """
        self._wait("barrier")

    def broadcast(self, obj: Any, root: int = 0) -> Any:
        """See ``Communicator.broadcast``.

        Raises:
            CommTimeoutError: a rank did not arrive within the group's timeout.
        """
        return self._exchange(obj if self.rank == root else None, "broadcast")[root]

    def gather(self, obj: Any, root: int = 0) -> list[Any] | None:
        """See ``Communicator.gather``.

        Raises:
            CommTimeoutError: a rank did not arrive within the group's timeout.
        """
        out = self._exchange(obj, "gather")
        return out if self.rank == root else None

    def allgather(self, obj: Any) -> list[Any]:
        """See ``Communicator.allgather``.

        Raises:
            CommTimeoutError: a rank did not arrive within the group's timeout.
        """
        return self._exchange(obj, "allgather")

    def dup(self) -> ThreadComm:
        """See ``Communicator.dup``: the n-th ``dup`` of each rank joins the same new group."""
        with self._g.lock:
            if len(self._g.dups) <= self._ndups:
                self._g.dups.append(self._g.dup())
            group = self._g.dups[self._ndups]
        self._ndups += 1
        return ThreadComm(group, self.rank)


def run_threads(size: int, fn: Callable[[ThreadComm], Any], timeout: float = 60.0) -> list[Any]:
    """Run ``fn(comm)`` on ``size`` thread-ranks; returns each rank's result or exception.

    A way to run collective code (``save``, ``load``) on several ranks in one
    process, for tests and examples. An exception is returned, not raised, so
    the caller sees every rank's outcome; a rank that raised has left the
    group, so the collectives that wait for it fail at once with ``CommError``.

    Args:
        size: The number of ranks (threads).
        fn: What each rank runs, given its ``ThreadComm``.
        timeout: Seconds a collective waits for every rank before it fails.

    Returns:
        Each rank's return value, or the exception it raised, in rank order.

    Raises:
        CommTimeoutError: a thread-rank did not finish within ``timeout`` + 30 s.
    """
    comms = ThreadComm.create(size, timeout)
    results: list[Any] = [None] * size

    def body(c: ThreadComm) -> None:
        try:
            results[c.rank] = fn(c)
        except BaseException as e:  # reported to the caller as a value
            results[c.rank] = e
            c._g.depart(c.rank, f"{type(e).__name__}: {e}")  # its peers stop waiting for it

    threads = [threading.Thread(target=body, args=(c,), name=f"tddist-rank{c.rank}") for c in comms]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout + 30)
    if any(t.is_alive() for t in threads):
        raise CommTimeoutError(f"thread ranks did not finish within {timeout + 30:.0f}s")
    return results
