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
"""

from __future__ import annotations

import logging
import os
import signal
import time
from collections.abc import Callable, Iterable, Mapping
from concurrent.futures import Future
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeVar

import torch
from tensordict import TensorDictBase

from . import root_lock
from .api import load, save
from .comm import decide_on_rank0, resolve
from .errors import CheckpointNotFoundError, InvalidArgumentError, TddistError
from .manifest_io import read_manifest
from .plan import LoadReport
from .retention import clean_root, delete_checkpoint, newest_checkpoint, retired, step_entries, step_name
from .state import get_state, holds_objects, set_state

if TYPE_CHECKING:
    from types import FrameType, TracebackType

    #: What ``signal.signal`` returns and accepts: a handler, SIG_DFL/SIG_IGN, or None.
    _Handler = Callable[[int, FrameType | None], Any] | int | None

logger = logging.getLogger(__name__)

R = TypeVar("R")

_RESERVED = frozenset({"return_early", "comm", "prefix", "data"})

#: Exit status of a training process that stopped because it was preempted
#: (``EX_TEMPFAIL``: "try again later"). Job scripts requeue on it.
EXIT_PREEMPTED = 75


def parse_signals(spec: Any) -> list[signal.Signals]:
    """Signals from a signal, a name ("USR1", "SIGTERM"), a comma-separated string, a list of these, or None."""
    if spec is None:
        return []
    if isinstance(spec, str):
        spec = [s for s in spec.split(",") if s.strip()]
    items = [spec] if isinstance(spec, int) else list(spec)
    try:
        return [_signal(s) for s in items]
    except (AttributeError, TypeError, ValueError):
        raise InvalidArgumentError(f"preempt_signal={spec!r}: expected a signal, several, or None") from None


def _signal(item: str | int) -> signal.Signals:
    if isinstance(item, str):
        name = item.strip().upper()
        return getattr(signal.Signals, name if name.startswith("SIG") else "SIG" + name)
    return signal.Signals(item)


def _check_count(name: str, value: object, allow_none: bool) -> None:
    if value is None and allow_none:
        return
    if type(value) is not int or value < 1:
        raise InvalidArgumentError(f"{name} must be a positive int{' or None' if allow_none else ''}, got {value!r}")


@dataclass(frozen=True, eq=False)
class Restored(int):
    """What ``CheckpointManager.restore`` loaded: the step (this object is that int), the path and the report.

    It is an ``int`` equal to ``step``, so ``range(mgr.restore(state), n)``,
    ``start == 20`` and f-strings keep working as when ``restore`` returned
    the step alone.

    Attributes:
        step: the step of the checkpoint loaded, 0 when there was none.
        path: the checkpoint loaded, or None.
        report: what ``tddist.load(into=...)`` found (loaded, skipped, ...), or None.
    """

    step: int
    path: str | None = None
    report: LoadReport | None = None

    def __new__(cls, step: int, path: str | None = None, report: LoadReport | None = None) -> Restored:
        return super().__new__(cls, step)

    def __repr__(self) -> str:
        return f"Restored(step={self.step}, path={self.path!r}, report={self.report!r})"

    def __str__(self) -> str:
        return str(self.step)

    __format__ = int.__format__
    __hash__ = int.__hash__


def _state_of(state: Any) -> Any:
    """The state itself, or what a callable state returns (called only when the state is needed)."""
    if callable(state) and not isinstance(state, (torch.nn.Module, Mapping, TensorDictBase, tuple, list)):
        return state()
    return state


def _model_pair(state: Any) -> tuple[torch.nn.Module, torch.optim.Optimizer | None] | None:
    """(model, optimizer or None) if ``state`` is a module or a (module, optimizer) pair, else None."""
    if isinstance(state, torch.nn.Module):
        return state, None
    if isinstance(state, (tuple, list)) and len(state) == 2 and isinstance(state[0], torch.nn.Module):
        return state[0], state[1]
    return None


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

    Creating it takes a lock on ``root`` (rank 0, ``fcntl.flock`` on a file
    in it, held until ``close()`` or the process exits): a second live job
    on the same root is refused on every rank with ``RootLockedError``. A
    root that does not exist yet is not created before the first save.
    ``keep_last`` committed checkpoints are kept (None: all). ``every``: save
    when ``step % every == 0`` (None: only on preemption or ``save()``).
    ``async_save`` saves with ``return_early=True``; the next save, ``wait()``
    and preemption wait for it. ``preempt_signal``: one signal, several, or
    None. ``save_kwargs`` go to ``tddist.save`` (``metadata`` is merged with
    the step).

    Args:
        root: the directory holding the step checkpoints (created by the first save).
        keep_last: how many committed checkpoints to keep (None: all).
        every: save when ``step % every == 0`` (None: only on preemption or ``save()``).
        async_save: save with ``return_early=True``, so training continues while
            a background thread writes and commits.
        comm: a torch ProcessGroup, an mpi4py communicator or a tddist
            ``Communicator`` (None: detected as ``tddist.save`` does).
        preempt_signal: the signal(s) that request a preemption: a signal, a
            name ("USR1", "SIGTERM"), a comma-separated string, a list, or None.
        save_kwargs: keyword arguments of every ``tddist.save``; ``data``,
            ``prefix``, ``comm`` and ``return_early`` are the manager's.

    Attributes:
        should_stop: True once a requested preemption has been saved; the
            training loop then exits with ``EXIT_PREEMPTED``.

    Raises:
        InvalidArgumentError: an invalid ``keep_last``, ``every``,
            ``preempt_signal`` or ``save_kwargs``.
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
    ) -> None:
        _check_count("keep_last", keep_last, allow_none=True)
        _check_count("every", every, allow_none=True)
        self.save_kwargs = dict(save_kwargs or {})
        bad = _RESERVED & set(self.save_kwargs)
        if bad:
            raise InvalidArgumentError(f"save_kwargs may not set {sorted(bad)}: the manager sets them")
        self.root = os.path.abspath(os.fspath(root))
        self.keep_last, self.every, self.async_save = keep_last, every, bool(async_save)
        self.comm = resolve(comm, self.save_kwargs.get("timeout"))
        self.should_stop = False
        self._requested = False
        self._pending: tuple[int, Future, float] | None = None
        self._locked = False
        self._handlers = self._install(parse_signals(preempt_signal))
        try:
            done = self._on_rank0("lock and clean-up of " + self.root, self._lock_and_clean)
        except BaseException:
            self._uninstall()
            raise
        self._locked = done is not None
        if done and self.comm.rank == 0:
            logger.info("cleaned %s: %s", self.root, "; ".join(done))

    def _lock_and_clean(self) -> list[str] | None:
        """Rank 0: lock an existing root and clean it (None: the root does not exist, nothing was done)."""
        if not os.path.isdir(self.root):
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
            os.makedirs(self.root, exist_ok=True)
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
        return os.path.join(self.root, step_name(step, archive))

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

        Returns:
            A ``Restored``: an int equal to the step of the checkpoint loaded
            (0 if there is none), with its ``path`` and the load's ``report``
            (what was loaded, skipped, missing or unexpected).

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
        found = self._on_rank0(f"finding the checkpoint to restore in {self.root}", lambda: self._find(step))
        if isinstance(found, str):
            if step is not None:
                raise CheckpointNotFoundError(
                    f"rank {self.comm.rank}: {found}; restore(step={step}) has nothing to load"
                )
            if required:
                raise CheckpointNotFoundError(f"rank {self.comm.rank}: {found}; nothing to restore (required=True)")
            if not os.path.isdir(self.root) and self.comm.rank == 0:
                logger.warning("%s; starting from step 0 (check the path if this job should resume)", found)
            else:
                logger.info("%s: starting from step 0", found)
            return Restored(0)
        path, at = found
        objects = _state_of(state)
        pair = _model_pair(objects)
        if pair is not None:
            full = get_state(*pair)
            report = load(path, comm=self.comm, into=full, **load_kwargs)
            set_state(pair[0], pair[1], full)
        elif holds_objects(objects):
            full = get_state(objects)
            report = load(path, comm=self.comm, into=full, **load_kwargs)
            set_state(objects, full)
        else:
            report = load(path, comm=self.comm, into=objects, **load_kwargs)
        assert isinstance(report, LoadReport)  # load(into=...) returns its report
        if report.skipped:
            logger.warning(
                "rank %d: restoring %s left out %s", self.comm.rank, path,
                "; ".join(f"{'/'.join(k)} ({why})" for k, why in list(report.skipped.items())[:10]),
            )  # fmt: skip
        logger.info("rank %d: resumed from %s (step %d)", self.comm.rank, path, at)
        return Restored(at, path, report)

    def _find(self, step: int | None) -> tuple[str, int] | str:
        """Rank 0: (path, step) of the checkpoint to restore, or why there is none."""
        if not os.path.isdir(self.root):
            return f"checkpoint root {self.root!r} does not exist"
        if step is None:
            return newest_checkpoint(self.root) or f"no committed checkpoint in {self.root!r}"
        for s, path in step_entries(self.root):
            if s == step:
                try:
                    manifest = read_manifest(path)
                except TddistError as e:
                    return f"the checkpoint of step {step} ({path}) is not committed or unreadable: {e}"
                return path, int(manifest.metadata.get("step", step))
        steps = sorted({s for s, _p in step_entries(self.root)})
        return f"no checkpoint of step {step} in {self.root!r} (steps there: {steps[-10:]})"

    def step(self, step: int, state: Any) -> bool:
        """Call after each training step (collective): save if due or preempted; True if it saved.

        After a preemption request on any rank, every rank saves this step and
        waits for it, and ``should_stop`` becomes True.

        Args:
            step: the number of training steps done.
            state: what to save, as in ``restore``.

        Returns:
            Whether a save was started (and, with a preemption, completed).

        Raises:
            InvalidArgumentError: ``step`` is not a non-negative int.
            TddistError: the save failed (the same error on every rank; see ``tddist.save``).
        """
        _check_step(step)
        self._retire_finished()
        preempt = any(self.comm.allgather(self._requested))
        due = preempt or (self.every is not None and step % self.every == 0)
        if due:
            self.save(step, state)  # a callable state is called (the TensorDict built) only here
        if preempt:
            self._requested = False
            self.wait()
            self.should_stop = True
            logger.warning("rank %d: preemption requested; saved step %d, stopping", self.comm.rank, step)
        return due

    def save(self, step: int, state: Any) -> None:
        """Save ``state`` as the checkpoint of ``step`` now (collective), after any save in flight.

        Retention runs once it is committed (for an asynchronous save, at the
        next ``step()``, ``save()`` or ``wait()``).

        Args:
            step: the training step, stored in the checkpoint's metadata.
            state: what to save, as in ``restore``.

        Raises:
            InvalidArgumentError: ``step`` is not a non-negative int.
            TddistError: this save or the one in flight failed (the same error
                on every rank; see ``tddist.save``).
        """
        _check_step(step)
        self.wait()
        self._ensure_root()
        objects = _state_of(state)
        pair = _model_pair(objects)
        if pair is not None:
            data = get_state(*pair)
        else:
            data = get_state(objects) if holds_objects(objects) else objects
        kwargs = dict(self.save_kwargs)
        metadata = {**(kwargs.pop("metadata", None) or {}), "step": step}
        path, start = self.path(step), time.monotonic()
        if self.async_save:
            fut = save(data, path, comm=self.comm, return_early=True, metadata=metadata, **kwargs)
            self._pending = (step, fut, start)
            return
        save(data, path, comm=self.comm, metadata=metadata, **kwargs)
        logger.info("rank %d: saved step %d in %.2fs", self.comm.rank, step, time.monotonic() - start)
        self._retain(step)

    def wait(self) -> None:
        """Wait for the save in flight, if any; raise its error (the same on every rank); apply retention.

        Raises:
            TddistError: the save in flight failed (see ``tddist.save``).
        """
        if self._pending is None:
            return
        step, fut, start = self._pending
        self._pending = None
        fut.result()
        logger.info("rank %d: saved step %d %.2fs after it started", self.comm.rank, step, time.monotonic() - start)
        self._retain(step)

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
            self._uninstall()
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
            self._uninstall()

    # --- internals ---------------------------------------------------------------------

    def _retire_finished(self) -> None:
        """Apply retention for a background save that already succeeded (errors wait for ``wait()``)."""
        if self._pending is not None and self._pending[1].done() and self._pending[1].exception() is None:
            self.wait()

    def _retain(self, newest: int) -> None:
        """Rank 0: delete committed checkpoints beyond the ``keep_last`` newest (never ``newest``)."""
        if self.keep_last is None or self.comm.rank != 0:
            return
        for _step, p in retired(self.root, self.keep_last, newest):
            try:
                delete_checkpoint(p)
            except OSError as e:
                logger.warning("could not delete old checkpoint %s: %s", p, e)

    def _on_rank0(self, what: str, fn: Callable[[], R]) -> R:
        """Run ``fn`` on rank 0 and broadcast its result, or raise its error on every rank."""
        return decide_on_rank0(self.comm, what, lambda _none: fn())

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        self.request_preemption()  # only a flag: the ranks agree at the next step()

    def _install(self, signals: Iterable[signal.Signals]) -> dict[signal.Signals, _Handler]:
        previous: dict[signal.Signals, _Handler] = {}
        for sig in signals:
            try:
                previous[sig] = signal.signal(sig, self._on_signal)
            except ValueError:  # not the main thread
                logger.warning("cannot handle %s outside the main thread; use request_preemption()", sig.name)
        return previous

    def _uninstall(self) -> None:
        for sig, handler in self._handlers.items():
            signal.signal(sig, handler)
        self._handlers = {}


def _check_step(step: object) -> None:
    if type(step) is not int or step < 0:
        raise InvalidArgumentError(f"step must be a non-negative int, got {step!r}")
