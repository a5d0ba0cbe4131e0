"""The slurm/ templates on a real single-node SLURM (tests/slurm_util.py).

Each template runs launch/train.py on 2 ranks. Once the first checkpoint is
saved the test sends the preemption signal as SLURM's ``--signal`` would:
``scancel --signal=USR1`` to the job steps, or ``--batch`` to the batch shell
for the template that traps it there. The job must save, requeue itself,
resume from the saved step with the same state (the same digest), possibly
on another number of tasks, and finish. The three jobs run at the same time
so their requeue delays overlap.
"""

from __future__ import annotations

import re
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

import tddist
from tests import slurm_util
from tests.helpers import leftovers, missing
from tests.launch_util import REPO, _env

pytestmark = pytest.mark.slurm

STEPS = 60
TRAIN_ARGS = ["--steps", str(STEPS), "--every", "5", "--step-time", "0.2"]


@dataclass
class Case:
    script: str
    options: list[str]  # sbatch options of the first run
    scancel: list[str]  # how the preemption signal is sent
    first_world: int
    resumed_world: int
    update: list[str]  # scontrol update of the requeued (pending) job, to change its size


CASES = {
    "torchrun": Case("torchrun.sbatch", ["--nodes=1", "--cpus-per-task=2"], ["--batch"], 2, 2, []),
    "srun": Case("srun.sbatch", ["--nodes=1", "--ntasks=2"], [], 2, 1, ["NumTasks=1", "NumCPUs=1"]),
    "mpi": Case("mpi.sbatch", ["--nodes=1", "--ntasks=2"], [], 2, 1, ["NumTasks=1", "NumCPUs=1"]),
}


@dataclass
class Run:
    jobid: int
    output: Path
    ckpt: Path
    events: list[str]
    info: dict | None = None
    error: str | None = None


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    try:
        c = slurm_util.start(tmp_path_factory.mktemp("slurm"))
    except slurm_util.SlurmUnavailable as e:
        missing("SLURM", str(e))
    yield c
    c.stop()


def _drive(cluster, runs: dict[str, Run], timeout: float) -> None:
    """Signal each job after its first save, resize it while requeued, wait until every job ended."""
    deadline = time.monotonic() + timeout
    active = dict(runs)
    while active and time.monotonic() < deadline:
        for name, run in list(active.items()):
            case, info = CASES[name], cluster.job(run.jobid)
            if not info:
                run.error = f"job {run.jobid} ({name}) is no longer known to slurmctld"
                del active[name]
                continue
            text = run.output.read_text(errors="replace") if run.output.exists() else ""
            if "signalled" not in run.events and info["JobState"] == "RUNNING" and "saved step=" in text:
                cluster.run("scancel", "--signal=USR1", *case.scancel, str(run.jobid))
                run.events.append("signalled")
            elif "signalled" in run.events and "resized" not in run.events and info["JobState"] == "PENDING":
                if case.update:
                    cluster.run("scontrol", "update", f"JobId={run.jobid}", *case.update)
                run.events.append("resized")
            elif info["JobState"] in ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY"):
                run.info = info
                del active[name]
            elif info["JobState"] == "PENDING" and info["Reason"] not in ("None", "Priority", "Resources", "BeginTime"):
                run.error = f"job {run.jobid} ({name}) cannot start: {info['Reason']} ({info})"
                cluster.run("scancel", str(run.jobid), check=False)
                del active[name]
        time.sleep(0.3)
    for name, run in active.items():
        run.error = f"job {run.jobid} ({name}) did not finish within {timeout:.0f}s: {cluster.job(run.jobid)}"
        cluster.run("scancel", "--full", str(run.jobid), check=False)


@pytest.fixture(scope="module")
def runs(cluster, tmp_path_factory) -> dict[str, Run]:
    """Submit every template at once and drive each through preemption, requeue and completion."""
    work = tmp_path_factory.mktemp("slurm-jobs")
    env = _env({"PYTHON": sys.executable, "MAX_RESTARTS": "1"})
    out = {}
    for name, case in CASES.items():
        output, ckpt = work / f"{name}.out", work / f"ckpt-{name}"
        jobid = cluster.sbatch(
            REPO / "slurm" / case.script,
            ["--ckpt", str(ckpt), *TRAIN_ARGS],
            [*case.options, f"--output={output}", f"--job-name=test-{name}"],
            cwd=REPO,
            env=env,
        )
        out[name] = Run(jobid, output, ckpt, [])
    _drive(cluster, out, timeout=300)
    return out


def _lines(text: str, pattern: str) -> list[tuple[str, ...]]:
    return re.findall(pattern, text, re.M)


@pytest.mark.parametrize("name", list(CASES))
def test_template_saves_requeues_and_resumes(runs: dict[str, Run], cluster, name: str) -> None:
    run, case = runs[name], CASES[name]
    text = run.output.read_text(errors="replace") if run.output.exists() else ""
    context = f"events {run.events}, job {run.info}\n--- job output ---\n{text[-6000:]}"
    assert run.error is None, f"{run.error}\n{context}"
    assert run.events == ["signalled", "resized"], context
    assert run.info["JobState"] == "COMPLETED" and run.info["ExitCode"] == "0:0", context
    assert run.info["Restarts"] == "1", f"the job was not requeued exactly once\n{context}"

    stopped = _lines(text, r"^preempted at step=(\d+): exiting with 75$")
    assert len(stopped) == 1, f"the first run did not stop for preemption\n{context}"
    stop = int(stopped[0])
    assert stop < STEPS, context
    saved = dict(_lines(text, r"^saved step=(\d+) digest=(\w+)$"))
    resumed = _lines(text, r"^resumed step=(\d+) digest=(\w+)$")
    assert resumed == [(str(stop), saved[str(stop)])], f"did not resume from step {stop} with its state\n{context}"
    assert _lines(text, r"^done step=(\d+) digest=\w+$") == [str(STEPS)], context

    for r in range(case.first_world):
        assert f"rank {r}/{case.first_world}: exit 75 at step={stop}" in text, f"rank {r} of the first run\n{context}"
    for r in range(case.resumed_world):
        assert f"rank {r}/{case.resumed_world}: exit 0 at step={STEPS}" in text, (
            f"rank {r} of the resumed run\n{context}"
        )
    assert f"train: {case.resumed_world} rank(s)" in text, context

    final = run.ckpt / f"step-{STEPS:09d}"
    manifest = tddist.read_manifest(final)
    assert manifest.metadata["step"] == STEPS and manifest.world_size == case.resumed_world
    assert not leftovers(run.ckpt / "*", strict=True), "leftovers beside the checkpoints"
