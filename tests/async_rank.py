"""Rank program for asynchronous-save tests: ``python tests/async_rank.py <workdir>``.

Runs every scenario in sequence inside the same ranks (plus the parameter
scenarios of tests/param_scenarios.py), then starts one more
save with return_early=True and leaves the interpreter without waiting for it
(the test then checks that this last checkpoint is complete).
The communicator is detected (torchrun -> gloo, mpiexec -> MPI). Each rank
writes a report through ``tests.launch_util.write_report``.
"""

from __future__ import annotations

import sys
import time
import traceback
from pathlib import Path

import torch
from tensordict import TensorDict

import tddist
from tddist import _faults
from tddist.comm.resolve import resolve
from tddist.saving.background import channel
from tests.helpers import assert_td_equal
from tests.launch_util import write_report
from tests.param_scenarios import SCENARIOS as PARAMETER_SCENARIOS


def make(rank: int, step: int) -> TensorDict:
    rows = 1000 + 37 * rank
    base = torch.arange(rows * 64, dtype=torch.float32).view(rows, 64) + 1e6 * rank
    return TensorDict(w=base + step, idx=torch.arange(rows) + step, batch_size=[rows])


class Training:
    """The job's own collectives, run while a save is in flight."""

    def __init__(self, comm):
        self.kind = type(comm).__name__
        if self.kind == "TorchComm":
            import torch.distributed as dist

            self.dist = dist
        else:
            from mpi4py import MPI

            self.mpi = MPI.COMM_WORLD

    def allreduce(self, value: float) -> float:
        if self.kind == "TorchComm":
            t = torch.tensor([value])
            self.dist.all_reduce(t)
            return float(t.item())
        return float(self.mpi.allreduce(value))


def scenario_snapshot_and_training(work: Path, comm, rank: int, size: int) -> None:
    """Mutations after save returns do not reach the checkpoint; training collectives run meanwhile."""
    td = make(rank, 0)
    expected = td.clone()
    fut = tddist.save(td, work / "snap", return_early=True, num_threads=2)
    td["w"].add_(5.0)
    td["idx"].mul_(0)
    train = Training(comm)
    for i in range(20):
        assert train.allreduce(1.0) == size, "training all_reduce returned a wrong value"
    out = fut.result(timeout=60)
    assert fut.done() and fut.exception() is None
    assert_td_equal(out, expected, f"rank {rank}: what save returned (values changed after it returned?)")
    back = tddist.load(work / "snap", shard="saved", verify=True)
    assert_td_equal(back, expected, f"rank {rank}: load(shard='saved')")


def scenario_buffers_reused(work: Path, comm, rank: int, size: int) -> None:
    """A second asynchronous save of the same structure allocates no new memory: a packed directory is
    copied into the channel's arena while it is written, an archive into per-leaf snapshot buffers."""
    ch = channel(comm)  # the channel these saves use: they pass the same communicator
    for target, count in (("reuse", lambda: ch.arena_allocations), ("reuse.tdz", lambda: ch.buffers.allocations)):
        tddist.save(make(rank, 1), work / target, comm=comm, return_early=True).result(60)
        before = count()
        assert before > 0, f"the first asynchronous save to {target} allocated nothing on this channel"
        tddist.save(make(rank, 2), work / target, comm=comm, return_early=True).result(60)
        assert count() == before, (target, before, count())
        full = tddist.load(work / target, shard="saved")
        assert torch.equal(full["w"], make(rank, 2)["w"])


def scenario_one_in_flight(work: Path, comm, rank: int, size: int) -> None:
    """A second save waits for the first by default, or raises SaveInProgressError if asked not to wait."""
    with _faults.inject("write", rank, "delay"):
        first = tddist.save(make(rank, 3), work / "a", return_early=True)
        try:
            tddist.save(make(rank, 4), work / "b", return_early=True, wait_for_pending=False)
        except tddist.errors.SaveInProgressError as e:
            assert "in flight" in str(e)
        else:
            raise AssertionError("a second save did not refuse to start while one was in flight")
        second = tddist.save(make(rank, 4), work / "b", return_early=True)  # waits for the first
        assert first.done()
    second.result(60)
    assert torch.equal(tddist.load(work / "a", shard="saved")["w"], make(rank, 3)["w"])
    assert torch.equal(tddist.load(work / "b", shard="saved")["w"], make(rank, 4)["w"])


def scenario_failure_fails_every_future(work: Path, comm, rank: int, size: int) -> None:
    """An error in the background on one rank fails every rank's future; nothing is committed."""
    target = work / "fail"
    tddist.save(make(rank, 5), target)
    with _faults.inject("write", size - 1, "raise"):
        fut = tddist.save(make(rank, 6), target, return_early=True)
        err = fut.exception(timeout=60)
    assert isinstance(err, tddist.errors.InjectedFault), repr(err)
    assert f"rank {size - 1}" in str(err)
    assert torch.equal(tddist.load(target, shard="saved")["w"], make(rank, 5)["w"])


def scenario_budget_streams(work: Path, comm, rank: int, size: int) -> None:
    """A shard four times the budget streams through it; what was written is the shard at the call."""
    rows = 2048 + 64 * rank
    td = TensorDict(w=torch.arange(rows * 512, dtype=torch.float32).view(rows, 512) + rank, batch_size=[rows])
    expected = td.clone()  # 4 MiB and more per rank, budget 1 MiB
    fut = tddist.save(td, work / "budget", return_early=True, snapshot_budget=1024 * 1024)
    td["w"].mul_(-1)
    train = Training(comm)
    assert train.allreduce(1.0) == size
    out = fut.result(timeout=120)
    assert_td_equal(out, expected, f"rank {rank}: what the budgeted save returned")
    assert_td_equal(tddist.load(work / "budget", shard="saved", verify=True), expected, f"rank {rank}: budgeted")


def scenario_streamed_with_replicas(work: Path, comm, rank: int, size: int) -> None:
    """Streamed saves (through a budget, and a whole state pipelined through the arena) of state that
    holds replicated leaves, which only rank 0 writes: the other ranks still hash their small replicas
    for rank 0 to compare, and the checkpoint holds every value as of the call."""
    rows = 1024 + 64 * rank
    td = TensorDict(
        w=torch.arange(rows * 1024, dtype=torch.float32).view(rows, 1024) + rank,  # 4 MiB and more, sharded
        lr=torch.tensor(0.5),  # replicated, small: hashed by every rank
        emb=torch.arange(300_000, dtype=torch.float32),  # replicated, over the hashed size
    )
    for budget in (1024 * 1024, None):
        expected = td.clone()
        target = work / f"replicas-{budget}"
        fut = tddist.save(td, target, return_early=True, snapshot_budget=budget, placements={"w": tddist.Shard(0)})
        td.apply_(lambda t: t.add_(1))
        out = fut.result(timeout=120)
        assert_td_equal(out, expected, f"rank {rank}: what the streamed save returned (budget {budget})")
        back = tddist.load(target, shard="saved", verify=True)
        assert_td_equal(back, expected, f"rank {rank}: streamed save with replicas (budget {budget})")


def fell_back_to_threads(work: Path, comm, rank: int) -> bool:
    """Under MPI the thread writer does a process-writer save (docs/parameters.md): check that, and say so."""
    if type(comm).__name__ == "TorchComm":
        return False
    out = tddist.save(make(rank, 13), work / "proc", return_early=True, async_writer="process", comm=comm).result(120)
    assert_td_equal(out, make(rank, 13), f"rank {rank}: process writer falling back to a thread")
    assert channel(comm)._process is None
    return True


def scenario_process_writer_killed(work: Path, comm, rank: int, size: int) -> None:
    """SIGKILL of the last rank's writer process during a save: every rank's future fails with CommError
    (no hang), the target keeps the previous checkpoint, and the next process save works again."""
    if fell_back_to_threads(work, comm, rank):
        return
    import os
    import signal

    target = work / "killed"
    tddist.save(make(rank, 10), target)
    os.environ[_faults.ENV] = ",".join(f"write:{r}:delay" for r in range(size))  # the writers inherit it
    try:
        fut = tddist.save(make(rank, 11), target, return_early=True, async_writer="process", comm=comm)
    finally:
        del os.environ[_faults.ENV]
    writer = channel(comm)._process
    assert writer is not None and writer.alive()
    if rank == size - 1:
        time.sleep(0.5)  # the writers are in the commit (each sleeps a second at 'write')
        os.kill(writer.process.pid, signal.SIGKILL)
    err = fut.exception(timeout=120)
    assert isinstance(err, tddist.errors.CommError), repr(err)
    comm.barrier()
    assert_td_equal(tddist.load(target, shard="saved", verify=True), make(rank, 10), f"rank {rank}: after the kill")
    out = tddist.save(make(rank, 12), target, return_early=True, async_writer="process", comm=comm).result(timeout=120)
    assert_td_equal(out, make(rank, 12), f"rank {rank}: the save after the kill")
    assert channel(comm)._process is not writer


def scenario_process_writer(work: Path, comm, rank: int, size: int) -> None:
    """The process writer: changes after save returns do not reach the checkpoint; the arena is reused."""
    if fell_back_to_threads(work, comm, rank):
        return
    td = make(rank, 13)
    train = Training(comm)
    for step in range(2):
        expected = td.clone()
        fut = tddist.save(td, work / "proc", return_early=True, async_writer="process", comm=comm)
        td["w"].add_(1.0)
        assert train.allreduce(1.0) == size
        assert_td_equal(fut.result(timeout=120), expected, f"rank {rank}: process writer, step {step}")
        assert_td_equal(tddist.load(work / "proc", shard="saved", verify=True), expected, f"rank {rank}: step {step}")
    writer = channel(comm)._process
    assert writer is not None
    writer.close()  # the writer's group is freed before it exits: it ends with 0, not with gloo's abort at exit
    assert writer.process.returncode == 0, f"rank {rank}: the writer process exited with {writer.process.returncode}"
    channel(comm)._process = None


SCENARIOS = [
    scenario_snapshot_and_training,
    scenario_process_writer_killed,
    scenario_process_writer,
    scenario_budget_streams,
    scenario_streamed_with_replicas,
    scenario_buffers_reused,
    scenario_one_in_flight,
    scenario_failure_fails_every_future,
]


def main() -> None:
    work = Path(sys.argv[1])
    comm = resolve(None, timeout=60)
    rank, size = comm.rank, comm.size
    failures = {}
    for scenario in SCENARIOS:
        comm.barrier()
        try:
            scenario(work, comm, rank, size)
        except Exception:
            failures[scenario.__name__] = traceback.format_exc()
    for scenario in PARAMETER_SCENARIOS:  # comm=None: each save detects the communicator
        comm.barrier()
        try:
            scenario(None, work / "params", rank, size)
        except Exception:
            failures[scenario.__name__] = traceback.format_exc()
    comm.barrier()
    tddist.save(make(rank, 7), work / "exit", return_early=True, num_threads=2)
    write_report(rank, "failed" if failures else "ok", failures=failures, comm=type(comm).__name__)
    # leave with the save in flight: the interpreter must wait for it


if __name__ == "__main__":
    main()
