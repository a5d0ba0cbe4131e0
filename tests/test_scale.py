"""A real job at a scale where per-leaf work shows: 8 ranks x 5,000 small leaves.

Saved by 8 torchrun ranks and by 8 mpiexec ranks (oversubscribed on a small
machine), loaded on 3 torchrun ranks (their even shares) and whole in this
process, bit for bit, with checksums verified. The default layout keeps a few
files per rank: the manifest, its index and one data file per rank.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest
import torch

import tddist
from tddist import format as fmt
from tests import scale_rank
from tests.launch_util import run_job

SCRIPT = Path(scale_rank.__file__)
JOB_TIMEOUT = 420


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """The checkpoints saved by 8 torchrun ranks and by 8 mpiexec ranks."""
    base = tmp_path_factory.mktemp("scale")
    out = {}
    for launcher in ("torchrun", "mpiexec"):
        target = base / f"{launcher}-ckpt"
        job = run_job(launcher, 8, SCRIPT, ["save", str(target)], base / f"{launcher}-save", timeout=JOB_TIMEOUT)
        job.assert_ok(8)
        out[launcher] = target
    return out


@pytest.mark.multirank
def test_eight_ranks_save_few_files(saved):
    """Each checkpoint holds its manifest, its index and one data file per rank: no file per leaf."""
    for target in saved.values():
        names = sorted(os.listdir(target))
        assert names == [f"rank-{r:05d}.data" for r in range(8)] + ["tddist.idx", "tddist.json"], names
        m = tddist.read_manifest(target)
        assert m.world_size == 8 and m.version == 4 and m.packing == "packed"
        assert len(m.leaves) == scale_rank.LEAVES
        assert os.path.getsize(target / "rank-00002.data") == 0  # rank 2 saved no rows


@pytest.mark.multirank
def test_three_ranks_load_even_shares(saved, tmp_path):
    """3 torchrun ranks load their even share of both checkpoints, bit for bit, checksums verified."""
    targets = [str(saved["torchrun"]), str(saved["mpiexec"])]
    job = run_job("torchrun", 3, SCRIPT, ["load", *targets], tmp_path / "load", timeout=JOB_TIMEOUT)
    job.assert_ok(3)
    assert all(rep["checked"] == targets for rep in job.reports.values())


@pytest.mark.multirank
def test_one_process_loads_everything(saved):
    """shard=None in one process gives the whole global TensorDict of either checkpoint."""
    expected = scale_rank.global_td()
    for target in saved.values():
        got = tddist.load(target, shard=None, verify=True)
        assert got.batch_size == expected.batch_size
        for key, value in expected.items():
            assert torch.equal(got[key], value), key


# --- whole reads, planned in columns, against the per-chunk planner ---------------------------------------------


def _random_leaf(rng, world: int, n: int):
    """A leaf of a random kind and shape over ``world`` ranks: sharded along a random dim (uneven, some ranks
    empty), replicated (a random writer), DTensor-like boxes (a grid over two dims, on random ranks), or empty."""
    from tddist.core.sharding import Boxes, Replicate, Shard
    from tddist.manifest.chunks import BoxChunks, ReplicaChunks, ShardChunks
    from tddist.manifest.model import Leaf

    kind = ["shard", "shard", "replicate", "boxes", "empty"][int(rng.integers(5))]
    dtype, itemsize = [("float32", 4), ("int64", 8), ("bool", 1), ("bfloat16", 2)][int(rng.integers(4))]
    ndim = int(rng.integers(1, 4))
    shape = [int(x) for x in rng.integers(1, 4, size=ndim)]
    key = (f"leaf{n}",)
    if kind in ("shard", "empty"):
        dim = int(rng.integers(ndim))
        lengths = rng.integers(0, 3, size=world) * (rng.random(world) < 0.7)
        shape[dim] = int(lengths.sum())
        if kind == "empty":
            shape[(dim + 1) % ndim if ndim > 1 else dim] = 0
            lengths = lengths * 0 if ndim == 1 else lengths
        sums = rng.integers(0, 2**63, size=world).astype(np.uint64)
        table = ShardChunks(tuple(shape), dim, itemsize, lengths.astype(np.int64), sums)
        return Leaf(key, dtype, tuple(shape), Shard(dim), table)
    if kind == "replicate":
        table = ReplicaChunks(tuple(shape), itemsize, int(rng.integers(world)), int(rng.integers(0, 2**63)))
        return Leaf(key, dtype, tuple(shape), Replicate(), table)
    shape = [int(x) for x in rng.integers(2, 9, size=2)] + shape[:1]
    cuts = [np.unique(np.concatenate(([0, s], rng.integers(0, s, size=2)))) for s in shape[:2]]
    offsets, sizes = [], []
    for a0, a1 in zip(cuts[0][:-1], cuts[0][1:]):
        for b0, b1 in zip(cuts[1][:-1], cuts[1][1:]):
            offsets.append([a0, b0, 0])
            sizes.append([a1 - a0, b1 - b0, shape[2]])
    ranks = rng.choice(world, size=len(offsets), replace=False)
    table = BoxChunks(
        itemsize,
        ranks.astype(np.int64),
        np.array(offsets, np.int64),
        np.array(sizes, np.int64),
        rng.integers(0, 2**63, size=len(offsets)).astype(np.uint64),
    )
    return Leaf(key, dtype, tuple(shape), Boxes(), table)


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("packing", ["packed", "memmap"])
def test_whole_plan_matches_the_per_chunk_planner(seed, packing):
    """At 1,000 ranks, seeded random leaves of every kind: ``manifest.whole``'s pieces (rank, chunk, offset in the
    rank's file, bytes, destination) are exactly those of ``plan_reads`` over ``Leaf.overlapping`` with each piece
    located by ``Locator``, leaf by leaf, in any order of the leaves asked for."""
    from tddist.core.sharding import full_box, plan_reads
    from tddist.manifest.locate import Locator, PackedChunks
    from tddist.manifest.model import Manifest
    from tddist.manifest.whole import file_offsets, needed_ranks, plan_whole

    rng = np.random.default_rng(seed)
    world = 1000
    leaves = [_random_leaf(rng, world, n) for n in range(40)]
    m = Manifest(world_size=world, nodes={(): ()}, leaves={lf.key: lf for lf in leaves}, packing=packing)
    placed = file_offsets(m) if packing == "packed" else None
    positions = rng.permutation(len(leaves)).tolist()
    plan = plan_whole(m, positions, placed)
    locator = Locator(m)
    for j, p in enumerate(positions):
        leaf = leaves[p]
        box = full_box(leaf.shape)
        chunks = leaf.overlapping(box)
        item = fmt.dtype_itemsize(leaf.dtype_name)
        strides = [int(np.prod(leaf.shape[d + 1 :])) * item for d in range(len(leaf.shape))]
        want = []
        for piece in plan_reads(box, [c.box for c in chunks]):
            c = chunks[piece.chunk_index]
            assert all(s.start == 0 and s.stop == n for s, n in zip(piece.src, c.box[1]))  # whole chunks
            target = sum(s.start * st for s, st in zip(piece.dst, strides))
            index = leaf.table.index_of_rank(c.rank)
            want.append((c.rank, index, locator.locate(leaf, c).offset, c.nbytes, target))
        rows = plan.rows(j)
        got = list(
            zip(
                plan.ranks[rows].tolist(),
                plan.chunks[rows].tolist(),
                plan.offsets[rows].tolist(),
                plan.nbytes[rows].tolist(),
                plan.targets[rows].tolist(),
            )
        )
        assert sorted(got) == sorted(want), leaf
    if placed is not None:
        every = PackedChunks.of(m)
        assert {r: placed.offsets[-1, r] for r in every.sizes} == every.sizes  # each data file's size
        assert int(placed.offsets[-1].sum()) == sum(every.sizes.values())
        # a few replicated or DTensor leaves need only their writers' offsets: the same ones
        few = [p for p in positions if leaves[p].placement.__class__.__name__ != "Shard"][:3]
        if few:
            some = plan_whole(m, few, file_offsets(m, needed_ranks([leaves[p] for p in few])))
            again = plan_whole(m, few, placed)
            assert np.array_equal(some.offsets, again.offsets) and np.array_equal(some.file_sizes, again.file_sizes)
