"""Rank program for CheckpointManager tests: ``python tests/manager_rank.py <workdir> <role>``.

Started by tests/test_manager.py with the "spawn" launcher (torchrun's
environment, one process per rank), so each rank's exit code is seen and
signals can be sent to single ranks. The state is a batch-sharded TensorDict
of 12 rows plus a replicated counter; its global value after ``s`` training
steps is ``expected(s)`` whatever the world size, so every resume can be
checked exactly.

Roles:
- ``crash-write`` (2 ranks): every=1, keep_last=2; trains to step 5, then
  rank 1 is SIGKILLed while writing the checkpoint of step 6.
- ``crash-publish`` (3 ranks, async saves): resumes (from 5), saves 6, and
  rank 0 is SIGKILLed right after publishing step 7, before retention.
- ``finish`` (1 rank): resumes from 7, trains to 9, leaves step 8 and 9.
- ``signal`` (2 ranks, async saves slowed by two seconds each): trains until
  the preemption signal, which the test sends to rank 1 only while a save is
  in flight; exits with EXIT_PREEMPTED.
"""

from __future__ import annotations

import os
import sys
import time
import traceback
from pathlib import Path

import torch
from tensordict import TensorDict

from tddist.comm.resolve import resolve
from tddist.jobs.manager import EXIT_PREEMPTED, CheckpointManager
from tests.helpers import assert_td_equal
from tests.launch_util import write_report

ROWS = 12


def expected(step: int) -> TensorDict:
    """The global state after ``step`` training steps (``frozen`` never changes: incremental saves reference it)."""
    w = torch.arange(ROWS * 4, dtype=torch.float32).view(ROWS, 4) + step
    frozen = torch.arange(64, dtype=torch.float32)
    return TensorDict(rows=TensorDict(w=w, batch_size=[ROWS]), frozen=frozen, count=torch.tensor(step), batch_size=[])


def local_state(rank: int, world: int, step: int) -> TensorDict:
    """This rank's even share of ``expected(step)`` (the layout ``load`` resumes into)."""
    full = expected(step)
    part = torch.tensor_split(torch.arange(ROWS), world)[rank]
    return TensorDict(
        rows=full["rows"][part].clone(), frozen=full["frozen"].clone(), count=full["count"].clone(), batch_size=[]
    )


def train(state: TensorDict) -> None:
    state["rows", "w"].add_(1)
    state["count"].add_(1)


def check(state: TensorDict, rank: int, world: int, step: int) -> None:
    assert_td_equal(state, local_state(rank, world, step), f"rank {rank}: state of step {step}")


def run(work: Path, rank: int, world: int, *, last: int, crash: tuple[int, str] | None = None, **options) -> dict:
    """Resume, check the state, train to ``last``; set the fault ``crash=(step, spec)`` before that step."""
    mgr = CheckpointManager(work / "ckpt", every=1, keep_last=2, preempt_signal=None, **options)
    state = local_state(rank, world, 0)
    start = mgr.restore(state)
    check(state, rank, world, start)
    for s in range(start, last):
        train(state)
        if crash and s + 1 == crash[0]:
            mgr.wait()  # the fault must strike this step's save, not one still in flight
            os.environ["TDDIST_FAULT"] = crash[1]
        mgr.step(s + 1, state)
    mgr.close()
    return {"start": start}


def role_signal(work: Path, rank: int, world: int) -> dict:
    os.environ["TDDIST_FAULT"] = ",".join(f"{point}:{r}:delay" for r in range(world) for point in ("write", "vote"))
    mgr = CheckpointManager(work / "ckpt", every=20, keep_last=2, async_save=True)
    state = local_state(rank, world, 0)
    in_flight = []
    signalled = work / "signalled"
    for s in range(1000):
        train(state)
        pending = mgr._direct.pending
        in_flight.append(pending is not None and not pending.future.done())
        started = mgr.step(s + 1, state)
        if started and not signalled.exists():
            # the first save is in flight (slowed down by the delay faults): rank 0 says so, and
            # every rank waits until the test has sent SIGUSR1 to rank 1, so the signal arrives
            # during this save whatever the machine's load
            if rank == 0:
                (work / ".inflight").write_text(str(s + 1))
                (work / ".inflight").replace(work / "inflight")
            wait_for(signalled, 90)
        if mgr.should_stop:
            mgr.close()
            return {"stopped": s + 1, "in_flight_at_stop": in_flight[-1], "code": EXIT_PREEMPTED}
    raise AssertionError("no preemption within 1000 steps")


def wait_for(path: Path, timeout: float) -> None:
    """Wait until ``path`` exists; ``timeout`` is only a no-hang bound."""
    deadline = time.monotonic() + timeout
    while not path.exists():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{path} did not appear within {timeout}s")
        time.sleep(0.01)


def main() -> None:
    work, role = Path(sys.argv[1]), sys.argv[2]
    comm = resolve(None, timeout=60)
    rank, world = comm.rank, comm.size
    roles = {
        "crash-write": lambda: run(work, rank, world, last=8, crash=(6, "write:1:kill")),
        "crash-publish": lambda: run(
            work, rank, world, last=9, crash=(7, "publish:0:kill"), async_save=True, incremental=True
        ),
        "finish": lambda: run(work, rank, world, last=9),
        "signal": lambda: role_signal(work, rank, world),
    }
    try:
        result = roles[role]()
    except Exception as e:
        write_report(rank, "failed", error=traceback.format_exc(), error_class=type(e).__name__)
        raise
    write_report(rank, "ok", **result)
    sys.exit(result.get("code", 0))


if __name__ == "__main__":
    main()
