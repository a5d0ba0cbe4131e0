"""Which node a rank runs on: ranks with the same name share a machine (its page cache, its local disk).

``node_name`` reads it from what the launcher tells: ``TDDIST_NODE`` (or the
manager's ``node=``) first, then torchrun's ``GROUP_RANK`` (its agent's node
rank), SLURM's ``SLURM_NODEID``, the MPI processor name, else the host name.
A load splits the reads that several ranks of one node share by it
(``loading.cooperate``); the node-local tier places replicas by it
(``jobs.nodes``).
"""

from __future__ import annotations

import os
import socket
import sys
from collections.abc import Mapping

#: Environment variable naming this process's node (overrides what the launcher tells).
NODE_ENV = "TDDIST_NODE"


def node_name(env: Mapping[str, str] | None = None) -> str:
    """This process's node, as a name the ranks compare (ranks with the same name share a node)."""
    env = os.environ if env is None else env
    if env.get(NODE_ENV):
        return env[NODE_ENV]
    if "GROUP_RANK" in env and "LOCAL_WORLD_SIZE" in env:
        return f"torchrun-node-{env['GROUP_RANK']}"
    if "SLURM_NODEID" in env:
        return f"slurm-node-{env['SLURM_NODEID']}"
    mpi = sys.modules.get("mpi4py.MPI")
    if mpi is not None and mpi.Is_initialized():
        return f"mpi-host-{mpi.Get_processor_name()}"
    return f"host-{socket.gethostname()}"


#: The launchers' counts of the ranks started on this node: torchrun, Open MPI, MPICH's Hydra, SLURM's srun.
LOCAL_RANK_COUNTS = ("LOCAL_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_SIZE", "MPI_LOCALNRANKS", "SLURM_NTASKS_PER_NODE")


def ranks_on_this_node(env: Mapping[str, str] | None = None) -> int:
    """How many ranks the launcher started on this node, the first of ``LOCAL_RANK_COUNTS`` it sets as a
    positive number (1 where none is set): the ranks that share this node's cores."""
    env = os.environ if env is None else env
    for name in LOCAL_RANK_COUNTS:
        value = env.get(name, "")
        if value.isdigit() and int(value) > 0:
            return int(value)
    return 1
