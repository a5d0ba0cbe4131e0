"""Stateful objects, per-rank state and restore options, on real multi-rank jobs and in one process.

The jobs (tests/stateful_rank.py under torchrun) save a model, AdamW, a
warmup + cosine schedule, a resumable sampler and per-rank RNGs through
CheckpointManager on 2 ranks, restore them on 2 ranks and on 3 (each
``per_rank`` policy and the default error); every rank's exit code and
report are checked. The root lock is taken by a real second process and
freed by SIGKILL.
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from tensordict import TensorDict

import tddist
from tddist.comm.base import LocalComm
from tddist.jobs.manager import CheckpointManager
from tests.helpers import second_manager_refusals
from tests.launch_util import REPO, run_job
from tests.stateful_rank import STEPS, Sampler, objects, position, rng_after, train_step

SCRIPT = Path(__file__).with_name("stateful_rank.py")


def test_per_rank_and_stateful_state_through_the_manager_on_2_then_3_ranks(tmp_path: Path) -> None:
    job = run_job("torchrun", 2, SCRIPT, [str(tmp_path), "save"], tmp_path / "r2", timeout=240)
    job.assert_ok(2)
    assert [job.reports[r]["position"] for r in range(2)] == [position(r, STEPS) for r in range(2)]
    m = tddist.read_manifest(tmp_path / "ckpt" / "step-000000003")
    assert isinstance(m.leaves[("rng", "gen")].placement, tddist.PerRank)
    assert m.leaves[("rng", "gen")].shape[0] == 2 and m.objects[("sampler", "position")].declared
    whole = tddist.load(tmp_path / "ckpt" / "step-000000003", shard=None)  # the ranks' values stacked
    assert all(torch.equal(whole["rng", "gen"][r], rng_after(r, STEPS)) for r in range(2))

    job = run_job("torchrun", 3, SCRIPT, [str(tmp_path), "reload"], tmp_path / "r3", timeout=240)
    job.assert_ok(3)
    assert [job.reports[r]["position"] for r in range(3)] == [position(r % 2, STEPS) for r in range(3)]
    assert len({job.reports[r]["lr"] for r in range(3)}) == 1


_HOLDER = """
import sys, time
from tddist.jobs.manager import CheckpointManager
mgr = CheckpointManager(sys.argv[1], preempt_signal=None)
print("locked", flush=True)
time.sleep(600)
"""


def test_root_lock_refuses_a_second_live_job_and_is_freed_when_the_holder_is_killed(tmp_path: Path) -> None:
    root = tmp_path / "ckpt"
    root.mkdir()
    env = dict(os.environ, PYTHONPATH=str(REPO))
    holder = subprocess.Popen(
        [sys.executable, "-c", _HOLDER, str(root)], stdout=subprocess.PIPE, text=True, env=env, start_new_session=True
    )
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "locked"
        with pytest.raises(tddist.RootLockedError) as e:
            CheckpointManager(root, comm=LocalComm(), preempt_signal=None)
        assert f"pid {holder.pid}" in str(e.value) and socket.gethostname() in str(e.value)

        messages = second_manager_refusals(root)  # two ranks: rank 0 takes the lock, every rank raises the same error
        assert messages[0] and messages[0] == messages[1] and f"pid {holder.pid}" in messages[0], messages
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait(timeout=60)
    with CheckpointManager(root, comm=LocalComm(), preempt_signal=None) as mgr:  # freed by the kernel
        mgr.save(1, {"x": torch.ones(2)})
    assert tddist.read_manifest(root / "step-000000001").metadata["step"] == 1


def test_get_state_and_set_state_of_a_mapping_of_stateful_objects() -> None:
    trained = objects(0)
    for s in range(STEPS):
        train_step(trained, s)
    state = tddist.get_state(trained)
    assert set(state.keys()) == {"model", "optim", "sched", "sampler", "rng"}
    assert state["sched", "last_epoch"] == STEPS and state["sampler", "seen"] == [0, STEPS]
    fresh = objects(0)
    tddist.set_state(fresh, state)
    assert fresh["sched"].last_epoch == STEPS and fresh["sched"].get_last_lr() == trained["sched"].get_last_lr()
    assert fresh["sampler"].position == STEPS and torch.equal(fresh["rng"].gen.get_state(), rng_after(0, STEPS))
    assert all(torch.equal(a, b) for a, b in zip(fresh["model"].parameters(), trained["model"].parameters()))
    with pytest.raises(tddist.InvalidDataError, match="optimizes parameters of none of the modules"):
        tddist.get_state({"optim": trained["optim"]})


def test_manager_restores_a_callable_state_and_reports_what_it_loaded(tmp_path: Path, caplog) -> None:
    calls = []
    sampler = Sampler(0)

    def state():
        calls.append(1)
        return {"sampler": sampler, "w": torch.full((3,), float(sampler.position))}

    with CheckpointManager(tmp_path / "ckpt", every=2, comm=LocalComm(), preempt_signal=None) as mgr:
        for s in range(4):
            sampler.advance()
            mgr.step(s + 1, state)
    assert len(calls) == 2  # only the steps that saved
    fresh = Sampler(0)
    w = torch.zeros(3)
    with CheckpointManager(tmp_path / "ckpt", comm=LocalComm(), preempt_signal=None) as mgr:
        r = mgr.restore(lambda: {"sampler": fresh, "w": w})
        assert r == 4 and f"{r}" == "4" and r.report.ok and ("sampler", "position") in r.report.loaded
        assert fresh.position == 4 and torch.equal(w, torch.full((3,), 4.0))
        with pytest.raises(tddist.CheckpointNotFoundError, match="no checkpoint of step 3"):
            mgr.restore({"sampler": fresh, "w": w}, step=3)


def test_load_side_errors_are_tddist_errors_that_do_not_name_save(tmp_path: Path) -> None:
    tddist.save(TensorDict(w=torch.ones(2), batch_size=[]), tmp_path / "c")
    with pytest.raises(tddist.InvalidArgumentError) as e:
        tddist.load(tmp_path / "c", into=torch.nn.Linear(2, 2))
    assert "save(" not in str(e.value) and "tddist.get_state" in str(e.value)
    if not torch.cuda.is_available():
        with pytest.raises(tddist.InvalidArgumentError, match="CUDA is not available"):
            tddist.load(tmp_path / "c", device="cuda")
    with pytest.raises(tddist.InvalidArgumentError, match="not in"):
        tddist.load(tmp_path / "c", exclude=["nope"])
    with pytest.raises(tddist.InvalidArgumentError, match="per_rank="):
        tddist.load(tmp_path / "c", per_rank="everyone")


def test_a_meta_tensor_is_refused_by_name(tmp_path: Path) -> None:
    with pytest.raises(tddist.InvalidDataError, match=r"leaf \['w'\] is a tensor on the meta device.*materialise"):
        tddist.save({"w": torch.empty(3, device="meta")}, tmp_path / "c")
    assert not (tmp_path / "c").exists()


def test_per_rank_placement_errors(tmp_path: Path) -> None:
    with pytest.raises(tddist.InvalidArgumentError, match="PerRank"):
        tddist.save({"w": torch.ones(2)}, tmp_path / "a", placements={"nope": tddist.PerRank()})

    def differing_shapes(comm):
        try:
            tddist.save(
                {"s": torch.zeros(comm.rank + 1)}, tmp_path / "b", comm=comm, placements={"s": tddist.PerRank()}
            )
        except tddist.ShardingError as err:
            return str(err)
        return None

    messages = tddist.run_threads(2, differing_shapes)
    assert all(m and "per-rank leaf 's' has different shapes" in m for m in messages), messages


def test_missing_root_is_not_created_until_the_first_save(tmp_path: Path, caplog) -> None:
    root = tmp_path / "typo" / "ckpt"
    with caplog.at_level(logging.WARNING, logger="tddist"):
        with CheckpointManager(root, comm=LocalComm(), preempt_signal=None) as mgr:
            assert mgr.restore({"w": torch.zeros(1)}) == 0
            assert not root.parent.exists()
            mgr.save(5, {"w": torch.zeros(1)})
    assert any(str(root) in r.getMessage() and "does not exist" in r.getMessage() for r in caplog.records)
    assert (root / "step-000000005").is_dir()
