#!/usr/bin/env python
"""Rank 0's manifest work at thousands of ranks, in one process (no job of that size needed).

    .venv/bin/python benchmarks/scale_manifest.py [--ranks 1024,4096] [--leaves 1000] [--repeats 3]

Builds the fragments (votes) that ``ranks`` ranks would send, each with
``leaves`` sharded leaves shaped exactly as a layout's ``write`` builds them
(``tddist.types.Fragment`` of ``FragmentLeaf``), and passes every fragment
through a pickle round trip, as the gather delivers it. Then, as rank 0 does
in the commit:

- write: ``merge_fragments`` (validation), ``to_json``, ``format.dumps``, and
  writing the file durably (``write_durable``, then an fsync of its directory);
- parse: reading the file, ``format.loads`` and ``parse_manifest``, which is
  what ``tddist.read_manifest`` does on every load.

Reports each stage's time and the peak RSS each phase adds. Targets: at 4,096
ranks x 1,000 leaves, write under 2 s and parse under 1 s. Also run by
``run.py`` as its ``manifest`` scenario.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import pickle
import sys
import tempfile
import time

# tddist as run.py passes it (PYTHONPATH: the snapshot of this run), else the repository's copy.
sys.path.append(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import _common as C

import tddist
from tddist import format as fmt
from tddist._fs import write_durable
from tddist.manifest import merge_fragments, parse_manifest, to_json
from tddist.sharding import Shard
from tddist.types import Fragment, FragmentLeaf, StoredBytes

ROWS, COLS = 8, 64  # each rank's shard of each leaf: 8 rows of 64 float32


def build_fragments(ranks: int, leaves: int) -> tuple[list[Fragment], int]:
    """The fragments as rank 0 receives them, and their total pickled size."""
    frags, pickled = [], 0
    nodes = (((), (ROWS,)), (("params",), (ROWS,)))
    nbytes = ROWS * COLS * 4
    for r in range(ranks):
        entries = tuple(
            FragmentLeaf(
                ("params", f"layer{i:04d}.weight"),
                "float32",
                (ROWS, COLS),
                Shard(0),
                StoredBytes(nbytes, f"{(r * leaves + i) * 0x9E3779B97F4A7C15 % (1 << 64):016x}"),
            )
            for i in range(leaves)
        )
        blob = pickle.dumps(Fragment(r, nodes, entries), protocol=pickle.HIGHEST_PROTOCOL)
        pickled += len(blob)
        frags.append(pickle.loads(blob))
    return frags, pickled


def one_run(frags: list[Fragment], path: str) -> tuple[dict, dict, int]:
    """(write stage times and peak RSS added, parse stage times and peak RSS added, manifest bytes)."""
    gc.collect()
    base = C.rss_kib()
    C.reset_hwm()
    t0 = time.perf_counter()
    m = merge_fragments(frags, metadata={}, robust_key=True, version=tddist.__version__)
    t1 = time.perf_counter()
    obj = to_json(m)
    t2 = time.perf_counter()
    raw = fmt.dumps(obj)
    t3 = time.perf_counter()
    write_durable(path, raw)
    C.fsync_path(os.path.dirname(path))
    t4 = time.perf_counter()
    write = {
        "time": t4 - t0,
        "merge": t1 - t0,
        "to_json": t2 - t1,
        "dumps": t3 - t2,
        "write file": t4 - t3,
        "rss_added_mib": (C.hwm_kib() - base) / 1024,
        "rss_peak_mib": C.hwm_kib() / 1024,
    }
    size = len(raw)
    del m, obj, raw
    gc.collect()
    base = C.rss_kib()
    C.reset_hwm()
    t0 = time.perf_counter()
    with open(path, "rb") as f:
        data = f.read()
    t1 = time.perf_counter()
    obj = fmt.loads(data)
    t2 = time.perf_counter()
    parsed = parse_manifest(obj, where="benchmark manifest")
    t3 = time.perf_counter()
    parse = {
        "time": t3 - t0,
        "read file": t1 - t0,
        "loads": t2 - t1,
        "parse_manifest": t3 - t2,
        "rss_added_mib": (C.hwm_kib() - base) / 1024,
        "rss_peak_mib": C.hwm_kib() / 1024,
    }
    assert parsed.world_size == len(frags) and len(parsed.leaves) == len(frags[0].leaves)
    del parsed, obj, data
    return write, parse, size


def run(ranks_list: list[int], leaves: int, repeats: int, directory: str) -> list[dict]:
    os.makedirs(directory, exist_ok=True)
    records = []
    for ranks in ranks_list:
        t0 = time.perf_counter()
        base = C.rss_kib()
        frags, pickled = build_fragments(ranks, leaves)
        held = (C.rss_kib() - base) / 1024
        print(
            f"[manifest {ranks} ranks x {leaves} leaves] fragments built in {time.perf_counter() - t0:.1f} s "
            f"({pickled / C.MIB:.0f} MiB pickled, {held:.0f} MiB resident)",
            file=sys.stderr,
            flush=True,
        )
        for rep in range(repeats):
            path = os.path.join(directory, f"manifest-{ranks}.json")
            write, parse, size = one_run(frags, path)
            os.unlink(path)
            for scenario, stage in (("manifest write", write), ("manifest parse", parse)):
                metrics = {k: v for k, v in stage.items() if not k.startswith("rss")}
                records.append(
                    {
                        "scenario": scenario,
                        "world": ranks,
                        "launcher": "model",
                        "impl": "tddist",
                        "ref": "tddist",
                        "repeat": rep,
                        "metrics": metrics,
                        "bytes": None,
                        "rss_added_mib": stage["rss_added_mib"],
                        "rss_peak_mib_ranks": [round(stage["rss_peak_mib"], 1)],
                        "extra": {
                            "leaves_per_rank": leaves,
                            "manifest_mib": size / C.MIB,
                            "fragments_pickled_mib": pickled / C.MIB,
                            "fragments_resident_mib": held,
                        },
                    }
                )
                shown = ", ".join(f"{k} {C.fmt_seconds(v)}" for k, v in metrics.items())
                print(
                    f"[manifest {ranks} ranks rep {rep}] {scenario}: {shown}; peak RSS added "
                    f"{stage['rss_added_mib']:.0f} MiB; manifest {size / C.MIB:.1f} MiB",
                    file=sys.stderr,
                    flush=True,
                )
        del frags
        gc.collect()
    return records


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ranks", default="1024,4096", help="rank counts (comma-separated)")
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
        for scenario in ("manifest write", "manifest parse"):
            recs = [r for r in records if r["world"] == world and r["scenario"] == scenario]
            s = C.summarize([r["metrics"]["time"] for r in recs])
            rss = C.summarize([r["rss_added_mib"] for r in recs])["median"]
            print(
                f"| {world} | {scenario} | {C.fmt_seconds(s['median'])} | {C.fmt_seconds(s['min'])} - "
                f"{C.fmt_seconds(s['max'])} | {rss:.0f} MiB |"
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
