"""What hiding an asynchronous save's snapshot copy behind its write costs the caller, on this machine.

    .venv/bin/python benchmarks/copy_overlap.py                 # 64 MiB per process, 1, 2 and 4 processes, 9 repeats
    .venv/bin/python benchmarks/copy_overlap.py --quick         # 8 MiB, 1 process, 1 repeat

A ``return_early`` save to a new path finishes about ``1 + copy / write``
times later than a synchronous save (``async_stall.py``), because it copies
the state before it writes it and a synchronous save writes from the
caller's leaves. The copy could only be hidden by writing while it runs.
This model measures every way of doing that with tddist's own pieces (the
address copy ``stream.copy_bytes``, the block write ``_fs.write_and_start_writeback``,
the block hashes ``checksum.hash_blocks``), without collectives or manifest, one data file
per process, N processes at once (each its own state and file, like ranks):

- ``synchronous``: hash and write the leaves straight into the file, fsync
  (what a synchronous save's writer does): the completion baseline.
- ``copy, then write``: what ``return_early`` does: the caller copies leaves
  into an arena from the first one on and a helper thread from the last one
  back; once both are done the caller is released and the writer hashes and
  writes the arena, fsync.
- ``write during copy``: the same copy, and a writer thread (at the
  background niceness) hashes and writes each leaf's copy as soon as it is
  in the arena.
- ``O_DIRECT during copy``: the same, writing through ``O_DIRECT`` (no
  page-cache copy, so little CPU beside the copy).
- ``helper writes leaves``: the caller copies from the first leaf on; the
  helper, instead of copying from the last one back, hashes each of its
  leaves and writes it straight from the caller's memory into the file; the
  writer then writes the caller's part.

``blocking`` is the time until the caller could return (every byte safe from
in-place updates), ``complete`` until the file is durable; per repeat the
slowest process, then the median over repeats; the modes run in a rotated
order at each repeat. Ratios: blocking against ``copy, then write`` (which
``async_stall.py`` relates to the floor and to DCP), completion against
``synchronous``.
"""

from __future__ import annotations

import argparse
import json
import mmap
import multiprocessing as mp
import os
import queue
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
from benchmarks._common import MIB, fmt_seconds, fsync_path  # noqa: E402
from tddist._fs import WRITE_STEP, write_and_start_writeback  # noqa: E402
from tddist.checksum import hash_blocks  # noqa: E402
from tddist.saving.arena import copy_bytes  # noqa: E402
from tddist.saving.background import yield_cpu_to_training  # noqa: E402

N_LEAVES = 32
MODES = ("synchronous", "copy, then write", "write during copy", "O_DIRECT during copy", "helper writes leaves")
Timing = tuple[float, float]  # (blocking, complete) in seconds


class State:
    """One process's leaves, its reusable arena, and the file it writes."""

    def __init__(self, nbytes: int, path: str, seed: int) -> None:
        rng = np.random.default_rng(seed)
        self.leaf_bytes = nbytes // N_LEAVES
        self.leaves = [rng.integers(0, 256, self.leaf_bytes, dtype=np.uint8) for _ in range(N_LEAVES)]
        self.arena_map = mmap.mmap(-1, nbytes)  # page-aligned, as tddist's Arena
        self.arena = np.frombuffer(self.arena_map, dtype=np.uint8)
        self.arena[:] = 1  # faulted in once, as a reused arena is
        self.path = path

    def offset(self, i: int) -> int:
        return i * self.leaf_bytes

    def arena_view(self, i: int) -> memoryview:
        return memoryview(self.arena_map)[self.offset(i) : self.offset(i) + self.leaf_bytes]

    def copy_leaf(self, i: int) -> None:
        copy_bytes(self.arena.ctypes.data + self.offset(i), self.leaves[i].ctypes.data, self.leaf_bytes)

    def check_file(self, mode: str) -> None:
        """Fail unless the file holds every leaf at its offset (a mode that wrote wrong bytes measures nothing)."""
        with open(self.path, "rb") as f:
            for i, leaf in enumerate(self.leaves):
                if f.read(self.leaf_bytes) != leaf.tobytes():
                    raise SystemExit(f"{mode}: leaf {i} of {self.path} does not hold its bytes")

    def create(self, direct: bool = False) -> tuple[int, int | None]:
        """The data file, allocated (and a second, ``O_DIRECT`` descriptor of it, if asked)."""
        fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        os.posix_fallocate(fd, 0, self.leaf_bytes * N_LEAVES)
        return fd, os.open(self.path, os.O_WRONLY | os.O_DIRECT) if direct else None


def put(fd: int, view: memoryview, at: int) -> None:
    """Hash, then write one leaf's bytes and start their write-back (as the writers do)."""
    hash_blocks(view)
    write_and_start_writeback(fd, view, at, WRITE_STEP)


def share_copy(s: State, helper_leaf: Callable[[int], None], done: Callable[[int], None] | None = None) -> None:
    """The caller takes leaves from the front (copying each), a helper thread from the back (``helper_leaf``);
    returns once every leaf is taken and handled. ``done(i)`` follows each copy into the arena."""
    lock = threading.Lock()
    bounds = [0, N_LEAVES]

    def take(front: bool) -> int | None:
        with lock:
            if bounds[0] >= bounds[1]:
                return None
            if front:
                bounds[0] += 1
                return bounds[0] - 1
            bounds[1] -= 1
            return bounds[1]

    def helper() -> None:
        while (i := take(False)) is not None:
            helper_leaf(i)

    t = threading.Thread(target=helper)
    t.start()
    while (i := take(True)) is not None:
        s.copy_leaf(i)
        if done is not None:
            done(i)
    t.join()


def finish(fd: int, *others: int | None) -> None:
    os.fsync(fd)
    for d in (fd, *others):
        if d is not None:
            os.close(d)


def synchronous(s: State) -> Timing:
    t0 = time.perf_counter()
    fd, _ = s.create()
    for i, leaf in enumerate(s.leaves):
        put(fd, leaf.data, s.offset(i))
    finish(fd)
    t = time.perf_counter() - t0
    return t, t


def copy_then_write(s: State) -> Timing:
    t0 = time.perf_counter()
    share_copy(s, s.copy_leaf)
    blocking = time.perf_counter() - t0
    fd, _ = s.create()
    for i in range(N_LEAVES):
        put(fd, s.arena_view(i), s.offset(i))
    finish(fd)
    return blocking, time.perf_counter() - t0


def write_during_copy(s: State, direct: bool) -> Timing:
    t0 = time.perf_counter()
    fd, dfd = s.create(direct)
    copied: queue.SimpleQueue[int | None] = queue.SimpleQueue()

    def writer() -> None:
        yield_cpu_to_training()
        while (i := copied.get()) is not None:
            view = s.arena_view(i)
            if dfd is None:
                put(fd, view, s.offset(i))
            else:
                hash_blocks(view)
                os.pwrite(dfd, view, s.offset(i))

    w = threading.Thread(target=writer)
    w.start()

    def helper_leaf(i: int) -> None:
        s.copy_leaf(i)
        copied.put(i)

    share_copy(s, helper_leaf, copied.put)
    blocking = time.perf_counter() - t0
    copied.put(None)
    w.join()
    finish(fd, dfd)
    return blocking, time.perf_counter() - t0


def helper_writes_leaves(s: State) -> Timing:
    t0 = time.perf_counter()
    fd, _ = s.create()
    written: list[int] = []

    def helper_leaf(i: int) -> None:
        put(fd, s.leaves[i].data, s.offset(i))
        written.append(i)

    share_copy(s, helper_leaf)
    blocking = time.perf_counter() - t0
    for i in sorted(set(range(N_LEAVES)) - set(written)):
        put(fd, s.arena_view(i), s.offset(i))
    finish(fd)
    return blocking, time.perf_counter() - t0


def run_mode(s: State, mode: str) -> Timing:
    if mode == "synchronous":
        return synchronous(s)
    if mode == "copy, then write":
        return copy_then_write(s)
    if mode == "write during copy":
        return write_during_copy(s, direct=False)
    if mode == "O_DIRECT during copy":
        return write_during_copy(s, direct=True)
    return helper_writes_leaves(s)


def direct_supported(directory: str) -> bool:
    path = os.path.join(directory, "direct-probe")
    try:
        os.close(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_DIRECT, 0o644))
        return True
    except OSError:
        return False
    finally:
        if os.path.exists(path):
            os.unlink(path)


def worker(
    rank: int, nbytes: int, directory: str, modes: list[str], repeats: int, verify: bool, barrier: Any, results: Any
) -> None:
    """One process: its state, every mode ``repeats`` times in a rotated order, each start behind ``barrier``."""
    try:
        s = State(nbytes, os.path.join(directory, f"data-{rank}"), seed=rank)
        out: dict[str, list[Timing]] = {m: [] for m in modes}
        for rep in range(repeats):
            for j in range(len(modes)):
                mode = modes[(rep + j) % len(modes)]
                barrier.wait()
                out[mode].append(run_mode(s, mode))
                if verify:
                    s.check_file(mode)
                os.unlink(s.path)
                fsync_path(directory)
    except BaseException as e:
        barrier.abort()  # the other processes stop waiting for this one
        results.put((rank, f"process {rank}: {type(e).__name__}: {e}"))
        raise SystemExit(1) from e
    results.put((rank, out))


def measure(world: int, nbytes: int, directory: str, modes: list[str], repeats: int, verify: bool) -> dict[str, Timing]:
    """Per mode: the median over repeats of the slowest process's (blocking, complete)."""
    ctx = mp.get_context("spawn")
    barrier, results = ctx.Barrier(world), ctx.Queue()
    procs = [
        ctx.Process(target=worker, args=(r, nbytes, directory, modes, repeats, verify, barrier, results))
        for r in range(world)
    ]
    for p in procs:
        p.start()
    got = dict(results.get(timeout=1800) for _ in procs)
    for p in procs:
        p.join(60)
    failed = sorted(str(v) for v in got.values() if isinstance(v, str))
    if failed or any(p.exitcode != 0 for p in procs):
        raise SystemExit("; ".join(failed) or f"exit codes {[p.exitcode for p in procs]}")
    medians: dict[str, Timing] = {}
    for m in modes:
        per_repeat = [(max(got[r][m][k][0] for r in got), max(got[r][m][k][1] for r in got)) for k in range(repeats)]
        medians[m] = (statistics.median(b for b, _c in per_repeat), statistics.median(c for _b, c in per_repeat))
    return medians


def report(world: int, mib: int, medians: dict[str, Timing]) -> list[dict]:
    base_blocking = medians["copy, then write"][0]
    base_complete = medians["synchronous"][1]
    print(f"\n### {world} process(es), {mib} MiB each\n")
    print("| mode | blocking | complete | blocking / copy, then write | complete / synchronous |")
    print("|---|---|---|---|---|")
    rows = []
    for m, (b, c) in medians.items():
        blocking = "-" if m == "synchronous" else fmt_seconds(b)
        ratio = "-" if m == "synchronous" else f"{b / base_blocking:.2f}"
        print(f"| {m} | {blocking} | {fmt_seconds(c)} | {ratio} | {c / base_complete:.2f} |")
        rows.append({"world": world, "mode": m, "blocking_s": b, "complete_s": c})
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--mib", type=int, default=64, help="state per process (MiB)")
    ap.add_argument("--worlds", default="1,2,4", help="process counts, comma-separated")
    ap.add_argument("--repeats", type=int, default=9)
    ap.add_argument("--dir", default=None, help="where the data files go (default: a temporary directory)")
    ap.add_argument("--out", default=None, help="write the medians as JSON here")
    ap.add_argument("--verify", action="store_true", help="read every file back and compare it with the leaves")
    ap.add_argument("--quick", action="store_true", help="8 MiB, 1 process, 1 repeat, --verify")
    args = ap.parse_args()
    if args.quick:
        args.mib, args.worlds, args.repeats, args.verify = 8, "1", 1, True
    nbytes = args.mib * MIB
    if nbytes % (N_LEAVES * 4096):
        raise SystemExit(f"--mib must split into {N_LEAVES} leaves of whole 4 KiB pages")
    with tempfile.TemporaryDirectory(dir=args.dir, prefix="copy-overlap-") as directory:
        modes = list(MODES)
        if not direct_supported(directory):
            print(f"O_DIRECT is not supported under {directory}: that mode is left out")
            modes.remove("O_DIRECT during copy")
        rows = []
        for world in [int(w) for w in args.worlds.split(",")]:
            rows += report(world, args.mib, measure(world, nbytes, directory, modes, args.repeats, args.verify))
    if args.out:
        Path(args.out).write_text(json.dumps({"mib": args.mib, "repeats": args.repeats, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
