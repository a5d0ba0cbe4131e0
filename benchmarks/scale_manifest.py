#!/usr/bin/env python
"""Rank 0's manifest work and one rank's open at thousands of ranks, in one process (no job of that size).

    .venv/bin/python benchmarks/scale_manifest.py [--ranks 1024,4096,16384] [--leaves 1000] [--repeats 3]

Builds the votes (``tddist.core.types.Fragment``) that ``ranks`` ranks would send
for a state of ``leaves`` sharded leaves, exactly as the layouts build them:
rank 0's ``Structure`` comes from ``structure_of`` of a real prepared shard,
every rank's rows and checksums are compact arrays, and each fragment goes
through a pickle round trip, as the gather delivers it. Then:

- write (full path): ``merge_fragments`` without a plan cache, ``encode``
  (tddist.json and tddist.idx), writing both files durably;
- write (cached path): the same with the plan cache of a previous committed
  save of the same structure;
- open for ``shard="saved"``: ``tddist.load(shard="saved")`` itself, on one
  rank (the middle one) of the ``ranks``-rank job, through a communicator
  that stands for that rank (its collectives return at once); only that
  rank's data file exists (sparse, written untimed), so this is exactly the
  work one rank does: read and validate both files, plan every leaf, map its
  own chunks;
- open for ``shard=None``: what ``load(shard=None)`` does in one process
  before it reads data (no data files here: the whole checkpoint would not fit
  in memory): ``read_manifest``, each leaf's box (``loading.share.leaf_box``),
  then the reader's own planning of the whole boxes (``loading.read.plan_wholes``:
  every rank's file offsets and every piece, in numpy columns), asserting one
  piece per rank and leaf. Nothing is mapped.

Reports each stage's time, the peak RSS each adds (the freed heap is given
back to the system before each stage, ``malloc_trim``, so a stage cannot hide
its allocations in memory an earlier stage freed), and the bytes gathered
(pickled fragments). Targets at 4,096 ranks x 1,000 leaves: write < 2 s
(cached < 0.5 s), open for ``shard="saved"`` < 0.5 s and < 256 MiB, open whole
< 2 s and < 1 GiB; at 16,384 ranks write < 8 s and open whole < 8 s; the
full-path gather under 64 MiB. The targets are printed, judged, after the
table. Also run by ``run.py`` as its ``manifest`` scenario.
"""

from __future__ import annotations

import argparse
import ctypes
import ctypes.util
import gc
import json
import os
import pickle
import sys
import tempfile
import time

import numpy as np
import torch

# tddist as run.py passes it (PYTHONPATH: the snapshot of this run), else the repository's copy.
sys.path.append(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import _common as C
from tensordict import TensorDict

import tddist
from tddist import format as fmt
from tddist._fs import write_durable
from tddist.core.structure import structure_of
from tddist.core.types import AllRows, Fragment, LocalShard, Structure
from tddist.loading.read import ChunkSource, plan_wholes
from tddist.loading.share import leaf_box
from tddist.manifest.locate import Locator
from tddist.manifest.merge import MergeCache, merge_fragments
from tddist.manifest.v2 import encode
from tddist.saving.prepare import prepare_shard
from tddist.storage.backends import read_manifest

ROWS, COLS = 8, 64  # each rank's shard of each leaf: 8 rows of 64 float32


def build_fragments(ranks: int, leaves: int) -> tuple[Structure, list[Fragment], int]:
    """Rank 0's structure, the fragments as rank 0 receives them, and their total pickled size."""
    td = TensorDict(
        {"params": TensorDict({f"layer{i:04d}.weight": torch.zeros(ROWS, COLS) for i in range(leaves)}, [ROWS])}, [ROWS]
    )
    shard = prepare_shard(td, 0, ranks, None, placements=None, robust_key=True, allow_pickle=False, copy_existing=False)
    assert isinstance(shard, LocalShard)
    structure = structure_of(shard)
    rng = np.random.default_rng(0)
    node_rows = np.array([ROWS, ROWS], dtype="<i8").tobytes()
    lengths = np.full(leaves, ROWS, dtype="<i8").tobytes()
    frags, pickled = [], 0
    for r in range(ranks):
        sums = rng.integers(1, 2**63, size=leaves, dtype=np.int64).astype("<u8").tobytes()
        # A clean state's counts: no chunk with NaN or Inf, the rank's largest finite magnitude and its leaf.
        largest, at = float(rng.random()), int(rng.integers(leaves))
        frag = Fragment(r, structure.digest, node_rows, lengths, sums, b"", largest=largest, largest_leaf=at)
        blob = pickle.dumps(frag, protocol=pickle.HIGHEST_PROTOCOL)
        pickled += len(blob)
        frags.append(pickle.loads(blob))
    return structure, frags, pickled


def _merge(structure: Structure, frags: list[Fragment], cache: MergeCache | None):
    return merge_fragments(
        frags, structure, metadata={}, robust_key=True, version=tddist.__version__, container="directory",
        packing="packed", cache=cache,
    )  # fmt: skip


class OneRank:
    """Rank ``rank`` of a ``size``-rank job whose other ranks agree at once: every collective returns this
    rank's own contribution (a load's only collective is the final agreement on success)."""

    def __init__(self, rank: int, size: int):
        self.rank, self.size = rank, size

    def barrier(self) -> None:
        pass

    def broadcast(self, obj, root: int = 0):
        return obj

    def gather(self, obj, root: int = 0):
        return [obj] * self.size if self.rank == root else None

    def allgather(self, obj):
        return [obj] * self.size

    def dup(self) -> OneRank:
        return self


_LIBC = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")


def _trim() -> None:
    """Return the heap an earlier stage freed to the system, so the next stage's RSS+ counts its allocations."""
    gc.collect()
    try:
        _LIBC.malloc_trim(0)
    except AttributeError:  # not glibc
        pass


def _stage(fn) -> dict:
    _trim()
    base = C.rss_kib()
    C.reset_hwm()
    t0 = time.perf_counter()
    out = fn()
    elapsed = time.perf_counter() - t0
    return {
        "time": elapsed,
        "rss_added_mib": (C.hwm_kib() - base) / 1024,
        "rss_peak_mib": C.hwm_kib() / 1024,
        "out": out,
    }


def one_run(structure: Structure, frags: list[Fragment], directory: str) -> dict[str, dict]:
    """Every stage once: write (full), write (cached), open saved, open whole."""

    def write(cache):
        m = _merge(structure, frags, cache)
        files = encode(m)
        write_durable(os.path.join(directory, fmt.INDEX_NAME), files.index)
        write_durable(os.path.join(directory, fmt.MANIFEST_NAME), files.manifest)
        C.fsync_path(directory)
        return len(files.manifest) + len(files.index)

    full = _stage(lambda: write(None))
    cache = MergeCache()
    _merge(structure, frags, cache)
    cache.committed(structure.digest, b"")
    cached = _stage(lambda: write(cache))
    assert cache.cached_merges == 1

    world, rank = len(frags), len(frags) // 2
    # The one data file the loading rank reads: sparse, of the size the manifest gives it (untimed).
    _, size = Locator(read_manifest(directory)).packed(rank)
    with open(os.path.join(directory, fmt.rank_data_name(rank)), "wb") as f:
        f.truncate(size)

    def open_saved():
        td = tddist.load(directory, comm=OneRank(rank, world), shard="saved")
        return sum(t.nbytes for t in td.values(include_nested=True, leaves_only=True))

    def open_whole():
        m = read_manifest(directory)
        source = ChunkSource(directory, m)  # opens the directory (pinned), maps nothing
        requests = [(leaf, leaf_box(leaf, AllRows(), 0, 1)) for leaf in m.leaves.values()]
        wholes = plan_wholes(source, requests)  # as load(shard=None) plans, before it maps any data file
        assert len(wholes.indices) == len(requests) and wholes.plan is not None
        return len(wholes.plan)

    stages = {"manifest write": full, "manifest write cached": cached}
    stages["manifest open saved"] = _stage(open_saved)
    assert stages["manifest open saved"]["out"] == ROWS * COLS * 4 * len(structure.leaves)
    stages["manifest open whole"] = _stage(open_whole)
    assert stages["manifest open whole"]["out"] == world * len(structure.leaves)  # one piece per rank and leaf
    return stages


def run(ranks_list: list[int], leaves: int, repeats: int, directory: str) -> list[dict]:
    os.makedirs(directory, exist_ok=True)
    records = []
    for ranks in ranks_list:
        t0 = time.perf_counter()
        base = C.rss_kib()
        structure, frags, pickled = build_fragments(ranks, leaves)
        held = (C.rss_kib() - base) / 1024
        print(
            f"[manifest {ranks} ranks x {leaves} leaves] fragments built in {time.perf_counter() - t0:.1f} s "
            f"({pickled / C.MIB:.1f} MiB pickled, {held:.0f} MiB resident)",
            file=sys.stderr,
            flush=True,
        )
        for rep in range(repeats):
            stages = one_run(structure, frags, directory)
            size = stages["manifest write"]["out"]
            for scenario, stage in stages.items():
                records.append(
                    {
                        "scenario": scenario,
                        "world": ranks,
                        "launcher": "model",
                        "impl": "tddist",
                        "ref": "tddist",
                        "repeat": rep,
                        "metrics": {"time": stage["time"]},
                        "bytes": None,
                        "rss_added_mib": stage["rss_added_mib"],
                        "rss_peak_mib_ranks": [round(stage["rss_peak_mib"], 1)],
                        "extra": {
                            "leaves_per_rank": leaves,
                            "manifest_and_index_mib": size / C.MIB,
                            "gathered_mib": pickled / C.MIB,
                            "fragments_resident_mib": held,
                        },
                    }
                )
                print(
                    f"[manifest {ranks} ranks rep {rep}] {scenario}: {C.fmt_seconds(stage['time'])}; peak RSS added "
                    f"{stage['rss_added_mib']:.0f} MiB; manifest+index {size / C.MIB:.1f} MiB; gathered "
                    f"{pickled / C.MIB:.1f} MiB",
                    file=sys.stderr,
                    flush=True,
                )
        del frags
        gc.collect()
    return records


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ranks", default="1024,4096,16384", help="rank counts (comma-separated)")
    ap.add_argument("--leaves", type=int, default=1000, help="leaves per rank")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--dir", help="where the manifest file is written (default: a temporary directory)")
    ap.add_argument("--json", help="write the records here")
    args = ap.parse_args(argv)
    ranks = [int(x) for x in args.ranks.split(",") if x.strip()]
    if args.dir:
        records = run(ranks, args.leaves, args.repeats, args.dir)
    else:
        with tempfile.TemporaryDirectory(prefix="tddist-manifest-") as tmp:
            records = run(ranks, args.leaves, args.repeats, tmp)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"records": records}, f)
    print("| ranks | stage | median | min-max | peak RSS added |")
    print("|---|---|---|---|---|")
    for world in ranks:
        for scenario in ("manifest write", "manifest write cached", "manifest open saved", "manifest open whole"):
            recs = [r for r in records if r["world"] == world and r["scenario"] == scenario]
            s = C.summarize([r["metrics"]["time"] for r in recs])
            rss = C.summarize([r["rss_added_mib"] for r in recs])["median"]
            print(
                f"| {world} | {scenario} | {C.fmt_seconds(s['median'])} | {C.fmt_seconds(s['min'])} - "
                f"{C.fmt_seconds(s['max'])} | {rss:.0f} MiB |"
            )
    print_targets(records, args.leaves)
    return 0


#: (ranks, stage, what, limit, unit): the targets this benchmark's stages are judged by (``run.py`` judges
#: them too, from its own run)
TARGETS = [
    (4096, "manifest write", "time", 2.0, "s"),
    (4096, "manifest write cached", "time", 0.5, "s"),
    (4096, "manifest open saved", "time", 0.5, "s"),
    (4096, "manifest open saved", "rss_added_mib", 256, "MiB"),
    (4096, "manifest open whole", "time", 2.0, "s"),
    (4096, "manifest open whole", "rss_added_mib", 1024, "MiB"),
    (16384, "manifest write", "time", 8.0, "s"),
    (16384, "manifest open whole", "time", 8.0, "s"),
]


def print_targets(records: list[dict], leaves: int) -> None:
    """Each target whose rank count was run (with 1,000 leaves): met or missed, on the medians."""
    if leaves != 1000:
        return
    for world, scenario, what, limit, unit in TARGETS:
        recs = [r for r in records if r["world"] == world and r["scenario"] == scenario]
        if not recs:
            continue
        values = [r["metrics"]["time"] if what == "time" else r[what] for r in recs]
        v = C.summarize(values)["median"]
        shown = C.fmt_seconds(v) if unit == "s" else f"{v:.0f} MiB"
        bound = f"{limit:g} s" if unit == "s" else f"{limit} MiB"
        label = "time" if what == "time" else "peak RSS added"
        print(
            f"target {world:,} ranks x 1,000 leaves, {scenario} {label} < {bound}: {shown}, "
            f"{'met' if v < limit else 'MISSED'}"
        )


if __name__ == "__main__":
    sys.exit(main())
