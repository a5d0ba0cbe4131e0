"""A committed directory checkpoint whose files are held in memory: read by a load without touching a disk.

The node-local tier's restore receives a peer's copy of a part over the
network (``jobs.transfer``), hashes every file as it arrives, and loads it
from these bytes while the rest arrives; writing them to the local directory
waits until the restore returned. ``MemoryStore`` is the read side of a store
(``opened.Readable``) over such files: ``open`` validates the manifest as any
store does (its checksum, its index), and each chunk is a view of the bytes
received (``MemoryFiles``), its size checked against the manifest's.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from .. import format as fmt
from ..errors import CheckpointNotFoundError, CorruptCheckpointError
from ..manifest.model import IndexBytes
from .opened import ChunkFiles, ManifestBytes, OpenedCheckpoint, Pin, validate

if TYPE_CHECKING:
    import torch

    from ..manifest.locate import ChunkRange, FileSpan, Location


#: Bytes of a file received in place elsewhere (``jobs.direct``: the state's tensors), by file: ``(offset in the
#: file, those bytes)``, by offset.
Regions = tuple[tuple[int, "torch.Tensor"], ...]

#: Called before a file's bytes are read: ``ready(name, end)`` returns once its first ``end`` bytes are there.
Ready = Callable[[str, int], None]


def region_of(regions: Regions, start: int, stop: int) -> torch.Tensor | None:
    """The bytes ``[start, stop)`` of a file if they lie in one of its ``regions``, else None."""
    i = bisect.bisect_right([r[0] for r in regions], start) - 1
    if i >= 0:
        offset, view = regions[i]
        if stop <= offset + view.numel():
            return view[start - offset : stop - offset]
    return None


def _there(_name: str, _end: int) -> None:
    """Every byte is there."""


@dataclass(frozen=True)
class MemoryPin:
    """The one generation of an in-memory checkpoint (a ``Pin``: nothing to hold, nothing to release)."""

    path: str
    files: Mapping[str, torch.Tensor]
    ready: Ready
    direct: Mapping[str, Regions]
    archive = False

    def close(self) -> None:
        """Nothing to release."""


@dataclass(frozen=True)
class MemoryStore:
    """The read side of a store over a directory checkpoint's files in memory (an ``opened.Readable``).

    The files may still be arriving: each read of a file's bytes first
    calls ``ready`` (it returns once they are there), so a load reads the
    leaves that arrived while the rest is in flight.

    Attributes:
        target: what the checkpoint is called in messages (where its bytes came from).
        files: each file's bytes (a flat uint8 tensor), by its path relative to the checkpoint.
        ready: waits for the first bytes of a file (default: every byte is there).
        direct: bytes of the files received elsewhere (read from there; ``files`` holds the rest).
    """

    target: str
    files: Mapping[str, torch.Tensor]
    ready: Ready = _there
    direct: Mapping[str, Regions] = field(default_factory=dict)

    def open(self) -> OpenedCheckpoint:
        """Validate the manifest held in memory (its checksum, its index); the chunks are read from memory.

        Raises:
            CheckpointNotFoundError: no manifest among the files.
            ManifestError: the manifest is not valid.
        """
        raw = self.files.get(fmt.MANIFEST_NAME)
        if raw is None:
            raise CheckpointNotFoundError(f"the copy received from {self.target} has no manifest; it is not committed")
        self.ready(fmt.MANIFEST_NAME, raw.numel())
        index = self.files.get(fmt.INDEX_NAME)
        if index is not None:
            self.ready(fmt.INDEX_NAME, index.numel())
        found = ManifestBytes(
            MemoryPin(self.target, self.files, self.ready, self.direct),
            raw.numpy().tobytes(),
            IndexBytes(index.numpy().tobytes() if index is not None else None),
            f"manifest of the copy received from {self.target}",
        )
        return validate(found, self.reader)

    @staticmethod
    def reader(pin: Pin) -> ChunkFiles:
        """The chunks of ``pin`` (a ``MemoryPin``)."""
        assert isinstance(pin, MemoryPin)
        return MemoryFiles(pin.path, pin.files, pin.ready, pin.direct)


class MemoryFiles:
    """The chunks of an in-memory checkpoint: views of its files' bytes (an ``opened.ChunkFiles``)."""

    fetches_ahead = False

    def __init__(
        self,
        root: str,
        files: Mapping[str, torch.Tensor],
        ready: Ready = _there,
        direct: Mapping[str, Regions] | None = None,
    ) -> None:
        self.root = root
        self._files = files
        self._ready = ready
        self._direct = direct or {}

    shares_pages = False

    def prefetch(self, ranges: Sequence[ChunkRange], num_threads: int) -> None:
        """Nothing to fetch: the bytes are in memory."""

    def warm(self, spans: Sequence[FileSpan]) -> None:
        """Nothing shared to warm: the bytes are in this process's memory."""

    def span(self, location: Location) -> torch.Tensor:
        """The chunk's bytes: a view of its file (whose size the manifest's must match)."""
        data = self._files.get(location.relpath)
        if data is None:
            raise CorruptCheckpointError(f"{location.relpath!r} is missing from the copy received from {self.root}")
        if data.numel() != location.file_size:
            raise CorruptCheckpointError(
                f"{location.relpath!r} of the copy received from {self.root} has {data.numel()} bytes, the manifest "
                f"says {location.file_size}; the copy is damaged"
            )
        start, stop = location.offset, location.offset + location.nbytes
        self._ready(location.relpath, stop)
        regions = self._direct.get(location.relpath)
        placed = region_of(regions, start, stop) if regions and stop > start else None
        return data[start:stop] if placed is None else placed  # a span over regions: their bytes are not read

    def release(self, span: torch.Tensor) -> None:
        """Nothing to drop: anonymous memory."""
