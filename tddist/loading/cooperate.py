"""Reads that several ranks of one node share, split among them: each reads one contiguous part for all of them.

In a resharding load the ranks of a node read pieces of the same data files:
loading a 1-rank checkpoint on 4 ranks, each rank reads a quarter of every
leaf of one file, so the disk sees 4 readers each jumping from leaf to leaf,
64 MiB apart. On the disk the benchmarks ran on, those reads took 1.4x as
long as a same-layout load's (4 readers, one file each, front to back), with
no tddist involved (``benchmarks/reshard_floor.py``). So the node's ranks
split the work instead: of every file that two or more of them read, the
union of their ranges is cut into one contiguous part per rank, each rank
reads its part into the page cache the node shares (``ChunkFiles.warm``),
and then every rank maps its own ranges, which are in memory by then or
being read by a neighbour (a page under read is waited for, never read
twice).

It is an optimisation only: a rank reads what it maps either way, so a part
a neighbour has not warmed yet is read on demand. It needs what every rank
of the node will read, which each rank computes from the manifest (plain and
evenly sharded leaves; not a save's own DTensor boxes, not per-rank state),
and which ranks share a node (``comm.node.node_name``, gathered with the
generation a load agrees on).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from ..manifest.locate import FileSpan, merged_ranges

if TYPE_CHECKING:
    from ..core.sharding import Box
    from ..manifest.model import Leaf


#: A rank that reads fewer bytes than this reads them itself: its reads are too short for their order to matter.
MIN_SHARED_BYTES = 16 * 1024 * 1024


@dataclass(frozen=True)
class NodeRanks:
    """The ranks that run on this rank's node, ascending, this rank among them (they share a page cache)."""

    ranks: tuple[int, ...]


def node_ranks(nodes: Sequence[str], rank: int) -> NodeRanks:
    """The ranks whose node name (``nodes``: every rank's, by rank) is this ``rank``'s."""
    return NodeRanks(tuple(r for r, n in enumerate(nodes) if n == nodes[rank]))


@dataclass(frozen=True)
class SharedReads:
    """What every rank of a node reads: ``requests[i]`` are the (leaf, box) reads of the node's ``i``-th rank,
    this rank's at ``me``. Handed to ``read.read_leaves``, which warms this rank's part first (``share_of``)."""

    requests: tuple[tuple[tuple[Leaf, Box], ...], ...]
    me: int


def share_of(needs: Sequence[Sequence[FileSpan]], me: int) -> list[FileSpan]:
    """This rank's part of what the node's ranks read together (``needs[i]``: the spans its ``i``-th rank reads).

    Files that only one rank reads are left out (that rank reads them as
    usual). Of the others, the union of every rank's spans, file by file in
    name order, is cut into ``len(needs)`` contiguous parts of equal bytes;
    part ``me`` is returned, as spans in file order.
    """
    readers: dict[str, set[int]] = {}
    spans: dict[str, list[tuple[int, int]]] = {}
    for i, rank_spans in enumerate(needs):
        for s in rank_spans:
            if s.stop > s.start:
                readers.setdefault(s.relpath, set()).add(i)
                spans.setdefault(s.relpath, []).append((s.start, s.stop))
    union = [(rel, lo, hi) for rel in sorted(spans) if len(readers[rel]) > 1 for lo, hi in merged_ranges(spans[rel])]
    total = sum(hi - lo for _rel, lo, hi in union)
    first, last = total * me // len(needs), total * (me + 1) // len(needs)
    part, at = [], 0  # ``at``: bytes of the union before the current span
    for rel, lo, hi in union:
        a, b = max(first - at, 0), min(last - at, hi - lo)
        if a < b:
            part.append(FileSpan(rel, lo + a, lo + b))
        at += hi - lo
    return part
