#!/usr/bin/env python
"""Time per leaf at many leaves: load, load(verify=True), ``tddist info``, ``tddist verify``, and an archive
of many entries, each at a small and a large count side by side.

    .venv/bin/python benchmarks/many_leaves.py                        # 1,000 and 100,000 leaves, 3 repeats
    .venv/bin/python benchmarks/many_leaves.py --leaves 100,1000 --entries 100,1000 --repeats 1   # quick

Checkpoints, written once (untimed) into a temporary directory (``--dir``), one rank:

- ``empty``: a TensorDict of batch size [0] with N leaves of shape [0, 4] (sharded, no bytes): nothing but
  the per-leaf work of reading the manifest, planning, building the TensorDict;
- ``small``: a dict of N replicated leaves of 16 float32 each (64 bytes, one packed data file): each leaf's
  chunk is also located, mapped and (with verify=True) hashed;
- ``ranks4``: ``empty``, saved by 4 ranks (threads), loaded with ``shard="saved"`` by 4 thread ranks of one
  process (each rank reads and validates the manifest: the time per leaf is that of all four);
- ``archive``: a one-leaf ``.tdz`` with N foreign entries added (``junk/<i>``, 4 bytes each) before its own:
  a load reads and validates the central directory of every entry.

Each operation runs in this process (imports and the first load warmed up beforehand), after a
``gc.collect()``; the time is the best wall time of ``--repeats`` runs (the least disturbed by other work on
the machine), divided by the number of leaves (entries, for the archive). The ratio is the large count's time
per leaf over the small count's: 1 means linear. Target: at most 3 at 100,000 leaves against 1,000 (200,000
entries against 1,000 for the archive). ``--json PATH`` also writes the numbers.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import io
import json
import os
import sys
import tempfile
import time
import zipfile
from collections.abc import Callable
from dataclasses import asdict, dataclass

import torch

# tddist as run.py passes it (PYTHONPATH), else the repository's copy.
sys.path.append(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from tensordict import TensorDict

import tddist
from tddist.cli import main as cli

TARGET_RATIO = 3.0


@dataclass(frozen=True)
class Row:
    """One operation at both counts: seconds per leaf (entry) at each, and their ratio."""

    operation: str
    small: int
    large: int
    per_leaf_small_s: float
    per_leaf_large_s: float

    @property
    def ratio(self) -> float:
        return self.per_leaf_large_s / self.per_leaf_small_s


def save_empty(path: str, n: int) -> str:
    tddist.save(TensorDict({f"k{i:06d}": torch.empty(0, 4) for i in range(n)}, batch_size=[0]), path)
    return path


def save_small(path: str, n: int) -> str:
    tddist.save({f"k{i:06d}": torch.full((16,), float(i)) for i in range(n)}, path)
    return path


def save_ranks4(path: str, n: int) -> str:
    tddist.run_threads(4, lambda comm: save_empty_on(comm, path, n))
    return path


def save_empty_on(comm: tddist.Communicator, path: str, n: int) -> None:
    tddist.save(TensorDict({f"k{i:06d}": torch.empty(0, 4) for i in range(n)}, batch_size=[0]), path, comm=comm)


def load_on_4_ranks(path: str) -> None:
    tddist.run_threads(4, lambda comm: tddist.load(path, shard="saved", comm=comm))


def save_archive(path: str, n: int) -> str:
    """A one-leaf archive with ``n`` foreign entries before its own (readers find entries by the directory)."""
    own = path + ".own.tdz"
    tddist.save({"w": torch.arange(16.0)}, own)
    with zipfile.ZipFile(own) as zin, zipfile.ZipFile(path, "w") as zout:
        for i in range(n):
            zout.writestr(f"junk/{i}", b"junk")
        for zi in zin.infolist():
            zout.writestr(zi.filename, zin.read(zi))
    os.unlink(own)
    return path


def quiet_cli(*argv: str) -> None:
    """Run a ``tddist`` command in this process, its output discarded; it must succeed."""
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        code = cli(list(argv))
    if code != 0:
        raise SystemExit(f"tddist {' '.join(argv)} exited with {code}")


def best_seconds(fn: Callable[[], object], repeats: int) -> float:
    """The best wall time of ``repeats`` runs of ``fn``, each after a full collection."""
    times = []
    for _ in range(repeats):
        gc.collect()
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


OPERATIONS: dict[str, tuple[str, Callable[[str], object]]] = {
    "load (empty leaves)": ("empty", lambda p: tddist.load(p, shard=None)),
    "load, verify=True (empty leaves)": ("empty", lambda p: tddist.load(p, shard=None, verify=True)),
    "tddist info (empty leaves)": ("empty", lambda p: quiet_cli("info", p)),
    "tddist verify (empty leaves)": ("empty", lambda p: quiet_cli("verify", p)),
    "load (64-byte leaves)": ("small", lambda p: tddist.load(p, shard=None)),
    "load, verify=True (64-byte leaves)": ("small", lambda p: tddist.load(p, shard=None, verify=True)),
    "tddist info (64-byte leaves)": ("small", lambda p: quiet_cli("info", p)),
    "tddist verify (64-byte leaves)": ("small", lambda p: quiet_cli("verify", p)),
    "load shard='saved', 4 thread ranks (empty leaves)": ("ranks4", load_on_4_ranks),
    "load an archive (per entry)": ("archive", lambda p: tddist.load(p, shard=None)),
}
SAVERS = {"empty": save_empty, "small": save_small, "ranks4": save_ranks4, "archive": save_archive}


def measure(root: str, leaves: tuple[int, int], entries: tuple[int, int], repeats: int) -> list[Row]:
    """Write the checkpoints (untimed), warm up, then time every operation at both counts."""
    paths: dict[tuple[str, int], str] = {}
    for kind, save in SAVERS.items():
        for n in entries if kind == "archive" else leaves:
            name = os.path.join(root, f"{kind}-{n}" + (".tdz" if kind == "archive" else ""))
            t = time.perf_counter()
            paths[kind, n] = save(name, n)
            print(f"  wrote {kind} checkpoint of {n:,} ({time.perf_counter() - t:.1f} s)", flush=True)
    for _name, (kind, op) in OPERATIONS.items():  # warm-up: imports, first maps
        op(paths[kind, (entries if kind == "archive" else leaves)[0]])
    rows = []
    for name, (kind, op) in OPERATIONS.items():
        small, large = entries if kind == "archive" else leaves
        per = [best_seconds(lambda n=n: op(paths[kind, n]), repeats) / n for n in (small, large)]
        rows.append(Row(name, small, large, per[0], per[1]))
        print(f"  {name}: {per[0] * 1e6:.1f} / {per[1] * 1e6:.1f} us per leaf", flush=True)
    return rows


def table(rows: list[Row]) -> str:
    """The rows as a markdown table, with the target's verdict."""
    out = [
        "| operation | small | us per leaf | large | us per leaf | ratio | <= 3 |",
        "|---|---:|---:|---:|---:|---:|---|",
    ]
    for r in rows:
        verdict = "met" if r.ratio <= TARGET_RATIO else "MISSED"
        out.append(
            f"| {r.operation} | {r.small:,} | {r.per_leaf_small_s * 1e6:.1f} | {r.large:,} | "
            f"{r.per_leaf_large_s * 1e6:.1f} | {r.ratio:.2f} | {verdict} |"
        )
    return "\n".join(out)


def counts(text: str) -> tuple[int, int]:
    small, large = (int(x) for x in text.split(","))
    return small, large


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--leaves", type=counts, default=(1000, 100_000), help="the small and the large leaf count")
    ap.add_argument("--entries", type=counts, default=(1000, 200_000), help="the archive's entry counts")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--dir", default=None, help="where the checkpoints are written (default: a temporary one)")
    ap.add_argument("--json", default=None, help="also write the rows to this file")
    args = ap.parse_args()
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory(dir=args.dir) as root:
        rows = measure(root, args.leaves, args.entries, args.repeats)
    print()
    print(table(rows))
    if args.json:
        with open(args.json, "w") as f:
            json.dump([{**asdict(r), "ratio": r.ratio} for r in rows], f, indent=2)


if __name__ == "__main__":
    main()
