"""A rank of the scale jobs: many small leaves saved by 8 ranks, loaded on 3 (see test_scale.py).

    scale_rank.py save TARGET     (8 ranks, torchrun or mpiexec)
    scale_rank.py load TARGET...  (3 ranks: each TARGET loaded with the even share and checked bit for bit)

Every rank writes a report (launch_util.write_report) with what it checked.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch
from tensordict import TensorDict

import tddist
from tddist.comm.resolve import resolve
from tests.launch_util import write_report

LEAVES = 5000
SAVE_WORLD = 8
ROWS = (2, 1, 0, 3, 2, 1, 2, 1)  # rows of every leaf per saving rank (rank 2 has none)


def leaf_values(rank: int, i: int) -> torch.Tensor:
    """Rank ``rank``'s rows of leaf ``i`` (distinct for every rank, leaf and element)."""
    n = ROWS[rank]
    start = sum(ROWS[:rank])
    rows = torch.arange(start, start + n, dtype=torch.float32).reshape(n, 1)
    return rows * 1000 + torch.arange(3, dtype=torch.float32) + i * 1e6


def shard(rank: int) -> TensorDict:
    return TensorDict({f"l{i:05d}": leaf_values(rank, i) for i in range(LEAVES)}, [ROWS[rank]])


def global_td() -> TensorDict:
    """The whole checkpoint: every rank's rows in rank order."""
    return torch.cat([shard(r) for r in range(SAVE_WORLD)])


def main() -> None:
    role, targets = sys.argv[1], sys.argv[2:]
    comm = resolve(None)
    rank, size = comm.rank, comm.size
    t0 = time.monotonic()
    if role == "save":
        tddist.save(shard(rank), targets[0], num_threads=2)
        write_report(rank, "ok", saved=LEAVES, seconds=time.monotonic() - t0)
        return
    expected = global_td()
    total = expected.batch_size[0]
    start, stop = (int(x) for x in torch.tensor_split(torch.arange(total), size)[rank][[0, -1]])
    checked = []
    for target in targets:
        got = tddist.load(target, verify=True)
        assert got.batch_size[0] == stop - start + 1, (got.batch_size, start, stop)
        for key, value in expected[start : stop + 1].items():
            assert torch.equal(got[key], value), (target, key)
        checked.append(target)
    write_report(rank, "ok", checked=checked, seconds=time.monotonic() - t0)


if __name__ == "__main__":
    try:
        main()
    except BaseException as e:
        import traceback

        rank = int(__import__("os").environ.get("RANK", __import__("os").environ.get("PMI_RANK", "0")))
        write_report(rank, "failed", error=f"{type(e).__name__}: {e}", traceback=traceback.format_exc())
        raise
