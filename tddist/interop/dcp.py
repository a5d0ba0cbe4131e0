"""torch.distributed.checkpoint (DCP) directories as a conversion's source or destination.

DCP's ``.metadata`` is a pickle, and ``FileSystemReader.read_metadata``
(torch 2.13, which ``dcp.load`` calls) unpickles it with ``pickle.load``,
so a hostile checkpoint runs code as soon as it is opened. torch's
``weights_only`` unpickler cannot stand in: it refuses the protocol-4
opcodes (``FRAME``, ``STACK_GLOBAL``) that every ``.metadata`` holds. So
tddist reads ``.metadata`` itself, with an unpickler that resolves only the
globals DCP's metadata is made of (its dataclasses, torch's dtypes, sizes and
layouts, a path); anything else is refused unless ``trust_pickle``, which
unpickles it as DCP does. The metadata, once read and checked (every data
file it names is a regular file inside the directory), is handed to
``dcp.load`` by a ``FileSystemReader`` that never unpickles it again.

Reading is one ``dcp.load`` per leaf into a full tensor (DCP puts a sharded
leaf's chunks together). Non-tensor values (an optimizer's ``param_groups``)
are stored by DCP as ``torch.save`` bytes: they are loaded with
``weights_only=True`` unless ``allow_pickle``, and come out as JSON-able
values (tuples as lists). Keys are the flat names DCP lists, or, with
``nested``, the paths DCP's planner recorded in the metadata's
``planner_data`` (``("model", "tok.weight")``), a list of dicts such as
``param_groups`` put back together as one value. Writing is ``dcp.save(...,
FileSystemWriter(dst), no_dist=True)`` of a flat dict, so ``dcp.load`` opens
the result on any number of ranks; a tddist export records each name's key
parts, and the marker, in the metadata's ``planner_data``.

DCP raises ``CheckpointException``, a ``BaseException``, for whatever failed
inside ``dcp.load`` or ``dcp.save``; it is caught here, by name, and becomes
a ``TddistError``.
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
    CheckpointException,
    DefaultLoadPlanner,
    DefaultSavePlanner,
    FileSystemReader,
    FileSystemWriter,
)
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    Metadata,
    StorageMeta,
    TensorStorageMetadata,
)

from ..errors import InvalidArgumentError, InvalidDataError, TddistError
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
from .guard import DCP_METADATA_NAME, inside, open_regular, read_regular
from .pages import MappedLeaves

METADATA_NAME = DCP_METADATA_NAME
#: The largest ``.metadata`` read (one entry per chunk: a few hundred bytes each).
MAX_METADATA_BYTES = 1 << 30

_DCP_MD = "torch.distributed.checkpoint.metadata"
#: The globals a ``.metadata`` pickle may name (module, name): what DCP's metadata is made of, nothing that acts.
METADATA_GLOBALS = frozenset(
    {
        *(
            (_DCP_MD, name)
            for name in (
                "Metadata",
                "MetadataIndex",
                "StorageMeta",
                "TensorStorageMetadata",
                "BytesStorageMetadata",
                "ChunkStorageMetadata",
                "TensorProperties",
                "_MEM_FORMAT_ENCODING",
            )
        ),
        ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
        ("torch", "Size"),
        ("torch.serialization", "_get_layout"),  # a lookup of torch.strided & co by name
        ("pathlib", "PosixPath"),
        ("pathlib", "PurePosixPath"),
        ("pathlib._local", "PosixPath"),
        ("pathlib._local", "PurePosixPath"),
        ("collections", "OrderedDict"),
        ("builtins", "set"),
        ("builtins", "frozenset"),
    }
)
_DTYPE_NAMES = frozenset(name for name, v in vars(torch).items() if isinstance(v, torch.dtype))


@contextmanager
def _one_process() -> Iterator[None]:
    """DCP warns that it runs in one process (``no_dist=True``); that is the intent here."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled", category=UserWarning)
        yield


class _Refused(pickle.UnpicklingError):
    """A global that the restricted reader of DCP metadata does not resolve."""


class _MetadataUnpickler(pickle.Unpickler):
    """An unpickler that resolves only ``METADATA_GLOBALS`` and torch's dtypes (Python's "restricting globals")."""

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in METADATA_GLOBALS or (module == "torch" and name in _DTYPE_NAMES):
            return super().find_class(module, name)
        raise _Refused(f"{module}.{name}")


def read_metadata(path: str, trust_pickle: bool) -> Metadata:
    """The checked metadata of the DCP directory ``path``; unpickled with any global only if ``trust_pickle``.

    Raises:
        InvalidArgumentError: the pickle names a global outside
            ``METADATA_GLOBALS`` and ``trust_pickle`` is False.
        InvalidDataError: not readable DCP metadata, or a data file it names
            is not a regular file inside ``path``.
    """
    where = inside(path, METADATA_NAME, "DCP metadata")
    raw = read_regular(where, MAX_METADATA_BYTES, "DCP metadata")
    try:
        md = pickle.loads(raw) if trust_pickle else _MetadataUnpickler(io.BytesIO(raw)).load()
    except _Refused as e:
        raise InvalidArgumentError(
            f"{where!r} names {e}, which tddist does not unpickle from DCP metadata: the file is a pickle, and "
            f"unpickling it can run any code. Pass trust_pickle=True (--trust-pickle) only if you trust where the "
            f"checkpoint comes from"
        ) from None
    except Exception as e:  # whatever a damaged pickle raises
        raise InvalidDataError(
            f"{where!r} is not readable DCP metadata ({type(e).__name__}: {e}); check the checkpoint"
        ) from None
    return _checked(md, path)


def _checked(md: Any, path: str) -> Metadata:
    """``md`` if it is DCP metadata whose every data file is a regular file inside ``path``."""
    entries, storage = getattr(md, "state_dict_metadata", None), getattr(md, "storage_data", None)
    if not isinstance(md, Metadata) or not isinstance(entries, dict) or not isinstance(storage, dict):
        raise InvalidDataError(
            f"{os.path.join(path, METADATA_NAME)!r} does not hold DCP metadata; check the checkpoint"
        )
    names: set[str] = set()
    for info in storage.values():
        name = getattr(info, "relative_path", None)
        if not isinstance(name, str):
            raise InvalidDataError(f"the DCP metadata of {path!r} names a data file {name!r}, which is not a name")
        names.add(name)
    for name in names:
        os.close(open_regular(inside(path, name, "DCP data file"), "DCP data file"))  # a FIFO would block DCP
    for fqn, item in entries.items():
        if isinstance(item, TensorStorageMetadata):
            dtype, size = getattr(getattr(item, "properties", None), "dtype", None), getattr(item, "size", None)
            if not (isinstance(dtype, torch.dtype) and isinstance(size, tuple)) or not all(
                type(n) is int and n >= 0 for n in size
            ):
                raise InvalidDataError(f"entry {fqn!r} of the DCP metadata of {path!r} has no valid dtype and size")
    return md


class _Reader(FileSystemReader):
    """DCP's reader of a directory, given the metadata tddist read and checked: it never unpickles it again."""

    def __init__(self, path: str, metadata: Metadata) -> None:
        super().__init__(path)
        self._checked_metadata = metadata

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        md = self._checked_metadata
        meta = getattr(md, "storage_meta", None)
        if not isinstance(meta, StorageMeta):
            meta = md.storage_meta = StorageMeta()
        meta.load_id = self.load_id  # as FileSystemReader.read_metadata does
        return md


def _failure(e: CheckpointException) -> BaseException:
    """The first rank's exception inside DCP's ``CheckpointException`` (which wraps each rank's)."""
    for wrapped in e.failures.values():
        inner = wrapped[0] if isinstance(wrapped, tuple) and wrapped else wrapped
        if isinstance(inner, BaseException):
            return inner
    return e


class DcpSource:
    """A DCP checkpoint directory, read leaf by leaf."""

    kind = "dcp"

    def __init__(self, path: str, allow_pickle: bool, trust_pickle: bool = False, nested: bool = False) -> None:
        self.path = path
        self.allow_pickle = allow_pickle
        self._md = read_metadata(path, trust_pickle)
        pd = self._md.planner_data if isinstance(self._md.planner_data, dict) else {}
        self._marked = pd.get(EXPORT_MARKER) == (EXPORT_VERSION,)
        self.nested = self._marked or nested
        value_keys = pd.get(VALUES_FIELD) if self._marked else None
        self._value_keys: dict[str, Key] = value_keys if isinstance(value_keys, dict) else {}
        self._fqn: dict[Key, str] = {}
        self._tensors: list[TensorEntry] = []
        self._parts: dict[Key, list[tuple[str, tuple[str | int, ...]]]] = {}  # value key -> (fqn, path inside)
        for fqn, item in self._md.state_dict_metadata.items():
            where = pd.get(fqn)
            if not (self.nested and isinstance(where, tuple) and where and all(type(p) in (str, int) for p in where)):
                where = (fqn,)
            if isinstance(item, TensorStorageMetadata):
                key = tuple(str(p) for p in where)
                self._fqn[key] = fqn
                self._tensors.append(TensorEntry(key, item.properties.dtype, tuple(item.size)))
            elif isinstance(item, BytesStorageMetadata):
                key, inside_value = self._value_of(where)
                self._parts.setdefault(key, []).append((fqn, inside_value))
            else:
                raise InvalidDataError(f"{fqn!r} in {path!r} is a {type(item).__name__}, which tddist does not convert")

    def _value_of(self, where: tuple[str | int, ...]) -> tuple[Key, tuple[str | int, ...]]:
        """The value a DCP entry belongs to, and where inside it (DCP spreads a list of dicts over entries).

        A tddist export names its values in ``planner_data``; elsewhere a
        value ends before the first list index of the entry's path
        (``("optim", "param_groups", 0, "lr")`` is ``lr`` of the first item of
        the value ``("optim", "param_groups")``).
        """
        if self._marked:
            for n in range(len(where), 0, -1):
                head = where[:n]
                if all(isinstance(p, str) for p in head) and ".".join(str(p) for p in head) in self._value_keys:
                    return tuple(str(p) for p in head), where[n:]
            return tuple(str(p) for p in where), ()
        n = next((i for i, p in enumerate(where) if isinstance(p, int)), len(where))
        n = max(n, 1)
        return tuple(str(p) for p in where[:n]), where[n:]

    def tensors(self) -> list[TensorEntry]:
        return list(self._tensors)

    def value_keys(self) -> list[Key]:
        return list(self._parts)

    def read(self, entry: TensorEntry) -> torch.Tensor:
        fqn = self._fqn[entry.key]
        t = torch.empty(entry.shape, dtype=entry.dtype)
        self._load({fqn: t}, values=False)
        return t

    def value(self, key: Key) -> Any:
        parts = self._parts[key]
        loaded = self._load(dict.fromkeys(fqn for fqn, _ in parts), values=True)
        if len(parts) == 1 and not parts[0][1]:
            return jsonable(loaded[parts[0][0]])
        root: dict[str | int, Any] = {}
        for fqn, inside_value in parts:
            _set_element(root, inside_value, jsonable(loaded[fqn]))
        return _lists(root)

    def metadata(self) -> dict[str, Any]:
        return {}

    def close(self) -> None:
        """Nothing is held open (the tensors read are the caller's)."""

    def _load(self, state_dict: dict[str, Any], values: bool) -> dict[str, Any]:
        planner = _BytesPlanner(self.allow_pickle)
        try:
            with _one_process():
                dcp.load(state_dict, storage_reader=_Reader(self.path, self._md), planner=planner, no_dist=True)
        except CheckpointException as e:  # a BaseException, which ``except Exception`` would let through
            raise self._failed(state_dict, _failure(e), values) from None
        except (pickle.UnpicklingError, OSError, RuntimeError, ValueError) as e:
            raise self._failed(state_dict, e, values) from None
        return planner.values

    def _failed(self, state_dict: dict[str, Any], e: BaseException, values: bool) -> TddistError:
        """The error for a ``dcp.load`` of ``state_dict`` that failed with ``e``."""
        names = ", ".join(repr(n) for n in list(state_dict)[:3]) + (", ..." if len(state_dict) > 3 else "")
        if isinstance(e, TddistError):
            return e
        if values and isinstance(e, pickle.UnpicklingError):
            return pickle_refused(f"the DCP entry {names} of {self.path!r}", e)
        first = str(e).splitlines()[0] if str(e) else ""
        return InvalidDataError(
            f"cannot read the DCP entry {names} of {self.path!r} ({type(e).__name__}: {first}); the checkpoint is "
            f"damaged or incomplete: check its files, or convert it without that entry (prefix=...)"
        )


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
    """``dcp.save`` the selection as one flat state dict into the new directory ``path``.

    Each leaf is a map of a file (``Selection.spilled_leaves``); DCP's one
    writing thread asks the planner for each item just before writing it, so
    the pages of the item before are dropped then (``pages.MappedLeaves``).
    """
    keys = [k for k, _ in sel.tensors] + [k for k, _ in sel.values]
    names, _odd = flat_names(keys)
    state: dict[str, Any] = {}
    mapped = MappedLeaves()
    for key, t in sel.spilled_leaves(os.path.dirname(path), mapped):
        state[names[key]] = t
    planner_data: dict[str, Any] = {names[k]: k for k, _ in sel.tensors}
    for key, v in sel.value_items():
        for name, within, part in _explode(names[key], v):
            if name in state:
                raise InvalidDataError(
                    f"the value {list(key)} and another leaf both become {name!r} in DCP; rename one"
                )
            state[name] = part
            planner_data[name] = (*key, *within)
    if sel.nested:
        planner_data[EXPORT_MARKER] = (EXPORT_VERSION,)
        planner_data[VALUES_FIELD] = {names[k]: k for k, _ in sel.values}

    class MarkedPlanner(DefaultSavePlanner):
        """DCP's default save planner of a flat dict; records each name's key (and the export marker)."""

        def create_global_plan(self, all_plans: list) -> tuple[list, Any]:
            plans, md = super().create_global_plan(all_plans)
            self.metadata = dataclasses.replace(md, planner_data=planner_data)
            return plans, self.metadata

        def resolve_data(self, write_item: Any) -> Any:
            data = super().resolve_data(write_item)
            mapped.resolved(data)  # one writing thread: the item asked for before this one is written
            return data

    os.mkdir(path)
    writer = FileSystemWriter(path, single_file_per_rank=True, sync_files=True, thread_count=1)
    try:
        with _one_process():
            dcp.save(state, storage_writer=writer, planner=MarkedPlanner(flatten_state_dict=False), no_dist=True)
    except CheckpointException as e:  # a BaseException: what failed is inside
        inner = _failure(e)
        raise InvalidDataError(f"dcp.save into {path!r} failed: {type(inner).__name__}: {inner}") from None
