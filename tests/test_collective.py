"""Collective save/load on several ranks: thread ranks in-process, then real torchrun and mpiexec jobs.

The scenarios live in ``tests/scenarios.py``. The thread tests run each one on
1, 2 and 3 thread-ranks. Each real job runs every scenario in sequence inside
the same ranks (one job per launcher and world size, started once and shared by
the tests that read its reports), letting tddist detect the communicator; two
extra scenarios pass ``comm=MPI.COMM_WORLD`` or ``comm=dist.group.WORLD``.
Scenarios listed in ``scenarios.KNOWN_BUGS`` are expected to fail (strict xfail).
"""

from __future__ import annotations

import traceback
from pathlib import Path

import pytest

import tddist
from tests import scenarios
from tests.launch_util import run_job

SCRIPT = Path(scenarios.__file__)
JOB_TIMEOUT = 120
THREAD_TIMEOUT = 30

# --- thread ranks ----------------------------------------------------------------------


def run_on_threads(fn, size: int, workdir: Path) -> None:
    results = tddist.run_threads(size, lambda c: fn(c, workdir, c.rank, c.size), timeout=THREAD_TIMEOUT)
    errors = {r: e for r, e in enumerate(results) if isinstance(e, BaseException)}
    if errors:
        text = "\n".join(f"--- rank {r} ---\n{''.join(traceback.format_exception(e))}" for r, e in errors.items())
        raise AssertionError(f"{fn.__name__} failed on thread-ranks {sorted(errors)}:\n{text}")


def _thread_cases():
    for fn in scenarios.SCENARIOS:
        for size in (1, 2, 3):
            bug = scenarios.KNOWN_BUGS.get(fn.__name__)
            marks = [pytest.mark.xfail(strict=True, reason=bug)] if bug else []
            yield pytest.param(fn, size, id=f"{fn.__name__}-{size}", marks=marks)


@pytest.mark.parametrize("scenario,size", list(_thread_cases()))
def test_threads(scenario, size, tmp_path):
    run_on_threads(scenario, size, tmp_path)


# --- real jobs -------------------------------------------------------------------------

JOBS = [("torchrun", 2), ("torchrun", 4), ("mpiexec", 2), ("mpiexec", 3)]
COMM_CLASS = {"torchrun": "TorchComm", "mpiexec": "MPIComm"}
EXPLICIT = {"torchrun": "explicit_torch_group", "mpiexec": "explicit_mpi4py_comm"}

_jobs: dict = {}


def job(launcher: str, nproc: int, tmp_path_factory):
    """Run every scenario once per (launcher, world size), shared by the tests below."""
    key = (launcher, nproc)
    if key not in _jobs:
        base = tmp_path_factory.mktemp(f"{launcher}{nproc}")
        _jobs[key] = run_job(
            launcher,
            nproc,
            SCRIPT,
            [str(base / "work")],
            base / "reports",
            timeout=JOB_TIMEOUT,
            env={"TDDIST_TIMEOUT": "60"},
        )
    return _jobs[key]


def assert_job_ok(j, nproc: int) -> None:
    """Every rank exited 0 and reported ok (all scenarios passed but known bugs); failures shown first."""
    unexpected = {
        f"rank {r}: {name}": tb
        for r, rep in sorted(j.reports.items())
        for name, tb in rep.get("failures", {}).items()
        if name not in scenarios.KNOWN_BUGS
    }
    assert not unexpected, "\n".join(f"--- {where} ---\n{tb}" for where, tb in unexpected.items())[-8000:]
    j.assert_ok(nproc)


@pytest.mark.multirank
@pytest.mark.parametrize("launcher,nproc", JOBS, ids=[f"{launcher}-{n}" for launcher, n in JOBS])
def test_job(launcher, nproc, tmp_path_factory):
    """Every rank exits 0 and reports every scenario passed, over the detected communicator."""
    j = job(launcher, nproc, tmp_path_factory)
    assert_job_ok(j, nproc)
    assert sorted(j.reports) == list(range(nproc))
    names = [f.__name__ for f in scenarios.SCENARIOS + scenarios.LAUNCH_SCENARIOS]
    for r, rep in j.reports.items():
        assert rep["detected_rank"] == r and rep["detected_size"] == nproc, rep
        assert rep["comm"] == COMM_CLASS[launcher], f"rank {r} detected {rep['comm']}"
        # the first save(comm=None) set the communicator up: gloo under torchrun, MPI under mpiexec
        assert rep["before"] == {"torch_initialised": False, "mpi_imported": False}, rep["before"]
        expected_after = {"torch_initialised": launcher == "torchrun", "mpi_imported": launcher == "mpiexec"}
        assert rep["after"] == expected_after, rep["after"]
        assert list(rep["scenarios"]) == names, rep["scenarios"]
        expected = {n: "ok" for n in names}
        other = EXPLICIT["mpiexec" if launcher == "torchrun" else "torchrun"]
        expected[other] = scenarios.SKIPPED  # the explicit comm of the other launcher does not apply
        got = {n: o for n, o in rep["scenarios"].items() if n not in scenarios.KNOWN_BUGS}
        assert got == {n: o for n, o in expected.items() if n not in scenarios.KNOWN_BUGS}, rep["failures"]
        assert rep["agree"], f"rank {r}: ranks recorded different scenario outcomes"


class ScenarioFailed(AssertionError):
    """A scenario failed inside a job that otherwise ran fine."""


if scenarios.KNOWN_BUGS:  # only while some library bug is known

    def _known_bug_cases():
        for name, reason in sorted(scenarios.KNOWN_BUGS.items()):
            for launcher, nproc in JOBS:
                mark = pytest.mark.xfail(strict=True, raises=ScenarioFailed, reason=reason)
                yield pytest.param(name, launcher, nproc, id=f"{name}-{launcher}-{nproc}", marks=mark)

    @pytest.mark.multirank
    @pytest.mark.parametrize("name,launcher,nproc", list(_known_bug_cases()))
    def test_job_known_bug(name, launcher, nproc, tmp_path_factory):
        """The scenarios of known library bugs, run in the same jobs; they fail until the bug is fixed."""
        j = job(launcher, nproc, tmp_path_factory)
        assert_job_ok(j, nproc)  # a broken job is a real failure, not the expected one
        failed = {r: rep["failures"][name] for r, rep in sorted(j.reports.items()) if rep["scenarios"][name] != "ok"}
        if failed:
            raise ScenarioFailed(f"{name} failed on ranks {sorted(failed)}:\n" + "\n".join(failed.values()))
