"""The node-local tier as ``CheckpointManager`` runs it: local saves, their promotion, local restores.

With ``local_dir``, each save first commits every rank's shard to its own
node (``local_tier.LocalTier``), the ranks agree that every part committed,
and the shared checkpoint is then written in the background by a promotion
(``promotion.start``). ``TieredSaves`` holds what the manager tracks for
this: the promotion in flight, the newest complete local copy and the newest
promoted step, and applies the local retention. The manager keeps the shared
root (its path names, its lock, its retention) and hands them over as a
``SharedRoot``.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ..comm.base import Communicator
from ..comm.collective import collective_error, contribute, describe, run_step
from ..comm.node import node_name
from ..errors import CommError, TddistError
from ..loading.share import LoadReport
from . import promotion
from .keeping import Keeping
from .local_shards import DTensorLayout
from .local_tier import LocalTier, Restoring, complete_steps, expand
from .peer_restore import PeerRestore, restore_from_copies
from .replication import Replicator
from .train_state import fill

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class SharedRoot:
    """The manager's shared root, as the node-local tier uses it.

    Attributes:
        root: the shared root (absolute), named in messages.
        path: the shared checkpoint of a step (``CheckpointManager.path``).
        prepare: run by a promotion on every rank, on the background
            communicator, before it saves: creates and locks the root.
        retain: applies the shared root's retention once a step's promotion
            committed (``keep_last``; rank 0 deletes, the others do nothing).
    """

    root: str
    path: Callable[[int], str]
    prepare: promotion.PrepareRoot
    retain: Callable[[int], None]


@dataclass(frozen=True)
class Replication:
    """The manager's replication options: ``replicas`` (0 or 1) and this rank's ``node`` (None: detected)."""

    replicas: int = 0
    node: str | None = None


@dataclass(frozen=True)
class LocalRestore:
    """What ``TieredSaves.restore`` loaded: this rank's own part of a step.

    Attributes:
        step: the step loaded.
        path: this rank's local part.
        report: what ``tddist.load(into=...)`` found.
        layouts: the layouts of the state's DTensor leaves (to promote the copy again).
    """

    step: int
    path: str
    report: LoadReport
    layouts: tuple[DTensorLayout, ...]


class TieredSaves:
    """The manager's node-local tier on one rank (``local_dir``), with its promotion in flight.

    Collective methods, called in the same order on every rank by the
    manager: ``complete`` (one allgather), ``restore`` (one allgather),
    ``promote_restored`` (``wait``, one allgather, then ``promotion.start``),
    ``save`` (one allgather, then ``promotion.start``) and ``wait`` (one
    allgather when a promotion is in flight). ``promotion_done`` is local:
    the manager exchanges it in its step vote and calls ``wait`` on every
    rank once it is True on every rank.

    With replication, ``save`` also starts the replication of the step
    (``replication.Replicator``; collective the first time), ``wait`` waits
    for it first, and ``restore_from_copies`` restores from what survives.

    Args:
        comm: the manager's communicator.
        local_dir: the node-local directory (``{rank}`` is replaced by the rank).
        shared: the manager's shared root.
        replication: the replication options.

    Raises:
        InvalidArgumentError: an invalid ``local_dir``.
    """

    def __init__(
        self,
        comm: Communicator,
        local_dir: str | os.PathLike,
        shared: SharedRoot,
        replication: Replication = Replication(),
    ) -> None:
        self.comm = comm
        self.shared = shared
        self.tier = LocalTier(expand(local_dir, comm.rank), comm.rank, comm.size)
        node = replication.node if replication.node is not None else node_name()
        self.replicator = Replicator(comm, self.tier, node) if replication.replicas else None
        self._promotion: promotion.Promotion | None = None
        self._newest_local: int | None = None  # the newest complete local copy saved by this manager
        self._promoted: int | None = None  # the newest step whose promotion committed
        self._keeping: Keeping | None = None  # a part restored from a peer, being written to the local tier

    def settle(self) -> None:
        """Wait until a part restored from a peer is written to this rank's local tier (``keeping``), if one is."""
        keeping, self._keeping = self._keeping, None
        if keeping is not None:
            keeping.wait()

    def complete(self) -> frozenset[int]:
        """The steps of which every rank holds its local part for this world size (collective)."""
        self.settle()
        return complete_steps(self.comm, self.tier)

    def promotion_done(self) -> bool:
        """Whether this rank's promotion in flight has ended (committed or failed); False when there is none."""
        return self._promotion is not None and self._promotion.future.done()

    def restore(self, state: Any, step: int, load_kwargs: dict[str, Any]) -> LocalRestore:
        """Every rank loads its own local part of ``step``; the same error on every rank if any rank fails.

        Returns what was restored and the layouts of the state's DTensor leaves.
        """
        tier = self.tier
        self.settle()
        restoring: list[Restoring] = []

        def load_local(into: Any) -> LoadReport:
            restoring.append(tier.load_into(step, into, load_kwargs))
            return restoring[-1].report

        outcome = contribute(lambda: fill(state, load_local))
        failures = {r: f for r, f in enumerate(self.comm.allgather(outcome.failure)) if f is not None}
        if failures:
            raise collective_error(f"restoring step {step} from the node-local copies", failures)
        assert outcome.value is not None
        return LocalRestore(step, tier.part(step), outcome.value, restoring[-1].layouts)

    def restore_from_copies(
        self, state: Any, step: int | None, shared: int | None, load_kwargs: dict[str, Any]
    ) -> PeerRestore | None:
        """Restore from the own parts and replicas on the nodes that are up (collective; see ``peer_restore``)."""
        assert self.replicator is not None  # the manager asks only with replicas
        self.settle()
        got = restore_from_copies(self.comm, self.tier, self.replicator.node, state, step, shared, load_kwargs)
        self._keeping = got.keeping if got is not None else None
        return got

    def promote_restored(self, step: int, layouts: tuple[DTensorLayout, ...], save_kwargs: dict[str, Any]) -> None:
        """Promote the local copy just restored, which is newer than the shared root's newest (collective).

        A part that cannot be read back is logged on every rank, and the
        shared root keeps its older checkpoints: the restore itself succeeded.
        """
        tier = self.tier
        self.wait()  # a promotion started by an earlier restore: its outcome is taken first
        try:
            copy = run_step(
                self.comm, f"reading step {step} back from the node-local tier", lambda: tier.read(step, layouts)
            )
        except CommError:
            raise
        except TddistError as e:
            logger.warning("rank %d: %s; step %d is not promoted to %s", self.comm.rank, e, step, self.shared.root)
            return
        assert copy is not None
        kwargs = {k: v for k, v in save_kwargs.items() if k != "metadata"}
        logger.info(
            "rank %d: promoting the restored local copy of step %d to %s", self.comm.rank, step, self.shared.root
        )
        self._newest_local = step
        request = promotion.PromotionRequest(
            step, copy.path, self.shared.path(step), copy.data, dict(copy.metadata), kwargs, self.shared.prepare
        )
        self._promotion = promotion.start(self.comm, request, time.monotonic())

    def save(self, step: int, data: Any, metadata: dict[str, Any], kwargs: dict[str, Any], start: float) -> None:
        """Commit every rank's local part, agree that all did, then start the promotion to the root (collective)."""
        tier = self.tier
        what = f"saving step {step} to the node-local tier"
        try:
            mapped, error = tier.save(data, step, metadata, kwargs), None
        except Exception as e:  # this rank's vote; every rank raises the agreed error below
            mapped, error = None, e
        _agree_naming(
            self.comm, what, error,
            lambda e: f"rank {self.comm.rank}: {what}: the ranks could not agree that every rank committed its "
            f"part: {e}. The shared root is unchanged, and restore() ignores a local copy that some rank lacks",
        )  # fmt: skip
        self._newest_local = step
        logger.info("rank %d: saved step %d locally in %.2fs", self.comm.rank, step, time.monotonic() - start)
        self._retain_local()
        request = promotion.PromotionRequest(
            step, tier.part(step), self.shared.path(step), mapped, dict(metadata), dict(kwargs), self.shared.prepare
        )
        self._promotion = promotion.start(self.comm, request, start)
        if self.replicator is not None:  # last: its thread starts reading as soon as it starts
            self.replicator.start(step)

    def wait(self) -> None:
        """Wait for a restored part being written (``settle``) and the replication in flight, then for the
        promotion in flight, if any, and agree on its outcome (collective); apply retention.

        Raises:
            TddistError: the promotion failed on some rank (the same error on
                every rank, naming its step); its local copy is kept.
        """
        self.settle()
        if self.replicator is not None:
            self.replicator.wait()
        p = self._promotion
        if p is None:
            return
        self._promotion = None
        error = p.future.exception()
        mine = f"failed ({error})" if error is not None else "committed on this rank"
        _agree_naming(
            self.comm, f"the promotion of step {p.step} to {p.target}", error,
            lambda e: f"rank {self.comm.rank}: the ranks could not agree on the promotion of step {p.step} to "
            f"{p.target}: {e}. This rank's promotion {mine}; its node-local copy ({p.local}) is kept",
        )  # fmt: skip
        logger.info(
            "rank %d: promoted step %d %.2fs after it started", self.comm.rank, p.step, time.monotonic() - p.started
        )
        self._promoted = p.step
        self.shared.retain(p.step)
        self._retain_local()

    def _retain_local(self) -> None:
        """Drop this rank's local parts older than the newest complete one and no newer than the newest promoted."""
        if self._newest_local is None or self._promoted is None:
            return
        newest, promoted = self._newest_local, self._promoted
        self.tier.drop(frozenset(s for s in self.tier.on_disk() if s < newest and s <= promoted))


def pick_local(complete: frozenset[int], step: int | None, shared: int | None) -> int | None:
    """The local copy to restore: ``step`` if complete; else the newest complete one, unless the shared root has a newer one."""
    if step is not None:
        return step if step in complete else None
    if not complete or (shared is not None and shared > max(complete)):
        return None
    return max(complete)


def _agree_naming(
    comm: Communicator, what: str, error: BaseException | None, broken: Callable[[CommError], str]
) -> None:
    """``comm.agree``, except that a transport failure of the agreement itself (a rank died or hung) is
    re-raised, with its class, as ``broken(error)`` says (naming the step), not as a bare allgather error."""
    try:
        statuses = comm.allgather(describe(error) if error is not None else None)
    except CommError as e:
        raise type(e)(broken(e), failures=e.failures) from e
    failures = {r: s for r, s in enumerate(statuses) if s is not None}
    if failures:
        raise collective_error(what, failures) from error
