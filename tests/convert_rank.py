"""Rank program for conversion tests: ``python tests/convert_rank.py <workdir> <role>``.

Roles:
- ``save`` (2 torchrun ranks): train an FSDP2 model with AdamW for two steps;
  save its state with ``tddist.save`` (``fsdp``) and with ``dcp.save``
  (``dcp``, DCP's default planner and names); rank 0 writes the full state
  (``ref.pt``: ``{"model": ..., "optim": ...}``, full tensors) as the
  reference the converted checkpoints are compared with.
- ``load`` (3 torchrun ranks): ``dcp.load`` the DCP checkpoint that
  ``tddist.convert`` wrote from ``fsdp`` into an FSDP2 model and AdamW on 3
  ranks, through DCP's own state-dict API, and check every tensor and
  hyper-parameter of the full state against ``ref.pt``, bit for bit.
- ``resume`` (3 torchrun ranks): ``CheckpointManager(root).restore((model,
  optim))`` of an FSDP2 model and AdamW, from the checkpoint that
  ``tddist.convert(..., nested=True)`` wrote from ``dcp`` into ``root``, and
  the same check against ``ref.pt``.
"""

from __future__ import annotations

import os
import sys
import traceback
from pathlib import Path

import torch
import torch.distributed as dist

import tddist
from tests.launch_util import write_report


def make_model():
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 10), torch.nn.Tanh(), torch.nn.Linear(10, 5))
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    fully_shard(model[0], mesh=mesh)
    fully_shard(model[2], mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model, torch.optim.AdamW(model.parameters(), lr=0.01, betas=(0.8, 0.95))


def full_state(model, optim) -> dict:
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

    m, o = get_state_dict(model, optim, options=StateDictOptions(full_state_dict=True))  # whole on every rank
    return {"model": m, "optim": o}


def role_save(work: Path, rank: int) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model, optim = make_model()
    for step in range(2):
        optim.zero_grad()
        x = torch.arange(24, dtype=torch.float32).view(4, 6) / (step + 3)
        model(x).square().sum().backward()
        optim.step()
    tddist.save(tddist.get_state(model, optim), work / "fsdp")
    m, o = get_state_dict(model, optim)
    dcp.save({"model": m, "optim": o}, checkpoint_id=str(work / "dcp"))
    ref = full_state(model, optim)
    if rank == 0:
        torch.save(ref, work / "ref.pt")


def role_load(work: Path, rank: int) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    model, optim = make_model()
    m, o = get_state_dict(model, optim)  # sharded over 3 ranks; the optimizer's state initialised
    state = {"model": m, "optim": o}
    dcp.load(state, checkpoint_id=str(work / "export-dcp"))
    set_state_dict(model, optim, model_state_dict=state["model"], optim_state_dict=state["optim"])
    check_against_ref(work, full_state(model, optim))


def role_resume(work: Path, rank: int) -> None:
    model, optim = make_model()
    with tddist.CheckpointManager(work / "root") as mgr:
        step = mgr.restore((model, optim), required=True)
    assert step == 2 and not step.report.skipped, (int(step), step.report.skipped)
    check_against_ref(work, full_state(model, optim))


def check_against_ref(work: Path, got: dict) -> None:
    """Every tensor and hyper-parameter of the full state ``got`` equals ``ref.pt``'s, bit for bit."""
    ref = torch.load(work / "ref.pt", weights_only=True)
    assert got["model"].keys() == ref["model"].keys()
    for k, v in ref["model"].items():
        assert torch.equal(got["model"][k], v), f"model {k}"
    assert got["optim"]["state"].keys() == ref["optim"]["state"].keys()
    for fqn, entries in ref["optim"]["state"].items():
        for name, v in entries.items():
            assert torch.equal(got["optim"]["state"][fqn][name], v), f"optim {fqn} {name}"
    for g, r in zip(got["optim"]["param_groups"], ref["optim"]["param_groups"], strict=True):
        assert {k: list(v) if isinstance(v, tuple) else v for k, v in g.items()} == {
            k: list(v) if isinstance(v, tuple) else v for k, v in r.items()
        }


ROLES = {"save": role_save, "load": role_load, "resume": role_resume}


def main() -> None:
    work, role = Path(sys.argv[1]), sys.argv[2]
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    try:
        ROLES[role](work, rank)
        write_report(rank, "ok")
    except Exception:
        write_report(rank, "failed", error=traceback.format_exc())
        raise
    finally:
        dist.destroy_process_group()
    # Skip the interpreter's teardown: torch's own gloo threads (dcp.load into FSDP2 here; tddist creates no group
    # in this program) have aborted it under load ("terminate called without an active exception"). What this
    # test checks is the report and the exit code of the conversion's work, written above; tddist's own clean exit
    # is what tests/test_exit.py checks.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
