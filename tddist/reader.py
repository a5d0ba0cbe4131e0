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
import os
import weakref
from concurrent.futures import ThreadPoolExecutor
from typing import Iterable

import numpy as np
import torch
import xxhash

from . import format as fmt
from ._fs import is_inside
from .errors import CheckpointNotFoundError, CorruptCheckpointError, ManifestError
from .manifest import Chunk, Leaf, Manifest, parse_manifest
from .sharding import Box, plan_reads
from .writer import combine_digests

logger = logging.getLogger(__name__)

# Start address of each live chunk mapping -> its file, so ``save`` can tell
# that a tensor is backed by a checkpoint file (``copy_existing``).
_MAPPED: dict[int, str] = {}


def mapped_file(t: torch.Tensor) -> str | None:
    """The file ``t`` is memory-mapped from (a tddist load or a tensordict MemoryMappedTensor), or None."""
    name = getattr(t, "filename", None)
    if name:
        return str(name)
    try:
        return _MAPPED.get(t.untyped_storage().data_ptr())
    except RuntimeError:
        return None


def read_manifest(path: str) -> Manifest:
    """Read and validate the manifest of the committed checkpoint at ``path``."""
    path = os.fspath(path)
    mpath = os.path.join(path, fmt.MANIFEST_NAME)
    if os.path.isfile(path):
        raise CheckpointNotFoundError(
            f"{path!r} is a file, not a tddist checkpoint directory; pass the checkpoint directory"
        )
    try:
        with open(mpath, "rb") as f:
            raw = f.read()
    except FileNotFoundError:
        side = fmt.side_entries(path)
        hint = (
            f"; leftovers of an interrupted save exist beside it ({len(side)}), run tddist.recover({path!r})"
            if side
            else ""
        )
        what = "does not exist" if not os.path.exists(path) else "has no manifest (it is not a committed tddist checkpoint)"
        raise CheckpointNotFoundError(f"checkpoint {path!r} {what}{hint}") from None
    try:
        obj = fmt.loads(raw)
    except (ValueError, UnicodeDecodeError) as e:
        raise ManifestError(f"manifest {mpath!r} is not valid JSON ({e}); the checkpoint is damaged") from None
    return parse_manifest(obj, where=f"manifest {mpath!r}")


class ChunkSource:
    """Opens (and caches) the memory maps of one directory checkpoint's chunks."""

    def __init__(self, root: str, manifest: Manifest):
        self.root = root
        self.manifest = manifest
        self._maps: dict[tuple, torch.Tensor] = {}

    def path(self, leaf: Leaf, chunk: Chunk) -> str:
        return os.path.join(self.root, fmt.leaf_relpath(chunk.rank, leaf.key, self.manifest.robust_key))

    def tensor(self, leaf: Leaf, chunk: Chunk) -> torch.Tensor:
        """The chunk as a tensor of its box's shape, mapped copy-on-write."""
        cache_key = (leaf.key, chunk.rank)
        t = self._maps.get(cache_key)
        if t is not None:
            return t
        sizes = chunk.box[1]
        if chunk.nbytes == 0:
            t = torch.empty(sizes, dtype=leaf.dtype)
        else:
            arr = self._map(leaf, chunk)
            t = torch.from_numpy(arr).view(leaf.dtype).view(sizes)
        self._maps[cache_key] = t
        return t

    def _map(self, leaf: Leaf, chunk: Chunk) -> np.ndarray:
        path = self.path(leaf, chunk)
        if not is_inside(self.root, path):
            raise CorruptCheckpointError(f"file {path!r} of leaf {leaf.key!r} resolves outside the checkpoint; refusing it")
        try:
            size = os.stat(path).st_size
        except FileNotFoundError:
            raise CorruptCheckpointError(
                f"file {path!r} of leaf {leaf.key!r} (written by rank {chunk.rank}) is missing; the checkpoint is damaged"
            ) from None
        if size != chunk.nbytes:
            raise CorruptCheckpointError(
                f"file {path!r} of leaf {leaf.key!r} has {size} bytes, the manifest says {chunk.nbytes}; "
                f"the checkpoint is damaged or truncated"
            )
        arr = np.memmap(path, dtype=np.uint8, mode="c", shape=(chunk.nbytes,))
        addr = arr.ctypes.data
        _MAPPED[addr] = path
        weakref.finalize(arr, _MAPPED.pop, addr, None)
        return arr

    def verify(self, leaf: Leaf, chunk: Chunk, pool: ThreadPoolExecutor | None) -> None:
        """Recompute the chunk's checksum and compare it with the manifest's."""
        if chunk.nbytes == 0:
            actual = combine_digests([])
        else:
            mv = memoryview(self._map(leaf, chunk))
            blocks = [mv[i : i + fmt.CHECKSUM_BLOCK] for i in range(0, len(mv), fmt.CHECKSUM_BLOCK)]
            digests = list(pool.map(xxhash.xxh3_64_intdigest, blocks)) if pool else [xxhash.xxh3_64_intdigest(b) for b in blocks]
            actual = combine_digests(digests)
        if actual != chunk.checksum:
            raise CorruptCheckpointError(
                f"checksum mismatch in {self.path(leaf, chunk)!r} (leaf {leaf.key!r}, rank {chunk.rank}): "
                f"expected {chunk.checksum}, found {actual}; the data is corrupted, restore it from another checkpoint"
            )


def read_box(source: ChunkSource, leaf: Leaf, box: Box, pool: ThreadPoolExecutor | None, verify: bool) -> torch.Tensor:
    """The part ``box`` of ``leaf``: a view when it lies in one chunk, else a threaded copy."""
    pieces = plan_reads(box, [c.box for c in leaf.chunks])
    if verify:
        for p in pieces:
            source.verify(leaf, leaf.chunks[p.chunk_index], pool)
    if len(pieces) == 1 and math.prod(box[1]) > 0:
        p = pieces[0]
        return source.tensor(leaf, leaf.chunks[p.chunk_index])[p.src]
    out = torch.empty(box[1], dtype=leaf.dtype)
    if not out.numel():
        return out

    def copy(p):
        out[p.dst].copy_(source.tensor(leaf, leaf.chunks[p.chunk_index])[p.src])

    if pool is not None and len(pieces) > 1:
        list(pool.map(copy, pieces))
    else:
        for p in pieces:
            copy(p)
    return out


def read_leaves(root: str, manifest: Manifest, requests: Iterable[tuple[Leaf, Box]], num_threads: int, verify: bool) -> list[torch.Tensor]:
    """Read every (leaf, box) request, sharing one pool and one set of maps."""
    source = ChunkSource(root, manifest)
    pool = ThreadPoolExecutor(num_threads, thread_name_prefix="tddist-read") if num_threads > 1 else None
    try:
        return [read_box(source, leaf, box, pool, verify) for leaf, box in requests]
    except OSError as e:
        if e.errno == errno.ENOMEM:
            raise
        raise CorruptCheckpointError(f"cannot read checkpoint {root!r}: {e}") from e
    finally:
        if pool is not None:
            pool.shutdown()
