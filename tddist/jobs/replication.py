"""Replication: each rank's committed local part copied to a rank on another node, in the background.

After every rank committed its local part of a step (``local_tier``), the
replicator sends each part to its peer (``nodes.replica_peers``) on a
dedicated duplicate of the manager's communicator, from its own thread, in
bounded chunks (``transfer.ship``). The peer writes it under
``<local_dir>/replicas/step-<step>/rank-<r>-of-<world>``, checks every file's
checksum, fsyncs it and only then writes the replica's record (its commit
point, ``copies.write_record``). The ranks then tell each other which
replicas committed, and the owner of each confirmed part records the peer in
its own copy's record: a step is replicated exactly when its owners' records
name a peer. A replica cut off (its peer killed mid-copy) has no record and
is never used; the next replication of its part replaces it.

Each rank keeps the replicas it received of the two newest steps it holds
replicas of (the current and the previous: with the owner's own two copies,
four slots), and deletes older ones once a newer one committed.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from dataclasses import dataclass

from .._fs import remove_tree
from ..comm.base import Communicator
from ..errors import TddistError
from . import transfer
from .copies import CopyRecord, FileSum, PartId, digest_files, read_record, record_path, write_record
from .local_tier import LocalTier
from .nodes import replica_peers
from .retention import parse_step, step_name

logger = logging.getLogger(__name__)

#: The directory under ``local_dir`` that holds the replicas a rank keeps for its peers.
REPLICAS = "replicas"
#: How many steps of replicas each rank keeps (the current and the previous).
KEEP_STEPS = 2


@dataclass(frozen=True)
class Topology:
    """Where the ranks run: each rank's node and the rank that keeps its replica (empty on one node)."""

    nodes: tuple[str, ...]
    peers: dict[int, int]


def replica_path(directory: str, part: PartId) -> str:
    """Where a replica of ``part`` is kept under a rank's local directory."""
    return os.path.join(directory, REPLICAS, step_name(part.step), part.name)


class Replicator:
    """The replication of one rank's local parts (see the module docstring).

    ``start`` is collective (the first call duplicates the communicator and
    exchanges the nodes); the copy itself runs on this rank's replication
    thread, one step at a time; ``wait`` waits for it. A failed replication
    is logged, never raised: the local copy and its promotion stand, and the
    step is only not replicated.

    Args:
        comm: the manager's communicator.
        tier: this rank's local tier.
        node: this rank's node.
    """

    def __init__(self, comm: Communicator, tier: LocalTier, node: str) -> None:
        self.comm, self.tier, self.node = comm, tier, node
        self._bg: Communicator | None = None
        self.topology: Topology | None = None
        self._thread: threading.Thread | None = None
        self.replicated: dict[int, float] = {}  # step -> seconds its replication took (committed ones)

    def start(self, step: int) -> None:
        """Start replicating this rank's part of ``step`` (collective), after the replication in flight."""
        self.wait()
        if self._bg is None:
            self._bg = self.comm.dup()
            nodes = tuple(self.comm.allgather(self.node))
            self.topology = Topology(nodes, replica_peers(nodes))
            if not self.topology.peers and self.comm.rank == 0:
                logger.warning("replicas=1, but every rank runs on node %r: no replica is kept", nodes[0])
        if not self.topology or not self.topology.peers:
            return
        self._thread = threading.Thread(
            target=self._run, args=(step,), name=f"tddist-replicate-rank{self.comm.rank}", daemon=True
        )
        self._thread.start()

    def wait(self) -> None:
        """Wait for the replication in flight, if any."""
        thread, self._thread = self._thread, None
        if thread is not None:
            thread.join()

    def _run(self, step: int) -> None:
        begin = time.monotonic()
        try:
            confirmed = self._replicate(step)
        except (TddistError, OSError) as e:
            logger.warning("rank %d: replicating step %d failed: %s; it is not replicated", self.comm.rank, step, e)
            return
        if confirmed:
            self.replicated[step] = time.monotonic() - begin
            logger.info("rank %d: step %d replicated in %.2fs", self.comm.rank, step, self.replicated[step])

    def _replicate(self, step: int) -> bool:
        """Send this rank's part, receive the peers', commit the replicas, record the confirmation."""
        assert self._bg is not None and self.topology is not None
        bg, tier, peers = self._bg, self.tier, self.topology.peers
        mine = PartId(step, bg.rank, bg.size)
        try:
            files: tuple[FileSum, ...] | None = digest_files(tier.part(step))
        except OSError as e:  # this part is not sent; the ranks still run every round together
            logger.warning("rank %d: reading its local part of step %d failed: %s", bg.rank, step, e)
            files = None
        everyone = bg.allgather(files)
        shipments = [
            transfer.Shipment(r, peers[r], PartId(step, r, bg.size), everyone[r])
            for r in sorted(peers)
            if everyone[r] is not None
        ]
        staging = {s.part: f"{replica_path(tier.directory, s.part)}.incoming-{os.getpid()}" for s in shipments}
        for s in shipments:
            if s.dst == bg.rank:
                remove_tree(staging[s.part])
        bad = transfer.ship(bg, shipments, lambda s: tier.part(step), lambda s: staging[s.part], transfer.chunk_bytes())
        committed = [self._commit(s, staging[s.part]) for s in shipments if s.dst == bg.rank and s not in bad]
        confirmations = bg.allgather(committed)
        confirmed = files is not None and any(mine in c for c in confirmations)
        if confirmed:
            assert files is not None
            peer = peers[bg.rank]
            write_record(tier.part(step), CopyRecord(mine, files, peer, self.topology.nodes[peer]))
        self._rotate()
        return confirmed

    def _commit(self, shipment: transfer.Shipment, staging: str) -> PartId | None:
        """Move a received replica into place and write its record (the replica's commit point); None if that failed."""
        final = replica_path(self.tier.directory, shipment.part)
        try:
            remove_tree(record_path(final))
            remove_tree(final)
            os.rename(staging, final)
            write_record(final, CopyRecord(shipment.part, shipment.files))
        except OSError as e:
            logger.warning("rank %d: committing the replica %s failed: %s", self.comm.rank, final, e)
            return None
        return shipment.part

    def _rotate(self) -> None:
        """Delete the replicas this rank received of steps older than the ``KEEP_STEPS`` newest it holds."""
        assert self.topology is not None
        mine = {r for r, p in self.topology.peers.items() if p == self.comm.rank}
        base = os.path.join(self.tier.directory, REPLICAS)
        held = held_replicas(self.tier.directory)
        steps = sorted({p.step for p in held if p.rank in mine}, reverse=True)
        for part in held:
            if part.rank in mine and part.step not in steps[:KEEP_STEPS]:
                path = replica_path(self.tier.directory, part)
                remove_tree(record_path(path))
                remove_tree(path)
                try:
                    os.rmdir(os.path.join(base, step_name(part.step)))
                except OSError:
                    pass


def held_replicas(directory: str) -> list[PartId]:
    """The committed replicas (with a valid record) under a rank's local directory."""
    base = os.path.join(directory, REPLICAS)
    out = []
    for step_dir in _listdir(base):
        step = parse_step(step_dir)
        if step is None:
            continue
        for name in _listdir(os.path.join(base, step_dir)):
            path = os.path.join(base, step_dir, name)
            if name.startswith(".") or not os.path.isdir(path):
                continue
            record = read_record(path)
            if record is not None and record.part.step == step and record.part.name == name:
                out.append(record.part)
    return sorted(out)


def _listdir(path: str) -> list[str]:
    try:
        return sorted(os.listdir(path))
    except FileNotFoundError:
        return []
