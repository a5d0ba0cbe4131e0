"""tddist checkpoints (directories and ``.tdz`` archives) as a conversion's source or destination.

Reading opens the checkpoint once (one generation, pinned until the
conversion ends: an overwrite meanwhile cannot mix two) and reads each leaf
whole through one ``ChunkSource`` (its chunks put together), with every
chunk's checksum verified. Once a leaf is written (when the next one is read,
or at once when the leaf was copied out of its chunks) the pages of its chunks
are dropped from the process, so a conversion holds about one leaf however
large the checkpoint.
Writing is ``tddist.save`` in one process, so the result is committed
atomically and checksummed like any checkpoint; its leaves are replicated
(one rank).
"""

from __future__ import annotations

import errno
import logging
import os
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch
from tensordict import NonTensorData

from ..api import save
from ..comm.base import LocalComm
from ..core.types import AllRows
from ..loading.read import ChunkSource, read_box
from ..loading.share import leaf_box, object_value
from ..manifest.model import Leaf, Manifest
from ..saving.memmaps import allocated_by_torch
from ..storage.backends import open_checkpoint
from ..storage.pinned import storage_failed
from . import Key, Selection, TensorEntry, nested_dict

logger = logging.getLogger(__name__)


class TddistSource:
    """A committed tddist checkpoint opened once, read leaf by leaf (sharded leaves come back whole); close it."""

    kind = "tddist"
    nested = True

    def __init__(self, path: str, allow_pickle: bool, num_threads: int = 0) -> None:
        self.path = path
        self.allow_pickle = allow_pickle
        self._opened = open_checkpoint(path)  # the generation every leaf is read from
        try:
            self.manifest: Manifest = self._opened.manifest
            self._chunks = ChunkSource(self._opened, self.manifest)  # one map per data file, one locator
        except BaseException:
            self._opened.close()
            raise
        self._pool = ThreadPoolExecutor(num_threads, thread_name_prefix="tddist-convert") if num_threads > 1 else None
        self._held: Leaf | None = None  # the leaf last read as a view of its chunks: released at the next read

    def tensors(self) -> list[TensorEntry]:
        return [TensorEntry(k, leaf.dtype, tuple(leaf.shape)) for k, leaf in self.manifest.leaves.items()]

    def value_keys(self) -> list[Key]:
        return list(self.manifest.objects)

    def read(self, entry: TensorEntry) -> torch.Tensor:
        """The whole leaf, its chunks verified; the previous leaf's pages are dropped first (it was written)."""
        self._release()
        leaf = self.manifest.leaves[entry.key]
        try:
            t = read_box(self._chunks, leaf, leaf_box(leaf, AllRows(), 0, 1), self._pool, True)
        except OSError as e:
            if e.errno == errno.ENOMEM:
                raise
            raise storage_failed(self.path, e) from e
        self._held = leaf
        if allocated_by_torch(t):  # copied out of its chunks: they are done with now
            self._release()
        return t

    def _release(self) -> None:
        if self._held is not None:
            self._chunks.release(self._held)
            self._held = None

    def close(self) -> None:
        """Drop the last leaf's pages, stop the reading threads, release the pinned generation (idempotent)."""
        try:
            self._release()
            if self._pool is not None:
                self._pool.shutdown()
                self._pool = None
        finally:
            self._opened.close()

    def value(self, key: Key) -> Any:
        _kind, value = object_value(self.manifest.objects[key], AllRows(), 0, 1, self.allow_pickle)
        return value

    def metadata(self) -> dict[str, Any]:
        return dict(self.manifest.metadata)


def write_tddist(
    sel: Selection,
    dst: str,
    *,
    archive: bool,
    compression: Any,
    allow_pickle: bool,
    num_threads: int,
) -> None:
    """Save the selection as a one-rank tddist checkpoint at ``dst`` (committed atomically by ``save``).

    ``save`` takes every leaf at once: each leaf is a copy-on-write map (of
    the source, or of a spill file beside ``dst``), read as it is written
    (``Selection.spilled_leaves``).
    """
    items: list[tuple[Key, Any]] = list(sel.spilled_leaves(os.path.dirname(dst)))
    items += [(k, NonTensorData(data=v)) for k, v in sel.value_items()]  # a dict value stays one value
    data = nested_dict(items)
    save(
        data,
        dst,
        comm=LocalComm(),
        archive=archive,
        compression=compression,
        metadata=sel.source.metadata(),
        copy_existing=True,
        allow_pickle=allow_pickle,
        num_threads=num_threads,
    )
    logger.info("wrote %d leaves into %s", len(items), os.path.basename(dst))
