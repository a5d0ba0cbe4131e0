"""What checkpointing costs a training loop: no checkpoint, tddist (synchronous, return_early, deferred), DCP.

    .venv/bin/python benchmarks/deferred.py                  # 256 MiB of state, 40 steps, a save every 10
    .venv/bin/python benchmarks/deferred.py --quick          # 16 MiB, 10 steps, a save every 5
    .venv/bin/python benchmarks/deferred.py --json out.json  # the records, as benchmarks/run.py reads them

One process (a gloo group of one, for DCP) trains an MLP with Adam whose
forward and backward take about as long as a plain ``copy_`` of its state
(parameters and the optimizer's two moments; the batch is sized for it at the
start), and saves its state (``tddist.get_state``) every ``--every`` steps,
each implementation in turn on the same model, in one run:

- ``no checkpoint``: the reference step time;
- ``tddist synchronous``: ``tddist.save``;
- ``tddist return_early``: today's copy into the reused arena before ``save`` returns;
- ``tddist deferred``: ``snapshot="deferred", guard=opt``: ``save`` returns
  once planned, the copy runs on the copy helper while forward and backward
  run, and the next ``step()`` waits for it if it is not done;
- ``dcp.async_save`` with ``AsyncCheckpointerType`` THREAD and PROCESS, and
  with a ``DefaultStager`` kept across saves (``cached``: its staging buffers
  are reused, as tddist's arena is).

Two configurations: the training on one thread (``torch.set_num_threads(1)``;
the copy helper and the writer then have the other core of a 2-core machine),
and the training on every core (the copy then competes with the training's
own threads, so a deferred copy slows the steps it overlaps instead).

Per implementation: ``blocking`` (the median time inside the save call),
``step`` (the mean time of a training step, saves and waits included, over
the loop), ``overhead`` (``step`` over the no-checkpoint step, minus one),
``complete`` (the median time from the call until the save is durable), and
the deferred mode's snapshot memory allocated after its first save. A save
waits for the previous one of its implementation first. Numbers from a
shared machine are noisy.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
from benchmarks._common import MIB, fmt_seconds  # noqa: E402

WIDTH = 1024  # the MLP's width: each layer 4 MiB of parameters, 12 MiB of state with Adam's moments


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--mib", type=int, default=256, help="state (parameters and Adam's moments), MiB")
    ap.add_argument("--steps", type=int, default=40, help="training steps per implementation and configuration")
    ap.add_argument("--every", type=int, default=10, help="save every this many steps")
    ap.add_argument("--repeats", type=int, default=2, help="loops per implementation, interleaved (medians)")
    ap.add_argument("--threads", default="1,all", help="training thread counts: 1, all, or both")
    ap.add_argument("--dir", help="where checkpoints are written (default: a temporary directory)")
    ap.add_argument("--json", help="write the records here (benchmarks/run.py reads them)")
    ap.add_argument("--quick", action="store_true", help="16 MiB, 10 steps, a save every 5")
    args = ap.parse_args(argv)
    if args.quick:
        args.mib, args.steps, args.every, args.repeats = 16, 10, 5, 1
    return args


class Training:
    """An MLP with Adam, its batch sized so that forward and backward take about a copy of its state."""

    def __init__(self, mib: int) -> None:
        torch.manual_seed(0)
        layers = max(1, mib * MIB // (3 * 4 * WIDTH * WIDTH))
        self.model = torch.nn.Sequential(*[torch.nn.Linear(WIDTH, WIDTH) for _ in range(layers)])
        self.opt = torch.optim.Adam(self.model.parameters(), lr=1e-5)
        self.x = torch.randn(8, WIDTH)
        self.step()  # Adam's moments exist from here on
        self.floor_buffers = [torch.empty_like(t) for t in self.tensors()]

    def tensors(self) -> list[torch.Tensor]:
        """The saved state's tensors: parameters and the optimizer's moments."""
        out = [p.detach() for p in self.model.parameters()]
        for st in self.opt.state.values():
            out += [v for v in st.values() if v.numel() > 1]
        return out

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors())

    def forward_backward(self) -> None:
        self.opt.zero_grad(set_to_none=False)
        self.model(self.x).square().mean().backward()

    def step(self) -> None:
        self.forward_backward()
        self.opt.step()

    def copy_floor(self) -> float:
        """A plain ``copy_`` of the state into preallocated buffers (seconds)."""
        t0 = time.perf_counter()
        for dst, src in zip(self.floor_buffers, self.tensors()):
            dst.copy_(src)
        return time.perf_counter() - t0

    def size_batch(self) -> None:
        """Make forward and backward take about as long as ``copy_floor`` (the copy a deferred save hides)."""
        copy = min(self.copy_floor() for _ in range(3))
        for _ in range(2):
            t0 = time.perf_counter()
            self.forward_backward()
            fb = time.perf_counter() - t0
            rows = max(1, min(4096, round(self.x.shape[0] * copy / max(fb, 1e-6))))
            self.x = torch.randn(rows, WIDTH)


def implementations(tr: Training, groups: dict[str, Any]) -> dict[str, Callable[[str], Any]]:
    """Each implementation's save of the training's state to a path: returns a future, or None once durable.

    Each tddist mode saves over its own process group (``groups``), so each has its own channel and memory."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
    from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType

    import tddist

    stager = DefaultStager(
        StagingOptions(use_pinned_memory=False, use_shared_memory=False, use_async_staging=False,
                       use_non_blocking_copy=False)
    )  # fmt: skip

    def state() -> Any:
        return tddist.get_state(tr.model, tr.opt)

    def dcp_state() -> dict:
        return {"model": tr.model.state_dict(), "optim": tr.opt.state_dict()}

    def synchronous(p: str) -> None:
        tddist.save(state(), p, comm=groups["sync"])

    return {
        "tddist synchronous": synchronous,
        "tddist return_early": lambda p: tddist.save(state(), p, comm=groups["early"], return_early=True),
        "tddist deferred": lambda p: tddist.save(
            state(), p, comm=groups["deferred"], return_early=True, snapshot="deferred", guard=tr.opt
        ),  # fmt: skip
        "dcp.async_save THREAD": lambda p: dcp.async_save(
            dcp_state(), checkpoint_id=p, async_checkpointer_type=AsyncCheckpointerType.THREAD
        ),
        "dcp.async_save PROCESS": lambda p: dcp.async_save(
            dcp_state(), checkpoint_id=p, async_checkpointer_type=AsyncCheckpointerType.PROCESS
        ),
        "dcp.async_save(cached)": lambda p: dcp.async_save(dcp_state(), checkpoint_id=p, async_stager=stager),
    }


def _done(fut: Any) -> Any:
    """The future that resolves once the save is durable (DCP's staging response has its own)."""
    return getattr(fut, "upload_completion", fut)


def train(tr: Training, save: Callable[[str], Any] | None, root: Path, steps: int, every: int) -> dict:
    """``steps`` training steps, saving every ``every`` steps (after waiting for the previous save)."""
    blocking, complete, fut, started, ended = [], [], None, 0.0, [0.0]
    n = 0
    t_loop = time.perf_counter()
    for s in range(steps):
        if save is not None and s % every == 0:
            if fut is not None:
                _done(fut).result()
                complete.append(ended[0] - started)
            n += 1
            target = str(root / f"s{n % 3}")  # each save replaces the one of three saves before
            ended = [0.0]
            started = time.perf_counter()
            fut = save(target)
            blocking.append(time.perf_counter() - started)
            if fut is None:
                complete.append(blocking[-1])
            else:
                _done(fut).add_done_callback(lambda _f, e=ended: e.__setitem__(0, time.perf_counter()))
        tr.step()
    loop = time.perf_counter() - t_loop
    if fut is not None:
        _done(fut).result()
        complete.append(ended[0] - started)
    return {
        "blocking": statistics.median(blocking) if blocking else 0.0,
        "step": loop / steps,
        "complete": statistics.median(complete) if complete else 0.0,
    }


def run_config(tr: Training, threads: str, root: Path, args: argparse.Namespace, groups: dict[str, Any]) -> list[dict]:
    """Every implementation once, on ``threads`` training threads; one record each."""
    from tddist.comm.resolve import resolve
    from tddist.saving.background import channel

    torch.set_num_threads(1 if threads == "1" else os.cpu_count() or 1)
    tr.size_batch()
    floor = min(tr.copy_floor() for _ in range(5))  # the floor: the fastest of five (noise only slows a copy)
    impls: dict[str, Callable[[str], Any] | None] = {"no checkpoint": None, **implementations(tr, groups)}
    wheres = {}
    for name, save in impls.items():
        wheres[name] = where = root / threads / name.replace(" ", "_")  # each implementation its own paths
        where.mkdir(parents=True, exist_ok=True)
        if save is not None:  # the first save allocates buffers and starts threads and processes: not measured
            fut = save(str(where / "warm"))
            if fut is not None:
                _done(fut).result()
    ch = channel(resolve(groups["deferred"]))
    before = (ch.arena_allocations, ch.buffers.allocations)
    names, runs = list(impls), {n: [] for n in impls}
    for rep in range(args.repeats):  # interleaved, each repeat starting at the next implementation
        for name in names[rep % len(names) :] + names[: rep % len(names)]:
            runs[name].append(train(tr, impls[name], wheres[name], args.steps, args.every))
    allocated = (ch.arena_allocations - before[0], ch.buffers.allocations - before[1])
    records = []
    for name in names:
        for rep, m in enumerate(runs[name]):
            records.append(
                {
                    "scenario": f"training, {threads} thread{'s' if threads != '1' else ''}",
                    "world": 1,
                    "launcher": "process",
                    "impl": name,
                    "ref": "no checkpoint",
                    "repeat": rep,
                    "metrics": m,
                    "bytes": tr.nbytes(),
                    "extra": {"copy_floor": floor, "batch": tr.x.shape[0], "every": args.every,
                              "allocations_after_first_save": allocated},
                }
            )  # fmt: skip
        m = medians(records, records[-1]["scenario"], name)
        print(
            f"[{threads} thread(s)] {name}: blocking {fmt_seconds(m['blocking'])}, step {fmt_seconds(m['step'])}, "
            f"complete {fmt_seconds(m['complete'])}",
            file=sys.stderr,
            flush=True,
        )
    return records


def medians(records: list[dict], scenario: str, impl: str) -> dict[str, float]:
    """Each metric's median over the repeats of ``impl`` in ``scenario``."""
    runs = [r["metrics"] for r in records if r["scenario"] == scenario and r["impl"] == impl]
    return {k: statistics.median(m[k] for m in runs) for k in ("blocking", "step", "complete")}


def report(records: list[dict]) -> None:
    """The table of one run, and the issue's targets judged from it."""
    for scenario in dict.fromkeys(r["scenario"] for r in records):
        rows = [r for r in records if r["scenario"] == scenario]
        base = medians(records, scenario, "no checkpoint")["step"]
        floor = rows[0]["extra"]["copy_floor"]
        print(f"\n## {scenario}: state {rows[0]['bytes'] / MIB:.0f} MiB, plain copy_ {fmt_seconds(floor)}, "
              f"batch {rows[0]['extra']['batch']}, a save every {rows[0]['extra']['every']} steps")  # fmt: skip
        print(f"{'implementation':<26} {'blocking':>10} {'/copy_':>7} {'step':>10} {'overhead':>9} {'complete':>10}")
        for impl in dict.fromkeys(r["impl"] for r in rows):
            m = medians(records, scenario, impl)
            print(
                f"{impl:<26} {fmt_seconds(m['blocking']):>10} {m['blocking'] / floor:>7.3f} "
                f"{fmt_seconds(m['step']):>10} {100 * (m['step'] / base - 1):>8.1f}% {fmt_seconds(m['complete']):>10}"
            )
    print("\n## Targets")
    for t in targets(records):
        print(f"- [{t['status']}] {t['target']}: {t['detail']}")


def targets(records: list[dict]) -> list[dict]:
    """The deferred mode's targets: blocking <= 5% of a plain copy_, step overhead <= 3% on one training thread,
    no snapshot memory allocated after the first save; the all-threads overhead reported beside."""
    out = []
    for scenario in dict.fromkeys(r["scenario"] for r in records):
        rows = {r["impl"]: r for r in records if r["scenario"] == scenario}
        d = rows.get("tddist deferred")
        if d is None or "no checkpoint" not in rows:
            continue
        floor, m = d["extra"]["copy_floor"], medians(records, scenario, "tddist deferred")
        b, over = m["blocking"], m["step"] / medians(records, scenario, "no checkpoint")["step"] - 1
        one = scenario.endswith(", 1 thread")
        out.append({"target": f"deferred ({scenario}): blocking per save <= 5% of a plain copy_",
                    "status": "met" if b <= 0.05 * floor else "MISSED",
                    "detail": f"{100 * b / floor:.1f}% ({fmt_seconds(b)} against {fmt_seconds(floor)})"})  # fmt: skip
        out.append({"target": f"deferred ({scenario}): step time overhead of a save every {d['extra']['every']} steps"
                              + (" <= 3%" if one else " (reported; the copy competes with the training's threads)"),
                    "status": ("met" if over <= 0.03 else "MISSED") if one else "reported",
                    "detail": f"{100 * over:.1f}%"})  # fmt: skip
        alloc = d["extra"]["allocations_after_first_save"]
        out.append({"target": f"deferred ({scenario}): no new snapshot memory after the first save",
                    "status": "met" if tuple(alloc) == (0, 0) else "MISSED",
                    "detail": f"arenas, buffers allocated after the first saves (every tddist mode): "
                              f"{tuple(alloc)}"})  # fmt: skip
    return out


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    import logging
    import warnings

    import torch.distributed as dist

    logging.getLogger().setLevel(logging.WARNING)  # DCP's writer process logs every request at INFO
    warnings.filterwarnings("ignore", message="Detected an existing checkpoint")
    if not dist.is_initialized():  # DCP's async_save needs a process group: one of one rank
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    groups = {name: dist.new_group(backend="gloo") for name in ("sync", "early", "deferred")}
    tr = Training(args.mib)
    root = Path(args.dir or tempfile.mkdtemp(prefix="tddist-deferred-"))
    root.mkdir(parents=True, exist_ok=True)
    records: list[dict] = []
    try:
        for threads in [t.strip() for t in args.threads.split(",") if t.strip()]:
            records += run_config(tr, threads, root, args, groups)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    report(records)
    if args.json:
        Path(args.json).write_text(json.dumps({"records": records, "targets": targets(records)}))
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
