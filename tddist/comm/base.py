"""The ``Communicator`` protocol: the few object collectives tddist needs; ``LocalComm``; the default timeout.

A ``Communicator`` is anything with ``rank``, ``size`` and four collectives on
picklable objects. Implementations: ``LocalComm`` (one process, here),
``threads.ThreadComm`` (ranks as threads of one process, for fast tests),
``gloo.TorchComm`` (a private gloo group) and ``mpi.MPIComm`` (a ``Dup()`` of
an MPI communicator). ``resolve.resolve`` picks one from what the caller
passed or from the environment; ``collective`` makes every rank end the same
way.
"""

from __future__ import annotations

import os
from typing import Any, Protocol, runtime_checkable

from ..errors import InvalidArgumentError

#: Seconds any collective may take when neither ``timeout=`` nor ``TDDIST_TIMEOUT`` says otherwise.
DEFAULT_TIMEOUT = 600.0


def default_timeout() -> float:
    """``TDDIST_TIMEOUT`` (seconds) if set, else ``DEFAULT_TIMEOUT``; read at each call, so a job can set it
    after importing tddist."""
    value = os.environ.get("TDDIST_TIMEOUT")
    if value is None:
        return DEFAULT_TIMEOUT
    try:
        seconds = float(value)
    except ValueError:
        raise InvalidArgumentError(
            f"TDDIST_TIMEOUT={value!r} is not a number of seconds; set it to a positive number or unset it"
        ) from None
    if not seconds > 0:
        raise InvalidArgumentError(f"TDDIST_TIMEOUT={value!r} must be a positive number of seconds")
    return seconds


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
