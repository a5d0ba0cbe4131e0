#!/usr/bin/env python
"""Consolidating a many-rank checkpoint: ``tddist convert`` against DCP's own consolidation of the same state.

    .venv/bin/python benchmarks/consolidate.py                      # 256 ranks x 200 leaves, 1 GiB, 2 repeats
    .venv/bin/python benchmarks/consolidate.py --quick              # 16 ranks x 20 leaves, 32 MiB, 1 repeat

The same state is saved twice (untimed), as ``--ranks`` ranks would save it: every leaf is a float32 matrix
sharded by rows, each rank holding the same number of rows of every leaf (``--size-mib`` in all):

- tddist: ``tddist.save`` on ``--ranks`` thread ranks of this process (``run_threads``): one packed data file
  per rank, the manifest merged by rank 0, committed, as a job of that size writes it;
- DCP: each rank's save plan (one ``WriteItem`` per leaf: its rows' offsets in the global tensor) built by a
  planner per rank, then the steps ``dcp.save`` runs on every rank, run here for each rank in turn: the
  coordinator's global plan (``DefaultSavePlanner.create_global_plan``: the metadata of every chunk), each
  rank's ``write_data`` with its own finished plan, the coordinator's ``finish``. Once with
  ``HuggingFaceStorageWriter(save_distributed=True)`` (one safetensors file per rank, each chunk's offsets in
  its metadata), once with ``FileSystemWriter`` (``__<rank>_0.distcp`` files and ``.metadata``).

Then two pairs of conversions, each conversion in a fresh process (``--child``) after the page cache is dropped
(``sync; echo 3 > /proc/sys/vm/drop_caches``, when permitted: root), its peak resident size reset
(``/proc/self/clear_refs``) just before it starts:

- to Hugging Face sharded safetensors (files of at most ``--max-shard-size``): ``tddist.convert(..., "safetensors",
  max_shard_size=...)`` against DCP's ``consolidate_safetensors_files`` (the same leaves to the same files);
- to one ``torch.save`` file: ``tddist.convert(src, "x.pt")`` against ``format_utils.dcp_to_torch_save``.

Each conversion's wall time and peak RSS added (VmHWM minus the RSS before it) are taken; the order of the
two sides alternates between repeats; the table shows the best time and the largest RSS of the repeats, and
the ratios DCP / tddist. ``--json PATH`` (or ``--out PATH``) writes every sample, and the same samples as
``run.py``'s records (``records_of``): ``run.py`` runs this program and judges its memory targets.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass

# tddist as run.py passes it (PYTHONPATH), else the repository's copy.
sys.path.append(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.append(os.path.dirname(os.path.abspath(__file__)))

import _common as C

COLS = 256  # each row of a leaf: 256 float32, 1 KiB


@dataclass(frozen=True)
class Shape:
    """The checkpoint: ``ranks`` ranks each holding ``rows`` rows of ``COLS`` float32 of each of ``leaves`` leaves."""

    ranks: int
    leaves: int
    rows: int

    @property
    def leaf_bytes(self) -> int:
        return self.ranks * self.rows * COLS * 4

    @property
    def total_bytes(self) -> int:
        return self.leaves * self.leaf_bytes

    @staticmethod
    def of(ranks: int, leaves: int, size_mib: float) -> Shape:
        rows = max(1, int(size_mib * C.MIB) // (ranks * leaves * COLS * 4))
        return Shape(ranks, leaves, rows)


def local(shape: Shape, rank: int, leaf: int):
    """Rank ``rank``'s rows of leaf ``leaf`` (the same values in both checkpoints)."""
    import torch

    n = shape.rows * COLS
    return torch.arange(n, dtype=torch.float32).add_(float(rank * 7919 + leaf * 104729)).view(shape.rows, COLS)


def name(leaf: int) -> str:
    return f"layer{leaf:04d}.weight"


# --- the checkpoints ------------------------------------------------------------------------------------------


def save_tddist(shape: Shape, path: str) -> None:
    """``tddist.save`` on ``shape.ranks`` thread ranks: each saves its rows of every leaf."""
    from tensordict import TensorDict

    import tddist

    def rank_saves(c) -> None:
        td = TensorDict({name(i): local(shape, c.rank, i) for i in range(shape.leaves)}, batch_size=[shape.rows])
        tddist.save(td, path, comm=c, num_threads=1)

    results = tddist.run_threads(shape.ranks, rank_saves, timeout=1800)
    failed = [r for r in results if isinstance(r, BaseException)]
    if failed:
        raise failed[0]


def save_dcp(shape: Shape, writer) -> None:
    """The steps of ``dcp.save`` on ``shape.ranks`` ranks, each rank's in turn, into ``writer``."""
    from torch.distributed.checkpoint import DefaultSavePlanner
    from torch.distributed.checkpoint.planner import SavePlan

    class RankPlanner(DefaultSavePlanner):
        """One rank's plan: a write item per leaf (its rows of the global tensor), data made when written."""

        def __init__(self, rank: int) -> None:
            super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)
            self.rank = rank

        def set_up_planner(self, state_dict, storage_meta=None, is_coordinator: bool = False) -> None:
            self.state_dict, self.is_coordinator = {}, is_coordinator

        def create_local_plan(self) -> SavePlan:
            self.plan = SavePlan([_write_item(shape, self.rank, i) for i in range(shape.leaves)])
            return self.plan

        def resolve_data(self, write_item):
            return local(shape, self.rank, int(write_item.index.fqn[5:9]))

    planners = [RankPlanner(r) for r in range(shape.ranks)]
    writer.set_up_storage_writer(True)
    plans = []
    for r, p in enumerate(planners):
        p.set_up_planner({}, None, r == 0)
        plans.append(writer.prepare_local_plan(p.create_local_plan()))
    plans, metadata = planners[0].create_global_plan(plans)
    plans = writer.prepare_global_plan(plans)
    results = []
    for p, plan in zip(planners, plans):
        results.append(writer.write_data(p.finish_plan(plan), p).wait())
    writer.finish(metadata, results)


def _write_item(shape: Shape, rank: int, leaf: int):
    import torch
    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex, TensorProperties
    from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType

    offsets, sizes = torch.Size([rank * shape.rows, 0]), torch.Size([shape.rows, COLS])
    return WriteItem(
        index=MetadataIndex(name(leaf), offsets),
        type=WriteItemType.SHARD,
        tensor_data=TensorWriteData(
            chunk=ChunkStorageMetadata(offsets=offsets, sizes=sizes),
            properties=TensorProperties(dtype=torch.float32),
            size=torch.Size([shape.ranks * shape.rows, COLS]),
        ),
    )


def shard_files(shape: Shape, max_shard_bytes: int) -> dict[str, int]:
    """Each leaf's file index (1..N) as ``tddist convert`` groups leaves into files of at most ``max_shard_bytes``."""
    out, index, size = {}, 1, 0
    for i in range(shape.leaves):
        if size and size + shape.leaf_bytes > max_shard_bytes:
            index, size = index + 1, 0
        out[name(i)] = index
        size += shape.leaf_bytes
    return out


def build(shape: Shape, root: str) -> dict[str, str]:
    """The three source checkpoints (tddist, DCP as HF safetensors per rank, DCP ``.distcp``), untimed."""
    from torch.distributed.checkpoint import FileSystemWriter
    from torch.distributed.checkpoint.hf_storage import HuggingFaceStorageWriter

    paths = {k: os.path.join(root, k) for k in ("tddist", "dcp-hf", "dcp")}
    t0 = time.perf_counter()
    save_tddist(shape, paths["tddist"])
    t1 = time.perf_counter()
    save_dcp(shape, HuggingFaceStorageWriter(paths["dcp-hf"], save_distributed=True))
    save_dcp(shape, FileSystemWriter(paths["dcp"], single_file_per_rank=True, sync_files=False))
    t2 = time.perf_counter()
    print(f"saved {shape.ranks} ranks x {shape.leaves} leaves ({shape.total_bytes / C.MIB:.0f} MiB) in "
          f"{t1 - t0:.1f} s (tddist), {t2 - t1:.1f} s (DCP, both)", flush=True)  # fmt: skip
    return paths


# --- one conversion, in a fresh process -----------------------------------------------------------------------


def child(kind: str, src: str, dst: str, max_shard_size: str, mapping: str) -> None:
    """Run one conversion here; print its seconds and peak RSS added (MiB) as JSON."""
    from torch.distributed.checkpoint._consolidate_hf_safetensors import consolidate_safetensors_files
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    import tddist
    import tddist.interop.convert
    import tddist.interop.hf
    import tddist.interop.native
    import tddist.interop.torch_file

    runs = {
        "tddist hf": lambda: tddist.convert(src, dst, "safetensors", max_shard_size=max_shard_size),
        "dcp hf": lambda: (os.mkdir(dst), consolidate_safetensors_files(src, dst, json.loads(mapping))),
        "tddist torch": lambda: tddist.convert(src, dst, "torch"),
        "dcp torch": lambda: dcp_to_torch_save(src, dst),
    }
    reset = C.reset_hwm()
    before = C.rss_kib()
    t0 = time.perf_counter()
    runs[kind]()
    seconds = time.perf_counter() - t0
    print(json.dumps({"seconds": seconds, "rss_added_mib": (C.hwm_kib() - before) / 1024, "hwm_reset": reset}))


def convert_once(
    kind: str, src: str, dst: str, shape: Shape, args: argparse.Namespace, mapping: dict[str, int]
) -> dict:
    """One conversion in a fresh process after the page cache is dropped; its sample (the output checked)."""
    C.remove(dst)
    dropped, why = C.drop_page_cache()
    cmd = [
        sys.executable,
        os.path.abspath(__file__),
        "--child",
        kind,
        src,
        dst,
        args.max_shard_size,
        json.dumps(mapping),
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=3600)
    if proc.returncode != 0:
        raise RuntimeError(f"{kind} failed:\n{proc.stderr[-4000:]}")
    sample = json.loads(proc.stdout.strip().splitlines()[-1])
    sample.update(kind=kind, cache_dropped=dropped, cache_note=why, out_bytes=_size(dst))
    check(shape, dst)
    C.remove(dst)
    return sample


def check(shape: Shape, dst: str) -> None:
    """The last leaf of what a conversion wrote holds every rank's rows (untimed)."""
    import torch
    from safetensors import safe_open

    leaf = shape.leaves - 1
    expected = torch.cat([local(shape, r, leaf) for r in range(shape.ranks)])
    if os.path.isdir(dst):
        with open(os.path.join(dst, "model.safetensors.index.json")) as f:
            file = json.load(f)["weight_map"][name(leaf)]
        with safe_open(os.path.join(dst, file), "pt") as st:
            got = st.get_tensor(name(leaf))
    else:
        got = torch.load(dst, mmap=True, weights_only=True)[name(leaf)]
    if not torch.equal(got, expected):
        raise AssertionError(f"{dst}: {name(leaf)} differs from what the ranks saved")


def _size(path: str) -> int:
    if os.path.isfile(path):
        return os.path.getsize(path)
    return sum(os.path.getsize(os.path.join(d, f)) for d, _s, fs in os.walk(path) for f in fs)


PAIRS = (("hf", "tddist hf", "dcp hf"), ("torch", "tddist torch", "dcp torch"))


def measure(shape: Shape, paths: dict[str, str], root: str, args: argparse.Namespace) -> list[dict]:
    """Every conversion ``--repeats`` times, the two sides of each pair in alternating order."""
    from tddist.interop.hf import parse_size

    mapping = shard_files(shape, parse_size(args.max_shard_size))
    where = {
        "tddist hf": (paths["tddist"], os.path.join(root, "out-hf")),
        "dcp hf": (paths["dcp-hf"], os.path.join(root, "out-hf")),
        "tddist torch": (paths["tddist"], os.path.join(root, "out.pt")),
        "dcp torch": (paths["dcp"], os.path.join(root, "out.pt")),
    }
    samples = []
    for rep in range(args.repeats):
        for _pair, a, b in PAIRS:
            for kind in (a, b) if rep % 2 == 0 else (b, a):
                s = convert_once(kind, *where[kind], shape, args, mapping)
                s["repeat"] = rep
                print(f"  {kind:13s} repeat {rep}: {s['seconds']:7.2f} s  +{s['rss_added_mib']:7.0f} MiB", flush=True)
                samples.append(s)
    return samples


def table(shape: Shape, samples: list[dict]) -> str:
    """Best time and largest RSS added of each conversion; DCP / tddist."""
    best = {k: min(s["seconds"] for s in samples if s["kind"] == k) for k in {s["kind"] for s in samples}}
    rss = {k: max(s["rss_added_mib"] for s in samples if s["kind"] == k) for k in best}
    lines = [
        f"{shape.ranks} ranks x {shape.leaves} leaves, {shape.total_bytes / C.MIB:.0f} MiB "
        f"(largest leaf {shape.leaf_bytes / C.MIB:.1f} MiB)",
        "",
        "| to | tddist s | DCP s | DCP/tddist time | tddist RSS+ MiB | DCP RSS+ MiB | DCP/tddist RSS+ |",
        "|---|---|---|---|---|---|---|",
    ]
    for pair, a, b in PAIRS:
        lines.append(
            f"| {pair} | {best[a]:.2f} | {best[b]:.2f} | {best[b] / best[a]:.2f} | {rss[a]:.0f} | {rss[b]:.0f} | "
            f"{rss[b] / max(rss[a], 1e-9):.2f} |"
        )
    return "\n".join(lines)


#: The name of each pair's scenario in ``run.py``'s records and table.
SCENARIO = {"hf": "consolidate to hf", "torch": "consolidate to torch.save"}


def records_of(shape: Shape, samples: list[dict]) -> list[dict]:
    """The samples as ``run.py``'s records: one process converting (world 1), tddist the reference, the
    checkpoint's shape and its largest leaf (what a conversion's memory is bounded by) in ``extra``."""
    extra = {"ranks": shape.ranks, "leaves": shape.leaves, "largest_leaf_bytes": shape.leaf_bytes}
    out = []
    for s in samples:
        impl, pair = s["kind"].split()  # "tddist hf", "dcp torch", ... (``PAIRS``)
        out.append(
            {
                "scenario": SCENARIO[pair],
                "world": 1,
                "launcher": "single",
                "impl": impl,
                "ref": "tddist",
                "repeat": s["repeat"],
                "metrics": {"time": s["seconds"]},
                "rss_added_mib": s["rss_added_mib"],
                "bytes": shape.total_bytes,
                "extra": dict(extra, out_bytes=s["out_bytes"]),
            }
        )
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ranks", type=int, default=256)
    p.add_argument("--leaves", type=int, default=200)
    p.add_argument("--size-mib", type=float, default=1024.0, help="the checkpoint's size (default: 1024)")
    p.add_argument("--max-shard-size", default="256MB", help="the largest safetensors file (default: 256MB)")
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--dir", default=None, help="where the checkpoints go (default: a temporary directory)")
    p.add_argument("--json", "--out", dest="json", default=None, help="write every sample as JSON here")
    p.add_argument("--quick", action="store_true", help="16 ranks x 20 leaves, 32 MiB, 1 repeat")
    p.add_argument("--child", nargs=5, metavar=("KIND", "SRC", "DST", "SIZE", "MAPPING"), help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        child(*args.child)
        return 0
    if args.quick:
        args.ranks, args.leaves, args.size_mib, args.repeats = 16, 20, 32.0, 1
        args.max_shard_size = "8MB"
    shape = Shape.of(args.ranks, args.leaves, args.size_mib)
    if args.dir:
        os.makedirs(args.dir, exist_ok=True)
    root = tempfile.mkdtemp(prefix="consolidate-", dir=args.dir)
    try:
        paths = build(shape, root)
        samples = measure(shape, paths, root, args)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    if not all(s["cache_dropped"] for s in samples):
        print(f"note: the page cache was not dropped ({samples[0]['cache_note']}): sources may be read from memory")
    print(table(shape, samples))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                {"shape": asdict(shape), "args": vars(args), "samples": samples, "records": records_of(shape, samples)},
                f,
                indent=2,
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
