#!/usr/bin/env python
"""tddist against its peers, in one run, on the same data and the same file system.

    .venv/bin/python benchmarks/run.py [--size-mib 1024] [--worlds 1,2,4] [--repeats 3]
                                       [--out results.json] [--dir DIR] [--quick]

For each world size (largest first, so that its checkpoints can be resharded
by the smaller ones) one torchrun job (gloo, CPU) runs every scenario, the
implementations interleaved A B C A B C ... once per repeat. Then mpiexec jobs
measure the commit overhead over MPI, and a single process models rank 0's
manifest work and one rank's open at 1,024, 4,096 and 16,384 ranks
(``scale_manifest.py``), one process trains with a save every 10 steps,
deferred snapshots beside the other asynchronous saves (``deferred.py``), and
one process converts a checkpoint of 256 ranks x 200 leaves into Hugging Face
shards and a torch.save file beside DCP's consolidation (``consolidate.py``). The table
gives the median, min-max and, for every peer, ``peer time / tddist time``
from this run (above 1: tddist is faster). See benchmarks/README.md.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import _common as C

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
# The programs of this run's jobs (``job_script``: the run's own snapshot of each).
WORKER = "worker.py"
SCALE = "scale_manifest.py"
DEFERRED = "deferred.py"
REPLICAS = "replicas.py"
CERTIFY = "certify.py"
INCREMENTAL = "incremental.py"
CONSOLIDATE = "consolidate.py"
SCENARIOS = [
    "save",
    "async",
    "load",
    "reshard",
    "small",
    "commit",
    "manifest",
    "deferred",
    "replicas",
    "certify",
    "incremental",
    "consolidate",
]
#: The scenarios that run as jobs of their own (one program each, below); the others run in the torchrun worker.
OWN_JOBS = ("manifest", "deferred", "replicas", "certify", "incremental", "consolidate")
LEAVES, COLS = 4, 1024  # the payload: 4 float32 leaves of 4 KiB rows, sharded by rows

QUICK = dict(
    size_mib=4,
    worlds="1,2",
    repeats=1,
    async_repeats=1,
    mpi_worlds="2",
    small_tensors=200,
    commit_reps=2,
    manifest_ranks="64,256",
    manifest_leaves=100,
    replicas_mib=8,
    clean_saves=20,
)
FULL = dict(
    size_mib=1024,
    worlds="1,2,4",
    repeats=3,
    async_repeats=7,
    mpi_worlds="2,4",
    small_tensors=10000,
    commit_reps=30,
    manifest_ranks="1024,4096,16384",
    manifest_leaves=1000,
    replicas_mib=256,
    clean_saves=1000,
)

DISPLAY_METRIC = {
    ("load", "time"): "open+touch",
    ("small load", "time"): "open+touch",
    ("async save", "time"): "complete",
    ("async first", "time"): "complete",
    ("commit", "cpu"): "CPU, all ranks",
}


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size-mib", type=int, help="total payload over all ranks (default 1024; --quick: 4)")
    ap.add_argument("--worlds", help="torchrun world sizes (default 1,2,4; --quick: 1,2)")
    ap.add_argument("--repeats", type=int, help="interleaved repeats per scenario (default 3; --quick: 1)")
    ap.add_argument(
        "--async-repeats",
        type=int,
        help="interleaved repeats of the asynchronous saves (default 7, cheap and the noisiest; --quick: 1)",
    )
    ap.add_argument("--out", default=str(HERE / "results.json"), help="JSON output (default benchmarks/results.json)")
    ap.add_argument("--dir", help="where checkpoints are written: the file system under test (default: the temp dir)")
    ap.add_argument("--quick", action="store_true", help="a few MB, 1 repeat, worlds 1 and 2, every scenario once")
    ap.add_argument("--scenarios", default=",".join(SCENARIOS), help=f"subset of {','.join(SCENARIOS)}")
    ap.add_argument("--mpi-worlds", help="mpiexec world sizes for the commit overhead (default 2,4; --quick: 2)")
    ap.add_argument("--small-tensors", type=int, help="tensors in the metadata-heavy checkpoint (default 10000)")
    ap.add_argument("--commit-reps", type=int, help="tiny checkpoints per repeat in the commit scenario (default 30)")
    ap.add_argument("--manifest-ranks", help="rank counts of the manifest scale model (default 1024,4096,16384)")
    ap.add_argument("--manifest-leaves", type=int, help="leaves per rank in the manifest scale model (default 1000)")
    ap.add_argument("--clean-saves", type=int, help="clean saves checked for false findings (default 1000)")
    ap.add_argument("--job-timeout", type=float, default=3600, help="seconds before a job is killed")
    ap.add_argument("--keep", action="store_true", help="keep the checkpoints written (default: removed)")
    ap.add_argument(
        "--archive",
        action="store_true",
        help="also benchmark tddist's archive layout (archive=True) where this tddist supports it",
    )
    ap.add_argument("--replicas-mib", type=int, help="state of the replicated-tier benchmark (default 256; --quick: 8)")
    args = ap.parse_args(argv)
    defaults = QUICK if args.quick else FULL
    for k, v in defaults.items():
        if getattr(args, k) is None:
            setattr(args, k, v)
    args.worlds = sorted({int(w) for w in str(args.worlds).split(",") if w.strip()})
    args.mpi_worlds = sorted({int(w) for w in str(args.mpi_worlds).split(",") if w.strip()})
    args.manifest_ranks = [int(w) for w in str(args.manifest_ranks).split(",") if w.strip()]
    args.scenarios = [s.strip() for s in args.scenarios.split(",") if s.strip()]
    unknown = set(args.scenarios) - set(SCENARIOS)
    if unknown:
        ap.error(f"unknown scenarios {sorted(unknown)}; choose from {SCENARIOS}")
    if not args.worlds or min(args.worlds) < 1:
        ap.error("--worlds needs positive world sizes")
    return args


# --- jobs ------------------------------------------------------------------------------------


_LIB: Path | None = None  # the snapshot of the tddist package every job of this run imports
_BENCH: Path | None = None  # the snapshot of benchmarks/*.py every job of this run runs


def snapshot_tddist(work: Path) -> dict:
    """Copy the tddist package under test and the benchmark programs into the work directory, so
    every job of one run measures the same code even if the source tree changes meanwhile; return
    its identity: the version, the digest of the package alone (``sha256``, as older runs had it),
    and ``source_digest`` over every ``.py`` file of both with the files' own digests
    (``source_files``), which ``publish.py`` compares with the tree before it writes a table."""
    global _LIB, _BENCH
    import hashlib
    import importlib.util
    import shutil

    spec = importlib.util.find_spec("tddist")
    if spec is None or not spec.submodule_search_locations:
        return {"version": None, "sha256": None, "source_digest": None}
    src = Path(list(spec.submodule_search_locations)[0])
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc")
    _LIB = work / "lib"
    shutil.copytree(src, _LIB / "tddist", ignore=ignore)
    _BENCH = work / "bench"
    _BENCH.mkdir()
    for f in sorted(HERE.glob("*.py")):
        shutil.copy2(f, _BENCH / f.name)
    h = hashlib.sha256()
    for f in sorted((_LIB / "tddist").rglob("*.py")):
        h.update(f.relative_to(_LIB).as_posix().encode() + b"\0" + f.read_bytes())
    version = None
    for name in ("_version.py", "__init__.py"):  # where this tddist assigns __version__
        f = _LIB / "tddist" / name
        for line in f.read_text().splitlines() if f.exists() else []:
            if version is None and line.startswith("__version__"):
                version = line.split("=", 1)[1].strip().strip("\"'")
    files = C.source_files(_LIB / "tddist", _BENCH)
    return {
        "version": version,
        "sha256": h.hexdigest()[:16],
        "source_digest": C.source_digest(files),
        "source_files": files,
        "source_dir": str(src),
    }


def job_script(name: str) -> str:
    """The path of the benchmark program ``name`` that a job runs: the run's snapshot of it (the code the
    source digest covers, whatever the tree holds by then), or this directory's before a snapshot exists."""
    return str((_BENCH or HERE) / name)


def _version_of(dist: str) -> str | None:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(dist)
    except PackageNotFoundError:
        return None


def _env() -> dict:
    env = dict(os.environ)
    paths = ([str(_LIB)] if _LIB else []) + [str(REPO), str(_BENCH or HERE), env.get("PYTHONPATH", "")]
    env["PYTHONPATH"] = os.pathsep.join(paths).rstrip(os.pathsep)
    env.setdefault("OMP_NUM_THREADS", "1")
    env.setdefault("PYTHONWARNINGS", "ignore")
    return env


def run_job(cmd: list[str], timeout: float, what: str) -> dict:
    print(f"\n=== {what}: {' '.join(Path(c).name if os.sep in c else c for c in cmd)}", file=sys.stderr, flush=True)
    t0 = time.perf_counter()
    load_start = [round(x, 2) for x in os.getloadavg()]  # other jobs on the machine add noise: recorded
    # The jobs' own output (progress, launcher messages) goes to stderr; stdout carries only the final table.
    proc = subprocess.Popen(cmd, env=_env(), cwd=str(REPO), start_new_session=True, stdout=sys.stderr)
    try:
        rc = proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        rc = "timeout"
    secs = time.perf_counter() - t0
    if rc != 0:
        print(f"=== {what} FAILED ({rc}) after {secs:.0f} s", file=sys.stderr, flush=True)
    return {
        "job": what,
        "rc": rc,
        "seconds": round(secs, 1),
        "load_average_at_start": load_start,
        "load_average_at_end": [round(x, 2) for x in os.getloadavg()],
    }


def read_records(path: Path) -> tuple[list, list]:
    try:
        data = json.loads(path.read_text())
        return data.get("records", []), data.get("notes", [])
    except (OSError, ValueError):
        return [], []


# --- aggregation ---------------------------------------------------------------------------------


def aggregate(records: list[dict]) -> list[dict]:
    """One row per (scenario, launcher, world, impl, metric), with ratios against the group's ref impl."""
    groups: dict[tuple, dict] = {}
    for r in records:
        if "metrics" not in r:
            continue
        g = groups.setdefault((r["scenario"], r["launcher"], r["world"]), {"ref": r["ref"], "impls": {}})
        impl = g["impls"].setdefault(r["impl"], {"records": []})
        impl["records"].append(r)
    rows = []
    for (scenario, launcher, world), g in groups.items():
        ref_recs = g["impls"].get(g["ref"], {"records": []})["records"]
        for impl, d in g["impls"].items():
            recs = d["records"]
            metrics = list(dict.fromkeys(m for r in recs for m in r["metrics"]))
            for metric in metrics:
                samples = [r["metrics"][metric] for r in recs if metric in r["metrics"]]
                s = C.summarize(samples)
                row = {
                    "scenario": scenario,
                    "launcher": launcher,
                    "world": world,
                    "impl": impl,
                    "metric": metric,
                    "display_metric": DISPLAY_METRIC.get(
                        (scenario, metric), DISPLAY_METRIC.get((scenario.split()[0], metric), metric)
                    ),
                    **s,
                    "bytes": recs[0].get("bytes"),
                    "rss_added_mib": C.summarize([r.get("rss_added_mib", 0.0) for r in recs])["median"],
                    "rss_peak_mib": max(max(r.get("rss_peak_mib_ranks") or [0]) for r in recs),
                    "is_ref": impl == g["ref"],
                    "ref": g["ref"],
                }
                if row["bytes"] and metric == "time":
                    row["gib_per_s"] = row["bytes"] / C.GIB / s["median"]
                extras = [r.get("extra") or {} for r in recs]
                files = next((e["files"] for e in extras if e.get("files")), None)
                if files is not None:  # the files the checkpoint holds (same every repeat: the first counted)
                    row["files"] = files
                packing = sorted({e["packing"] for e in extras if e.get("packing")})
                if packing:
                    row["packing"] = packing
                for k in ("gathered_mib", "manifest_and_index_mib", "fragments_resident_mib", "leaves_per_rank"):
                    vals = [e[k] for e in extras if e.get(k) is not None]
                    if vals:
                        row[k] = max(vals)
                ref_samples = {(r["repeat"], r.get("sample")): r["metrics"].get(metric) for r in ref_recs}
                ref_vals = [v for v in ref_samples.values() if v is not None]
                if ref_vals and impl != g["ref"]:
                    ref_med = C.summarize(ref_vals)["median"]
                    row["x_vs_tddist"] = s["median"] / ref_med if ref_med > 0 else None
                    paired = [
                        r["metrics"][metric] / ref_samples[(r["repeat"], r.get("sample"))]
                        for r in recs
                        if ref_samples.get((r["repeat"], r.get("sample")))
                    ]
                    if paired:
                        row["x_vs_tddist_paired"] = C.summarize(paired)
                rows.append(row)
    return rows


PRIMARY = ("time", "open", "blocking")  # metrics of the main table; the rest (stage breakdowns) go below it
NO_RATIO = ("barrier only", "plain copy_")  # measurement floors, not peers


def order(rows: list[dict]) -> list[dict]:
    """Scenario order of the run, then world size, then the order the implementations ran in."""
    scen_rank = {}
    for r in rows:
        base = r["scenario"].split(" ")[0]
        scen_rank.setdefault(
            r["scenario"],
            (
                SCENARIOS.index(base) if base in SCENARIOS else 99,
                len(scen_rank),
            ),
        )
    idx = {id(r): i for i, r in enumerate(rows)}
    return sorted(
        rows,
        key=lambda r: (
            scen_rank[r["scenario"]][0],
            r["launcher"] == "mpiexec",
            r["world"],
            scen_rank[r["scenario"]][1],
            idx[id(r)],
        ),
    )


def fmt_files(files: dict | None) -> str:
    """``"1/rank + 2"``: the most files one rank's share of a checkpoint holds, plus the shared ones."""
    if not files:
        return "-"
    return f"{files['per_rank_max']}/rank + {len(files['shared'])}"


def format_table(rows: list[dict]) -> str:
    head = ["scenario", "N", "impl", "metric", "median", "min-max", "GiB/s", "RSS+ MiB", "files", "peer/tddist"]
    lines = ["| " + " | ".join(head) + " |", "|" + "|".join("---" for _ in head) + "|"]
    for r in order([r for r in rows if r["metric"] in PRIMARY]):
        n = f"{r['world']}" + (" mpi" if r["launcher"] == "mpiexec" else "")
        if r["launcher"] == "model":
            n = f"{r['world']} ranks"
        x = (
            "ref"
            if r["is_ref"]
            else (f"{r['x_vs_tddist']:.2f}x" if r.get("x_vs_tddist") and r["impl"] not in NO_RATIO else "-")
        )
        gib = f"{r['gib_per_s']:.2f}" if r.get("gib_per_s") else "-"
        lines.append(
            "| "
            + " | ".join(
                [
                    r["scenario"],
                    n,
                    r["impl"],
                    r["display_metric"],
                    C.fmt_seconds(r["median"]),
                    f"{C.fmt_seconds(r['min'])} - {C.fmt_seconds(r['max'])}",
                    gib,
                    f"{r['rss_added_mib']:.0f}",
                    fmt_files(r.get("files")) if r["metric"] == "time" else "-",
                    x,
                ]
            )
            + " |"
        )
    return "\n".join(lines)


def format_model(rows: list[dict]) -> str:
    """The manifest model: per rank count, the bytes gathered, the files written, and each stage's peak RSS."""
    model = [r for r in order(rows) if r["launcher"] == "model" and r["metric"] == "time"]
    if not model:
        return ""
    lines = []
    for world in sorted({r["world"] for r in model}):
        rs = [r for r in model if r["world"] == world]
        first = rs[0]
        parts = [
            f"{r['scenario'].removeprefix('manifest ')} {C.fmt_seconds(r['median'])} "
            f"(RSS +{r['rss_added_mib']:.0f} MiB, peak {r['rss_peak_mib']:.0f} MiB)"
            for r in rs
        ]
        lines.append(
            f"- {world} ranks x {first.get('leaves_per_rank', '?')} leaves: gathered "
            f"{first.get('gathered_mib', float('nan')):.1f} MiB, tddist.json + tddist.idx "
            f"{first.get('manifest_and_index_mib', float('nan')):.1f} MiB, fragments resident "
            f"{first.get('fragments_resident_mib', float('nan')):.0f} MiB; " + "; ".join(parts)
        )
    return "\n".join(lines)


# --- targets ---------------------------------------------------------------------------------------


def evaluate_targets(rows: list[dict], records: list[dict]) -> list[dict]:
    def med(scenario, world, impl, metric="time", launcher="torchrun"):
        for r in rows:
            if (r["scenario"], r["world"], r["impl"], r["metric"], r["launcher"]) == (
                scenario,
                world,
                impl,
                metric,
                launcher,
            ):
                return r["median"]
        return None

    out = []

    def check(name, ok, detail):
        out.append(
            {"target": name, "status": "not measured" if ok is None else ("met" if ok else "MISSED"), "detail": detail}
        )

    def report(name, detail):
        """A number shown beside the targets, judged against none."""
        out.append({"target": name, "status": "reported", "detail": detail})

    for n in (2, 4):
        t, d, raw = med("save", n, "tddist"), med("save", n, "dcp"), med("save", n, "raw pwrite+fsync")
        check(
            f"durable save N={n}: >= 1.25x DCP throughput",
            None if None in (t, d) else d / t >= 1.25,
            None if None in (t, d) else f"{d / t:.2f}x (tddist {C.fmt_seconds(t)}, dcp {C.fmt_seconds(d)})",
        )
        least = 0.95 if n >= 4 else 0.9
        check(
            f"durable save N={n}: >= {least}x raw threaded pwrite+fsync",
            None if None in (t, raw) else raw / t >= least,
            None if None in (t, raw) else f"{raw / t:.2f}x (tddist {C.fmt_seconds(t)}, raw {C.fmt_seconds(raw)})",
        )
    for n in sorted({r["world"] for r in rows if r["scenario"] == "load" and r["launcher"] == "torchrun"}):
        t, d = med("load", n, "tddist"), med("load", n, "dcp.load")  # metric "time": cold open+touch
        check(
            f"cold load (open+touch) N={n}: no slower than dcp.load",
            None if None in (t, d) else t <= d,
            None if None in (t, d) else f"{d / t:.2f}x (tddist {C.fmt_seconds(t)}, dcp {C.fmt_seconds(d)})",
        )
    worlds = sorted({r["world"] for r in rows if r["scenario"] == "async save"})
    for n in worlds:
        b, db = (
            med("async save", n, "tddist return_early", "blocking"),
            med("async save", n, "dcp.async_save", "blocking"),
        )
        check(
            f"return_early N={n}: blocking <= 0.5x dcp.async_save",
            None if None in (b, db) else b <= 0.5 * db,
            None if None in (b, db) else f"{b / db:.2f}x (tddist {C.fmt_seconds(b)}, dcp {C.fmt_seconds(db)})",
        )
        cb = med("async save", n, "dcp.async_save(cached)", "blocking")
        if None not in (b, cb):  # DCP's staging into reused buffers: the like-for-like comparison, no target
            report(
                f"return_early N={n}: blocking vs dcp.async_save with cached staging",
                f"{b / cb:.2f}x (tddist {C.fmt_seconds(b)}, dcp cached {C.fmt_seconds(cb)}; no target)",
            )
        copy = med("async save", n, "plain copy_", "blocking")
        check(
            f"return_early N={n}: blocking <= 1.3x a plain copy_ of the state",
            None if None in (b, copy) else b <= 1.3 * copy,
            None if None in (b, copy) else f"{b / copy:.2f}x (tddist {C.fmt_seconds(b)}, copy_ {C.fmt_seconds(copy)})",
        )
        c, s = med("async save", n, "tddist return_early"), med("async save", n, "tddist (synchronous)")
        check(
            f"return_early N={n}: completion <= 1.05x a synchronous save",
            None if None in (c, s) else c <= 1.05 * s,
            None
            if None in (c, s)
            else f"{c / s:.2f}x of synchronous (return_early {C.fmt_seconds(c)}, sync {C.fmt_seconds(s)})",
        )
        alloc = [r for r in records if r.get("kind") == "allocations" and r["world"] == n]
        rss = [
            r["rss_added_mib"]
            for r in records
            if r.get("scenario") == "async save" and r["world"] == n and r.get("impl") == "tddist return_early"
        ]
        if alloc:
            new = alloc[0]["new_allocations_after_first_save_per_rank"]
            check(
                f"return_early N={n}: no new allocation after the first save",
                all(v == 0 for v in new),
                f"new snapshot buffers per rank after the first save: {new}; peak RSS added per save "
                f"(max rank, median): {sorted(rss)[len(rss) // 2]:.0f} MiB"
                if rss
                else f"{new}",
            )
    for r in rows:
        if (
            r["scenario"].startswith("reshard 1->")
            and r["impl"].startswith("tddist")
            and r["metric"] == "time"
            and r["is_ref"]
        ):
            n = r["world"]
            same = med(r["scenario"], n, f"tddist {n}->{n} (same layout)")
            dcp = med(r["scenario"], n, f"dcp.load 1->{n}")
            t = r["median"]
            check(
                f"reshard 1->{n}: within 1.1x of a same-layout load",
                None if same is None else t <= 1.1 * same,
                None
                if same is None
                else f"{t / same:.2f}x (1->{n} {C.fmt_seconds(t)}, {n}->{n} {C.fmt_seconds(same)})",
            )
            check(
                f"reshard 1->{n}: >= 1.5x faster than dcp.load",
                None if dcp is None else dcp / t >= 1.5,
                None if dcp is None else f"{dcp / t:.2f}x (tddist {C.fmt_seconds(t)}, dcp {C.fmt_seconds(dcp)})",
            )
    for n in sorted({r["world"] for r in rows if r["scenario"] == "small save"}):
        for scen, peer in (("small save", "dcp"), ("small load", "dcp.load")):
            t, d = med(scen, n, "tddist"), med(scen, n, peer)
            check(
                f"{scen} (many small tensors, default layout) N={n}: >= 3x faster than DCP",
                None if None in (t, d) else d / t >= 3,
                None if None in (t, d) else f"{d / t:.2f}x (tddist {C.fmt_seconds(t)}, dcp {C.fmt_seconds(d)})",
            )
        files = {
            r["impl"]: r.get("files")
            for r in rows
            if (r["scenario"], r["world"], r["metric"], r["launcher"]) == ("small save", n, "time", "torchrun")
        }
        mine = files.get("tddist")
        others = ", ".join(f"{impl} {fmt_files(f)}" for impl, f in files.items() if impl != "tddist" and f)
        check(
            f"small save N={n}: tddist's checkpoint holds at most 4 files per rank plus the manifest",
            None if not mine else mine["per_rank_max"] <= 4 and set(mine["shared"]) <= {"tddist.json", "tddist.idx"},
            None
            if not mine
            else f"tddist {fmt_files(mine)} ({', '.join(mine['shared'])}; {mine['total']} files in all); {others}",
        )
    for launcher, name in (("torchrun", "gloo"), ("mpiexec", "MPI")):
        t, floor = med("commit", 4, "tddist", launcher=launcher), med("commit", 4, "fsync floor", launcher=launcher)
        check(
            f"commit overhead at 4 {name} ranks <= 1.5x the fsync floor",
            None if None in (t, floor) else t <= 1.5 * floor,
            None
            if None in (t, floor)
            else f"{t / floor:.2f}x (tddist {C.fmt_seconds(t)}, floor {C.fmt_seconds(floor)})",
        )
        ct, cf = med("commit", 4, "tddist", "cpu", launcher), med("commit", 4, "fsync floor", "cpu", launcher)
        if None not in (ct, cf):  # what bounds the wall time where the ranks share the cores: no target
            report(
                f"commit at 4 {name} ranks: CPU time of a save, all ranks together",
                f"{ct / cf:.2f}x the floor's (tddist {C.fmt_seconds(ct)}, floor {C.fmt_seconds(cf)}; no target)",
            )

    for r in records:
        if r.get("kind") == "replicas":  # benchmarks/replicas.py judged its own targets
            for t in r.get("targets", []):
                check(f"replicas: {t['target']}", t["met"], t["detail"])

    def model(scenario, ranks):
        """The manifest model's row at ``ranks`` ranks, if it was measured with 1,000 leaves per rank."""
        for r in rows:
            if (r["scenario"], r["world"], r["metric"], r["launcher"]) == (scenario, ranks, "time", "model"):
                return r if r.get("leaves_per_rank") == 1000 else None
        return None

    def model_check(name, scenario, ranks, value, limit, unit="s"):
        r = model(scenario, ranks)
        v = None if r is None else value(r)
        shown = None if v is None else (C.fmt_seconds(v) if unit == "s" else f"{v:.1f} MiB")
        if r is not None and unit == "s":
            shown += f" (peak RSS added {r['rss_added_mib']:.0f} MiB)"
        check(name, None if v is None else v < limit, shown)

    model_check("manifest 4,096 ranks x 1,000 leaves: write < 2 s", "manifest write", 4096, lambda r: r["median"], 2.0)
    model_check(
        "manifest 4,096 ranks x 1,000 leaves: cached write < 0.5 s",
        "manifest write cached",
        4096,
        lambda r: r["median"],
        0.5,
    )
    model_check(
        'manifest 4,096 ranks x 1,000 leaves: one rank\'s open for shard="saved" < 0.5 s',
        "manifest open saved",
        4096,
        lambda r: r["median"],
        0.5,
    )
    model_check(
        'manifest 4,096 ranks x 1,000 leaves: one rank\'s open for shard="saved" < 256 MiB added RSS',
        "manifest open saved",
        4096,
        lambda r: r["rss_added_mib"],
        256,
        unit="MiB",
    )
    model_check(
        "manifest 4,096 ranks x 1,000 leaves: full-path gather < 64 MiB",
        "manifest write",
        4096,
        lambda r: r.get("gathered_mib"),
        64,
        unit="MiB",
    )
    model_check(
        "manifest 16,384 ranks x 1,000 leaves: write < 8 s", "manifest write", 16384, lambda r: r["median"], 8.0
    )
    model_check(
        "manifest 4,096 ranks x 1,000 leaves: open whole (shard=None in one process) < 2 s",
        "manifest open whole",
        4096,
        lambda r: r["median"],
        2.0,
    )
    model_check(
        "manifest 4,096 ranks x 1,000 leaves: open whole (shard=None in one process) < 1 GiB added RSS",
        "manifest open whole",
        4096,
        lambda r: r["rss_added_mib"],
        1024,
        unit="MiB",
    )
    model_check(
        "manifest 16,384 ranks x 1,000 leaves: open whole (shard=None in one process) < 8 s",
        "manifest open whole",
        16384,
        lambda r: r["median"],
        8.0,
    )
    certify_targets(med, records, check)
    incremental_targets(med, records, check)
    consolidate_targets(med, records, check, report)
    return out


#: Each consolidation (``consolidate.py``): what it writes, and DCP's conversion it is compared with.
CONSOLIDATIONS = (
    ("consolidate to hf", "Hugging Face sharded safetensors", "consolidate_safetensors_files"),
    ("consolidate to torch.save", "one torch.save file", "dcp_to_torch_save"),
)


def consolidate_targets(med, records: list[dict], check, report) -> None:
    """Consolidation (``consolidate.py``): one process converting a many-rank checkpoint holds about one leaf
    (peak RSS added at most the largest leaf + 256 MiB, the largest of its repeats), and its time beside DCP's."""
    for scenario, what, peer in CONSOLIDATIONS:
        mine = [r for r in records if (r.get("scenario"), r.get("impl")) == (scenario, "tddist")]
        if not mine:
            check(f"consolidation into {what}: peak RSS added <= the largest leaf + 256 MiB", None, None)
            continue
        e = mine[0]["extra"]
        leaf = e["largest_leaf_bytes"] / C.MIB
        rss = max(r["rss_added_mib"] for r in mine)
        check(
            f"consolidate {e['ranks']} ranks x {e['leaves']} leaves into {what}: peak RSS added <= the largest "
            f"leaf + 256 MiB",
            rss <= leaf + 256,
            f"{rss:.0f} MiB (largest leaf {leaf:.1f} MiB, so at most {leaf + 256:.0f} MiB)",
        )
        t, d = med(scenario, 1, "tddist", launcher="single"), med(scenario, 1, "dcp", launcher="single")
        if None not in (t, d):
            report(
                f"consolidate {e['ranks']} ranks x {e['leaves']} leaves into {what}: time against DCP's {peer}",
                f"DCP/tddist time {d / t:.2f}x (above 1: tddist is faster; tddist {C.fmt_seconds(t)}, dcp "
                f"{C.fmt_seconds(d)}; no target)",
            )


def incremental_targets(med, records: list[dict], check) -> None:
    """Incremental checkpoints (``incremental.py``): what a save against its base writes and takes, and its load."""
    full, inc = (
        med("incremental save", 1, "full", launcher="single"),
        med("incremental save", 1, "incremental", launcher="single"),
    )
    written = {
        impl: sorted(r["extra"]["written"] for r in records if (r.get("scenario"), r.get("impl")) == ("incremental save", impl))
        for impl in ("full", "incremental")
    }  # fmt: skip
    wfull, winc = (w[len(w) // 2] if w else None for w in (written["full"], written["incremental"]))
    check(
        "incremental save (95% frozen): writes <= 6% of a full save's bytes",
        None if None in (wfull, winc) else winc <= 0.06 * wfull,
        None if None in (wfull, winc) else f"{100 * winc / wfull:.1f}%",
    )
    check(
        "incremental save (95% frozen): <= 0.15x a full save's time",
        None if None in (full, inc) else inc <= 0.15 * full,
        None if None in (full, inc) else f"{inc / full:.3f}x ({C.fmt_seconds(inc)} vs {C.fmt_seconds(full)})",
    )
    lfull, linc = (
        med("incremental load", 1, "full", launcher="single"),
        med("incremental load", 1, "incremental", launcher="single"),
    )
    check(
        "load of an incremental checkpoint: <= 1.1x a full one's",
        None if None in (lfull, linc) else linc <= 1.1 * lfull,
        None if None in (lfull, linc) else f"{linc / lfull:.3f}x ({C.fmt_seconds(linc)} vs {C.fmt_seconds(lfull)})",
    )


def certify_targets(med, records: list[dict], check) -> None:
    """Certified checkpoints (``certify.py``): the counting's cost on a durable save, and no false findings."""
    counted = med("certify save", 1, "tddist", launcher="single")
    plain = med("certify save", 1, "tddist uncounted", launcher="single")
    check(
        "certification (NaN/Inf counts in the checksum pass): <= 3% of a durable save",
        None if None in (counted, plain) else counted <= 1.03 * plain,
        None
        if None in (counted, plain)
        else f"{100 * (counted / plain - 1):+.1f}% (counted {C.fmt_seconds(counted)}, uncounted "
        f"{C.fmt_seconds(plain)})",
    )
    clean = [r["extra"] for r in records if r.get("scenario") == "certify clean"]
    check(
        "certification: 0 false findings on clean saves",
        None if not clean else all(e["false_findings"] == 0 for e in clean),
        None if not clean else f"{sum(e['false_findings'] for e in clean)} in {sum(e['saves'] for e in clean)} saves",
    )


# --- main ---------------------------------------------------------------------------------------------


def main(argv=None) -> int:
    args = parse_args(argv)
    with C.host_memory_kept(enabled=not args.quick) as host_memory:
        return run(args, host_memory)


def run(args: argparse.Namespace, host_memory: str) -> int:
    """Every job of the run, on a machine whose freed memory stays in it (``_common.host_memory_kept``)."""
    base = args.dir or tempfile.gettempdir()
    os.makedirs(base, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="tddist-bench-", dir=base))
    machine = C.machine_info(str(work))
    machine["torch"] = _version_of("torch")
    machine["host_memory"] = host_memory
    started = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    lib = snapshot_tddist(work)
    worlds = args.worlds
    lcm = math.lcm(*worlds)
    rows = max(lcm, (args.size_mib * C.MIB // (LEAVES * COLS * 4)) // lcm * lcm)
    small_elems = max(lcm, math.ceil(256 / lcm) * lcm)
    cfg_common = {
        "dir": str(work),
        "repeats": args.repeats,
        "async_repeats": args.async_repeats,
        "rows": rows,
        "leaves": LEAVES,
        "cols": COLS,
        "small_tensors": args.small_tensors,
        "small_elems": small_elems,
        "commit_reps": args.commit_reps,
        "scenarios": [s for s in args.scenarios if s not in OWN_JOBS],
        "mpi_scenarios": ["commit"],
        "archive": args.archive,
    }
    payload_mib = rows * LEAVES * COLS * 4 / C.MIB
    print(
        f"tddist {lib['version']} (source digest {lib['source_digest']} of tddist/ and benchmarks/), "
        "snapshotted for this run",
        file=sys.stderr,
    )
    print(
        f"tddist benchmarks: payload {payload_mib:.0f} MiB over {worlds} ranks, {args.repeats} repeat(s), "
        f"checkpoints in a {machine['filesystem']} file system ({machine['cpus']} CPUs, {machine['memory_gib']} GiB); "
        f"{host_memory}",
        file=sys.stderr,
        flush=True,
    )
    records, notes, jobs = [], [], []
    biggest = max(worlds)
    keep = lambda w: {"tddist": str(work / f"keep-w{w}" / "tddist"), "dcp": str(work / f"keep-w{w}" / "dcp")}
    torch_scen = cfg_common["scenarios"]
    t_start = time.perf_counter()
    if torch_scen:
        for w in sorted(worlds, reverse=True):
            cfg = dict(cfg_common)
            if "reshard" in torch_scen:
                if w < biggest:
                    cfg["reshard_from"] = {str(biggest): keep(biggest)}
                elif biggest > 1:
                    cfg["make_world1_source"] = True
                    cfg["world1_source"] = {
                        "tddist": str(work / "src-w1" / "tddist"),
                        "dcp": str(work / "src-w1" / "dcp"),
                    }
            cfg_path, res_path = work / f"config-w{w}.json", work / f"result-w{w}.json"
            cfg_path.write_text(json.dumps(cfg))
            cmd = [
                sys.executable,
                "-m",
                "torch.distributed.run",
                "--standalone",
                f"--nproc-per-node={w}",
                job_script(WORKER),
                "--config",
                str(cfg_path),
                "--result",
                str(res_path),
            ]
            jobs.append(run_job(cmd, args.job_timeout, f"torchrun N={w}"))
            got, n = read_records(res_path)
            records += got
            notes += [x for x in n if x not in notes]
            if w != biggest and not args.keep:
                C.remove(str(work / f"keep-w{w}"))
    if "commit" in args.scenarios:
        mpiexec = Path(sys.executable).parent / "mpiexec"
        for w in args.mpi_worlds:
            if not mpiexec.exists():
                notes.append(f"mpiexec not found beside {Path(sys.executable).name}: MPI commit overhead not measured")
                break
            cfg_path, res_path = work / f"config-mpi{w}.json", work / f"result-mpi{w}.json"
            cfg_path.write_text(json.dumps(cfg_common))
            cmd = [
                str(mpiexec),
                "-n",
                str(w),
                sys.executable,
                job_script(WORKER),
                "--launcher",
                "mpi",
                "--config",
                str(cfg_path),
                "--result",
                str(res_path),
            ]
            jobs.append(run_job(cmd, args.job_timeout, f"mpiexec N={w}"))
            got, n = read_records(res_path)
            records += got
            notes += [x for x in n if x not in notes]

    def own_job(scenario: str, script: str, options: list[str], what: str) -> Path:
        """Run the program of a scenario that is a job of its own (``OWN_JOBS``) with ``options``, its result
        file last; add its records and notes; return the result file."""
        res_path = work / f"result-{scenario}.json"
        cmd = [sys.executable, job_script(script), *options, "--json", str(res_path)]
        jobs.append(run_job(cmd, args.job_timeout, what))
        got, n = read_records(res_path)
        records.extend(got)
        notes.extend(x for x in n if x not in notes)
        return res_path

    if "manifest" in args.scenarios:
        ranks = ",".join(map(str, args.manifest_ranks))
        options = ["--ranks", ranks, "--leaves", str(args.manifest_leaves), "--repeats", str(args.repeats)]
        own_job("manifest", SCALE, options + ["--dir", str(work / "manifest")], "manifest scale model")
    deferred_targets: list[dict] = []
    if "deferred" in args.scenarios:  # a training loop saving every 10 steps: one process, its own targets
        size = ["--quick"] if args.quick else ["--mib", str(args.size_mib)]  # the payload: 1 GiB, as the targets say
        res_path = own_job("deferred", DEFERRED, ["--dir", str(work / "deferred"), *size], "deferred snapshots")
        try:
            deferred_targets = json.loads(res_path.read_text()).get("targets", [])
        except (OSError, ValueError):
            notes.append("deferred snapshots: no result")
    if "replicas" in args.scenarios:  # the replicated node-local tier: two processes as two nodes
        options = ["--mib", str(args.replicas_mib), "--rounds", str(max(3, args.repeats)), "--dir", str(work)]
        own_job("replicas", REPLICAS, options, "replicated node-local tier")
    if "certify" in args.scenarios:
        options = ["--size-mib", str(args.size_mib), "--repeats", str(args.repeats)]
        own_job(
            "certify", CERTIFY, options + ["--clean-saves", str(args.clean_saves), "--dir", str(work)], "certification"
        )
    if "incremental" in args.scenarios:
        options = ["--size-mib", str(args.size_mib), "--repeats", str(max(3, args.repeats)), "--dir", str(work)]
        own_job("incremental", INCREMENTAL, options, "incremental checkpoints")
    if "consolidate" in args.scenarios:  # one process converts a many-rank checkpoint, beside DCP's consolidation
        own_job("consolidate", CONSOLIDATE, ["--dir", str(work), *(["--quick"] if args.quick else [])], "consolidation")
    total = time.perf_counter() - t_start
    if not args.keep:
        C.remove(str(work))

    table_rows = aggregate(records)
    targets = evaluate_targets(table_rows, records) + deferred_targets
    if args.quick:  # a few MB say nothing about the targets, which are defined at 1 GiB and thousands of ranks
        for t in targets:
            t["status"] = "not judged (--quick)" if t["status"] in ("met", "MISSED") else t["status"]
    print()
    print(
        f"## tddist {lib['version']} (source digest {lib['source_digest']}) vs peers: {payload_mib:.0f} MiB payload, "
        f"{args.repeats} repeat(s) ({args.async_repeats} of the asynchronous saves), {machine['cpus']} CPUs, {machine['memory_gib']} GiB, {machine['filesystem']} "
        f"({machine['filesystem_device']}), kernel {machine['kernel']}, load average at start "
        f"{machine['load_average_at_start'][0]:.1f}"
    )
    print("peer/tddist = peer median time / tddist median time in this run (above 1: tddist is faster).")
    print()
    print(format_table(table_rows))
    model = format_model(table_rows)
    if model:
        print("\nManifest model (medians; peak = the process's peak RSS during the stage, fragments included):")
        print(model)
    alloc = [r for r in records if r.get("kind") == "allocations"]
    for a in alloc:
        print(
            f"\nreturn_early N={a['world']}: snapshot buffers allocated by the first save per rank "
            f"{a['buffers_after_first_save']}, new ones afterwards per rank {a['new_allocations_after_first_save_per_rank']}"
        )
    print("\n## Targets")
    for t in targets:
        print(f"- [{t['status']}] {t['target']}: {t['detail'] or '-'}")
    for n in notes:
        print(f"NOTE: {n}")
    failed = [j for j in jobs if j["rc"] != 0]
    for j in failed:
        print(f"FAILED: {j['job']} (exit {j['rc']})")
    print(f"\nwall time of the run: {total:.0f} s")
    result = {
        "config": {k: v for k, v in vars(args).items() if k not in ("out", "dir")}
        | {"rows": rows, "leaves": LEAVES, "cols": COLS, "payload_mib": payload_mib, "small_elems": small_elems},
        "machine": machine,
        "tddist": lib,
        "jobs": jobs,
        "notes": notes,
        "targets": targets,
        "summary": table_rows,
        "records": records,
        "seconds": round(total, 1),
        "started_utc": started,
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1, default=str))
    print(f"results written to {out}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
