"""Rank-local reading: the manifest, then planned slices of memory-mapped chunks.

Chunks are mapped copy-on-write (``MAP_PRIVATE``): a loaded tensor can be
modified in place without ever writing into the checkpoint, and reading costs
no copy when the wanted box lies inside one chunk. Only the chunks a request
overlaps are opened, so loading some keys or some rows touches nothing else.
"""

from __future__ import annotations

import errno
import logging
import math
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np
import torch

from .. import format as fmt
from .._fs import available_memory
from ..checksum import EMPTY, combine_digests, hash_blocks
from ..core.sharding import Box, ReadPiece, full_box, plan_reads
from ..core.types import Key
from ..errors import CorruptCheckpointError, TddistError
from ..manifest.locate import ChunkRange, FileSpan, Location, Locator
from ..manifest.model import Chunk, Leaf, Manifest
from ..manifest.parse import paused_gc
from ..manifest.whole import FileOffsets, WholePieces, file_offsets, needed_ranks, plan_whole
from ..storage.backends import local_files, store_for
from ..storage.opened import ChunkFiles, OpenedCheckpoint
from ..storage.pinned import storage_failed
from . import whole
from .cooperate import MIN_SHARED_BYTES, SharedReads, share_of

logger = logging.getLogger(__name__)


class ChunkSource:
    """Opens (and caches) the chunks of one checkpoint as tensors."""

    def __init__(self, checkpoint: str | OpenedCheckpoint, manifest: Manifest) -> None:
        """``checkpoint``: opened (its ``ChunkFiles``, one generation), or the path of a local one."""
        self.root = checkpoint if isinstance(checkpoint, str) else checkpoint.path
        self.manifest = manifest
        self.files: ChunkFiles = local_files(checkpoint) if isinstance(checkpoint, str) else checkpoint.files()
        self.locator = Locator(manifest)
        self._maps: dict[tuple[Key, int], torch.Tensor] = {}
        self._verified: set[tuple[Key, int]] = set()
        self._rank_files: dict[tuple[int, int], torch.Tensor] = {}  # packed: (holder, rank)'s data file, mapped once
        self._holders: dict[int, OpenedCheckpoint] = {}  # an incremental checkpoint's holders, opened once
        self._holder_files: dict[int, ChunkFiles] = {}  # and their readers
        self._placed: FileOffsets | None = None  # packed: every rank's offsets, once a whole read needed them
        self._positions: dict[Key, int] | None = None

    def mark_verified(self, leaf: Leaf, ranks: np.ndarray) -> None:
        """The chunks of ``leaf`` stored by ``ranks`` were verified (by a whole read): not hashed again."""
        self._verified.update((leaf.key, r) for r in ranks.tolist())

    def position(self, key: Key) -> int:
        """The position of the leaf ``key`` in the manifest's leaves (the plans' and offsets' row)."""
        if self._positions is None:
            self._positions = {k: i for i, k in enumerate(self.manifest.leaves)}
        return self._positions[key]

    def placed(self, leaves: list[Leaf] | None) -> FileOffsets | None:
        """Packing "packed": where the chunks of ``leaves`` (None: any leaf) start in their ranks' files.

        Every rank's offsets are computed once and kept (a whole read of a
        sharded leaf reads every rank); a few replicated or DTensor leaves
        need only their writers' (one pass over the leaves, as a rank that
        loads its own rows pays).
        """
        if self.manifest.packing != "packed":
            return None
        if self._placed is not None:
            return self._placed
        ranks = None if leaves is None else needed_ranks(leaves)
        if ranks is not None and len(ranks) * 4 < self.manifest.world_size:
            return file_offsets(self.manifest, ranks)
        self._placed = file_offsets(self.manifest)
        return self._placed

    def whole_pieces(self, leaves: list[Leaf], placed: FileOffsets | None = None) -> WholePieces:
        """The planned pieces of ``leaves``, each read whole (see ``manifest.whole``)."""
        positions = [self.position(leaf.key) for leaf in leaves]
        return plan_whole(self.manifest, positions, placed if placed is not None else self.placed(leaves))

    def rank_file(self, rank: int, size: int, holder: int = 0) -> torch.Tensor:
        """``rank``'s data file (of ``size`` bytes) as a uint8 tensor: mapped (or fetched) once, through the
        pinned ``ChunkFiles``; of the manifest's holder ``holder`` (0: this checkpoint), whose file of an
        incremental checkpoint's rank has the same layout."""
        t = self._rank_files.get((holder, rank))
        if t is None:
            try:
                t = self.holder_files(holder).span(Location(fmt.rank_data_name(rank), 0, size, size))
            except CorruptCheckpointError as e:
                raise CorruptCheckpointError(f"the data file of rank {rank}: {e}") from None
            self._rank_files[(holder, rank)] = t
        return t

    def holder_files(self, holder: int) -> ChunkFiles:
        """The chunks of the manifest's holder ``holder`` (0: this checkpoint's own), opened once at the
        generation the manifest recorded.

        Raises:
            CorruptCheckpointError: the holder is missing, damaged or another checkpoint now (replaced).
        """
        if holder == 0:
            return self.files
        files = self._holder_files.get(holder)
        if files is None:
            files = self._holder_files[holder] = self.holder(holder).files()
        return files

    def holder(self, holder: int) -> OpenedCheckpoint:
        """The manifest's holder ``holder`` (>= 1), opened once at the generation the manifest recorded.

        Raises:
            CorruptCheckpointError: it is missing, damaged or another checkpoint now (replaced).
        """
        opened = self._holders.get(holder)
        if opened is None:
            opened = self._holders[holder] = open_holder(self.root, self.manifest, holder)
        return opened

    def packed_holder(self, holder: int) -> bool:
        """Whether the manifest's holder ``holder`` (>= 1) is a packed directory: its chunks lie at this
        checkpoint's offsets, in its data file of the same rank."""
        m = self.holder(holder).manifest
        return m.layout == "directory" and m.packing == "packed"

    def held_span(self, leaf: Leaf, chunk: Chunk) -> torch.Tensor:
        """The bytes of ``chunk`` of ``leaf`` wherever they lie: here, or in the holder the manifest names."""
        index = leaf.table.index_of_rank(chunk.rank) if leaf.refs is not None else None
        h = 0 if index is None else leaf.holder_of(index)
        own = self.location(leaf, chunk)
        loc = own if h == 0 else held_location(self.holder(h), leaf, chunk, own)
        return self.holder_files(h).span(loc)

    def release(self, leaf: Leaf) -> None:
        """Forget the leaf's chunks, and have the files drop the pages this process mapped of them.

        For a reader that streams leaf by leaf (``convert``): what it read
        stops counting in its resident memory, whether it came through the
        chunk's own map or through its rank's data file mapped for whole reads
        (``rank_file``: the leaf's ranges of it). Tensors still viewing a chunk
        stay valid; a chunk read again is mapped (and verified) again.
        """
        for cache_key in [k for k in self._maps if k[0] == leaf.key]:
            self._verified.discard(cache_key)
            self.files.release(self._maps.pop(cache_key))
        if not self._rank_files:
            return
        pieces = self.whole_pieces([leaf])
        for rank, offset, nbytes in zip(pieces.ranks.tolist(), pieces.offsets.tolist(), pieces.nbytes.tolist()):
            mapped = self._rank_files.get((0, rank))
            if mapped is not None:  # one advice per chunk: the pages of a leaf's chunks are not contiguous
                self._verified.discard((leaf.key, rank))
                self.files.release(mapped[offset : offset + nbytes])

    def relpath(self, leaf: Leaf, chunk: Chunk) -> str:
        return self.location(leaf, chunk).relpath

    def location(self, leaf: Leaf, chunk: Chunk) -> Location:
        """Where ``chunk``'s bytes lie: from every rank's offsets once a whole read computed them (no offsets
        of a rank's leaves kept per rank), else through the ``Locator``."""
        placed = self._placed
        if placed is None or not chunk.nbytes:
            return self.locator.locate(leaf, chunk)
        offset, size = placed.offset_of(self.position(leaf.key), chunk.rank)
        return Location(fmt.rank_data_name(chunk.rank), offset, chunk.nbytes, size)

    def tensor(self, leaf: Leaf, chunk: Chunk) -> torch.Tensor:
        """The chunk as a tensor of its box's shape (a copy-on-write map where possible)."""
        cache_key = (leaf.key, chunk.rank)
        t = self._maps.get(cache_key)
        if t is not None:
            return t
        sizes = chunk.box[1]
        if chunk.nbytes == 0:
            t = torch.empty(sizes, dtype=leaf.dtype)
        else:
            t = self._array(leaf, chunk).view(leaf.dtype).view(sizes)
        self._maps[cache_key] = t
        return t

    def _array(self, leaf: Leaf, chunk: Chunk) -> torch.Tensor:
        try:
            return self.held_span(leaf, chunk)
        except CorruptCheckpointError as e:
            raise CorruptCheckpointError(f"leaf {leaf.key!r} (written by rank {chunk.rank}): {e}") from None

    def verify(self, leaf: Leaf, chunk: Chunk, pool: ThreadPoolExecutor | None) -> None:
        """Recompute the chunk's checksum and compare it with the manifest's (once per chunk)."""
        if (leaf.key, chunk.rank) in self._verified:
            return
        if chunk.nbytes == 0:
            actual = EMPTY
        else:
            # the very mapping (or decompressed copy) the load returns: mapped, or inflated, once
            data = self.tensor(leaf, chunk).reshape(-1).view(torch.uint8).numpy()
            actual = combine_digests(hash_blocks(data, pool.map if pool else map))
        if actual != chunk.checksum:
            raise CorruptCheckpointError(
                f"checksum mismatch in {self.relpath(leaf, chunk)!r} of {self.root!r} (leaf {leaf.key!r}, rank "
                f"{chunk.rank}): expected {chunk.checksum}, found {actual}; the data is corrupted, restore it from "
                f"another checkpoint"
            )
        self._verified.add((leaf.key, chunk.rank))


def held_location(holder: OpenedCheckpoint, leaf: Leaf, chunk: Chunk, own: Location) -> Location:
    """Where a referenced chunk's bytes lie in its holder: a packed directory's data file of the same rank at
    the same offset (``own``: the holder's layout is this checkpoint's), else the holder's file or archive entry
    of the same leaf and rank.

    Raises:
        CorruptCheckpointError: the holder has no such chunk, or one of another size.
    """
    m = holder.manifest
    if m.layout == "directory" and m.packing == "packed":
        return own
    held = m.leaves.get(leaf.key)
    i = None if held is None else held.table.index_of_rank(chunk.rank)
    if held is None or i is None or held.table.chunk(i).nbytes != chunk.nbytes:
        raise CorruptCheckpointError(
            f"{holder.path!r} holds no chunk of leaf {leaf.key!r} of rank {chunk.rank} of {chunk.nbytes} bytes, "
            f"which a checkpoint beside it references; the referencing checkpoint is damaged"
        )
    return Locator(m).locate(held, held.table.chunk(i))


def open_holder(root: str, manifest: Manifest, holder: int) -> OpenedCheckpoint:
    """The manifest's holder ``holder`` of the checkpoint at ``root``, opened, at the generation recorded.

    Raises:
        CorruptCheckpointError: it is missing, unreadable, or another checkpoint than the one referenced.
    """
    h = manifest.referenced()[holder - 1]
    path = fmt.holder_path(root, h.name)
    try:
        opened = store_for(path).open()
    except TddistError as e:
        raise CorruptCheckpointError(
            f"{root!r} references chunks held by {path!r}, which cannot be read ({e}); the checkpoint is damaged: "
            f"restore the holder, or load another checkpoint"
        ) from None
    if opened.generation != h.generation:
        opened.close()
        raise CorruptCheckpointError(
            f"{root!r} references chunks held by {path!r} at generation {h.generation}, but it holds generation "
            f"{opened.generation} now (it was replaced); the checkpoint is damaged: load another checkpoint"
        )
    return opened


def _whole(leaf: Leaf, box: Box) -> bool:
    """Whether ``box`` is all of ``leaf`` (read through ``loading.whole``: planned in columns)."""
    return box == full_box(leaf.shape) and math.prod(box[1]) > 0


def read_box(source: ChunkSource, leaf: Leaf, box: Box, pool: ThreadPoolExecutor | None, verify: bool) -> torch.Tensor:
    """The part ``box`` of ``leaf``: a view when it lies in one chunk, else a threaded copy."""
    if _whole(leaf, box):  # every rank's offsets, computed once for every later leaf of this source
        return whole.read_whole(source, [leaf], pool, verify, source.whole_pieces([leaf], source.placed(None)))[0]
    chunks = leaf.overlapping(box)  # only these are built, however many ranks saved the leaf
    if len(chunks) == 1 and chunks[0].box == box and math.prod(box[1]) > 0:  # one whole chunk: no planning
        if verify:
            source.verify(leaf, chunks[0], pool)
        return source.tensor(leaf, chunks[0])[...]  # a view, as a piece of a chunk is
    pieces = plan_reads(box, [c.box for c in chunks])
    if verify:
        for p in pieces:
            source.verify(leaf, chunks[p.chunk_index], pool)
    if len(pieces) == 1 and math.prod(box[1]) > 0:
        p = pieces[0]
        return source.tensor(leaf, chunks[p.chunk_index])[p.src]
    sources = {p.chunk_index: source.tensor(leaf, chunks[p.chunk_index]) for p in pieces}  # files checked first
    out = torch.empty(box[1], dtype=leaf.dtype)  # only then the memory a (possibly tampered) shape asks for
    if not out.numel():
        return out

    def copy(p: ReadPiece) -> None:
        out[p.dst].copy_(sources[p.chunk_index][p.src])

    if pool is not None and len(pieces) > 1:
        list(pool.map(copy, pieces))
    else:
        for p in pieces:
            copy(p)
    return out


def _needed(
    source: ChunkSource, requests: list[tuple[Leaf, Box]], verify: bool, plan: WholePieces | None = None
) -> dict[int, list[ChunkRange]]:
    """The bytes of each chunk that the requests read (``read_box`` asks for those chunks), by the holder whose
    files hold them (``whole.needed``): the span from the first to the last byte of each piece, or the whole
    chunk when it is verified. Whole boxes are read through ``plan`` (their pieces, in columns): whole
    chunks, in runs of each rank's data file."""
    wholes = [leaf for leaf, box in requests if _whole(leaf, box)]
    by_holder = whole.needed(source, wholes, plan or source.whole_pieces(wholes)) if wholes else {}
    for leaf, box in requests:
        if _whole(leaf, box):
            continue
        chunks = leaf.overlapping(box)
        for p in plan_reads(box, [c.box for c in chunks]):
            chunk = chunks[p.chunk_index]
            index = leaf.table.index_of_rank(chunk.rank) if leaf.refs is not None else None
            h = 0 if index is None else leaf.holder_of(index)
            if h and not source.packed_holder(h):
                continue  # an archive holder's entry: read when it is asked for
            out = by_holder.setdefault(h, [])
            loc = source.location(leaf, chunk)
            if verify or not loc.nbytes:
                out.append(ChunkRange(loc, 0, loc.nbytes))
                continue
            sizes, item = chunk.box[1], loc.nbytes // max(math.prod(chunk.box[1]), 1)
            strides = [math.prod(sizes[d + 1 :]) * item for d in range(len(sizes))]
            first = sum(s.start * st for s, st in zip(p.src, strides))
            last = sum((s.stop - 1) * st for s, st in zip(p.src, strides)) + item
            out.append(ChunkRange(loc, first, last))
    return by_holder


def read_leaves(
    checkpoint: str | OpenedCheckpoint,
    manifest: Manifest,
    requests: Iterable[tuple[Leaf, Box]],
    num_threads: int,
    verify: bool,
    shared: SharedReads | None = None,
) -> list[torch.Tensor]:
    """Read every (leaf, box) request, sharing one pool and one set of maps.

    Pass the ``OpenedCheckpoint`` the manifest was read from, so the data
    comes from the same generation (a path is opened again). ``shared``: what
    every rank of this node reads; this rank first reads its part of the files
    they share into the page cache (``cooperate``).
    """
    source = ChunkSource(checkpoint, manifest)
    root = source.root
    requests = list(requests)
    try:
        with paused_gc():  # a tensor per leaf, and its chunks: see paused_gc
            if shared is not None:
                _warm_shared(source, shared, verify)
            return _read(source, requests, num_threads, verify)
    except OSError as e:
        if e.errno == errno.ENOMEM:
            raise
        raise storage_failed(root, e) from e


def _warm_shared(source: ChunkSource, shared: SharedReads, verify: bool) -> None:
    """Read this rank's part of the node's shared reads into the page cache (``cooperate.share_of``), file store by
    file store (a holder of an incremental checkpoint has files of its own).

    Not for a rank that reads less than ``MIN_SHARED_BYTES`` (the neighbours' plans would cost more than the
    order of its reads saves), nor when the node's shared bytes exceed half the memory available (what one
    rank read for another would be evicted before it is mapped, and read again).
    """
    if not source.files.shares_pages:  # object storage: each rank fetches into its own memory; nothing to plan
        return
    mine = _needed(source, list(shared.requests[shared.me]), verify)
    if sum(r.stop - r.start for ranges in mine.values() for r in ranges) < MIN_SHARED_BYTES:
        return
    needs = [mine if i == shared.me else _needed(source, list(reqs), verify) for i, reqs in enumerate(shared.requests)]
    available = available_memory()
    for h in sorted({h for need in needs for h in need}):
        files = source.holder_files(h)  # a holder is a checkpoint of the same store, so it shares pages too
        part = share_of([[_file_span(r) for r in need.get(h, [])] for need in needs], shared.me)
        node_bytes = sum(s.stop - s.start for s in part) * len(needs)
        if available is not None and node_bytes > available // 2:
            logger.info(
                "the node's shared reads (%d bytes) exceed half its available memory: each rank reads its own",
                node_bytes,
            )
            return
        if part:
            files.warm(part)


def _file_span(r: ChunkRange) -> FileSpan:
    loc = r.location
    return FileSpan(loc.relpath, loc.offset + r.start, loc.offset + r.stop)


@dataclass(frozen=True)
class WholeReads:
    """The requests of a load that read their leaf whole, planned together (``manifest.whole``).

    Attributes:
        indices: their positions in the load's requests.
        leaves: their leaves.
        plan: every piece of them, in columns; None when no request is whole.
    """

    indices: list[int]
    leaves: list[Leaf]
    plan: WholePieces | None


def plan_wholes(source: ChunkSource, requests: list[tuple[Leaf, Box]]) -> WholeReads:
    """The whole boxes among ``requests``, and their pieces: all a load plans for them before reading data."""
    indices = [j for j, (leaf, box) in enumerate(requests) if _whole(leaf, box)]
    leaves = [requests[j][0] for j in indices]
    return WholeReads(indices, leaves, source.whole_pieces(leaves) if leaves else None)


def _read(source: ChunkSource, requests: list[tuple[Leaf, Box]], num_threads: int, verify: bool) -> list[torch.Tensor]:
    """Whole boxes through one plan in columns (``loading.whole``), the others box by box."""
    wholes = plan_wholes(source, requests)
    if source.files.fetches_ahead:  # a store that pays per request: every range this load reads, in parallel
        for h, ranges in _needed(source, requests, verify, wholes.plan).items():
            source.holder_files(h).prefetch(ranges, num_threads)
    pool = ThreadPoolExecutor(num_threads, thread_name_prefix="tddist-read") if num_threads > 1 else None
    try:
        out: list[torch.Tensor | None] = [None] * len(requests)
        if wholes.plan is not None:
            got = whole.read_whole(source, wholes.leaves, pool, verify, wholes.plan, source.files.fetches_ahead)
            for j, t in zip(wholes.indices, got):
                out[j] = t
        for j, (leaf, box) in enumerate(requests):
            if out[j] is None:
                out[j] = read_box(source, leaf, box, pool, verify)
        return out  # type: ignore[return-value]
    finally:
        if pool is not None:
            pool.shutdown()
