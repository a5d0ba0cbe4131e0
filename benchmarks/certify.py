#!/usr/bin/env python
"""What certifying a checkpoint costs: counting NaN and Inf values while hashing, and no false findings.

    .venv/bin/python benchmarks/certify.py [--size-mib 1024] [--repeats 3] [--clean-saves 1000]
                                           [--dir DIR] [--json OUT]

Three measurements, on one process:

- ``certify save``: a durable save of ``--size-mib`` of float32 (four leaves,
  packed directory) as tddist does it (``tddist``: every floating chunk
  counted in the checksum pass) and with the counting switched off
  (``tddist uncounted``: the writers' counters replaced by None, what tddist
  did before it certified), interleaved A B A B. The target: counting costs
  at most 3% of the save.
- ``certify pass``: the counting alone over the same bytes in memory, next
  to the checksum alone (``xxh3 blocks``), one thread: the cost per GiB.
- ``certify clean``: ``--clean-saves`` small saves of random finite data
  (every floating dtype) read back: the number of leaves reported non-finite
  must be 0.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Iterator

import _common as C
import torch
from tensordict import TensorDict

import tddist
from tddist.checksum import hash_blocks, tensor_bytes
from tddist.core.finite import buffer_stats

LEAVES = 4


@contextlib.contextmanager
def uncounted() -> Iterator[None]:
    """Every writer without its counters: the save as it was before checkpoints were certified."""
    from tddist.saving import stream
    from tddist.storage import writer, zipcodec

    modules = (stream, writer, zipcodec)
    saved = [m.counter_for for m in modules]
    try:
        for m in modules:
            m.counter_for = lambda _name: None
        yield
    finally:
        for m, f in zip(modules, saved):
            m.counter_for = f


def state(size_mib: int) -> TensorDict:
    rows = max(1, size_mib * C.MIB // (LEAVES * 4 * 1024))
    gen = torch.Generator().manual_seed(0)
    return TensorDict({f"w{i}": torch.randn(rows, 1024, generator=gen) for i in range(LEAVES)}, [])


def _record(scenario: str, impl: str, rep: int, seconds: float, nbytes: int, extra: dict | None = None) -> dict:
    return {
        "scenario": scenario,
        "world": 1,
        "launcher": "single",
        "impl": impl,
        "ref": "tddist" if scenario == "certify save" else "xxh3 blocks" if scenario == "certify pass" else impl,
        "repeat": rep,
        "metrics": {"time": seconds},
        "bytes": nbytes,
        "extra": extra or {},
    }


def save_records(td: TensorDict, repeats: int, directory: str) -> list[dict]:
    """The interleaved durable saves, counted and uncounted."""
    nbytes = sum(t.numel() * t.element_size() for t in td.values())
    for impl in ("tddist", "tddist uncounted"):  # warm-up, not measured: imports, first-call costs, allocations
        with uncounted() if impl != "tddist" else contextlib.nullcontext():
            tddist.save(td, os.path.join(directory, "warm-up"))
    shutil.rmtree(os.path.join(directory, "warm-up"))
    out = []
    for rep in range(repeats):
        for impl in ("tddist", "tddist uncounted"):
            target = os.path.join(directory, f"save-{rep}-{impl.replace(' ', '-')}")
            with uncounted() if impl != "tddist" else contextlib.nullcontext():
                t0 = time.perf_counter()
                tddist.save(td, target)
                seconds = time.perf_counter() - t0
            counted = tddist.read_manifest(target).leaves[("w0",)].stats is not None
            assert counted == (impl == "tddist"), impl
            shutil.rmtree(target)
            out.append(_record("certify save", impl, rep, seconds, nbytes))
            print(f"[certify save rep {rep}] {impl}: {C.fmt_seconds(seconds)}", file=sys.stderr, flush=True)
    return out


def pass_records(td: TensorDict, repeats: int) -> list[dict]:
    """The counting alone and the checksum alone over the same bytes, one thread."""
    buffers = [tensor_bytes(t) for t in td.values()]
    nbytes = sum(b.size for b in buffers)
    out = []
    for rep in range(repeats):
        for impl, fn in (("xxh3 blocks", hash_blocks), ("count", lambda b: buffer_stats("float32", b))):
            t0 = time.perf_counter()
            for b in buffers:
                fn(b)
            seconds = time.perf_counter() - t0
            out.append(_record("certify pass", impl, rep, seconds, nbytes))
            print(f"[certify pass rep {rep}] {impl}: {C.fmt_seconds(seconds)}", file=sys.stderr, flush=True)
    return out


def clean_records(saves: int, directory: str) -> list[dict]:
    """``saves`` saves of random finite data, every floating dtype: how many leaves come back non-finite."""
    dtypes = [torch.float64, torch.float32, torch.float16, torch.bfloat16, torch.complex64, torch.float8_e5m2]
    gen = torch.Generator().manual_seed(1)
    false_findings = 0
    t0 = time.perf_counter()
    for i in range(saves):
        scale = 10.0 ** (i % 7 - 3)
        td = TensorDict(
            {str(d).removeprefix("torch."): (torch.randn(257, generator=gen, dtype=torch.float64) * scale).to(d)
             for d in dtypes},
            [],
        )  # fmt: skip
        target = os.path.join(directory, "clean")
        tddist.save(td, target)
        false_findings += len(tddist.read_manifest(target).non_finite())
    seconds = time.perf_counter() - t0
    print(f"[certify clean] {saves} saves: {false_findings} false findings", file=sys.stderr, flush=True)
    return [_record("certify clean", "tddist", 0, seconds, None, {"saves": saves, "false_findings": false_findings})]


def run(size_mib: int, repeats: int, saves: int, directory: str) -> list[dict]:
    os.makedirs(directory, exist_ok=True)
    td = state(size_mib)
    return save_records(td, repeats, directory) + pass_records(td, repeats) + clean_records(saves, directory)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size-mib", type=int, default=1024)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--clean-saves", type=int, default=1000)
    ap.add_argument("--dir", help="where to save (default: a temporary directory)")
    ap.add_argument("--json", help="write the records here")
    args = ap.parse_args(argv)
    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        records = run(args.size_mib, args.repeats, args.clean_saves, tmp)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"records": records}, f)
    for line in summary(records):
        print(line)
    return 0


def summary(records: list[dict]) -> list[str]:
    """The medians and the targets' verdicts, in words."""

    def median(scenario: str, impl: str) -> float | None:
        got = [r["metrics"]["time"] for r in records if (r["scenario"], r["impl"]) == (scenario, impl)]
        return C.summarize(got)["median"] if got else None

    lines = []
    counted, plain = median("certify save", "tddist"), median("certify save", "tddist uncounted")
    if counted and plain:
        lines.append(f"save: counted {C.fmt_seconds(counted)}, uncounted {C.fmt_seconds(plain)}: "
                     f"{100 * (counted / plain - 1):+.1f}% (target <= +3%)")  # fmt: skip
    count, digest = median("certify pass", "count"), median("certify pass", "xxh3 blocks")
    if count and digest:
        lines.append(f"one thread: counting {C.fmt_seconds(count)}, checksum {C.fmt_seconds(digest)}")
    clean = [r for r in records if r["scenario"] == "certify clean"]
    for r in clean:
        lines.append(f"{r['extra']['saves']} clean saves: {r['extra']['false_findings']} false findings (target 0)")
    return lines


if __name__ == "__main__":
    sys.exit(main())
