"""Model and optimizer state as a TensorDict, through torch.distributed.checkpoint's state_dict API.

``get_state`` uses ``get_state_dict`` (sharded DTensors under FSDP2, full
tensors under DDP or in one process) and keeps the optimizer's non-tensor
entries (hyper-parameters of each param group) as JSON values;
``set_state`` applies a (loaded) state with ``set_state_dict``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, cast

import torch
from tensordict import TensorDict

from .errors import InvalidDataError
from .tree import flatten

if TYPE_CHECKING:
    from torch.distributed.checkpoint.state_dict import StateDictOptions


def get_state(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    *,
    options: StateDictOptions | None = None,
) -> TensorDict:
    """``{"model": ..., "optim": {"state": ..., "param_groups": ...}}`` as a TensorDict.

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
    """
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_state_dict

    if optimizer is None:
        model_sd, optim_sd = get_model_state_dict(model, options=options), None
    else:
        model_sd, optim_sd = get_state_dict(model, optimizer, options=options)
    state = TensorDict({"model": TensorDict(dict(model_sd), batch_size=[])}, batch_size=[])
    if optim_sd is not None:
        per_param = TensorDict({}, batch_size=[])
        # torch types both entries as one union; "state" maps each parameter's name to its state.
        per_param_state = cast("dict[str, dict[str, Any]]", optim_sd.get("state", {}))
        for fqn, entries in per_param_state.items():
            node = TensorDict({}, batch_size=[])
            for name, value in entries.items():
                if isinstance(value, torch.Tensor):
                    node.set(name, value)
                else:
                    node.set_non_tensor(name, _jsonable(value))
            per_param.set(str(fqn), node)
        state.set("optim", TensorDict({"state": per_param}, batch_size=[]))
        state.set_non_tensor(("optim", "param_groups"), _jsonable(optim_sd.get("param_groups", [])))
    return state


def set_state(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer | None,
    state: Any,
    *,
    options: StateDictOptions | None = None,
) -> None:
    """Apply ``state`` (as ``get_state`` builds it, possibly loaded) to ``model`` and ``optimizer``.

    For a state loaded as a new TensorDict (not filled in place with
    ``load(into=...)``); the param groups' lists become tuples again where
    the live optimizer has tuples.

    Args:
        model: the model to update.
        optimizer: its optimizer, or None to apply the model's state only.
        state: a TensorDict or nested dict with a "model" entry (and an
            "optim" entry when ``optimizer`` is given).
        options: passed to ``torch.distributed.checkpoint.state_dict.set_state_dict``.

    Raises:
        InvalidDataError: ``state`` lacks the "model" entry, or the "optim"
            entry that ``optimizer`` needs, or is not a TensorDict or nested dict.
    """
    from torch.distributed.checkpoint.state_dict import set_model_state_dict, set_state_dict

    tree = _to_nested_dict(state)
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
