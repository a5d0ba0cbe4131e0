"""mpi4py communicator on a ``Dup()`` of the user's communicator.

mpi4py is imported only here, and only when an MPI communicator is used.
MPI collectives cannot time out, so each collective is built from
point-to-point messages whose completion is polled against a deadline: a hung
rank becomes a ``CommTimeoutError`` on the others instead of a hang.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, TypeVar

from ..errors import CommTimeoutError, wrap_transport_error

if TYPE_CHECKING:
    from mpi4py import MPI

T = TypeVar("T")

_TAG = 7301
#: The shortest and the longest sleep between two tests of a message (``MPIComm._poll``).
MIN_POLL_SECONDS, MAX_POLL_SECONDS = 0.00005, 0.001


class MPIComm:
    """Object collectives over a private duplicate of an MPI communicator."""

    def __init__(self, comm: MPI.Comm | None = None, timeout: float = 600.0) -> None:
        from mpi4py import MPI

        self._MPI = MPI
        parent = comm if comm is not None else MPI.COMM_WORLD
        self.rank = parent.Get_rank()
        self.size = parent.Get_size()
        self.timeout = timeout
        # A nonblocking duplicate, polled like every collective: a stopped peer cannot hold this rank past
        # ``timeout`` (a blocking ``Dup()`` would wait for it forever).
        self.comm, done = parent.Idup()
        self._guard("duplicating the communicator", lambda start: self._poll("Idup", done.Test, start))

    def _poll(self, op: str, ready: Callable[[], object], start: float) -> None:
        """Test ``ready()`` until it holds or the deadline passes, sleeping between tests for a fiftieth of the
        time waited so far (50 us to 1 ms).

        A waiting rank must not spin: where ranks share cores, a spinning one takes the CPU from the rank it
        waits for (rank 0 deciding a commit). Sleeping in proportion to the wait keeps a message that comes
        soon noticed soon (a decision after a few ms of waiting: within about 0.1 ms) at a few percent of a
        core, and a long wait at one test per millisecond.
        """
        while not ready():
            elapsed = time.monotonic() - start
            if elapsed > self.timeout:
                raise CommTimeoutError(
                    f"rank {self.rank}: {op} on the tddist MPI communicator did not complete within "
                    f"{self.timeout:.0f}s; a peer rank probably died or hung, see the other ranks' logs"
                )
            time.sleep(min(MAX_POLL_SECONDS, max(MIN_POLL_SECONDS, elapsed / 50)))

    def _send(self, obj: Any, dest: int, op: str, start: float) -> None:
        req = self.comm.isend(obj, dest=dest, tag=_TAG)
        self._poll(op, lambda: req.Test(), start)

    def _recv(self, source: int, op: str, start: float) -> Any:
        self._poll(op, lambda: self.comm.Iprobe(source=source, tag=_TAG), start)
        return self.comm.recv(source=source, tag=_TAG)

    def _guard(self, op: str, fn: Callable[[float], T]) -> T:
        start = time.monotonic()
        try:
            return fn(start)
        except CommTimeoutError:
            raise
        except self._MPI.Exception as e:
            raise wrap_transport_error(
                self.rank, f"{op} on the tddist MPI communicator", e, time.monotonic() - start, self.timeout
            ) from e

    def barrier(self) -> None:
        self.allgather(None)

    def broadcast(self, obj: Any, root: int = 0) -> Any:
        def run(start: float) -> Any:
            if self.rank == root:
                reqs = [self.comm.isend(obj, dest=r, tag=_TAG) for r in range(self.size) if r != root]
                self._poll("broadcast", lambda: self._MPI.Request.Testall(reqs), start)
                return obj
            return self._recv(root, "broadcast", start)

        return self._guard("broadcast", run)

    def gather(self, obj: Any, root: int = 0) -> list[Any] | None:
        def run(start: float) -> list[Any] | None:
            if self.rank != root:
                self._send(obj, root, "gather", start)
                return None
            return [obj if r == root else self._recv(r, "gather", start) for r in range(self.size)]

        return self._guard("gather", run)

    def allgather(self, obj: Any) -> list[Any]:
        return self.broadcast(self.gather(obj, 0), 0)

    def dup(self) -> MPIComm:
        return MPIComm(self.comm, self.timeout)


_CACHE: dict[tuple[int, float], MPIComm] = {}


def mpi_comm(parent: MPI.Comm | None = None, timeout: float = 600.0) -> MPIComm:
    """The MPIComm for ``parent`` (None: COMM_WORLD), duplicated once and reused."""
    from mpi4py import MPI

    parent = parent if parent is not None else MPI.COMM_WORLD
    key = (parent.py2f(), round(timeout, 3))
    comm = _CACHE.get(key)
    if comm is None:
        comm = _CACHE[key] = MPIComm(parent, timeout)
    return comm
