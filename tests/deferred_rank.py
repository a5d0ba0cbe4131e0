"""Rank program for deferred snapshots of DTensor leaves: ``torchrun ... tests/deferred_rank.py <workdir>``.

Both scenarios run in the same ranks (gloo, a CPU device mesh over every
rank); each rank writes a report through ``tests.launch_util.write_report``:

- a DTensor leaf changed on rank 0 while the copy is held (no guard): every
  rank's save fails with ``SnapshotChangedError``, and nothing is committed;
- DTensor parameters and their Adam state, guarded: saved deferred, trained
  on (the step releases the held copy and waits for it), loaded back and
  compared bit for bit with the state at the save.
"""

from __future__ import annotations

import sys
import threading
import traceback
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard, distribute_tensor

import tddist
from tddist.saving import deferred
from tests.launch_util import write_report


def _held() -> threading.Event:
    go = threading.Event()
    deferred.copy_hooks.append(lambda _keys: go.wait(60))
    return go


def scenario_changed_dtensor_refused(work: Path, mesh) -> None:
    d = distribute_tensor(torch.arange(64 * 256, dtype=torch.float32).view(64, 256), mesh, [Shard(0)])
    go = _held()
    try:
        fut = tddist.save({"d": d}, work / "refused", return_early=True, snapshot="deferred")
        if dist.get_rank() == 0:
            d.add_(1.0)  # an in-place change of the DTensor, before its copy
        dist.barrier()
        go.set()
        try:
            fut.result(60)
        except tddist.SnapshotChangedError as e:
            assert sorted(e.failures) == [0], e.failures
        else:
            raise AssertionError("a DTensor changed during its copy was committed")
    finally:
        deferred.copy_hooks.clear()
    dist.barrier()
    assert not (work / "refused").exists(), "a refused save committed"


def _step(w: torch.nn.Parameter, opt: torch.optim.Optimizer) -> None:
    loss = (w * w).sum()
    opt.zero_grad()
    loss.backward()
    opt.step()


def scenario_guarded_dtensor_training(work: Path, mesh) -> None:
    torch.manual_seed(0)
    w = torch.nn.Parameter(distribute_tensor(torch.randn(256, 256), mesh, [Shard(0)]))
    opt = torch.optim.Adam([w], lr=1e-2)
    _step(w, opt)

    def state() -> dict:
        st = opt.state[w]
        return {"w": w.detach(), "exp_avg": st["exp_avg"], "exp_avg_sq": st["exp_avg_sq"]}

    saved = {k: v.to_local().clone() for k, v in state().items()}
    assert not deferred.eager_keys({k: v.to_local() for k, v in state().items()}, [opt]), "all guarded: deferred"
    go = _held()
    handle = opt.register_step_pre_hook(lambda *_a: go.set())  # before tddist's hook, which then waits
    try:
        fut = tddist.save(state(), work / "guarded", return_early=True, snapshot="deferred", guard=opt)
        for _ in range(3):
            _step(w, opt)
        fut.result(60)
    finally:
        handle.remove()
        deferred.copy_hooks.clear()
    assert not torch.equal(w.to_local(), saved["w"]), "training did not go on"
    into = {k: distribute_tensor(torch.zeros(256, 256), mesh, [Shard(0)]) for k in saved}
    tddist.load(work / "guarded", into=into)
    for k, v in saved.items():
        assert torch.equal(into[k].to_local(), v), f"rank {dist.get_rank()}: {k} differs from the saved step"


def main() -> None:
    work = Path(sys.argv[1])
    dist.init_process_group("gloo")
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    failures = {}
    for scenario in (scenario_changed_dtensor_refused, scenario_guarded_dtensor_training):
        dist.barrier()
        try:
            scenario(work, mesh)
        except Exception:
            failures[scenario.__name__] = traceback.format_exc()
    write_report(dist.get_rank(), "failed" if failures else "ok", failures=failures)


if __name__ == "__main__":
    main()
