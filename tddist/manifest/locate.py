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
from .chunks import Chunk
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
        self._all: tuple[np.ndarray, np.ndarray] | None = None  # offsets[leaf, rank], sizes[rank]

    def locate(self, leaf: Leaf, chunk: Chunk) -> Location:
        m = self.manifest
        if m.packing != "packed":
            return Location(fmt.leaf_relpath(chunk.rank, leaf.key, m.robust_key), 0, chunk.nbytes, chunk.nbytes)
        offsets, size = self.packed(chunk.rank)
        return Location(fmt.rank_data_name(chunk.rank), offsets.get(leaf.key, 0), chunk.nbytes, size)

    def packed(self, rank: int) -> tuple[dict[Key, int], int]:
        """Each leaf's offset in ``rank``'s data file, and the file's size.

        The first rank asked for is computed alone (one pass over the leaves:
        a rank loading its own rows); from the second one on, every rank is
        computed at once, column by column (a load of the whole checkpoint).
        """
        found = self._packed.get(rank)
        if found is not None:
            return found
        keys = list(self.manifest.leaves)
        if not self._packed and self._all is None:
            nbytes = np.array([leaf.table.nbytes_of_rank(rank) for leaf in self.manifest.leaves.values()], np.int64)
            offsets, total = packed_offsets(nbytes)
            size = int(total)
        else:
            if self._all is None:
                self._all = self._every_rank()
            offsets, size = self._all[0][:, rank], int(self._all[1][rank])
        found = self._packed[rank] = (dict(zip(keys, offsets.tolist())), size)
        return found

    def _every_rank(self) -> tuple[np.ndarray, np.ndarray]:
        """offsets[leaf, rank] of every chunk in its rank's data file, and every data file's size."""
        world = self.manifest.world_size
        rows = [leaf.table.nbytes_by_rank(world) for leaf in self.manifest.leaves.values()]
        return packed_offsets(np.stack(rows) if rows else np.zeros((0, world), dtype=np.int64))


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
