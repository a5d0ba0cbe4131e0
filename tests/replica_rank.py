"""Rank program of the replicated node-local tier's multi-node test: ``python tests/replica_rank.py <work> <role> <step>``.

Started by tests/test_replicas.py under torchrun agents that play separate
nodes on 127.0.0.1 (each with its own ``--node-rank`` and node-local
directory, ``REPLICA_LOCAL``). The state is tests/manager_rank.py's (plain
row-sharded tensors and a replicated counter) plus DTensors on a 1-D mesh
over the world (``fsdp``: Shard(0) parameters with their Adam state, as FSDP2
makes them, a Shard(1) leaf and a Replicate one, with dimensions that 4 and 2
ranks do not divide evenly): its value after ``s`` steps is known on any
world size, so every restore is checked bit for bit.

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
import math
import os
import sys
import time
import traceback
from pathlib import Path

import torch
from tensordict import TensorDict

from tddist.comm.resolve import resolve
from tddist.jobs.manager import CheckpointManager
from tests.launch_util import write_report
from tests.manager_rank import check, local_state, train


def full_dtensors(step: int) -> dict[str, torch.Tensor]:
    """The global values of the DTensor leaves after ``step`` training steps."""
    base = {"w": (9, 5), "w_exp_avg": (9, 5), "w_exp_avg_sq": (9, 5), "v": (3, 7), "bias": (6,)}
    out = {}
    for i, (name, shape) in enumerate(base.items()):
        out[name] = torch.arange(math.prod(shape), dtype=torch.float32).view(shape) * 0.37 + i + step
    return out


def mixed_state(rank: int, world: int, step: int) -> TensorDict:
    """The plain state of tests/manager_rank.py and, under ``fsdp``, DTensors on a 1-D mesh of ``world`` ranks."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world,))
    placements = {"v": Shard(1), "bias": Replicate()}
    fsdp = {k: distribute_tensor(v, mesh, [placements.get(k, Shard(0))]) for k, v in full_dtensors(step).items()}
    state = local_state(rank, world, step)
    state["fsdp"] = TensorDict(fsdp, batch_size=[])
    state["fsdp", "step"] = torch.tensor(float(step))  # Adam's step: a plain tensor among the DTensors
    return state


def train_mixed(state: TensorDict) -> None:
    train(state)
    for value in state["fsdp"].values():
        value.add_(1)


def check_mixed(state: TensorDict, rank: int, world: int, step: int) -> None:
    """``state`` is that of ``step``, bit for bit: the plain leaves, and each DTensor gathered whole (collective)."""
    check(state.exclude("fsdp"), rank, world, step)
    assert torch.equal(state["fsdp", "step"], torch.tensor(float(step))), f"rank {rank}: Adam's step"
    for name, want in full_dtensors(step).items():
        got = state["fsdp", name].full_tensor()
        assert torch.equal(got, want), f"rank {rank}: DTensor {name} of step {step} differs after the restore"


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
        state = mixed_state(rank, world, 0)
        got = mgr.restore(state)
        if role == "train":
            for s in range(got, step):
                train_mixed(state)
                mgr.step(s + 1, state)
            mgr.wait()
            write_report(rank, "ok", step=step)
            time.sleep(3600)  # until the test kills this node
        check_mixed(state, rank, world, step)
        write_report(rank, "ok", step=int(got), tier=got.tier)
        if role == "restore-then-crash":
            os.environ["TDDIST_FAULT_THREAD"] = "tddist-"
            os.environ["TDDIST_FAULT"] = ",".join(["replica.chunk:1:kill"] + [f"begin:{r}:delay" for r in range(world)])
            train_mixed(state)
            mgr.step(step + 1, state)
            mgr.wait()
            time.sleep(3600)  # rank 1 is dead: the test kills what is left
        mgr.close()
    except BaseException as e:
        write_report(rank, "error", error=f"{type(e).__name__}: {e}", tb=traceback.format_exc())
        raise


if __name__ == "__main__":
    main()
