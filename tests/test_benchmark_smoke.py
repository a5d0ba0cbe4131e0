"""The benchmark suite runs end to end: ``benchmarks/run.py --quick`` (a few MB, one repeat,
worlds 1 and 2, every scenario once) exits 0, prints its table and writes valid JSON
holding every scenario. Timings are not checked here."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
RUN = REPO / "benchmarks" / "run.py"
TIMEOUT = 120


#: The stages of the manifest scale model (one implementation: tddist's).
MANIFEST = {"manifest write", "manifest write cached", "manifest open saved", "manifest open whole"}


@pytest.mark.multirank
def test_quick_benchmark_run(tmp_path: Path) -> None:
    out = tmp_path / "results.json"
    cmd = [sys.executable, str(RUN), "--quick", "--out", str(out), "--dir", str(tmp_path / "work")]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.Popen(
        cmd, cwd=str(REPO), env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True
    )
    try:
        stdout, stderr = proc.communicate(timeout=TIMEOUT)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        stdout, stderr = proc.communicate()
        pytest.fail(f"benchmarks/run.py --quick exceeded {TIMEOUT}s\n{stderr[-4000:]}")
    assert proc.returncode == 0, f"exit code {proc.returncode}\n{stdout[-3000:]}\n{stderr[-6000:]}"

    assert "| scenario | N | impl | metric | median |" in stdout, stdout[-3000:]
    assert "## Targets" in stdout

    result = json.loads(out.read_text())
    for key in ("config", "machine", "tddist", "summary", "records", "targets"):
        assert key in result, key
    seen = {(r["scenario"], r["launcher"]) for r in result["records"] if "metrics" in r}
    scenarios = {s for s, _ in seen}
    expected = {
        "save",
        "async first",
        "async save",
        "load",
        "small save",
        "small load",
        "commit",
        *MANIFEST,
    }
    assert expected <= scenarios, f"missing scenarios: {sorted(expected - scenarios)}"
    assert {"reshard 2->1", "reshard 1->2"} <= scenarios, sorted(scenarios)
    assert ("commit", "torchrun") in seen and ("commit", "mpiexec") in seen
    worlds = {r["world"] for r in result["records"] if r.get("launcher") == "torchrun"}
    assert worlds == {1, 2}
    # every scenario compares tddist with at least one peer, except the single-implementation manifest model
    for scen in expected - MANIFEST:
        impls = {r["impl"] for r in result["records"] if r.get("scenario") == scen and "impl" in r}
        assert any(i.startswith("tddist") for i in impls) and len(impls) >= 2, (scen, impls)
