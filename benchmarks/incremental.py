#!/usr/bin/env python
"""Incremental checkpoints: a save that references its base's unchanged chunks next to a full save.

    .venv/bin/python benchmarks/incremental.py [--size-mib 1024] [--repeats 3] [--dir DIR] [--json OUT]

One process saves a LoRA-like state, 95% of its bytes frozen: a large frozen
base (``--size-mib`` in all, 16 leaves) and small adapters with their Adam
state (``exp_avg``, ``exp_avg_sq``), which change at every step. A first full
save is the base; then, per repeat, alternating which goes first, the same
step is saved

- ``full``: ``tddist.save(state, target)``;
- ``incremental``: ``tddist.save(state, target, base=...)`` (every chunk hashed);
- ``incremental trusted``: the same with ``trust_versions=True`` (a leaf whose
  memory and version counter did not change since this process hashed it is
  not hashed again), beside it, not judged (an opt-in with a documented limit);

each durable (the save's own fsyncs), each with ``--num-threads`` writer
threads (2, as every tddist save of ``worker.py``), and the bytes it wrote counted from the
data files' allocated blocks (a referenced chunk's range is a hole). Then
both are loaded cold (the page cache dropped before each load where the
script may: root) and every byte touched (``load full``, ``load
incremental``, alternating). The page cache is not dropped before the saves
(as ``certify.py``): the state is in memory, and here a drop before an
incremental save made the next cold loads of 1 GiB 3-4x slower, whatever
they read, for a reason not found. The targets (benchmarks/README.md): an incremental save writes
<= 6% of a full save's bytes and takes <= 0.15x its time; its load takes
<= 1.1x a full one's.

A load is judged against the full save of the same step (``full``); a full
checkpoint saved right after the base (``full aged``, as old as the
checkpoint that holds the incremental one's frozen bytes) is loaded too, for
comparison.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import shutil
import sys
import tempfile
import time

import _common as C
import torch
from tensordict import TensorDict

import tddist

FROZEN_LEAVES = 16
FROZEN_SHARE = 0.95


def state(size_mib: int) -> TensorDict:
    """The training state: frozen leaves (95% of the bytes) and adapters with their Adam moments (5%)."""
    total = size_mib * C.MIB
    frozen_rows = max(1, int(total * FROZEN_SHARE) // (FROZEN_LEAVES * 4 * 1024))
    adapter_rows = max(1, int(total * (1 - FROZEN_SHARE)) // (3 * 4 * 1024))
    gen = torch.Generator().manual_seed(0)
    frozen = {f"layer{i}": torch.randn(frozen_rows, 1024, generator=gen) for i in range(FROZEN_LEAVES)}
    adapter = {name: torch.randn(adapter_rows, 1024, generator=gen) for name in ("lora", "exp_avg", "exp_avg_sq")}
    return TensorDict({"base": TensorDict(frozen, []), "adapter": TensorDict(adapter, []), "step": torch.tensor(0)})


def train_step(td: TensorDict, step: int) -> None:
    """A step of training: the adapters and their moments change in place; the frozen base does not."""
    gen = torch.Generator().manual_seed(1000 + step)
    for t in td["adapter"].values():
        t.copy_(torch.randn(t.shape, generator=gen))
    td["step"].fill_(step)


def allocated(path: str) -> int:
    """Bytes of disk a checkpoint's files take (holes take none)."""
    total = 0
    for dirpath, _dirs, files in os.walk(path):
        total += sum(os.stat(os.path.join(dirpath, f)).st_blocks * 512 for f in files)
    return total


def _cold() -> bool:
    done, _why = C.drop_page_cache()
    return done


def _record(scenario: str, impl: str, rep: int, seconds: float, nbytes: int, cold: bool, written: int = 0) -> dict:
    return {
        "scenario": scenario,
        "world": 1,
        "launcher": "single",
        "impl": impl,
        "ref": "full",
        "repeat": rep,
        "metrics": {"time": seconds},
        "bytes": nbytes,
        "extra": {"written": written, "cold": cold},
    }


def save_records(size_mib: int, repeats: int, directory: str, num_threads: int = 2) -> list[dict]:
    """The base (a full save, then an incremental one, as a job with ``incremental=True`` has after its first
    steps), then per repeat a full and an incremental save of the next step, alternating."""
    td = state(size_mib)
    tddist.save(td, os.path.join(directory, "step-0"))
    train_step(td, 1)
    base = os.path.join(directory, "step-1")
    tddist.save(td, base, base=os.path.join(directory, "step-0"), trust_versions=True)  # hashes remembered
    tddist.save(td, os.path.join(directory, "full-aged"))  # a full checkpoint as old as the holder
    out = []
    for rep in range(repeats):
        train_step(td, rep + 2)
        nbytes = sum(t.numel() * t.element_size() for t in td.values(True, True))
        impls = ("full", "incremental", "incremental trusted")
        order = impls[rep % 3 :] + impls[: rep % 3]
        for impl in order:
            target = os.path.join(directory, f"{impl}-{rep}")
            os.sync()  # the previous writes are not this save's to wait for
            cold = False  # the state is in memory; the page cache is dropped before loads only
            t0 = time.perf_counter()
            kwargs = {} if impl == "full" else {"base": base, "trust_versions": impl == "incremental trusted"}
            tddist.save(td, target, num_threads=num_threads, **kwargs)
            seconds = time.perf_counter() - t0
            written = allocated(target)
            out.append(_record("incremental save", impl, rep, seconds, nbytes, cold, written))
            print(f"[save rep {rep}] {impl}: {C.fmt_seconds(seconds)}, {written / C.MIB:.1f} MiB on disk",
                  file=sys.stderr, flush=True)  # fmt: skip
        out += load_records(directory, rep, nbytes)
    # removed only now: on a file system mounted with "discard", removing a GiB trims it while the next
    # measurements run, and slows them by whatever the device does meanwhile
    for rep in range(repeats):
        for impl in ("full", "incremental", "incremental trusted"):
            shutil.rmtree(os.path.join(directory, f"{impl}-{rep}"))
    return out


def load_records(directory: str, rep: int, nbytes: int) -> list[dict]:
    """A cold load of the full and of the incremental checkpoint of repeat ``rep``, every byte touched."""
    out = []
    order = ("full", "incremental", "full aged") if rep % 2 else ("full aged", "incremental", "full")
    for impl in order:
        cold = _cold()
        t0 = time.perf_counter()
        td = tddist.load(os.path.join(directory, "full-aged" if impl == "full aged" else f"{impl}-{rep}"))
        for t in td.values(True, True):
            t.reshape(-1).view(torch.uint8)[::4096].sum()  # one byte a page: every page read
        seconds = time.perf_counter() - t0
        del td
        gc.collect()  # the maps are released before the next load drops the page cache
        out.append(_record("incremental load", impl, rep, seconds, nbytes, cold))
        print(f"[load rep {rep}] {impl}: {C.fmt_seconds(seconds)}", file=sys.stderr, flush=True)
    return out


def summary(records: list[dict]) -> list[str]:
    """Medians, ratios and the targets' verdicts, in words."""

    def median(scenario: str, impl: str, key: str = "time") -> float:
        got = sorted(
            r["metrics"]["time"] if key == "time" else r["extra"][key]
            for r in records
            if (r["scenario"], r["impl"]) == (scenario, impl)
        )
        return got[len(got) // 2]

    full, inc = median("incremental save", "full"), median("incremental save", "incremental")
    wfull, winc = median("incremental save", "full", "written"), median("incremental save", "incremental", "written")
    lfull, linc = median("incremental load", "full"), median("incremental load", "incremental")
    laged = median("incremental load", "full aged")
    trusted = median("incremental save", "incremental trusted")
    cold = all(r["extra"]["cold"] for r in records if r["scenario"] == "incremental load")
    return [
        f"page cache dropped before every load: {'yes' if cold else 'no (not root)'}",
        f"save: full {C.fmt_seconds(full)}, incremental {C.fmt_seconds(inc)}: {inc / full:.3f}x (target <= 0.15x): "
        f"{'met' if inc <= 0.15 * full else 'MISSED'}",
        f"written: full {wfull / C.MIB:.1f} MiB, incremental {winc / C.MIB:.1f} MiB: {100 * winc / wfull:.1f}% "
        f"(target <= 6%): {'met' if winc <= 0.06 * wfull else 'MISSED'}",
        f"load: full {C.fmt_seconds(lfull)}, incremental {C.fmt_seconds(linc)}: {linc / lfull:.3f}x (target <= 1.1x): "
        f"{'met' if linc <= 1.1 * lfull else 'MISSED'}",
        f"load: full saved right after the base {C.fmt_seconds(laged)} (incremental {linc / laged:.3f}x of it)",
        f"save with trust_versions=True (not judged): {C.fmt_seconds(trusted)}, {trusted / full:.3f}x the full save",
    ]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size-mib", type=int, default=1024)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--dir", help="where to save (default: a temporary directory)")
    ap.add_argument("--json", help="write the records here")
    ap.add_argument("--num-threads", type=int, default=2, help="threads every save writes and hashes with")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        records = save_records(args.size_mib, args.repeats, tmp, args.num_threads)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"records": records}, f)
    for line in summary(records):
        print(line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
