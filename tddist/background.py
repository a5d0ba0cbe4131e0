"""Background saves: one worker thread and one private channel per communicator.

``save(return_early=True)`` snapshots the data, then runs the writing and the
whole two-phase commit on a worker thread over a duplicate of the
communicator, so its messages never interleave with the caller's own
collectives or with a later foreground save. At most one save per
communicator is in flight. The worker thread is not a daemon: the
interpreter waits for an in-flight save at exit, so it commits or aborts
cleanly instead of being cut off halfway (a killed process leaves only a
staging directory, which ``recover`` removes).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from ._compat import register_exit_hook
from .comm import Communicator
from .errors import InvalidArgumentError, SaveInProgressError
from .merge import PlanCache
from .snapshot import SnapshotBuffers

logger = logging.getLogger(__name__)


class Channel:
    """Per-communicator state of asynchronous saves."""

    def __init__(self, comm: Communicator):
        self.comm = comm
        self.buffers = SnapshotBuffers()
        self.plans = PlanCache()  # the cached path of the next save's merge (see merge.py)
        self.pending: Future | None = None
        self._bg_comm: Communicator | None = None
        self._executor: ThreadPoolExecutor | None = None

    def background_comm(self) -> Communicator:
        """The duplicate communicator used by background commits (collective on first use)."""
        if self._bg_comm is None:
            dup = getattr(self.comm, "dup", None)
            if dup is None:
                raise InvalidArgumentError(
                    f"return_early=True needs a communicator with dup(); {type(self.comm).__name__} has none"
                )
            self._bg_comm = dup()
        return self._bg_comm

    def wait_idle(self, wait: bool, target: str) -> None:
        """Block until no save is in flight (or raise if ``wait`` is False)."""
        pending = self.pending
        if pending is None or pending.done():
            return
        if not wait:
            raise SaveInProgressError(
                f"rank {self.comm.rank}: a save is still in flight on this communicator; saving to {target!r} "
                f"would need to wait for it. Call .result() on the previous future first, or pass "
                f"wait_for_pending=True"
            )
        logger.info("rank %d: waiting for the in-flight save before saving %s", self.comm.rank, target)
        try:
            pending.result()
        except Exception:  # reported by that save's own future
            pass

    def submit(self, fn: Callable[[], Any]) -> Future:
        if self._executor is None:
            self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"tddist-save-rank{self.comm.rank}")
        fut = self._executor.submit(fn)
        self.pending = fut
        return fut


_channels: dict[int, Channel] = {}
_lock = threading.Lock()


def wait_all() -> None:
    """Wait for every in-flight save of this process; log the ones that failed."""
    for ch in list(_channels.values()):
        fut = ch.pending
        if fut is None or fut.done():  # a finished save's outcome is its caller's to see
            continue
        logger.warning("rank %d: waiting for an in-flight tddist save before exiting", ch.comm.rank)
        try:
            fut.result()
        except Exception as e:
            logger.error("rank %d: an asynchronous tddist save failed while exiting: %s", ch.comm.rank, e)


register_exit_hook(wait_all)  # in-flight saves finish before thread pools refuse work


def channel(comm: Communicator) -> Channel:
    """The channel of ``comm`` (communicators are cached by ``comm.resolve``, so identity is stable)."""
    with _lock:
        ch = _channels.get(id(comm))
        if ch is None or ch.comm is not comm:
            ch = _channels[id(comm)] = Channel(comm)
        return ch
