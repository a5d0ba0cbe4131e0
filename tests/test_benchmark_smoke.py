"""The benchmarks run end to end: ``benchmarks/run.py --quick`` (a few MB, one repeat, worlds 1 and 2,
every scenario once) and ``benchmarks/s3.py --quick`` exit 0, print their tables and write valid JSON
holding every scenario. Timings are not checked here."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest

from tests.helpers import require

REPO = Path(__file__).resolve().parent.parent
RUN = REPO / "benchmarks" / "run.py"
S3 = REPO / "benchmarks" / "s3.py"
COPY_OVERLAP = REPO / "benchmarks" / "copy_overlap.py"
RESHARD_FLOOR = REPO / "benchmarks" / "reshard_floor.py"
TIMEOUT = 300  # a no-hang limit: the run takes 35-90 s alone, over 3 minutes on a busy shared machine


#: The stages of the manifest scale model (one implementation: tddist's).
MANIFEST = {"manifest write", "manifest write cached", "manifest open saved", "manifest open whole"}


def _run_quick(script: Path, out: Path, work: Path) -> str:
    """Run ``script --quick`` (its output JSON to ``out``), within the no-hang limit; its standard output."""
    cmd = [sys.executable, str(script), "--quick", "--out", str(out), "--dir", str(work)]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.Popen(
        cmd, cwd=str(REPO), env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True
    )
    try:
        stdout, stderr = proc.communicate(timeout=TIMEOUT)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        stdout, stderr = proc.communicate()
        pytest.fail(f"{script.name} --quick exceeded {TIMEOUT}s\n{stderr[-4000:]}")
    assert proc.returncode == 0, f"exit code {proc.returncode}\n{stdout[-3000:]}\n{stderr[-6000:]}"
    return stdout


#: The scenarios of benchmarks/deferred.py (a training loop saving every few steps, one process).
DEFERRED = {"training, 1 thread", "training, all threads"}
#: The scenarios of benchmarks/consolidate.py (one process converts a many-rank checkpoint; DCP's beside it).
CONSOLIDATED = {"consolidate to hf", "consolidate to torch.save"}


@pytest.mark.multirank
def test_quick_benchmark_run(tmp_path: Path) -> None:
    out = tmp_path / "results.json"
    stdout = _run_quick(RUN, out, tmp_path / "work")

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
        *DEFERRED,
        *CONSOLIDATED,
    }
    assert expected <= scenarios, f"missing scenarios: {sorted(expected - scenarios)}"
    assert {"reshard 2->1", "reshard 1->2"} <= scenarios, sorted(scenarios)
    assert ("commit", "torchrun") in seen and ("commit", "mpiexec") in seen
    worlds = {r["world"] for r in result["records"] if r.get("launcher") == "torchrun"}
    assert worlds == {1, 2}
    # the commit scenario takes each rank's CPU time of a save: metric "cpu" is their sum
    commits = [r for r in result["records"] if r.get("scenario") == "commit" and "metrics" in r]
    assert {r["launcher"] for r in commits} == {"torchrun", "mpiexec"}
    for r in commits:
        assert len(r["cpu_ranks"]) == r["world"] and all(c >= 0 for c in r["cpu_ranks"]), r
        assert r["metrics"]["cpu"] == sum(r["cpu_ranks"]), r
    assert any(r["metrics"]["cpu"] > 0 for r in commits if r["impl"] == "tddist")
    # consolidation: the same 16-rank state converted by tddist and by DCP, into HF shards and a torch.save file
    # (each output checked against what the ranks saved), its memory judged against the largest leaf
    converted = [r for r in result["records"] if r.get("scenario") in CONSOLIDATED]
    assert {(r["scenario"], r["impl"]) for r in converted} == {(s, i) for s in CONSOLIDATED for i in ("tddist", "dcp")}
    assert all(r["metrics"]["time"] > 0 and r["extra"]["out_bytes"] > 0 for r in converted), converted
    assert all(r["extra"]["ranks"] == 16 and r["extra"]["leaves"] == 20 for r in converted), converted
    for what in ("Hugging Face sharded safetensors", "one torch.save file"):
        assert f"consolidate 16 ranks x 20 leaves into {what}: peak RSS added <= the largest leaf" in stdout
    # every scenario compares tddist with at least one peer, except the single-implementation manifest model
    for scen in expected - MANIFEST - DEFERRED:
        impls = {r["impl"] for r in result["records"] if r.get("scenario") == scen and "impl" in r}
        assert any(i.startswith("tddist") for i in impls) and len(impls) >= 2, (scen, impls)


@pytest.mark.multirank
def test_quick_s3_benchmark(tmp_path: Path) -> None:
    """``benchmarks/s3.py --quick`` (8 MiB, worlds 1 and 2, one repeat, its own SeaweedFS on loopback) prints a
    table per world size and the targets, and its JSON holds every implementation; resharding loads GET the
    rank's rows (and, from an archive, the last 64 KiB read when it is opened, and the entries' local headers)."""
    from tests import s3_server

    require("weed", "SeaweedFS for the object-storage benchmark", available=s3_server.weed_binary() is not None)
    require("s3fs", "DCP's FsspecWriter on S3 (the dev and test extras have it)", available=_has("s3fs"))
    out = tmp_path / "s3.json"
    stdout = _run_quick(S3, out, tmp_path / "work")
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
    need = reshard["needed_per_rank"]
    for impl, slack in (("tddist dir", 64 * 1024), ("tddist tdz", 128 * 1024)):
        gets = [g["tddist"][0] for g in reshard["impls"][impl][0]["per_rank"]]
        assert all(n <= g <= n + slack for g, n in zip(gets, need)), (impl, gets, need)
    assert all(g["s3fs"][0] > 0 for g in reshard["impls"]["dcp fsspec"][0]["per_rank"])


def test_copy_overlap_model(tmp_path: Path) -> None:
    """``benchmarks/copy_overlap.py --quick`` writes every mode's file and reads it back (``--verify``: a mode
    that wrote wrong bytes stops the run), prints one row per mode and writes timings where the caller is
    released no later than the file is durable."""
    out = tmp_path / "overlap.json"
    stdout = _run_quick(COPY_OVERLAP, out, tmp_path)
    rows = json.loads(out.read_text())["rows"]
    modes = {r["mode"] for r in rows}
    assert {"synchronous", "copy, then write", "write during copy", "helper writes leaves"} <= modes, modes
    for r in rows:
        assert f"| {r['mode']} |" in stdout, stdout
        assert 0 < r["blocking_s"] <= r["complete_s"], r


def test_reshard_floor_model(tmp_path: Path) -> None:
    """``benchmarks/reshard_floor.py`` reads a quarter of each leaf of one file and a file each, by mmap and by
    pread, and prints both layouts' times and their ratio for each."""
    cmd = [sys.executable, str(RESHARD_FLOOR), "--leaf-mib", "4", "--repeats", "1", "--dir", str(tmp_path)]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=REPO / "benchmarks")
    assert done.returncode == 0, done.stdout + done.stderr
    rows = re.findall(r"^(mmap|pread) .*?([\d.]+) ms .*?([\d.]+) ms +ratio ([\d.]+)$", done.stdout, re.M)
    assert [r[0] for r in rows] == ["mmap", "pread"], done.stdout
    for _how, one, each, ratio in rows:
        assert float(one) > 0 and float(each) > 0, rows
        assert abs(float(ratio) - float(one) / float(each)) < 0.01 + 0.01 * float(ratio), rows


def _has(module: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(module) is not None


def _bench_modules(root: Path) -> tuple[ModuleType, ModuleType]:
    """``benchmarks/_common.py`` and ``benchmarks/run.py`` of the tree at ``root``, imported from there."""
    import importlib

    sys.path.insert(0, str(root / "benchmarks"))
    try:
        return importlib.import_module("_common"), importlib.import_module("run")
    finally:
        sys.path.remove(str(root / "benchmarks"))
        sys.modules.pop("_common", None)
        sys.modules.pop("run", None)


def test_publish_refuses_results_of_other_code(tmp_path: Path) -> None:
    """publish.py writes a run's table into the README only when the run's source digest is that of the
    tree's tddist/ and benchmarks/; after one source file changes it refuses, names the file, and leaves
    the README as it was."""
    import shutil

    root = tmp_path / "tree"
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc", "results*.json")
    for name in ("tddist", "benchmarks"):
        shutil.copytree(REPO / name, root / name, ignore=ignore)
    C, R = _bench_modules(root)
    files = C.source_files(root / "tddist", root / "benchmarks")  # what run.py records of its snapshot
    record = {"scenario": "save", "world": 1, "launcher": "torchrun", "ref": "tddist", "repeat": 0, "bytes": 1 << 30}
    records = [
        dict(record, impl="tddist", metrics={"time": 1.25}),
        dict(record, impl="raw pwrite+fsync", metrics={"time": 1.0}),
    ]
    result = {
        "tddist": {"version": "0", "source_digest": C.source_digest(files), "source_files": files},
        "config": {"quick": False, "worlds": [1], "repeats": 1, "payload_mib": 1024},
        "machine": {"load_average_at_start": [1.0]},
        "jobs": [{"job": "torchrun N=1", "rc": 0}],
        "summary": R.aggregate(records),
        "targets": [{"target": "raw is a floor", "status": "met", "detail": "0.80x"}],
    }
    results = tmp_path / "results.json"
    results.write_text(json.dumps(result))
    readme = root / "benchmarks" / "README.md"
    publish = [sys.executable, str(root / "benchmarks" / "publish.py"), "--root", str(root), "--results", str(results)]

    def run_publish() -> subprocess.CompletedProcess:
        return subprocess.run(publish, capture_output=True, text=True, timeout=60)

    done = run_publish()
    assert done.returncode == 0, done.stderr
    text = readme.read_text()
    assert f"Source digest **`{C.source_digest(files)}`**" in text
    assert "| save | 1 | raw pwrite+fsync | time | 1.00 s |" in text and "| raw is a floor | met | 0.80x |" in text

    writer = root / "tddist" / "storage" / "writer.py"
    writer.write_text(writer.read_text() + "\n# an edit after the run\n")
    refused = run_publish()
    assert refused.returncode == 2, (refused.returncode, refused.stdout, refused.stderr)
    assert "refused" in refused.stderr and "tddist/storage/writer.py (changed)" in refused.stderr, refused.stderr
    assert readme.read_text() == text

    del result["tddist"]["source_digest"]  # results of a run.py that did not record the digest
    results.write_text(json.dumps(result))
    refused = run_publish()
    assert refused.returncode == 2 and "no source digest" in refused.stderr, refused.stderr
    assert readme.read_text() == text


def test_commit_targets_report_the_cpu_of_a_save_beside_the_wall_time() -> None:
    """Beside each commit target at 4 ranks, ``run.py`` reports (with no target) tddist's CPU time of a save, all
    ranks together, against the fsync floor's, from the ``cpu`` metric of the same run."""
    _C, R = _bench_modules(REPO)
    record = {"scenario": "commit", "world": 4, "ref": "tddist", "repeat": 0, "bytes": None}
    records = [
        dict(record, launcher=launcher, impl=impl, sample=i, metrics={"time": wall, "cpu": cpu})
        for launcher in ("torchrun", "mpiexec")
        for impl, wall, cpu in (("tddist", 0.018, 0.030), ("fsync floor", 0.010, 0.012))
        for i in range(3)
    ]
    targets = {t["target"]: t for t in R.evaluate_targets(R.aggregate(records), records)}
    for name in ("gloo", "MPI"):
        judged = targets[f"commit overhead at 4 {name} ranks <= 1.5x the fsync floor"]
        assert judged["status"] == "MISSED" and judged["detail"].startswith("1.80x"), judged
        cpu = targets[f"commit at 4 {name} ranks: CPU time of a save, all ranks together"]
        assert cpu["status"] == "reported", cpu
        assert cpu["detail"] == "2.50x the floor's (tddist 30.0 ms, floor 12.0 ms; no target)", cpu


def test_consolidation_targets_bound_the_peak_rss_by_the_largest_leaf() -> None:
    """``run.py`` judges each consolidation by its largest peak RSS added over the repeats against the largest
    leaf + 256 MiB, and reports DCP's time over tddist's beside it, from ``consolidate.py``'s records."""
    _C, R = _bench_modules(REPO)
    leaf = 5 * 2**20
    extra = {"ranks": 256, "leaves": 200, "largest_leaf_bytes": leaf, "out_bytes": 1}
    record = {"world": 1, "launcher": "single", "ref": "tddist", "bytes": 200 * leaf, "extra": extra}
    samples = {  # (scenario, impl): (seconds, peak RSS added in MiB) of repeats 0 and 1
        ("consolidate to hf", "tddist"): ((2.0, 40.0), (2.2, 250.0)),
        ("consolidate to hf", "dcp"): ((4.2, 66.0), (4.2, 66.0)),
        ("consolidate to torch.save", "tddist"): ((2.0, 30.0), (2.0, 262.0)),
        ("consolidate to torch.save", "dcp"): ((10.0, 1101.0), (10.0, 1101.0)),
    }
    records = [
        dict(record, scenario=s, impl=i, repeat=rep, metrics={"time": t}, rss_added_mib=rss)
        for (s, i), reps in samples.items()
        for rep, (t, rss) in enumerate(reps)
    ]
    targets = {t["target"]: t for t in R.evaluate_targets(R.aggregate(records), records)}
    into = "consolidate 256 ranks x 200 leaves into"
    hf = targets[f"{into} Hugging Face sharded safetensors: peak RSS added <= the largest leaf + 256 MiB"]
    assert hf["status"] == "met" and hf["detail"] == "250 MiB (largest leaf 5.0 MiB, so at most 261 MiB)", hf
    pt = targets[f"{into} one torch.save file: peak RSS added <= the largest leaf + 256 MiB"]
    assert pt["status"] == "MISSED" and pt["detail"].startswith("262 MiB"), pt  # the larger repeat counts
    timed = targets[f"{into} Hugging Face sharded safetensors: time against DCP's consolidate_safetensors_files"]
    assert timed["status"] == "reported" and timed["detail"].startswith("DCP/tddist time 2.00x"), timed
