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
import time
import weakref
from collections.abc import Callable
from typing import Any, TypeVar

import torch.distributed as dist

from .._compat import group_is_live
from ..errors import CommError, wrap_transport_error

logger = logging.getLogger(__name__)

T = TypeVar("T")

_GROUPS: dict[tuple[int, tuple[int, ...], float, int], TorchComm] = {}
#: Every gloo group tddist created (cached or duplicated for a background channel), oldest first.
_CREATED: list[dist.ProcessGroup] = []
#: Whether tddist initialised the default group itself (it then destroys it at exit).
_OWNS_DEFAULT = False
#: Every TorchComm of this process; at exit each one lets go of its group (see the module's docstring).
_COMMS: weakref.WeakSet[TorchComm] = weakref.WeakSet()


def init_from_env(timeout: float) -> None:
    """Initialise torch.distributed with gloo from torchrun's environment variables."""
    global _OWNS_DEFAULT
    if not dist.is_initialized():
        logger.info("initialising torch.distributed (gloo) from the environment")
        dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=timeout))
        _OWNS_DEFAULT = True


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
        box = [obj if self.rank == root else None]
        self._run("broadcast", lambda: dist.broadcast_object_list(box, group=self.group, group_src=root))
        return box[0]

    def gather(self, obj: Any, root: int = 0) -> list[Any] | None:
        out = [None] * self.size if self.rank == root else None
        self._run("gather", lambda: dist.gather_object(obj, out, group=self.group, group_dst=root))
        return out

    def allgather(self, obj: Any) -> list[Any]:
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
    """A new gloo group over ``ranks`` (collective over them)."""
    td = datetime.timedelta(seconds=timeout)
    local = len(ranks) != dist.get_world_size()
    start = time.monotonic()
    try:
        group = dist.new_group(ranks=list(ranks), backend="gloo", timeout=td, use_local_synchronization=local)
        _CREATED.append(group)
        return group
    except Exception as e:  # a peer died or hung while the group was being created
        op = "creating the tddist gloo group"
        raise wrap_transport_error(dist.get_rank(), op, e, time.monotonic() - start, timeout) from e
