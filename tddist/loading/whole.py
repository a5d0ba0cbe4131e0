"""Reading leaves whole: the pieces ``manifest.whole`` plans, copied into one tensor per leaf.

A whole read (``shard=None``, a replicated leaf, any full box) is planned in
numpy columns over every rank at once (``manifest.whole.plan_whole``); here
each rank's data file is mapped once, through the opened checkpoint's
``ChunkFiles`` (so the pinned generation is what is read), and every piece is
copied to its place. What stays per piece is inherent:

- the byte copy itself. A piece that is one range of the output (a leaf
  sharded along dim 0, a replicated leaf) is one ``memmove`` by address,
  from a loop over precomputed address lists on the pool's threads (ctypes
  drops the interpreter lock for the call); no library copies a batch of
  ranges from many mapped files into one buffer in one call. A block of a
  leaf sharded along a later dim, or a DTensor box, is one strided torch copy.
- the checksum of each chunk with ``verify=True`` (each chunk has its own), in
  batches of blocks on the pool;
- with packing "memmap" (and archives, which hold that tree), opening each
  chunk's own file or entry: there is one per chunk.

On object storage a load fetches ahead each data file's runs of chunks
(``needed``: one range per file when every chunk of it is read); a caller of
``read_box`` that fetched nothing ahead gets each chunk's range instead, so
reading one leaf never downloads every rank's whole file.
"""

from __future__ import annotations

import ctypes
import math
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch

from .. import format as fmt
from ..checksum import EMPTY, block_digest, blocks, combine_digests
from ..errors import CorruptCheckpointError
from ..manifest.chunks import BoxChunks, ReplicaChunks, ShardChunks, hex_checksum
from ..manifest.locate import ChunkRange, Location
from ..manifest.model import Leaf
from ..manifest.whole import WholePieces

if TYPE_CHECKING:
    from .read import ChunkSource

#: pieces larger than this are cut, so that the pool's threads share a large leaf's copy
_SPLIT = 16 << 20
#: bytes of copies or checksum blocks one task of the pool takes at least
_BATCH = 64 << 20


@dataclass(frozen=True)
class Sources:
    """Where each piece's bytes are in memory.

    Attributes:
        tensors: the mapped (or fetched) uint8 tensors, kept alive while they are read.
        owners: the tensor that holds each piece (int64[n]).
        addresses: each piece's address (int64[n]).
    """

    tensors: list[torch.Tensor]
    owners: np.ndarray
    addresses: np.ndarray

    @staticmethod
    def one_each(tensors: list[torch.Tensor]) -> Sources:
        """Piece ``i`` is all of ``tensors[i]`` (a chunk's own file, or a fetched span)."""
        addresses = np.array([t.data_ptr() for t in tensors], np.int64)
        return Sources(tensors, np.arange(len(tensors), dtype=np.int64), addresses)

    def view(self, i: int, plan: WholePieces) -> torch.Tensor:
        """Piece ``i``'s bytes as a uint8 tensor (a view of its map)."""
        owner = self.tensors[int(self.owners[i])]
        start = int(self.addresses[i]) - owner.data_ptr()
        return owner[start : start + int(plan.nbytes[i])]


def _piece_holders(leaves: list[Leaf], plan: WholePieces) -> np.ndarray | None:
    """Which holder has each piece's bytes (an incremental checkpoint), or None when this one has them all."""
    if not any(leaf.refs is not None and leaf.refs.holders.any() for leaf in leaves):
        return None
    out = np.zeros(len(plan), np.int64)
    for j, leaf in enumerate(leaves):
        if leaf.refs is not None:
            rows = plan.rows(j)
            out[rows] = leaf.refs.holders[plan.chunks[rows]]
    return out


def _held_sources(source: ChunkSource, leaves: list[Leaf], plan: WholePieces, held: np.ndarray) -> Sources:
    """Packing "packed" with references: each (holder, rank) data file of a packed holder mapped once (its
    layout is this checkpoint's: the same offsets), each piece of another holder (an archive) its own span."""
    sizes = dict(zip(plan.files.tolist(), plan.file_sizes.tolist()))
    world = source.manifest.world_size
    apart = np.zeros(len(plan), dtype=bool)  # the pieces of holders that are not packed directories
    for h in np.unique(held[held > 0]).tolist():
        if not source.packed_holder(h):
            apart |= held == h
    mapped = np.where(apart, -1, held * world + plan.ranks.astype(np.int64))
    files, owner = np.unique(mapped[~apart], return_inverse=True)
    tensors = [source.rank_file(r, sizes[r], h) for h, r in (divmod(int(f), world) for f in files)]
    owners = np.zeros(len(plan), np.int64)
    owners[~apart] = owner
    for j, leaf in enumerate(leaves):
        rows = plan.rows(j)
        for i in [i for i in range(rows.start, rows.stop) if apart[i]]:
            owners[i] = len(tensors)
            tensors.append(source.held_span(leaf, leaf.table.chunk(int(plan.chunks[i]))))
    bases = np.array([t.data_ptr() for t in tensors], np.int64)
    offsets = np.where(apart, 0, plan.offsets)
    return Sources(tensors, owners, bases[owners] + offsets)


def _rank_sources(source: ChunkSource, plan: WholePieces, leaves: list[Leaf]) -> Sources:
    """Packing "packed": each rank's data file mapped once, and each piece's address in it."""
    held = _piece_holders(leaves, plan)
    if held is not None:
        return _held_sources(source, leaves, plan, held)
    tensors = [source.rank_file(r, n) for r, n in zip(plan.files.tolist(), plan.file_sizes.tolist())]  # one map each
    bases = np.array([t.data_ptr() for t in tensors], np.int64)
    owner = np.searchsorted(plan.files, plan.ranks)
    return Sources(tensors, owner, bases[owner] + plan.offsets)


def _chunk_sources(source: ChunkSource, leaves: list[Leaf], plan: WholePieces) -> Sources:
    """Packing "memmap": each chunk is a file (an archive entry) of its own, opened once here: one per chunk."""
    tensors: list[torch.Tensor] = [torch.empty(0, dtype=torch.uint8)] * len(plan)  # in the plan's row order
    for j, leaf in enumerate(leaves):
        rows = plan.rows(j)
        for i, rank, n in zip(range(rows.start, rows.stop), plan.ranks[rows].tolist(), plan.nbytes[rows].tolist()):
            loc = Location(source.locator.relpath(leaf.key, rank), 0, n, n)
            try:
                tensors[i] = source.files.span(loc)
            except CorruptCheckpointError as e:
                raise CorruptCheckpointError(f"leaf {leaf.key!r} (written by rank {rank}): {e}") from None
    return Sources.one_each(tensors)


def _piece_sources(source: ChunkSource, plan: WholePieces) -> Sources:
    """Packing "packed" on a store that fetches what it reads (object storage) when the load fetched nothing
    ahead: each chunk's span of its rank's file, a ranged request each, rather than every rank's whole file."""
    sizes = dict(zip(plan.files.tolist(), plan.file_sizes.tolist()))
    tensors = []
    for rank, at, n in zip(plan.ranks.tolist(), plan.offsets.tolist(), plan.nbytes.tolist()):
        try:
            tensors.append(source.files.span(Location(fmt.rank_data_name(rank), at, n, sizes[rank])))
        except CorruptCheckpointError as e:
            raise CorruptCheckpointError(f"the data file of rank {rank}: {e}") from None
    return Sources.one_each(tensors)


def sources(source: ChunkSource, leaves: list[Leaf], plan: WholePieces, fetched: bool) -> Sources:
    """Every piece's bytes, mapped before any output is allocated (files are checked first). ``fetched``: the
    runs of each rank's file that ``needed`` gives were fetched ahead (``ChunkFiles.prefetch``)."""
    if source.manifest.packing != "packed":
        return _chunk_sources(source, leaves, plan)
    if source.files.fetches_ahead and not fetched:
        return _piece_sources(source, plan)
    return _rank_sources(source, plan, leaves)


def needed(source: ChunkSource, leaves: list[Leaf], plan: WholePieces) -> dict[int, list[ChunkRange]]:
    """The byte ranges a whole read of ``leaves`` fetches, by the holder whose files hold them (0: this
    checkpoint; an incremental one's packed directory holders have the same offsets; an archive holder's
    chunks are read entry by entry, not fetched ahead): per rank's data file, its runs of consecutive chunks
    (each chunk up to the next one's aligned start), so a whole file is a single range; per chunk's own file
    with packing "memmap"."""
    if source.manifest.packing != "packed":  # never holds references
        out = []
        for j, leaf in enumerate(leaves):
            rows = plan.rows(j)
            for rank, n in zip(plan.ranks[rows].tolist(), plan.nbytes[rows].tolist()):
                loc = Location(source.locator.relpath(leaf.key, rank), 0, n, n)
                out.append(ChunkRange(loc, 0, n))
        return {0: out}
    sizes = dict(zip(plan.files.tolist(), plan.file_sizes.tolist()))
    held = _piece_holders(leaves, plan)
    if held is None:
        return {0: _runs(plan.ranks, plan.offsets, plan.nbytes, sizes)}
    by_holder = {}
    for h in np.unique(held).tolist():
        if h == 0 or source.packed_holder(h):
            mask = held == h
            by_holder[h] = _runs(plan.ranks[mask], plan.offsets[mask], plan.nbytes[mask], sizes)
    return by_holder


def _runs(ranks: np.ndarray, offsets: np.ndarray, nbytes: np.ndarray, sizes: dict[int, int]) -> list[ChunkRange]:
    """The runs of consecutive chunks of each rank's data file (``sizes``: each file's size), as ranges."""
    order = np.lexsort((offsets, ranks))
    ranks, starts = ranks[order].astype(np.int64), offsets[order]
    stops = starts + nbytes[order]
    ends = -(-stops // fmt.PACK_ALIGN) * fmt.PACK_ALIGN
    breaks = np.flatnonzero((np.diff(ranks) != 0) | (starts[1:] != ends[:-1])) + 1
    first = np.concatenate(([0], breaks)).astype(np.int64)
    last = np.concatenate((breaks - 1, [len(order) - 1])).astype(np.int64)
    out = []
    for r, lo, hi in zip(ranks[first].tolist(), starts[first].tolist(), stops[last].tolist()):
        size = sizes[r]
        out.append(ChunkRange(Location(fmt.rank_data_name(r), 0, size, size), lo, hi))
    return out


def _expected(leaf: Leaf, chunks: np.ndarray) -> np.ndarray:
    """The manifest's checksums of ``chunks`` of ``leaf`` (uint64)."""
    t = leaf.table
    if isinstance(t, ReplicaChunks):
        return np.full(len(chunks), t.checksum, np.uint64)
    assert isinstance(t, (ShardChunks, BoxChunks))
    return np.asarray(t.checksums, np.uint64)[chunks]


def _check_empty_chunks(source: ChunkSource, leaf: Leaf) -> None:
    """An empty chunk has no bytes, only a checksum: that of nothing."""
    c = leaf.table.columns()
    bad = np.flatnonzero((c.nbytes == 0) & (c.checksums != np.uint64(int(EMPTY, 16))))
    if len(bad):
        rank = int(c.ranks[bad[0]])
        raise CorruptCheckpointError(
            f"checksum mismatch in leaf {leaf.key!r} of {source.root!r} (rank {rank}, an empty chunk): expected "
            f"{hex_checksum(c.checksums[bad[0]])}, found {EMPTY}; the manifest is damaged"
        )


def verify(
    source: ChunkSource, leaves: list[Leaf], plan: WholePieces, found: Sources, pool: ThreadPoolExecutor | None
) -> None:
    """Every chunk's checksum against the manifest's: the blocks of every chunk hashed in batches on the pool."""
    views = [found.view(i, plan).numpy() for i in range(len(plan))]
    parts = [blocks(v) for v in views]  # each chunk's checksum blocks (views, no copy)
    flat = [b for p in parts for b in p]
    digests: list[int] = []
    for batch in _map(pool, lambda bs: [block_digest(b) for b in bs], _batches(flat, [len(b) for b in flat])):
        digests.extend(batch)
    at = np.concatenate(([0], np.cumsum([len(p) for p in parts], dtype=np.int64))).tolist()  # each piece's blocks
    for j, leaf in enumerate(leaves):
        _check_empty_chunks(source, leaf)
        rows = plan.rows(j)
        expected = _expected(leaf, plan.chunks[rows])
        for k, i in enumerate(range(rows.start, rows.stop)):
            got = combine_digests(digests[at[i] : at[i + 1]])
            if got != hex_checksum(expected[k]):
                rank = int(plan.ranks[i])
                raise CorruptCheckpointError(
                    f"checksum mismatch in {source.locator.relpath(leaf.key, rank)!r} of {source.root!r} (leaf {leaf.key!r}, "
                    f"rank {rank}): expected {hex_checksum(expected[k])}, found {got}; the data is corrupted, restore "
                    f"it from another checkpoint"
                )
        source.mark_verified(leaf, plan.ranks[rows])


def _batches(items: list, sizes: list[int]) -> list[list]:
    """``items`` cut into consecutive batches of about ``_BATCH`` bytes each."""
    out: list[list] = [[]]
    acc = 0
    for item, n in zip(items, sizes):
        if acc >= _BATCH:
            out.append([])
            acc = 0
        out[-1].append(item)
        acc += n
    return [b for b in out if b]


def _cuts(nbytes: np.ndarray) -> list[tuple[int, int]]:
    """Consecutive row ranges of about ``_BATCH`` bytes each (vectorised: a batch per cumulative ``_BATCH``)."""
    ends = np.cumsum(nbytes)
    stops = np.searchsorted(ends, np.arange(_BATCH, int(ends[-1]) + _BATCH, _BATCH), side="left") + 1
    stops = np.unique(np.minimum(stops, len(nbytes)))
    starts = np.concatenate(([0], stops[:-1]))
    return [(a, b) for a, b in zip(starts.tolist(), stops.tolist()) if b > a]


def _map(pool: ThreadPoolExecutor | None, fn: Callable, batches: list) -> list:
    if pool is not None and len(batches) > 1:
        return list(pool.map(fn, batches))
    return [fn(b) for b in batches]


def _memmove_all(batch: tuple[list[int], list[int], list[int]]) -> None:
    # The innermost copy: a loop over precomputed addresses (see the module's docstring).
    move = ctypes.memmove
    for dst, src, n in zip(*batch):
        move(dst, src, n)


def _ranges(out: torch.Tensor, plan: WholePieces, rows: slice, found: Sources) -> tuple[np.ndarray, ...]:
    """(destination, source, size) of every contiguous piece of ``rows``, large ones cut in ``_SPLIT`` parts."""
    dst = out.data_ptr() + plan.targets[rows]
    src = found.addresses[rows]
    n = plan.nbytes[rows]
    parts = np.maximum(-(-n // _SPLIT), 1)
    if (parts == 1).all():
        return dst, src, n
    first = np.repeat(np.cumsum(parts) - parts, parts)
    within = (np.arange(int(parts.sum())) - first) * _SPLIT  # each part's start within its piece
    n = np.minimum(np.repeat(n, parts) - within, _SPLIT)
    return np.repeat(dst, parts) + within, np.repeat(src, parts) + within, n


def _strided(leaf: Leaf, out: torch.Tensor, plan: WholePieces, i: int, found: Sources) -> Callable[[], None]:
    """The copy of piece ``i``: a block of runs (sharded along a dim after the first) or a DTensor box."""
    t = leaf.table
    data = found.view(i, plan)
    target = int(plan.targets[i])
    if isinstance(t, ShardChunks):
        pre = math.prod(t.shape[: t.dim])
        width = data.numel() // pre
        flat = out.view(-1).view(torch.uint8)
        dst = flat.as_strided((pre, width), (math.prod(t.shape[t.dim :]) * t.itemsize, 1), target)
        return lambda: _copy(dst, data.view(pre, width))
    assert isinstance(t, BoxChunks)
    sizes = tuple(int(s) for s in t.sizes[int(plan.chunks[i])])
    box = out.as_strided(sizes, out.stride(), target // t.itemsize)
    return lambda: _copy(box, data.view(out.dtype).view(sizes))


def _copy(dst: torch.Tensor, src: torch.Tensor) -> None:
    dst.copy_(src)


def _contiguous(leaf: Leaf) -> bool:
    """Whether each chunk of ``leaf`` is one range of the output."""
    t = leaf.table
    return isinstance(t, ReplicaChunks) or (isinstance(t, ShardChunks) and math.prod(t.shape[: t.dim]) == 1)


def read_whole(
    source: ChunkSource,
    leaves: list[Leaf],
    pool: ThreadPoolExecutor | None,
    verify_sums: bool,
    plan: WholePieces,
    fetched: bool = False,
) -> list[torch.Tensor]:
    """Each of ``leaves``, whole (``plan``: their pieces; ``fetched``: see ``sources``): a view of its map when
    one chunk holds all of it, else a fresh tensor."""
    found = sources(source, leaves, plan, fetched)
    if verify_sums:
        verify(source, leaves, plan, found, pool)
    outs: list[torch.Tensor] = []
    moves: list[tuple[np.ndarray, ...]] = []
    strided: list[Callable[[], None]] = []
    for j, leaf in enumerate(leaves):
        rows = plan.rows(j)
        nbytes = math.prod(leaf.shape) * fmt.dtype_itemsize(leaf.dtype_name)
        if rows.stop - rows.start == 1 and int(plan.nbytes[rows.start]) == nbytes:  # one chunk: a view, no copy
            outs.append(found.view(rows.start, plan).view(leaf.dtype).view(leaf.shape))
            continue
        out = torch.empty(leaf.shape, dtype=leaf.dtype)  # only now: every file it reads is checked
        outs.append(out)
        if _contiguous(leaf):
            moves.append(_ranges(out, plan, rows, found))
        else:
            strided.extend(_strided(leaf, out, plan, i, found) for i in range(rows.start, rows.stop))
    if moves and sum(len(m[2]) for m in moves):
        dst, src, n = (np.concatenate(c) for c in zip(*moves))
        bounds = _cuts(n)
        _map(pool, _memmove_all, [(dst[a:b].tolist(), src[a:b].tolist(), n[a:b].tolist()) for a, b in bounds])
    _map(pool, lambda fs: [f() for f in fs], _batches(strided, [1 << 20] * len(strided)))
    return outs
