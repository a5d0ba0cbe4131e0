"""``get_state(model, optimizer)`` kept per model (``jobs/state_cache.py``): after every structural change a
training loop can make, the kept state equals a fresh ``get_state_dict`` (``options=`` bypasses the cache)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from tensordict import TensorDict
from torch.distributed.checkpoint.state_dict import StateDictOptions

import tddist
from tddist.core.tree import flatten
from tddist.jobs import state_cache


def _fresh(model: torch.nn.Module, opt: torch.optim.Optimizer) -> TensorDict:
    return tddist.get_state(model, opt, options=StateDictOptions())


def _assert_equal(kept: TensorDict, fresh: TensorDict) -> None:
    """Same nodes, keys and order; each leaf the same tensor (same storage, offset, shape, strides, dtype);
    each non-tensor value equal."""
    kn, kl, ko = flatten(kept)
    fn, fl, fo = flatten(fresh)
    assert kn == fn
    assert list(kl) == list(fl)
    for k in kl:
        a, b = kl[k], fl[k]
        assert (a.data_ptr(), a.shape, a.stride(), a.dtype, a.device) == (
            b.data_ptr(), b.shape, b.stride(), b.dtype, b.device
        ), k  # fmt: skip
        assert torch.equal(a, b), k
    assert list(ko) == list(fo) and ko == fo


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 6), torch.nn.BatchNorm1d(6), torch.nn.Linear(6, 2))


def _step(model: torch.nn.Module, opt: torch.optim.Optimizer) -> None:
    opt.zero_grad()
    model(torch.randn(5, model[0].in_features)).square().mean().backward()
    opt.step()


def _replace_weight(m: torch.nn.Module, _o: torch.optim.Optimizer) -> None:
    with torch.no_grad():
        m[0].weight.data = torch.randn(6, 4)  # other storage, the same Parameter object


def _resize_buffer(m: torch.nn.Module, _o: torch.optim.Optimizer) -> None:
    m[1].num_batches_tracked.resize_(1)  # the same object, another shape


def _assign_buffer(m: torch.nn.Module, _o: torch.optim.Optimizer) -> None:
    m[1].running_var = torch.full((6,), 2.0)


def _add_module(m: torch.nn.Module, _o: torch.optim.Optimizer) -> None:
    m.add_module("head", torch.nn.Linear(2, 2))


def _add_param_group(m: torch.nn.Module, o: torch.optim.Optimizer) -> None:
    head = torch.nn.Linear(2, 3)
    m.add_module("head", head)
    o.add_param_group({"params": list(head.parameters()), "lr": 0.5})
    o.zero_grad()
    m[2].weight.sum().backward()  # only the old groups get gradients: the new one has no state yet
    o.step()
    m(torch.randn(5, 4)).sum().backward()
    o.step()


def _load_optimizer(m: torch.nn.Module, o: torch.optim.Optimizer) -> None:
    other = torch.optim.Adam(m.parameters(), lr=0.3)
    _step(m, other)
    o.load_state_dict(other.state_dict())  # new state tensors, new hyper-parameters


def _schedule(m: torch.nn.Module, o: torch.optim.Optimizer) -> None:
    sched = torch.optim.lr_scheduler.StepLR(o, step_size=1, gamma=0.5)
    _step(m, o)
    sched.step()


def _drop_state(_m: torch.nn.Module, o: torch.optim.Optimizer) -> None:
    o.state.clear()


def _hook(m: torch.nn.Module, _o: torch.optim.Optimizer) -> None:
    m[2].register_state_dict_post_hook(lambda *_a: None)


def _non_persistent(m: torch.nn.Module, _o: torch.optim.Optimizer) -> None:
    m[1]._non_persistent_buffers_set.add("running_var")


def _buffer_set(m: torch.nn.Module, _o: torch.optim.Optimizer) -> None:
    m[2].register_buffer("extra", None)  # a buffer that is None is no leaf ...
    m[2].extra = torch.ones(2)  # ... until it is given a tensor


def _state_entry_added(m: torch.nn.Module, o: torch.optim.Optimizer) -> None:
    o.state[m[0].bias]["extra"] = torch.zeros(1)  # one parameter's state gets another entry


CHANGES: dict[str, Callable[[torch.nn.Module, torch.optim.Optimizer], None]] = {
    "a step": _step,
    "a parameter given other storage": _replace_weight,
    "a buffer resized": _resize_buffer,
    "a buffer replaced": _assign_buffer,
    "a module added": _add_module,
    "a param group added": _add_param_group,
    "the optimizer loaded": _load_optimizer,
    "the learning rate scheduled": _schedule,
    "the optimizer state dropped": _drop_state,
    "a state dict hook": _hook,
    "a buffer made non-persistent": _non_persistent,
    "a buffer registered as None then set": _buffer_set,
    "an optimizer state entry added": _state_entry_added,
}


@pytest.mark.parametrize("change", list(CHANGES))
def test_the_kept_state_equals_a_fresh_one_after_each_change(change: str) -> None:
    state_cache.forget()
    model = _model()
    opt = torch.optim.Adam(model.parameters(), lr=0.1)
    first = tddist.get_state(model, opt)  # before the first step: DCP creates the optimizer's state
    _assert_equal(first, _fresh(model, opt))
    _step(model, opt)
    _assert_equal(tddist.get_state(model, opt), _fresh(model, opt))
    CHANGES[change](model, opt)
    _assert_equal(tddist.get_state(model, opt), _fresh(model, opt))
    _step(model, opt)
    _assert_equal(tddist.get_state(model, opt), _fresh(model, opt))


def test_the_kept_state_is_reused_and_each_call_returns_new_nodes() -> None:
    state_cache.forget()
    model = _model()
    opt = torch.optim.Adam(model.parameters(), lr=0.1)
    _step(model, opt)
    a = tddist.get_state(model, opt)
    a["extra"] = torch.zeros(1)  # the caller's changes to its state stay in its state
    del a["model", "0.weight"]
    b = tddist.get_state(model, opt)
    assert b is not a and "extra" not in b.keys() and ("model", "0.weight") in b.keys(include_nested=True)
    assert b["optim", "state", "0.weight", "exp_avg"] is opt.state[model[0].weight]["exp_avg"]
    assert state_cache._cache[model].state is not b
    _assert_equal(b, _fresh(model, opt))


def test_another_optimizer_or_options_are_built_afresh() -> None:
    state_cache.forget()
    model = _model()
    sgd = torch.optim.SGD(model.parameters(), lr=0.1)  # no state: DCP creates it at every call
    _step(model, sgd)
    _assert_equal(tddist.get_state(model, sgd), _fresh(model, sgd))
    assert model not in state_cache._cache
    adam = torch.optim.Adam(model.parameters(), lr=0.1)
    _step(model, adam)
    _assert_equal(tddist.get_state(model, adam), _fresh(model, adam))
    _assert_equal(tddist.get_state(model, adam), _fresh(model, adam))
    assert model in state_cache._cache


def test_a_saved_kept_state_loads_back(tmp_path: Path) -> None:
    state_cache.forget()
    model = _model()
    opt = torch.optim.Adam(model.parameters(), lr=0.1)
    for i in range(3):
        _step(model, opt)
        tddist.save(tddist.get_state(model, opt), str(tmp_path / f"s{i}"))
        _nodes, leaves, objects = flatten(tddist.load(str(tmp_path / f"s{i}"), shard=None))
        _fn, fresh_leaves, fresh_objects = flatten(_fresh(model, opt))
        assert set(leaves) == set(fresh_leaves) and all(torch.equal(leaves[k], t) for k, t in fresh_leaves.items())
        assert objects == fresh_objects
