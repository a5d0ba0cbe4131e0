"""torch.distributed communicator on a private gloo group.

tddist never runs its collectives on the user's group: that group may be NCCL
(objects would go through the GPU) and its collectives must never interleave
with ours. A private gloo group with its own timeout is created once per
parent group and reused.

Lifetime: a gloo worker thread frees a finished collective's tensors after the
waiting thread has returned, and freeing a tensor that has a Python object
takes the interpreter lock. When the interpreter is already finalizing (the
collective was the last thing a rank did), the worker thread is ended inside
that destructor and the process aborts ("terminate called without an active
exception", SIGABRT). ``destroy_process_group`` does not stop the workers;
only freeing the group does, and torch frees it with the interpreter lock
released, joining its worker threads. So at exit, after in-flight saves have
finished and while the interpreter is still whole, tddist destroys every group
it created (newest first) and drops every reference it holds to them,
``TorchComm.group`` included: the group is freed there and its workers have
finished before finalization starts. The default group is destroyed too if
tddist initialised torch.distributed itself. Groups the user's
``destroy_process_group()`` already destroyed are only freed, and a cached
group found destroyed is created again on next use.
"""

from __future__ import annotations

import atexit
import datetime
import logging
import os
import threading
import time
import weakref
from collections.abc import Callable
from typing import Any, TypeVar, cast

import torch.distributed as dist

from .._compat import group_is_live
from ..errors import CommError, CommTimeoutError, wrap_transport_error
from . import slots

logger = logging.getLogger(__name__)

T = TypeVar("T")

_GROUPS: dict[tuple[int, tuple[int, ...], float, int], TorchComm] = {}
#: Every gloo group tddist created (cached or duplicated for a background channel), oldest first.
_CREATED: list[dist.ProcessGroup] = []
#: Whether tddist initialised the default group itself (it then destroys it at exit).
_OWNS_DEFAULT = False
#: Every TorchComm of this process; at exit each one lets go of its group (see the module's docstring).
_COMMS: weakref.WeakSet[TorchComm] = weakref.WeakSet()


#: Seconds past ``timeout`` that creating a group or joining the job may take before this rank gives up on it.
#: torch bounds these steps by its store's timeout, not by the group's: a peer that hosts the store and is
#: stopped (SIGSTOP, a debugger, a swapped-out node) would hold the other ranks far past ``timeout=``.
DEADLINE_GRACE = 5.0


def init_from_env(timeout: float) -> None:
    """Initialise torch.distributed with gloo from torchrun's environment variables, within ``timeout``.

    Raises ``CommTimeoutError`` (a peer, or the store's host, is stopped or
    gone) or ``CommError`` (the store refused us) instead of torch's
    ``DistNetworkError``.
    """
    global _OWNS_DEFAULT
    if not dist.is_initialized():
        logger.info("initialising torch.distributed (gloo) from the environment")
        rank = int(os.environ.get("RANK", "-1"))
        td = datetime.timedelta(seconds=timeout)
        within_deadline(rank, "joining the job (torch.distributed.init_process_group, gloo)", timeout,
                        lambda: dist.init_process_group("gloo", timeout=td))  # fmt: skip
        _OWNS_DEFAULT = True


def within_deadline(rank: int, op: str, timeout: float, fn: Callable[[], T]) -> T:
    """Run ``fn`` (a step that waits on the peers) and return its result, or raise a ``CommError`` once it
    failed or ``timeout + DEADLINE_GRACE`` seconds passed.

    The step runs on a daemon thread: past the deadline this rank raises
    ``CommTimeoutError`` and leaves the thread waiting (torch offers no way to
    cancel it); the rank's job is broken by then anyway, since a peer is
    stopped or gone.
    """
    outcome: list[tuple[bool, Any]] = []
    done = threading.Event()
    start = time.monotonic()

    def run() -> None:
        try:
            outcome.append((True, fn()))
        except BaseException as e:  # handed to the waiting thread, which raises it typed
            outcome.append((False, e))
        finally:
            done.set()

    threading.Thread(target=run, name=f"tddist-connect-rank{rank}", daemon=True).start()
    if not done.wait(timeout + DEADLINE_GRACE):
        raise CommTimeoutError(
            f"rank {rank}: {op} did not complete within {timeout:g}s (waited "
            f"{time.monotonic() - start:.1f}s): a peer rank, or the one hosting the job's store, is stopped or "
            f"gone; see the other ranks' logs. Nothing was written; pass a larger timeout= (or TDDIST_TIMEOUT) "
            f"if the job is only slow to start"
        )
    ok, value = outcome[0]
    if ok:
        return cast(T, value)
    raise wrap_transport_error(rank, op, value, time.monotonic() - start, timeout) from value


def release_groups() -> None:
    """Destroy every group tddist created, newest first, then the default group if tddist created it.

    Runs at exit (after in-flight saves finished); safe to call again, and
    after the user destroyed the groups (those are only forgotten).
    """
    global _OWNS_DEFAULT
    for comm in list(_COMMS):
        comm.release()
    groups = list(reversed(_CREATED))
    _CREATED.clear()
    _GROUPS.clear()
    initialized = dist.is_available() and dist.is_initialized()
    while groups:
        group = groups.pop(0)
        if initialized and group_is_live(group):
            try:
                dist.destroy_process_group(group)
            except Exception:  # already destroyed through another path; nothing is left to release
                logger.debug("destroying a tddist gloo group failed", exc_info=True)
        del group  # the last reference: torch frees the group here, joining its worker threads
    if not initialized:
        _OWNS_DEFAULT = False
        return
    if _OWNS_DEFAULT:
        _OWNS_DEFAULT = False
        logger.info("destroying the default process group that tddist initialised")
        dist.destroy_process_group()


atexit.register(release_groups)  # atexit runs after threading's exit hooks, where in-flight saves finish


class TorchComm:
    """Collectives over a private gloo process group."""

    def __init__(self, group: dist.ProcessGroup, timeout: float) -> None:
        self._group: dist.ProcessGroup | None = group
        self.timeout = timeout
        self.rank = dist.get_rank(group)
        self.size = dist.get_world_size(group)
        _COMMS.add(self)

    @property
    def group(self) -> dist.ProcessGroup:
        """The gloo group the collectives run on."""
        if self._group is None:
            raise CommError(
                f"rank {self.rank}: tddist's gloo group was released because the interpreter is exiting; "
                f"save or load before the end of the program (not from an atexit handler or a finalizer)"
            )
        return self._group

    def release(self) -> None:
        """Let go of the group (at exit), so that torch can free it and join its worker threads."""
        self._group = None

    def _run(self, op: str, fn: Callable[[], T]) -> T:
        start = time.monotonic()
        try:
            return fn()
        except Exception as e:  # gloo raises RuntimeError (or DistBackendError) on a dead peer or timeout
            raise wrap_transport_error(
                self.rank, f"{op} on the tddist gloo group", e, time.monotonic() - start, self.timeout
            ) from e

    def barrier(self) -> None:
        self._run("barrier", lambda: dist.barrier(group=self.group))

    def broadcast(self, obj: Any, root: int = 0) -> Any:
        return self._run("broadcast", lambda: slots.broadcast(obj, root, self.rank, self.group))

    def gather(self, obj: Any, root: int = 0) -> list[Any] | None:
        if self.size <= slots.SLOTTED_RANKS:
            return self._run("gather", lambda: slots.gather(obj, root, self.rank, self.size, self.group))
        out = [None] * self.size if self.rank == root else None
        self._run("gather", lambda: dist.gather_object(obj, out, group=self.group, group_dst=root))
        return out

    def allgather(self, obj: Any) -> list[Any]:
        if self.size <= slots.SLOTTED_RANKS:
            return self._run("allgather", lambda: slots.allgather(obj, self.rank, self.size, self.group))
        out = [None] * self.size
        self._run("allgather", lambda: dist.all_gather_object(out, obj, group=self.group))
        return out

    def dup(self) -> TorchComm:
        return TorchComm(_new_gloo_group(tuple(dist.get_process_group_ranks(self.group)), self.timeout), self.timeout)


def torch_comm(group: dist.ProcessGroup | None, timeout: float) -> TorchComm:
    """The private gloo TorchComm for ``group`` (None: the default group).

    Creating it is collective over ``group``'s ranks the first time; later
    calls reuse it.
    """
    parent = group if group is not None else dist.group.WORLD
    ranks = tuple(dist.get_process_group_ranks(parent))
    key = (id(parent), ranks, round(timeout, 3), os.getpid())
    comm = _GROUPS.get(key)
    if comm is not None and not group_is_live(comm.group):  # the user destroyed the groups and initialised anew
        comm = None
    if comm is None:
        comm = TorchComm(_new_gloo_group(ranks, timeout), timeout)
        _GROUPS[key] = comm
    return comm


def _new_gloo_group(ranks: tuple[int, ...], timeout: float) -> dist.ProcessGroup:
    """A new gloo group over ``ranks`` (collective over them), within ``timeout`` (``within_deadline``)."""
    td = datetime.timedelta(seconds=timeout)
    local = len(ranks) != dist.get_world_size()

    def create() -> dist.ProcessGroup:
        return dist.new_group(ranks=list(ranks), backend="gloo", timeout=td, use_local_synchronization=local)

    group = within_deadline(dist.get_rank(), "creating the tddist gloo group", timeout, create)
    _CREATED.append(group)
    return group
