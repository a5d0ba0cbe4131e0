"""Which node a rank runs on, and which rank on another node keeps its replica.

A replica is only worth keeping on another node: a node that dies takes its
local disk with it. ``node_name`` says where this process runs (``TDDIST_NODE``
or the manager's ``node=`` override it), from what the launcher tells: torchrun's
``GROUP_RANK`` (its agent's node rank), SLURM's ``SLURM_NODEID``, the MPI
processor name, else the host name. ``replica_peers`` pairs every rank with a
rank of the next node, so each node's replicas all live on one other node.
"""

from __future__ import annotations

import os
import socket
import sys
from collections.abc import Mapping, Sequence

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


def replica_peers(nodes: Sequence[str]) -> dict[int, int]:
    """rank -> the rank that keeps its replica: the same local index (modulo its size) on the next node.

    Nodes are ordered by their lowest rank; the last node's peers are on the
    first. Empty when every rank is on one node (a replica there would die
    with it).
    """
    order: list[str] = []
    for n in nodes:
        if n not in order:
            order.append(n)
    if len(order) < 2:
        return {}
    ranks = {n: [r for r, m in enumerate(nodes) if m == n] for n in order}
    peers = {}
    for i, n in enumerate(order):
        nxt = ranks[order[(i + 1) % len(order)]]
        for j, r in enumerate(ranks[n]):
            peers[r] = nxt[j % len(nxt)]
    return peers
