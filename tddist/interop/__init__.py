"""Checkpoints of other formats, read and written leaf by leaf (used by ``tddist.convert``).

One module per format (``native``: tddist directories and archives,
``dcp``: torch.distributed.checkpoint, ``torch_file``: ``torch.save`` files,
``hf``: safetensors files and Hugging Face directories), and ``guard``:
what every reader checks of another format's files (regular files opened
without blocking, names inside the source, JSON of bounded depth). Each reader
is a ``Source``: it lists its tensor leaves (key, dtype, shape) and its
non-tensor values without reading data, and reads one whole leaf at a time,
so a conversion holds about one leaf in memory. Each writer takes a
``Selection`` (the source seen through ``--prefix`` and ``--dtype``).

Keys are tuples of strings, as in tddist. Flat formats name a leaf by
joining its key with "." (``("model", "w")`` -> ``"model.w"``); their
readers split names back only in a file that a tddist export marked (the
marker records any key whose parts hold a "." themselves), otherwise every
name stays one flat key.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from ..errors import InvalidArgumentError, InvalidDataError

if TYPE_CHECKING:
    import torch

    from .pages import MappedLeaves

Key = tuple[str, ...]

#: Format names, as ``convert(to=...)`` takes them.
FORMATS = ("tddist", "tdz", "dcp", "torch", "safetensors")

#: The marker a tddist export leaves in a flat file's metadata (value: ``EXPORT_VERSION``).
EXPORT_MARKER = "tddist.export"
EXPORT_VERSION = "1"
#: Beside the marker: JSON ``{flat name: [key parts]}`` for keys that "." cannot split back.
KEYS_FIELD = "tddist.keys"
#: Beside the marker in safetensors files: JSON ``{flat name: value}`` of the non-tensor values.
VALUES_FIELD = "tddist.values"


@dataclass(frozen=True)
class TensorEntry:
    """One tensor leaf of a source: its key, dtype and (global) shape."""

    key: Key
    dtype: torch.dtype
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize


class Source(Protocol):
    """A checkpoint opened for reading, leaf by leaf.

    ``nested`` is True when keys are tddist's own (a tddist checkpoint or a
    marked tddist export) or keep the source's nesting (``convert(nested=True)``);
    False when each key is one flat name.
    """

    kind: str
    nested: bool

    def tensors(self) -> list[TensorEntry]:
        """Every tensor leaf, in the source's order, without reading data."""
        ...

    def value_keys(self) -> list[Key]:
        """Every non-tensor value's key."""
        ...

    def read(self, entry: TensorEntry) -> torch.Tensor:
        """The whole leaf (a sharded leaf consolidated), on the CPU."""
        ...

    def value(self, key: Key) -> Any:
        """A non-tensor value, as plain Python (JSON-able where the source allows)."""
        ...

    def metadata(self) -> dict[str, Any]:
        """User metadata the source carries (a tddist manifest's ``metadata``), else empty."""
        ...

    def close(self) -> None:
        """Release what the source holds open (``convert`` calls it when it ends, also on error)."""
        ...


@dataclass(frozen=True)
class Selection:
    """The source as written out: keys under ``prefix`` with the prefix stripped, floating leaves cast to ``dtype``.

    ``progress(nbytes)`` is called after each leaf is read.
    """

    source: Source
    tensors: list[tuple[Key, TensorEntry]]  # (output key, source entry)
    values: list[tuple[Key, Key]]  # (output key, source key)
    dtype: torch.dtype | None
    progress: Callable[[int], None]

    @property
    def nested(self) -> bool:
        return self.source.nested

    def out_dtype(self, entry: TensorEntry) -> torch.dtype:
        if self.dtype is not None and entry.dtype.is_floating_point:
            return self.dtype
        return entry.dtype

    def out_nbytes(self, entry: TensorEntry) -> int:
        return math.prod(entry.shape) * self.out_dtype(entry).itemsize

    def read(self, entry: TensorEntry) -> torch.Tensor:
        t = self.source.read(entry)
        out = self.out_dtype(entry)
        if t.dtype != out:
            t = t.to(out)
        self.progress(entry.nbytes)
        return t

    def leaves(self) -> Iterator[tuple[Key, torch.Tensor]]:
        """Each tensor leaf in turn (one in memory at a time unless the caller keeps them)."""
        for key, entry in self.tensors:
            yield key, self.read(entry)

    def spilled_leaves(self, directory: str, mapped: MappedLeaves | None = None) -> Iterator[tuple[Key, torch.Tensor]]:
        """Each tensor leaf in turn, for a writer that keeps them all: at most one is held in anonymous memory.

        ``torch.save``, ``dcp.save`` and ``tddist.save`` take every leaf at
        once. A leaf read into memory (a DCP or safetensors source, a sharded
        or cast leaf) is written to a file in ``directory`` and handed on as a
        copy-on-write map of it; a leaf that already is a map of its source
        file that is its storage whole is handed on as it is (a view of a
        larger map is spilled: ``torch.save`` would write its whole storage,
        ``dcp.save`` copies it). Mapped pages are the kernel's page cache,
        which it reclaims under memory pressure; anonymous memory it cannot.
        Each leaf handed on as a map is recorded in ``mapped``, so that the
        writer can drop its pages once written (``interop.pages``).
        """
        from .pages import trim_heap

        spill = _Spill(directory)
        for key, entry in self.tensors:
            held, is_map = spill.hold(self.read(entry))  # the leaf read is freed here, before the next one is read
            if is_map:
                trim_heap()  # the freed leaf's memory leaves the process (see trim_heap)
                if mapped is not None:
                    mapped.add(held)
            yield key, held

    def value_items(self) -> Iterator[tuple[Key, Any]]:
        for key, src_key in self.values:
            yield key, self.source.value(src_key)

    @property
    def total_bytes(self) -> int:
        return sum(e.nbytes for _k, e in self.tensors)


#: Leaves below this size stay in memory when spilled (a file and a mapping each would cost more than they hold).
SPILL_MIN_BYTES = 1 << 20


class _Spill:
    """Files that hold read leaves out of anonymous memory; each file is unlinked as soon as it is mapped.

    So nothing is left behind, even by a killed process: the kernel frees a
    spilled leaf's file when its last map goes. Written with ``os.pwrite``
    (``_fs.pwrite_all``: no library streams a tensor to a file without a second copy in memory).
    """

    def __init__(self, directory: str) -> None:
        self.directory = directory
        self.count = 0

    def hold(self, t: torch.Tensor) -> tuple[torch.Tensor, bool]:
        """``t`` as a map of a file (spilled unless it already is one, its storage whole), and whether it is a map
        (a small leaf, or one not on the CPU, stays as it is)."""
        import torch

        from .._fs import pwrite_all
        from ..saving.memmaps import mapped_files

        nbytes = t.numel() * t.element_size()
        whole = t.storage_offset() == 0 and t.untyped_storage().nbytes() == nbytes and t.is_contiguous()
        if t.device.type != "cpu":
            return t, False
        if nbytes < SPILL_MIN_BYTES:  # a view of a larger storage (a data file's map) is copied out of it
            return (t if whole else t.clone()), False
        if whole and mapped_files({0: t}):
            return t, True
        flat = t.contiguous().reshape(-1).view(torch.uint8).numpy()
        self.count += 1
        path = os.path.join(self.directory, f".tddist-convert-spill-{os.getpid()}-{self.count}")
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
        try:
            os.unlink(path)
            pwrite_all(fd, memoryview(flat), 0)  # type: ignore[arg-type]  # numpy arrays are buffers
            mapped = torch.from_file(f"/proc/self/fd/{fd}", shared=False, size=nbytes, dtype=torch.uint8)
        finally:
            os.close(fd)
        return mapped.view(t.dtype).view(t.shape), True


def select(
    source: Source, prefix: str | None, dtype: torch.dtype | None, progress: Callable[[int], None] | None = None
) -> Selection:
    """The leaves of ``source`` under ``prefix`` (stripped), in order; refuses an empty or colliding result."""
    tensors = [(k, e) for e in source.tensors() if (k := strip_prefix(e.key, prefix)) is not None]
    values = [(k, s) for s in source.value_keys() if (k := strip_prefix(s, prefix)) is not None]
    if not tensors and not values:
        where = f"under the prefix {prefix!r}" if prefix else "in it"
        raise InvalidArgumentError(
            f"the {source.kind} source holds nothing {where}; check the prefix against the source's keys "
            f"(tddist ls, or tddist info, lists them for a tddist checkpoint)"
        )
    seen: set[Key] = set()
    for key in [k for k, _ in tensors] + [k for k, _ in values]:
        if key in seen or not key or not all(key):
            raise InvalidArgumentError(
                f"stripping the prefix {prefix!r} leaves the key {list(key)} twice or empty; use a shorter prefix"
            )
        seen.add(key)
    return Selection(source, tensors, values, dtype, progress or (lambda n: None))


def strip_prefix(key: Key, prefix: str | None) -> Key | None:
    """``key`` without ``prefix``, or None if the key is not under it.

    The prefix is the key's parts joined with "/" (``"model/"``), and may end
    inside a part (``"model."`` on the flat key ``("model.w",)`` gives ``("w",)``).
    """
    if not prefix:
        return key
    *whole, partial = prefix.split("/")
    n = len(whole)
    if tuple(key[:n]) != tuple(whole) or len(key) <= n or not key[n].startswith(partial):
        return None
    rest = key[n][len(partial) :]
    return ((rest,) if rest else ()) + tuple(key[n + 1 :])


def flat_names(keys: list[Key]) -> tuple[dict[Key, str], dict[str, list[str]]]:
    """Each key's flat name (parts joined with "."), and the keys that "." would not split back.

    Raises InvalidDataError when two keys get one name (``("a.b",)`` and ``("a", "b")``).
    """
    names: dict[Key, str] = {}
    owners: dict[str, Key] = {}
    odd: dict[str, list[str]] = {}
    for key in keys:
        name = ".".join(key)
        if name in owners:
            raise InvalidDataError(
                f"keys {list(owners[name])} and {list(key)} both become {name!r} in a flat format; rename one, "
                f"or export them separately with a prefix"
            )
        owners[name] = key
        names[key] = name
        if tuple(name.split(".")) != key:
            odd[name] = list(key)
    return names, odd


def split_name(name: str, odd: dict[str, Any]) -> Key:
    """The key of a flat name in a marked tddist export (inverse of ``flat_names``)."""
    parts = odd.get(name)
    if isinstance(parts, list) and parts and all(isinstance(p, str) for p in parts):
        return tuple(parts)
    return tuple(name.split("."))


def nested_dict(items: list[tuple[Key, Any]]) -> dict[str, Any]:
    """Nested dicts from (key, value) pairs; refuses a key that is both a leaf and a parent."""
    root: dict[str, Any] = {}
    for key, value in items:
        node = root
        for i, part in enumerate(key[:-1]):
            child = node.setdefault(part, {})
            if not isinstance(child, dict):
                raise InvalidDataError(f"{list(key[: i + 1])} is both a leaf and a parent of {list(key)}; rename one")
            node = child
        if key[-1] in node:
            raise InvalidDataError(f"{list(key)} is both a leaf and a parent of other keys; rename one")
        node[key[-1]] = value
    return root


def jsonable(value: Any) -> Any:
    """Tuples as lists, recursively (JSON has no tuples); everything else as it is."""
    if isinstance(value, (list, tuple)):
        return [jsonable(v) for v in value]
    if isinstance(value, dict):
        return {k: jsonable(v) for k, v in value.items()}
    return value


def pickle_refused(what: str, e: Exception) -> InvalidArgumentError:
    """The error for a source holding objects that ``torch.load(weights_only=True)`` refuses to unpickle."""
    return InvalidArgumentError(
        f"{what} holds objects that torch.load(weights_only=True) refuses ({str(e).splitlines()[0]}); pass "
        f"allow_pickle=True (--allow-pickle) only if you trust where it comes from"
    )
