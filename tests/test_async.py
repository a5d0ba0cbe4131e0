"""Asynchronous saves (return_early=True) on real torchrun/gloo and mpiexec ranks.

One job per (launcher, world size) runs every scenario of tests/async_rank.py,
then exits with one more save in flight; the test checks every rank's report
and that this last checkpoint was committed complete.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import tddist
from tests.async_rank import make
from tests.helpers import assert_td_equal, leftovers
from tests.launch_util import run_job

SCRIPT = Path(__file__).with_name("async_rank.py")


@pytest.mark.multirank
@pytest.mark.parametrize(
    "launcher,nproc,comm",
    [("torchrun", 2, "TorchComm"), ("torchrun", 4, "TorchComm"), ("mpiexec", 2, "MPIComm")],
)
def test_async_save_on_real_ranks(tmp_path: Path, launcher: str, nproc: int, comm: str) -> None:
    job = run_job(launcher, nproc, SCRIPT, [str(tmp_path / "work")], tmp_path / "reports", timeout=240)
    job.assert_ok(nproc)
    assert {r["comm"] for r in job.reports.values()} == {comm}
    # the save left in flight at exit was completed, not cut off
    full = tddist.load(tmp_path / "work" / "exit", shard=None, verify=True)
    assert_td_equal(full, torch.cat([make(r, 7) for r in range(nproc)]), "the save in flight at exit")
    assert leftovers(tmp_path / "work" / "exit") == [], "leftovers beside a completed save"


def test_async_save_thread_ranks(tmp_path: Path) -> None:
    """The same snapshot semantics with in-process thread ranks (no processes)."""

    def rank_fn(comm):
        td = make(comm.rank, 0)
        expected = td.clone()
        fut = tddist.save(td, tmp_path / "t", comm=comm, return_early=True)
        td["w"].zero_()
        out = fut.result(30)
        assert_td_equal(out, expected, f"rank {comm.rank}: what save returned")
        return True

    assert tddist.run_threads(3, rank_fn, timeout=60) == [True, True, True]
