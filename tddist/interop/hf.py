"""safetensors files and Hugging Face sharded directories as a conversion's source or destination.

Reading uses the safetensors library (``safe_open``: one tensor at a time).
Writing streams: the header (every tensor's dtype, shape and offsets) is known
from the source's listing before any data is read, so a file is written
leaf by leaf and never held in memory whole. A sharded directory holds
``model-00001-of-0000N.safetensors`` files of at most ``max_shard_size``
bytes each (a larger leaf gets a file of its own) and
``model.safetensors.index.json`` (``{"metadata": {"total_size": N},
"weight_map": {name: file}}``), as ``transformers`` writes and reads them.
A tddist export marks each file's ``__metadata__`` (and the index's
``metadata``) with ``tddist.export``; non-tensor values go to
``tddist.values`` as JSON.
"""

from __future__ import annotations

import json
import os
import re
import struct
from typing import Any

import torch

from .. import format as fmt
from .._fs import fsync_path
from ..errors import InvalidArgumentError, InvalidDataError
from . import (
    EXPORT_MARKER,
    EXPORT_VERSION,
    KEYS_FIELD,
    VALUES_FIELD,
    Key,
    Selection,
    TensorEntry,
    flat_names,
    split_name,
)

INDEX_NAME = "model.safetensors.index.json"
SUFFIX = ".safetensors"

#: torch dtype -> safetensors' dtype name.
DTYPES: dict[torch.dtype, str] = {
    torch.bool: "BOOL",
    torch.uint8: "U8",
    torch.int8: "I8",
    torch.int16: "I16",
    torch.uint16: "U16",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.int32: "I32",
    torch.uint32: "U32",
    torch.float32: "F32",
    torch.float64: "F64",
    torch.int64: "I64",
    torch.uint64: "U64",
    torch.float8_e4m3fn: "F8_E4M3",
    torch.float8_e5m2: "F8_E5M2",
}
_NAMES = {v: k for k, v in DTYPES.items()}


def parse_size(text: str | int) -> int:
    """``"5GB"`` (10^9), ``"500MiB"`` (2^20), ``"1000"`` (bytes) -> bytes; at least 1."""
    if isinstance(text, int) and not isinstance(text, bool):
        n = text
    else:
        m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]i?B|B)?\s*", str(text), re.IGNORECASE)
        if not m:
            raise InvalidArgumentError(
                f"max_shard_size {text!r} is not a size; write it as bytes or with a unit, as in 5GB, 500MB or 2GiB"
            )
        unit = (m.group(2) or "B").upper()
        scale = 1 if unit == "B" else (1024 if "I" in unit else 1000) ** ("KMGT".index(unit[0]) + 1)
        n = int(float(m.group(1)) * scale)
    if n < 1:
        raise InvalidArgumentError(f"max_shard_size must be at least one byte, got {text!r}")
    return n


def is_sharded_dir(path: str) -> bool:
    return os.path.isfile(os.path.join(path, INDEX_NAME))


class SafetensorsSource:
    """A ``.safetensors`` file, or a sharded directory with ``model.safetensors.index.json``."""

    kind = "safetensors"

    def __init__(self, path: str) -> None:
        from safetensors import safe_open

        self.path = path
        if os.path.isdir(path):
            files, meta = _index(path)
        else:
            files, meta = [os.path.basename(path)], None
            path = os.path.dirname(path)
        self._handles: dict[str, Any] = {}
        self._where: dict[str, str] = {}  # tensor name -> file
        self._entries: dict[Key, tuple[str, TensorEntry]] = {}
        listing: list[tuple[str, torch.dtype, tuple[int, ...]]] = []
        for name in files:
            try:
                h = safe_open(os.path.join(path, name), framework="pt")
            except Exception as e:  # the library raises its own SafetensorError (and OSError)
                raise InvalidDataError(
                    f"{os.path.join(path, name)!r} is not a readable safetensors file: {e}"
                ) from None
            self._handles[name] = h
            if meta is None:
                meta = h.metadata() or {}
            for t in h.keys():
                sl = h.get_slice(t)
                dtype = _NAMES.get(sl.get_dtype())
                if dtype is None:
                    raise InvalidDataError(
                        f"tensor {t!r} of {name!r} has the dtype {sl.get_dtype()}, which tddist does not convert"
                    )
                self._where[t] = name
                listing.append((t, dtype, tuple(sl.get_shape())))
        meta = meta or {}
        self.nested = meta.get(EXPORT_MARKER) == EXPORT_VERSION
        odd = _json_field(meta, KEYS_FIELD) if self.nested else {}
        values = _json_field(meta, VALUES_FIELD) if self.nested else {}
        for t, dtype, shape in listing:
            key = split_name(t, odd) if self.nested else (t,)
            self._entries[key] = (t, TensorEntry(key, dtype, shape))
        self._values = {split_name(n, odd): v for n, v in values.items()}

    def tensors(self) -> list[TensorEntry]:
        return [e for _n, e in self._entries.values()]

    def value_keys(self) -> list[Key]:
        return list(self._values)

    def read(self, entry: TensorEntry) -> torch.Tensor:
        name = self._entries[entry.key][0]
        return self._handles[self._where[name]].get_tensor(name)

    def value(self, key: Key) -> Any:
        return self._values[key]

    def metadata(self) -> dict[str, Any]:
        return {}


def _json_field(meta: dict, field: str) -> dict:
    text = meta.get(field)
    if text is None:
        return {}
    try:
        value = json.loads(text) if isinstance(text, str) else text
    except ValueError:
        value = None
    if not isinstance(value, dict):
        raise InvalidDataError(f"the {field!r} metadata of this tddist export is damaged; export the checkpoint again")
    return value


def _index(path: str) -> tuple[list[str], dict | None]:
    """The shard files a sharded directory's index names (in order), and its metadata."""
    where = os.path.join(path, INDEX_NAME)
    try:
        with open(where, "rb") as f:
            doc = json.loads(f.read(64 << 20))
    except (OSError, ValueError) as e:
        raise InvalidDataError(f"{where!r} is not a readable index: {e}; check the directory") from None
    wm = doc.get("weight_map") if isinstance(doc, dict) else None
    if not isinstance(wm, dict) or not all(isinstance(v, str) for v in wm.values()):
        raise InvalidDataError(f"{where!r} has no weight_map of tensor names to files; it is not a sharded checkpoint")
    files = list(dict.fromkeys(wm.values()))
    for name in files:
        if os.path.basename(name) != name or name in (".", "..") or not name.endswith(SUFFIX):
            raise InvalidDataError(f"{where!r} names the file {name!r}, which is not a .safetensors file beside it")
    meta = doc.get("metadata")
    return files, meta if isinstance(meta, dict) else {}


def _plan(sel: Selection) -> tuple[list[tuple[Key, TensorEntry, str]], dict[str, str]]:
    """Each leaf with its flat name, and the ``__metadata__`` every file carries."""
    keys = [k for k, _ in sel.tensors] + [k for k, _ in sel.values]
    names, odd = flat_names(keys)
    for _k, e in sel.tensors:
        if sel.out_dtype(e) not in DTYPES:
            raise InvalidDataError(
                f"leaf {list(e.key)} has the dtype {sel.out_dtype(e)}, which safetensors cannot store; cast it "
                f"(dtype=...) or leave it out with a prefix"
            )
    meta = {"format": "pt"}
    if sel.nested:
        meta[EXPORT_MARKER] = EXPORT_VERSION
        if odd:
            meta[KEYS_FIELD] = json.dumps(odd)
    if sel.values:
        values = {names[k]: v for k, v in sel.value_items()}
        try:
            meta[VALUES_FIELD] = fmt.dumps(values).decode()
        except (TypeError, ValueError) as e:
            raise InvalidDataError(
                f"the non-tensor values {sorted(values)[:5]} are not all JSON ({e}); safetensors keeps only JSON "
                f"values: leave them out with a prefix, or convert to torch or tddist"
            ) from None
        if not sel.nested:
            meta[EXPORT_MARKER] = EXPORT_VERSION  # values are only read back from a marked file
    return [(k, e, names[k]) for k, e in sel.tensors], meta


def write_file(sel: Selection, path: str, members: list[tuple[Key, TensorEntry, str]], meta: dict[str, str]) -> int:
    """Write one safetensors file from ``members``, leaf by leaf, durably; returns its data bytes."""
    header: dict[str, Any] = {"__metadata__": meta}
    offset = 0
    for _k, e, name in members:
        n = sel.out_nbytes(e)
        header[name] = {"dtype": DTYPES[sel.out_dtype(e)], "shape": list(e.shape), "data_offsets": [offset, offset + n]}
        offset += n
    head = json.dumps(header, separators=(",", ":"), ensure_ascii=False).encode()
    head += b" " * (-len(head) % 8)
    with open(path, "xb") as f:
        f.write(struct.pack("<Q", len(head)))
        f.write(head)
        for _k, e, _name in members:
            t = sel.read(e).contiguous().reshape(-1)
            if t.numel():
                f.write(t.view(torch.uint8).numpy().data)
            del t
        f.flush()
        os.fsync(f.fileno())
    return offset


def write_safetensors(sel: Selection, path: str) -> None:
    """One ``.safetensors`` file at ``path``."""
    members, meta = _plan(sel)
    write_file(sel, path, members, meta)


def write_sharded(sel: Selection, path: str, max_shard_size: int) -> None:
    """A Hugging Face sharded directory at ``path`` (created here): shard files and the index."""
    members, meta = _plan(sel)
    shards: list[list[tuple[Key, TensorEntry, str]]] = [[]]
    size = 0
    for m in members:
        n = sel.out_nbytes(m[1])
        if shards[-1] and size + n > max_shard_size:
            shards.append([])
            size = 0
        shards[-1].append(m)
        size += n
    os.mkdir(path)
    total = len(shards)
    weight_map: dict[str, str] = {}
    total_size = 0
    for i, group in enumerate(shards, 1):
        name = f"model-{i:05d}-of-{total:05d}{SUFFIX}"
        total_size += write_file(sel, os.path.join(path, name), group, meta)
        weight_map.update({n: name for _k, _e, n in group})
    index = {
        "metadata": {"total_size": total_size, **{k: v for k, v in meta.items() if k != "format"}},
        "weight_map": weight_map,
    }
    with open(os.path.join(path, INDEX_NAME), "x") as f:
        json.dump(index, f, indent=2)
        f.write("\n")
        f.flush()
        os.fsync(f.fileno())
    fsync_path(path)
