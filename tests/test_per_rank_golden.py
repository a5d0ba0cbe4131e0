"""A golden checkpoint of format version 3 with per-rank state (``tests/golden/v3/per_rank``) must keep loading.

Written by ``write_per_rank`` below (two thread ranks, ``tddist.PerRank()`` on a
tensor leaf and on a node holding non-tensor values) with the tddist that
introduced the ``per_rank`` placement; like every golden checkpoint it is
never regenerated (tests/golden/README.md). To write it elsewhere:
``python tests/test_per_rank_golden.py OUT_DIR``.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

import tddist

GOLDEN = Path(__file__).resolve().parent / "golden" / "v3" / "per_rank"
WORLD = 2


def rng_of(rank: int) -> torch.Tensor:
    return torch.arange(8, dtype=torch.uint8) + 10 * rank


def shard_of(rank: int) -> dict:
    return {
        "w": torch.linspace(-1.0, 1.0, 6).view(2, 3),  # replicated (equal on both ranks)
        "rng": rng_of(rank),
        "sampler": {"position": 7 * rank, "epoch": 1, "host": f"node-{rank}"},
    }


PLACEMENTS = {"rng": tddist.PerRank(), "sampler": tddist.PerRank()}


def write_per_rank(path) -> None:
    def rank_main(comm):
        tddist.save(shard_of(comm.rank), path, comm=comm, placements=PLACEMENTS, metadata={"recipe": "per_rank"})
        return "ok"

    errors = [r for r in tddist.run_threads(WORLD, rank_main) if r != "ok"]
    if errors:
        raise errors[0]


def test_packed_per_rank_leaf_keeps_each_ranks_shape_in_its_rank_directory(tmp_path):
    """pack and unpack write each rank directory's meta.json as the rank saved it: a per-rank leaf's own
    shape (not row ``rank`` of the stack), so TensorDict.load_memmap of a rank directory gives its value."""
    from tensordict import TensorDict

    tddist.pack(GOLDEN, tmp_path / "a.tdz")
    tddist.unpack(tmp_path / "a.tdz", tmp_path / "d")
    for rank in range(WORLD):
        td = TensorDict.load_memmap(tmp_path / "d" / f"rank-{rank:05d}")
        assert torch.equal(td["rng"], rng_of(rank)), rank
    back = tddist.run_threads(WORLD, lambda comm: tddist.load(tmp_path / "a.tdz", comm=comm)["rng"])
    assert all(torch.equal(b, rng_of(r)) for r, b in enumerate(back))


def test_per_rank_golden_json_records_the_placement():
    obj = json.loads((GOLDEN / "tddist.json").read_text())
    assert obj["version"] == 3 and obj["world_size"] == WORLD
    leaves = {tuple(e["key"]): e for e in obj["leaves"]}
    assert leaves[("rng",)]["placement"] == {"type": "per_rank"} and leaves[("rng",)]["shape"] == [WORLD, 8]
    assert leaves[("w",)]["placement"] == {"type": "replicate"}
    objects = {tuple(o["key"]): o for o in obj["objects"]}
    assert objects[("sampler", "epoch")]["placement"] == "per_rank" and objects[("sampler", "epoch")]["declared"]


@pytest.mark.parametrize("world", [1, 2, 3])
def test_per_rank_golden_loads_on_each_world_size(world):
    def body(comm):
        kw = {} if world == WORLD else {"per_rank": "rank0"}
        out = tddist.load(GOLDEN, comm=comm, verify=True, **kw)
        source = comm.rank if world == WORLD else 0
        assert torch.equal(out["w"], shard_of(0)["w"])
        assert torch.equal(out["rng"], rng_of(source))
        assert out["sampler", "position"] == 7 * source and out["sampler", "host"] == f"node-{source}"
        if world != WORLD:
            with pytest.raises(tddist.IncompatibleCheckpointError, match="rng"):
                tddist.load(GOLDEN, comm=comm)
            dropped = tddist.load(GOLDEN, comm=comm, per_rank="drop")
            assert set(dropped.keys(True, True)) == {"w"}  # the per-rank leaves (an empty node stays)
        return True

    assert tddist.run_threads(world, body) == [True] * world


def test_per_rank_golden_whole_is_the_stack_of_the_ranks_values():
    whole = tddist.load(GOLDEN, shard=None, verify=True)
    assert torch.equal(whole["rng"], torch.stack([rng_of(r) for r in range(WORLD)]))
    assert whole["sampler", "position"] == [0, 7]


def test_per_rank_golden_into_plain_targets():
    def body(comm):
        target = {"w": torch.zeros(2, 3), "rng": torch.zeros(8, dtype=torch.uint8), "sampler": {"position": -1}}
        report = tddist.load(GOLDEN, comm=comm, into=target, exclude=[("sampler", "epoch"), ("sampler", "host")])
        assert (
            report.ok
            and torch.equal(target["rng"], rng_of(comm.rank))
            and target["sampler"]["position"] == 7 * comm.rank
        )
        return True

    assert tddist.run_threads(WORLD, body) == [True] * WORLD


if __name__ == "__main__":
    out = Path(sys.argv[1]) / "per_rank"
    if out.exists():
        sys.exit(f"{out} exists; golden checkpoints are never regenerated")
    write_per_rank(out)
    print(f"wrote {out}")
