"""Rank program for resharding tests: ``python tests/reshard_rank.py <workdir> <role>``.

Roles:
- ``save``: (4 torchrun ranks) save a batch-sharded TensorDict, DTensors on a
  1-D mesh of 4 and on a 2x2 mesh, and an FSDP2 training run: its state at
  step K and, after continuing to step N, its final state.
- ``mpisave``: (3 mpiexec ranks) save a batch-sharded TensorDict.
- ``load``: (any number of torchrun ranks) load all of the above on this world
  size and check every value; resume the FSDP2 run from step K (FSDP2 on this
  world size, or a plain model on one rank), train to step N and check that
  parameters and optimizer state equal the uninterrupted run's bit for bit.

The training is chosen so that its arithmetic does not depend on the world
size: every rank sees the same integer-valued batch and the model is linear,
so the gradients are small integers whose reduction is exact, and Adam then
updates each element independently.
"""

from __future__ import annotations

import sys
import traceback
from pathlib import Path

import torch
import torch.distributed as dist
from tensordict import TensorDict

import tddist
from tddist.comm.resolve import resolve
from tests.helpers import assert_td_equal
from tests.launch_util import write_report

K_STEPS, N_STEPS = 3, 6
GLOBAL = torch.arange(9 * 10, dtype=torch.float32).view(9, 10)


def batch_rows(rank: int) -> int:
    return [5, 0, 3, 6][rank] if rank < 4 else 2


def batch_td(rank: int, offset: int) -> TensorDict:
    n = batch_rows(rank)
    start = sum(batch_rows(r) for r in range(rank))
    idx = torch.arange(start, start + n)
    return TensorDict(
        obs=(idx[:, None] * 10 + torch.arange(4)).float() + offset,
        nested=TensorDict(flag=(idx % 2 == 0), val=idx.to(torch.int16), batch_size=[n]),
        batch_size=[n],
    )


def global_batch(world: int, offset: int) -> TensorDict:
    return torch.cat([batch_td(r, offset) for r in range(world)])


class Model(torch.nn.Module):
    """Two linear maps of the same input: gradients are independent of the weights."""

    def __init__(self):
        super().__init__()
        self.a = torch.nn.Linear(5, 7)
        self.b = torch.nn.Linear(5, 3)

    def forward(self, x):
        return self.a(x).sum() + self.b(x).sum()


def batch_for_step(step: int) -> torch.Tensor:
    return (torch.arange(20, dtype=torch.float32).view(4, 5) % (step + 2)) - 1


def make_model(seed: int, fsdp: bool):
    torch.manual_seed(seed)
    model = Model()
    if fsdp:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh("cpu", (dist.get_world_size(),))
        fully_shard(model.a, mesh=mesh)
        fully_shard(model.b, mesh=mesh)
        fully_shard(model, mesh=mesh)
    optim = torch.optim.Adam(model.parameters(), lr=0.05)
    return model, optim


def train(model, optim, first: int, last: int) -> None:
    for step in range(first, last):
        optim.zero_grad()
        model(batch_for_step(step)).backward()
        optim.step()


def role_save(work: Path, rank: int, world: int) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    tddist.save(batch_td(rank, 0), work / "batch")
    tddist.save(batch_td(rank, 0), work / "batch.tdz", num_threads=2)
    mesh = init_device_mesh("cpu", (world,))
    mesh2 = init_device_mesh("cpu", (2, 2))
    dts = {
        "s0": distribute_tensor(GLOBAL, mesh, [Shard(0)]),
        "s1": distribute_tensor(GLOBAL, mesh, [Shard(1)]),
        "rep": distribute_tensor(GLOBAL, mesh, [Replicate()]),
        "grid": distribute_tensor(GLOBAL, mesh2, [Shard(0), Shard(1)]),
        "mixed": distribute_tensor(GLOBAL, mesh2, [Replicate(), Shard(0)]),
    }
    tddist.save(dts, work / "dt")
    m = tddist.read_manifest(work / "dt")
    assert len(m.leaves[("rep",)].chunks) == 1, "a replicated DTensor was written more than once"
    assert len(m.leaves[("mixed",)].chunks) == 2, "replicas along a mesh dim were written more than once"

    model, optim = make_model(0, fsdp=True)
    train(model, optim, 0, K_STEPS)
    tddist.save(tddist.get_state(model, optim), work / "fsdp-k", metadata={"step": K_STEPS})
    train(model, optim, K_STEPS, N_STEPS)
    tddist.save(tddist.get_state(model, optim), work / "fsdp-final", metadata={"step": N_STEPS})


def role_mpisave(work: Path, rank: int, world: int) -> None:
    tddist.save(batch_td(rank, 1000), work / "mpi3")
    tddist.save(batch_td(rank, 1000), work / "mpi3.tdz", compression="deflate")


def _check_state_equals(state: TensorDict, path: Path, what: str) -> None:
    """``state`` (its DTensors gathered, collectively) is the checkpoint's global TensorDict, bit for bit."""
    assert_td_equal(state, tddist.load(path, shard=None), what)


def role_load(work: Path, rank: int, world: int) -> dict:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    # batch-sharded TensorDict saved on 4 ranks (uneven, one empty), and on 3 MPI ranks
    checked = []
    for name, saved_world, offset in (("batch", 4, 0), ("mpi3", 3, 1000)):
        if not (work / name).exists():  # the save jobs write both: a missing one is an error, never a skip
            raise FileNotFoundError(f"rank {rank}: source checkpoint {work / name} is missing; did its save job run?")
        expected = global_batch(saved_world, offset)
        mine = tddist.load(work / name)
        part = torch.tensor_split(torch.arange(expected.batch_size[0]), world)[rank]
        assert_td_equal(mine, expected[part], f"{name}: even share on {world} ranks")
        counts = [expected.batch_size[0] - (world - 1)] + [1] * (world - 1)
        by_counts = tddist.load(work / name, shard=counts)
        start = sum(counts[:rank])
        assert_td_equal(by_counts, expected[start : start + counts[rank]], f"{name}: shard=counts")
        from_archive = tddist.load(work / f"{name}.tdz", verify=True)
        assert_td_equal(from_archive, mine, f"{name}.tdz vs the directory checkpoint on {world} ranks")
        checked.append(name)
    if world == 1:  # an archive written by a single torchrun rank, read back by the test on other world sizes
        tddist.save(global_batch(4, 0), work / "w1.tdz")

    # DTensors onto a 1-D mesh of this world size, other placements than saved
    mesh = init_device_mesh("cpu", (world,))
    target = {
        "s0": distribute_tensor(torch.zeros_like(GLOBAL), mesh, [Shard(1)]),
        "s1": distribute_tensor(torch.zeros_like(GLOBAL), mesh, [Shard(0)]),
        "rep": distribute_tensor(torch.zeros_like(GLOBAL), mesh, [Shard(0)]),
        "grid": distribute_tensor(torch.zeros_like(GLOBAL), mesh, [Replicate()]),
        "mixed": distribute_tensor(torch.zeros_like(GLOBAL), mesh, [Shard(1)]),
    }
    report = tddist.load(work / "dt", into=target)
    assert report.ok and len(report.loaded) == 5, report
    for key, d in target.items():
        assert torch.equal(d.full_tensor(), GLOBAL), f"DTensor {key} differs after resharding to {world} ranks"
    checked.append("dt")

    # FSDP2 resume: 4 ranks -> this world size (a plain model on one rank)
    fsdp = world > 1
    model, optim = make_model(seed=123, fsdp=fsdp)
    state = tddist.get_state(model, optim)
    report = tddist.load(work / "fsdp-k", into=state)
    assert report.ok, report
    tddist.set_state(model, optim, state)
    assert tddist.read_manifest(work / "fsdp-k").metadata["step"] == K_STEPS
    _check_state_equals(tddist.get_state(model, optim), work / "fsdp-k", "state right after resume")
    train(model, optim, K_STEPS, N_STEPS)
    _check_state_equals(tddist.get_state(model, optim), work / "fsdp-final", "state after continuing")
    checked.append("fsdp")
    return {"checked": checked}


ROLES = {"save": role_save, "mpisave": role_mpisave, "load": role_load}


def main() -> None:
    work, role = Path(sys.argv[1]), sys.argv[2]
    if role == "mpisave":
        comm = resolve(None)
        rank, world = comm.rank, comm.size
    else:
        dist.init_process_group("gloo")
        rank, world = dist.get_rank(), dist.get_world_size()
    try:
        result = ROLES[role](work, rank, world) or {}
        write_report(rank, "ok", **result)
    except Exception:
        write_report(rank, "failed", error=traceback.format_exc())
        raise


if __name__ == "__main__":
    main()
