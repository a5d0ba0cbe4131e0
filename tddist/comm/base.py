"""Communicators: the few object collectives tddist needs, and error agreement.

A ``Communicator`` is anything with ``rank``, ``size`` and four collectives on
picklable objects. Implementations: ``LocalComm`` (one process),
``ThreadComm`` (ranks as threads of one process, for fast tests),
``comm_torch.TorchComm`` (a private gloo group) and ``comm_mpi.MPIComm`` (a
``Dup()`` of an MPI communicator). ``resolve`` picks one from what the caller
passed or from the environment.
"""

from __future__ import annotations

import logging
import os
import pickle
import threading
import traceback
from collections.abc import Callable, Mapping
from typing import Any, Protocol, TypeVar, cast, runtime_checkable

from ..core.types import Contribution, Decision, Failure
from ..errors import BY_NAME, CollectiveError, CommError, CommTimeoutError, InvalidArgumentError, TddistError

logger = logging.getLogger(__name__)

T = TypeVar("T")
R = TypeVar("R")

DEFAULT_TIMEOUT = float(os.environ.get("TDDIST_TIMEOUT", "600"))


@runtime_checkable
class Communicator(Protocol):
    """What tddist needs of a communicator: rank, size and a few collectives on picklable objects.

    tddist exchanges only small objects (paths, fragments, decisions,
    errors); tensor data never goes through a communicator. Pass any object
    with these members as ``comm=`` (a torch ProcessGroup or an mpi4py
    communicator is wrapped in a private one instead). Every method but the
    attributes is collective: all ranks call it, in the same order. What a
    rank receives from other ranks is a copy (it went through pickle); what
    comes back of its own contribution (at the root of ``broadcast`` and
    ``gather``, its own slot of ``allgather``) may be the very object it
    passed, so callers never mutate a collective's result in place.

    Attributes:
        rank: This process's rank, ``0 <= rank < size``.
        size: The number of ranks.
    """

    rank: int
    size: int

    def barrier(self) -> None:
        """Return once every rank has called it."""
        ...

    def broadcast(self, obj: Any, root: int = 0) -> Any:
        """Send ``root``'s object to every rank.

        Args:
            obj: The object to send (used on ``root`` only).
            root: The rank that sends.

        Returns:
            ``root``'s object, on every rank.
        """
        ...

    def gather(self, obj: Any, root: int = 0) -> list[Any] | None:
        """Collect every rank's object on ``root``.

        Args:
            obj: This rank's object.
            root: The rank that receives.

        Returns:
            On ``root``, every rank's object in rank order; None elsewhere.
        """
        ...

    def allgather(self, obj: Any) -> list[Any]:
        """Collect every rank's object on every rank.

        Args:
            obj: This rank's object.

        Returns:
            Every rank's object, in rank order.
        """
        ...

    def dup(self) -> Communicator:
        """A new communicator over the same ranks whose messages never mix with this one's (collective).

        Returns:
            The duplicate; asynchronous saves run their collectives on it.
        """
        ...


class LocalComm:
    """The communicator of a single process (rank 0 of 1); what ``comm=None`` resolves to without a launcher.

    Every collective returns at once: ``broadcast`` returns ``obj``,
    ``gather`` and ``allgather`` return ``[obj]``.
    """

    rank = 0
    size = 1

    def barrier(self) -> None:
        """Return at once (one rank)."""
        pass

    def broadcast(self, obj: Any, root: int = 0) -> Any:
        """Return ``obj`` (see ``Communicator.broadcast``)."""
        return obj

    def gather(self, obj: Any, root: int = 0) -> list[Any]:
        """Return ``[obj]`` (see ``Communicator.gather``)."""
        return [obj]

    def allgather(self, obj: Any) -> list[Any]:
        """Return ``[obj]`` (see ``Communicator.allgather``)."""
        return [obj]

    def dup(self) -> LocalComm:
        """Return a new ``LocalComm`` (see ``Communicator.dup``)."""
        return LocalComm()


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
    def create(size: int, timeout: float = DEFAULT_TIMEOUT) -> list[ThreadComm]:
        """The ranks of a new group of ``size`` thread-ranks, to hand one to each thread.

        Args:
            size: The number of ranks.
            timeout: Seconds a collective waits for every rank before it fails.

        Returns:
            One communicator per rank, in rank order.
        """
        group = _ThreadGroup(size, timeout)
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


#: The communicator of a process without torch.distributed or MPI: one per process, so that what is
#: kept per communicator (the channel of asynchronous saves, its buffers and plan cache) is kept once.
_LOCAL = LocalComm()


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


# --- error agreement -----------------------------------------------------------------


def describe(exc: BaseException) -> Failure:
    """A local error as sent to other ranks: its class name and message."""
    if isinstance(exc, TddistError):
        return Failure(type(exc).__name__, str(exc))
    logger.debug("local error:\n%s", "".join(traceback.format_exception(exc)))
    return Failure(type(exc).__name__, f"{type(exc).__name__}: {exc}")


def collective_error(what: str, failures: Mapping[int, Failure]) -> TddistError:
    """One error, the same on every rank, naming every failing rank and its message.

    If all failing ranks raised the same tddist error class, that class is
    used; otherwise ``CollectiveError``.
    """
    names = {f.error_class for f in failures.values()}
    cls = (BY_NAME.get(names.pop()) if len(names) == 1 else None) or CollectiveError
    ranks = sorted(failures)
    lines = "\n".join(f"  rank {r}: {failures[r].message.removeprefix(f'rank {r}: ')}" for r in ranks[:16])
    more = f"\n  ... and {len(ranks) - 16} more ranks" if len(ranks) > 16 else ""
    msg = f"{what} failed on rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks[:16]))}:\n{lines}{more}"
    return cls(msg, failures={r: f.message for r, f in failures.items()})


def contribute(fn: Callable[[], T]) -> Contribution[T]:
    """Run ``fn``; its value, or its error as a ``Failure`` (a rank's error becomes its vote)."""
    try:
        return Contribution(value=fn())
    except Exception as e:
        logger.debug("this rank's contribution failed", exc_info=True)
        return Contribution(failure=describe(e))


def agree(comm: Communicator, what: str, local_error: BaseException | None) -> None:
    """Collectively raise the same error on every rank if any rank had one (one allgather)."""
    status = describe(local_error) if local_error is not None else None
    statuses = comm.allgather(status)
    failures = {r: s for r, s in enumerate(statuses) if s is not None}
    if failures:
        raise collective_error(what, failures) from local_error


def run_step(comm: Communicator, what: str, fn: Callable[[], T]) -> T | None:
    """Run ``fn`` on every rank; if it fails on any rank, raise the same error on all."""
    try:
        value, error = fn(), None
    except Exception as e:
        value, error = None, e
    agree(comm, what, error)
    return value


def decide_on_rank0(
    comm: Communicator,
    what: str,
    decide: Callable[[list[Any]], R],
    contribution: Contribution[Any] | None = None,
    *,
    after_gather: Callable[[], None] | None = None,
    on_failure: Callable[[], None] | None = None,
) -> R:
    """Rank 0 decides; every rank returns the decision, or raises the same error.

    Call order, on every rank: with a ``contribution``, the contributions are
    gathered to rank 0 (``after_gather`` then runs on every rank; on rank 0 a
    failure there counts as rank 0's). Rank 0 calls ``decide(values)`` with
    every rank's value if no rank failed; whatever it raises becomes the
    decision. If the decision is a failure, rank 0 calls ``on_failure`` (a
    clean-up that must not raise). Rank 0 broadcasts the decision; every rank
    returns its value or raises ``collective_error(what, failures)``.
    Without a contribution only the broadcast runs.
    """
    contributions = comm.gather(contribution, 0) if contribution is not None else None
    if comm.rank != 0 and after_gather is not None:
        after_gather()
    decision: Decision[R] | None = None
    if comm.rank == 0:
        try:
            if after_gather is not None:
                after_gather()
            failures = {r: c.failure for r, c in enumerate(contributions or []) if c.failure is not None}
            if failures:
                decision = Decision(failures=failures)
            else:
                decision = Decision(value=decide([c.value for c in contributions or []]))
        except Exception as e:
            logger.debug("rank 0 failed to decide %s", what, exc_info=True)
            decision = Decision(failures={0: describe(e)})
        if not decision.ok and on_failure is not None:
            on_failure()
    decision = comm.broadcast(decision, 0)
    assert decision is not None
    if not decision.ok:
        raise collective_error(what, decision.failures)
    return cast(R, decision.value)  # a decision without failures holds decide()'s value


# --- choosing a communicator -----------------------------------------------------------


def _mpi_world_size_from_env() -> int:
    for var in ("PMI_SIZE", "OMPI_COMM_WORLD_SIZE", "PMIX_SIZE", "MPI_LOCALNRANKS"):
        v = os.environ.get(var)
        if v and v.isdigit():
            return int(v)
    return 0


def resolve(comm: Any = None, timeout: float | None = None) -> Communicator:
    """The communicator to use for ``comm`` (None: detect from the environment).

    Detection order: an initialised torch.distributed default group; an MPI
    launch of more than one rank; torchrun's environment (gloo is initialised);
    else a single process.
    """
    timeout = DEFAULT_TIMEOUT if timeout is None else float(timeout)
    if comm is not None:
        if isinstance(comm, (LocalComm, ThreadComm)) or _is_tddist_comm(comm):
            return comm
        mod = type(comm).__module__ or ""
        if mod.startswith("mpi4py"):
            from .mpi import mpi_comm

            return mpi_comm(comm, timeout)
        if mod.startswith("torch"):
            from .gloo import torch_comm

            return torch_comm(comm, timeout)
        if isinstance(comm, Communicator):
            return comm
        raise InvalidArgumentError(
            f"comm={comm!r} is not a torch ProcessGroup, an mpi4py communicator or a tddist Communicator; "
            f"pass one of those, or comm=None to detect it"
        )
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        from .gloo import torch_comm

        return torch_comm(None, timeout)
    if _mpi_world_size_from_env() > 1:
        from .mpi import mpi_comm

        return mpi_comm(None, timeout)
    if all(v in os.environ for v in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")):
        from .gloo import init_from_env, torch_comm

        init_from_env(timeout)
        return torch_comm(None, timeout)
    return _LOCAL


def _is_tddist_comm(comm: object) -> bool:
    return type(comm).__module__.startswith("tddist.")
