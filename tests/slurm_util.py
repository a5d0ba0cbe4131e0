"""A real single-node SLURM for tests: munged, slurmctld and slurmd as root, in a temporary directory.

``start(workdir)`` installs Debian's ``slurm-wlm`` and ``munge`` when
slurmctld is missing, writes a slurm.conf whose node has this machine's CPUs
and memory (as ``slurmd -C`` reports them), starts the three daemons in the
foreground as children of the test process and waits until the node is idle.
``Cluster.stop()`` cancels every job and stops each daemon by its pid.

Requeued jobs become eligible again after ``cred_expire`` seconds (120 by
default); the generated configuration sets it to 10 so that requeue tests
stay short. Partitions allow 4 jobs per CPU, so several small jobs run at once.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import socket
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

from tests.launch_util import free_port

REQUEUE_DELAY_S = 10
_DAEMONS = ("munged", "slurmctld", "slurmd")


class SlurmUnavailable(Exception):
    """SLURM is not installed and cannot be installed here (the reason is the message)."""


def ensure_installed() -> None:
    """Install slurm-wlm and munge with apt-get if the daemons are missing."""
    if all(shutil.which(d) for d in _DAEMONS):
        return
    if os.geteuid() != 0 or not shutil.which("apt-get"):
        raise SlurmUnavailable("slurmctld is missing and installing it needs root and apt-get")
    env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
    install = ["apt-get", "install", "-y", "-q", "--no-install-recommends", "slurm-wlm", "munge"]
    out = ""
    for cmd in (install, ["apt-get", "update", "-q"], install):
        try:
            p = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900)
        except subprocess.TimeoutExpired:
            raise SlurmUnavailable(f"{' '.join(cmd)} did not finish within 900 s") from None
        out = p.stdout + p.stderr
        if cmd is install and p.returncode == 0:
            break
    if not all(shutil.which(d) for d in _DAEMONS):
        raise SlurmUnavailable(f"apt-get could not install slurm-wlm and munge:\n{out[-2000:]}")


@dataclass
class Cluster:
    dir: Path
    env: dict
    procs: dict[str, subprocess.Popen] = field(default_factory=dict)

    def run(
        self, *cmd: str, timeout: float = 60, check: bool = True, cwd: Path | None = None, env: dict | None = None
    ) -> str:
        """Run a SLURM client command against this cluster; its output."""
        p = subprocess.run(
            cmd, env={**self.env, **(env or {})}, capture_output=True, text=True, timeout=timeout, cwd=cwd
        )
        if check and p.returncode != 0:
            raise AssertionError(f"{' '.join(cmd)} failed ({p.returncode}): {p.stdout}{p.stderr}\n{self.logs()}")
        return p.stdout

    def sbatch(self, script: Path, args: list[str], options: list[str], cwd: Path, env: dict | None = None) -> int:
        """Submit ``script args`` with sbatch ``options`` (the submitting environment is exported)."""
        return int(
            self.run("sbatch", "--parsable", *options, str(script), *args, cwd=cwd, env=env).strip().split(";")[0]
        )

    def job(self, jobid: int) -> dict[str, str]:
        """``scontrol show job`` as a dict (JobState, Restarts, ExitCode, NumTasks, ...); empty if unknown."""
        text = self.run("scontrol", "show", "job", "-o", str(jobid), check=False)
        return dict(m.groups() for m in re.finditer(r"(\w+)=(\S*)", text))

    def logs(self, chars: int = 3000) -> str:
        parts = []
        for name in ("slurmctld.log", "slurmd.log", "munged.log"):
            path = self.dir / name
            if path.exists():
                parts.append(f"--- {name} ---\n{path.read_text(errors='replace')[-chars:]}")
        return "\n".join(parts)

    def stop(self) -> None:
        """Cancel every job, then stop the daemons this cluster started, by pid (slurmd first)."""
        if "slurmctld" in self.procs:
            self.run("scancel", "--full", "--user=root", check=False)
            self._wait_no_jobs(30)
        for name in ("slurmd", "slurmctld", "munged"):
            p = self.procs.pop(name, None)
            if p is None:
                continue
            p.send_signal(signal.SIGTERM)
            try:
                p.wait(20)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait(10)

    def _wait_no_jobs(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            out = self.run("squeue", "-h", "-o", "%i", check=False)
            if not out.strip():
                return
            time.sleep(0.5)


def _node_line() -> str:
    """This machine as a slurm.conf node line (CPUs, sockets, cores, memory from ``slurmd -C``)."""
    out = subprocess.run(["slurmd", "-C"], capture_output=True, text=True, check=True, timeout=60).stdout
    line = next(ln for ln in out.splitlines() if ln.startswith("NodeName="))
    return f"{line} NodeAddr=127.0.0.1 State=UNKNOWN"


def write_conf(d: Path, host: str) -> Path:
    conf = d / "slurm.conf"
    conf.write_text(
        "\n".join(
            [
                "ClusterName=tddisttest",
                f"SlurmctldHost={host}(127.0.0.1)",
                f"SlurmctldPort={free_port()}",
                f"SlurmdPort={free_port()}",
                "SlurmUser=root",
                "SlurmdUser=root",
                "AuthType=auth/munge",
                "CredType=cred/munge",
                f"AuthInfo=socket={d / 'munge.sock'},cred_expire={REQUEUE_DELAY_S}",
                f"StateSaveLocation={d / 'state'}",
                f"SlurmdSpoolDir={d / 'spool'}",
                f"SlurmctldPidFile={d / 'slurmctld.pid'}",
                f"SlurmdPidFile={d / 'slurmd.pid'}",
                f"SlurmctldLogFile={d / 'slurmctld.log'}",
                f"SlurmdLogFile={d / 'slurmd.log'}",
                "ProctrackType=proctrack/linuxproc",
                "TaskPlugin=task/none",
                "JobAcctGatherType=jobacct_gather/none",
                "AccountingStorageType=accounting_storage/none",
                "MpiDefault=none",
                "MailProg=/bin/true",
                "SelectType=select/cons_tres",
                "SelectTypeParameters=CR_Core",
                "SchedulerParameters=sched_interval=2,bf_interval=1",
                "ReturnToService=2",
                "KillWait=10",
                "MinJobAge=600",
                _node_line(),
                "PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP OverSubscribe=FORCE:4",
                "",
            ]
        )
    )
    return conf


def _daemon(cluster: Cluster, name: str, cmd: list[str]) -> None:
    log = open(cluster.dir / f"{name}.out", "w")
    cluster.procs[name] = subprocess.Popen(
        cmd, env=cluster.env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
    )
    log.close()


def _wait(cluster: Cluster, what: str, ready, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while not ready():
        dead = {n: p.returncode for n, p in cluster.procs.items() if p.poll() is not None}
        if dead or time.monotonic() > deadline:
            outs = "\n".join(
                f"--- {f.name} ---\n{f.read_text(errors='replace')[-2000:]}" for f in cluster.dir.glob("*.out")
            )
            cluster.stop()
            raise RuntimeError(f"SLURM did not start ({what}; exited: {dead})\n{outs}\n{cluster.logs()}")
        time.sleep(0.3)


def start(d: Path) -> Cluster:
    """Install if needed, configure and start a one-node cluster in ``d``; returns it with the node idle."""
    ensure_installed()
    d.mkdir(parents=True, exist_ok=True)
    d.chmod(0o755)
    for sub in ("state", "spool"):
        (d / sub).mkdir(exist_ok=True)
    key = d / "munge.key"
    fd = os.open(key, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o400)
    os.write(fd, os.urandom(1024))
    os.close(fd)
    host = socket.gethostname().split(".")[0]
    conf = write_conf(d, host)
    cluster = Cluster(d, dict(os.environ, SLURM_CONF=str(conf)))
    _daemon(
        cluster,
        "munged",
        [
            "munged",
            "--foreground",
            "--force",
            f"--socket={d / 'munge.sock'}",
            f"--key-file={key}",
            f"--pid-file={d / 'munged.pid'}",
            f"--log-file={d / 'munged.log'}",
            f"--seed-file={d / 'munged.seed'}",
        ],
    )
    _wait(cluster, "munge socket", lambda: (d / "munge.sock").exists())
    _daemon(cluster, "slurmctld", ["slurmctld", "-D", "-c", "-f", str(conf)])
    _daemon(cluster, "slurmd", ["slurmd", "-D", "-f", str(conf)])

    def idle() -> bool:
        out = subprocess.run(
            ["sinfo", "-h", "-o", "%T"], env=cluster.env, capture_output=True, text=True, timeout=30
        ).stdout
        return out.strip() == "idle"

    _wait(cluster, "node idle", idle)
    return cluster
