"""torch.distributed.checkpoint (DCP) directories as a conversion's source or destination.

Reading goes through DCP's own ``FileSystemReader`` and metadata, one leaf
per ``dcp.load`` into a full tensor (DCP puts a sharded leaf's chunks
together). Non-tensor values (an optimizer's ``param_groups``) are stored by
DCP as ``torch.save`` bytes: they are loaded with ``weights_only=True``
unless ``allow_pickle``, and come out as JSON-able values (tuples as lists).
Writing is ``dcp.save(..., FileSystemWriter(dst), no_dist=True)`` of a flat
dict, so ``dcp.load`` opens the result on any number of ranks; a tddist
export records each name's key parts, and the marker, in the metadata's
``planner_data``. DCP's ``.metadata`` is a pickle that ``FileSystemReader``
unpickles, as ``dcp.load`` does: DCP sources must be trusted.
"""

from __future__ import annotations

import dataclasses
import io
import os
import pickle
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import (
    DefaultLoadPlanner,
    DefaultSavePlanner,
    FileSystemReader,
    FileSystemWriter,
)
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, TensorStorageMetadata

from ..errors import InvalidDataError
from . import (
    EXPORT_MARKER,
    EXPORT_VERSION,
    VALUES_FIELD,
    Key,
    Selection,
    TensorEntry,
    flat_names,
    jsonable,
    pickle_refused,
)

METADATA_NAME = ".metadata"


def is_dcp_dir(path: str) -> bool:
    return os.path.isfile(os.path.join(path, METADATA_NAME))


@contextmanager
def _one_process() -> Iterator[None]:
    """DCP warns that it runs in one process (``no_dist=True``); that is the intent here."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled", category=UserWarning)
        yield


class DcpSource:
    """A DCP checkpoint directory, read leaf by leaf."""

    kind = "dcp"

    def __init__(self, path: str, allow_pickle: bool) -> None:
        self.path = path
        self.allow_pickle = allow_pickle
        try:
            md = FileSystemReader(path).read_metadata()
        except Exception as e:  # DCP raises whatever unpickling its metadata raised
            raise InvalidDataError(f"{path!r} has no readable DCP metadata ({e}); check the checkpoint") from None
        pd = md.planner_data if isinstance(md.planner_data, dict) else {}
        self.nested = pd.get(EXPORT_MARKER) == (EXPORT_VERSION,)
        value_keys = pd.get(VALUES_FIELD) if self.nested else None
        self._value_keys: dict[str, Key] = value_keys if isinstance(value_keys, dict) else {}
        self._fqn: dict[Key, str] = {}
        self._tensors: list[TensorEntry] = []
        self._parts: dict[Key, list[tuple[str, tuple[str | int, ...]]]] = {}  # value key -> (fqn, path inside)
        for fqn, item in md.state_dict_metadata.items():
            where = pd.get(fqn)
            if not (self.nested and isinstance(where, tuple) and all(isinstance(p, (str, int)) for p in where)):
                where = (fqn,)
            if isinstance(item, TensorStorageMetadata):
                key = tuple(str(p) for p in where)
                self._fqn[key] = fqn
                self._tensors.append(TensorEntry(key, item.properties.dtype, tuple(item.size)))
            elif isinstance(item, BytesStorageMetadata):
                key, inside = self._value_of(where)
                self._parts.setdefault(key, []).append((fqn, inside))
            else:
                raise InvalidDataError(f"{fqn!r} in {path!r} is a {type(item).__name__}, which tddist does not convert")

    def _value_of(self, where: tuple[str | int, ...]) -> tuple[Key, tuple[str | int, ...]]:
        """The tddist value a DCP entry belongs to (an export spreads a list or dict over entries, as DCP does)."""
        for n in range(len(where), 0, -1):
            head = where[:n]
            if all(isinstance(p, str) for p in head) and ".".join(str(p) for p in head) in self._value_keys:
                return tuple(str(p) for p in head), where[n:]
        return tuple(str(p) for p in where), ()

    def tensors(self) -> list[TensorEntry]:
        return list(self._tensors)

    def value_keys(self) -> list[Key]:
        return list(self._parts)

    def read(self, entry: TensorEntry) -> torch.Tensor:
        fqn = self._fqn[entry.key]
        t = torch.empty(entry.shape, dtype=entry.dtype)
        self._load({fqn: t})
        return t

    def value(self, key: Key) -> Any:
        parts = self._parts[key]
        loaded = self._load(dict.fromkeys(fqn for fqn, _ in parts))
        if len(parts) == 1 and not parts[0][1]:
            return jsonable(loaded[parts[0][0]])
        root: dict[str | int, Any] = {}
        for fqn, inside in parts:
            _set_element(root, inside, jsonable(loaded[fqn]))
        return _lists(root)

    def metadata(self) -> dict[str, Any]:
        return {}

    def _load(self, state_dict: dict[str, Any]) -> dict[str, Any]:
        planner = _BytesPlanner(self.allow_pickle)
        try:
            with _one_process():
                dcp.load(state_dict, storage_reader=FileSystemReader(self.path), planner=planner, no_dist=True)
        except pickle.UnpicklingError as e:
            raise pickle_refused(f"{list(state_dict)[0]!r} in {self.path!r}", e) from None
        except (OSError, RuntimeError, ValueError) as e:
            raise InvalidDataError(f"cannot read {list(state_dict)[0]!r} from {self.path!r}: {e}") from None
        return planner.values


def _set_element(root: dict, path: tuple[str | int, ...], value: Any) -> None:
    node = root
    for p in path[:-1]:
        node = node.setdefault(p, {})
    node[path[-1]] = value


def _lists(node: Any) -> Any:
    """Dicts keyed 0..n-1 by ints back into lists (the inverse of ``_explode``)."""
    if not isinstance(node, dict):
        return node
    items = {k: _lists(v) for k, v in node.items()}
    if items and all(isinstance(k, int) for k in items) and sorted(items) == list(range(len(items))):
        return [items[i] for i in range(len(items))]
    return items


def _explode(name: str, value: Any, path: tuple[str | int, ...] = ()) -> list[tuple[str, tuple[str | int, ...], Any]]:
    """A value as DCP's default planner would flatten it: dicts by key, lists that hold dicts by index.

    So that ``dcp.load`` of a state dict with the same nesting (an
    optimizer's ``param_groups``) finds every entry by its name.
    """
    if isinstance(value, dict) and value:
        return [e for k, v in value.items() for e in _explode(f"{name}.{k}", v, (*path, str(k)))]
    if isinstance(value, list) and not _terminal(value):
        return [e for i, v in enumerate(value) for e in _explode(f"{name}.{i}", v, (*path, i))]
    return [(name, path, value)]


def _terminal(value: list) -> bool:
    return not any(isinstance(v, dict) or (isinstance(v, list) and not _terminal(v)) for v in value)


class _BytesPlanner(DefaultLoadPlanner):
    """DCP's default load planner of a flat dict; non-tensor values are unpickled with ``weights_only`` unless allowed."""

    def __init__(self, allow_pickle: bool) -> None:
        super().__init__(flatten_state_dict=False)
        self.allow_pickle = allow_pickle
        self.values: dict[str, Any] = {}

    def load_bytes(self, read_item: Any, value: io.BytesIO) -> None:
        self.values[read_item.dest_index.fqn] = torch.load(value, weights_only=not self.allow_pickle)


def write_dcp(sel: Selection, path: str) -> None:
    """``dcp.save`` the selection as one flat state dict into the new directory ``path``."""
    keys = [k for k, _ in sel.tensors] + [k for k, _ in sel.values]
    names, _odd = flat_names(keys)
    state: dict[str, Any] = {}
    for key, t in sel.spilled_leaves(os.path.dirname(path)):
        state[names[key]] = t
    planner_data: dict[str, Any] = {names[k]: k for k, _ in sel.tensors}
    for key, v in sel.value_items():
        for name, inside, part in _explode(names[key], v):
            if name in state:
                raise InvalidDataError(
                    f"the value {list(key)} and another leaf both become {name!r} in DCP; rename one"
                )
            state[name] = part
            planner_data[name] = (*key, *inside)
    if sel.nested:
        planner_data[EXPORT_MARKER] = (EXPORT_VERSION,)
        planner_data[VALUES_FIELD] = {names[k]: k for k, _ in sel.values}

    class MarkedPlanner(DefaultSavePlanner):
        """DCP's default save planner of a flat dict; records each name's key (and the export marker)."""

        def create_global_plan(self, all_plans: list) -> tuple[list, Any]:
            plans, md = super().create_global_plan(all_plans)
            self.metadata = dataclasses.replace(md, planner_data=planner_data)
            return plans, self.metadata

    os.mkdir(path)
    writer = FileSystemWriter(path, single_file_per_rank=True, sync_files=True, thread_count=1)
    with _one_process():
        dcp.save(state, storage_writer=writer, planner=MarkedPlanner(flatten_state_dict=False), no_dist=True)
