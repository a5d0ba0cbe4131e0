"""Which rank on another node keeps each rank's replica.

A replica is only worth keeping on another node: a node that dies takes its
local disk with it. ``comm.node.node_name`` says where a process runs
(``TDDIST_NODE`` or the manager's ``node=`` override it); ``replica_peers``
pairs every rank with a rank of the next node, so each node's replicas all
live on one other node.
"""

from __future__ import annotations

from collections.abc import Sequence


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
