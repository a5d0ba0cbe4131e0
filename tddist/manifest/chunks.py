"""The chunks of one leaf, in columns: numpy arrays instead of one object per chunk.

At thousands of ranks and leaves a checkpoint has millions of chunks; a rank
that loads its own rows needs a handful of them. A table keeps the chunks of
a leaf as arrays (views of the manifest's index where possible) and builds a
``Chunk`` only when one is asked for. Three kinds, one per placement:

- ``ShardChunks``: one chunk per rank, cut along one dim; chunk ``r`` holds
  ``lengths[r]`` rows starting at the sum of the lengths before it. Finding
  the chunks a box overlaps is a bisection on those starts.
- ``ReplicaChunks``: one chunk, the whole leaf, written by one rank.
- ``BoxChunks``: any boxes (a DTensor's local shards), with their ranks.

No torch here: the manifest is read and validated without it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from ..core.sharding import Box, full_box, shard_box


@dataclass(frozen=True, slots=True)
class Chunk:
    """One stored piece of a leaf: who wrote it, where it lies in the global tensor, its bytes."""

    rank: int
    box: Box
    nbytes: int
    checksum: str


@dataclass(frozen=True, slots=True)
class ChunkColumns:
    """Every chunk of a leaf as three columns, in chunk order (what whole-checkpoint passes vectorise over).

    Attributes:
        ranks: the rank that wrote each chunk (int64[n]).
        nbytes: each chunk's size in bytes (int64[n]; 0 for an empty chunk, which has no file).
        checksums: each chunk's checksum (uint64[n]).
    """

    ranks: np.ndarray
    nbytes: np.ndarray
    checksums: np.ndarray


@dataclass(frozen=True, slots=True)
class LeafStats:
    """A counted floating leaf's non-finite values (format version 4), sparse: only the chunks that hold any,
    so a clean leaf costs nothing however many chunks it has.

    Attributes:
        chunks: the indices (in chunk order) of the chunks that hold a NaN or an infinite value, increasing
            (int64[k]; empty for a leaf whose values are all finite).
        nan: each of those chunks' NaN count (uint64[k]).
        inf: each of those chunks' count of infinite values (uint64[k]).
    """

    chunks: np.ndarray
    nan: np.ndarray
    inf: np.ndarray

    @property
    def finite(self) -> bool:
        """Every value of the leaf is finite."""
        return len(self.chunks) == 0

    def total(self) -> tuple[int, int]:
        """The whole leaf's NaN and Inf counts."""
        return int(self.nan.sum(dtype=np.uint64)), int(self.inf.sum(dtype=np.uint64))


#: The counts of a leaf whose values are all finite.
FINITE = LeafStats(np.zeros(0, dtype="<i8"), np.zeros(0, dtype="<u8"), np.zeros(0, dtype="<u8"))


def hex_checksum(value: int) -> str:
    """A chunk checksum (an unsigned 64-bit integer) as the manifest's 16 hex digits."""
    return f"{int(value):016x}"


def int_checksum(text: str) -> int:
    """Inverse of ``hex_checksum``."""
    return int(text, 16)


def starts_of(lengths: np.ndarray) -> np.ndarray:
    """Where each of consecutive runs of ``lengths`` starts, and where the last one ends (int64[n + 1])."""
    return np.concatenate(([0], np.cumsum(lengths, dtype=np.int64)))


class ShardChunks:
    """One chunk per rank along ``dim``: ``lengths`` (int64) and ``checksums`` (uint64), in rank order."""

    # Slots: a manifest holds one table per leaf (100,000s), and an object without a ``__dict__`` is one
    # object less for the collector to walk.
    __slots__ = ("shape", "dim", "itemsize", "lengths", "checksums", "_starts")

    def __init__(
        self,
        shape: tuple[int, ...],
        dim: int,
        itemsize: int,
        lengths: np.ndarray,
        checksums: np.ndarray,
        starts: np.ndarray | None = None,
    ):
        """``starts``: those of ``lengths`` (see ``starts``), when they are already known: the leaves of one
        node share its rows, and their starts."""
        self.shape, self.dim, self.itemsize = shape, dim, itemsize
        self.lengths, self.checksums = lengths, checksums
        self._starts: np.ndarray | None = starts

    def __len__(self) -> int:
        return len(self.lengths)

    @property
    def row_bytes(self) -> int:
        """Bytes of one index along the shard dim."""
        return math.prod(s for i, s in enumerate(self.shape) if i != self.dim) * self.itemsize

    def starts(self) -> np.ndarray:
        """Where each rank's chunk starts along the shard dim, and the end (computed once, in numpy)."""
        if self._starts is None:
            self._starts = starts_of(self.lengths)
        return self._starts

    def chunk(self, i: int) -> Chunk:
        start = int(self.starts()[i])
        length = int(self.lengths[i])
        box = shard_box(self.shape, self.dim, start, start + length)
        return Chunk(i, box, length * self.row_bytes, hex_checksum(self.checksums[i]))

    def overlapping(self, box: Box) -> list[int]:
        """Indices of the chunks that share elements with ``box``."""
        if math.prod(box[1]) == 0:
            return []
        lo, hi = box[0][self.dim], box[0][self.dim] + box[1][self.dim]
        s = self.starts()
        first = max(int(np.searchsorted(s, lo, side="right")) - 1, 0)
        last = int(np.searchsorted(s, hi, side="left"))  # chunks from here on start at or after hi
        return [i for i in range(first, min(last, len(self.lengths))) if s[i + 1] > lo and self.lengths[i] > 0]

    def index_of_rank(self, rank: int) -> int | None:
        return rank if 0 <= rank < len(self.lengths) else None

    def nbytes_of_rank(self, rank: int) -> int:
        """Bytes ``rank`` stored for this leaf."""
        return int(self.lengths[rank]) * self.row_bytes

    def columns(self) -> ChunkColumns:
        """Every chunk in columns: chunk ``r`` is rank ``r``'s."""
        n = len(self.lengths)
        return ChunkColumns(np.arange(n, dtype=np.int64), self.lengths * self.row_bytes, self.checksums)


class ReplicaChunks:
    """The whole leaf, stored once by ``writer``."""

    __slots__ = ("shape", "itemsize", "writer", "checksum")

    def __init__(self, shape: tuple[int, ...], itemsize: int, writer: int, checksum: int):
        self.shape, self.itemsize, self.writer, self.checksum = shape, itemsize, writer, checksum

    def __len__(self) -> int:
        return 1

    def chunk(self, i: int) -> Chunk:
        nbytes = math.prod(self.shape) * self.itemsize
        return Chunk(self.writer, full_box(self.shape), nbytes, hex_checksum(self.checksum))

    def overlapping(self, box: Box) -> list[int]:
        return [0] if math.prod(box[1]) else []

    def index_of_rank(self, rank: int) -> int | None:
        return 0 if rank == self.writer else None

    def nbytes_of_rank(self, rank: int) -> int:
        return math.prod(self.shape) * self.itemsize if rank == self.writer else 0

    def columns(self) -> ChunkColumns:
        nbytes = math.prod(self.shape) * self.itemsize
        return ChunkColumns(
            np.array([self.writer], np.int64), np.array([nbytes], np.int64), np.array([self.checksum], np.uint64)
        )


class BoxChunks:
    """Arbitrary boxes: ``ranks`` (int64[n]), ``offsets`` and ``sizes`` (int64[n, ndim]), ``checksums`` (uint64[n])."""

    __slots__ = ("itemsize", "ranks", "offsets", "sizes", "checksums")

    def __init__(self, itemsize: int, ranks: np.ndarray, offsets: np.ndarray, sizes: np.ndarray, checksums: np.ndarray):
        self.itemsize, self.ranks, self.offsets, self.sizes, self.checksums = itemsize, ranks, offsets, sizes, checksums

    def __len__(self) -> int:
        return len(self.ranks)

    def box(self, i: int) -> Box:
        return tuple(int(x) for x in self.offsets[i]), tuple(int(x) for x in self.sizes[i])

    def chunk(self, i: int) -> Chunk:
        box = self.box(i)
        return Chunk(int(self.ranks[i]), box, math.prod(box[1]) * self.itemsize, hex_checksum(self.checksums[i]))

    def overlapping(self, box: Box) -> list[int]:
        if len(self.ranks) == 0 or math.prod(box[1]) == 0:
            return []
        lo = np.asarray(box[0], dtype=np.int64)
        hi = lo + np.asarray(box[1], dtype=np.int64)
        inter = (np.minimum(self.offsets + self.sizes, hi) - np.maximum(self.offsets, lo)) > 0
        return [int(i) for i in np.nonzero(inter.all(axis=1))[0]]

    def index_of_rank(self, rank: int) -> int | None:
        hits = np.nonzero(self.ranks == rank)[0]
        return int(hits[0]) if len(hits) else None

    def nbytes_of_rank(self, rank: int) -> int:
        i = self.index_of_rank(rank)
        return 0 if i is None else int(np.prod(self.sizes[i], dtype=np.int64)) * self.itemsize

    def columns(self) -> ChunkColumns:
        nbytes = np.prod(self.sizes, axis=1, dtype=np.int64).reshape(-1) * self.itemsize
        return ChunkColumns(self.ranks, nbytes, self.checksums)


ChunkTable = ShardChunks | ReplicaChunks | BoxChunks


def table_from_chunks(
    shape: tuple[int, ...], placement_dim: int | None, itemsize: int, kind: str, chunks: list[Chunk]
) -> ChunkTable:
    """A table from ``Chunk`` objects (a version-1 manifest lists every chunk)."""
    sums = np.array([int_checksum(c.checksum) for c in chunks], dtype=np.uint64)
    if kind == "shard":
        assert placement_dim is not None
        lengths = np.array([c.box[1][placement_dim] for c in chunks], dtype=np.int64)
        return ShardChunks(shape, placement_dim, itemsize, lengths, sums)
    if kind == "replicate":
        return ReplicaChunks(shape, itemsize, chunks[0].rank, int(sums[0]))
    ndim = len(shape)
    return BoxChunks(
        itemsize,
        np.array([c.rank for c in chunks], dtype=np.int64),
        np.array([c.box[0] for c in chunks], dtype=np.int64).reshape(-1, ndim),
        np.array([c.box[1] for c in chunks], dtype=np.int64).reshape(-1, ndim),
        sums,
    )
