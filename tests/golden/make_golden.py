"""Build the golden checkpoints of tddist's on-disk format, version 4 (the version this tddist writes).

    python tests/golden/make_golden.py            # writes tests/golden/v4/<name>/
    python tests/golden/make_golden.py OUT_DIR    # writes OUT_DIR/<name>/ instead

The values come from fixed formulas (no random numbers), so the recipe
functions below also give the expected values to tests/test_golden.py, for
every version's golden checkpoints (tests/golden/v1 and v2 were written by the
same recipes, except "single_rank_memmap", which version 1 did not need). An
existing golden checkpoint is never overwritten: see README.md beside this file.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

if __name__ == "__main__":  # allow running the script from a checkout without installing
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch
from tensordict import TensorDict

import tddist
from tddist import format as tddist_format

GOLDEN_DIR = Path(__file__).resolve().parent
#: The format version these recipes write, and where a plain run writes it.
VERSION = 4
VERSION_DIR = GOLDEN_DIR / f"v{VERSION}"

#: checkpoint (a): one rank, nested, many dtypes, keys that need escaping
SINGLE = "single_rank"
#: checkpoint (a'): the data of (a) saved with layout="memmap" (version 2: one file per leaf and rank,
#: rank directories that TensorDict.load_memmap opens, instead of one packed data file per rank)
SINGLE_MEMMAP = "single_rank_memmap"
SINGLE_METADATA = {"recipe": "single_rank", "step": 100, "lr": 0.25, "tags": ["golden", "v1"], "none": None}

#: checkpoint (b): three ranks with uneven rows (rank 1 has none) and uneven columns
MULTI = "three_ranks"
WORLD = 3
ROWS = (3, 0, 2)  # rows of "data" per rank
COLS = (1, 3, 2)  # columns of ("shared", "cols") per rank, sharded along dim 1
MULTI_METADATA = {"recipe": "three_ranks", "world": WORLD, "rows": list(ROWS), "cols": list(COLS), "note": "ünï ✓"}
MULTI_PLACEMENTS = {("shared", "cols"): tddist.Shard(1)}


def _ramp(shape, dtype, scale=1.0, offset=0.0) -> torch.Tensor:
    n = 1
    for s in shape:
        n *= s
    return (torch.arange(n, dtype=torch.float64) * scale + offset).reshape(shape).to(dtype)


def single_rank_td() -> TensorDict:
    """The data of checkpoint (a)."""
    n = 4
    obs = _ramp((n, 3), torch.float32, 0.5, -2.0)
    obs[0, 1] = float("nan")
    obs[1, 2] = float("-inf")
    obs[2, 0] = -0.0
    obs[3, 2] = 1e-45  # float32 subnormal
    batch = TensorDict(
        {
            "obs": obs,
            "a/b": torch.tensor([-(2**62), -1, 0, 2**62 + 5], dtype=torch.int64),
            "..": TensorDict(
                {"x y": _ramp((n, 2), torch.float16, 0.125, -0.5), "%": torch.tensor([True, False, False, True])},
                [n],
            ),
            "": _ramp((n,), torch.bfloat16, 3.0, -4.0),
            "tab\there": (_ramp((n, 2), torch.float64, 37.0) % 256).to(torch.uint8),
            ".": _ramp((n,), torch.int16, -1000.0, 500.0),
            "i32": _ramp((n,), torch.int32, 2**20, -(2**30)),
            "f64": _ramp((n,), torch.float64, 1 / 3, 0.1),
            "grid": TensorDict(
                {
                    "c": _ramp((n, 2), torch.int8, -17.0, 60.0),
                    "z": torch.complex(_ramp((n, 2), torch.float32, 0.5), _ramp((n, 2), torch.float32, -1.5, 1.0)),
                },
                [n, 2],
            ),
            "empty": torch.zeros(n, 0),
        },
        [n],
    )
    return TensorDict(
        {
            "batch": batch,
            "step": torch.tensor(123456789, dtype=torch.int64),
            "table": _ramp((3,), torch.float64, 0.75, 1.0),
        },
        [],
    )


def multi_rank_global() -> TensorDict:
    """The global values of checkpoint (b): what loading it whole must give."""
    rows, cols = sum(ROWS), sum(COLS)
    data = TensorDict(
        {
            "x": _ramp((rows, 4), torch.float32, 0.25, -1.0),
            "y": _ramp((rows,), torch.int32, 7.0, -3.0),
            "sub": TensorDict({"z": _ramp((rows, 2, 2), torch.float64, 1.5, 0.5)}, [rows, 2]),
        },
        [rows],
    )
    shared = TensorDict(
        {"w": _ramp((6,), torch.float32, -0.5, 2.0), "cols": _ramp((3, cols), torch.int16, 11.0, -40.0)}, []
    )
    return TensorDict({"data": data, "shared": shared, "step": torch.tensor(42, dtype=torch.int64)}, [])


def _span(counts, rank):
    start = sum(counts[:rank])
    return start, start + counts[rank]


def multi_rank_shard(rank: int) -> TensorDict:
    """What rank ``rank`` passes to save for checkpoint (b): its rows, its columns, the replicas."""
    g = multi_rank_global()
    r0, r1 = _span(ROWS, rank)
    c0, c1 = _span(COLS, rank)
    shard = TensorDict(
        {
            "data": g["data"][r0:r1].clone(),
            "shared": TensorDict({"w": g["shared", "w"].clone(), "cols": g["shared", "cols"][:, c0:c1].clone()}, []),
            "step": g["step"].clone(),
        },
        [],
    )
    return shard


def write_single(path) -> None:
    """Save checkpoint (a) at ``path``."""
    tddist.save(single_rank_td(), path, metadata=SINGLE_METADATA, comm=tddist.LocalComm())


def write_single_memmap(path) -> None:
    """Save checkpoint (a') at ``path``: the data of (a), one file per leaf (layout "memmap")."""
    tddist.save(single_rank_td(), path, metadata=SINGLE_METADATA, comm=tddist.LocalComm(), layout="memmap")


def write_multi(path) -> None:
    """Save checkpoint (b) at ``path`` from three thread ranks."""

    def rank_main(comm):
        tddist.save(
            multi_rank_shard(comm.rank),
            path,
            comm=comm,
            placements=MULTI_PLACEMENTS,
            metadata=MULTI_METADATA,
            check_replicas=True,
        )
        return "ok"

    results = tddist.run_threads(WORLD, rank_main)
    errors = [r for r in results if r != "ok"]
    if errors:
        raise errors[0]


#: checkpoint (c): two ranks with non-tensor values (replicated, per rank, a stack), a
#: batched sub-TensorDict without tensors (its rows are recorded per rank), verbatim keys
EXTENDED = "extended"
EXTENDED_ROWS = (2, 1)
#: the same data as one deflate-compressed archive
EXTENDED_ARCHIVE = "extended.tdz"
#: checkpoint (d): a DTensor saved from a one-rank mesh (a "boxes" leaf)
DTENSOR = "dtensor"


def extended_shard(rank: int) -> TensorDict:
    """What rank ``rank`` saves for checkpoints (c) and (c'), with ``robust_key=False``."""
    n = EXTENDED_ROWS[rank]
    start = sum(EXTENDED_ROWS[:rank])
    td = TensorDict({"v": _ramp((n, 2), torch.float32, 0.5, 10.0 * start), "meta": TensorDict({}, [n])}, [n])
    td.set_non_tensor("config", {"lr": 0.5, "betas": [0.9, 0.99], "name": "golden"})
    td.set_non_tensor("host", f"node-{rank}")
    from tensordict import NonTensorStack

    td["labels"] = NonTensorStack.from_list([f"row-{start + i}" for i in range(n)])
    return td


def write_extended(path, archive: bool = False) -> None:
    def rank_main(comm):
        kwargs = {"compression": "deflate"} if archive else {}
        tddist.save(
            extended_shard(comm.rank), path, comm=comm, robust_key=False, metadata={"recipe": EXTENDED}, **kwargs
        )
        return "ok"

    errors = [r for r in tddist.run_threads(len(EXTENDED_ROWS), rank_main) if r != "ok"]
    if errors:
        raise errors[0]


def dtensor_global() -> torch.Tensor:
    return _ramp((5, 3), torch.float32, 1.0, -7.0)


def write_dtensor(path) -> None:
    import tempfile

    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    with tempfile.TemporaryDirectory() as tmp:
        dist.init_process_group("gloo", store=dist.FileStore(os.path.join(tmp, "store"), 1), rank=0, world_size=1)
        try:
            mesh = init_device_mesh("cpu", (1,))
            tddist.save({"w": distribute_tensor(dtensor_global(), mesh, [Shard(0)])}, path)
        finally:
            dist.destroy_process_group()


#: checkpoints (e) and (e'): two thread ranks save a frozen part and an adapter, then save again with the
#: adapter changed and the first as ``base``: (e') references (e)'s unchanged chunks (format version 4)
INCREMENTAL_BASE = "incremental_base"
INCREMENTAL = "incremental"
INCREMENTAL_ROWS = (2, 3)


def incremental_shard(rank: int, step: int) -> TensorDict:
    """What rank ``rank`` saves for checkpoint (e) (``step`` 1) and (e') (``step`` 2)."""
    n, start = INCREMENTAL_ROWS[rank], sum(INCREMENTAL_ROWS[:rank])
    return TensorDict(
        {
            "frozen": TensorDict({"w": _ramp((n, 4), torch.float32, 0.25, 4.0 * start)}, [n]),
            "embed": _ramp((3, 2), torch.bfloat16, 0.5),
            "adapter": _ramp((2, 2), torch.float32, 1.0, 100.0 * step),
        },
        [],
    )


def write_incremental(path, step: int) -> None:
    base = Path(path).parent / INCREMENTAL_BASE if step == 2 else None

    def rank_main(comm):
        tddist.save(incremental_shard(comm.rank, step), path, comm=comm, base=base, metadata={"step": step})
        return "ok"

    errors = [r for r in tddist.run_threads(len(INCREMENTAL_ROWS), rank_main) if r != "ok"]
    if errors:
        raise errors[0]


BUILDERS = {
    SINGLE: write_single,
    SINGLE_MEMMAP: write_single_memmap,
    MULTI: write_multi,
    EXTENDED: write_extended,
    EXTENDED_ARCHIVE: lambda path: write_extended(path, archive=True),
    DTENSOR: write_dtensor,
    INCREMENTAL_BASE: lambda path: write_incremental(path, 1),
    INCREMENTAL: lambda path: write_incremental(path, 2),
}


#: checkpoints (e) and (e') saved to object storage (docs/format.md 13.3), as files: every object of the two
#: checkpoints, named by its key under their parent prefix; a manifest object's metadata
#: (``tddist-generation``) is the name of the one generation beside it. Written only against an S3 server
#: (``AWS_ENDPOINT_URL`` and credentials in the environment, ``TDDIST_GOLDEN_BUCKET`` an existing bucket).
S3_INCREMENTAL = "s3_incremental"


def write_s3_incremental(path) -> None:
    """Save (e) and (e') under a fresh prefix of the bucket, then download every object under it into ``path``."""
    import uuid

    from tddist.storage.s3.client import s3_client

    bucket, prefix = os.environ["TDDIST_GOLDEN_BUCKET"], f"golden-{uuid.uuid4().hex}"
    for name, step in ((INCREMENTAL_BASE, 1), (INCREMENTAL, 2)):
        target, base = f"s3://{bucket}/{prefix}/{name}", f"s3://{bucket}/{prefix}/{INCREMENTAL_BASE}"

        def rank_main(comm, target=target, base=base, step=step):
            tddist.save(incremental_shard(comm.rank, step), target, comm=comm, metadata={"step": step},
                        base=base if step == 2 else None)  # fmt: skip
            return "ok"

        errors = [r for r in tddist.run_threads(len(INCREMENTAL_ROWS), rank_main) if r != "ok"]
        if errors:
            raise errors[0]
    client = s3_client()
    for page in client.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix + "/"):
        for o in page.get("Contents", []):
            out = Path(path) / o["Key"][len(prefix) + 1 :]
            out.parent.mkdir(parents=True, exist_ok=True)
            out.write_bytes(client.get_object(Bucket=bucket, Key=o["Key"])["Body"].read())


def main(argv: list[str]) -> int:
    out = Path(argv[0]) if argv else VERSION_DIR
    if tddist_format.FORMAT_VERSION != VERSION:
        print(f"this tddist writes format version {tddist_format.FORMAT_VERSION}, not {VERSION}", file=sys.stderr)
        return 1
    if out.resolve().parent == GOLDEN_DIR and out.resolve() != VERSION_DIR:
        # a new checkpoint in another version's directory would be written in the wrong format
        print(f"{out} is another format version's golden directory; it is never added to", file=sys.stderr)
        return 1
    out.mkdir(parents=True, exist_ok=True)
    for name, write in BUILDERS.items():
        target = out / name
        if os.path.lexists(target):
            print(f"{target} exists; golden checkpoints are never regenerated (see README.md)", file=sys.stderr)
            continue
        write(target)
        print(f"wrote {target}")
    target = out / S3_INCREMENTAL
    if os.path.lexists(target):
        print(f"{target} exists; golden checkpoints are never regenerated (see README.md)", file=sys.stderr)
    elif "TDDIST_GOLDEN_BUCKET" not in os.environ:
        print(f"{target} needs an S3 server: set AWS_ENDPOINT_URL, credentials and TDDIST_GOLDEN_BUCKET", file=sys.stderr)
    else:
        write_s3_incremental(target)
        print(f"wrote {target}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
