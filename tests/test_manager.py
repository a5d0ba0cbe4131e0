"""CheckpointManager: step directories, retention, resume, preemption.

In-process tests use one process or thread ranks. Multi-rank tests run
tests/manager_rank.py on real processes (crashes by SIGKILL, a real SIGUSR1
sent to one rank during an asynchronous save) and launch/train.py through
the launch/ wrappers: torchrun over two agents on loopback, then one agent
with 3 ranks, then mpiexec.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
import torch

import tddist
from tddist import _faults
from tddist import format as fmt
from tddist.jobs.manager import CheckpointManager, parse_signals
from tddist.jobs.retention import newest_checkpoint, parse_step, step_name
from tests.helpers import MANAGER_LOCK, assert_td_equal, leftovers
from tests.launch_util import REPO, Job, _communicate, _env, _reports, free_port, run_job
from tests.manager_rank import expected, local_state

SCRIPT = Path(__file__).with_name("manager_rank.py")


def steps_in(root: Path) -> list[int]:
    return sorted(s for s in map(parse_step, os.listdir(root)) if s is not None)


def assert_checkpoint(root: Path, step: int) -> None:
    full = tddist.load(root / step_name(step), shard=None, verify=True)
    assert_td_equal(full, expected(step), f"checkpoint of step {step}")
    assert tddist.read_manifest(root / step_name(step)).metadata["step"] == step


# --- one process and thread ranks ----------------------------------------------------------


def test_latest_ignores_leftovers_and_torn_checkpoints(tmp_path: Path) -> None:
    root = tmp_path / "ckpt"
    for step in (10, 20):
        tddist.save(local_state(0, 1, step), root / step_name(step), metadata={"step": step})
    hexid = uuid.uuid4().hex
    (root / f".{step_name(30)}.tddist-staging-{hexid}" / "rank-00000").mkdir(parents=True)  # crashed save
    (root / f".{step_name(5)}.tddist-trash-{hexid}").mkdir()  # crashed deletion
    torn = root / step_name(40) / "rank-00000"  # atomic=False save cut off before its manifest
    torn.mkdir(parents=True)
    (torn / "w.memmap").write_bytes(b"\0" * 16)
    bad = root / step_name(50)  # a manifest that does not parse: skipped, never deleted
    bad.mkdir()
    (bad / fmt.MANIFEST_NAME).write_text("{not json")
    foreign = root / step_name(60)  # not ours: skipped, never deleted
    foreign.mkdir()
    (foreign / "notes.txt").write_text("mine")
    (root / "README").write_text("user file")

    assert newest_checkpoint(str(root)) == (str(root / step_name(20)), 20)
    mgr = CheckpointManager(root, preempt_signal=None)  # cleans up at start
    assert mgr.latest() == str(root / step_name(20))
    assert leftovers(root / "*") == [], "staging and trash leftovers were not removed"  # of any checkpoint
    assert steps_in(root) == [10, 20, 50, 60]
    assert (foreign / "notes.txt").read_text() == "mine" and (root / "README").exists()
    state = local_state(0, 1, 0)
    assert mgr.restore(state) == 20
    assert_td_equal(state, local_state(0, 1, 20), "state restored from step 20")


def test_restore_without_checkpoint_returns_zero(tmp_path: Path) -> None:
    mgr = CheckpointManager(tmp_path / "empty", preempt_signal=None)
    state = local_state(0, 1, 3)
    assert mgr.latest() is None and mgr.restore(state) == 0
    assert_td_equal(state, local_state(0, 1, 3), "state after restore without a checkpoint")


def test_retention_and_resume_on_other_thread_world(tmp_path: Path) -> None:
    root = tmp_path / "ckpt"

    def first(comm):
        mgr = CheckpointManager(root, every=2, keep_last=2, comm=comm, preempt_signal=None)
        state = local_state(comm.rank, comm.size, 0)
        saved = []
        for s in range(mgr.restore(state), 7):
            state["rows", "w"].add_(1)
            state["count"].add_(1)
            saved.append(mgr.step(s + 1, state))
        mgr.close()
        return saved

    results = tddist.run_threads(4, first)
    assert results[0] == [False, True, False, True, False, True, False], results
    assert steps_in(root) == [4, 6]

    def second(comm):
        mgr = CheckpointManager(root, every=2, keep_last=2, comm=comm, preempt_signal=None)
        state = local_state(comm.rank, comm.size, 0)
        start = mgr.restore(state)
        assert_td_equal(state, local_state(comm.rank, comm.size, 6), f"rank {comm.rank}: state restored")
        return start, True

    assert tddist.run_threads(3, second) == [(6, True)] * 3
    assert_checkpoint(root, 6)


def test_preemption_request_on_one_rank_stops_all_at_the_same_step(tmp_path: Path) -> None:
    def body(comm):
        mgr = CheckpointManager(tmp_path / "ckpt", every=10, comm=comm, async_save=True, preempt_signal=None)
        state = local_state(comm.rank, comm.size, 0)
        for s in range(20):
            state["rows", "w"].add_(1)
            state["count"].add_(1)
            if comm.rank == 1 and s == 2:
                mgr.request_preemption()
            mgr.step(s + 1, state)
            if mgr.should_stop:
                return s + 1
        return None

    assert tddist.run_threads(3, body) == [3, 3, 3]
    assert steps_in(tmp_path / "ckpt") == [3]
    assert_checkpoint(tmp_path / "ckpt", 3)


def test_real_signal_in_one_process_and_handlers_restored(tmp_path: Path) -> None:
    before = signal.getsignal(signal.SIGUSR2)
    with CheckpointManager(tmp_path / "ckpt", every=100, preempt_signal="USR1,SIGUSR2") as mgr:
        state = local_state(0, 1, 0)
        assert not mgr.step(1, state)
        os.kill(os.getpid(), signal.SIGUSR2)
        assert mgr.step(2, state) and mgr.should_stop
    assert signal.getsignal(signal.SIGUSR2) is before
    assert steps_in(tmp_path / "ckpt") == [2]


def test_async_retention_keeps_the_previous_checkpoint_until_the_next_commits(tmp_path: Path) -> None:
    root = tmp_path / "ckpt"
    mgr = CheckpointManager(root, every=1, keep_last=1, async_save=True, preempt_signal=None)
    state = local_state(0, 1, 0)
    for s in range(2):
        state["count"].add_(1)
        state["rows", "w"].add_(1)
        mgr.step(s + 1, state)
    mgr.wait()
    assert steps_in(root) == [2]
    with _faults.inject("write", 0, "delay"):
        state["count"].add_(1)
        state["rows", "w"].add_(1)
        mgr.step(3, state)
        assert steps_in(root) == [2], "the committed checkpoint went away while the next save was in flight"
        mgr.wait()
    assert steps_in(root) == [3] and leftovers(root / "step-*", strict=True) == []
    with _faults.inject("write", 0, "raise"):
        mgr.save(4, local_state(0, 1, 4))  # fails in the background
        with pytest.raises(tddist.errors.InjectedFault):
            mgr.wait()
    assert steps_in(root) == [3] and leftovers(root / "step-*", strict=True) == []
    assert_checkpoint(root, 3)
    mgr.save(4, local_state(0, 1, 4))  # the manager carries on after a failed save
    mgr.close()
    assert steps_in(root) == [4]
    assert_checkpoint(root, 4)


def test_async_retention_runs_on_the_saves_thread_not_the_training_thread(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With ``async_save``, the old checkpoints are deleted by the save's background thread once it committed:
    training steps go on while a deletion is still running, and ``wait()`` returns only after it."""
    import threading

    import tddist.jobs.manager

    gate, deleted_on = threading.Event(), []
    real = tddist.jobs.manager.delete_checkpoint

    def held_delete(path: str) -> None:
        deleted_on.append(threading.current_thread())
        assert gate.wait(60), "the test never opened the gate"
        real(path)

    monkeypatch.setattr(tddist.jobs.manager, "delete_checkpoint", held_delete)
    root = tmp_path / "ckpt"
    mgr = CheckpointManager(root, every=2, keep_last=1, async_save=True, preempt_signal=None)
    mgr.step(2, local_state(0, 1, 2))
    mgr.wait()
    assert steps_in(root) == [2] and not deleted_on
    mgr.step(4, local_state(0, 1, 4))
    deadline = time.monotonic() + 60
    while not deleted_on and time.monotonic() < deadline:  # step 4 committed; its thread deletes step 2
        time.sleep(0.01)
    assert deleted_on and deleted_on[0] is not threading.main_thread()
    assert mgr.step(5, local_state(0, 1, 5)) is False  # a training step does not wait for the deletion
    waited = threading.Thread(target=mgr.wait)
    waited.start()
    waited.join(0.3)
    assert waited.is_alive(), "wait() returned while the retention after the save was still running"
    gate.set()
    waited.join(60)
    assert not waited.is_alive() and steps_in(root) == [4]
    assert_checkpoint(root, 4)
    mgr.close()


def test_model_optimizer_pair_and_archives(tmp_path: Path) -> None:
    def build():
        torch.manual_seed(0)
        model = torch.nn.Linear(4, 3)
        return model, torch.optim.Adam(model.parameters(), lr=0.1)

    model, optim = build()
    mgr = CheckpointManager(tmp_path / "ckpt", every=2, keep_last=1, preempt_signal=None, save_kwargs={"archive": True})
    for s in range(mgr.restore((model, optim)), 4):
        model(torch.ones(2, 4)).sum().backward()
        optim.step()
        mgr.step(s + 1, (model, optim))
    assert sorted(os.listdir(tmp_path / "ckpt")) == [MANAGER_LOCK, step_name(4, archive=True)]
    fresh, fresh_optim = build()
    assert mgr.restore((fresh, fresh_optim)) == 4
    assert torch.equal(fresh.weight, model.weight) and torch.equal(fresh.bias, model.bias)
    assert torch.equal(fresh_optim.state_dict()["state"][0]["exp_avg"], optim.state_dict()["state"][0]["exp_avg"])


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(keep_last=0),
        dict(every=-1),
        dict(every=1.5),
        dict(save_kwargs={"return_early": True}),
        dict(preempt_signal="NOPE"),
    ],
)
def test_invalid_arguments(tmp_path: Path, kwargs: dict) -> None:
    with pytest.raises(tddist.InvalidArgumentError):
        CheckpointManager(tmp_path, **kwargs)


def test_parse_signals() -> None:
    assert parse_signals(None) == []
    assert parse_signals(signal.SIGUSR1) == [signal.SIGUSR1]
    assert parse_signals("USR1, SIGTERM") == [signal.SIGUSR1, signal.SIGTERM]
    assert parse_signals([signal.SIGUSR2, "HUP"]) == [signal.SIGUSR2, signal.SIGHUP]


# --- real processes ------------------------------------------------------------------------------


def spawn(nproc: int, args: list[str], report_dir: Path) -> list[subprocess.Popen]:
    """Start ``nproc`` ranks of manager_rank.py with torchrun's environment; each rank's pid is known."""
    report_dir.mkdir(parents=True, exist_ok=True)
    env = _env({"TDDIST_REPORT_DIR": str(report_dir), "TDDIST_TIMEOUT": "60"})
    port = free_port()
    return [
        subprocess.Popen(
            [sys.executable, str(SCRIPT), *args],
            env=dict(
                env,
                RANK=str(r),
                LOCAL_RANK=str(r),
                WORLD_SIZE=str(nproc),
                MASTER_ADDR="127.0.0.1",
                MASTER_PORT=str(port),
            ),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            start_new_session=True,
            cwd=str(REPO),
        )
        for r in range(nproc)
    ]


@pytest.mark.multirank
def test_crashes_retention_and_resume_on_other_world_sizes(tmp_path: Path) -> None:
    """2 ranks crash in the middle of a save, 3 ranks resume and crash after a commit, 1 rank finishes."""
    root = tmp_path / "ckpt"
    job = run_job(
        "spawn", 2, SCRIPT, [str(tmp_path), "crash-write"], tmp_path / "r1", timeout=120, env={"TDDIST_TIMEOUT": "60"}
    )
    assert job.returncodes[1] == -signal.SIGKILL, job.output[-3000:]
    assert 1 not in job.reports, "rank 1 was killed before it could report"
    assert job.returncodes[0] == 1 and job.reports[0]["error_class"] in ("CommError", "CommTimeoutError"), job.output[
        -3000:
    ]
    assert steps_in(root) == [4, 5]
    left = leftovers(root / "*")
    assert [kind for kind, _ in fmt.side_entries(str(root / step_name(6)))] == ["staging"], left

    job = run_job(
        "spawn", 3, SCRIPT, [str(tmp_path), "crash-publish"], tmp_path / "r2", timeout=120, env={"TDDIST_TIMEOUT": "60"}
    )
    assert job.returncodes[0] == -signal.SIGKILL, job.output[-3000:]
    assert job.returncodes[1:] == [1, 1], job.output[-3000:]
    assert 0 not in job.reports, "rank 0 was killed before it could report"
    for r in (1, 2):  # rank 0 died in the middle of the commit: each other rank saw it, and said so
        rep = job.reports.get(r, {})
        assert rep.get("status") == "failed" and rep.get("error_class") in ("CommError", "CommTimeoutError"), (
            f"rank {r}: {rep}\n{job.output[-3000:]}"
        )
    assert steps_in(root) == [5, 6, 7], "step 7 was published before the crash; retention had not run yet"
    for step in (5, 6, 7):
        assert_checkpoint(root, step)

    job = run_job("spawn", 1, SCRIPT, [str(tmp_path), "finish"], tmp_path / "r3", timeout=120)
    job.assert_ok(1)
    assert job.reports[0]["start"] == 7
    assert steps_in(root) == [8, 9] and leftovers(root / "step-*", strict=True) == []
    assert_checkpoint(root, 9)


@pytest.mark.multirank
def test_signal_during_async_save(tmp_path: Path) -> None:
    """SIGUSR1 to rank 1 alone while a save is in flight: both ranks save the same step and exit 75."""
    procs = spawn(2, [str(tmp_path), "signal"], tmp_path / "reports")
    marker = tmp_path / "inflight"
    deadline = time.monotonic() + 90
    while not marker.exists() and time.monotonic() < deadline and all(p.poll() is None for p in procs):
        time.sleep(0.02)
    if marker.exists():
        os.kill(procs[1].pid, signal.SIGUSR1)
        (tmp_path / "signalled").write_text("")  # the ranks wait for this before their next step
    rcs, output = _communicate(procs, timeout=max(10, deadline - time.monotonic()))
    job = Job(rcs, output, _reports(tmp_path / "reports"))
    assert marker.exists(), f"no save was started\n{output[-3000:]}"
    assert rcs == [75, 75], f"exit codes {rcs}\n{output[-3000:]}"
    assert all(job.reports.get(r, {}).get("status") == "ok" for r in (0, 1)), job.reports
    stops = {r: job.reports[r]["stopped"] for r in (0, 1)}
    assert len(set(stops.values())) == 1, f"ranks stopped at different steps: {stops}"
    assert job.reports[1]["in_flight_at_stop"], "the signal did not arrive during a save"
    stop, first = stops[0], int(marker.read_text())
    assert first < stop < first + 20, (first, stop)
    root = tmp_path / "ckpt"
    assert steps_in(root) == [first, stop] and leftovers(root / "step-*", strict=True) == []
    assert_checkpoint(root, first)
    assert_checkpoint(root, stop)


# --- launch/ wrappers with launch/train.py -------------------------------------------------------


def launch(script: str, args: list[str], env: dict) -> subprocess.Popen:
    """Start ``launch/<script> args`` in its own session (``_communicate`` kills it on timeout)."""
    return subprocess.Popen(
        ["bash", str(REPO / "launch" / script), *args],
        env=_env({"PYTHON": sys.executable, **env}),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )


def finished(output: str, world: int, step: int) -> None:
    for r in range(world):
        assert f"rank {r}/{world}: exit 0 at step={step}" in output, f"rank {r} did not finish\n{output[-4000:]}"


def digests(output: str, kind: str) -> dict[int, str]:
    return {int(s): d for s, d in re.findall(rf"^{kind} step=(\d+) digest=(\w+)$", output, re.M)}


@pytest.mark.multirank
def test_launchers_multinode_then_other_world_sizes(tmp_path: Path) -> None:
    """Two torchrun agents (2 ranks each) on loopback save; one agent with 3 ranks resumes; then mpiexec."""
    ckpt = str(tmp_path / "ckpt")
    multinode = {"NNODES": "2", "NPROC": "2", "RDZV_ENDPOINT": f"127.0.0.1:{free_port()}", "RDZV_ID": uuid.uuid4().hex}
    agents = [launch("multinode.sh", ["--ckpt", ckpt, "--steps", "12", "--every", "4"], multinode) for _ in range(2)]
    rcs, out = _communicate(agents, timeout=240)
    assert rcs == [0, 0], f"agent exit codes {rcs}\n{out[-6000:]}"
    finished(out, 4, 12)
    saved = digests(out, "saved")
    assert sorted(saved) == [4, 8, 12] and steps_in(tmp_path / "ckpt") == [4, 8, 12]

    rcs, out = _communicate(
        [launch("torchrun.sh", ["--ckpt", ckpt, "--steps", "20", "--every", "4"], {"NPROC": "3"})], 240
    )
    assert rcs == [0], out[-6000:]
    finished(out, 3, 20)
    assert digests(out, "resumed") == {12: saved[12]}, out[-4000:]
    saved = digests(out, "saved")

    rcs, out = _communicate(
        [launch("mpiexec.sh", ["--ckpt", ckpt, "--steps", "24", "--every", "4", "--async-save"], {"NPROC": "2"})], 240
    )
    assert rcs == [0], out[-6000:]
    finished(out, 2, 24)
    assert "MPI launch" in out and digests(out, "resumed") == {20: saved[20]}, out[-4000:]
    assert steps_in(tmp_path / "ckpt") == [16, 20, 24]
