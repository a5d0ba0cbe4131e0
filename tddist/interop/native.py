"""tddist checkpoints (directories and ``.tdz`` archives) as a conversion's source or destination.

Reading goes through the manifest and the rank-local reader: each leaf is
read whole (its chunks put together), with every chunk's checksum verified.
Writing is ``tddist.save`` in one process, so the result is committed
atomically and checksummed like any checkpoint; its leaves are replicated
(one rank).
"""

from __future__ import annotations

import logging
import os
from typing import Any

import torch
from tensordict import NonTensorData

from ..api import read_manifest, save
from ..comm.base import LocalComm
from ..core.types import AllRows
from ..loading.read import read_leaves
from ..loading.share import leaf_box, object_value
from ..manifest.model import Manifest
from . import Key, Selection, TensorEntry, nested_dict

logger = logging.getLogger(__name__)


class TddistSource:
    """A committed tddist checkpoint, read leaf by leaf (sharded leaves come back whole)."""

    kind = "tddist"
    nested = True

    def __init__(self, path: str, allow_pickle: bool, num_threads: int = 0) -> None:
        self.path = path
        self.manifest: Manifest = read_manifest(path)
        self.allow_pickle = allow_pickle
        self.num_threads = num_threads

    def tensors(self) -> list[TensorEntry]:
        return [TensorEntry(k, leaf.dtype, tuple(leaf.shape)) for k, leaf in self.manifest.leaves.items()]

    def value_keys(self) -> list[Key]:
        return list(self.manifest.objects)

    def read(self, entry: TensorEntry) -> torch.Tensor:
        leaf = self.manifest.leaves[entry.key]
        box = leaf_box(leaf, AllRows(), 0, 1)
        (t,) = read_leaves(self.path, self.manifest, [(leaf, box)], self.num_threads, True)
        return t

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
