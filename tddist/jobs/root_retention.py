"""The retention of a manager's shared root after each committed save, on rank 0.

Once a save committed, rank 0 deletes the committed checkpoints that no rule
of ``retention.Retention`` keeps (never the one just saved, the newest, or
one a restore of this process is reading). ``keep_best`` ranks checkpoints by
a metric: ``RootRetention`` remembers the value of each checkpoint saved by
this manager and reads the others' from their manifests once. An
asynchronous save applies retention on its own worker thread, right after it
committed (``retain_after``), so that deleting never stalls a training step.

Apart from the manager so that what happens after a save reads on its own;
the rules themselves are ``retention``'s. No collectives.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

from ..errors import TddistError
from ..storage.backends import store_for
from .retention import Retention, delete_checkpoint, metric_value, retire, stored_metric, unless_read

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class InFlight:
    """The asynchronous save a manager has in flight, and the retention that follows it."""

    step: int
    future: Future
    started: float  # time.monotonic() when the save began, for the log
    retained: threading.Event  # set once retention after the save ran, or was skipped because the save failed


def retain_after(pending: InFlight, retain: Callable[[int], None], future: Future) -> None:
    """(the save's worker thread, once its future resolved) Apply retention after a successful save.

    There and not at the next ``step()``: deleting old checkpoints is
    rank 0's file-system work (tens of milliseconds per 64 MiB file on a
    file system that discards freed blocks at once), which would stall
    rank 0's training step and, at the next collective, every rank. A
    future already resolved when the manager adds this runs it at once.
    """
    try:
        if not future.cancelled() and future.exception() is None:
            retain(pending.step)
    finally:
        pending.retained.set()


class RootRetention:
    """The retention of one manager's shared root: rank 0 deletes, the other ranks do nothing."""

    def __init__(self, root: str, rank: int) -> None:
        """``root``: the shared root (absolute, or an ``s3://`` URL); ``rank``: this rank."""
        self.root, self.rank = root, rank
        self._metrics: dict[str, float | None] = {}  # rank 0: a checkpoint's value of the metric, by path
        self._unranked_warned = False

    def note_metric(self, step: int, path: str, metadata: dict[str, Any], metric: str | None) -> None:
        """(rank 0) Remember the saved value of ``keep_best``'s metric, so retention need not read it back."""
        if metric is None or self.rank != 0:
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

    def retain(self, newest: int, rules: Retention) -> None:
        """Rank 0: delete the committed checkpoints no rule of ``rules`` keeps (never ``newest``, the newest
        committed one, or one a restore of this process is reading)."""
        if not rules.active or self.rank != 0:
            return

        def metric_of(path: str) -> float | None:
            return self._metric_of(path, rules.metric)

        try:
            doomed = retire(self.root, rules, keep=(newest,), metric_of=metric_of)
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

    def _metric_of(self, path: str, metric: str | None) -> float | None:
        """(rank 0) A checkpoint's value of the metric: as saved by this manager, else read from its manifest."""
        target = store_for(path).target
        if target not in self._metrics:
            self._metrics[target] = stored_metric(path, metric)
        return self._metrics[target]
