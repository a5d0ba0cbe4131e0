"""Rank program for per-rank and Stateful state: ``python tests/stateful_rank.py <workdir> <role>``.

Started by tests/test_stateful.py through ``run_job`` (torchrun). A small
training state as a user writes it: a model, AdamW, a warmup + cosine LR
schedule (``SequentialLR``), a resumable sampler whose position is each
rank's own, and a per-rank RNG (both saved with ``tddist.PerRank()``). The
values after ``s`` steps are fixed formulas (``rng_after``, ``position``),
so any process can check what a rank restored.

Roles (each runs several scenarios in one job and reports per rank):
- ``save`` (2 ranks): trains 3 steps with a manager saving every step;
  then a new manager restores into fresh objects (per-rank round trip),
  ``restore(step=2)``, ``keys=``/``exclude=`` with ``into``, a differing
  non-batched leaf refused on every rank, ``required=True`` on an empty
  root, and the warning for a root that does not exist.
- ``reload`` (3 ranks): the same checkpoint on another world size: the
  default error on every rank, then ``per_rank="drop"``, ``"rank0"`` and a callable.
"""

from __future__ import annotations

import logging
import math
import sys
import traceback
from pathlib import Path
from typing import Any

import torch

import tddist
from tddist.comm.resolve import resolve
from tddist.jobs.manager import CheckpointManager
from tests.launch_util import write_report

STEPS = 3


class RankRng:
    """Each rank's dropout RNG: a generator seeded by rank (Stateful)."""

    def __init__(self, rank: int) -> None:
        self.gen = torch.Generator().manual_seed(1000 + rank)

    def state_dict(self) -> dict[str, Any]:
        return {"gen": self.gen.get_state()}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        self.gen.set_state(sd["gen"])


class Sampler:
    """A resumable sampler: this rank's position in the epoch (Stateful)."""

    def __init__(self, rank: int) -> None:
        self.rank, self.epoch, self.position = rank, 0, 0

    def advance(self) -> None:
        self.position += self.rank + 1

    def state_dict(self) -> dict[str, Any]:
        return {"epoch": self.epoch, "position": self.position, "seen": (self.rank, self.position)}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        assert isinstance(sd["seen"], tuple), sd  # tuples come back as tuples
        self.epoch, self.position = sd["epoch"], sd["position"]


def rng_after(rank: int, steps: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 + rank)
    for _ in range(steps):
        torch.rand(4, generator=g)
    return g.get_state()


def position(rank: int, steps: int) -> int:
    return steps * (rank + 1)


def objects(rank: int) -> dict[str, Any]:
    torch.manual_seed(0)  # the same model on every rank (replicated leaves must be equal)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    optim = torch.optim.AdamW(model.parameters(), lr=0.01)
    warmup = torch.optim.lr_scheduler.LinearLR(optim, start_factor=0.1, total_iters=2)
    cosine = torch.optim.lr_scheduler.CosineAnnealingLR(optim, T_max=10)
    sched = torch.optim.lr_scheduler.SequentialLR(optim, [warmup, cosine], milestones=[2])
    return {"model": model, "optim": optim, "sched": sched, "sampler": Sampler(rank), "rng": RankRng(rank)}


def train_step(state: dict[str, Any], step: int) -> None:
    data = torch.Generator().manual_seed(step)  # the same batch on every rank: the model stays replicated
    x = torch.randn(5, 8, generator=data)
    torch.rand(4, generator=state["rng"].gen)  # this rank's dropout draws
    loss = state["model"](x).square().mean()
    state["optim"].zero_grad()
    loss.backward()
    state["optim"].step()
    state["sched"].step()
    state["sampler"].advance()


PLACEMENTS = {"rng": tddist.PerRank(), "sampler": tddist.PerRank()}


def manager(root: Path, comm: Any, **kw: Any) -> CheckpointManager:
    return CheckpointManager(root, every=1, keep_last=3, comm=comm, preempt_signal=None, **kw)


def same_model(a: dict[str, Any], b: dict[str, Any]) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a["model"].state_dict().values(), b["model"].state_dict().values()))


def role_save(work: Path, comm: Any) -> dict:
    rank = comm.rank
    root = work / "ckpt"
    trained = objects(rank)
    with manager(root, comm, save_kwargs={"placements": PLACEMENTS}) as mgr:
        gathered = []

        def state() -> dict[str, Any]:  # called only on the steps that save
            gathered.append(1)
            return trained

        assert int(mgr.restore(state)) == 0
        for s in range(STEPS):
            train_step(trained, s)
            mgr.step(s + 1, state)
        assert len(gathered) == STEPS, gathered

        # per-rank round trip: a fresh job state gets this rank's own RNG and sampler back
        fresh = objects(rank)
        restored = mgr.restore(fresh)
        assert restored == STEPS and restored.step == STEPS and restored.path == str(root / "step-000000003")
        assert restored.report is not None and not restored.report.skipped, restored.report
        assert torch.equal(fresh["rng"].gen.get_state(), rng_after(rank, STEPS))
        assert fresh["sampler"].position == position(rank, STEPS) == trained["sampler"].position
        assert fresh["sched"].last_epoch == STEPS and fresh["sched"].get_last_lr() == trained["sched"].get_last_lr()
        assert same_model(fresh, trained)
        assert fresh["optim"].state_dict()["state"][0]["step"] == STEPS

        # restore(step=N)
        older = objects(rank)
        at2 = mgr.restore(older, step=2)
        assert at2 == 2 and older["sampler"].position == position(rank, 2)
        assert torch.equal(older["rng"].gen.get_state(), rng_after(rank, 2)) and older["sched"].last_epoch == 2

        # keys= and exclude= with into: only those keys are compared and filled
        path = str(root / "step-000000003")
        target = tddist.get_state(objects(rank))
        before = target["rng", "gen"].clone()
        report = tddist.load(path, comm=comm, into=target, keys=["model"])
        assert report.ok and {k[0] for k in report.loaded} == {"model"}, report
        assert torch.equal(target["rng", "gen"], before)
        target = tddist.get_state(objects(rank))
        report = tddist.load(path, comm=comm, into=target, exclude=["rng", ("optim", "state")])
        assert report.ok and not any(k[0] == "rng" or k[:2] == ("optim", "state") for k in report.loaded), report
        assert report.skipped.get(("rng", "gen")) == "excluded", report.skipped
        assert torch.equal(target["rng", "gen"], before)
        plain = tddist.load(path, comm=comm, exclude=["optim"])
        assert "optim" not in plain.keys() and torch.equal(plain["rng", "gen"], rng_after(rank, STEPS))

    # a non-batched leaf whose value differs by rank is refused on every rank, naming it and PerRank()
    try:
        tddist.save({"step_seed": torch.tensor([rank])}, work / "differs", comm=comm)
        raise AssertionError("a differing replicated leaf was saved")
    except tddist.ShardingError as e:
        assert "'step_seed'" in str(e) and "tddist.PerRank()" in str(e), e
    assert not (work / "differs").exists()

    # required=True on an empty root; a root that does not exist is named in a warning and not created
    empty = work / "empty"
    comm.barrier()
    if rank == 0:
        empty.mkdir()
    comm.barrier()
    with manager(empty, comm) as mgr:
        try:
            mgr.restore(objects(rank), required=True)
            raise AssertionError("required=True restored nothing without raising")
        except tddist.CheckpointNotFoundError as e:
            assert "required=True" in str(e) and str(empty) in str(e), e
    missing = work / "no" / "such-root"
    records: list[logging.LogRecord] = []
    handler = logging.Handler()
    handler.emit = records.append  # type: ignore[method-assign]
    logging.getLogger("tddist").addHandler(handler)
    with manager(missing, comm) as mgr:
        assert mgr.restore(objects(rank)) == 0
    logging.getLogger("tddist").removeHandler(handler)
    warned = [r.getMessage() for r in records if r.levelno >= logging.WARNING and str(missing) in r.getMessage()]
    assert bool(warned) == (rank == 0), records
    assert not missing.exists() and not missing.parent.exists()
    return {"lr": trained["sched"].get_last_lr()[0], "position": trained["sampler"].position}


def role_reload(work: Path, comm: Any) -> dict:
    rank = comm.rank
    root = work / "ckpt"
    out: dict[str, Any] = {}
    with manager(root, comm) as mgr:
        live = objects(rank)
        try:
            mgr.restore(live)
            raise AssertionError("per-rank state loaded on another world size without per_rank=")
        except tddist.IncompatibleCheckpointError as e:
            assert "saved by 2 ranks" in str(e) and "this job has 3 ranks" in str(e), e
            assert "rng/gen" in str(e) and "sampler/position" in str(e) and "per_rank='drop'" in str(e), e
        assert live["sampler"].position == 0  # nothing was applied

        dropped = objects(rank)
        r = mgr.restore(dropped, per_rank="drop")
        assert r == STEPS and {k[0] for k in r.report.skipped} == {"rng", "sampler"}, r.report.skipped
        assert dropped["sampler"].position == 0 and torch.equal(dropped["rng"].gen.get_state(), rng_after(rank, 0))
        assert dropped["sched"].last_epoch == STEPS and not same_model(dropped, objects(rank))
        out["lr"] = dropped["sched"].get_last_lr()[0]

        first = objects(rank)
        mgr.restore(first, per_rank="rank0")
        assert first["sampler"].position == position(0, STEPS)
        assert torch.equal(first["rng"].gen.get_state(), rng_after(0, STEPS))

        seen: list[tuple] = []

        def pick(key: tuple, values: list, r: int, size: int) -> Any:
            seen.append((key, len(values), r, size))
            return values[r % len(values)]

        chosen = objects(rank)
        mgr.restore(chosen, per_rank=pick)
        assert chosen["sampler"].position == position(rank % 2, STEPS)
        assert torch.equal(chosen["rng"].gen.get_state(), rng_after(rank % 2, STEPS))
        assert {s[1:] for s in seen} == {(2, rank, 3)} and ("rng", "gen") in {s[0] for s in seen}, seen
    out["position"] = chosen["sampler"].position
    return out


def main() -> None:
    work, role = Path(sys.argv[1]), sys.argv[2]
    comm = resolve(None)
    try:
        result = {"save": role_save, "reload": role_reload}[role](work, comm)
    except Exception as e:
        write_report(comm.rank, "failed", error=traceback.format_exc(), error_class=type(e).__name__)
        raise
    assert math.isfinite(result["lr"])
    write_report(comm.rank, "ok", **result)


if __name__ == "__main__":
    main()
