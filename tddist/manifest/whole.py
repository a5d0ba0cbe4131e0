"""Whole leaves, planned in columns: which bytes of which rank's file land where in each output tensor.

A load that reads a leaf whole (``shard=None`` in one process, a replicated
leaf, any box that is the leaf's full box) reads every chunk of it, and each
chunk lands whole in the output. Planned chunk by chunk (``Leaf.overlapping``,
``core.sharding.plan_reads``, ``Locator.locate``) that is Python work per rank
and per leaf: minutes at 16,384 ranks x 1,000 leaves. Here it is numpy over
every rank at once:

- ``file_offsets`` places every chunk in its rank's packed data file (the
  offsets ``locate.packed_offsets`` derives) without a loop per rank: the
  sharded leaves' padded sizes form a leaves x ranks matrix (no larger than
  the manifest's own index, which holds a length per rank and sharded leaf),
  the chunks of replicated and DTensor leaves (few, or one per rank that holds
  a box) are added where they fall, and one cumulative sum down the leaves
  gives every offset and every file's size.
- ``plan_whole`` turns the requested leaves into ``WholePieces``: one row per
  chunk that holds bytes, with its rank, its position in its leaf's table, its
  offset in the rank's file, its size and where its first byte lands in the
  output (``targets``, in bytes). A chunk of a leaf sharded along dim 0, or a
  replicated leaf, is one contiguous byte range of the output; along a dim
  ``d > 0`` it is a strided block (the output seen as ``[pre, rows, post]``:
  ``pre`` runs of its bytes); a DTensor box is a box of the output, whose
  first element ``targets`` names.

No torch and no file: the reader (``loading.whole``) maps each rank's file
once and copies the pieces. With packing "memmap" (one file per chunk) the
offsets are 0 and only the destinations are planned.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from .chunks import BoxChunks, ReplicaChunks, ShardChunks
from .locate import pad_in_place
from .model import Leaf, Manifest


@dataclass(frozen=True)
class FileOffsets:
    """Where every chunk of the covered ranks starts in its rank's packed data file.

    Attributes:
        ranks: the ranks covered (sorted, int64[k]); ``None`` when every rank is.
        shard_rows: each leaf's row in ``offsets`` (int64[leaves]; -1 for a leaf not sharded by rank).
        offsets: int64[sharded leaves + 1, k]: where each sharded leaf's chunk starts in each covered rank's
            file; the last row is each file's size.
        sparse_leaves, sparse_ranks, sparse_offsets: the chunks of replicated and DTensor leaves that hold
            bytes, in leaf order, then chunk order: their leaf's position, their rank, where they start.
    """

    ranks: np.ndarray | None
    shard_rows: np.ndarray
    offsets: np.ndarray
    sparse_leaves: np.ndarray
    sparse_ranks: np.ndarray
    sparse_offsets: np.ndarray

    def column(self, ranks: np.ndarray) -> np.ndarray:
        """The column of each of ``ranks`` (covered ranks) in ``offsets``."""
        return ranks if self.ranks is None else np.searchsorted(self.ranks, ranks)

    def offset_of(self, position: int, rank: int) -> tuple[int, int]:
        """Where ``rank``'s chunk of the leaf at ``position`` starts (a chunk that holds bytes, of a covered
        rank), and the size of ``rank``'s data file."""
        col = int(self.column(np.array([rank]))[0])
        row = int(self.shard_rows[position])
        if row >= 0:
            return int(self.offsets[row, col]), int(self.offsets[-1, col])
        lo, hi = np.searchsorted(self.sparse_leaves, [position, position + 1])
        hit = lo + np.flatnonzero(self.sparse_ranks[lo:hi] == rank)
        return int(self.sparse_offsets[hit[0]]), int(self.offsets[-1, col])


def _sparse_chunks(leaves: list[Leaf], keep: np.ndarray | None) -> tuple[np.ndarray, ...]:
    """(leaf position, rank, padded bytes) of each chunk of a replicated or DTensor leaf that holds bytes, in
    leaf order; only ranks in ``keep`` (sorted) when given."""
    pos: list[np.ndarray] = []
    ranks: list[np.ndarray] = []
    sizes: list[np.ndarray] = []
    single: list[tuple[int, int, int]] = []
    for i, leaf in enumerate(leaves):
        t = leaf.table
        if isinstance(t, ReplicaChunks):
            n = math.prod(t.shape) * t.itemsize
            if n:
                single.append((i, t.writer, n))
        elif isinstance(t, BoxChunks):
            cols = t.columns()
            held = np.flatnonzero(cols.nbytes)
            if len(held):
                pos.append(np.full(len(held), i, np.int64))
                ranks.append(cols.ranks[held].astype(np.int64))
                sizes.append(cols.nbytes[held])
    if single:
        rows = np.array(single, np.int64).reshape(-1, 3)
        pos.append(rows[:, 0])
        ranks.append(rows[:, 1])
        sizes.append(rows[:, 2])
    if not pos:
        return np.zeros(0, np.int64), np.zeros(0, np.int64), np.zeros(0, np.int64)
    p, r, s = np.concatenate(pos), np.concatenate(ranks), np.concatenate(sizes)
    order = np.argsort(p, kind="stable")  # replicated leaves were gathered apart: back into leaf order
    p, r, s = p[order], r[order], s[order]
    if keep is not None:
        inside = np.isin(r, keep)
        p, r, s = p[inside], r[inside], s[inside]
    return p, r, pad_in_place(s)


def file_offsets(manifest: Manifest, ranks: np.ndarray | None = None) -> FileOffsets:
    """Place every chunk of ``ranks`` (default: every rank) in its packed data file, at once.

    A sharded leaf has one chunk per rank, so its row of padded sizes is a
    row of the matrix; a chunk of another leaf at position ``j`` adds its size
    to the first sharded row after ``j`` (and every one below it, through the
    cumulative sum). Its own offset is that row's value less the chunks of its
    rank that the row also counts: those at or after ``j`` in the same gap
    between two sharded leaves.
    """
    leaves = list(manifest.leaves.values())
    covered = None if ranks is None else np.unique(np.asarray(ranks, np.int64))
    width = manifest.world_size if covered is None else len(covered)
    is_shard = np.fromiter((isinstance(leaf.table, ShardChunks) for leaf in leaves), bool, len(leaves))
    shard_pos = np.flatnonzero(is_shard)
    shard_rows = np.full(len(leaves), -1, np.int64)
    shard_rows[shard_pos] = np.arange(len(shard_pos))
    acc = np.zeros((len(shard_pos) + 1, width), np.int64)  # row r + 1: sharded leaf r's padded sizes
    for row, i in enumerate(shard_pos.tolist()):
        t = leaves[i].table
        assert isinstance(t, ShardChunks)
        np.multiply(t.lengths if covered is None else t.lengths[covered], t.row_bytes, out=acc[row + 1])
    pad_in_place(acc[1:])
    sp_pos, sp_ranks, sp_sizes = _sparse_chunks(leaves, covered)
    gap = np.searchsorted(shard_pos, sp_pos, side="right")  # the first sharded row after each sparse chunk
    col = sp_ranks if covered is None else np.searchsorted(covered, sp_ranks)
    np.add.at(acc, (gap, col), sp_sizes)
    np.cumsum(acc, axis=0, out=acc)
    # Within a rank, sorted by leaf: the chunks a row counts that lie at or after each sparse chunk.
    order = np.lexsort((sp_pos, col))
    key = (col * (len(shard_pos) + 1) + gap)[order]
    ends = np.searchsorted(key, key, side="right")
    summed = np.concatenate(([0], np.cumsum(sp_sizes[order], dtype=np.int64)))
    later = summed[ends] - summed[np.arange(len(order))]
    sp_offsets = np.empty(len(order), np.int64)
    sp_offsets[order] = acc[gap[order], col[order]] - later
    return FileOffsets(covered, shard_rows, acc, sp_pos, sp_ranks, sp_offsets)


@dataclass(frozen=True)
class WholePieces:
    """Every chunk of the requested whole leaves that holds bytes, in columns (one row per chunk).

    The rows of the ``j``-th requested leaf are ``rows(j)``. A leaf without
    rows has no bytes (an empty leaf). The reader copies each row's ``nbytes``
    at ``offsets`` of ``ranks``' file (or of the chunk's own file, packing
    "memmap") to ``targets`` of the output: one range for a leaf sharded along
    dim 0 or replicated; ``pre`` equal runs for one sharded along a later dim;
    a box for a DTensor leaf (see the module's docstring).

    Attributes:
        first, count: each requested leaf's first row and number of rows (int64[leaves]).
        ranks: the rank that stored each chunk (int32[n]).
        chunks: its position in its leaf's table (int32[n]), for its checksum and a DTensor box's sizes.
        offsets: where it starts in its rank's data file; 0 with packing "memmap" (int64[n]).
        nbytes: its size (int64[n]).
        targets: where its first byte lands in the output, in bytes (int64[n]).
        files: the ranks whose data files hold the pieces (sorted, int64[k]; packing "packed", else empty).
        file_sizes: the size of each of those files (int64[k]).
    """

    first: np.ndarray
    count: np.ndarray
    ranks: np.ndarray
    chunks: np.ndarray
    offsets: np.ndarray
    nbytes: np.ndarray
    targets: np.ndarray
    files: np.ndarray
    file_sizes: np.ndarray

    def __len__(self) -> int:
        return len(self.ranks)

    def rows(self, j: int) -> slice:
        """The rows of the ``j``-th requested leaf."""
        start = int(self.first[j])
        return slice(start, start + int(self.count[j]))


def needed_ranks(leaves: list[Leaf]) -> np.ndarray | None:
    """The ranks whose files a whole read of ``leaves`` touches, or None for "every rank" (a sharded leaf
    has a chunk on every rank)."""
    found: list[np.ndarray] = []
    for leaf in leaves:
        t = leaf.table
        if isinstance(t, ShardChunks):
            return None
        found.append(np.array([t.writer], np.int64) if isinstance(t, ReplicaChunks) else t.ranks)
    return np.unique(np.concatenate(found)) if found else np.zeros(0, np.int64)


def plan_whole(manifest: Manifest, positions: list[int], placed: FileOffsets | None) -> WholePieces:
    """The pieces of the leaves at ``positions`` (in the manifest's leaves), each read whole.

    ``placed``: ``file_offsets`` covering every rank these leaves were stored
    by (packing "packed"); None with packing "memmap", whose chunks are files
    of their own (offset 0).
    """
    leaves = list(manifest.leaves.values())
    asked = [leaves[p] for p in positions]
    shard = [j for j, leaf in enumerate(asked) if isinstance(leaf.table, ShardChunks)]
    other = [j for j, leaf in enumerate(asked) if not isinstance(leaf.table, ShardChunks)]
    parts = [_shard_pieces(asked, positions, shard, placed), _other_pieces(asked, positions, other, placed)]
    count = np.zeros(len(asked), np.int64)
    for part, js in zip(parts, (shard, other)):
        count[js] = part[0]
    first = np.zeros(len(asked), np.int64)
    # rows are stored with the sharded leaves first, then the others, each in request order
    in_order = np.array(shard + other, np.int64)
    first[in_order] = np.concatenate(([0], np.cumsum(count[in_order])[:-1])) if len(in_order) else in_order
    kinds = (np.int32, np.int32, np.int64, np.int64, np.int64)
    if not other or not shard:  # one kind of leaf (the common case): its columns as they are, no copy
        cols = [np.asarray(c, t) for c, t in zip(parts[0 if shard else 1][1:], kinds)]
    else:
        cols = [np.concatenate([np.asarray(part[c], t) for part in parts]) for c, t in zip(range(1, 6), kinds)]
    files = np.unique(cols[0]).astype(np.int64) if placed is not None else np.zeros(0, np.int64)
    sizes = placed.offsets[-1, placed.column(files)] if placed is not None else files
    ranks, chunks, offsets, nbytes, targets = cols
    return WholePieces(first, count, ranks, chunks, offsets, nbytes, targets, files, sizes)


def _shard_pieces(
    asked: list[Leaf], positions: list[int], js: list[int], placed: FileOffsets | None
) -> tuple[np.ndarray, ...]:
    """(count per leaf, ranks, chunks, offsets, nbytes, targets) of the sharded leaves ``js``, vectorised
    over their ranks: their lengths stacked into one leaves x ranks matrix."""
    if not js:
        empty = np.zeros(0, np.int64)
        return empty, empty, empty, empty, empty, empty
    tables = [asked[j].table for j in js]
    lengths = np.stack([t.lengths for t in tables])  # type: ignore[union-attr]
    row_bytes = np.array([t.row_bytes for t in tables], np.int64)  # type: ignore[union-attr]
    # bytes between two consecutive indices of the shard dim in the output: everything after that dim
    post = np.array(
        [math.prod(t.shape[t.dim + 1 :]) * t.itemsize for t in tables],  # type: ignore[union-attr]
        np.int64,
    )
    held = lengths > 0
    held &= (row_bytes > 0)[:, None]  # a chunk of rows of no elements holds no bytes
    count = held.sum(axis=1)
    ranks = np.nonzero(held)[1].astype(np.int32)
    nbytes = lengths[held]  # each chunk's rows, then its bytes
    np.cumsum(lengths, axis=1, out=lengths)  # in place: where each chunk ends along the shard dim
    targets = lengths[held]
    del lengths
    targets -= nbytes  # where it starts
    targets *= np.repeat(post, count)
    nbytes *= np.repeat(row_bytes, count)
    if placed is None:
        offsets = np.zeros(len(ranks), np.int64)
    else:
        if placed.ranks is not None:
            raise ValueError("a sharded leaf has a chunk on every rank: place every rank (file_offsets(manifest))")
        rows = placed.shard_rows[[positions[j] for j in js]]
        offsets = placed.offsets[rows[0] : rows[-1] + 1][held] if _consecutive(rows) else placed.offsets[rows][held]
    return count, ranks, ranks, offsets, nbytes, targets


def _consecutive(rows: np.ndarray) -> bool:
    """Whether ``rows`` are ``r, r + 1, ...`` (a slice of a matrix, not a copy of its rows)."""
    return bool(len(rows)) and bool((np.diff(rows) == 1).all())


def _other_pieces(
    asked: list[Leaf], positions: list[int], js: list[int], placed: FileOffsets | None
) -> tuple[np.ndarray, ...]:
    """The same columns for replicated and DTensor leaves: a handful of chunks each (one per box)."""
    count = np.zeros(len(js), np.int64)
    cols: list[list[np.ndarray]] = [[], [], [], [], []]
    for n, j in enumerate(js):
        t = asked[j].table
        c = t.columns()
        chunks = np.flatnonzero(c.nbytes)
        count[n] = len(chunks)
        ranks = c.ranks[chunks]
        if isinstance(t, BoxChunks):
            strides = np.array([math.prod(asked[j].shape[d + 1 :]) for d in range(len(asked[j].shape))], np.int64)
            targets = (t.offsets[chunks] @ strides if len(strides) else np.zeros(len(chunks), np.int64)) * t.itemsize
        else:
            targets = np.zeros(len(chunks), np.int64)
        if placed is None:
            offsets = np.zeros(len(chunks), np.int64)
        else:
            lo, hi = np.searchsorted(placed.sparse_leaves, [positions[j], positions[j] + 1])
            mine = placed.sparse_ranks[lo:hi]  # this leaf's stored chunks, in chunk order, as ranks
            offsets = placed.sparse_offsets[lo:hi]
            if not np.array_equal(mine, ranks):
                raise ValueError(f"leaf {asked[j].key!r}: its ranks are not all covered by these file offsets")
        for col, values in zip(cols, (ranks, chunks, offsets, c.nbytes[chunks], targets)):
            col.append(np.asarray(values, np.int64))
    joined = [np.concatenate(c) if c else np.zeros(0, np.int64) for c in cols]
    return (count, *joined)
