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
in ``tiered.py``; ``parse_signals`` is importable from here too. The
constructor's options are checked in ``options.py``, when to save is
``schedule.py``'s decision, what ``restore`` runs is in ``restore.py`` (with
``Restored``, importable from here too), and the retention after a save in
``root_retention.py``. This module keeps the manager's own state, its lock
of the root and the order of its collectives.
"""

from __future__ import annotations

import logging
import os
import signal
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, TypeVar

from ..comm.base import Communicator
from ..comm.collective import decide_on_rank0
from ..comm.resolve import resolve
from ..errors import InvalidArgumentError
from . import root_lock
from .options import ManagerOptions, check_options, step_path
from .preemption import PreemptionSignals, parse_signals
from .restore import Restored, Restorer, RestoreRequest
from .retention import METRICS_KEY, clean_root, committed_steps, encode_metrics, newest_checkpoint
from .root_retention import RootRetention
from .root_saves import RootSaves
from .schedule import Decision, SaveSchedule, StepVote
from .tiered import Replication, SharedRoot, TieredSaves
from .train_state import data_to_save, state_of

if TYPE_CHECKING:
    from types import TracebackType

__all__ = ["EXIT_PREEMPTED", "CheckpointManager", "Restored", "parse_signals"]

logger = logging.getLogger(__name__)

R = TypeVar("R")

#: Exit status of a training process that stopped because it was preempted
#: (``EX_TEMPFAIL``: "try again later"). Job scripts requeue on it.
EXIT_PREEMPTED = 75


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

    ``restore="finite"``: ``restore`` (without ``step``) skips the checkpoints
    whose floating-point leaves hold NaN or Inf values, as counted when they
    were saved (format version 4; older checkpoints were not counted and are
    taken as they are), so a diverged run resumes from its last healthy
    state; a node-local copy is then used only for the step it picked.

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
            a background thread writes and commits. ``"deferred"``: also copy
            the state in the background (``snapshot="deferred"``), guarded by
            the state's optimizers: their next ``step()`` waits for the copy
            (a model pair or a mapping of objects; a TensorDict is guarded by
            the optimizers ``get_state`` saw that change it; another state gets
            no guard, so call ``wait_snapshot()`` before changing it).
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
        replicas: with ``local_dir``, 1 copies each rank's local part to a rank
            on another node after each save, in the background, and ``restore``
            resumes from the surviving copies (own parts and peers' replicas)
            when a node was lost (docs/jobs.md, "Replicated node-local tier"); 0: no replicas.
        node: this rank's node, as a name (ranks with the same name share a
            node); None: ``TDDIST_NODE``, torchrun's ``GROUP_RANK``, ``SLURM_NODEID``,
            the MPI processor name, else the host name.
        restore: "newest" (the default) or "finite": ``restore`` skips
            checkpoints that hold NaN or Inf values.
        incremental: each save references the chunks it shares with the
            newest committed checkpoint instead of writing them
            (``tddist.save(..., base=...)``); retention keeps every checkpoint
            that a kept one references. Not with ``local_dir``.

    Attributes:
        should_stop: True once a requested preemption has been saved; the
            training loop then exits with ``EXIT_PREEMPTED``.
        retention: the retention rules (``tddist.jobs.retention.Retention``).

    Raises:
        InvalidArgumentError: an invalid ``keep_last``, ``every``, ``keep_best``,
            ``metric``, ``mode``, ``keep_period``, ``save_interval_minutes``,
            ``preempt_signal``, ``save_kwargs``, ``local_dir``, ``replicas`` or ``node``, or a
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
        async_save: bool | str = False,
        comm: Any = None,
        preempt_signal: Any = signal.SIGUSR1,
        save_kwargs: dict[str, Any] | None = None,
        local_dir: str | os.PathLike | None = None,
        keep_best: int | None = None,
        metric: str | None = None,
        mode: str = "min",
        keep_period: int | None = None,
        save_interval_minutes: float | None = None,
        replicas: int = 0,
        node: str | None = None,
        restore: str = "newest",
        incremental: bool = False,
    ) -> None:
        options = check_options(
            root,
            keep_last=keep_last,
            every=every,
            async_save=async_save,
            save_kwargs=save_kwargs,
            local_dir=local_dir,
            keep_best=keep_best,
            metric=metric,
            mode=mode,
            keep_period=keep_period,
            save_interval_minutes=save_interval_minutes,
            replicas=replicas,
            node=node,
            restore=restore,
            incremental=incremental,
        )
        self.retention, self._restore_finite = options.retention, options.restore_finite
        self.save_kwargs, self._root = options.save_kwargs, options.root
        self.root = self._root.target
        self.keep_last, self.every, self.async_save = options.keep_last, options.every, options.async_save
        self.comm = resolve(comm, self.save_kwargs.get("timeout"))
        self.should_stop, self._requested = False, False
        self._locked = False
        self._schedule = SaveSchedule(options.interval)
        self._root_retention = RootRetention(self.root, self.comm.rank)
        self._direct = RootSaves(self.comm, self.root, self._retain, async_save=bool(options.async_save),
                                 deferred=options.deferred, incremental=options.incremental)  # fmt: skip
        self._tiered = self._make_tiered(options)
        self._signals = PreemptionSignals(parse_signals(preempt_signal), self.request_preemption)
        try:
            done = self._on_rank0("lock and clean-up of " + self.root, self._lock_and_clean)
        except BaseException:
            self._signals.uninstall()
            raise
        self._locked = done is not None
        if done and self.comm.rank == 0:
            logger.info("cleaned %s: %s", self.root, "; ".join(done))

    def _make_tiered(self, options: ManagerOptions) -> TieredSaves | None:
        """The node-local tier of ``local_dir`` (with its replication), or None without one."""
        if options.local_dir is None:
            return None
        shared = SharedRoot(self.root, self.path, self._prepare_root, self._retain)
        return TieredSaves(self.comm, options.local_dir, shared, Replication(options.replicas, options.node))

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
        self._prepare_root(self.comm)

    # --- where checkpoints are -----------------------------------------------------

    def path(self, step: int) -> str:
        """Where the checkpoint of ``step`` is (or would be) saved.

        Args:
            step: the training step.

        Returns:
            ``<root>/step-<step, 9 digits>``, with ``.tdz`` when ``save_kwargs``
            ask for an archive.
        """
        return step_path(self._root, self.save_kwargs, step)

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
            CorruptCheckpointError: a data file is missing, truncated or fails its checksum;
                or, with replicas, the node-local copies failed their checksums after the
                state was filled from them, and the shared root has nothing to restore.
            InvalidArgumentError: an invalid keyword argument of ``tddist.load``.
            CommError: a rank could not be reached.
        """
        if step is not None:
            _check_step(step)
        restorer = Restorer(self.comm, self._root, self._tiered, self.save_kwargs)
        return restorer.restore(RestoreRequest(state, step, required, load_kwargs, self._restore_finite))

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

    def _decide(self, step: int) -> Decision:
        """The ranks' decision for ``step`` (one allgather), or the one ``should_save`` already took for it."""
        decided = self._schedule.decided(step)
        if decided is not None:
            return decided
        if self._tiered is None:
            self._direct.retire_finished()
        done = self._tiered.promotion_done() if self._tiered is not None else False
        votes: list[StepVote] = self.comm.allgather(self._schedule.vote(self._requested, done))
        if self._tiered is not None and all(v.promotion_done for v in votes):
            self.wait()  # every rank takes the promotion's outcome (its error, too) at the same step
        return self._schedule.decide(step, votes, self.every)

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
        self._schedule.clear()
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
        state = state_of(state)  # a callable state is called once
        data = data_to_save(state)
        kwargs = dict(self.save_kwargs)
        metadata = {**(kwargs.pop("metadata", None) or {}), "step": step}
        if encoded:
            metadata[METRICS_KEY] = encoded
        path, start = self.path(step), time.monotonic()
        self._schedule.saved()
        self._root_retention.note_metric(step, path, metadata, self.retention.metric)
        if self._tiered is not None:
            self._tiered.save(step, data, metadata, kwargs, start)
            return
        self._direct.save(step, path, data, state, metadata, kwargs, start)

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
        else:
            self._direct.wait()

    def wait_snapshot(self) -> None:
        """Wait until the save in flight has copied the state (``async_save="deferred"``), not for its commit.

        The state's optimizers already wait for the copy in their ``step()``;
        call this before changing the state any other way. Returns at once when
        no save is in flight or its state was copied before ``save`` returned.
        """
        self._direct.wait_snapshot()

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

    def _retain(self, newest: int) -> None:
        """Rank 0: apply the retention rules after the save of ``newest`` (``root_retention.RootRetention``)."""
        self._root_retention.retain(newest, self.retention)

    def _on_rank0(self, what: str, fn: Callable[[], R]) -> R:
        """Run ``fn`` on rank 0 and broadcast its result, or raise its error on every rank."""
        return decide_on_rank0(self.comm, what, lambda _none: fn())


def _check_step(step: object) -> None:
    if type(step) is not int or step < 0:
        raise InvalidArgumentError(f"step must be a non-negative int, got {step!r}")
