"""Promotion: copying a committed node-local checkpoint to the shared root, in the background.

A promotion is an ordinary collective ``tddist.save`` of the data read back
from the local copy (copy-on-write memory maps of its committed files): the
same sharding, manifest, checksums and two-phase commit as a direct save, so
the shared checkpoint appears whole and verified, or not at all. It runs on
the worker thread of ``background.py`` over the channel's duplicate
communicator, like a ``return_early`` save, so the training loop's own
collectives never mix with it, and the interpreter's exit hook waits for it.

Call order, on every rank: ``start`` (collective the first time: it
duplicates the communicator), then the Future's ``result`` (the manager
agrees on every rank's outcome before it raises, see ``CheckpointManager.wait``).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping
from concurrent.futures import Future
from dataclasses import dataclass, field
from functools import partial
from typing import Any

from ..api import save
from ..comm.base import Communicator
from ..errors import TddistError
from ..saving import background

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Promotion:
    """One step's promotion, as the manager tracks it until its outcome is known.

    Attributes:
        step: the training step.
        local: this rank's committed local part (kept whatever happens to the promotion).
        target: the shared checkpoint being written.
        future: the outcome (None, or the error naming the step).
        started: ``time.monotonic()`` when the local save began.
    """

    step: int
    local: str
    target: str
    future: Future = field(compare=False)
    started: float


#: Run on the background communicator before the save, on every rank: creates and locks the root.
PrepareRoot = Callable[[Communicator], None]


@dataclass(frozen=True)
class PromotionRequest:
    """What to promote and how: the manager's side of ``start``.

    Attributes:
        step: the training step.
        local: this rank's committed local part.
        target: the shared checkpoint to write.
        data: this rank's shard, mapped from its local part.
        metadata: the checkpoint's user metadata.
        save_kwargs: the manager's other ``tddist.save`` options.
        prepare_root: run first on every rank (creates and locks the root).
    """

    step: int
    local: str
    target: str
    data: Any = field(compare=False)
    metadata: Mapping[str, Any]
    save_kwargs: Mapping[str, Any]
    prepare_root: PrepareRoot = field(compare=False)


def start(comm: Communicator, request: PromotionRequest, started: float) -> Promotion:
    """Hand the promotion of ``request.step`` to ``comm``'s background worker and return at once (collective).

    A save in flight on ``comm`` (the manager's previous promotion, or the
    caller's own ``return_early`` save) is waited for first, as
    ``tddist.save`` does. ``started`` is when the local save began.
    """
    ch = background.channel(comm)
    bg = ch.background_comm()  # collective on first use; also starts the worker thread
    ch.wait_idle(True, request.target)
    future = ch.submit(partial(_promote, bg, request))
    return Promotion(request.step, request.local, request.target, future, started)


def _promote(comm: Communicator, request: PromotionRequest) -> None:
    """(worker thread) Prepare the root and save the local copy's data to the target; errors name the step."""
    begin = time.monotonic()
    try:
        request.prepare_root(comm)
        save(
            request.data, request.target, comm=comm, copy_existing=True, metadata=dict(request.metadata),
            **request.save_kwargs,
        )  # fmt: skip
    except Exception as e:
        raise failure(comm.rank, request.step, request.local, request.target, e) from e
    logger.info(
        "rank %d: promoted step %d to %s in %.2fs", comm.rank, request.step, request.target, time.monotonic() - begin
    )


def failure(rank: int, step: int, local: str, target: str, e: BaseException) -> TddistError:
    """The error of a failed promotion: the class of the cause (``TddistError`` for a foreign one) and what to do."""
    cls = type(e) if isinstance(e, TddistError) else TddistError
    failures = e.failures if isinstance(e, TddistError) else None
    cause = str(e) if isinstance(e, TddistError) else f"{type(e).__name__}: {e}"
    return cls(
        f"rank {rank}: promoting the checkpoint of step {step} to the shared root ({target}) failed: {cause}. "
        f"The node-local copy ({local}) is kept, and restore() on these nodes resumes from it; the shared root "
        f"holds its previous checkpoints, never a partial one. Make the shared root writable (or fix the failing "
        f"rank) and save again: the next promotion commits a newer step",
        failures=failures,
    )
