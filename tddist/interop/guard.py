"""What every reader of another format checks before it trusts a file of the source.

A checkpoint from elsewhere may be damaged or hostile, and a conversion must
end in a ``TddistError``, never hang, crash or read outside the source:

- ``open_regular``: a file is opened without blocking (``O_NONBLOCK``: a FIFO
  would block the open forever) and refused unless it is a regular file
  (``fstat``), as ``storage/pinned.py`` opens a checkpoint's files;
- ``inside``: a name a source lists (a shard of a Hugging Face index, a
  data file of DCP's metadata) must stay inside the source's folder once
  symbolic links are resolved;
- ``loads_json``: JSON is parsed only when its nesting is bounded (Python's
  parser recurses once per level, and a deep enough document raises
  ``RecursionError``).

No torch here: ``tddist info`` uses ``foreign_kind`` without importing it.
"""

from __future__ import annotations

import json
import os
import stat
from typing import Any

from .._fs import is_inside
from ..errors import InvalidDataError, StorageError

#: DCP's metadata file, in a DCP checkpoint directory.
DCP_METADATA_NAME = ".metadata"
#: A Hugging Face directory: one safetensors file (``save_pretrained`` of a small model) or an index of shards.
HF_WEIGHTS_NAME = "model.safetensors"
HF_INDEX_NAME = "model.safetensors.index.json"
SAFETENSORS_SUFFIX = ".safetensors"
TORCH_SUFFIXES = (".pt", ".pth")

#: The deepest JSON tddist parses from another format (an index or safetensors metadata is a few levels deep).
MAX_JSON_DEPTH = 64

_DEPTH_BLOCK = 1 << 22


def open_regular(path: str, what: str) -> int:
    """A read-only descriptor of the regular file ``path``, opened without blocking.

    Raises:
        InvalidDataError: ``path`` is missing or is not a regular file (a FIFO, a device, a directory).
        StorageError: the file system refused the open.
    """
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except FileNotFoundError:
        raise InvalidDataError(f"{what} {path!r} does not exist; the checkpoint is incomplete") from None
    except OSError as e:
        raise StorageError(f"cannot open {what} {path!r}: {e}") from e
    try:
        mode = os.fstat(fd).st_mode
    except OSError as e:
        os.close(fd)
        raise StorageError(f"cannot stat {what} {path!r}: {e}") from e
    if not stat.S_ISREG(mode):
        os.close(fd)
        raise InvalidDataError(
            f"{what} {path!r} is not a regular file (a FIFO, a device or a directory); refusing to read it: the "
            f"checkpoint is damaged or was tampered with"
        )
    return fd


def read_regular(path: str, limit: int, what: str) -> bytes:
    """The whole regular file ``path`` (opened as ``open_regular`` does), refused above ``limit`` bytes."""
    fd = open_regular(path, what)
    try:
        size = os.fstat(fd).st_size
        if size > limit:
            raise InvalidDataError(f"{what} {path!r} has {size} bytes, more than tddist reads ({limit}); refusing it")
        chunks = []
        left = size + 1  # one more byte tells a file that grew meanwhile
        while left > 0:
            chunk = os.read(fd, min(left, 1 << 24))
            if not chunk:
                break
            chunks.append(chunk)
            left -= len(chunk)
    except OSError as e:
        raise StorageError(f"cannot read {what} {path!r}: {e}") from e
    finally:
        os.close(fd)
    data = b"".join(chunks)
    if len(data) != size:
        raise InvalidDataError(f"{what} {path!r} changed size while it was read; retry when nothing writes it")
    return data


def inside(folder: str, name: str, what: str) -> str:
    """``folder/name``, once checked to be a plain name whose resolved path stays inside ``folder``.

    Raises:
        InvalidDataError: ``name`` is not a plain file name, or a symbolic
            link takes it outside ``folder``.
    """
    if not name or "/" in name or "\0" in name or name in (".", ".."):
        raise InvalidDataError(
            f"{what} {name!r} in {folder!r} is not a plain file name beside it; the checkpoint is damaged or was "
            f"tampered with"
        )
    path = os.path.join(folder, name)
    if not is_inside(os.path.realpath(folder), path):
        raise InvalidDataError(
            f"{what} {path!r} is a symbolic link to {os.path.realpath(path)!r}, outside {folder!r}; tddist reads "
            f"only files inside the source folder: copy the file into it instead of linking it (or, for a single "
            f"file you trust, pass that file itself as the source)"
        )
    return path


def loads_json(text: str | bytes, what: str, max_depth: int = MAX_JSON_DEPTH) -> Any:
    """``json.loads(text)``, refused when nested deeper than ``max_depth`` or not JSON.

    The depth is counted first (``json_depth``), so no document makes the
    parser recurse past ``max_depth``.
    """
    try:
        s = text.decode() if isinstance(text, bytes) else text
    except UnicodeDecodeError as e:
        raise InvalidDataError(f"{what} is not UTF-8 JSON ({e}); the checkpoint is damaged") from None
    if json_depth(s) > max_depth:
        raise InvalidDataError(
            f"{what} nests JSON deeper than {max_depth} levels, which no checkpoint needs; refusing it: the "
            f"checkpoint is damaged or was tampered with"
        )
    try:
        return json.loads(s)
    except (ValueError, RecursionError) as e:
        raise InvalidDataError(f"{what} is not valid JSON ({e}); the checkpoint is damaged") from None


def json_depth(s: str) -> int:
    """How deep the brackets of the JSON text ``s`` nest, outside its strings; in time linear in ``len(s)``.

    Escaped backslashes, then escaped quotes, are dropped, so that every
    quote left opens or closes a string; the text between strings is every
    other piece between quotes. Its brackets are ASCII bytes that no other
    UTF-8 character contains; their running depth is a cumulative sum, taken
    in blocks (numpy: a document may hold millions of brackets).
    """
    import numpy as np

    outside = "".join(s.replace("\\\\", "").replace('\\"', "").split('"')[::2]).encode()
    raw = np.frombuffer(outside, dtype=np.uint8)
    opens = (raw == ord("[")) | (raw == ord("{"))
    brackets = opens[opens | (raw == ord("]")) | (raw == ord("}"))]  # True opens, False closes
    depth = deepest = 0
    for at in range(0, brackets.size, _DEPTH_BLOCK):
        running = np.cumsum(np.where(brackets[at : at + _DEPTH_BLOCK], 1, -1).astype(np.int32)) + depth
        deepest, depth = max(deepest, int(running.max())), int(running[-1])
    return deepest


def hf_weights(folder: str) -> str | None:
    """What a Hugging Face directory holds: ``model.safetensors`` (preferred, as ``from_pretrained`` does), its index, or None."""
    for name in (HF_WEIGHTS_NAME, HF_INDEX_NAME):
        if os.path.isfile(os.path.join(folder, name)):
            return name
    return None


def foreign_kind(path: str) -> str | None:
    """What ``path`` is when it is a checkpoint of another format that ``tddist convert`` reads, in words; else None."""
    if os.path.isdir(path):
        if os.path.isfile(os.path.join(path, DCP_METADATA_NAME)):
            return f"a torch.distributed.checkpoint (DCP) directory (it holds {DCP_METADATA_NAME})"
        found = hf_weights(path)
        if found is not None:
            return f"a Hugging Face safetensors directory (it holds {found})"
        return None
    lower = path.lower()
    if os.path.isfile(path) and lower.endswith(SAFETENSORS_SUFFIX):
        return "a safetensors file"
    if os.path.isfile(path) and lower.endswith(TORCH_SUFFIXES):
        return "a torch.save file"
    return None
