"""A small training job that checkpoints with ``tddist.CheckpointManager``, survives preemption and resumes.

A two-layer MLP learns a fixed random linear map with Adam, on CPU. Under
several ranks the model is sharded with FSDP2 (gloo); alone it is a plain
module. The batch of step ``s`` depends only on ``s``, so a resumed run sees
the data an uninterrupted one would. Launch it with:

    python launch/train.py --ckpt ckpt/train --steps 200        # one process
    NPROC=4 bash launch/torchrun.sh --ckpt ckpt/train            # torchrun --standalone
    NPROC=4 bash launch/mpiexec.sh --ckpt ckpt/train             # mpiexec ... python -m mpi4py
    bash launch/multinode.sh ...                                 # torchrun over several nodes
    sbatch slurm/torchrun.sbatch ...                             # SLURM, see slurm/README.md

Each launch resumes from the newest checkpoint under ``--ckpt``, on any
number of ranks. On the preemption signal (``--preempt-signal``, default
SIGUSR1) every rank saves at the same step and the job exits with status
``tddist.EXIT_PREEMPTED`` (75). Rank 0 prints ``saved step=S
digest=D`` after each save and ``resumed step=S digest=D`` after a restore;
the digest is a SHA-256 of the whole model and optimizer state.
"""

from __future__ import annotations

import argparse
import hashlib
import logging
import os
import socket
import sys
import time

import torch
import torch.distributed as dist

import tddist
from tddist import EXIT_PREEMPTED, CheckpointManager

DIM, HIDDEN, BATCH = 16, 32, 64


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ckpt", default="ckpt/train", help="checkpoint root (default: %(default)s)")
    p.add_argument("--steps", type=int, default=200, help="train until this step (default: %(default)s)")
    p.add_argument("--every", type=int, default=20, help="save every N steps (default: %(default)s)")
    p.add_argument("--keep", type=int, default=3, help="checkpoints kept (default: %(default)s)")
    p.add_argument("--async-save", action="store_true", help="save in the background (return_early=True)")
    p.add_argument(
        "--local-dir",
        default=None,
        help="node-local storage ({rank}: the rank): save there first, promote to --ckpt in the background",
    )
    p.add_argument("--step-time", type=float, default=0.0, help="extra seconds per step, to stand in for a real model")
    p.add_argument(
        "--preempt-signal", default="USR1", help="signal(s) that request a save and stop (default: %(default)s)"
    )
    p.add_argument("--log-every", type=int, default=10, help="print the loss every N steps (default: %(default)s)")
    p.add_argument("--verbose", action="store_true", help="log every save and its duration (tddist at INFO level)")
    return p.parse_args()


def under_mpi() -> bool:
    """True when started by an MPI launcher (and not by torchrun)."""
    return "RANK" not in os.environ and any(v in os.environ for v in ("PMI_RANK", "OMPI_COMM_WORLD_RANK", "PMIX_RANK"))


def init_distributed():
    """Start torch.distributed (gloo) if there are several ranks; return the communicator for tddist.

    torchrun (or any launcher setting RANK/WORLD_SIZE/MASTER_ADDR/MASTER_PORT):
    the environment. MPI: rank 0 picks an address and port and broadcasts
    them, and tddist uses the MPI communicator itself.
    """
    if under_mpi():
        from mpi4py import MPI

        world = MPI.COMM_WORLD
        if world.Get_size() == 1:
            return world
        where = None
        if world.Get_rank() == 0:
            with socket.socket() as s:
                s.bind(("", 0))
                port = s.getsockname()[1]
            where = (os.environ.get("MASTER_ADDR", socket.gethostname()), int(os.environ.get("MASTER_PORT", port)))
        addr, port = world.bcast(where, root=0)
        dist.init_process_group(
            "gloo", init_method=f"tcp://{addr}:{port}", rank=world.Get_rank(), world_size=world.Get_size()
        )
        return world
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        dist.init_process_group("gloo")
    return None


class MLP(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = torch.nn.Linear(DIM, HIDDEN)
        self.fc2 = torch.nn.Linear(HIDDEN, DIM)

    def forward(self, x):
        return self.fc2(torch.relu(self.fc1(x)))


def build(world: int):
    """The model (FSDP2 over all ranks when there are several) and its optimizer, seeded identically everywhere."""
    torch.manual_seed(0)
    model = MLP()
    if world > 1:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh("cpu", (world,))
        fully_shard(model.fc1, mesh=mesh)
        fully_shard(model.fc2, mesh=mesh)
        fully_shard(model, mesh=mesh)
    return model, torch.optim.Adam(model.parameters(), lr=1e-2)


def batch(step: int, rank: int, world: int) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's rows of the global batch of ``step`` (inputs, targets)."""
    gen = torch.Generator().manual_seed(1000 + step)
    x = torch.randn(BATCH, DIM, generator=gen)
    target_map = torch.randn(DIM, DIM, generator=torch.Generator().manual_seed(7)) / DIM**0.5
    rows = torch.tensor_split(torch.arange(BATCH), world)[rank]
    return x[rows], (x @ target_map)[rows]


def train_step(model, optim, step: int, rank: int, world: int) -> float:
    x, y = batch(step, rank, world)
    optim.zero_grad()
    loss = torch.nn.functional.mse_loss(model(x), y)
    loss.backward()
    optim.step()
    return float(loss.detach())


def digest(model, optim) -> str:
    """SHA-256 of every tensor of the model and optimizer state, gathered whole (collective)."""
    h = hashlib.sha256()
    state = tddist.get_state(model, optim)
    for key in sorted(state.keys(include_nested=True, leaves_only=True), key=str):
        value = state.get(key)
        if isinstance(value, torch.Tensor):
            full = value.full_tensor() if hasattr(value, "full_tensor") else value
            h.update(str(key).encode())
            h.update(full.detach().reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()[:16]


def print_line(text: str) -> None:
    """Print ``text`` and its newline in one write, flushed: the ranks share one output file (a job's log), and
    ``print`` writes the newline separately, so another rank's line could land between the two."""
    sys.stdout.write(text + "\n")
    sys.stdout.flush()


def main() -> int:
    args = parse_args()
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    if args.verbose:
        logging.getLogger("tddist").setLevel(logging.INFO)
    comm = init_distributed()
    rank = dist.get_rank() if dist.is_initialized() else 0
    world = dist.get_world_size() if dist.is_initialized() else 1
    say = print_line if rank == 0 else (lambda *a, **k: None)
    model, optim = build(world)
    state = (model, optim)
    mgr = CheckpointManager(
        args.ckpt,
        every=args.every,
        keep_last=args.keep,
        async_save=args.async_save,
        comm=comm,
        preempt_signal=args.preempt_signal,
        local_dir=args.local_dir,
    )
    start = mgr.restore(state)
    say(
        f"train: {world} rank(s), {'MPI' if under_mpi() else 'torch'} launch, steps {start}..{args.steps}, checkpoints in {mgr.root}"
    )
    if start:
        say(f"resumed step={start} digest={digest(model, optim)}")
    code, at, saved = 0, start, start
    for step in range(start, args.steps):
        loss = train_step(model, optim, step, rank, world)
        time.sleep(args.step_time)
        at = step + 1
        if at % args.log_every == 0:
            say(f"step={at} loss={loss:.5f}")
        if mgr.step(at, state):
            saved = at
            say(f"saved step={at} digest={digest(model, optim)}")
        if mgr.should_stop:
            say(f"preempted at step={at}: exiting with {EXIT_PREEMPTED}")
            code = EXIT_PREEMPTED
            break
    else:
        if saved != at:
            mgr.save(at, state)
        mgr.wait()
        say(f"done step={at} digest={digest(model, optim)}")
    mgr.close()
    print_line(f"rank {rank}/{world}: exit {code} at step={at}")
    if dist.is_initialized():
        dist.destroy_process_group()
    if comm is not None:  # MPI: finalize, so that the exit status is not turned into an abort
        from mpi4py import MPI

        MPI.Finalize()
    return code


if __name__ == "__main__":
    sys.exit(main())
