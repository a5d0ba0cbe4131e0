"""A real job at a scale where per-leaf work shows: 8 ranks x 5,000 small leaves.

Saved by 8 torchrun ranks and by 8 mpiexec ranks (oversubscribed on a small
machine), loaded on 3 torchrun ranks (their even shares) and whole in this
process, bit for bit, with checksums verified. The default layout keeps a few
files per rank: the manifest, its index and one data file per rank.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

import tddist
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
        assert m.world_size == 8 and m.version == 3 and m.packing == "packed"
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
