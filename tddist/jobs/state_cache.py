"""``get_state(model, optimizer)`` kept per model, so a training loop that builds its state at every save pays
for ``get_state_dict`` only when something structural changed.

DCP's ``get_state_dict`` costs about 10 ms at 672 leaves (the names of every
parameter are resolved again at each call), on the blocking path of every
save. What it returns is a function of the structure: the module tree, each
module's parameters and buffers (their objects and storages), the optimizer's
param groups and per-parameter state (their objects). ``Fingerprint`` holds
exactly that; a state built once is handed out again (a shallow copy: new
nodes, the same tensors) while the fingerprint is the same, and rebuilt by
``get_state_dict`` when anything in it changed: a module added or replaced,
a parameter replaced or given other storage (``.data =``), ``resize_``, the
optimizer's state created at its first step or replaced (``load_state_dict``),
a param group added. Each param group's hyper-parameters are read from the
optimizer at every call (a scheduler changes the learning rate).

Only the plain case is kept: no ``options``, modules and an optimizer without
state-dict hooks or their own ``state_dict``/``_save_to_state_dict``/
``get_extra_state``, plain (not distributed) tensors, an optimizer whose state
exists and holds only tensors. Anything else is built by ``get_state_dict``
at every call, as before.
"""

from __future__ import annotations

import operator
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from itertools import chain
from typing import Any

import torch
from tensordict import TensorDict

from ..core.tree import flatten


@dataclass(frozen=True, slots=True)
class Fingerprint:
    """What a model's and optimizer's state dict is a function of: ``objects`` compared by identity (held, so
    an identity is never reused while it is compared), ``values`` by equality (keys, storages, shapes, counts)."""

    objects: tuple[Any, ...]
    values: tuple[Any, ...]

    def same(self, other: Fingerprint) -> bool:
        return (
            len(self.objects) == len(other.objects)
            and all(map(operator.is_, self.objects, other.objects))
            and self.values == other.values
        )


@dataclass(frozen=True, slots=True)
class CachedState:
    """A state ``get_state_dict`` built, the fingerprint it was built for, and each param group's parameter names."""

    optimizer: weakref.ref[Any]
    descendants: tuple[torch.nn.Module, ...]  # the model's modules but itself (held weakly, as the cache's key)
    fingerprint: Fingerprint
    nodes: Node  # the kept state's nodes, for ``_shallow_copy``
    group_names: tuple[tuple[Any, ...], ...]

    @property
    def state(self) -> TensorDict:
        """The kept state (never handed out: callers get a ``_shallow_copy``)."""
        return self.nodes.td


@dataclass(frozen=True, slots=True)
class Node:
    """A node of a kept state and its sub-nodes by key (what ``_shallow_copy`` copies: the rest is shared)."""

    td: TensorDict
    batch_size: torch.Size
    device: torch.device | None
    children: tuple[tuple[str, Node], ...]


def _node(td: TensorDict) -> Node:
    children = tuple((k, _node(v)) for k, v in td._tensordict.items() if type(v) is TensorDict)
    return Node(td, td.batch_size, td.device, children)


_cache: weakref.WeakKeyDictionary[torch.nn.Module, CachedState] = weakref.WeakKeyDictionary()

_MODULE = torch.nn.Module
_OPTIMIZER = torch.optim.Optimizer


_PARAMETERS = operator.attrgetter("_parameters")
_BUFFERS = operator.attrgetter("_buffers")
_MODULES = operator.attrgetter("_modules")
_HIDDEN = operator.attrgetter("_non_persistent_buffers_set")
_HOOKS = operator.attrgetter("_state_dict_hooks")
_PRE_HOOKS = operator.attrgetter("_state_dict_pre_hooks")
_DATA_PTR = torch.Tensor.data_ptr
_SHAPE = operator.attrgetter("shape")
_STRIDE = torch.Tensor.stride
_DTYPE = operator.attrgetter("dtype")
_values = dict.values


def fingerprint(modules: tuple[torch.nn.Module, ...], optimizer: Any) -> Fingerprint:
    """The fingerprint of ``modules`` (the tree's modules, root first) and ``optimizer`` as they are now.

    Gathered a kind at a time over all the modules (``map`` and ``chain`` run in C: a loop with a dozen
    steps per module cost half a millisecond per call at 85 modules), each sequence with its lengths, so two
    different structures never flatten to the same values."""
    objects: list[Any] = list(map(type, modules))
    values: list[Any] = []
    for get in (_PARAMETERS, _BUFFERS, _MODULES):
        dicts = list(map(get, modules))
        values.extend(map(len, dicts))
        values.extend(chain.from_iterable(dicts))  # the keys
        objects.extend(chain.from_iterable(map(_values, dicts)))
    values.extend(frozenset(h) if h else None for h in map(_HIDDEN, modules))
    values.extend(map(len, map(_HOOKS, modules)))
    values.extend(map(len, map(_PRE_HOOKS, modules)))
    tensors = [
        t
        for t in chain.from_iterable(map(_values, chain(map(_PARAMETERS, modules), map(_BUFFERS, modules))))
        if t is not None
    ]
    for attribute in (_DATA_PTR, _SHAPE, _STRIDE, _DTYPE):
        values.extend(map(attribute, tensors))
    values.append(len(optimizer._optimizer_state_dict_pre_hooks) + len(optimizer._optimizer_state_dict_post_hooks))
    groups = [g["params"] for g in optimizer.param_groups]
    values.append(len(groups))
    values.extend(map(len, groups))
    objects.extend(chain.from_iterable(groups))
    state = optimizer.state
    values.append(len(state))
    objects.extend(state)
    entries = list(state.values())
    values.extend(map(len, entries))
    values.extend(chain.from_iterable(entries))  # each parameter's state's keys
    objects.extend(chain.from_iterable(map(_values, entries)))
    return Fingerprint(tuple(objects), tuple(values))


def cached_state(
    model: torch.nn.Module, optimizer: Any, build: Callable[[], TensorDict], groups: Callable[[Any], Any]
) -> TensorDict:
    """``model``'s and ``optimizer``'s state: a shallow copy of the kept one while their fingerprint is the same,
    else ``build()`` (``get_state_dict``), kept when it can be. ``groups`` turns a param group's hyper-parameters
    into the state's values (JSON), refreshed at every call from the optimizer's own groups."""
    kept = _cache.get(model)
    if (
        kept is not None
        and id(kept.optimizer()) == id(optimizer)  # (not "is": it would narrow the type of optimizer)
        and fingerprint((model, *kept.descendants), optimizer).same(kept.fingerprint)
    ):
        out = _shallow_copy(kept.nodes)
        live = [  # the names are JSON already: only the hyper-parameters are converted
            {**groups({k: v for k, v in g.items() if k != "params"}), "params": list(names)}
            for g, names in zip(optimizer.param_groups, kept.group_names)
        ]
        out.set_non_tensor(("optim", "param_groups"), live)
        return out
    _cache.pop(model, None)
    state = build()
    entry = _entry(model, optimizer, state)
    if entry is not None:
        _cache[model] = entry
        return _shallow_copy(entry.nodes)
    return state


def _entry(model: torch.nn.Module, optimizer: Any, state: TensorDict) -> CachedState | None:
    """What to keep of a state just built, or None when it is not the plain case (``module docstring``)."""
    if not _plain_optimizer(optimizer):
        return None
    modules = tuple(model.modules())
    if not all(_plain_module(m) for m in modules):
        return None
    _nodes, leaves, _objects = flatten(state)
    if not all(type(t) is torch.Tensor for t in leaves.values()):
        return None  # DTensors or other tensor types: built by get_state_dict every time
    held = {id(v) for entries in optimizer.state.values() for v in entries.values()}
    if not all(id(t) in held for k, t in leaves.items() if k[:2] == ("optim", "state")):
        return None  # the optimizer's state was copied or converted: not the optimizer's own tensors
    names = [g["params"] for g in state["optim", "param_groups"]]
    if len(names) != len(optimizer.param_groups):
        return None
    return CachedState(
        weakref.ref(optimizer),
        modules[1:],
        fingerprint(modules, optimizer),
        _node(state),
        tuple(tuple(n) for n in names),
    )


def _plain_module(m: torch.nn.Module) -> bool:
    """A module whose state dict is its parameters and persistent buffers, nothing computed."""
    cls = type(m)
    return (
        cls.state_dict is _MODULE.state_dict
        and cls._save_to_state_dict is _MODULE._save_to_state_dict
        and cls.get_extra_state is _MODULE.get_extra_state
        and not m._state_dict_hooks
        and not m._state_dict_pre_hooks
    )


def _plain_optimizer(optimizer: Any) -> bool:
    """An optimizer whose state dict is its own state (created: DCP initialises an empty one at every call),
    tensors only (other values are copied into the state as JSON, and change)."""
    return (
        isinstance(optimizer, _OPTIMIZER)
        and type(optimizer).state_dict is _OPTIMIZER.state_dict
        and not optimizer._optimizer_state_dict_pre_hooks
        and not optimizer._optimizer_state_dict_post_hooks
        and bool(optimizer.state)
        and all(isinstance(v, torch.Tensor) for entries in optimizer.state.values() for v in entries.values())
    )


def _shallow_copy(node: Node) -> TensorDict:
    """New nodes holding the same tensors and values: what the caller changes in its state stays out of the kept
    one. Each node's entries are copied as one dict (in C), then its sub-nodes replaced by their copies: a
    loop over every entry cost twice as much, ``TensorDict.copy`` (which checks every entry again) four times."""
    source = dict(node.td._tensordict)
    for k, child in node.children:
        source[k] = _shallow_copy(child)
    return TensorDict._new_unsafe(source=source, batch_size=node.batch_size, device=node.device, nested=False)


def forget() -> None:
    """Drop every kept state (the tests compare a kept state with a fresh one)."""
    _cache.clear()
