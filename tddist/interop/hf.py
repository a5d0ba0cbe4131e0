"""safetensors files and Hugging Face directories as a conversion's source or destination.

Reading uses the safetensors library (``safe_open``: one tensor at a time),
on a file checked first (``guard``: a regular file inside the source folder;
``check_header``: bounded JSON, tensors' bytes inside the data and never
shared). A Hugging Face directory (what ``save_pretrained`` writes) holds
``model.safetensors``, or shards and their index.
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
from .guard import (
    HF_INDEX_NAME,
    HF_WEIGHTS_NAME,
    SAFETENSORS_SUFFIX,
    hf_weights,
    inside,
    loads_json,
    open_regular,
    read_regular,
)

INDEX_NAME = HF_INDEX_NAME
SUFFIX = SAFETENSORS_SUFFIX
#: The largest header read (the safetensors library's own bound).
MAX_HEADER_BYTES = 100_000_000
#: The largest index read.
MAX_INDEX_BYTES = 64 << 20

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


class SafetensorsSource:
    """A ``.safetensors`` file, or a Hugging Face directory: ``model.safetensors``, or shards and their index.

    Every file is opened without blocking and must be a regular file; a
    file that a directory names (its index's shards, its ``model.safetensors``)
    must lie inside it once symbolic links are resolved; each file's header
    is checked (``check_header``) before the safetensors library maps it.
    """

    kind = "safetensors"

    def __init__(self, path: str) -> None:
        self.path = path
        meta: dict | None = None
        if os.path.isdir(path):
            found = hf_weights(path)
            if found == INDEX_NAME:
                files, meta = _index(path)
            elif found is not None:
                files = [found]
            else:
                raise InvalidDataError(
                    f"{path!r} holds neither {HF_WEIGHTS_NAME} nor {INDEX_NAME}; pass a Hugging Face directory "
                    f"or a .safetensors file"
                )
            paths = [inside(path, name, "safetensors file") for name in files]
        else:
            paths = [path]
        self._handles: dict[str, Any] = {}
        self._where: dict[str, str] = {}  # tensor name -> file
        self._entries: dict[Key, tuple[str, TensorEntry]] = {}
        listing: list[tuple[str, torch.dtype, tuple[int, ...]]] = []
        for file in paths:
            h = _open_checked(file)
            self._handles[file] = h
            if meta is None:
                meta = h.metadata() or {}
            listing += self._list(h, file)
        meta = meta or {}
        self.nested = meta.get(EXPORT_MARKER) == EXPORT_VERSION
        odd = _json_field(meta, KEYS_FIELD) if self.nested else {}
        values = _json_field(meta, VALUES_FIELD) if self.nested else {}
        for t, dtype, shape in listing:
            key = split_name(t, odd) if self.nested else (t,)
            self._entries[key] = (t, TensorEntry(key, dtype, shape))
        self._values = {split_name(n, odd): v for n, v in values.items()}

    def _list(self, h: Any, file: str) -> list[tuple[str, torch.dtype, tuple[int, ...]]]:
        """(name, dtype, shape) of every tensor of the opened file ``file``; a name in two files is refused."""
        out = []
        for t in h.keys():
            sl = h.get_slice(t)
            dtype = _NAMES.get(sl.get_dtype())
            if dtype is None:
                raise InvalidDataError(
                    f"tensor {t!r} of {file!r} has the dtype {sl.get_dtype()}, which tddist does not convert"
                )
            if t in self._where:
                raise InvalidDataError(
                    f"tensor {t!r} is in both {self._where[t]!r} and {file!r}; the shards of one checkpoint hold "
                    f"each tensor once: check the directory"
                )
            self._where[t] = file
            out.append((t, dtype, tuple(sl.get_shape())))
        return out

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

    def close(self) -> None:
        """Drop the files' handles (their maps go with the last tensor read from them)."""
        self._handles.clear()


def _open_checked(path: str) -> Any:
    """``safe_open`` of the regular file ``path`` (opened without blocking), once its header is checked."""
    from safetensors import safe_open

    fd = open_regular(path, "safetensors file")
    try:
        check_header(fd, path)
        # the descriptor checked, by its path: the file cannot be swapped between the check and the map
        return safe_open(f"/proc/self/fd/{fd}", framework="pt")
    except InvalidDataError:
        raise
    except Exception as e:  # the library raises its own SafetensorError (and OSError)
        raise InvalidDataError(f"{path!r} is not a readable safetensors file: {e}") from None
    finally:
        os.close(fd)


def check_header(fd: int, path: str) -> None:
    """Refuse a safetensors file whose header is not bounded JSON, or whose tensors' bytes overlap or leave the data.

    The header is ``<u64 n><n bytes of JSON>``; each tensor's
    ``data_offsets`` ``[start, end]`` count from the end of the header.
    Two tensors sharing bytes would alias one another, and an offset past
    the data would read what is not there.
    """
    bad = f"{path!r} is not a readable safetensors file"
    size = os.fstat(fd).st_size
    head = _pread_exact(fd, 8, 0)
    n = int.from_bytes(head, "little") if len(head) == 8 else -1
    if n < 0 or n > MAX_HEADER_BYTES or 8 + n > size:
        raise InvalidDataError(f"{bad}: its header length ({n}) does not fit the file of {size} bytes")
    header = loads_json(_pread_exact(fd, n, 8), f"{bad}: its header", max_depth=8)
    if not isinstance(header, dict):
        raise InvalidDataError(f"{bad}: its header is not a JSON object")
    data = size - 8 - n
    spans = []
    for name, info in header.items():
        if name == "__metadata__":
            continue
        offsets = info.get("data_offsets") if isinstance(info, dict) else None
        if not (isinstance(offsets, list) and len(offsets) == 2 and all(type(o) is int for o in offsets)):
            raise InvalidDataError(f"{bad}: tensor {name!r} has no data_offsets [start, end]")
        start, end = offsets
        if not 0 <= start <= end <= data:
            raise InvalidDataError(
                f"{bad}: tensor {name!r} has the data_offsets {offsets}, outside the {data} bytes of data after the "
                f"header; the file is truncated or damaged"
            )
        spans.append((start, end, name))
    prev_end, prev = 0, ""
    for start, end, name in sorted(spans):
        if start == end:
            continue  # an empty tensor holds no bytes
        if start < prev_end:
            raise InvalidDataError(
                f"{bad}: tensors {prev!r} and {name!r} share bytes (data_offsets overlap), so one would alias the "
                f"other; the file is damaged or was tampered with: export it again"
            )
        prev_end, prev = end, name


def _pread_exact(fd: int, n: int, at: int) -> bytes:
    """``n`` bytes at ``at`` (fewer only at the end of the file)."""
    parts = []
    while n > 0:
        chunk = os.pread(fd, min(n, 1 << 24), at)
        if not chunk:
            break
        parts.append(chunk)
        n -= len(chunk)
        at += len(chunk)
    return b"".join(parts)


def _json_field(meta: dict, field: str) -> dict:
    text = meta.get(field)
    if text is None:
        return {}
    value = loads_json(text, f"the {field!r} metadata of this tddist export") if isinstance(text, str) else text
    if not isinstance(value, dict):
        raise InvalidDataError(f"the {field!r} metadata of this tddist export is damaged; export the checkpoint again")
    return value


def _index(path: str) -> tuple[list[str], dict]:
    """The shard files a sharded directory's index names (in order), and its metadata."""
    where = inside(path, INDEX_NAME, "index")
    doc = loads_json(read_regular(where, MAX_INDEX_BYTES, "index"), f"index {where!r}")
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
