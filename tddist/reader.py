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
import zipfile
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
from .archive import ArchiveFiles
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
    """Read and validate the manifest of the committed checkpoint (directory or archive) at ``path``."""
    path = os.fspath(path)
    if os.path.isfile(path):
        if not zipfile.is_zipfile(path):
            raise CheckpointNotFoundError(
                f"{path!r} is a file but not a tddist archive; pass a checkpoint directory or a .tdz archive"
            )
        raw = ArchiveFiles(path).read_manifest()
        where = f"manifest of archive {path!r}"
        if not raw:
            raise CheckpointNotFoundError(f"archive {path!r} has no {fmt.MANIFEST_NAME} entry; it is not a tddist checkpoint")
    else:
        where = f"manifest {os.path.join(path, fmt.MANIFEST_NAME)!r}"
        try:
            with open(os.path.join(path, fmt.MANIFEST_NAME), "rb") as f:
                raw = f.read()
        except (FileNotFoundError, NotADirectoryError):
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
        raise ManifestError(f"{where} is not valid JSON ({e}); the checkpoint is damaged") from None
    m = parse_manifest(obj, where=where)
    expected = "archive" if os.path.isfile(path) else "directory"
    if m.layout != expected:
        raise ManifestError(f"{where} declares layout {m.layout!r}, but the checkpoint is a {expected}; it was tampered with")
    return m


class DirectoryFiles:
    """The files of a directory checkpoint, each mapped copy-on-write."""

    def __init__(self, root: str):
        self.root = root

    def array(self, rel: str, nbytes: int) -> np.ndarray:
        path = os.path.join(self.root, rel)
        if not is_inside(self.root, path):
            raise CorruptCheckpointError(f"file {path!r} resolves outside the checkpoint; refusing it")
        try:
            size = os.stat(path).st_size
        except FileNotFoundError:
            raise CorruptCheckpointError(f"file {path!r} is missing; the checkpoint is damaged") from None
        if size != nbytes:
            raise CorruptCheckpointError(
                f"file {path!r} has {size} bytes, the manifest says {nbytes}; the checkpoint is damaged or truncated"
            )
        return np.memmap(path, dtype=np.uint8, mode="c", shape=(nbytes,))


def open_files(path: str):
    """The reader of a checkpoint's files: ``ArchiveFiles`` for an archive, else ``DirectoryFiles``."""
    return ArchiveFiles(path) if os.path.isfile(path) else DirectoryFiles(path)


class ChunkSource:
    """Opens (and caches) the chunks of one checkpoint as tensors."""

    def __init__(self, root: str, manifest: Manifest):
        self.root = root
        self.manifest = manifest
        self.files = open_files(root)
        self._maps: dict[tuple, torch.Tensor] = {}

    def relpath(self, leaf: Leaf, chunk: Chunk) -> str:
        return fmt.leaf_relpath(chunk.rank, leaf.key, self.manifest.robust_key)

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
            t = torch.from_numpy(self._array(leaf, chunk)).view(leaf.dtype).view(sizes)
        self._maps[cache_key] = t
        return t

    def _array(self, leaf: Leaf, chunk: Chunk) -> np.ndarray:
        try:
            arr = self.files.array(self.relpath(leaf, chunk), chunk.nbytes)
        except CorruptCheckpointError as e:
            raise CorruptCheckpointError(f"leaf {leaf.key!r} (written by rank {chunk.rank}): {e}") from None
        if isinstance(arr, np.memmap) or isinstance(arr.base, np.memmap):
            addr = arr.ctypes.data
            _MAPPED[addr] = os.path.join(self.root, self.relpath(leaf, chunk))
            weakref.finalize(arr, _MAPPED.pop, addr, None)
        return arr

    def verify(self, leaf: Leaf, chunk: Chunk, pool: ThreadPoolExecutor | None) -> None:
        """Recompute the chunk's checksum and compare it with the manifest's."""
        if chunk.nbytes == 0:
            actual = combine_digests([])
        else:
            mv = memoryview(self._array(leaf, chunk))
            blocks = [mv[i : i + fmt.CHECKSUM_BLOCK] for i in range(0, len(mv), fmt.CHECKSUM_BLOCK)]
            digests = list(pool.map(xxhash.xxh3_64_intdigest, blocks)) if pool else [xxhash.xxh3_64_intdigest(b) for b in blocks]
            actual = combine_digests(digests)
        if actual != chunk.checksum:
            raise CorruptCheckpointError(
                f"checksum mismatch in {self.relpath(leaf, chunk)!r} of {self.root!r} (leaf {leaf.key!r}, rank "
                f"{chunk.rank}): expected {chunk.checksum}, found {actual}; the data is corrupted, restore it from "
                f"another checkpoint"
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
