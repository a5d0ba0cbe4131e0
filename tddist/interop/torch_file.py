"""``torch.save`` files (``.pt``/``.pth``) as a conversion's source or destination.

A file is read with ``torch.load(mmap=True, weights_only=True)`` (pickled
objects only with ``allow_pickle``): tensors are copy-on-write maps of the
file, paged in leaf by leaf. Its top level must be a dict; nested dicts are
flattened with "." into one-part keys, unless ``nested`` (each dict level
one part of the key: ``("model", "tok.weight")``, ``("optimizer", "state",
"0", "exp_avg")``) or the file is a marked tddist export. A tddist
export is one flat ``OrderedDict`` ``{"model.w": tensor, ...}`` (the form
``model.load_state_dict`` takes); the marker is an attribute of that dict
(``_tddist``), which ``torch.load`` restores and ``load_state_dict`` ignores.
"""

from __future__ import annotations

import collections
import os
import pickle
from typing import IO, Any, cast

import torch

from ..errors import InvalidDataError
from . import (
    EXPORT_MARKER,
    EXPORT_VERSION,
    KEYS_FIELD,
    Key,
    Selection,
    TensorEntry,
    flat_names,
    jsonable,
    pickle_refused,
    split_name,
)
from .pages import MappedLeaves, ReleasingFile

#: The attribute of the saved dict that marks a tddist export.
MARKER_ATTR = "_tddist"


def _load(path: str, allow_pickle: bool) -> Any:
    kwargs: dict[str, Any] = {"map_location": "cpu", "weights_only": not allow_pickle}
    try:
        try:
            return torch.load(path, mmap=True, **kwargs)
        except RuntimeError as e:
            if "mmap" not in str(e) and "zip" not in str(e):
                raise
            return torch.load(path, **kwargs)  # a legacy (non-zip) file cannot be mapped
    except pickle.UnpicklingError as e:
        raise pickle_refused(repr(path), e) from None
    except (RuntimeError, EOFError, OSError) as e:
        raise InvalidDataError(f"{path!r} is not a readable torch.save file: {e}; check the file") from None


class TorchFileSource:
    """A ``torch.save`` file of a (nested) dict of tensors and plain values."""

    kind = "torch"

    def __init__(self, path: str, allow_pickle: bool, nested: bool = False) -> None:
        obj = _load(path, allow_pickle)
        if not isinstance(obj, dict):
            raise InvalidDataError(
                f"{path!r} holds a {type(obj).__name__}, not a dict of tensors; save a state dict "
                f"(torch.save(model.state_dict(), path)) to convert it"
            )
        marker = getattr(obj, MARKER_ATTR, None)
        marked = isinstance(marker, dict) and marker.get(EXPORT_MARKER) == EXPORT_VERSION
        self.nested = marked or nested
        odd = marker.get(KEYS_FIELD, {}) if marked and isinstance(marker, dict) else {}
        self._tensors: dict[Key, torch.Tensor] = {}
        self._values: dict[Key, Any] = {}
        for parts, value in _flat(obj, path, recurse=not marked):
            if marked:
                key = split_name(parts[0], odd)
            else:
                key = parts if nested else (".".join(parts),)
            if key in self._tensors or key in self._values:
                raise InvalidDataError(
                    f"two entries of {path!r} are both named {'.'.join(key)!r} once nested dicts are joined with "
                    f"'.'; convert with nested=True (--nested) to keep the nesting"
                )
            if isinstance(value, torch.Tensor):
                self._tensors[key] = value
            else:
                self._values[key] = jsonable(value)

    def tensors(self) -> list[TensorEntry]:
        return [TensorEntry(k, t.dtype, tuple(t.shape)) for k, t in self._tensors.items()]

    def value_keys(self) -> list[Key]:
        return list(self._values)

    def read(self, entry: TensorEntry) -> torch.Tensor:
        return self._tensors[entry.key]

    def value(self, key: Key) -> Any:
        return self._values[key]

    def metadata(self) -> dict[str, Any]:
        return {}

    def close(self) -> None:
        """Nothing is held open (the tensors read are the caller's)."""


def _flat(obj: dict, path: str, prefix: Key = (), *, recurse: bool = True) -> list[tuple[Key, Any]]:
    """(key parts, value) of every entry, nested dicts' keys appended when ``recurse`` (a marked export is flat)."""
    out: list[tuple[Key, Any]] = []
    for k, v in obj.items():
        parts = (*prefix, str(k))
        name = ".".join(parts)
        if recurse and isinstance(v, dict) and v:
            out += _flat(v, path, parts)
        elif isinstance(v, torch.Tensor):
            if type(v) is not torch.Tensor and not isinstance(v, torch.nn.Parameter):
                raise InvalidDataError(
                    f"{name!r} in {path!r} is a {type(v).__name__}; only plain tensors convert (save full tensors)"
                )
            out.append((parts, v.detach()))
        elif _holds_tensor(v):
            raise InvalidDataError(
                f"{name!r} in {path!r} is a {type(v).__name__} holding tensors; only dicts of tensors convert "
                f"(store the tensors under dict keys)"
            )
        else:
            out.append((parts, v))
    return out


def _holds_tensor(v: Any) -> bool:
    if isinstance(v, (list, tuple)):
        return any(isinstance(x, torch.Tensor) or _holds_tensor(x) for x in v)
    if isinstance(v, dict):
        return any(isinstance(x, torch.Tensor) or _holds_tensor(x) for x in v.values())
    return False


def write_torch(sel: Selection, path: str) -> None:
    """``torch.save`` the selection as one flat dict at ``path``.

    ``torch.save`` takes the whole dict: each leaf is a copy-on-write map
    (of the source, or of a spill file beside ``path``), paged in as it is
    written (``Selection.spilled_leaves``), and its pages dropped once it is
    (``pages.ReleasingFile``), so the process holds about one leaf.
    """
    keys = [k for k, _ in sel.tensors] + [k for k, _ in sel.values]
    names, odd = flat_names(keys)
    out: collections.OrderedDict[str, Any] = collections.OrderedDict()
    mapped = MappedLeaves()
    for key, t in sel.spilled_leaves(os.path.dirname(path), mapped):
        out[names[key]] = t
    for key, v in sel.value_items():
        out[names[key]] = v
    if sel.nested:
        setattr(out, MARKER_ATTR, {EXPORT_MARKER: EXPORT_VERSION, KEYS_FIELD: odd})
    with open(path, "xb") as f:
        torch.save(out, cast(IO[bytes], ReleasingFile(f, mapped)))  # a binary file object: write() is all it uses
