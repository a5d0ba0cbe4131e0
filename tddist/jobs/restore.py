"""What ``CheckpointManager.restore`` runs: find the checkpoint, hold it, load it, say what was loaded.

Rank 0 alone looks for the checkpoint under the shared root (the newest, or
that of a given step) and holds it, so that no retention of this process
deletes it while it is read; it broadcasts what it found as a
``RestoreSource``. With the node-local tier, each rank's own local part is
loaded instead when it is at least as new. The result is a ``Restored``: an
int equal to the step, with the path, the load's report and the tier.

Apart from the manager so that the restore path, with its fallbacks and its
messages, reads in one place; the manager only checks its arguments.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ..api import load
from ..comm.base import Communicator
from ..comm.collective import decide_on_rank0
from ..errors import CheckpointNotFoundError, CommError, TddistError
from ..loading.share import LoadReport
from ..storage.backends import read_manifest, store_for
from ..storage.roots import Root
from .retention import hold, newest_checkpoint, step_entries
from .tiered import TieredSaves, pick_local
from .train_state import fill

logger = logging.getLogger(__name__)


@dataclass(frozen=True, eq=False)
class Restored(int):
    """What ``CheckpointManager.restore`` loaded: the step (this object is that int), the path and the report.

    It is an ``int`` equal to ``step``, so ``range(mgr.restore(state), n)``,
    ``start == 20`` and f-strings keep working as when ``restore`` returned
    the step alone.

    Attributes:
        step: the step of the checkpoint loaded, 0 when there was none.
        path: the checkpoint loaded (with ``tier="local"``, this rank's own
            part of the node-local copy), or None.
        report: what ``tddist.load(into=...)`` found (loaded, skipped, ...), or None.
        tier: where it came from: ``"shared"`` (the manager's root),
            ``"local"`` (the node-local copy, see ``local_dir``), ``"peers"``
            (with ``replicas=1``: the node-local copies, some read from other
            nodes), or None when nothing was restored.
    """

    step: int
    path: str | None = None
    report: LoadReport | None = None
    tier: str | None = None

    def __new__(
        cls, step: int, path: str | None = None, report: LoadReport | None = None, tier: str | None = None
    ) -> Restored:
        return super().__new__(cls, step)

    def __repr__(self) -> str:
        return f"Restored(step={self.step}, path={self.path!r}, report={self.report!r}, tier={self.tier!r})"

    def __str__(self) -> str:
        return str(self.step)

    __format__ = int.__format__
    __hash__ = int.__hash__


@dataclass(frozen=True)
class RestoreRequest:
    """What ``CheckpointManager.restore`` was asked to do (its arguments, checked).

    Attributes:
        state: what to fill, as in ``CheckpointManager.restore``.
        step: the step to load, or None for the newest.
        required: raise instead of starting from step 0 when there is nothing to restore.
        load_kwargs: passed to ``tddist.load``.
        finite: skip checkpoints that hold NaN or Inf values (``CheckpointManager(restore="finite")``).
    """

    state: Any
    step: int | None
    required: bool
    load_kwargs: dict[str, Any]
    finite: bool = False


@dataclass(frozen=True)
class RestoreSource:
    """Rank 0's answer to which checkpoint of the shared root ``restore`` loads, broadcast to every rank.

    Either there is one (``path`` and ``step`` set) or there is none and
    ``missing`` says why, in words that every rank puts in its message.

    Attributes:
        path: the committed checkpoint to load, or None.
        step: its step (as its manifest's metadata records it), or None.
        missing: why there is none; "" when there is one.
        root_missing: there is none because the root does not exist (a typo in the path?).
    """

    path: str | None = None
    step: int | None = None
    missing: str = ""
    root_missing: bool = False

    @classmethod
    def at(cls, path: str, step: int) -> RestoreSource:
        """The checkpoint at ``path``, of ``step``."""
        return cls(path=path, step=step)

    @classmethod
    def none(cls, missing: str, root_missing: bool = False) -> RestoreSource:
        """No checkpoint to restore, because of ``missing`` (``root_missing``: the root does not exist)."""
        return cls(missing=missing, root_missing=root_missing)


class Restorer:
    """One ``restore`` of a manager (collective): rank 0 finds and holds the checkpoint, every rank loads it.

    Made for each call from the manager's communicator, shared root,
    node-local tier (or None) and ``save_kwargs`` (a restored local copy
    newer than the shared root is promoted with them).
    """

    def __init__(self, comm: Communicator, root: Root, tiered: TieredSaves | None, save_kwargs: dict[str, Any]) -> None:
        self.comm, self._root, self.root = comm, root, root.target
        self._tiered = tiered
        self._save_kwargs = save_kwargs
        self._read_release: Callable[[], None] | None = None  # rank 0: the hold of the checkpoint being restored

    def restore(self, request: RestoreRequest) -> Restored:
        """``CheckpointManager.restore``, once its arguments are checked."""
        tiered = self._tiered
        replicated = tiered is not None and tiered.replicator is not None
        complete = tiered.complete() if tiered is not None and not replicated else frozenset()
        try:  # rank 0 holds the checkpoint it picked (retention leaves it alone) until the load ended
            what = f"finding the checkpoint to restore in {self.root}"
            found = decide_on_rank0(self.comm, what, lambda _none: self._find_held(request.step, request.finite))
            return self._restore_found(request, found, complete)
        finally:
            release, self._read_release = self._read_release, None
            if release is not None:
                release()

    def _restore_found(self, request: RestoreRequest, found: RestoreSource, complete: frozenset[int]) -> Restored:
        """``restore`` once rank 0 found the shared checkpoint: the local copy when it is as new, else that."""
        tiered = self._tiered
        step, shared_step = request.step, found.step
        if request.finite:  # the local copies were not checked: only that of the step rank 0 certified
            complete = frozenset(s for s in complete if s == shared_step)
        local_error: TddistError | None = None
        if tiered is not None and tiered.replicator is not None and not request.finite:
            from_copies, local_error = self._from_copies(request, shared_step)
            if from_copies is not None:
                return from_copies
        local = pick_local(complete, step, shared_step)
        if local is not None:
            assert tiered is not None  # pick_local picks from the complete local steps only
            try:
                restored = tiered.restore(request.state, local, request.load_kwargs)
            except CommError:
                raise
            except TddistError as e:  # the same on every rank: all of them go to the shared root
                local_error = e
                logger.warning("rank %d: %s; restoring from the shared root %s", self.comm.rank, e, self.root)
            else:
                self._log_restored(restored.path, restored.step, restored.report)
                if step is None and (shared_step is None or local > shared_step):
                    # its promotion never committed (a crash, a failure)
                    tiered.promote_restored(local, restored.layouts, self._save_kwargs)
                return Restored(restored.step, restored.path, restored.report, "local")
        if found.path is None:
            return self._nothing_to_restore(found, request, local_error)
        path, at = found.path, found.step
        assert at is not None  # found with its path

        def shared(into: Any) -> LoadReport:
            report = load(path, comm=self.comm, into=into, **request.load_kwargs)
            assert isinstance(report, LoadReport)  # load(into=...) returns its report
            return report

        report = fill(request.state, shared)
        self._log_restored(path, at, report)
        return Restored(at, path, report, "shared")

    def _from_copies(
        self, request: RestoreRequest, shared_step: int | None
    ) -> tuple[Restored | None, TddistError | None]:
        """With replication: restore from the own parts and replicas that survive; else None (the shared root)
        and the error that stopped it, if one did (raised if the shared root has nothing either)."""
        tiered = self._tiered
        assert tiered is not None
        try:
            got = tiered.restore_from_copies(request.state, request.step, shared_step, request.load_kwargs)
        except CommError:
            raise
        except TddistError as e:  # the same on every rank: all of them go to the shared root
            logger.warning("rank %d: %s; restoring from the shared root %s", self.comm.rank, e, self.root)
            return None, e
        if got is None:
            return None, None
        self._log_restored(got.path, got.step, got.report)
        if got.tier == "peers":
            logger.info("rank %d: step %d came from the node-local copies and peers' replicas, 0 bytes from %s",
                        self.comm.rank, got.step, self.root)  # fmt: skip
        if request.step is None and (shared_step is None or got.step > shared_step):
            if got.same_world:
                tiered.promote_restored(got.step, got.layouts, self._save_kwargs)
            elif self.comm.rank == 0:
                logger.warning("step %d (restored onto another world size) is not in %s; the next save promotes "
                               "a newer one", got.step, self.root)  # fmt: skip
        return Restored(got.step, got.path, got.report, got.tier), None

    def _nothing_to_restore(
        self, found: RestoreSource, request: RestoreRequest, local_error: TddistError | None
    ) -> Restored:
        """No shared checkpoint to load: raise what ``restore`` raises, or start from step 0."""
        if local_error is not None:
            raise local_error
        if request.step is not None:
            raise CheckpointNotFoundError(
                f"rank {self.comm.rank}: {found.missing}; restore(step={request.step}) has nothing to load"
            )
        if request.required:
            raise CheckpointNotFoundError(f"rank {self.comm.rank}: {found.missing}; nothing to restore (required=True)")
        if self.comm.rank == 0 and found.root_missing:
            logger.warning("%s; starting from step 0 (check the path if this job should resume)", found.missing)
        else:
            logger.info("%s: starting from step 0", found.missing)
        return Restored(0)

    def _log_restored(self, path: str, step: int, report: LoadReport) -> None:
        if report.skipped:
            logger.warning(
                "rank %d: restoring %s left out %s", self.comm.rank, path,
                "; ".join(f"{'/'.join(k)} ({why})" for k, why in list(report.skipped.items())[:10]),
            )  # fmt: skip
        logger.info("rank %d: resumed from %s (step %d)", self.comm.rank, path, step)

    def _find_held(self, step: int | None, finite: bool) -> RestoreSource:
        """Rank 0: ``find``, holding what it found (``retention.hold``) until ``restore`` ends.

        Held, then checked again: a checkpoint retention deleted between the
        two is looked for again, and once held no retention deletes it.
        """
        for _attempt in range(3):
            found = find(self._root, step, finite)
            if found.path is None:
                return found
            release = hold(found.path)
            if store_for(found.path).committed():
                self._read_release = release
                return found
            release()
        return found


def find(root: Root, step: int | None, finite: bool = False) -> RestoreSource:
    """Rank 0: the checkpoint under ``root`` to restore (that of ``step``, else the newest; with ``finite`` the
    newest without NaN or Inf values), or why there is none."""
    where = root.target
    if not root.exists():
        return RestoreSource.none(f"checkpoint root {where!r} does not exist", root_missing=True)
    if step is None:
        newest = newest_checkpoint(where, finite=finite)
        if newest is None:
            what = "committed checkpoint without NaN or Inf values" if finite else "committed checkpoint"
            return RestoreSource.none(f"no {what} in {where!r}")
        path, at = newest
        return RestoreSource.at(path, at)
    for s, path in step_entries(where):
        if s == step:
            try:
                manifest = read_manifest(path)
            except TddistError as e:
                return RestoreSource.none(f"the checkpoint of step {step} ({path}) is not committed or unreadable: {e}")
            return RestoreSource.at(path, int(manifest.metadata.get("step", step)))
    steps = sorted({s for s, _p in step_entries(where)})
    return RestoreSource.none(f"no checkpoint of step {step} in {where!r} (steps there: {steps[-10:]})")
