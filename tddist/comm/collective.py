"""The collective step every rank ends the same way: errors described, gathered and raised alike on every rank.

``run_step`` runs a local function on every rank and raises one
``CollectiveError`` (or the single failing class) on every rank if any
failed; ``decide_on_rank0`` gathers every rank's contribution on rank 0,
which decides and broadcasts the decision (or every failure). The commit
and the load are built from these two.
"""

from __future__ import annotations

import logging
import traceback
from collections.abc import Callable, Mapping
from typing import Any, TypeVar, cast

from ..core.types import Contribution, Decision, Failure
from ..errors import BY_NAME, CollectiveError, TddistError
from .base import Communicator

logger = logging.getLogger(__name__)

T = TypeVar("T")
R = TypeVar("R")


def describe(exc: BaseException) -> Failure:
    """A local error as sent to other ranks: its class name and message."""
    if isinstance(exc, TddistError):
        return Failure(type(exc).__name__, str(exc))
    logger.debug("local error:\n%s", "".join(traceback.format_exception(exc)))
    return Failure(type(exc).__name__, f"{type(exc).__name__}: {exc}")


def collective_error(what: str, failures: Mapping[int, Failure]) -> TddistError:
    """One error, the same on every rank, naming every failing rank and its message.

    If all failing ranks raised the same tddist error class, that class is
    used; otherwise ``CollectiveError``.
    """
    names = {f.error_class for f in failures.values()}
    cls = (BY_NAME.get(names.pop()) if len(names) == 1 else None) or CollectiveError
    ranks = sorted(failures)
    lines = "\n".join(f"  rank {r}: {failures[r].message.removeprefix(f'rank {r}: ')}" for r in ranks[:16])
    more = f"\n  ... and {len(ranks) - 16} more ranks" if len(ranks) > 16 else ""
    msg = f"{what} failed on rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks[:16]))}:\n{lines}{more}"
    return cls(msg, failures={r: f.message for r, f in failures.items()})


def contribute(fn: Callable[[], T]) -> Contribution[T]:
    """Run ``fn``; its value, or its error as a ``Failure`` (a rank's error becomes its vote)."""
    try:
        return Contribution(value=fn())
    except Exception as e:
        logger.debug("this rank's contribution failed", exc_info=True)
        return Contribution(failure=describe(e))


def agree(comm: Communicator, what: str, local_error: BaseException | None) -> None:
    """Collectively raise the same error on every rank if any rank had one (one allgather)."""
    status = describe(local_error) if local_error is not None else None
    statuses = comm.allgather(status)
    failures = {r: s for r, s in enumerate(statuses) if s is not None}
    if failures:
        raise collective_error(what, failures) from local_error


def run_step(comm: Communicator, what: str, fn: Callable[[], T]) -> T | None:
    """Run ``fn`` on every rank; if it fails on any rank, raise the same error on all."""
    try:
        value, error = fn(), None
    except Exception as e:
        value, error = None, e
    agree(comm, what, error)
    return value


def decide_on_rank0(
    comm: Communicator,
    what: str,
    decide: Callable[[list[Any]], R],
    contribution: Contribution[Any] | None = None,
    *,
    after_gather: Callable[[], None] | None = None,
    on_failure: Callable[[], None] | None = None,
    after_failure: Callable[[], None] | None = None,
) -> R:
    """Rank 0 decides; every rank returns the decision, or raises the same error.

    Call order, on every rank: with a ``contribution``, the contributions are
    gathered to rank 0 (``after_gather`` then runs on every rank; on rank 0 a
    failure there counts as rank 0's). Rank 0 calls ``decide(values)`` with
    every rank's value if no rank failed; whatever it raises becomes the
    decision. If the decision is a failure, rank 0 calls ``on_failure`` (a
    clean-up that must not raise). Rank 0 broadcasts the decision; every rank
    returns its value or, after ``after_failure`` (a clean-up that must not
    raise, run only on a decided failure: never when the broadcast itself
    failed), raises ``collective_error(what, failures)``.
    Without a contribution only the broadcast runs.
    """
    contributions = comm.gather(contribution, 0) if contribution is not None else None
    if comm.rank != 0 and after_gather is not None:
        after_gather()
    decision: Decision[R] | None = None
    if comm.rank == 0:
        try:
            if after_gather is not None:
                after_gather()
            failures = {r: c.failure for r, c in enumerate(contributions or []) if c.failure is not None}
            if failures:
                decision = Decision(failures=failures)
            else:
                decision = Decision(value=decide([c.value for c in contributions or []]))
        except Exception as e:
            logger.debug("rank 0 failed to decide %s", what, exc_info=True)
            decision = Decision(failures={0: describe(e)})
        if not decision.ok and on_failure is not None:
            on_failure()
    decision = comm.broadcast(decision, 0)
    assert decision is not None
    if not decision.ok:
        if after_failure is not None:
            after_failure()
        raise collective_error(what, decision.failures)
    return cast(R, decision.value)  # a decision without failures holds decide()'s value
