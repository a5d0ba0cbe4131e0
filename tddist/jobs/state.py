"""Training state as a TensorDict: models and optimizers through torch.distributed.checkpoint's state_dict
API, and any object with ``state_dict()``/``load_state_dict()`` (an LR scheduler, a stateful data loader or
sampler, a user class), as DCP's ``Stateful`` protocol has them.

``get_state`` uses ``get_state_dict`` (sharded DTensors under FSDP2, full
tensors under DDP or in one process) and keeps the optimizer's non-tensor
entries (hyper-parameters of each param group) as JSON values;
``set_state`` applies a (loaded) state with ``set_state_dict``, and
``load_state_dict`` for the other objects.
"""

from __future__ import annotations

from collections.abc import Mapping, MutableMapping
from typing import TYPE_CHECKING, Any, cast

import torch
from tensordict import TensorDict, TensorDictBase

from ..core.tree import flatten
from ..errors import InvalidArgumentError, InvalidDataError
from ..saving.deferred import remember_optimizer
from .state_cache import cached_state

if TYPE_CHECKING:
    from torch.distributed.checkpoint.state_dict import StateDictOptions


def is_stateful(obj: object) -> bool:
    """Whether ``obj`` has callable ``state_dict`` and ``load_state_dict`` (DCP's ``Stateful`` protocol)."""
    return callable(getattr(obj, "state_dict", None)) and callable(getattr(obj, "load_state_dict", None))


def holds_objects(state: object) -> bool:
    """Whether ``state`` is a mapping of live objects (a module, an optimizer, a Stateful) for ``get_state``."""
    return (
        isinstance(state, Mapping)
        and not isinstance(state, TensorDictBase)
        and any(is_stateful(v) for v in state.values())
    )


def get_state(
    model: torch.nn.Module | Mapping[str, Any],
    optimizer: torch.optim.Optimizer | None = None,
    *,
    options: StateDictOptions | None = None,
) -> TensorDict:
    """The training state as a TensorDict: of a model (and optimizer), or of a mapping of objects.

    ``get_state(model, optimizer)`` gives ``{"model": ..., "optim": {"state":
    ..., "param_groups": ...}}``. ``get_state({"model": model, "optim": optim,
    "sched": scheduler, "loader": loader, ...})`` gives one entry per name:
    a module's and an optimizer's state as above (an optimizer is paired
    with the module of the mapping that holds its parameters), any object
    with ``state_dict()``/``load_state_dict()`` as its ``state_dict()``
    (nested dicts become nodes, tensors leaves, other values JSON values;
    lists or tuples holding tensors become nodes keyed "0", "1", ...), and
    tensors, TensorDicts, nested dicts and plain values as they are.

    The optimizers it sees are remembered (weakly): a deferred save of this
    state (``snapshot="deferred"`` without ``guard=``) guards their steps.
    ``get_state(model, optimizer)`` without ``options`` keeps what it built
    per model and returns a shallow copy of it (new nodes, the same tensors)
    while the modules, parameters, buffers and optimizer state keep their
    structure; anything structural changed, it is built again
    (``jobs.state_cache``, docs/parameters.md).

    Tensors are the state dict's own (no copy): ``tddist.load(path, into=state)``
    fills them in place, each in its own placements. Under FSDP2 they are
    sharded DTensors, under DDP or in one process full tensors; the
    optimizer's non-tensor entries (each param group's hyper-parameters) are
    kept as JSON values, tuples as lists.

    Args:
        model: the model whose parameters and buffers are taken.
        optimizer: its optimizer, or None for the model's state only.
        options: passed to ``torch.distributed.checkpoint.state_dict.get_state_dict``.

    Returns:
        The state, ready for ``tddist.save`` or to be filled by ``tddist.load(into=...)``.

    Raises:
        InvalidDataError: an optimizer of the mapping whose parameters belong to
            none of its modules, or a key that is not a string.
    """
    if isinstance(model, Mapping):
        if optimizer is not None:
            raise InvalidArgumentError("get_state(mapping) takes no optimizer: put it in the mapping")
        return _state_of_objects(model, options)
    return _model_state(model, optimizer, options)


def _model_state(
    model: torch.nn.Module, optimizer: torch.optim.Optimizer | None, options: StateDictOptions | None
) -> TensorDict:
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_state_dict

    if optimizer is None:
        model_sd, optim_sd = get_model_state_dict(model, options=options), None
    else:
        remember_optimizer(optimizer)
        if options is None:
            return cached_state(model, optimizer, lambda: _built(*get_state_dict(model, optimizer)), _jsonable)
        model_sd, optim_sd = get_state_dict(model, optimizer, options=options)
    return _built(model_sd, optim_sd)


def _built(model_sd: Any, optim_sd: Any) -> TensorDict:
    """The state of DCP's model and optimizer state dicts (None: no optimizer)."""
    state = TensorDict({"model": TensorDict(dict(model_sd), batch_size=[])}, batch_size=[])
    if optim_sd is not None:
        state.set("optim", _optim_node(cast("dict[str, Any]", optim_sd)))
    return state


def set_state(
    model: torch.nn.Module | Mapping[str, Any],
    optimizer: Any = None,
    state: Any = None,
    *,
    options: StateDictOptions | None = None,
) -> None:
    """Apply ``state`` (as ``get_state`` builds it, possibly loaded) to the live objects.

    ``set_state(model, optimizer, state)`` updates a model and its optimizer;
    ``set_state(objects, state)`` updates every object of the mapping given
    to ``get_state``: modules and optimizers through ``set_state_dict``,
    other objects with ``load_state_dict`` (their state's lists and tuples,
    and keys that were not strings, restored after what their current
    ``state_dict()`` holds), tensors and dicts in place. A name missing
    from ``state`` (left out of a load) leaves its object untouched. The
    param groups' lists become tuples again where the live optimizer has tuples.

    Args:
        model: the model to update, or the mapping of objects.
        optimizer: its optimizer (None: the model's state only); with a
            mapping, the state.
        state: a TensorDict or nested dict with a "model" entry (and an
            "optim" entry when ``optimizer`` is given).
        options: passed to ``torch.distributed.checkpoint.state_dict.set_state_dict``.

    Raises:
        InvalidDataError: ``state`` lacks the "model" entry, or the "optim"
            entry that ``optimizer`` needs, or is not a TensorDict or nested dict.
    """
    if isinstance(model, Mapping):
        if state is not None:
            raise InvalidArgumentError("set_state(mapping, state) takes two arguments: the objects and the state")
        _apply_to_objects(model, _to_nested_dict(optimizer), options)
        return
    _apply_model_state(model, optimizer, state, options)


def _apply_model_state(
    model: torch.nn.Module, optimizer: torch.optim.Optimizer | None, state: Any, options: StateDictOptions | None
) -> None:
    from torch.distributed.checkpoint.state_dict import set_model_state_dict, set_state_dict

    tree = state if isinstance(state, dict) and not isinstance(state, TensorDictBase) else _to_nested_dict(state)
    if "model" not in tree:
        raise InvalidDataError("state has no 'model' entry; build it with tddist.get_state(model, optimizer)")
    if optimizer is None:
        set_model_state_dict(model, tree["model"], options=options)
        return
    if "optim" not in tree:
        raise InvalidDataError("state has no 'optim' entry; build it with tddist.get_state(model, optimizer)")
    optim_sd = {
        "state": tree["optim"].get("state", {}),
        "param_groups": _restore_tuples(tree["optim"].get("param_groups", []), optimizer.state_dict()["param_groups"]),
    }
    set_state_dict(model, optimizer, model_state_dict=tree["model"], optim_state_dict=optim_sd, options=options)


def _jsonable(value: Any) -> Any:
    """Tuples become lists (``set_state`` turns them back using the live optimizer's types)."""
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    return value


def _restore_tuples(saved: list[dict[str, Any]], current: list[dict[str, Any]]) -> list[dict[str, Any]]:
    out = []
    for i, group in enumerate(saved):
        like = current[i] if i < len(current) else {}
        out.append(
            {k: tuple(v) if isinstance(like.get(k), tuple) and isinstance(v, list) else v for k, v in group.items()}
        )
    return out


def _to_nested_dict(state: Any) -> dict[str, Any]:
    nodes, leaves, objects = flatten(state)
    out: dict[str, Any] = {}
    for key in sorted(nodes, key=len):
        if key:
            _parent(out, key)[key[-1]] = {}
    for key, value in list(leaves.items()) + [(k, v) for k, (_kind, v) in objects.items()]:
        _parent(out, key)[key[-1]] = value
    return out


def _parent(root: dict[str, Any], key: tuple[str, ...]) -> dict[str, Any]:
    node = root
    for k in key[:-1]:
        node = node[k]
    return node


# --- a mapping of objects --------------------------------------------------------------------------


def _owner(objects: Mapping[str, Any], optimizer: torch.optim.Optimizer, name: str) -> torch.nn.Module:
    """The module of ``objects`` that holds ``optimizer``'s parameters (DCP keys its state by their names)."""
    params = {id(p) for group in optimizer.param_groups for p in group["params"]}
    for value in objects.values():
        if isinstance(value, torch.nn.Module) and any(id(p) in params for p in value.parameters()):
            return value
    raise InvalidDataError(
        f"optimizer {name!r} optimizes parameters of none of the modules in the state; put its model in the same "
        f"mapping (its state is keyed by the model's parameter names)"
    )


def _state_of_objects(objects: Mapping[str, Any], options: StateDictOptions | None) -> TensorDict:
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

    out = TensorDict({}, batch_size=[])
    for name, value in objects.items():
        if not isinstance(name, str):
            raise InvalidDataError(f"state key {name!r} is not a string; name every object with a string")
        if isinstance(value, torch.nn.Module):
            out.set(name, TensorDict(dict(get_model_state_dict(value, options=options)), batch_size=[]))
        elif isinstance(value, torch.optim.Optimizer):
            osd = get_optimizer_state_dict(_owner(objects, value, name), value, options=options)
            remember_optimizer(value)
            out.set(name, _optim_node(cast("dict[str, Any]", osd)))
        elif isinstance(value, (torch.Tensor, TensorDictBase)):
            out.set(name, value)
        elif is_stateful(value):
            _set_tree(out, (name,), value.state_dict())
        else:
            _set_tree(out, (name,), value)
    return out


def _optim_node(optim_sd: dict[str, Any]) -> TensorDict:
    """An optimizer's state dict as ``{"state": {fqn: {...}}, "param_groups": [...]}`` (JSON hyper-parameters)."""
    per_param = TensorDict({}, batch_size=[])
    # torch types both entries as one union; "state" maps each parameter's name to its state.
    for fqn, entries in cast("dict[str, dict[str, Any]]", optim_sd.get("state", {})).items():
        node = TensorDict({}, batch_size=[])
        for name, value in entries.items():
            if isinstance(value, torch.Tensor):
                node.set(name, value)
            else:
                node.set_non_tensor(name, _jsonable(value))
        per_param.set(str(fqn), node)
    node = TensorDict({"state": per_param}, batch_size=[])
    node.set_non_tensor("param_groups", _jsonable(optim_sd.get("param_groups", [])))
    return node


def _holds_tensor(value: Any) -> bool:
    if isinstance(value, torch.Tensor):
        return True
    if isinstance(value, Mapping):
        return any(_holds_tensor(v) for v in value.values())
    if isinstance(value, (list, tuple)):
        return any(_holds_tensor(v) for v in value)
    return False


def _set_tree(out: TensorDict, key: tuple[str, ...], value: Any) -> None:
    """Store a state dict's value: dicts (and sequences holding tensors) as nodes, tensors, JSON values."""
    if isinstance(value, torch.Tensor):
        out.set(key, value)
    elif isinstance(value, Mapping) or (isinstance(value, (list, tuple)) and _holds_tensor(value)):
        items = value.items() if isinstance(value, Mapping) else enumerate(value)
        out.set(key, TensorDict({}, batch_size=[]))
        for k, v in items:
            _set_tree(out, (*key, str(k)), v)
    else:
        out.set_non_tensor(key, _jsonable(value))


def _like(saved: Any, template: Any) -> Any:
    """``saved`` (as loaded: dicts with string keys, lists) shaped like ``template`` (a current state dict):
    tuples, lists stored as nodes, and non-string keys come back as the template has them."""
    if isinstance(template, Mapping) and isinstance(saved, Mapping):
        by_text = {str(k): k for k in template}
        return {by_text.get(k, k): _like(v, template.get(by_text.get(k, k))) for k, v in saved.items()}
    if isinstance(template, (list, tuple)):
        if isinstance(saved, Mapping):  # a sequence that held tensors was stored as a node "0", "1", ...
            saved = [saved[str(i)] for i in range(len(saved))]
        if isinstance(saved, list):
            items = [_like(v, template[i] if i < len(template) else None) for i, v in enumerate(saved)]
            return tuple(items) if isinstance(template, tuple) else items
    return saved


def _apply_to_objects(objects: Mapping[str, Any], tree: dict[str, Any], options: StateDictOptions | None) -> None:
    from torch.distributed.checkpoint.state_dict import set_model_state_dict, set_optimizer_state_dict

    for name, value in objects.items():
        if name not in tree:
            continue
        loaded = tree[name]
        if isinstance(value, torch.nn.Module):
            set_model_state_dict(value, loaded, options=options)
        elif isinstance(value, torch.optim.Optimizer):
            groups = _restore_tuples(loaded.get("param_groups", []), value.state_dict()["param_groups"])
            osd = {"state": loaded.get("state", {}), "param_groups": groups}
            set_optimizer_state_dict(_owner(objects, value, name), value, osd, options=options)
        elif isinstance(value, (torch.Tensor, TensorDictBase)) or (not is_stateful(value) and isinstance(value, dict)):
            _assign(value, loaded)
        elif is_stateful(value):
            value.load_state_dict(_like(loaded, value.state_dict()))


def _assign(live: Any, loaded: Any) -> None:
    """Copy ``loaded`` into a live tensor, TensorDict or dict, in place (nothing to do for what was filled)."""
    if isinstance(live, torch.Tensor):
        if live is not loaded:
            with torch.no_grad():
                live.copy_(loaded)
        return
    for k, v in loaded.items():
        current = live.get(k) if isinstance(live, (Mapping, TensorDictBase)) else None
        if isinstance(current, torch.Tensor) or isinstance(current, (dict, TensorDictBase)):
            _assign(current, v)
        elif isinstance(live, TensorDictBase):
            live.set(k, v) if isinstance(v, torch.Tensor) else live.set_non_tensor(k, v)
        else:
            cast(MutableMapping[str, Any], live)[k] = v
