"""Resharding on real processes: save on 4 torchrun ranks (and 3 mpiexec ranks),
load on 1, 2, 3 and 5 torchrun ranks. See tests/reshard_rank.py for what each
job checks, including the bit-exact FSDP2 resume."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import tddist
from tests.helpers import assert_td_equal
from tests.launch_util import run_job
from tests.reshard_rank import global_batch

SCRIPT = Path(__file__).with_name("reshard_rank.py")
pytestmark = pytest.mark.multirank


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> Path:
    work = tmp_path_factory.mktemp("reshard")
    run_job("torchrun", 4, SCRIPT, [str(work), "save"], work / "reports-save", timeout=240).assert_ok(4)
    run_job("mpiexec", 3, SCRIPT, [str(work), "mpisave"], work / "reports-mpi", timeout=120).assert_ok(3)
    return work


@pytest.mark.parametrize("world", [1, 2, 3, 5])
def test_load_on_other_world_size(saved: Path, world: int) -> None:
    job = run_job("torchrun", world, SCRIPT, [str(saved), "load"], saved / f"reports-load{world}", timeout=240)
    job.assert_ok(world)
    for r in range(world):  # every rank checked every source, none was passed over
        assert job.reports[r]["checked"] == ["batch", "mpi3", "dt", "fsdp"], (r, job.reports[r])
    if world == 1:
        expected = global_batch(4, 0)
        parts = tddist.run_threads(3, lambda c: tddist.load(saved / "w1.tdz", comm=c, verify=True), timeout=60)
        assert_td_equal(torch.cat(parts), expected, "w1.tdz loaded on 3 thread ranks")
