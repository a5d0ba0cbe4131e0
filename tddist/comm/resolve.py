"""Choosing the communicator of a save or a load: the one passed as ``comm=``, else the job's.

Detection order: an initialised torch.distributed default group (tddist's
private gloo group over it, ``gloo``); an MPI launch of more than one rank
(a ``Dup()``, ``mpi``); torchrun's environment (gloo is initialised); else
one process (``LocalComm``).
"""

from __future__ import annotations

import os
from typing import Any

from ..errors import InvalidArgumentError
from .base import Communicator, LocalComm, default_timeout
from .threads import ThreadComm

#: The communicator of a process without torch.distributed or MPI: one per process, so that what is
#: kept per communicator (the channel of asynchronous saves, its buffers and merge cache) is kept once.
_LOCAL = LocalComm()


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
    timeout = default_timeout() if timeout is None else float(timeout)
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
