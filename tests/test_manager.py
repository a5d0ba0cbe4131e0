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
from tests.helpers import MANAGER_LOCK, assert_td_equal, leftovers, second_manager_refusals
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

    import tddist.jobs.root_retention

    gate, deleted_on = threading.Event(), []
    real = tddist.jobs.root_retention.delete_checkpoint

    def held_delete(path: str) -> None:
        deleted_on.append(threading.current_thread())
        assert gate.wait(60), "the test never opened the gate"
        real(path)

    monkeypatch.setattr(tddist.jobs.root_retention, "delete_checkpoint", held_delete)
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


# --- retention rules, when to save, what the root holds ----------------------------------------------


def saved_metrics(root: Path, step: int) -> dict:
    return tddist.read_manifest(root / step_name(step)).metadata.get("metrics", {})


def test_keep_best_by_a_metric_combines_with_keep_last_and_survives_a_restart(tmp_path: Path) -> None:
    """Lightning's save_top_k/monitor, Orbax's best_fn: the 2 lowest val_loss plus the newest (keep_last=1);
    the values are stored in the manifests, so a new manager ranks what an earlier one saved."""
    root = tmp_path / "ckpt"
    losses = {1: 0.9, 2: 0.3, 3: 0.5, 4: 0.2, 5: 0.8}

    def first(comm):
        mgr = CheckpointManager(
            root, keep_last=1, keep_best=2, metric="val_loss", mode="min", every=1, comm=comm, preempt_signal=None
        )
        for s in range(1, 6):
            mgr.step(s, local_state(comm.rank, comm.size, s), metrics={"val_loss": losses[s], "acc": s / 10})
        mgr.close()
        return mgr.all_steps()

    assert tddist.run_threads(2, first) == [[2, 4, 5]] * 2
    assert steps_in(root) == [2, 4, 5]
    assert saved_metrics(root, 4) == {"val_loss": 0.2, "acc": 0.4}
    assert tddist.read_manifest(root / step_name(4)).metadata["step"] == 4

    # a new job: the old values come from the manifests. 0.25 is better than 0.3: step 2 goes,
    # and step 5 (0.8, no longer the newest nor among the best) goes too
    with CheckpointManager(root, keep_last=1, keep_best=2, metric="val_loss", preempt_signal=None) as mgr:
        mgr.save(6, local_state(0, 1, 6), metrics={"val_loss": torch.tensor(0.25)})
        assert mgr.all_steps() == [4, 6]
    # mode="max": the highest values are the best
    with CheckpointManager(root, keep_last=None, keep_best=1, metric="val_loss", mode="max",
                           preempt_signal=None) as mgr:  # fmt: skip
        mgr.save(7, local_state(0, 1, 7), metrics={"val_loss": 0.1})
        assert mgr.all_steps() == [6, 7]  # 0.25 is the best; 7 is the newest


def test_keep_best_never_removes_the_newest_checkpoint(tmp_path: Path) -> None:
    """keep_last=None with keep_best: only the best and the newest stay; the newest is kept though it is the worst;
    a step saved without the metric (or with NaN) is never among the best."""
    root = tmp_path / "ckpt"
    with CheckpointManager(root, keep_last=None, keep_best=1, metric="loss", preempt_signal=None) as mgr:
        for s, loss in ((1, 0.5), (2, 0.3), (3, 0.6)):
            mgr.save(s, local_state(0, 1, s), metrics={"loss": loss})
        assert steps_in(root) == [2, 3], "the newest step (3) is not among the best but must be kept"
        mgr.save(4, local_state(0, 1, 4), metrics={"loss": float("nan")})
        assert steps_in(root) == [2, 4] and saved_metrics(root, 4) == {"loss": "nan"}
        mgr.save(5, local_state(0, 1, 5))  # no metric: kept as the newest only
        mgr.save(6, local_state(0, 1, 6), metrics={"loss": 0.1})
        assert steps_in(root) == [6]
    assert_checkpoint(root, 6)


def test_keep_period_keeps_every_multiple_forever(tmp_path: Path) -> None:
    root = tmp_path / "ckpt"

    def body(comm):
        mgr = CheckpointManager(root, keep_last=2, keep_period=4, every=1, comm=comm, preempt_signal=None)
        return train_until(mgr, comm, 10)

    assert tddist.run_threads(3, body) == [[4, 8, 9, 10]] * 3
    with CheckpointManager(root, keep_last=None, keep_period=4, preempt_signal=None) as mgr:
        mgr.save(11, local_state(0, 1, 11))
        assert mgr.all_steps() == [4, 8, 11]


def train_state(state) -> None:
    state["rows", "w"].add_(1)
    state["count"].add_(1)


def train_until(mgr: CheckpointManager, comm, stop: int) -> list[int]:
    """Restore (or start) this rank's state, train and step up to ``stop``, close: the steps the root keeps."""
    state = local_state(comm.rank, comm.size, 0)
    for s in range(mgr.restore(state), stop):
        train_state(state)
        mgr.step(s + 1, state)
    mgr.close()
    return mgr.all_steps()


def test_save_interval_minutes_rank0_clock_decides(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Time-based saves: rank 0's clock decides and every rank saves at the same step, whatever its own clock."""
    import threading

    import tddist.jobs.schedule as schedule_module

    local = threading.local()
    start = time.monotonic()
    # each rank's clock: rank 0's runs 100 s per step; rank 1's never moves; rank 2's runs 10 minutes per step
    pace = {0: 100.0, 1: 0.0, 2: 600.0}
    monkeypatch.setattr(schedule_module, "_clock", lambda: start + pace[local.rank] * local.steps)

    def body(comm):
        local.rank, local.steps = comm.rank, 0
        mgr = CheckpointManager(tmp_path / f"ckpt{comm.size}", keep_last=None, every=7, save_interval_minutes=5,
                                comm=comm, preempt_signal=None)  # fmt: skip
        saved = []
        for s in range(1, 11):
            local.steps = s
            if mgr.step(s, local_state(comm.rank, comm.size, s)):
                saved.append(s)
        mgr.close()
        return saved

    # rank 0: 300 s pass at steps 3, 6 (after the save at 3), 7 by `every`, then 10 (300 s after 7)
    assert tddist.run_threads(3, body) == [[3, 6, 7, 10]] * 3
    assert steps_in(tmp_path / "ckpt3") == [3, 6, 7, 10]
    pace[0] = 0.0  # rank 0's clock stands still: only `every` saves, though rank 2's clock runs
    assert tddist.run_threads(3, body) == [[7]] * 3


def test_should_save_is_the_decision_step_takes(tmp_path: Path) -> None:
    """should_save(s) exchanges the flags once; the step(s) after it saves exactly when it said, on every rank,
    and a preemption requested on one rank makes it True everywhere."""

    def body(comm):
        mgr = CheckpointManager(tmp_path / "ckpt", keep_last=None, every=3, comm=comm, preempt_signal=None)
        answers, saved = [], []
        for s in range(1, 9):
            if comm.rank == 1 and s == 5:
                mgr.request_preemption()
            due = mgr.should_save(s)
            assert mgr.should_save(s) == due  # asked again: the same decision, no second exchange
            answers.append(due)
            metrics = {"val_loss": 1.0 / s} if due else None  # computed only when a save is due
            saved.append(mgr.step(s, local_state(comm.rank, comm.size, s), metrics=metrics))
            if mgr.should_stop:
                break
        mgr.close()
        return answers, saved

    results = tddist.run_threads(3, body)
    assert results == [([False, False, True, False, True], [False, False, True, False, True])] * 3, results
    assert steps_in(tmp_path / "ckpt") == [3, 5] and saved_metrics(tmp_path / "ckpt", 5) == {"val_loss": 0.2}


def test_all_steps_lists_the_committed_steps_on_every_rank(tmp_path: Path) -> None:
    root = tmp_path / "ckpt"
    for step in (30, 10, 20):
        tddist.save(local_state(0, 1, step), root / step_name(step), metadata={"step": step})
    hexid = uuid.uuid4().hex
    (root / f".{step_name(40)}.tddist-staging-{hexid}").mkdir()  # a crashed save: not a step
    (root / step_name(50)).mkdir()  # foreign files under a step name: not committed
    (root / step_name(50) / "notes.txt").write_text("mine")

    def body(comm):
        mgr = CheckpointManager(root, keep_last=None, comm=comm, preempt_signal=None)
        found = mgr.all_steps()
        mgr.close()
        return found

    assert tddist.run_threads(2, body) == [[10, 20, 30]] * 2
    assert CheckpointManager(tmp_path / "none", preempt_signal=None).all_steps() == []


def test_retention_never_deletes_a_checkpoint_a_restore_is_reading(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A restore of step 2 is in progress (held inside its load) while another manager of this process saves
    steps 3 with keep_last=1: step 2 stays until the restore has ended, and the restore gets step 2's data."""
    import threading

    import tddist.jobs.restore as restore_module

    root = tmp_path / "ckpt"
    with CheckpointManager(root, keep_last=None, preempt_signal=None) as mgr:
        for s in (1, 2):
            mgr.save(s, local_state(0, 1, s))
    entered, gate = threading.Event(), threading.Event()
    real_load = restore_module.load

    def held_load(*args, **kwargs):
        entered.set()
        assert gate.wait(60), "the test never opened the gate"
        return real_load(*args, **kwargs)

    monkeypatch.setattr(restore_module, "load", held_load)
    reader = CheckpointManager(root, keep_last=None, preempt_signal=None)
    state, result = local_state(0, 1, 0), []
    t = threading.Thread(target=lambda: result.append(reader.restore(state, step=2)))
    t.start()
    assert entered.wait(60)
    saver = CheckpointManager(root, keep_last=1, preempt_signal=None)
    saver.save(3, local_state(0, 1, 3))
    assert steps_in(root) == [2, 3], "retention deleted the checkpoint a restore is reading"
    gate.set()
    t.join(60)
    assert result == [2] and result[0].path == str(root / step_name(2))
    assert_td_equal(state, local_state(0, 1, 2), "the state restored while retention ran")
    saver.save(4, local_state(0, 1, 4))  # the restore has ended: step 2 goes now
    assert steps_in(root) == [4]
    saver.close()
    reader.close()


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(keep_best=2),  # no metric
        dict(keep_best=0, metric="loss"),
        dict(metric="loss"),  # a metric without keep_best
        dict(keep_best=1, metric="loss", mode="avg"),
        dict(keep_period=0),
        dict(save_interval_minutes=0),
        dict(save_interval_minutes="5"),
    ],
)
def test_invalid_retention_and_interval_options(tmp_path: Path, kwargs: dict) -> None:
    with pytest.raises(tddist.InvalidArgumentError):
        CheckpointManager(tmp_path, preempt_signal=None, **kwargs)


def test_invalid_metrics_are_refused_before_saving(tmp_path: Path) -> None:
    with CheckpointManager(tmp_path / "ckpt", keep_best=1, metric="loss", preempt_signal=None) as mgr:
        for bad in ({"loss": "low"}, {"loss": True}, {1: 0.5}, [("loss", 0.5)], {"loss": torch.ones(2)}):
            with pytest.raises(tddist.InvalidArgumentError, match="metrics"):
                mgr.save(1, local_state(0, 1, 1), metrics=bad)
    assert not (tmp_path / "ckpt").exists() or steps_in(tmp_path / "ckpt") == []


# --- on object storage (the real S3 server of tests/conftest.py) --------------------------------------


@pytest.fixture
def s3_root(s3, tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """(client, "BUCKET/PREFIX", root URL) in a fresh working directory; afterwards, no local directory named
    like the URL (``s3:``) may have appeared there or in the repository."""
    client, where = s3
    monkeypatch.chdir(tmp_path)
    yield client, where, f"s3://{where}/run"
    made = [str(p) for p in tmp_path.rglob("s3:*")] + [str(p) for p in REPO.glob("s3:*")]
    assert not made, f"a local directory named like the S3 root appeared: {made}"


def objects_under(client, where: str) -> list[str]:
    bucket, prefix = where.split("/", 1)
    pages = client.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix + "/")
    return sorted(o["Key"][len(prefix) + 1 :] for page in pages for o in page.get("Contents", []))


def s3_steps(client, where: str) -> list[int]:
    """The steps whose commit point (manifest object, or archive object) is in the bucket."""
    found = set()
    for key in objects_under(client, where):
        head, _, rest = key.partition("/")  # run/step-.../tddist.json or run/step-....tdz
        name, _, leaf = rest.partition("/")
        step = parse_step(name)
        if head == "run" and step is not None and (leaf == fmt.MANIFEST_NAME or name.endswith(".tdz")):
            found.add(step)
    return sorted(found)


def test_manager_on_s3_saves_retains_and_restores(s3_root) -> None:
    """An s3:// root: saves go to the bucket (none to a local directory), every retention rule applies there,
    the metrics are read back from the manifests by a new job, and 3 ranks restore what 2 saved."""
    client, where, root = s3_root
    losses = {1: 0.4, 2: 0.1, 3: 0.7, 4: 0.6, 5: 0.9, 6: 0.8, 7: 0.5}

    def first(comm):
        mgr = CheckpointManager(root, keep_last=2, keep_best=1, metric="val_loss", keep_period=3, every=1,
                                comm=comm, preempt_signal=None)  # fmt: skip
        state = local_state(comm.rank, comm.size, 0)
        assert mgr.restore(state) == 0
        for s in range(1, 8):
            train_state(state)
            mgr.step(s, state, metrics={"val_loss": losses[s]})
        mgr.close()
        return mgr.all_steps(), mgr.latest()

    # kept: 2 (best), 3 and 6 (period), 6 and 7 (last two)
    assert tddist.run_threads(2, first) == [([2, 3, 6, 7], f"{root}/{step_name(7)}")] * 2
    assert s3_steps(client, where) == [2, 3, 6, 7]
    assert tddist.read_manifest(f"{root}/{step_name(2)}").metadata["metrics"] == {"val_loss": 0.1}

    def second(comm):
        mgr = CheckpointManager(root, keep_last=1, keep_best=1, metric="val_loss", comm=comm, preempt_signal=None)
        state = local_state(comm.rank, comm.size, 0)
        start = mgr.restore(state)
        assert_td_equal(state, local_state(comm.rank, comm.size, 7), f"rank {comm.rank}: restored from S3")
        mgr.save(8, state, metrics={"val_loss": 0.3})  # step 2 (0.1, read back from its manifest) stays the best
        mgr.close()
        return int(start), start.path, mgr.all_steps()

    assert tddist.run_threads(3, second) == [(7, f"{root}/{step_name(7)}", [2, 8])] * 3
    assert s3_steps(client, where) == [2, 8]
    full = tddist.load(f"{root}/{step_name(8)}", shard=None, verify=True)
    assert_td_equal(full, expected(7), "step 8 holds the state restored at 7")
    assert [k for k in objects_under(client, where) if not k.startswith("run/step-")] == []  # the lease is gone


def test_manager_on_s3_archives_async_saves_and_preemption(s3_root) -> None:
    client, where, root = s3_root

    def body(comm):
        mgr = CheckpointManager(root, every=2, keep_last=1, async_save=True, save_kwargs={"archive": True},
                                comm=comm, preempt_signal=None)  # fmt: skip
        state = local_state(comm.rank, comm.size, 0)
        for s in range(mgr.restore(state), 20):
            train_state(state)
            if comm.rank == 1 and s + 1 == 5:
                mgr.request_preemption()
            mgr.step(s + 1, state)
            if mgr.should_stop:
                mgr.close()
                return s + 1
        raise AssertionError("not preempted")

    assert tddist.run_threads(2, body) == [5, 5]
    assert s3_steps(client, where) == [5]
    assert objects_under(client, where) == [f"run/{step_name(5, archive=True)}"]
    assert_td_equal(tddist.load(f"{root}/{step_name(5, archive=True)}", shard=None), expected(5), "preempted at 5")
    with CheckpointManager(root, save_kwargs={"archive": True}, preempt_signal=None) as mgr:
        state = local_state(0, 1, 0)
        assert mgr.restore(state) == 5 and mgr.latest() == f"{root}/{step_name(5, archive=True)}"
        assert_td_equal(state, local_state(0, 1, 5), "resumed after the preemption")


def test_manager_on_s3_cleans_what_interrupted_saves_and_deletions_left(s3_root, s3_env) -> None:
    """A save killed before its commit (an uncommitted generation), a deletion cut between the manifest and the
    data (a prefix of generations without a manifest) and an unfinished archive upload are removed at start;
    the committed checkpoints stay."""
    client, where, root = s3_root
    bucket, prefix = where.split("/", 1)
    for step in (1, 2):
        tddist.save(local_state(0, 1, step), f"{root}/{step_name(step)}", metadata={"step": step})
    code = f"import torch, tddist; tddist.save({{'x': torch.ones(1000)}}, {root + '/' + step_name(3)!r})"
    env = dict(os.environ, TDDIST_FAULT="validate:0:kill", PYTHONPATH=str(REPO))
    assert subprocess.run([sys.executable, "-c", code], env=env, timeout=120).returncode == -signal.SIGKILL
    client.delete_object(Bucket=bucket, Key=f"{prefix}/run/{step_name(1)}/{fmt.MANIFEST_NAME}")  # deletion cut
    client.create_multipart_upload(Bucket=bucket, Key=f"{prefix}/run/{step_name(4, archive=True)}")
    assert any(k.startswith(f"run/{step_name(3)}/tddist-gen-") for k in objects_under(client, where))

    with CheckpointManager(root, keep_last=None, preempt_signal=None) as mgr:
        assert mgr.all_steps() == [2] and mgr.latest() == f"{root}/{step_name(2)}"
    left = [k for k in objects_under(client, where) if not k.startswith(f"run/{step_name(2)}/")]
    assert left == [], left
    assert client.list_multipart_uploads(Bucket=bucket, Prefix=f"{prefix}/").get("Uploads", []) == []
    assert_td_equal(tddist.load(f"{root}/{step_name(2)}", shard=None), local_state(0, 1, 2), "step 2 kept")


_S3_HOLDER = """
import sys, time
import tddist.storage.s3.lease as lease
lease.LEASE_SECONDS = float(sys.argv[2])
from tddist.jobs.manager import CheckpointManager
mgr = CheckpointManager(sys.argv[1], preempt_signal=None)
mgr.save(1, {"x": __import__("torch").ones(2)})
print("locked", flush=True)
time.sleep(600)
"""


def test_s3_root_lease_refuses_a_second_live_job_and_is_taken_over_after_a_crash(s3_root) -> None:
    """The lease object: a live holder keeps renewing it (a second job is refused on every rank, naming its pid,
    also after several lease periods); once the holder is SIGKILLed, a new job takes the lease over."""
    from tddist.comm.base import LocalComm

    client, where, root = s3_root
    lease_s = 2.0
    holder = subprocess.Popen(
        [sys.executable, "-c", _S3_HOLDER, root, str(lease_s)], stdout=subprocess.PIPE, text=True,
        env=dict(os.environ, PYTHONPATH=str(REPO)), start_new_session=True,
    )  # fmt: skip
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "locked"
        assert "run/.tddist-manager.lock" in objects_under(client, where)
        time.sleep(3 * lease_s)  # only renewals keep it

        messages = second_manager_refusals(root)
        assert messages[0] and messages[0] == messages[1] and f"pid {holder.pid}" in messages[0], messages
        from tddist.jobs.cleanup import gc  # no pins on object storage: the clean-up waits for no live job

        with pytest.raises(tddist.RootLockedError, match=f"pid {holder.pid}"):
            gc(root, keep_last=1)
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait(timeout=60)
    begin = time.monotonic()
    with CheckpointManager(root, comm=LocalComm(), preempt_signal=None) as mgr:  # waits out the dead lease
        assert time.monotonic() - begin < 10 * lease_s
        mgr.save(2, {"x": torch.ones(2)})
        assert mgr.all_steps() == [1, 2]
    assert "run/.tddist-manager.lock" not in objects_under(client, where)  # released by close()
    with CheckpointManager(root, preempt_signal=None) as mgr:  # at once: nobody holds it
        assert mgr.latest() == f"{root}/{step_name(2)}"


def test_manager_on_s3_with_a_node_local_tier(s3_root, tmp_path: Path) -> None:
    """local_dir with an s3:// root: each save commits locally, the promotion commits to the bucket."""
    client, where, root = s3_root

    def body(comm):
        mgr = CheckpointManager(root, every=2, keep_last=1, local_dir=str(tmp_path / "local" / "{rank}"),
                                comm=comm, preempt_signal=None)  # fmt: skip
        return train_until(mgr, comm, 4)

    assert tddist.run_threads(2, body) == [[4]] * 2
    assert s3_steps(client, where) == [4]
    assert_td_equal(tddist.load(f"{root}/{step_name(4)}", shard=None, verify=True), expected(4), "promoted to S3")


@pytest.mark.parametrize(
    "kwargs, named",
    [
        (dict(save_kwargs={"snapshot_budget": 1 << 20}), "snapshot_budget"),
        (dict(save_kwargs={"atomic": False}), "atomic=False"),
        (dict(save_kwargs={"async_writer": "process"}), "async_writer"),
    ],
)
def test_manager_on_s3_refuses_what_object_storage_cannot_do(s3_root, kwargs: dict, named: str) -> None:
    _client, _where, root = s3_root
    with pytest.raises(tddist.InvalidArgumentError, match=named):
        CheckpointManager(root, preempt_signal=None, **kwargs)
    with pytest.raises(tddist.InvalidArgumentError, match="s3://bucket/prefix"):
        CheckpointManager("s3://only-a-bucket", preempt_signal=None)
    with pytest.raises(tddist.InvalidArgumentError, match="local_dir="):
        CheckpointManager(root, local_dir=root + "-local/{rank}", preempt_signal=None)  # never a local "s3:" dir


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
    # incremental=True: step 7 (3 ranks, as step 6) references step 6's unchanged chunk; the 1-rank job below
    # resumes from it through the reference
    inc = tddist.read_manifest(root / step_name(7))
    assert [h.name for h in inc.referenced()] == [step_name(6)]
    assert inc.leaves[("frozen",)].refs.holders.tolist() == [1]

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
