"""Every communicator passes the same conformance checks (tests/comm_conformance.py).

LocalComm and ThreadComm run each check in this process when its test runs.
TorchComm and MPIComm run all the checks in ONE real job each (3 torchrun
ranks on gloo, 3 mpiexec ranks), started once per class; each test then reads
its check's outcome from every rank's report.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tddist.comm.base import LocalComm
from tests import comm_conformance
from tests.comm_conformance import SHORT_TIMEOUT, CommunicatorTests, Ctx, run_check, run_on_threads
from tests.launch_util import Job, run_job

SCRIPT = Path(comm_conformance.__file__)
JOB_TIMEOUT = 150


class TestLocalComm(CommunicatorTests):
    size = 1

    def outcomes(self, name: str) -> dict[int, str]:
        return {0: run_check(name, Ctx(LocalComm(), LocalComm, 0, 1, SHORT_TIMEOUT))}


class TestThreadComm(CommunicatorTests):
    size = 3

    def outcomes(self, name: str) -> dict[int, str]:
        return run_on_threads(name, self.size)


class JobCommTests(CommunicatorTests):
    """The checks run by ONE real job per class; ``launcher``, ``kind``, ``comm_class`` set by subclasses."""

    launcher: str
    kind: str
    comm_class: str
    job: Job

    @pytest.fixture(scope="class", autouse=True)
    @classmethod
    def _job(cls, tmp_path_factory) -> None:
        base = tmp_path_factory.mktemp(f"conformance-{cls.kind}")
        cls.job = run_job(cls.launcher, cls.size, SCRIPT, [cls.kind], base / "reports", timeout=JOB_TIMEOUT)

    def outcomes(self, name: str) -> dict[int, str]:
        job = self.job
        assert job.returncodes == [0], f"exit code {job.returncodes}\n{job.output[-6000:]}"
        missing = [r for r in range(self.size) if r not in job.reports]
        assert not missing, f"ranks {missing} wrote no report\n{job.output[-6000:]}"
        broken = {r: rep.get("error") for r, rep in job.reports.items() if rep["status"] != "ok"}
        assert not broken, f"the rank program broke on ranks {sorted(broken)}: {broken}\n{job.output[-3000:]}"
        classes = {rep["comm"] for rep in job.reports.values()}
        assert classes == {self.comm_class}, f"ran on {classes}, expected {self.comm_class}"
        return {r: rep["checks"][name] for r, rep in job.reports.items()}

    def test_job_ran_every_check(self) -> None:
        """Every rank exited 0 and ran every check, in order; the job took seconds, not minutes."""
        self.outcomes("rank_and_size")
        for r, rep in self.job.reports.items():
            assert list(rep["checks"]) == list(comm_conformance.CHECKS), f"rank {r}: {list(rep['checks'])}"
        print(
            {name: max(rep["seconds"][name] for rep in self.job.reports.values()) for name in comm_conformance.CHECKS}
        )
        waited = max(rep["seconds"]["absent_rank_times_out"] for rep in self.job.reports.values())
        assert waited < SHORT_TIMEOUT + comm_conformance.TIMEOUT_SLACK, f"the timeout check took {waited:.1f}s"


@pytest.mark.multirank
class TestTorchComm(JobCommTests):
    size = 3
    launcher = "torchrun"
    kind = "torch"
    comm_class = "TorchComm"


@pytest.mark.multirank
class TestMPIComm(JobCommTests):
    size = 3
    launcher = "mpiexec"
    kind = "mpi"
    comm_class = "MPIComm"


def test_a_thread_rank_that_raised_has_left_the_group():
    """In ``run_threads`` a rank whose function raised is gone, as a process that exited: the collectives
    that wait for it, on its communicator and on every dup (made before or after), fail at once with
    ``CommError`` naming it, not after the group's timeout; a step the others had completed before it
    left still returns, and a rank that only returned early leaves the others to their timeout."""
    import time

    from tddist import CommError, CommTimeoutError, run_threads

    def fn(comm):
        early = comm.dup()
        assert comm.allgather(comm.rank) == [0, 1, 2]  # completed by every rank before rank 2 leaves
        if comm.rank == 2:
            raise ValueError("rank 2 gave up")
        late = comm.dup()
        out = {}
        for name, c in (("comm", comm), ("early dup", early), ("late dup", late)):
            t0 = time.monotonic()
            try:
                c.allgather(comm.rank)
            except CommError as e:
                out[name] = (type(e), str(e), time.monotonic() - t0)
        return out

    results = run_threads(3, fn, timeout=60)
    assert isinstance(results[2], ValueError)
    for rank in (0, 1):
        assert set(results[rank]) == {"comm", "early dup", "late dup"}, results[rank]
        for cls, text, elapsed in results[rank].values():
            assert cls is CommError and elapsed < 30, (cls, elapsed)
            assert f"rank {rank}: allgather cannot complete: its peer thread-rank 2 left the group" in text, text
            assert "ValueError: rank 2 gave up" in text, text

    def returns_early(comm):
        if comm.rank == 0:
            comm.barrier()

    t0 = time.monotonic()
    results = run_threads(2, returns_early, timeout=1)
    assert isinstance(results[0], CommTimeoutError) and results[1] is None, results
    assert time.monotonic() - t0 >= 1.0
