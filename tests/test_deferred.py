"""Deferred snapshots (``save(return_early=True, snapshot="deferred")``): the copy runs after ``save`` returned.

Every change during the copy is made deterministic with the copy hooks of
``tddist.saving.deferred``: the copy is held before its first slot until the
test has changed a leaf (without the guard: the save must be refused on every
rank, nothing committed) or until an optimizer step asks for it (with the
guard: the step waits, and the checkpoint is bit for bit the state at the
save). DTensor leaves and real ranks: ``tests/deferred_rank.py``; CUDA:
``test_cuda_side_stream_pinned_and_guarded``.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch
from tensordict import TensorDict

import tddist
from tddist.saving import deferred
from tddist.saving.background import channel
from tddist.saving.snapshot import SnapshotBuffers
from tests.helpers import assert_td_equal, leftovers, missing
from tests.launch_util import run_job

SCRIPT = Path(__file__).with_name("deferred_rank.py")


@contextmanager
def held_copy() -> Iterator[threading.Event]:
    """The copy of a deferred save waits before its first slot until the event is set."""
    go = threading.Event()

    def hook(_keys: list) -> None:
        go.wait(60)

    deferred.copy_hooks.append(hook)
    try:
        yield go
    finally:
        go.set()
        deferred.copy_hooks.remove(hook)


def _model(device: str = "cpu") -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.BatchNorm1d(128), torch.nn.Linear(128, 8)).to(device)
    return m, torch.optim.Adam(m.parameters(), lr=1e-2)


def _train(m: torch.nn.Module, opt: torch.optim.Optimizer, steps: int = 1) -> None:
    for _ in range(steps):
        x = torch.randn(16, 64, device=next(m.parameters()).device)
        loss = m(x).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()


def _tensors(td: TensorDict) -> TensorDict:
    """The tensor leaves of a state (non-tensor values left out), cloned."""
    flat = {k: v for k, v in td.flatten_keys(".").items() if type(v) is torch.Tensor}
    return TensorDict({k: v.detach().clone() for k, v in flat.items()}, batch_size=[])


def _leaf(kind: str, m: torch.nn.Module, opt: torch.optim.Optimizer) -> torch.Tensor:
    """A tensor of ``kind`` in the trained state: what the test changes in place during the copy."""
    if kind == "parameter":
        return m[0].weight
    if kind == "optimizer state":
        return opt.state[m[0].weight]["exp_avg"]
    return m[1].running_mean  # a buffer


@pytest.mark.parametrize("kind", ["parameter", "optimizer state", "buffer"])
def test_a_leaf_changed_during_its_copy_is_refused_without_the_guard(tmp_path: Path, kind: str) -> None:
    m, opt = _model()
    _train(m, opt)
    with held_copy() as go:
        state = tddist.get_state(m, opt)
        fut = tddist.save(state, tmp_path / "ck", return_early=True, snapshot="deferred", guard=[])
        with torch.no_grad():
            _leaf(kind, m, opt).add_(1.0)  # the copy has not copied it yet: the snapshot would hold the change
        go.set()
        with pytest.raises(tddist.SnapshotChangedError, match="changed while the deferred snapshot copied it"):
            fut.result(60)
    assert not (tmp_path / "ck").exists(), "a refused save committed"
    assert leftovers(tmp_path / "ck") == []


def test_with_the_guard_a_step_waits_for_the_copy_and_the_checkpoint_is_the_saved_step(tmp_path: Path) -> None:
    """Train, save deferred, keep training (forward changes BatchNorm's buffers, the step waits for the copy),
    restore, compare bit for bit with the state at the save's step; no save refused."""
    m, opt = _model()
    _train(m, opt, 2)
    saved = _tensors(tddist.get_state(m, opt))
    order: list[str] = []
    with held_copy() as go:

        def first(_opt, _args, _kwargs) -> None:  # registered before tddist's hook: runs before it waits
            order.append("step asked")
            go.set()

        handle = opt.register_step_pre_hook(first)
        with tddist.CheckpointManager(tmp_path / "root", async_save="deferred") as mgr:
            mgr.save(1, (m, opt))
            order.append("save returned")
            _train(m, opt, 3)  # forward changes the running statistics; the first step waits for the copy
            mgr.wait()
        handle.remove()
    assert order[:2] == ["save returned", "step asked"]
    after = _tensors(tddist.get_state(m, opt))
    assert not torch.equal(after["model.0.weight"], saved["model.0.weight"]), "training did not go on"
    m2, opt2 = _model()
    _train(m2, opt2)  # the optimizer's state exists, to be filled
    with tddist.CheckpointManager(tmp_path / "root") as mgr:
        assert mgr.restore((m2, opt2)).step == 1
    assert_td_equal(_tensors(tddist.get_state(m2, opt2)), saved, "the restored state")


def test_get_state_s_optimizer_guards_a_deferred_save_by_default(tmp_path: Path) -> None:
    """``save(get_state(m, opt), snapshot="deferred")`` without ``guard=``: the optimizer get_state saw guards
    it (its step waits for the held copy; the buffer forward changes was copied eagerly), another model's
    optimizer does not, and the checkpoint is the saved step bit for bit."""
    m, opt = _model()
    other, other_opt = _model()
    _train(m, opt, 2)
    _train(other, other_opt)
    tddist.get_state(other, other_opt)  # seen too, but it changes none of the saved leaves
    state = tddist.get_state(m, opt)
    leaves = {k: v for k, v in state.flatten_keys(".").items() if isinstance(v, torch.Tensor)}
    assert deferred.seen_guarding(leaves) == (opt,)
    saved = _tensors(state)
    waited: list[bool] = []
    with held_copy() as go:
        fut = tddist.save(state, tmp_path / "ck", return_early=True, snapshot="deferred")
        threading.Timer(0.2, go.set).start()
        _train(m, opt)  # forward changes BatchNorm's running statistics at once; the step waits for the copy
        waited.append(go.is_set())
        fut.result(60)
    assert waited == [True], "the step ran before the copy it changes was done"
    assert_td_equal(_tensors(tddist.load(tmp_path / "ck", shard=None)), saved, "the checkpoint")


def test_wait_snapshot_lets_the_caller_change_the_state(tmp_path: Path) -> None:
    m, opt = _model()
    _train(m, opt)
    state = tddist.get_state(m, opt)
    saved = _tensors(state)
    fut = tddist.save(state, tmp_path / "ck", return_early=True, snapshot="deferred")
    fut.wait_snapshot()
    with torch.no_grad():
        m[0].weight.add_(1.0)
    fut.result(60)
    assert_td_equal(_tensors(tddist.load(tmp_path / "ck", shard=None)), saved, "the checkpoint")


def test_manager_wait_snapshot_for_a_state_without_optimizers(tmp_path: Path) -> None:
    """A manager saving a TensorDict (no optimizer to guard): ``wait_snapshot()`` before changing it."""
    td = TensorDict(w=torch.arange(100_000.0), batch_size=[])
    with held_copy() as go, tddist.CheckpointManager(tmp_path / "root", async_save="deferred") as mgr:
        mgr.save(3, td)
        threading.Timer(0.05, go.set).start()
        mgr.wait_snapshot()  # returns once the held copy ran
        td["w"].zero_()
        mgr.wait()
    assert torch.equal(tddist.load(mgr.path(3), shard=None)["w"], torch.arange(100_000.0))


def test_buffers_and_small_leaves_are_copied_before_save_returns(tmp_path: Path) -> None:
    """With a guard, what the optimizer does not own is copied eagerly: changing it at once is safe."""
    m, opt = _model()
    _train(m, opt)
    state = tddist.get_state(m, opt)
    saved = _tensors(state)
    with held_copy() as go:
        fut = tddist.save(state, tmp_path / "ck", return_early=True, snapshot="deferred", guard=opt)
        with torch.no_grad():
            m[1].running_mean.add_(1.0)  # a buffer
            m[2].bias.add_(1.0)  # a parameter of under EAGER_BYTES
        go.set()
        fut.result(60)
    assert_td_equal(_tensors(tddist.load(tmp_path / "ck", shard=None)), saved, "the checkpoint")


def test_every_rank_raises_the_same_typed_error(tmp_path: Path) -> None:
    """Thread ranks: a change on rank 1 only fails the save on both ranks; nothing is committed."""
    go = threading.Event()
    tds = [TensorDict(w=torch.arange(40_000.0) + r, batch_size=[40_000]) for r in range(2)]  # sharded: each writes
    changed = threading.Barrier(2)

    def rank_fn(comm):
        fut = tddist.save(tds[comm.rank], tmp_path / "ck", comm=comm, return_early=True, snapshot="deferred")
        if comm.rank == 1:
            tds[1]["w"].mul_(2)
        changed.wait(30)
        go.set()
        try:
            fut.result(60)
        except tddist.SnapshotChangedError as e:
            return sorted(e.failures)
        return "committed"

    deferred.copy_hooks.append(lambda _keys: go.wait(60))
    try:
        assert tddist.run_threads(2, rank_fn, timeout=90) == [[1], [1]]
    finally:
        deferred.copy_hooks.clear()
    assert not (tmp_path / "ck").exists()


def test_no_new_host_memory_after_the_first_save(tmp_path: Path) -> None:
    m, opt = _model()
    _train(m, opt)
    comm = tddist.LocalComm()
    ch = channel(comm)
    counts = []
    for i in range(3):
        fut = tddist.save(tddist.get_state(m, opt), tmp_path / f"s{i}", comm=comm, return_early=True,
                          snapshot="deferred", guard=opt)  # fmt: skip
        _train(m, opt)
        fut.result(60)
        counts.append((ch.arena_allocations, ch.buffers.allocations))
    assert counts[1] == counts[2] == counts[0], counts


def test_a_kept_plan_is_reused_only_for_the_same_leaves_and_still_proves_each_copy(tmp_path: Path) -> None:
    """Saves of an unchanged structure reuse the channel's plan (``deferred_plan``); a leaf given other storage,
    another dtype or shape, or a new key is planned again; the checkpoint is the state at each save, and a leaf
    changed during the copy of a reused plan still fails the save."""
    comm = tddist.LocalComm()
    ch = channel(comm)
    m, opt = _model()
    _train(m, opt)

    def save(state: TensorDict, name: str, guard: object = opt) -> None:
        saved = _tensors(state)
        tddist.save(state, tmp_path / name, comm=comm, return_early=True, snapshot="deferred", guard=guard).result(60)
        assert_td_equal(_tensors(tddist.load(tmp_path / name, shard=None)), saved, name)

    save(tddist.get_state(m, opt), "a")
    plan = ch.deferred_plan
    assert plan is not None
    _train(m, opt)
    save(tddist.get_state(m, opt), "b")
    assert ch.deferred_plan is plan, "the same structure was planned again"
    with torch.no_grad():
        m[0].weight.data = torch.randn(128, 64)  # other storage: get_state and the plan are made again
    save(tddist.get_state(m, opt), "c")
    assert ch.deferred_plan is not plan and ch.deferred_plan is not None
    td = TensorDict(w=torch.arange(50_000.0), b=torch.ones(3), s=torch.arange(16.0).view(4, 4), batch_size=[])
    save(td, "d", guard=[])
    plan = ch.deferred_plan
    changes = [
        lambda: td["w"].mul_(3),  # values only: the plan holds
        lambda: setattr(td["w"], "data", torch.arange(50_000.0) * 5),  # the same tensor, other storage
        lambda: setattr(td["w"], "data", td["w"].data.view(torch.int32)),  # the same storage, another dtype
        lambda: td["w"].resize_(100_000).resize_(50_000),  # the same storage object and shape, moved
        lambda: td["s"].t_(),  # the same storage and shape, other strides (not kept: not contiguous)
        lambda: td["s"].t_(),  # contiguous again: planned again
        lambda: td["b"].resize_(6).fill_(2.0),  # another shape
        lambda: td.set("c", torch.zeros(2)),  # a new key
    ]
    for i, change in enumerate(changes):
        change()
        save(td, f"e{i}", guard=[])
        assert (ch.deferred_plan is plan) == (i == 0), i
        plan = ch.deferred_plan
    with held_copy() as go:
        fut = tddist.save(td, tmp_path / "f", comm=comm, return_early=True, snapshot="deferred", guard=[])
        assert ch.deferred_plan is plan
        td["w"].add_(1)
        go.set()
        with pytest.raises(tddist.SnapshotChangedError, match="changed while the deferred snapshot copied it"):
            fut.result(60)
    assert not (tmp_path / "f").exists()
    nested = {"w": torch.arange(50_000.0), "n": {"b": torch.ones(3)}, "note": "x"}  # compared through flatten
    plans = []
    for i in range(2):
        tddist.save(nested, tmp_path / f"g{i}", comm=comm, return_early=True, snapshot="deferred", guard=[]).result(60)
        back = tddist.load(tmp_path / f"g{i}", shard=None)
        assert torch.equal(back["w"], nested["w"]) and back["note"] == nested["note"]
        nested["w"].add_(1)
        nested["note"] = "y"  # a value, not the structure: encoded again
        plans.append(ch.deferred_plan)
    assert plans[0] is plans[1] is not None


def test_archives_copy_before_returning(tmp_path: Path) -> None:
    """A save that cannot defer its copy (an archive) copies now: changing the state at once is safe."""
    td = TensorDict(w=torch.arange(100_000.0), batch_size=[])
    fut = tddist.save(td, tmp_path / "ck.tdz", return_early=True, snapshot="deferred")
    td["w"].zero_()
    fut.result(60)
    assert torch.equal(tddist.load(tmp_path / "ck.tdz", shard=None)["w"], torch.arange(100_000.0))


@pytest.mark.parametrize(
    "kwargs,match",
    [
        ({"snapshot": "lazy", "return_early": True}, "snapshot must be"),
        ({"snapshot": "deferred"}, "pass return_early=True"),
        ({"snapshot": "deferred", "return_early": True, "snapshot_budget": 1 << 20}, "snapshot_budget"),
        ({"guard": torch.optim.SGD([torch.nn.Parameter(torch.ones(1))], lr=1.0)}, "guards a deferred"),
        ({"snapshot": "deferred", "return_early": True, "guard": "adam"}, "guard must be"),
    ],
)
def test_bad_arguments_are_refused(tmp_path: Path, kwargs: dict, match: str) -> None:
    with pytest.raises(tddist.InvalidArgumentError, match=match):
        tddist.save(TensorDict(w=torch.ones(3), batch_size=[]), tmp_path / "ck", **kwargs)


def test_manager_refuses_a_bad_async_save(tmp_path: Path) -> None:
    with pytest.raises(tddist.InvalidArgumentError, match="async_save must be"):
        tddist.CheckpointManager(tmp_path / "root", async_save="lazy")


@pytest.mark.multirank
def test_dtensor_leaves_on_real_ranks(tmp_path: Path) -> None:
    """DTensor leaves: changed during the copy without the guard, refused on every rank; with the guard,
    trained, saved deferred, trained on, restored bit for bit (tests/deferred_rank.py)."""
    job = run_job("torchrun", 2, SCRIPT, [str(tmp_path / "work")], tmp_path / "reports", timeout=180)
    job.assert_ok(2)


def test_cuda_side_stream_pinned_and_guarded(tmp_path: Path) -> None:
    """CUDA: the copy runs on a side stream into pinned buffers; the guard waits on its event; a change
    enqueued during the copy without the guard is refused."""
    if not torch.cuda.is_available():
        missing("cuda", "the deferred snapshot's side stream, pinned buffers and events need a CUDA device")
    m, opt = _model("cuda")
    _train(m, opt, 2)
    saved = _tensors(tddist.get_state(m, opt)).cpu()
    comm = tddist.LocalComm()
    fut = tddist.save(tddist.get_state(m, opt), tmp_path / "g", comm=comm, return_early=True,
                      snapshot="deferred", guard=opt)  # fmt: skip
    buffers: SnapshotBuffers = channel(comm).buffers
    pinned = [b for b in buffers._buffers.values() if b.is_pinned()]  # Adam's step counters stay on the host
    assert len(pinned) >= len(list(m.parameters())), "device leaves are copied into pinned buffers"
    _train(m, opt, 3)  # the first step waits on the copy's event
    fut.result(60)
    assert_td_equal(_tensors(tddist.load(tmp_path / "g", shard=None)), saved, "the guarded checkpoint")
    # without the guard: a change enqueued before the copy's event completed is refused
    big = torch.randn(64 << 20, device="cuda")
    with held_copy() as go:  # the worker checks the copy only once the change is enqueued
        fut = tddist.save(TensorDict(w=big, batch_size=[]), tmp_path / "u", comm=comm, return_early=True,
                          snapshot="deferred")  # fmt: skip
        big.add_(1.0)
        go.set()
        with pytest.raises(tddist.SnapshotChangedError):
            fut.result(60)
    assert not (tmp_path / "u").exists()
