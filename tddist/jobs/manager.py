"""Checkpoints of a training job: numbered step directories, retention, resume, preemption.

``CheckpointManager`` keeps ``<root>/step-000001000``-style checkpoints (one
per saved step, the step also stored in the manifest's metadata), resumes
from the newest committed one and deletes old ones once a newer one is
committed. Rank 0 alone scans, cleans and deletes; it broadcasts what it
found, so every rank agrees on the checkpoint to resume from.

Preemption: the signal handler only sets a flag. At the next ``step()`` the
ranks exchange their flags (one small allgather), so a signal delivered to
any rank makes every rank save at the same step, wait for the save, and then
``should_stop`` is True. The training script exits with ``EXIT_PREEMPTED``.
See docs/jobs.md.

The signal handlers are in ``preemption.py``, how a user's state is
read and filled in ``train_state.py``, and the node-local tier (``local_dir``)
in ``tiered.py``; ``parse_signals`` is importable from here too.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from functools import partial
from typing import TYPE_CHECKING, Any, TypeVar

from ..api import load, save
from ..comm.base import Communicator
from ..comm.collective import decide_on_rank0
from ..comm.resolve import resolve
from ..errors import CheckpointNotFoundError, CommError, InvalidArgumentError, TddistError
from ..loading.share import LoadReport
from ..storage.backends import read_manifest, root_for, store_for
from . import root_lock
from .preemption import PreemptionSignals, parse_signals
from .retention import (
    METRICS_KEY,
    Retention,
    clean_root,
    committed_steps,
    delete_checkpoint,
    encode_metrics,
    hold,
    metric_value,
    newest_checkpoint,
    retire,
    step_entries,
    step_name,
    stored_metric,
    unless_read,
)
from .tiered import SharedRoot, TieredSaves, pick_local
from .train_state import data_to_save, fill

if TYPE_CHECKING:
    from types import TracebackType

logger = logging.getLogger(__name__)

R = TypeVar("R")

_RESERVED = frozenset({"return_early", "comm", "prefix", "data"})

#: Exit status of a training process that stopped because it was preempted
#: (``EX_TEMPFAIL``: "try again later"). Job scripts requeue on it.
EXIT_PREEMPTED = 75


def _check_count(name: str, value: object, allow_none: bool) -> None:
    if value is None and allow_none:
        return
    if type(value) is not int or value < 1:
        raise InvalidArgumentError(f"{name} must be a positive int{' or None' if allow_none else ''}, got {value!r}")


def _interval_seconds(minutes: object) -> float | None:
    """``save_interval_minutes`` in seconds (None: no time-based saves)."""
    if minutes is None:
        return None
    if isinstance(minutes, bool) or not isinstance(minutes, (int, float)) or not minutes > 0:
        raise InvalidArgumentError(f"save_interval_minutes must be a positive number or None, got {minutes!r}")
    return float(minutes) * 60.0


def _check_local_dir(local_dir: str | os.PathLike) -> None:
    """The node-local tier is a directory on each node's own file system: refuse anything else (``s3://``)."""
    try:
        local = root_for(local_dir).local
    except InvalidArgumentError:
        local = False
    if not local:
        raise InvalidArgumentError(
            f"local_dir={os.fspath(local_dir)!r}: the node-local tier needs a directory on each node's own file "
            f"system (a tmpfs, a local disk); object storage can only be the root"
        )


def _clock() -> float:
    """The clock of time-based saves (rank 0's decides)."""
    return time.monotonic()


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
            ``"local"`` (the node-local copy, see ``local_dir``), or None
            when nothing was restored.
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
class InFlight:
    """The asynchronous save a manager has in flight, and the retention that follows it."""

    step: int
    future: Future
    started: float  # time.monotonic() when the save began, for the log
    retained: threading.Event  # set once retention after the save ran, or was skipped because the save failed


@dataclass(frozen=True)
class StepVote:
    """What each rank tells the others at every ``step()`` (one allgather).

    Attributes:
        preempt: a preemption was requested on this rank.
        promotion_done: this rank's promotion in flight has ended (committed or failed);
            once it has on every rank, every rank takes its outcome at the same step.
        time_due: ``save_interval_minutes`` have passed since this rank's last save
            (only rank 0's counts, so every rank saves at the same step).
    """

    preempt: bool
    promotion_done: bool
    time_due: bool = False


@dataclass(frozen=True)
class _Decision:
    """What the ranks decided for one step (``should_save``), kept for the ``step()`` that follows it."""

    step: int
    save: bool
    preempt: bool


@dataclass(frozen=True)
class _RestoreSource:
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
    def at(cls, path: str, step: int) -> _RestoreSource:
        """The checkpoint at ``path``, of ``step``."""
        return cls(path=path, step=step)

    @classmethod
    def none(cls, missing: str, root_missing: bool = False) -> _RestoreSource:
        """No checkpoint to restore, because of ``missing`` (``root_missing``: the root does not exist)."""
        return cls(missing=missing, root_missing=root_missing)


class CheckpointManager:
    """Step checkpoints under ``root`` for a training loop, on every rank of ``comm``.

    Creating it is collective: rank 0 removes leftovers of crashed saves. Then::

        mgr = CheckpointManager("ckpt/run", every=100)
        for s in range(mgr.restore(state), total):
            train(s)
            mgr.step(s + 1, state)
            if mgr.should_stop:
                sys.exit(EXIT_PREEMPTED)

    ``state`` is a TensorDict or nested dict (filled in place on restore), a
    ``(model, optimizer)`` pair, or a mapping of objects such as ``{"model":
    model, "optim": optim, "sched": scheduler, "loader": loader}`` (modules,
    optimizers and any object with ``state_dict()``/``load_state_dict()``,
    through ``get_state``/``set_state``), or a callable returning one of
    these; the state is gathered only on steps that save.

    ``root`` is a directory or ``s3://bucket/prefix`` (docs/object_storage.md):
    the step checkpoints are saved, listed, restored and retired there
    through the storage ``tddist.storage.backends.root_for`` chooses. Creating
    the manager takes the root's lock (rank 0, held until ``close()`` or the
    process exits): on a file system an ``fcntl.flock`` on a file in it; on
    object storage a lease object, renewed while held and taken over once a
    crashed job has not renewed it for a minute. A second live job on the same
    root is refused on every rank with ``RootLockedError``. A root that does not
    exist yet is not created before the first save.

    Retention (docs/jobs.md, "Retention"): ``keep_last`` newest, ``keep_best``
    best by ``metric`` (the ``metrics=`` given at each save, stored in the
    manifest's metadata), every step divisible by ``keep_period``. A committed
    checkpoint is deleted only when at least one of these is set and none of
    them keeps it; the newest committed one, the one just saved and one that a
    restore of this process is reading are never deleted.

    When to save: ``every`` steps, ``save_interval_minutes`` after the last save
    (rank 0's clock decides, so every rank saves at the same step), on
    preemption, and on ``save()``. ``async_save`` saves with
    ``return_early=True``; the next save, ``wait()`` and preemption wait for it.
    ``preempt_signal``: one signal, several, or None. ``save_kwargs`` go to
    ``tddist.save`` (``metadata`` is merged with the step and the metrics).

    ``local_dir`` adds a node-local tier (docs/jobs.md, "Node-local tier"):
    each save first commits every rank's shard to fast storage of its own
    node, as the one-rank checkpoint ``<local_dir>/step-<step>/rank-<r>-of-<world>``
    (``{rank}`` in ``local_dir`` is replaced by the rank), and returns once
    every rank's part is committed; then it is promoted to ``root`` in the
    background, by a collective ``tddist.save`` of the data mapped back from
    the local copy (the shared checkpoint commits whole, or not at all).
    ``restore`` loads each rank's own part when every rank holds its part of
    the newest step for the same world size, and the shared root otherwise.
    A failed promotion keeps the local copy and raises, on every rank, from
    the next ``step()``, ``save()``, ``wait()`` or ``close()``; a ``restore``
    from a local copy newer than the shared root's newest promotes it again.
    The newest complete local copy is kept, and older ones until a promotion
    of them or of a newer step has committed.

    Args:
        root: the directory (created by the first save) or ``s3://bucket/prefix``
            holding the step checkpoints.
        keep_last: keep the ``keep_last`` newest committed checkpoints (None: no
            such rule; with no rule at all, every checkpoint is kept).
        every: save when ``step % every == 0`` (None: no step interval).
        async_save: save with ``return_early=True``, so training continues while
            a background thread writes and commits.
        comm: a torch ProcessGroup, an mpi4py communicator or a tddist
            ``Communicator`` (None: detected as ``tddist.save`` does).
        preempt_signal: the signal(s) that request a preemption: a signal, a
            name ("USR1", "SIGTERM"), a comma-separated string, a list, or None.
        save_kwargs: keyword arguments of every ``tddist.save``; ``data``,
            ``prefix``, ``comm`` and ``return_early`` are the manager's.
        local_dir: node-local storage for the local tier (a directory, created
            when needed; ``{rank}`` is replaced by the rank), or None (save to
            ``root`` only). Each node may have its own: no rank reads another
            rank's local files. Not with ``async_save`` (promotions already run
            in the background).
        keep_best: keep the ``keep_best`` best checkpoints by ``metric`` (None: no such rule).
        metric: the name of the metric ``keep_best`` ranks by; each save passes
            its value as ``metrics={metric: value}``.
        mode: ``"min"`` (the smallest value is the best, as for a loss) or ``"max"``.
        keep_period: keep every step divisible by ``keep_period`` forever (None: no such rule).
        save_interval_minutes: also save when this many minutes have passed
            since the last save (or since the manager was created); None: never by time.

    Attributes:
        should_stop: True once a requested preemption has been saved; the
            training loop then exits with ``EXIT_PREEMPTED``.
        retention: the retention rules (``tddist.jobs.retention.Retention``).

    Raises:
        InvalidArgumentError: an invalid ``keep_last``, ``every``, ``keep_best``,
            ``metric``, ``mode``, ``keep_period``, ``save_interval_minutes``,
            ``preempt_signal``, ``save_kwargs`` or ``local_dir``, or a
            ``save_kwargs`` option the root's storage cannot honour.
        RootLockedError: another live job holds ``root`` (on every rank; the
            message names its host and pid).
        TddistError: rank 0 could not clean up ``root`` (the same error on
            every rank, a ``CollectiveError`` for an ``OSError``), or a
            ``CommError`` when the ranks cannot reach each other.
    """

    def __init__(
        self,
        root: str | os.PathLike,
        *,
        keep_last: int | None = 3,
        every: int | None = None,
        async_save: bool = False,
        comm: Any = None,
        preempt_signal: Any = signal.SIGUSR1,
        save_kwargs: dict[str, Any] | None = None,
        local_dir: str | os.PathLike | None = None,
        keep_best: int | None = None,
        metric: str | None = None,
        mode: str = "min",
        keep_period: int | None = None,
        save_interval_minutes: float | None = None,
    ) -> None:
        _check_count("every", every, allow_none=True)
        self.retention = Retention(keep_last, keep_best, metric, mode, keep_period)
        self._interval = _interval_seconds(save_interval_minutes)
        if local_dir is not None:
            _check_local_dir(local_dir)
        if local_dir is not None and async_save:
            raise InvalidArgumentError(
                "async_save=True with local_dir: the local tier already promotes to the root in the background; "
                "pass one of them"
            )
        self.save_kwargs = dict(save_kwargs or {})
        bad = _RESERVED & set(self.save_kwargs)
        if bad:
            raise InvalidArgumentError(f"save_kwargs may not set {sorted(bad)}: the manager sets them")
        self._root = root_for(root)
        self.root = self._root.target
        self._check_storage()
        self.keep_last, self.every, self.async_save = keep_last, every, bool(async_save)
        self.comm = resolve(comm, self.save_kwargs.get("timeout"))
        self.should_stop = False
        self._requested = False
        self._pending: InFlight | None = None
        self._locked = False
        self._decided: _Decision | None = None
        self._last_save = _clock()
        self._metrics: dict[str, float | None] = {}  # rank 0: a checkpoint's value of the metric, by path
        self._unranked_warned = False
        self._read_release: Callable[[], None] | None = None  # rank 0: the hold of the checkpoint being restored
        self._tiered = (
            None
            if local_dir is None
            else TieredSaves(self.comm, local_dir, SharedRoot(self.root, self.path, self._prepare_root, self._retain))
        )
        self._signals = PreemptionSignals(parse_signals(preempt_signal), self.request_preemption)
        try:
            done = self._on_rank0("lock and clean-up of " + self.root, self._lock_and_clean)
        except BaseException:
            self._signals.uninstall()
            raise
        self._locked = done is not None
        if done and self.comm.rank == 0:
            logger.info("cleaned %s: %s", self.root, "; ".join(done))

    def _check_storage(self) -> None:
        """Refuse, before any collective, ``save_kwargs`` that the root's storage cannot honour (every rank)."""
        kwargs = self.save_kwargs
        try:
            store_for(self.path(0)).check_save(
                atomic=bool(kwargs.get("atomic", True)),
                archive=kwargs.get("archive"),
                snapshot_budget=kwargs.get("snapshot_budget"),
                async_writer=kwargs.get("async_writer", "thread"),
            )
        except InvalidArgumentError as e:
            raise InvalidArgumentError(f"save_kwargs of a manager of {self.root!r}: {e}") from None

    def _lock_and_clean(self) -> list[str] | None:
        """Rank 0: lock an existing root and clean it (None: the root does not exist, nothing was done)."""
        if not self._root.exists():
            return None
        root_lock.acquire(self.root)
        try:
            return clean_root(self.root)
        except BaseException:
            root_lock.release(self.root)
            raise

    def _ensure_root(self) -> None:
        """Before the first save into a root that did not exist: create it and take its lock (collective)."""
        if self._locked:
            return

        def make() -> None:
            self._root.create()
            root_lock.acquire(self.root)

        self._on_rank0("creating and locking " + self.root, make)
        self._locked = True

    # --- where checkpoints are -----------------------------------------------------

    def path(self, step: int) -> str:
        """Where the checkpoint of ``step`` is (or would be) saved.

        Args:
            step: the training step.

        Returns:
            ``<root>/step-<step, 9 digits>``, with ``.tdz`` when ``save_kwargs``
            ask for an archive.
        """
        archive = bool(self.save_kwargs.get("archive") or self.save_kwargs.get("compression"))
        return self._root.join(step_name(step, archive))

    def latest(self) -> str | None:
        """The newest committed checkpoint, the same on every rank (collective), or None.

        Rank 0 looks and broadcasts its answer, so every rank resumes from the
        same checkpoint; staging leftovers, torn directories and unreadable
        manifests are skipped.

        Returns:
            The checkpoint's path, or None if ``root`` holds none.
        """
        found = self._latest()
        return found[0] if found else None

    def _latest(self) -> tuple[str, int] | None:
        return self._on_rank0("finding the latest checkpoint in " + self.root, lambda: newest_checkpoint(self.root))

    def all_steps(self) -> list[int]:
        """The steps of the committed checkpoints under ``root``, in increasing order (collective).

        Rank 0 lists the root and broadcasts, so every rank gets the same list.
        A checkpoint counts once its commit point exists (its manifest is not
        validated here; ``latest()`` and ``restore`` skip a damaged one).
        Retention applies after each save, so the list holds what it keeps.

        Returns:
            The steps, each once, smallest first; empty when there is none.
        """
        return self._on_rank0(
            "listing the checkpoints in " + self.root, lambda: sorted({s for s, _p in committed_steps(self.root)})
        )

    # --- training loop -----------------------------------------------------------------

    def restore(self, state: Any, *, step: int | None = None, required: bool = False, **load_kwargs: Any) -> Restored:
        """Load the newest checkpoint (or that of ``step``) into ``state``. Collective.

        Args:
            state: as in the class docstring: a TensorDict or nested dict,
                filled in place (``tddist.load(path, into=state)``), a
                ``(model, optimizer)`` pair, a mapping of objects, or a
                callable returning one of these.
            step: load the checkpoint of this step instead of the newest.
            required: raise instead of starting from step 0 when there is
                nothing to restore.
            **load_kwargs: passed to ``tddist.load`` (``strict``, ``verify``,
                ``keys``, ``exclude``, ``per_rank``, ...).

        With ``local_dir``, the ranks first agree (one allgather) on the steps
        of which every rank holds its local part for this world size; if the
        newest of them (or ``step``) is at least as new as the newest shared
        checkpoint, every rank loads its own part and ``tier`` is "local".
        If a rank cannot load its part, every rank loads from the shared root.
        A local copy newer than every shared checkpoint (its promotion failed
        or was cut off) is then promoted in the background, as a save would.

        Returns:
            A ``Restored``: an int equal to the step of the checkpoint loaded
            (0 if there is none), with its ``path``, the load's ``report``
            (what was loaded, skipped, missing or unexpected) and the ``tier``
            it came from.

        Raises:
            CheckpointNotFoundError: ``required`` and nothing to restore, or no
                committed checkpoint of ``step`` (on every rank).
            IncompatibleCheckpointError: ``state`` does not match the checkpoint,
                or per-rank state saved on another world size without ``per_rank=``.
            CorruptCheckpointError: a data file is missing, truncated or fails its checksum.
            InvalidArgumentError: an invalid keyword argument of ``tddist.load``.
            CommError: a rank could not be reached.
        """
        if step is not None:
            _check_step(step)
        tiered = self._tiered
        complete = tiered.complete() if tiered is not None else frozenset()
        try:  # rank 0 holds the checkpoint it picked (retention leaves it alone) until the load ended
            found = self._on_rank0(f"finding the checkpoint to restore in {self.root}", lambda: self._find_held(step))
            return self._restore_found(state, step, required, found, complete, load_kwargs)
        finally:
            release, self._read_release = self._read_release, None
            if release is not None:
                release()

    def _restore_found(
        self,
        state: Any,
        step: int | None,
        required: bool,
        found: _RestoreSource,
        complete: frozenset[int],
        load_kwargs: dict[str, Any],
    ) -> Restored:
        """``restore`` once rank 0 found the shared checkpoint: the local copy when it is as new, else that."""
        tiered = self._tiered
        shared_step = found.step
        local = pick_local(complete, step, shared_step)
        local_error: TddistError | None = None
        if local is not None:
            assert tiered is not None  # pick_local picks from the complete local steps only
            try:
                restored = tiered.restore(state, local, load_kwargs)
            except CommError:
                raise
            except TddistError as e:  # the same on every rank: all of them go to the shared root
                local_error = e
                logger.warning("rank %d: %s; restoring from the shared root %s", self.comm.rank, e, self.root)
            else:
                self._log_restored(restored.path, restored.step, restored.report)
                if step is None and (shared_step is None or local > shared_step):
                    # its promotion never committed (a crash, a failure)
                    tiered.promote_restored(local, restored.layouts, self.save_kwargs)
                return Restored(restored.step, restored.path, restored.report, "local")
        if found.path is None:
            return self._nothing_to_restore(found, step, required, local_error)
        path, at = found.path, found.step
        assert at is not None  # found with its path

        def shared(into: Any) -> LoadReport:
            report = load(path, comm=self.comm, into=into, **load_kwargs)
            assert isinstance(report, LoadReport)  # load(into=...) returns its report
            return report

        report = fill(state, shared)
        self._log_restored(path, at, report)
        return Restored(at, path, report, "shared")

    def _nothing_to_restore(
        self, found: _RestoreSource, step: int | None, required: bool, local_error: TddistError | None
    ) -> Restored:
        """No shared checkpoint to load: raise what ``restore`` raises, or start from step 0."""
        if local_error is not None:
            raise local_error
        if step is not None:
            raise CheckpointNotFoundError(
                f"rank {self.comm.rank}: {found.missing}; restore(step={step}) has nothing to load"
            )
        if required:
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

    def _find_held(self, step: int | None) -> _RestoreSource:
        """Rank 0: ``_find``, holding what it found (``retention.hold``) until ``restore`` ends.

        Held, then checked again: a checkpoint retention deleted between the
        two is looked for again, and once held no retention deletes it.
        """
        for _attempt in range(3):
            found = self._find(step)
            if found.path is None:
                return found
            release = hold(found.path)
            if store_for(found.path).committed():
                self._read_release = release
                return found
            release()
        return found

    def _find(self, step: int | None) -> _RestoreSource:
        """Rank 0: the checkpoint to restore (that of ``step``, else the newest), or why there is none."""
        if not self._root.exists():
            return _RestoreSource.none(f"checkpoint root {self.root!r} does not exist", root_missing=True)
        if step is None:
            newest = newest_checkpoint(self.root)
            if newest is None:
                return _RestoreSource.none(f"no committed checkpoint in {self.root!r}")
            path, at = newest
            return _RestoreSource.at(path, at)
        for s, path in step_entries(self.root):
            if s == step:
                try:
                    manifest = read_manifest(path)
                except TddistError as e:
                    return _RestoreSource.none(
                        f"the checkpoint of step {step} ({path}) is not committed or unreadable: {e}"
                    )
                return _RestoreSource.at(path, int(manifest.metadata.get("step", step)))
        steps = sorted({s for s, _p in step_entries(self.root)})
        return _RestoreSource.none(f"no checkpoint of step {step} in {self.root!r} (steps there: {steps[-10:]})")

    def should_save(self, step: int) -> bool:
        """Whether the manager saves at ``step``: the ranks' decision, the same on every rank. Collective.

        A save is due when ``step % every == 0``, when ``save_interval_minutes``
        have passed since the last save by rank 0's clock, or when a preemption
        was requested on any rank. The ranks exchange their preemption flags and
        rank 0's clock (one small allgather, the one ``step()`` runs), so every
        rank must call it at the same point. It saves nothing: the ``step()`` of
        the same step that follows takes this decision (without exchanging
        again), so a loop can compute what only a saving step needs::

            if mgr.should_save(s):
                metrics = {"val_loss": evaluate(model)}
            mgr.step(s, state, metrics=metrics)

        Args:
            step: the number of training steps done.

        Returns:
            Whether ``step(step, ...)`` will save.

        Raises:
            InvalidArgumentError: ``step`` is not a non-negative int.
            TddistError: a promotion of the node-local tier failed (on every rank).
        """
        _check_step(step)
        return self._decide(step).save

    def _decide(self, step: int) -> _Decision:
        """The ranks' decision for ``step`` (one allgather), or the one ``should_save`` already took for it."""
        decided = self._decided
        if decided is not None and decided.step == step:
            return decided
        if self._tiered is None:
            self._retire_finished()
        done = self._tiered.promotion_done() if self._tiered is not None else False
        timed = self._interval is not None and _clock() - self._last_save >= self._interval
        votes: list[StepVote] = self.comm.allgather(StepVote(self._requested, done, timed))
        preempt = any(v.preempt for v in votes)
        if self._tiered is not None and all(v.promotion_done for v in votes):
            self.wait()  # every rank takes the promotion's outcome (its error, too) at the same step
        due = preempt or votes[0].time_due or (self.every is not None and step % self.every == 0)
        self._decided = _Decision(step, due, preempt)
        return self._decided

    def step(self, step: int, state: Any, *, metrics: dict[str, Any] | None = None) -> bool:
        """Call after each training step (collective): save if due or preempted; True if it saved.

        After a preemption request on any rank, every rank saves this step and
        waits for it, and ``should_stop`` becomes True. When to save is
        ``should_save(step)``'s decision (taken here unless it was just taken).

        Args:
            step: the number of training steps done.
            state: what to save, as in ``restore``.
            metrics: the metrics of this step, stored with its checkpoint if it
                saves (see ``save``).

        Returns:
            Whether a save was started (and, with a preemption, completed).

        Raises:
            InvalidArgumentError: ``step`` is not a non-negative int, or invalid ``metrics``.
            TddistError: the save failed (the same error on every rank; see ``tddist.save``).
        """
        _check_step(step)
        decision = self._decide(step)
        self._decided = None
        if decision.save:
            self.save(step, state, metrics=metrics)  # a callable state is called (the TensorDict built) only here
        if decision.preempt:
            self._requested = False
            self.wait()
            self.should_stop = True
            logger.warning("rank %d: preemption requested; saved step %d, stopping", self.comm.rank, step)
        return decision.save

    def save(self, step: int, state: Any, *, metrics: dict[str, Any] | None = None) -> None:
        """Save ``state`` as the checkpoint of ``step`` now (collective), after any save in flight.

        Retention runs once it is committed (for an asynchronous save, on the
        save's background thread right after it; ``wait()`` waits for both). With ``local_dir`` it
        returns once every rank's local part is committed, and the promotion
        to ``root`` runs in the background.

        Args:
            step: the training step, stored in the checkpoint's metadata.
            state: what to save, as in ``restore``.
            metrics: name -> real number (``{"val_loss": 0.31}``), stored in the
                checkpoint's metadata under ``"metrics"`` (rank 0's values; pass
                the same on every rank). ``keep_best`` ranks checkpoints by
                ``metrics[metric]`` as stored, so retention after a restart
                reads it back from the root.

        Raises:
            InvalidArgumentError: ``step`` is not a non-negative int, or ``metrics`` are not numbers.
            TddistError: this save or the one in flight failed (the same error
                on every rank; see ``tddist.save``).
        """
        _check_step(step)
        encoded = encode_metrics(metrics)
        self.wait()
        if self._tiered is None:
            self._ensure_root()  # with the local tier, the promotion creates it (and fails, not the save)
        data = data_to_save(state)
        kwargs = dict(self.save_kwargs)
        metadata = {**(kwargs.pop("metadata", None) or {}), "step": step}
        if encoded:
            metadata[METRICS_KEY] = encoded
        path, start = self.path(step), time.monotonic()
        self._last_save = _clock()
        self._note_metric(step, path, metadata)
        if self._tiered is not None:
            self._tiered.save(step, data, metadata, kwargs, start)
            return
        if self.async_save:
            fut = save(data, path, comm=self.comm, return_early=True, metadata=metadata, **kwargs)
            self._pending = InFlight(step, fut, start, threading.Event())
            fut.add_done_callback(partial(self._retain_after, self._pending))
            return
        save(data, path, comm=self.comm, metadata=metadata, **kwargs)
        logger.info("rank %d: saved step %d in %.2fs", self.comm.rank, step, time.monotonic() - start)
        self._retain(step)

    def _note_metric(self, step: int, path: str, metadata: dict[str, Any]) -> None:
        """(rank 0) Remember the saved value of ``keep_best``'s metric, so retention need not read it back."""
        metric = self.retention.metric
        if metric is None or self.comm.rank != 0:
            return
        value = metric_value(metadata, metric)
        self._metrics[store_for(path).target] = value
        if value is None and not self._unranked_warned:
            self._unranked_warned = True
            logger.warning(
                "step %d was saved without metrics[%r]: keep_best does not rank it (only keep_last, keep_period "
                "and being the newest keep it); pass metrics={%r: value} to step() or save()",
                step, metric, metric,
            )  # fmt: skip

    def _metric_of(self, path: str) -> float | None:
        """(rank 0) A checkpoint's value of the metric: as saved by this manager, else read from its manifest."""
        target = store_for(path).target
        if target not in self._metrics:
            self._metrics[target] = stored_metric(path, self.retention.metric)
        return self._metrics[target]

    def _prepare_root(self, comm: Communicator) -> None:
        """(promotion worker, on every rank) Create and lock the root before the first promotion into it."""
        if self._locked:
            return

        def make(_none: object) -> None:
            self._root.create()
            root_lock.acquire(self.root)

        decide_on_rank0(comm, "creating and locking " + self.root, make)
        self._locked = True

    def wait(self) -> None:
        """Wait for the save in flight, if any, and the retention after it; raise its error (the same on every rank).

        With ``local_dir``: wait for the promotion in flight (collective: the
        ranks agree on its outcome).

        Raises:
            TddistError: the save in flight failed (see ``tddist.save``); a
                failed promotion names its step, and its local copy is kept.
        """
        if self._tiered is not None:
            self._tiered.wait()
            return
        pending, self._pending = self._pending, None
        if pending is None:
            return
        try:
            pending.future.result()
        finally:
            pending.retained.wait()  # the save's worker applies retention once the save resolved
        took = time.monotonic() - pending.started
        logger.info("rank %d: saved step %d %.2fs after it started", self.comm.rank, pending.step, took)

    def request_preemption(self) -> None:
        """Ask the ranks to save and stop at the next ``step()``, as the preemption signal does."""
        self._requested = True

    def close(self) -> None:
        """Wait for the save in flight and restore the previous signal handlers.

        The handlers are restored even if the save failed.

        Raises:
            TddistError: the save in flight failed (see ``tddist.save``).
        """
        try:
            self.wait()
        finally:
            self._signals.uninstall()
            self._unlock()

    def _unlock(self) -> None:
        if self._locked and self.comm.rank == 0:
            root_lock.release(self.root)
        self._locked = False

    def __enter__(self) -> CheckpointManager:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        if exc_type is None:
            self.close()
        else:  # an in-flight save still completes (and keeps the lock): the interpreter waits for it at exit
            self._signals.uninstall()

    # --- internals ---------------------------------------------------------------------

    def _retain_after(self, pending: InFlight, future: Future) -> None:
        """(the save's worker thread, once its future resolved) Apply retention after a successful save.

        There and not at the next ``step()``: deleting old checkpoints is
        rank 0's file-system work (tens of milliseconds per 64 MiB file on a
        file system that discards freed blocks at once), which would stall
        rank 0's training step and, at the next collective, every rank. A
        future already resolved when the manager adds this runs it at once.
        """
        try:
            if not future.cancelled() and future.exception() is None:
                self._retain(pending.step)
        finally:
            pending.retained.set()

    def _retire_finished(self) -> None:
        """Forget a background save that succeeded and whose retention is done (its errors wait for
        ``wait()``; a retention still running is not waited for)."""
        p = self._pending
        if p is not None and p.retained.is_set() and p.future.exception() is None:
            self.wait()

    def _retain(self, newest: int) -> None:
        """Rank 0: delete the committed checkpoints no retention rule keeps (never ``newest``, the newest
        committed one, or one a restore of this process is reading)."""
        if not self.retention.active or self.comm.rank != 0:
            return
        try:
            doomed = retire(self.root, self.retention, keep=(newest,), metric_of=self._metric_of)
        except (OSError, TddistError) as e:
            logger.warning("could not apply retention to %s: %s", self.root, e)
            return
        for _step, p in doomed:
            try:
                with unless_read(p) as free:
                    if free:
                        delete_checkpoint(p)
                        self._metrics.pop(store_for(p).target, None)
                    else:
                        logger.info("kept %s for now: a restore is reading it", p)
            except (OSError, TddistError) as e:
                logger.warning("could not delete old checkpoint %s: %s", p, e)

    def _on_rank0(self, what: str, fn: Callable[[], R]) -> R:
        """Run ``fn`` on rank 0 and broadcast its result, or raise its error on every rank."""
        return decide_on_rank0(self.comm, what, lambda _none: fn())


def _check_step(step: object) -> None:
    if type(step) is not int or step < 0:
        raise InvalidArgumentError(f"step must be a non-negative int, got {step!r}")
