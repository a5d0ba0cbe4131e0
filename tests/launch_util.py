"""Start real multi-rank jobs from tests: torchrun, mpiexec, or plain processes.

Every job runs in its own session and is killed as a group when it exceeds its
timeout, so a hung rank fails the test instead of hanging it. Rank programs
report through a JSON file per rank (``rank<r>.json`` in ``report_dir``), so
a test can check every rank's outcome, not only the launcher's exit code.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
BIN = Path(sys.executable).parent


@dataclass
class Job:
    returncodes: list[int]  # per rank for "spawn", one entry (the launcher's) otherwise
    output: str
    reports: dict[int, dict]

    def assert_ok(self, nproc: int) -> None:
        assert all(rc == 0 for rc in self.returncodes), f"exit codes {self.returncodes}\n{self.output[-6000:]}"
        missing = [r for r in range(nproc) if r not in self.reports]
        assert not missing, f"ranks {missing} wrote no report\n{self.output[-6000:]}"
        bad = {r: rep for r, rep in self.reports.items() if rep.get("status") != "ok"}
        assert not bad, f"ranks failed: {json.dumps(bad, indent=1)[:6000]}\n{self.output[-3000:]}"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _env(extra: dict | None) -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    env.setdefault("OMP_NUM_THREADS", "1")
    env.update(extra or {})
    return env


def _communicate(procs: list[subprocess.Popen], timeout: float) -> tuple[list[int], str]:
    deadline = time.monotonic() + timeout
    outputs = []
    timed_out = False
    for p in procs:
        try:
            out, _ = p.communicate(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            timed_out = True
            for q in procs:
                try:
                    os.killpg(q.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            out, _ = p.communicate()
        outputs.append(out or "")
    text = "\n".join(f"--- process {i} ---\n{o}" for i, o in enumerate(outputs))
    if timed_out:
        raise AssertionError(f"job exceeded its {timeout:.0f}s timeout and was killed\n{text[-6000:]}")
    return [p.returncode for p in procs], text


def _reports(report_dir: Path) -> dict[int, dict]:
    out = {}
    for f in report_dir.glob("rank*.json"):
        out[int(f.stem[4:])] = json.loads(f.read_text())
    return out


def run_job(
    launcher: str,
    nproc: int,
    script: str | Path,
    args: list[str],
    report_dir: Path,
    *,
    timeout: float = 180,
    env: dict | None = None,
) -> Job:
    """Run ``script args`` on ``nproc`` ranks with ``launcher`` ("torchrun", "mpiexec" or "spawn").

    "spawn" starts the ranks as independent processes with torchrun's
    environment variables, so each rank's exit code is seen and a killed rank
    does not take the others down (fault-injection tests need that).
    """
    report_dir.mkdir(parents=True, exist_ok=True)
    env = _env({"TDDIST_REPORT_DIR": str(report_dir), **(env or {})})
    cmd_py = [sys.executable, str(script), *args]
    popen = dict(stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True, cwd=str(REPO))
    if launcher == "torchrun":
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}", *cmd_py[1:]]
        procs = [subprocess.Popen(cmd, env=env, **popen)]
    elif launcher == "mpiexec":
        cmd = [str(BIN / "mpiexec"), "-n", str(nproc), *cmd_py]
        procs = [subprocess.Popen(cmd, env=env, **popen)]
    elif launcher == "spawn":
        port = free_port()
        procs = []
        for r in range(nproc):
            renv = dict(
                env,
                RANK=str(r),
                LOCAL_RANK=str(r),
                WORLD_SIZE=str(nproc),
                LOCAL_WORLD_SIZE=str(nproc),
                MASTER_ADDR="127.0.0.1",
                MASTER_PORT=str(port),
            )
            procs.append(subprocess.Popen(cmd_py, env=renv, **popen))
    else:
        raise ValueError(launcher)
    rcs, text = _communicate(procs, timeout)
    return Job(rcs, text, _reports(report_dir))


def write_report(rank: int, status: str, **fields) -> None:
    """Rank side: record this rank's outcome for ``run_job`` (no-op outside a job)."""
    d = os.environ.get("TDDIST_REPORT_DIR")
    if d:
        tmp = Path(d) / f".rank{rank}.json.tmp"
        tmp.write_text(json.dumps({"status": status, **fields}, default=str))
        tmp.replace(Path(d) / f"rank{rank}.json")
