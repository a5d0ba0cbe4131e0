"""Rank program of the replicated node-local tier's multi-node test: ``python tests/replica_rank.py <work> <role> <step>``.

Started by tests/test_replicas.py under torchrun agents that play separate
nodes on 127.0.0.1 (each with its own ``--node-rank`` and node-local
directory, ``REPLICA_LOCAL``). The state is tests/manager_rank.py's: its
value after ``s`` steps is known on any world size, so every restore is
checked bit for bit.

Roles:
- ``train`` (every=1, keep_last=2, replicas=1): trains to ``<step>``, waits
  for the replication and promotion, reports, then sleeps until the test
  kills its node.
- ``restore``: restores, checks the state is that of ``<step>``, reports the
  step and tier.
- ``restore-then-crash``: as ``restore``, then saves step ``<step> + 1``
  with rank 1 SIGKILLed while it receives a peer's replica (and every
  promotion held back a second so that none commits first).
"""

from __future__ import annotations

import logging
import os
import sys
import time
import traceback
from pathlib import Path

from tddist.comm.resolve import resolve
from tddist.jobs.manager import CheckpointManager
from tests.launch_util import write_report
from tests.manager_rank import check, local_state, train


def main() -> None:
    work, role, step = Path(sys.argv[1]), sys.argv[2], int(sys.argv[3])
    logging.basicConfig(level=logging.WARNING, format="%(name)s: %(message)s")
    comm = resolve(None)
    rank, world = comm.rank, comm.size
    try:
        mgr = CheckpointManager(
            work / "shared", every=1, keep_last=2, comm=comm, local_dir=os.environ["REPLICA_LOCAL"],
            preempt_signal=None, replicas=1,
        )  # fmt: skip
        state = local_state(rank, world, 0)
        got = mgr.restore(state)
        if role == "train":
            for s in range(got, step):
                train(state)
                mgr.step(s + 1, state)
            mgr.wait()
            write_report(rank, "ok", step=step)
            time.sleep(3600)  # until the test kills this node
        check(state, rank, world, step)
        write_report(rank, "ok", step=int(got), tier=got.tier)
        if role == "restore-then-crash":
            os.environ["TDDIST_FAULT_THREAD"] = "tddist-"
            os.environ["TDDIST_FAULT"] = ",".join(["replica.chunk:1:kill"] + [f"begin:{r}:delay" for r in range(world)])
            train(state)
            mgr.step(step + 1, state)
            mgr.wait()
            time.sleep(3600)  # rank 1 is dead: the test kills what is left
        mgr.close()
    except BaseException as e:
        write_report(rank, "error", error=f"{type(e).__name__}: {e}", tb=traceback.format_exc())
        raise


if __name__ == "__main__":
    main()
