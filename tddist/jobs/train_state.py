"""The user's training state as ``CheckpointManager`` reads and fills it.

The manager accepts several kinds of state: a TensorDict or nested dict
(saved as is, filled in place), a module or a ``(model, optimizer)`` pair, a
mapping of objects with ``state_dict()``/``load_state_dict()``, or a callable
returning one of these (called only when the state is needed, so a training
loop does not build its TensorDict on steps that do not save). This module
turns each into the data ``tddist.save`` writes, and fills each from a load,
through ``state.get_state``/``set_state``; it knows nothing of checkpoints.

``get_state`` and ``set_state`` of a model may be collective (DCP's
``state_dict`` of a sharded model): ``data_to_save`` and ``fill`` call them
once each, in the same order on every rank.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch
from tensordict import TensorDictBase

from ..loading.share import LoadReport
from .state import get_state, holds_objects, set_state


def state_of(state: Any) -> Any:
    """The state itself, or what a callable state returns (called only when the state is needed)."""
    if callable(state) and not isinstance(state, (torch.nn.Module, Mapping, TensorDictBase, tuple, list)):
        return state()
    return state


def model_pair(state: Any) -> tuple[torch.nn.Module, torch.optim.Optimizer | None] | None:
    """(model, optimizer or None) if ``state`` is a module or a (module, optimizer) pair, else None."""
    if isinstance(state, torch.nn.Module):
        return state, None
    if isinstance(state, (tuple, list)) and len(state) == 2 and isinstance(state[0], torch.nn.Module):
        return state[0], state[1]
    return None


def optimizers_of(state: Any) -> list[torch.optim.Optimizer]:
    """The optimizers in ``state`` (a model pair's, or a mapping of objects'): a deferred save guards their steps."""
    objects = state_of(state)
    pair = model_pair(objects)
    if pair is not None:
        return [] if pair[1] is None else [pair[1]]
    if holds_objects(objects):
        return [v for v in objects.values() if isinstance(v, torch.optim.Optimizer)]
    return []


def data_to_save(state: Any) -> Any:
    """What ``tddist.save`` writes for ``state``: a model pair or objects through ``get_state``, else the state."""
    objects = state_of(state)
    pair = model_pair(objects)
    if pair is not None:
        return get_state(*pair)
    return get_state(objects) if holds_objects(objects) else objects


def fill(state: Any, load_into: Callable[[Any], LoadReport]) -> LoadReport:
    """Load into ``state`` (a TensorDict or dict in place, a model pair or objects through get/set_state).

    Args:
        state: the user's state, as ``CheckpointManager.restore`` takes it.
        load_into: loads a checkpoint into the TensorDict or dict it is given and returns the report.

    Returns:
        What ``load_into`` returned.
    """
    objects = state_of(state)
    pair = model_pair(objects)
    if pair is not None:
        full = get_state(*pair)
        report = load_into(full)
        set_state(pair[0], pair[1], full)
    elif holds_objects(objects):
        full = get_state(objects)
        report = load_into(full)
        set_state(objects, full)
    else:
        report = load_into(objects)
    return report
