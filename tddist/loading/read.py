"""Rank-local reading: the manifest, then planned slices of memory-mapped chunks.

Chunks are mapped copy-on-write (``MAP_PRIVATE``): a loaded tensor can be
modified in place without ever writing into the checkpoint, and reading costs
no copy when the wanted box lies inside one chunk. Only the chunks a request
overlaps are opened, so loading some keys or some rows touches nothing else.
"""

from __future__ import annotations

import errno
import math
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor

import torch

from ..checksum import EMPTY, combine_digests, hash_blocks
from ..core.sharding import Box, ReadPiece, plan_reads
from ..core.types import Key
from ..errors import CorruptCheckpointError
from ..manifest.locate import ChunkRange, Locator
from ..manifest.model import Chunk, Leaf, Manifest
from ..manifest.parse import paused_gc
from ..storage.backends import local_files
from ..storage.opened import ChunkFiles, OpenedCheckpoint
from ..storage.pinned import storage_failed


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

    def release(self, leaf: Leaf) -> None:
        """Forget the leaf's chunks, and have the files drop the pages this process mapped of them.

        For a reader that streams leaf by leaf (``convert``): what it read
        stops counting in its resident memory. Tensors still viewing a chunk
        stay valid; a chunk read again is mapped (and verified) again.
        """
        for cache_key in [k for k in self._maps if k[0] == leaf.key]:
            self._verified.discard(cache_key)
            self.files.release(self._maps.pop(cache_key))

    def relpath(self, leaf: Leaf, chunk: Chunk) -> str:
        return self.locator.locate(leaf, chunk).relpath

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
            return self.files.span(self.locator.locate(leaf, chunk))
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


def read_box(source: ChunkSource, leaf: Leaf, box: Box, pool: ThreadPoolExecutor | None, verify: bool) -> torch.Tensor:
    """The part ``box`` of ``leaf``: a view when it lies in one chunk, else a threaded copy."""
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


def _needed(source: ChunkSource, requests: list[tuple[Leaf, Box]], verify: bool) -> list[ChunkRange]:
    """The bytes of each chunk that the requests read (``read_box`` asks for those chunks): the span from
    the first to the last byte of each piece, or the whole chunk when it is verified."""
    out = []
    for leaf, box in requests:
        chunks = leaf.overlapping(box)
        for p in plan_reads(box, [c.box for c in chunks]):
            chunk = chunks[p.chunk_index]
            loc = source.locator.locate(leaf, chunk)
            if verify or not loc.nbytes:
                out.append(ChunkRange(loc, 0, loc.nbytes))
                continue
            sizes, item = chunk.box[1], loc.nbytes // max(math.prod(chunk.box[1]), 1)
            strides = [math.prod(sizes[d + 1 :]) * item for d in range(len(sizes))]
            first = sum(s.start * st for s, st in zip(p.src, strides))
            last = sum((s.stop - 1) * st for s, st in zip(p.src, strides)) + item
            out.append(ChunkRange(loc, first, last))
    return out


def read_leaves(
    checkpoint: str | OpenedCheckpoint,
    manifest: Manifest,
    requests: Iterable[tuple[Leaf, Box]],
    num_threads: int,
    verify: bool,
) -> list[torch.Tensor]:
    """Read every (leaf, box) request, sharing one pool and one set of maps.

    Pass the ``OpenedCheckpoint`` the manifest was read from, so the data
    comes from the same generation (a path is opened again).
    """
    source = ChunkSource(checkpoint, manifest)
    root = source.root
    requests = list(requests)
    if source.files.fetches_ahead:  # a store that pays per request: every range this load reads, in parallel
        source.files.prefetch(_needed(source, requests, verify), num_threads)
    pool = ThreadPoolExecutor(num_threads, thread_name_prefix="tddist-read") if num_threads > 1 else None
    try:
        with paused_gc():  # a tensor per leaf, and its chunks: see paused_gc
            return [read_box(source, leaf, box, pool, verify) for leaf, box in requests]
    except OSError as e:
        if e.errno == errno.ENOMEM:
            raise
        raise storage_failed(root, e) from e
    finally:
        if pool is not None:
            pool.shutdown()
