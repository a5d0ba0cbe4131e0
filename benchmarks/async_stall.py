"""How long an asynchronous save stalls the caller, against a plain copy and DCP's async_save.

    .venv/bin/python benchmarks/async_stall.py                 # 64 MiB per rank, worlds 1,2,4, 3 repeats
    .venv/bin/python benchmarks/async_stall.py --quick         # 8 MiB per rank, worlds 1,2, 1 repeat
    .venv/bin/python benchmarks/async_stall.py --tensors 1000 --worlds 1 --steps 0   # per-leaf cost

One ``torchrun --standalone`` job per world size (gloo, CPU, OMP_NUM_THREADS=1)
runs three scenarios, every implementation on the same data, interleaved (each
repeat starts at the next implementation):

1. blocking: the time until ``save`` returns (the slowest rank, between
   barriers) and the caller's CPU time in it, for a plain ``copy_`` into
   preallocated buffers (the floor), a synchronous ``tddist.save`` (for the
   completion time), ``tddist.save(return_early=True)`` with
   ``async_writer`` "thread" and "process",
   ``tddist.save(return_early=True, snapshot_budget=state/4)``, and
   ``dcp.async_save`` with ``async_checkpointer_type`` THREAD and PROCESS;
   plain tensors and DTensors (Shard(0) over all ranks); plus the peak RSS the
   save added (``VmHWM`` after resetting it; DCP's PROCESS mode copies into a
   child process, whose memory is not counted). Each implementation
   alternates between two paths, so every save replaces the checkpoint of
   two saves before (as a job that overwrites "latest" does): a synchronous
   save removes it before returning, a ``return_early`` save after its
   future resolves. The rows "tddist sync, new" and "tddist thread, new" save
   to a new path every time instead (as ``CheckpointManager`` does), so the
   completion ratio is also given without any removal.
2. training stall: CPU MLP steps (tens of ms each) with a save of the state
   every K steps (the previous one waited for first): mean and p95 step time
   while a save is in flight against steps without saving, and the training
   time lost per save (all steps' time over the no-saving mean, per save).
3. the budget: blocking time and peak RSS added with ``snapshot_budget`` at a
   quarter of the state, beside the whole-state snapshot.

Ratios are taken within one job only. Numbers from a shared machine are noisy.
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
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
from benchmarks._common import MIB, host_memory_kept, hwm_kib, reset_hwm, rss_kib  # noqa: E402

N_TENSORS = 32  # the default; --tensors sets it (many small leaves show the per-leaf cost)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--mib", type=int, default=64, help="state per rank (MiB)")
    ap.add_argument("--worlds", default="1,2,4")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--tensors", type=int, default=N_TENSORS, help="float32 leaves the state is split into")
    ap.add_argument("--steps", type=int, default=40, help="training steps per implementation")
    ap.add_argument("--every", type=int, default=8, help="save every K steps")
    ap.add_argument("--dir", default=None, help="where checkpoints go (default: a temp dir)")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--out", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.quick:
        args.mib, args.worlds, args.repeats, args.steps, args.every = 8, "1,2", 1, 12, 4
    if args.worker:
        return worker(args)
    with host_memory_kept(enabled=not args.quick) as host_memory:
        print(host_memory, flush=True)
        run_worlds(args)


def run_worlds(args: argparse.Namespace) -> None:
    """One torchrun job per world size, each reported as it ends."""
    work = Path(args.dir or tempfile.mkdtemp(prefix="async-stall-"))
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(HERE.parent))
    for world in [int(w) for w in args.worlds.split(",")]:
        out = work / f"results-{world}.json"
        cmd = [
            sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={world}", __file__,
            "--worker", f"--mib={args.mib}", f"--tensors={args.tensors}", f"--repeats={args.repeats}", f"--steps={args.steps}",
            f"--every={args.every}", f"--dir={work / f'w{world}'}", f"--out={out}",
        ]  # fmt: skip
        subprocess.run(cmd, env=env, check=True)
        report(world, json.loads(out.read_text()))
    if args.dir is None:
        shutil.rmtree(work, ignore_errors=True)


# --- the job's ranks ------------------------------------------------------------------------


def worker(args: argparse.Namespace) -> None:
    import datetime

    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from tensordict import TensorDict
    from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType

    import tddist
    from tddist.saving.arena import MIN_BUDGET

    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=1800))
    rank, world = dist.get_rank(), dist.get_world_size()
    timing = dist.new_group(backend="gloo")
    dcp_pg = dist.new_group(backend="gloo")  # DCP's documentation advises its own group for async_save
    # One group (so one tddist channel, with its own buffers) per tddist mode: a budgeted save frees the
    # whole-state buffers of its channel, which would make the next thread save allocate them again.
    thread_pg, process_pg, budget_pg, sync_pg = (dist.new_group(backend="gloo") for _ in range(4))
    root = Path(args.dir)
    root.mkdir(parents=True, exist_ok=True)
    numel = args.mib * MIB // 4 // args.tensors
    plain = {f"w{i}": torch.randn(numel) for i in range(args.tensors)}
    states = {"plain": plain}
    if world > 1:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor import DTensor, Shard

        mesh = init_device_mesh("cpu", (world,))
        states["dtensor"] = {
            k: DTensor.from_local(v.clone(), mesh, [Shard(0)], run_check=False) for k, v in plain.items()
        }
    budget = max(args.mib * MIB // 4, MIN_BUDGET)
    floor_buffers = {k: torch.empty_like(v) for k, v in plain.items()}
    results: dict = {"blocking": {}, "stall": {}, "notes": []}
    counter = [0]

    def target(label: str) -> str:
        counter[0] += 1
        return str(root / f"{label.replace(' ', '_').replace('/', '_')}-{counter[0] % 2}")

    def new_target(label: str) -> str:
        """A path no save used before (``clear_new_targets`` removes them between saves, untimed)."""
        counter[0] += 1
        return str(root / "new" / f"{label}-{counter[0]}")

    def clear_new_targets() -> None:
        if rank == 0:
            shutil.rmtree(root / "new", ignore_errors=True)
            (root / "new").mkdir()

    def wait(fut) -> None:
        if fut is None:
            return
        done = getattr(fut, "upload_completion", None)  # DCP's AsyncSaveResponse
        (done if done is not None else fut).result()

    def sync_save(td, path: str) -> None:
        tddist.save(td, path, comm=sync_pg)  # returns the saved TensorDict, not a future

    def saver(label: str, sd: dict):
        td = TensorDict(sd, [])

        def floor():
            for k, v in sd.items():
                floor_buffers[k].copy_(v.to_local() if hasattr(v, "to_local") else v)

        table = {
            "copy_ floor": lambda: floor() or None,
            "tddist synchronous": lambda: sync_save(td, target(label + "-ts")),
            "tddist thread": lambda: tddist.save(td, target(label + "-tt"), return_early=True, comm=thread_pg),
            "tddist sync, new": lambda: sync_save(td, new_target(label + "-tsn")),
            "tddist thread, new": lambda: tddist.save(td, new_target(label + "-ttn"), return_early=True, comm=thread_pg),
            "tddist process": lambda: tddist.save(td, target(label + "-tp"), return_early=True, async_writer="process", comm=process_pg),
            "tddist budget/4": lambda: tddist.save(td, target(label + "-tb"), return_early=True, snapshot_budget=budget, comm=budget_pg),
            "dcp THREAD": lambda: dcp.async_save(
                sd, checkpoint_id=target(label + "-dt"), process_group=dcp_pg, async_checkpointer_type=AsyncCheckpointerType.THREAD
            ),
            "dcp PROCESS": lambda: dcp.async_save(
                sd, checkpoint_id=target(label + "-dp"), process_group=dcp_pg,
                async_checkpointer_type=AsyncCheckpointerType.PROCESS,
            ),
        }  # fmt: skip
        return table

    def measure(fn) -> dict:
        clear_new_targets()
        dist.barrier(group=timing)
        reset_hwm()
        before = rss_kib()
        t0, c0 = time.perf_counter(), time.thread_time()
        fut = fn()
        blocking, cpu = time.perf_counter() - t0, time.thread_time() - c0
        wait(fut)
        total = time.perf_counter() - t0
        added = (hwm_kib() - before) * 1024
        gathered: list = [None] * world
        dist.all_gather_object(gathered, (blocking, cpu, total, added), group=timing)
        return {
            "blocking": max(g[0] for g in gathered),
            "cpu": max(g[1] for g in gathered),
            "total": max(g[2] for g in gathered),
            "rss_added": max(g[3] for g in gathered),
        }

    # 1 and 3: blocking time, CPU, completion, RSS added
    for kind, sd in states.items():
        impls = saver(kind, sd)
        names = list(impls)
        rows: dict = {n: [] for n in names}
        for n in names:  # first saves allocate buffers, start threads and processes: not measured
            try:
                measure(impls[n])
            except Exception as e:  # an implementation that cannot run here is reported, not fatal
                results["notes"].append(f"{kind} {n}: {type(e).__name__}: {e}"[:300])
                rows.pop(n)
        names = [n for n in names if n in rows]
        for rep in range(args.repeats):
            for n in names[rep % len(names) :] + names[: rep % len(names)]:
                rows[n].append(measure(impls[n]))
        results["blocking"][kind] = rows

    # 2: training stall
    model = torch.nn.Sequential(*[torch.nn.Linear(768, 768) for _ in range(6)])
    opt = torch.optim.SGD(model.parameters(), lr=1e-4)
    x = torch.randn(96, 768)

    def step() -> None:
        opt.zero_grad()
        model(x).square().mean().backward()
        opt.step()

    impls = saver("stall", plain)
    skip = ("copy_ floor", "tddist synchronous", "tddist sync, new", "tddist thread, new")
    names = ["no saving"] + [n for n in impls if n not in skip and n in results["blocking"]["plain"]]
    stall: dict = {n: {"all": [], "in_flight": [], "saves": 0} for n in names}
    for _ in range(3):
        step()
    for rep in range(args.repeats):
        for n in names[rep % len(names) :] + names[: rep % len(names)]:
            dist.barrier(group=timing)
            fut = None
            for s in range(args.steps):
                t0 = time.perf_counter()
                if n != "no saving" and s % args.every == 0:
                    wait(fut)
                    fut = impls[n]()
                    stall[n]["saves"] += 1
                step()
                dt = time.perf_counter() - t0
                stall[n]["all"].append(dt)
                busy = fut is not None and not (getattr(fut, "upload_completion", fut)).done()
                if busy or (n != "no saving" and s % args.every == 0):
                    stall[n]["in_flight"].append(dt)
            wait(fut)
    results["stall"] = stall
    if rank == 0:
        Path(args.out).write_text(json.dumps(results))
    dist.barrier(group=timing)
    dist.destroy_process_group()


# --- the report -----------------------------------------------------------------------------


def _med(rows: list[dict], key: str) -> float:
    return statistics.median(r[key] for r in rows) if rows else float("nan")


def _p95(xs: list[float]) -> float:
    if not xs:
        return float("nan")
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(0.95 * (len(xs) - 1))))]


def report(world: int, res: dict) -> None:
    print(f"\n=== N={world} (medians over repeats; the slowest rank; noisy on a shared machine) ===")
    for kind, rows in res["blocking"].items():
        floor = _med(rows.get("copy_ floor", []), "blocking")
        print(
            f"{kind}: {'implementation':<18} {'blocking s':>10} {'x floor':>8} {'cpu s':>7} {'done s':>7} {'RSS+ MiB':>9}"
        )
        for name, r in rows.items():
            b = _med(r, "blocking")
            print(
                f"{'':{len(kind) + 1}} {name:<18} {b:>10.4f} {b / floor:>8.2f} {_med(r, 'cpu'):>7.3f} "
                f"{_med(r, 'total'):>7.3f} {_med(r, 'rss_added') / MIB:>9.1f}"
            )
        pad = " " * (len(kind) + 1)
        dcp_modes = {n: _med(rows[n], "blocking") for n in ("dcp THREAD", "dcp PROCESS") if n in rows}
        for mine in ("tddist thread", "tddist process"):
            if mine not in rows:
                continue
            b = _med(rows[mine], "blocking")
            if dcp_modes:
                best = min(dcp_modes, key=lambda n: dcp_modes[n])
                print(f"{pad} {mine} blocking / DCP's best mode ({best}): {b / dcp_modes[best]:.2f} (target <= 0.5)")
            if "tddist synchronous" in rows:
                sync = _med(rows["tddist synchronous"], "total")
                print(
                    f"{pad} {mine} completion / synchronous save: {_med(rows[mine], 'total') / sync:.2f} (target <= 1.1)"
                )
        if "tddist thread, new" in rows and "tddist sync, new" in rows:
            ratio = _med(rows["tddist thread, new"], "total") / _med(rows["tddist sync, new"], "total")
            print(f"{pad} tddist thread completion / synchronous save, new targets: {ratio:.2f} (target <= 1.1)")
    base = res["stall"].get("no saving", {}).get("all", [])
    bm = statistics.mean(base) if base else float("nan")
    if base:  # --steps 0 measures no training
        print(f"training steps: no saving mean {bm * 1e3:.1f} ms, p95 {_p95(base) * 1e3:.1f} ms")
    for name, s in res["stall"].items():
        if name == "no saving" or not s["all"]:
            continue
        f = s["in_flight"]
        m = statistics.mean(f) if f else float("nan")
        # The training time a save costs in all: every step's time over the no-saving mean, summed, per save.
        # Unlike the in-flight mean, it does not favour a save that ends early (its few in-flight steps are the
        # slow ones) or one that runs long over cheap steps.
        lost = (sum(s["all"]) - len(s["all"]) * bm) / max(s.get("saves", 0), 1)
        print(
            f"  {name:<18} with a save in flight: mean {m * 1e3:7.1f} ms ({m / bm:.2f}x), p95 {_p95(f) * 1e3:7.1f} ms "
            f"({_p95(f) / _p95(base):.2f}x); all steps mean {statistics.mean(s['all']) * 1e3:.1f} ms; "
            f"training time lost per save {lost * 1e3:.0f} ms"
        )
    for note in res["notes"]:
        print("NOTE:", note)


if __name__ == "__main__":
    main()
