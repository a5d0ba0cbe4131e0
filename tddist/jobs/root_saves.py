"""A manager's saves straight to its root (no node-local tier): synchronous, or one asynchronous save in flight.

The retention after an asynchronous save runs on the save's worker thread
(``root_retention.retain_after``); ``wait`` takes the save's outcome, the
same error on every rank. An incremental manager saves against the last
checkpoint it saved, else the newest one in the root.

Call order, on every rank: ``retire_finished`` when the ranks decide a step;
``wait`` before each ``save`` (the manager's ``save`` does); ``wait_snapshot``
and ``wait`` whenever the caller asks.
"""

from __future__ import annotations

import logging
import threading
import time
from functools import partial
from typing import Any

from ..api import save
from ..comm.base import Communicator
from ..comm.collective import decide_on_rank0
from .retention import newest_checkpoint
from .root_retention import InFlight, retain_after
from .train_state import optimizers_of

logger = logging.getLogger(__name__)


class RootSaves:
    """The saves of one manager into ``root``, and the asynchronous one in flight (``pending``)."""

    def __init__(self, comm: Communicator, root: str, retain: Any, *, async_save: bool, deferred: bool,
                 incremental: bool) -> None:  # fmt: skip
        self.comm, self.root, self._retain = comm, root, retain
        self.async_save, self.deferred, self.incremental = async_save, deferred, incremental
        self.pending: InFlight | None = None
        self.last: str | None = None  # the last checkpoint saved: the next incremental save's base

    def save(self, step: int, path: str, data: Any, state: Any, metadata: dict, kwargs: dict, start: float) -> None:
        """Save ``data`` (``state``'s, for the deferred guard) to ``path``: durably, or in flight."""
        if self.incremental:
            kwargs["base"] = self.base_for(path)
        if self.deferred:
            kwargs.update(snapshot="deferred", guard=optimizers_of(state) or None)
        self.last = path
        if self.async_save:
            fut = save(data, path, comm=self.comm, return_early=True, metadata=metadata, **kwargs)
            self.pending = InFlight(step, fut, start, threading.Event())
            fut.add_done_callback(partial(retain_after, self.pending, self._retain))
            return
        save(data, path, comm=self.comm, metadata=metadata, **kwargs)
        logger.info("rank %d: saved step %d in %.2fs", self.comm.rank, step, time.monotonic() - start)
        self._retain(step)

    def base_for(self, path: str) -> str | None:
        """The base of an incremental save to ``path``: the last checkpoint saved, else the newest committed
        one in the root (rank 0 finds it, every rank gets the same)."""
        if self.last is not None and self.last != path:
            return self.last
        what = "finding the base in " + self.root
        found = decide_on_rank0(self.comm, what, lambda _none: newest_checkpoint(self.root))
        return None if found is None or found[0] == path else found[0]

    def wait(self) -> None:
        """Wait for the save in flight, if any, and the retention after it; raise its error."""
        pending, self.pending = self.pending, None
        if pending is None:
            return
        try:
            pending.future.result()
        finally:
            pending.retained.wait()  # the save's worker applies retention once the save resolved
        took = time.monotonic() - pending.started
        logger.info("rank %d: saved step %d %.2fs after it started", self.comm.rank, pending.step, took)

    def wait_snapshot(self) -> None:
        """Wait until the save in flight has copied the state (a deferred snapshot), not for its commit."""
        wait = getattr(self.pending.future, "wait_snapshot", None) if self.pending is not None else None
        if wait is not None:  # a tddist save's Future (``saving.background.SaveFuture``)
            wait()

    def retire_finished(self) -> None:
        """Forget a save that succeeded and whose retention is done (its errors wait for ``wait()``; a
        retention still running is not waited for)."""
        p = self.pending
        if p is not None and p.retained.is_set() and p.future.exception() is None:
            self.wait()
