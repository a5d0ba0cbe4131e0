"""Where the bytes of each chunk are: a file of its own, or a span of its rank's packed data file.

With packing "memmap" (version 1, archives, ``layout="memmap"``) each chunk
is a file named after its rank and key. With packing "packed" each rank's
chunks lie in one data file, in the manifest's leaf order, at offsets that
``packed_offsets`` (below) derives from the chunk sizes: the writer and every
reader compute them the same way, so the manifest stores none.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .. import format as fmt
from ..core.types import Key
from .chunks import Chunk, ReplicaChunks
from .model import Leaf, Manifest


@dataclass(frozen=True, slots=True)
class Location:
    """A chunk's bytes: ``nbytes`` at ``offset`` of ``relpath``, a file of ``file_size`` bytes."""

    relpath: str
    offset: int
    nbytes: int
    file_size: int


class Locator:
    """Locates the chunks of one checkpoint (a rank's packed offsets are computed once, when first needed)."""

    def __init__(self, manifest: Manifest):
        self.manifest = manifest
        self._packed: dict[int, tuple[dict[Key, int], int]] = {}
        self._all: PackedChunks | None = None

    def relpath(self, key: Key, rank: int) -> str:
        """The file holding ``rank``'s chunk of the leaf ``key``: its rank's data file (packing "packed"), or
        a file of its own."""
        m = self.manifest
        return fmt.rank_data_name(rank) if m.packing == "packed" else fmt.leaf_relpath(rank, key, m.robust_key)

    def locate(self, leaf: Leaf, chunk: Chunk) -> Location:
        if self.manifest.packing != "packed":
            return Location(self.relpath(leaf.key, chunk.rank), 0, chunk.nbytes, chunk.nbytes)
        offsets, size = self.packed(chunk.rank)
        return Location(fmt.rank_data_name(chunk.rank), offsets.get(leaf.key, 0), chunk.nbytes, size)

    def packed(self, rank: int) -> tuple[dict[Key, int], int]:
        """Each leaf's offset in ``rank``'s data file (the leaves it stored bytes of), and the file's size.

        The first rank asked for is computed alone (one pass over the leaves:
        a rank loading its own rows); from the second one on, every chunk of
        every rank is placed at once (``every_rank``: a load of the whole checkpoint).
        """
        found = self._packed.get(rank)
        if found is not None:
            return found
        if not self._packed and self._all is None:
            leaves = self.manifest.leaves
            nbytes = np.array([leaf.table.nbytes_of_rank(rank) for leaf in leaves.values()], np.int64)
            offsets, total = packed_offsets(nbytes)
            found = ({k: o for k, o, n in zip(leaves, offsets.tolist(), nbytes.tolist()) if n}, int(total))
        else:
            found = self.every_rank().of_rank(rank, list(self.manifest.leaves))
        self._packed[rank] = found
        return found

    def every_rank(self) -> PackedChunks:
        """Where every chunk that holds bytes lies in its rank's data file (computed once)."""
        if self._all is None:
            self._all = PackedChunks.of(self.manifest)
        return self._all


@dataclass(frozen=True)
class PackedChunks:
    """Every chunk that holds bytes, ordered by rank, then by leaf (the order of a packed data file), in columns.

    Only chunks of at least one byte are listed, so its size follows the
    index (a chunk per rank of a sharded leaf) and the leaves, never the
    world size alone: a rank that stored nothing has no row, and a data
    file of size 0. 16 bytes per chunk (ranks, leaves and chunk positions
    fit in int32: at most 2^24 ranks, and fewer leaves than a manifest of
    256 MiB can list).

    Attributes:
        ranks: each chunk's rank (int32[n], sorted).
        leaves: each chunk's leaf, as its position in the manifest's leaves (int32[n]).
        chunks: each chunk's position in its leaf's table (int32[n]).
        offsets: where each chunk starts in its rank's data file (int64[n]).
        sizes: the size of each data file that holds bytes, by rank (every other rank's is 0).
    """

    ranks: np.ndarray
    leaves: np.ndarray
    chunks: np.ndarray
    offsets: np.ndarray
    sizes: dict[int, int]

    @staticmethod
    def of(manifest: Manifest) -> PackedChunks:
        """Place every chunk of ``manifest`` that holds bytes: sort by (rank, leaf), then one cumulative sum."""
        ranks, leaves, chunks, nbytes = _stored_chunks(manifest)
        order = np.lexsort((leaves, ranks))
        ranks, leaves, chunks, padded = ranks[order], leaves[order], chunks[order], nbytes[order]
        del order, nbytes
        pad_in_place(padded)  # each chunk rounded up to the alignment
        offsets = np.cumsum(padded, dtype=np.int64)  # at most MAX_TOTAL_BYTES plus padding: no wrap
        offsets -= padded  # where each chunk starts, counted over every rank's chunks together
        first = np.flatnonzero(np.diff(ranks, prepend=-1))  # where each rank's chunks begin
        counts = np.diff(np.append(first, len(ranks)))
        base = offsets[first]
        last = first + counts - 1
        sizes = dict(zip(ranks[first].tolist(), (offsets[last] + padded[last] - base).tolist()))
        offsets -= np.repeat(base, counts)
        return PackedChunks(ranks, leaves, chunks, offsets, sizes)

    def rows_of(self, rank: int) -> slice:
        """The rows of ``rank``'s chunks."""
        return slice(int(np.searchsorted(self.ranks, rank, "left")), int(np.searchsorted(self.ranks, rank, "right")))

    def of_rank(self, rank: int, keys: list[Key]) -> tuple[dict[Key, int], int]:
        """Each leaf's offset in ``rank``'s data file (``keys``: the manifest's leaf keys), and the file's size."""
        rows = self.rows_of(rank)
        offsets = dict(zip([keys[i] for i in self.leaves[rows].tolist()], self.offsets[rows].tolist()))
        return offsets, self.sizes.get(rank, 0)

    def file_sizes(self) -> dict[int, int]:
        """The size of each data file that holds bytes, by rank (every other rank's is 0)."""
        return self.sizes


def _stored_chunks(manifest: Manifest) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """(rank, leaf position, chunk position, nbytes) of every chunk of at least one byte, in leaf order.

    Replicated leaves (one chunk each; often most of a model) are gathered
    in Python lists; the others' columns in numpy.
    """
    single: list[tuple[int, int, int, int]] = []
    parts: list[tuple[np.ndarray, ...]] = []
    for i, leaf in enumerate(manifest.leaves.values()):
        t = leaf.table
        if isinstance(t, ReplicaChunks):
            n = t.nbytes_of_rank(t.writer)
            if n:
                single.append((t.writer, i, 0, n))
            continue
        cols = t.columns()
        held = np.flatnonzero(cols.nbytes)
        if len(held):
            parts.append((cols.ranks[held], np.full(len(held), i, np.int64), held, cols.nbytes[held]))
    if single:
        rows = np.array(single, dtype=np.int64).reshape(-1, 4)
        parts.append(tuple(rows[:, c] for c in range(4)))
    types = (np.int32, np.int32, np.int32, np.int64)  # rank, leaf and chunk positions; bytes
    if not parts:
        return tuple(np.zeros(0, t) for t in types)  # type: ignore[return-value]
    return tuple(np.concatenate([np.asarray(p[c], t) for p in parts]) for c, t in enumerate(types))  # type: ignore[return-value]


def pad_in_place(nbytes: np.ndarray) -> np.ndarray:
    """Each size rounded up to ``format.PACK_ALIGN``, in place (``nbytes``: a fresh int64 array); returns it."""
    nbytes += fmt.PACK_ALIGN - 1
    nbytes //= fmt.PACK_ALIGN
    nbytes *= fmt.PACK_ALIGN
    return nbytes


def packed_offsets(nbytes: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Where each chunk of a packed data file starts, and the file's size.

    Chunks follow the manifest's leaf order (axis 0 of ``nbytes``); each starts
    at a multiple of ``format.PACK_ALIGN`` (its size rounded up), so a chunk
    maps without a copy. ``nbytes`` holds 0 for leaves a rank did not store;
    it is one rank's column (int64[leaves], the size is then a 0-d array) or
    every rank's (int64[leaves, ranks]: offsets and sizes of every rank's
    file at once). Writers and readers both call this: offsets are never stored.
    """
    padded = (nbytes + fmt.PACK_ALIGN - 1) // fmt.PACK_ALIGN * fmt.PACK_ALIGN
    ends = np.cumsum(padded, axis=0, dtype=np.int64)
    sizes = ends[-1] if len(ends) else np.zeros(nbytes.shape[1:], dtype=np.int64)
    return ends - padded, sizes


@dataclass(frozen=True, slots=True)
class ChunkRange:
    """Bytes ``[start, stop)`` of the chunk at ``location`` that a load reads."""

    location: Location
    start: int
    stop: int


def merged_ranges(ranges: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """``(start, stop)`` byte ranges sorted, with the ones that overlap or touch joined."""
    out: list[tuple[int, int]] = []
    for lo, hi in sorted(ranges):
        if out and lo <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], hi))
        else:
            out.append((lo, hi))
    return out


@dataclass(frozen=True, slots=True)
class FileSpan:
    """Bytes ``[start, stop)`` of the checkpoint's file ``relpath`` (a range several chunks may share)."""

    relpath: str
    start: int
    stop: int


def kept_offsets(nbytes: np.ndarray, held: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """A rank's data object on object storage with references (docs/format.md 13.3): where each of its chunks
    starts in it, and its size: ``packed_offsets`` with 0 for every referenced chunk (``held``: its holder,
    0 for a chunk this checkpoint holds), so only the chunks it holds take space, in leaf order."""
    return packed_offsets(np.where(np.asarray(held) == 0, nbytes, 0))


@dataclass(frozen=True)
class CutFiles:
    """The data objects of a checkpoint with references on object storage (docs/format.md 13.3): each rank's
    data file of section 2.3 without the ranges of its referenced chunks. Readers keep placing chunks at the
    offsets of section 2.3; ``pieces`` says where those bytes lie in the object.

    Attributes:
        ranks: each kept chunk's rank (int32[n], sorted, then by offset).
        starts: where it starts in the data file of section 2.3 (int64[n]).
        spans: its size rounded up to the alignment (int64[n]).
        at: where it starts in the object (int64[n]).
        sizes: each object's size, by rank (0 where absent).
    """

    ranks: np.ndarray
    starts: np.ndarray
    spans: np.ndarray
    at: np.ndarray
    sizes: dict[int, int]

    @staticmethod
    def of(manifest: Manifest) -> CutFiles:
        """Every kept chunk of ``manifest`` (one with at least one byte, held by this checkpoint), in columns."""
        placed = PackedChunks.of(manifest)
        n = len(placed.ranks)
        ends = np.empty(n, np.int64)
        ends[:-1] = placed.offsets[1:]
        last = np.flatnonzero(np.diff(placed.ranks, append=np.int32(-1)))  # each rank's last chunk
        ends[last] = [placed.sizes[int(r)] for r in placed.ranks[last].tolist()]
        spans = ends - placed.offsets
        held = np.zeros(n, dtype=bool)
        order = np.argsort(placed.leaves, kind="stable")
        bounds = np.searchsorted(placed.leaves[order], np.arange(len(manifest.leaves) + 1))
        for li, leaf in enumerate(manifest.leaves.values()):
            if leaf.refs is not None and bounds[li] < bounds[li + 1]:
                rows = order[bounds[li] : bounds[li + 1]]
                held[rows] = leaf.refs.holders[placed.chunks[rows]] != 0
        keep = ~held
        ranks, starts, spans = placed.ranks[keep], placed.offsets[keep], spans[keep]
        at = np.cumsum(spans, dtype=np.int64) - spans
        first = np.flatnonzero(np.diff(ranks, prepend=np.int32(-1)))
        counts = np.diff(np.append(first, len(ranks)))
        at -= np.repeat(at[first], counts)
        sizes = dict(zip(ranks[first].tolist(), (at[first + counts - 1] + spans[first + counts - 1]).tolist()))
        return CutFiles(ranks, starts, spans, at, sizes)

    def pieces(self, rank: int, lo: int, hi: int) -> list[tuple[int, int, int]]:
        """Bytes ``[lo, hi)`` of ``rank``'s data file of section 2.3, as (start, stop) ranges of its object and
        where each lands from ``lo``; the ranges of referenced chunks are in none (they read as zeros)."""
        a, b = int(np.searchsorted(self.ranks, rank, "left")), int(np.searchsorted(self.ranks, rank, "right"))
        starts, spans, at = self.starts[a:b], self.spans[a:b], self.at[a:b]
        i = max(int(np.searchsorted(starts, lo, "right")) - 1, 0)
        out: list[tuple[int, int, int]] = []
        while i < len(starts) and int(starts[i]) < hi:
            s, e = max(lo, int(starts[i])), min(hi, int(starts[i] + spans[i]))
            if s < e:
                o = int(at[i]) + s - int(starts[i])
                if out and out[-1][1] == o and out[-1][2] + (out[-1][1] - out[-1][0]) == s - lo:
                    out[-1] = (out[-1][0], o + e - s, out[-1][2])
                else:
                    out.append((o, o + e - s, s - lo))
            i += 1
        return out
