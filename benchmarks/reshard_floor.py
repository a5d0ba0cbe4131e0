"""What the disk alone makes of a 1 -> 4 reshard's reads, against a same-layout load's, on this machine.

    .venv/bin/python benchmarks/reshard_floor.py                 # 4 leaves of 256 MiB, 4 processes, 6 repeats
    .venv/bin/python benchmarks/reshard_floor.py --leaf-mib 8 --repeats 1

``run.py``'s reshard scenario loads a checkpoint saved by one rank with 4
ranks (``shard="even"``): every rank maps the one data file and reads its
quarter of the rows of each leaf, views of the map where a same-layout load
maps a file of its own and reads all of it. This model does exactly those
reads without tddist (no manifest, no plan, no tensors): N processes map
either one file of ``leaves`` leaves or a file each, and touch every page of
their byte ranges, from a dropped page cache, the two layouts alternating.
The ratio is the floor under the benchmark's ``reshard 1->4`` against
``same layout``: what the page cache's read-around does with N readers in one
file, 64 MiB apart, against N readers in N files. Reads by ``pread`` are
measured beside (a copy of every byte, but the kernel's own readahead).
Needs root to drop the page cache; without it the reads are warm and the
numbers say nothing of the disk.
"""

from __future__ import annotations

import argparse
import mmap
import multiprocessing as mp
import os
import statistics
import tempfile
import time

import _common as C

MIB = 1 << 20
PAGE = 4096


def _make(path: str, nbytes: int) -> None:
    """A file of ``nbytes`` random bytes (written once, kept across modes)."""
    block = os.urandom(MIB)
    with open(path, "wb") as f:
        for _ in range(nbytes // MIB):
            f.write(block)
        f.flush()
        os.fsync(f.fileno())


def _reader(rank: int, spans: list[tuple[int, int]], path: str, how: str, start, out) -> None:
    fd = os.open(path, os.O_RDONLY)
    size = os.fstat(fd).st_size
    m = mmap.mmap(fd, size, mmap.MAP_PRIVATE, mmap.PROT_READ | mmap.PROT_WRITE)
    start.wait()
    t0 = time.perf_counter()
    if how == "pread":
        buf = bytearray(8 * MIB)
        for lo, hi in spans:
            for at in range(lo, hi, len(buf)):
                os.preadv(fd, [memoryview(buf)[: min(len(buf), hi - at)]], at)
    else:
        view = memoryview(m)
        total = 0
        for lo, hi in spans:
            for at in range(lo, hi, PAGE):  # one byte a page: every page faulted in, as touching a tensor does
                total += view[at]
        view.release()
    start.wait()
    out.put(time.perf_counter() - t0)
    m.close()
    os.close(fd)


def run_once(root: str, layout: str, how: str, world: int, leaves: int, leaf: int) -> float:
    """The slowest reader's time for one layout ("1->N": one file, "N->N": a file each), cold."""
    quarter = leaf // world
    jobs = []
    for r in range(world):
        if layout == "1->N":
            jobs.append(
                (
                    os.path.join(root, "one"),
                    [(j * leaf + r * quarter, j * leaf + (r + 1) * quarter) for j in range(leaves)],
                )
            )
        else:
            jobs.append((os.path.join(root, f"rank{r}"), [(0, leaves * quarter)]))
    os.sync()
    dropped, why = C.drop_page_cache()
    if not dropped:
        print(f"(could not drop the page cache: {why}; these reads are warm)")
    ctx = mp.get_context("fork")
    start, out = ctx.Barrier(world), ctx.Queue()
    procs = [
        ctx.Process(target=_reader, args=(r, spans, path, how, start, out)) for r, (path, spans) in enumerate(jobs)
    ]
    for p in procs:
        p.start()
    times = [out.get() for _ in procs]
    for p in procs:
        p.join()
        if p.exitcode != 0:
            raise SystemExit(f"a reader exited with {p.exitcode}")
    return max(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--leaf-mib", type=int, default=256, help="bytes of each leaf (default 256, run.py's payload)")
    ap.add_argument("--leaves", type=int, default=4, help="leaves (default 4, run.py's payload)")
    ap.add_argument("--world", type=int, default=4, help="reading processes (default 4)")
    ap.add_argument("--repeats", type=int, default=6)
    ap.add_argument("--dir", default=None, help="where the files are written (default: the temp dir)")
    args = ap.parse_args()
    leaf = args.leaf_mib * MIB
    with tempfile.TemporaryDirectory(prefix="tddist-reshard-floor-", dir=args.dir) as root:
        _make(os.path.join(root, "one"), args.leaves * leaf)
        for r in range(args.world):
            _make(os.path.join(root, f"rank{r}"), args.leaves * leaf // args.world)
        got: dict[tuple[str, str], list[float]] = {}
        for how in ("mmap", "pread"):
            for i in range(args.repeats):
                for layout in ("1->N", "N->N") if i % 2 == 0 else ("N->N", "1->N"):
                    got.setdefault((how, layout), []).append(run_once(root, layout, how, args.world, args.leaves, leaf))
    n = args.world
    print(f"## raw reads of {args.leaves} x {args.leaf_mib} MiB by {n} processes, cold, median of {args.repeats}")
    for how in ("mmap", "pread"):
        one, each = (statistics.median(got[(how, lay)]) for lay in ("1->N", "N->N"))
        print(
            f"{how:<6} 1->{n} (one file, a quarter of each leaf) {one * 1e3:7.1f} ms   {n}->{n} (a file each) "
            f"{each * 1e3:7.1f} ms   ratio {one / each:.2f}"
        )


if __name__ == "__main__":
    main()
