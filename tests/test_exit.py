"""Finished jobs exit cleanly: no rank aborts (SIGABRT) at interpreter exit, whoever created the process group.

A gloo group still referenced when the interpreter tears down can abort a
rank whose peers exited first ("terminate called without an active
exception"); torchrun then reports the whole job as failed. tddist destroys
its own groups, and the default group when it created it, at exit
(``comm_torch.release_groups``). Every rank's exit code is checked.
``scripts/exit_campaign.py`` runs the same jobs many times (100 per mode).
"""

from __future__ import annotations

import os

import pytest

import tddist
from tests.launch_util import REPO, run_job

MODES = ["user-destroy", "user-keep", "tddist-init", "async"]


@pytest.mark.multirank
@pytest.mark.parametrize("mode", MODES)
def test_four_ranks_exit_cleanly(tmp_path, mode):
    job = run_job("spawn", 4, REPO / "tests" / "exit_rank.py", [mode, str(tmp_path)], tmp_path / "reports")
    assert job.returncodes == [0, 0, 0, 0], f"exit codes {job.returncodes} (-6: SIGABRT at exit)\n{job.output[-4000:]}"
    assert "terminate called" not in job.output
    job.assert_ok(4)
    if mode == "async":  # the save in flight at exit committed, and the checkpoint it replaced is gone
        assert [n for n in os.listdir(tmp_path) if "tddist" in n] == [], os.listdir(tmp_path)
        saved = tddist.load(tmp_path / "ckpt", shard=None, verify=True)["a"]
        assert int(saved[0, 1]) == 2 and int(saved[-1, -1]) == 2 * (63 + 3)
