"""The replicated node-local tier (``replicas=1``): what replication costs a step, and a restore after a lost node.

    .venv/bin/python benchmarks/replicas.py                       # 128 MiB over 2 ranks, 5 rounds
    .venv/bin/python benchmarks/replicas.py --mib 8 --rounds 2    # quick
    .venv/bin/python benchmarks/replicas.py --json out.json       # records for benchmarks/run.py

Two processes on one gloo group, each told it is its own node (``node=``),
each with its own node-local directory (under ``--local``, default
``/dev/shm``) and one shared root (under ``--dir``). Measured, against the
targets:

- blocking: the median time ``step()`` blocks on a saving step with
  ``replicas=1`` against the same manager without replicas (target: at most
  1.10x), and the replication's own duration against that step's (target:
  it finishes before the next save at a save interval of 10x the save's
  duration, i.e. at most 10x);
- restore: the median time of ``restore`` of the same step with both nodes'
  local directories (healthy) and after rank 1's node lost its directory
  (its part comes from the replica on rank 0's node, over the group), with
  the shared root's data files renamed away, so that reading any byte of
  them fails: 0 bytes come from it (target: at most 1.3x the healthy one);
  the two alternate, from the same bytes (see ``restore_times``), and the
  background write of the received part after the restore is reported,
  beside the floor: a raw gloo send of as many bytes as the lost part holds
  (``loopback_floor``), what the transport alone costs on this machine;
- corruption: random single-bit corruptions of the replicas' files, each
  checked against its record, and a few restores after the lost node from a
  replica with one bit flipped, which must fall back to the shared root with
  the right values (target: 100% detected).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from tensordict import TensorDict

from benchmarks._common import MIB
from tddist.jobs.copies import file_names, mismatch, read_record
from tddist.jobs.manager import CheckpointManager
from tddist.jobs.replication import REPLICAS
from tddist.jobs.transfer import chunk_bytes

WORLD = 2


def state_of(mib: float, rank: int) -> TensorDict:
    """This rank's batch-sharded share (``mib`` MiB) of the state, in 8 leaves."""
    rows = max(1, int(mib * MIB) // (8 * 4 * 1024))
    gen = torch.Generator().manual_seed(rank)
    leaves = {f"w{i}": torch.randn(rows, 1024, generator=gen) for i in range(8)}
    return TensorDict(rows=TensorDict(leaves, batch_size=[rows]), step=torch.tensor(0), batch_size=[])


def blocking(rank: int, work: Path, local: Path, state: TensorDict, rounds: int) -> dict:
    """Median blocking time of a saving ``step()`` with and without replicas, and the replications' durations."""
    kw = dict(every=1, keep_last=1, preempt_signal=None, node=f"node-{rank}")
    plain = CheckpointManager(work / "plain", local_dir=local / f"plain-{rank}", **kw)
    rep = CheckpointManager(work / "rep", local_dir=local / f"rep-{rank}", replicas=1, **kw)
    times: dict[str, list[float]] = {"plain": [], "replicas": []}
    for r in range(rounds + 1):  # the first round warms up (the replication's group is created then)
        for name, mgr in [("plain", plain), ("replicas", rep)][:: 1 if r % 2 else -1]:
            state["step"].fill_(r + 1)
            dist.barrier()
            start = time.perf_counter()
            mgr.step(r + 1, state)
            took = time.perf_counter() - start
            mgr.wait()  # the promotion (and the replication) outside the timing
            if r:
                times[name].append(took)
    replicator = rep._tiered.replicator if rep._tiered is not None else None
    replication = [replicator.replicated[s] for s in range(2, rounds + 2)] if replicator else []
    plain.close()
    rep.close()
    return {"blocking": times, "replication": replication}


def restore_times(rank: int, work: Path, local: Path, rounds: int) -> dict:
    """Median ``restore`` of the newest step with both nodes up, and after rank 1's node lost its directory.

    Fair to the healthy restore: both restore the same step, each from the
    same bytes (rank 1's directory is put back from a copy taken before the
    first restore, so a healthy restore never reads what a restore after the
    loss wrote), with the files in the page cache alike (``os.sync`` before
    each), in alternating order (healthy first in even rounds, lost first in
    odd ones). The write of rank 1's part after a lost-node restore (in the
    background, after ``restore`` returned) is not in the restore's time:
    what ``close()`` still waits for it is reported apart, as ``kept``.
    """
    out: dict[str, list] = {"healthy": [], "lost": [], "tiers": [], "steps": [], "kept": []}
    mine, pristine = local / f"rep-{rank}", local / f"pristine-{rank}"
    shutil.copytree(mine, pristine)
    expected = state_of(float(os.environ["REPLICA_BENCH_MIB"]) / WORLD, rank)
    for r in range(rounds):
        for case in ("healthy", "lost")[:: 1 if r % 2 == 0 else -1]:
            if rank == 1:  # rank 0's node stays as it is; rank 1's is whole (healthy) or gone (lost)
                shutil.rmtree(mine, ignore_errors=True)
                if case == "healthy":
                    shutil.copytree(pristine, mine)
            mgr = CheckpointManager(work / "rep", local_dir=mine, replicas=1, preempt_signal=None, node=f"node-{rank}")
            state = expected.apply(torch.zeros_like)
            os.sync()
            dist.barrier()
            start = time.perf_counter()
            got = mgr.restore(state)
            took = max(dist_all(time.perf_counter() - start))
            assert got.tier in ("local", "peers"), got
            assert (state["rows"] == expected["rows"]).all(), f"rank {rank}: {case} restore loaded other values"
            out[case].append(took)
            out["tiers"].append(got.tier)
            out["steps"].append(int(got))
            begin = time.perf_counter()
            mgr.close()  # waits for the write of a part received from a peer
            if case == "lost":
                out["kept"].append(max(dist_all(time.perf_counter() - begin)))
    shutil.rmtree(pristine)
    return out


def loopback_floor(local: Path, rounds: int) -> dict:
    """The transport's own time under a lost-node restore: rank 0 sends rank 1 as many bytes as rank 1's part
    holds, over the same gloo group, in the restore's chunks, from memory into memory already touched (no
    file, no hash, no state): the floor under what the restore adds to a healthy one, on this machine."""
    box: list[object] = [None]
    if dist.get_rank() == 0:
        newest = sorted((local / "rep-0" / REPLICAS).glob("step-*"))[-1] / "rank-1-of-2"
        box[0] = sum(p.stat().st_size for p in newest.iterdir() if p.is_file())
    dist.broadcast_object_list(box, src=0)
    nbytes, chunk = int(box[0]), chunk_bytes()  # type: ignore[call-overload]
    buf = torch.ones(nbytes, dtype=torch.uint8)
    times = []
    for _r in range(rounds + 1):  # the first round warms up
        dist.barrier()
        start = time.perf_counter()
        pieces = [buf[a : a + chunk] for a in range(0, nbytes, chunk)]
        works = [dist.isend(p, 1) if dist.get_rank() == 0 else dist.irecv(p, 0) for p in pieces]
        for w in works:
            w.wait()
        times.append(max(dist_all(time.perf_counter() - start)))
    return {"bytes": nbytes, "times": times[1:]}


def dist_all(value: float) -> list[float]:
    box: list[object] = [None] * WORLD
    dist.all_gather_object(box, value)
    return [float(v) for v in box]  # type: ignore[arg-type]


def corruptions(local: Path, n: int, seed: int = 0) -> dict:
    """Flip one random bit of a random replica file ``n`` times; count how many the record check detects."""
    rng = random.Random(seed)
    base = local / "rep-0" / REPLICAS
    copies = [p for p in sorted(base.glob("step-*/rank-*")) if p.is_dir() and read_record(str(p)) is not None]
    detected = 0
    for _ in range(n):
        copy = rng.choice(copies)
        record = read_record(str(copy))
        assert record is not None
        path = copy / rng.choice([f for f in file_names(str(copy)) if (copy / f).stat().st_size])
        original = path.read_bytes()
        raw = bytearray(original)
        raw[rng.randrange(len(raw))] ^= 1 << rng.randrange(8)
        path.write_bytes(bytes(raw))
        detected += mismatch(str(copy), record.files) is not None
        path.write_bytes(original)
    return {"injected": n, "detected": detected}


def corrupted_restores(rank: int, work: Path, local: Path, n: int, seed: int = 1) -> dict:
    """Restores after rank 1's node lost its directory, each with one random bit of rank 0's replica of rank 1's
    part flipped (the shared root's data files back in place): detected when every rank restored the expected
    values from the shared root, never from the corrupted replica."""
    rng = random.Random(seed)
    newest = sorted((local / "rep-0" / REPLICAS).glob("step-*"))[-1] / "rank-1-of-2"
    names = [f for f in file_names(str(newest)) if (newest / f).stat().st_size]
    expected = state_of(float(os.environ["REPLICA_BENCH_MIB"]) / WORLD, rank)
    detected = 0
    for _ in range(n):
        path = newest / rng.choice(names)
        original = path.read_bytes()
        if rank == 0:
            raw = bytearray(original)
            raw[rng.randrange(len(raw))] ^= 1 << rng.randrange(8)
            path.write_bytes(bytes(raw))
        else:
            shutil.rmtree(local / "rep-1", ignore_errors=True)
        dist.barrier()
        mgr = CheckpointManager(
            work / "rep", local_dir=local / f"rep-{rank}", replicas=1, preempt_signal=None, node=f"node-{rank}"
        )
        state = expected.apply(torch.zeros_like)
        got = mgr.restore(state)
        mgr.close()
        ok = got.tier == "shared" and bool((state["rows"] == expected["rows"]).all())
        detected += min(dist_all(float(ok))) == 1.0
        if rank == 0:
            path.write_bytes(original)
        dist.barrier()
    return {"injected": n, "detected": detected}


def worker(rank: int, args: argparse.Namespace, work: Path, local: Path) -> None:
    dist.init_process_group("gloo", init_method=f"file://{work / 'store'}", rank=rank, world_size=WORLD)
    os.environ["REPLICA_BENCH_MIB"] = str(args.mib)
    state = state_of(args.mib / WORLD, rank)
    saves = blocking(rank, work, local, state, args.rounds)
    for p in (work / "rep").rglob("*.data"):  # reading any byte of the shared root now fails
        if rank == 0:
            p.rename(p.with_name(p.name + ".hidden"))
    dist.barrier()
    restores = restore_times(rank, work, local, args.rounds)
    floor = loopback_floor(local, args.rounds)
    for p in (work / "rep").rglob("*.data.hidden"):  # the shared root is whole again: the restores fall back to it
        if rank == 0:
            p.rename(p.with_name(p.name.removesuffix(".hidden")))
    dist.barrier()
    network = corrupted_restores(rank, work, local, args.corrupted_restores)
    if rank == 0:
        record = {"kind": "replicas", "mib": args.mib, "rounds": args.rounds, **saves, **restores, "floor": floor}
        record["corruption"] = {**corruptions(local, args.corruptions), "restores": network}
        (work / "result.json").write_text(json.dumps(record))
    dist.barrier()
    dist.destroy_process_group()


def report(record: dict) -> list[tuple[str, bool, str]]:
    """The targets: (what, met, detail)."""
    med = {k: statistics.median(v) for k, v in record["blocking"].items()}
    rep_med = statistics.median(record["replication"]) if record["replication"] else float("nan")
    healthy, lost = statistics.median(record["healthy"]), statistics.median(record["lost"])
    kept = statistics.median(record["kept"]) if record.get("kept") else float("nan")
    floor = record.get("floor", {"bytes": 0, "times": [float("nan")]})
    raw = statistics.median(floor["times"])
    c = record["corruption"]
    r = c.get("restores", {"injected": 0, "detected": 0})
    return [
        ("replication adds <= 10% to a saving step's blocking time", med["replicas"] <= 1.10 * med["plain"],
         f"{med['replicas'] / med['plain']:.2f}x ({med['replicas'] * 1e3:.1f} ms vs {med['plain'] * 1e3:.1f} ms)"),
        ("replication finishes within 10x the save's blocking time (the next save at that interval)",
         rep_med <= 10 * med["replicas"],
         f"{rep_med / med['replicas']:.2f}x ({rep_med * 1e3:.1f} ms)"),
        ("restore after losing 1 of 2 nodes: 0 bytes from the shared root, <= 1.3x a healthy local restore",
         lost <= 1.3 * healthy and "shared" not in record["tiers"] and len(set(record["steps"])) == 1,
         f"{lost / healthy:.2f}x ({lost * 1e3:.1f} ms vs {healthy * 1e3:.1f} ms; tiers {sorted(set(record['tiers']))}"
         f", step {sorted(set(record['steps']))}; close() then waited {kept * 1e3:.1f} ms for the received part's "
         f"write; the floor, a raw gloo send of the same {floor['bytes'] / MIB:.0f} MiB: {raw * 1e3:.1f} ms, "
         f"{(healthy + raw) / healthy:.2f}x if added to the healthy one)"),
        ("replica checksums: 100% of injected corruptions detected",
         c["detected"] == c["injected"] and r["detected"] == r["injected"],
         f"{c['detected']}/{c['injected']} by the record check, {r['detected']}/{r['injected']} in restores over "
         f"the network"),
    ]  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--mib", type=int, default=128, help="size of the state over both ranks (MiB)")
    parser.add_argument("--rounds", type=int, default=5, help="timed saves and restores of each kind")
    parser.add_argument("--corruptions", type=int, default=200, help="corruptions of replicas injected")
    parser.add_argument(
        "--corrupted-restores", type=int, default=5, help="restores after a lost node from a corrupted replica"
    )
    parser.add_argument("--dir", default=None, help="where the shared root goes (default: a temporary directory)")
    parser.add_argument("--local", default=None, help="node-local storage (default: /dev/shm where it exists)")
    parser.add_argument("--json", default=None, help="write the record here (for benchmarks/run.py)")
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="tddist-replicas-", dir=args.dir))
    local_base = args.local or ("/dev/shm" if os.path.isdir("/dev/shm") else None)
    local = Path(tempfile.mkdtemp(prefix="tddist-replicas-", dir=local_base))
    try:
        mp.start_processes(worker, args=(args, work, local), nprocs=WORLD, start_method="fork")
        record = json.loads((work / "result.json").read_text())
    finally:
        shutil.rmtree(work, ignore_errors=True)
        shutil.rmtree(local, ignore_errors=True)
    print(f"state: {args.mib} MiB over {WORLD} ranks on 2 nodes, {args.rounds} rounds; local tier under {local}")
    targets = report(record)
    for what, ok, detail in targets:
        print(f"- [{'met' if ok else 'MISSED'}] {what}: {detail}")
    if args.json:
        record["targets"] = [{"target": w, "met": ok, "detail": d} for w, ok, d in targets]
        Path(args.json).write_text(json.dumps({"records": [record]}))


if __name__ == "__main__":
    main()
