"""When a ``CheckpointManager`` saves: the ranks' vote at each step and the decision taken from it.

A save is due every ``every`` steps, ``save_interval_minutes`` after the last
save by rank 0's clock, and on a preemption requested on any rank. Each rank
casts a ``StepVote``; the manager exchanges the votes (one allgather) and
``SaveSchedule.decide`` turns them into the same ``Decision`` on every rank.
The decision is kept for the ``step()`` that follows a ``should_save()`` of
the same step, so the ranks exchange once per step. Apart from the manager so
that the rule of when to save reads on its own; no collectives here.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass


def _clock() -> float:
    """The clock of time-based saves (rank 0's decides)."""
    return time.monotonic()


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
class Decision:
    """What the ranks decided for one step (``should_save``), kept for the ``step()`` that follows it.

    Attributes:
        step: the step decided on.
        save: a save is due at ``step``.
        preempt: a preemption was requested on some rank: save, wait, stop.
    """

    step: int
    save: bool
    preempt: bool


class SaveSchedule:
    """One manager's clock of time-based saves and the decision taken for the current step (one rank's)."""

    def __init__(self, interval: float | None) -> None:
        """``interval``: seconds between time-based saves (None: never by time); the clock starts now."""
        self.interval = interval
        self._last_save = _clock()
        self._decided: Decision | None = None

    def decided(self, step: int) -> Decision | None:
        """The decision already taken for ``step`` (by a ``should_save``), or None."""
        decided = self._decided
        return decided if decided is not None and decided.step == step else None

    def vote(self, preempt: bool, promotion_done: bool) -> StepVote:
        """This rank's vote: the flags given, and whether ``interval`` has passed since its last save."""
        timed = self.interval is not None and _clock() - self._last_save >= self.interval
        return StepVote(preempt, promotion_done, timed)

    def decide(self, step: int, votes: Sequence[StepVote], every: int | None) -> Decision:
        """Every rank's decision for ``step`` from every rank's vote (rank 0's clock counts), kept until ``clear``."""
        preempt = any(v.preempt for v in votes)
        due = preempt or votes[0].time_due or (every is not None and step % every == 0)
        self._decided = Decision(step, due, preempt)
        return self._decided

    def clear(self) -> None:
        """Forget the decision taken: ``step()`` has acted on it."""
        self._decided = None

    def saved(self) -> None:
        """A save starts now: the next time-based save is due ``interval`` from now."""
        self._last_save = _clock()
