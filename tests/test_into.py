"""load(into=...) and shard= requests in one process: compatibility report, strictness, views."""

from __future__ import annotations

import pytest
import torch
from tensordict import TensorDict

import tddist
from tddist.saving.memmaps import mapped_file


@pytest.fixture()
def ckpt(tmp_path):
    state = {"w": torch.arange(12.0).view(3, 4), "b": torch.ones(4), "opt": {"step": torch.tensor(7)}}
    tddist.save(state, tmp_path / "c", metadata={"step": 7})
    return tmp_path / "c", state


def test_into_fills_in_place_and_reports(ckpt):
    """Every matching leaf is copied into the target's own tensors; the report lists them."""
    path, state = ckpt
    target = {"w": torch.zeros(3, 4), "b": torch.zeros(4), "opt": {"step": torch.tensor(0)}}
    w_storage = target["w"].data_ptr()
    report = tddist.load(path, into=target)
    assert report.ok and sorted(report.loaded) == [("b",), ("opt", "step"), ("w",)]
    assert target["w"].data_ptr() == w_storage and torch.equal(target["w"], state["w"])
    assert int(target["opt"]["step"]) == 7


@pytest.mark.parametrize(
    "target,needle",
    [
        ({"w": torch.zeros(3, 5), "b": torch.zeros(4), "opt": {"step": torch.tensor(0)}}, "shape [3, 5]"),
        ({"w": torch.zeros(3, 4), "opt": {"step": torch.tensor(0)}}, "not in the target: ['b']"),
        (
            {"w": torch.zeros(3, 4, dtype=torch.float64), "b": torch.zeros(4), "opt": {"step": torch.tensor(0)}},
            "dtype torch.float64",
        ),
        (
            {"w": torch.zeros(3, 4), "b": torch.zeros(4), "opt": {"step": torch.tensor(0)}, "new": torch.zeros(1)},
            "missing from the checkpoint: ['new']",
        ),
    ],
    ids=["shape", "unexpected", "dtype", "missing"],
)
def test_strict_refuses_before_touching_anything(ckpt, target, needle):
    """A wrong shape, a dtype change, a missing or an unexpected key: one error, target untouched."""
    path, _ = ckpt
    before = {k: v.clone() for k, v in target.items() if isinstance(v, torch.Tensor)}
    with pytest.raises(tddist.IncompatibleCheckpointError) as err:
        tddist.load(path, into=target)
    assert needle in str(err.value) and "strict=False" in str(err.value)
    assert all(torch.equal(target[k], v) for k, v in before.items())


def test_non_strict_loads_what_matches(ckpt):
    path, state = ckpt
    target = {"w": torch.zeros(3, 5), "b": torch.zeros(4), "extra": torch.zeros(2)}
    report = tddist.load(path, into=target, strict=False)
    assert not report.ok
    assert report.missing == [("extra",)] and report.unexpected == [("opt", "step")]
    assert list(report.mismatched) == [("w",)]
    assert report.loaded == [("b",)] and torch.equal(target["b"], state["b"])
    assert torch.equal(target["w"], torch.zeros(3, 5))


def test_row_requests_and_zero_copy_views(tmp_path):
    """shard=(start, stop) and per-rank counts; a box inside one chunk is a view of the mapped file."""
    td = TensorDict(x=torch.arange(20.0).view(10, 2), batch_size=[10])
    tddist.save(td, tmp_path / "r")
    part = tddist.load(tmp_path / "r", shard=(2, 7))
    assert torch.equal(part["x"], td["x"][2:7]) and part.batch_size == torch.Size([5])
    assert mapped_file(part["x"]) is not None, "a slice of one chunk should be a view of the mapped file"
    counts = tddist.run_threads(3, lambda c: tddist.load(tmp_path / "r", comm=c, shard=[5, 0, 5])["x"], timeout=30)
    assert [t.shape[0] for t in counts] == [5, 0, 5] and torch.equal(torch.cat(counts), td["x"])
    bad = tddist.run_threads(3, lambda c: tddist.load(tmp_path / "r", comm=c, shard=[4, 0, 5]), timeout=30)
    assert all(isinstance(r, tddist.InvalidArgumentError) and "sum to 9" in str(r) for r in bad), bad
    with pytest.raises(tddist.InvalidArgumentError, match="ends past"):
        tddist.load(tmp_path / "r", shard=(5, 11))
