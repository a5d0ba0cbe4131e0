"""Step checkpoints under a root: their names, the newest committed one, retention and clean-up.

The rules that ``CheckpointManager`` applies on rank 0 and that the ``tddist``
command applies offline, on any root ``storage.backends.root_for`` knows (a
directory, ``s3://bucket/prefix``). ``Retention`` holds the rules (``keep_last``,
``keep_best`` by a metric, ``keep_period``) and ``retire`` applies them:
a committed checkpoint is deleted only when at least one rule is set and no
rule keeps it; the newest committed checkpoint, the one just saved and one
that a restore of this process is reading (``reading``) are never deleted.
Only the standard library is needed (the manifest is JSON), so listing and
cleaning a root does not import torch.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import re
import threading
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

from .. import format as fmt
from ..errors import InvalidArgumentError, TddistError
from ..storage.backends import read_manifest, root_for, store_for

logger = logging.getLogger(__name__)

_STEP_RE = re.compile(r"^step-(\d{9,})(\.tdz)?$")

#: The metadata member of a checkpoint's manifest holding the metrics given at save time.
METRICS_KEY = "metrics"
#: What ``mode`` may be: the best value of the metric is the smallest, or the largest.
MODES = ("min", "max")


def step_name(step: int, archive: bool = False) -> str:
    """The name of the checkpoint of ``step`` (zero-padded so names sort by step).

    Args:
        step: the training step.
        archive: name an archive (``.tdz``) instead of a directory.

    Returns:
        ``step-<step, at least 9 digits>``, with ``.tdz`` for an archive.
    """
    return f"step-{step:09d}" + (fmt.ARCHIVE_SUFFIX if archive else "")


def parse_step(name: str) -> int | None:
    """The step of a checkpoint name, or None if ``name`` is not one.

    Args:
        name: a file or directory name (not a path), as ``step_name`` makes them.

    Returns:
        The step, or None.
    """
    m = _STEP_RE.match(name)
    return int(m.group(1)) if m else None


def step_entries(root: str) -> list[tuple[int, str]]:
    """(step, path) of every step entry under ``root``, newest first (committed or not).

    Args:
        root: the root holding the step checkpoints (a directory or ``s3://bucket/prefix``).

    Returns:
        Every entry whose name is a step name, by descending step; empty if
        ``root`` does not exist.
    """
    r = root_for(root)
    found = [(parse_step(n), r.join(n)) for n in r.names()]
    return sorted(((s, p) for s, p in found if s is not None), reverse=True)


def newest_checkpoint(root: str, *, finite: bool = False) -> tuple[str, int] | None:
    """(path, step) of the newest checkpoint under ``root`` with a valid manifest, or None.

    Staging leftovers, torn directories and unreadable manifests are skipped.
    The step is the one stored in the metadata (the name's, if absent).

    Args:
        root: the root holding the step checkpoints.
        finite: also skip checkpoints whose recorded counts show NaN or Inf values (format version 4;
            uncounted older ones are not skipped).

    Returns:
        The newest readable checkpoint's path and step, or None if there is none.
    """
    for step, path in step_entries(root):
        try:
            manifest = read_manifest(path)
        except TddistError as e:
            logger.warning("skipping %s: %s", path, e)
            continue
        bad = manifest.non_finite() if finite else []
        if bad:
            logger.warning(
                "skipping %s: %d leaves hold NaN or Inf values (first: %s)", path, len(bad), list(bad[0].key)
            )
            continue
        return path, int(manifest.metadata.get("step", step))
    return None


def committed_steps(root: str) -> list[tuple[int, str]]:
    """(step, path) of every committed step checkpoint under ``root``, newest first (manifests not validated)."""
    return [(s, p) for s, p in step_entries(root) if store_for(p).committed()]


def delete_checkpoint(path: str) -> None:
    """Remove a checkpoint so that a crash in the middle never leaves it looking committed.

    On a file system it is first renamed to a trash name in one step
    (``recover`` removes a half-deleted one); on object storage a directory's
    manifest is deleted first (clean-up removes the objects a crash left).

    Args:
        path: the checkpoint (directory, archive, or ``s3://`` URL).

    Raises:
        OSError: ``path`` could not be renamed or removed.
        StorageError: a request to object storage failed.
    """
    store_for(path).delete()


def clean_root(root: str) -> list[str]:
    """Remove leftovers of crashed saves and deletions under ``root``; returns what was done.

    ``recover`` runs on every step name (on a file system, staging, trash and
    backup entries; on object storage, unfinished uploads and generations no
    manifest names); then a step entry without a commit that holds only what
    tddist writes (a save cut off before its commit) is removed. A damaged
    manifest or foreign files are left alone (``newest_checkpoint`` skips them).

    Args:
        root: the root holding the step checkpoints (a directory is created if missing).

    Returns:
        One line per action taken, for a log.

    Raises:
        OSError: a leftover could not be removed or restored.
        StorageError: a request to object storage failed.
    """
    r = root_for(root)
    r.create()
    names: set[str] = set()
    for name in r.names():
        side = fmt.side_entry_kind(name)
        base = side[0] if side else name
        if parse_step(base) is not None:
            names.add(base)
    done: list[str] = []
    for name in sorted(names):
        path = r.join(name)
        store = store_for(path)
        done += store.recover()
        done += _unpin(path) if r.local else []
        ours = r.partial(name)
        if ours:
            store.delete()
            done.append(f"removed torn checkpoint {path}")
        elif ours is not None:
            logger.warning("%s is not a committed checkpoint and holds foreign files; left alone", path)
    return done


def _unpin(path: str) -> list[str]:
    """Remove every pin of ``path``: no save into the root runs while it is cleaned (the manager holds its lock),
    so each was left by an incremental save that died."""
    done = []
    for pin in fmt.pin_entries(path):
        os.unlink(pin)
        done.append(f"removed the pin {pin} of a save that died")
    return done


def retired(root: str, keep_last: int, newest: int | None = None) -> list[tuple[int, str]]:
    """(step, path) of the committed checkpoints beyond the ``keep_last`` newest ones, never ``newest``.

    Uncommitted entries are not counted: retention never deletes a committed
    checkpoint to make room for a save that did not commit.

    Args:
        root: the root holding the step checkpoints.
        keep_last: how many of the newest committed checkpoints to keep.
        newest: a step never to retire (the one just saved), or None.

    Returns:
        The checkpoints to delete, newest first.
    """
    return retire(root, Retention(keep_last=keep_last), keep=() if newest is None else (newest,))


# --- retention rules -----------------------------------------------------------------------


@dataclass(frozen=True)
class Retention:
    """Which committed step checkpoints a root keeps. Each rule keeps some; a checkpoint goes only when at
    least one rule is set and none keeps it. The newest committed checkpoint is always kept.

    Attributes:
        keep_last: the ``keep_last`` newest (by step), or None (no such rule).
        keep_best: the ``keep_best`` best by ``metric``, or None; a checkpoint
            saved without the metric (or with NaN) is never among the best.
        metric: the name of the metric (``metrics={name: value}`` at save time,
            stored in the manifest's metadata under ``"metrics"``).
        mode: ``"min"`` (the smallest value is the best) or ``"max"``.
        keep_period: every step divisible by ``keep_period``, or None.
    """

    keep_last: int | None = None
    keep_best: int | None = None
    metric: str | None = None
    mode: str = "min"
    keep_period: int | None = None

    def __post_init__(self) -> None:
        for name in ("keep_last", "keep_best", "keep_period"):
            value = getattr(self, name)
            if value is not None and (type(value) is not int or value < 1):
                raise InvalidArgumentError(f"{name} must be a positive int or None, got {value!r}")
        if self.mode not in MODES:
            raise InvalidArgumentError(f"mode must be 'min' or 'max', got {self.mode!r}")
        if self.keep_best is not None and not (isinstance(self.metric, str) and self.metric):
            raise InvalidArgumentError(
                f"keep_best={self.keep_best} needs metric=: the name of the metric that ranks the checkpoints "
                f"(passed at each save as metrics={{name: value}}), got metric={self.metric!r}"
            )
        if self.metric is not None and self.keep_best is None:
            raise InvalidArgumentError(
                f"metric={self.metric!r} without keep_best: pass keep_best=k to keep the k best checkpoints by it "
                f"(metrics given at save time are stored either way)"
            )

    @property
    def active(self) -> bool:
        """Whether any rule is set: with none, nothing is ever deleted."""
        return any(v is not None for v in (self.keep_last, self.keep_best, self.keep_period))

    def best(self, scored: Iterable[tuple[int, float]]) -> set[int]:
        """The ``keep_best`` best steps of (step, value) pairs; NaN is never among them, ties go to newer steps."""
        if self.keep_best is None:
            return set()
        sign = 1.0 if self.mode == "min" else -1.0
        ranked = sorted(((sign * v, -s) for s, v in scored if not math.isnan(v)))
        return {-neg for _v, neg in ranked[: self.keep_best]}

    def kept(self, committed: list[tuple[int, str]], metric_of: Callable[[str], float | None]) -> set[int]:
        """The steps of ``committed`` (newest first) that some rule keeps, the newest always."""
        kept = {committed[0][0]} if committed else set()
        if self.keep_last is not None:
            kept |= {s for s, _p in committed[: self.keep_last]}
        if self.keep_period is not None:
            kept |= {s for s, _p in committed if s % self.keep_period == 0}
        if self.keep_best is not None:
            scored = [(s, v) for s, p in committed if (v := metric_of(p)) is not None]
            kept |= self.best(scored)
        return kept


def retire(
    root: str,
    rules: Retention,
    keep: Iterable[int] = (),
    metric_of: Callable[[str], float | None] | None = None,
) -> list[tuple[int, str]]:
    """(step, path) of the committed checkpoints under ``root`` that ``rules`` delete, newest first.

    Never the newest committed one, a step of ``keep`` (the one just saved),
    or one that a restore of this process is reading (``reading``).
    Uncommitted entries are not counted: retention never deletes a committed
    checkpoint to make room for a save that did not commit.

    Args:
        root: the root holding the step checkpoints.
        rules: the retention rules.
        keep: steps never to delete.
        metric_of: a checkpoint's value of ``rules.metric`` (default: read from its manifest).
    """
    if not rules.active:
        return []
    committed = committed_steps(root)
    kept = rules.kept(committed, metric_of or (lambda p: stored_metric(p, rules.metric)))
    kept |= set(keep)
    needed = referenced([p for s, p in committed if s in kept])
    return [(s, p) for s, p in committed if s not in kept and not being_read(p) and _target(p) not in needed]


def holders_of(path: str) -> list[str]:
    """The checkpoints that the committed checkpoint at ``path`` references (an incremental one's holders),
    by path; none when its manifest cannot be read (it references nothing a reader could follow)."""
    try:
        m = read_manifest(path)
    except TddistError:
        return []
    return [fmt.holder_path(path, h.name) for h in m.referenced()]


def referenced(kept: Iterable[str]) -> set[str]:
    """Mark: the targets of every checkpoint that one of ``kept`` references, transitively (a reference names
    the holder itself, so one step suffices for what tddist writes; a longer chain costs nothing more).
    A clean-up never deletes them (the sweep)."""
    seen: set[str] = set()
    todo = list(kept)
    while todo:
        for holder in holders_of(todo.pop()):
            t = _target(holder)
            if t not in seen:
                seen.add(t)
                todo.append(holder)
    return seen


def _target(path: str) -> str:
    return store_for(path).target


# --- metrics ---------------------------------------------------------------------------------


def encode_metrics(metrics: Mapping[str, Any] | None) -> dict[str, float | str]:
    """``metrics`` as stored in a manifest: str keys, real numbers (NaN and infinities as "nan", "inf", "-inf").

    Raises:
        InvalidArgumentError: a key is not a str, or a value is not a real number.
    """
    if metrics is None:
        return {}
    if not isinstance(metrics, Mapping):
        raise InvalidArgumentError(f"metrics must be a dict of name -> number, got {type(metrics).__name__}")
    out: dict[str, float | str] = {}
    for name, value in metrics.items():
        if not isinstance(name, str):
            raise InvalidArgumentError(f"metrics: every name must be a str, got {name!r}")
        number = _real(value)
        if number is None:
            raise InvalidArgumentError(
                f"metrics[{name!r}] must be a real number (an int, a float or a one-element tensor), got {value!r}"
            )
        out[name] = number if math.isfinite(number) else str(number)
    return out


def _real(value: Any) -> float | None:
    if isinstance(value, (bool, str, bytes)):
        return None
    try:
        return float(value)
    except (TypeError, ValueError, RuntimeError):
        return None


def metric_value(metadata: Mapping[str, Any], metric: str | None) -> float | None:
    """The value of ``metric`` a checkpoint's metadata holds, or None (absent, or not a number)."""
    metrics = metadata.get(METRICS_KEY)
    if metric is None or not isinstance(metrics, Mapping):
        return None
    value = metrics.get(metric)
    if isinstance(value, str) and value in ("nan", "inf", "-inf"):
        return float(value)
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value)
    return None


def stored_metric(path: str, metric: str | None) -> float | None:
    """The value of ``metric`` the checkpoint at ``path`` was saved with, or None (absent, or unreadable)."""
    try:
        return metric_value(read_manifest(path).metadata, metric)
    except TddistError as e:
        logger.warning("%s: cannot read its %s (%s); it is not ranked by it", path, metric, e)
        return None


# --- checkpoints being read ------------------------------------------------------------------

_reading_guard = threading.Lock()
_reading: dict[str, int] = {}  # a checkpoint's target -> restores of this process reading it


def hold(path: str) -> Callable[[], None]:
    """Mark the checkpoint at ``path`` as being read by a restore of this process; returns the release.

    Until released, ``unless_read`` refuses it, so retention in this process
    never deletes it. A deletion already under way finishes first.
    """
    target = store_for(path).target
    with _reading_guard:
        _reading[target] = _reading.get(target, 0) + 1
    released: list[bool] = []

    def release() -> None:
        with _reading_guard:
            if released:
                return
            released.append(True)
            _reading[target] -= 1
            if not _reading[target]:
                del _reading[target]

    return release


@contextlib.contextmanager
def reading(path: str) -> Iterator[None]:
    """While in this block, retention in this process never deletes the checkpoint at ``path``."""
    release = hold(path)
    try:
        yield
    finally:
        release()


def being_read(path: str) -> bool:
    """Whether a restore of this process is reading the checkpoint at ``path`` now."""
    target = store_for(path).target
    with _reading_guard:
        return target in _reading


@contextlib.contextmanager
def unless_read(path: str) -> Iterator[bool]:
    """Yields whether the checkpoint at ``path`` may be deleted (no restore of this process reads it); no
    restore starts reading it until the block ends, so a deletion in the block never pulls it from one."""
    target = store_for(path).target
    with _reading_guard:
        yield target not in _reading
