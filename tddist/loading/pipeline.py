"""The path of a load, read top to bottom: open one generation on every rank, agree on it, read, build.

``load`` (``tddist.load`` checks the arguments and calls it) runs:

1. ``open_agreed``: every rank opens the checkpoint through its store
   (``storage.backends``); on several ranks they compare the generations
   they pinned, so every rank reads the same one (an overwrite that
   committed in between makes every rank open again, up to ``ATTEMPTS``
   times);
2. ``read_into`` (``into=``: fill the caller's TensorDict in place,
   ``loading.into``) or ``read_shard`` (build this rank's TensorDict): each
   plans its boxes from the manifest (``share``, ``per_rank``) and reads them
   through the opened checkpoint's ``ChunkFiles`` (``read``); in a resharding
   load the ranks of one node first split the reads of the files they share
   (``cooperate``);
3. the pin is closed; the returned tensors map the files they came from.

A save reads back what it committed with ``read_shard`` too
(``saving.committing.open_committed``).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, TypeVar

from tensordict import TensorDict

from ..comm.base import Communicator
from ..comm.collective import run_step
from ..comm.node import node_name
from ..core.sharding import Box, PerRank
from ..core.tree import build, select
from ..core.types import AllRows, Key, LoadOptions, SavedRows
from ..errors import CheckpointChangedError, InvalidArgumentError
from ..manifest.model import Manifest
from ..storage.opened import OpenedCheckpoint, Readable
from . import per_rank as pr
from .cooperate import NodeRanks, SharedReads, node_ranks
from .into import fill
from .read import read_leaves
from .share import LoadReport, check_exclude, in_scope, leaf_box, node_rows, object_value

logger = logging.getLogger(__name__)

T = TypeVar("T")

#: How often a load reads a checkpoint that an overwrite keeps replacing before it gives up.
ATTEMPTS = 3


def load(
    store: Readable, c: Communicator, options: LoadOptions, into: Any = None, strict: bool = True
) -> TensorDict | LoadReport:
    """Read the committed checkpoint of ``store`` on ``c``: this rank's TensorDict, or ``into`` filled in place.

    Alone (one rank, or ``shard=None`` without ``into``): open, read, close. On
    several ranks every rank reads the same generation, or all raise.
    """

    def read(opened: OpenedCheckpoint, node: NodeRanks) -> TensorDict | LoadReport:
        if into is not None:
            return read_into(opened, c, options, into, strict)
        return read_shard(opened, c, options, node=node)

    alone = c.size == 1 or (isinstance(options.shard, AllRows) and into is None)
    for attempt in range(1, ATTEMPTS + 1):
        try:
            return open_agreed(store, c, read, alone)
        except CheckpointChangedError:
            if attempt == ATTEMPTS:
                raise
            logger.info("rank %d: %s was replaced while it was read; reading it again", c.rank, store.target)
    raise AssertionError("unreachable")


def open_agreed(store: Readable, c: Communicator, read: Callable[[OpenedCheckpoint, NodeRanks], T], alone: bool) -> T:
    """Open the checkpoint once and ``read`` it; on several ranks, every rank reads the same generation.

    Alone: open, read, close. On several ranks: every rank opens it (or all
    raise), they compare the generations they pinned (an overwrite may have
    committed between two ranks' opens: then every rank raises
    ``CheckpointChangedError``), then every rank reads, or all raise. The
    generations travel with each rank's node name: ``read`` learns which ranks
    share this rank's node (``cooperate``).
    """
    target = store.target
    if alone:
        with store.open() as opened:
            return read(opened, NodeRanks((c.rank,)))
    pinned = run_step(c, f"opening {target!r}", store.open)
    assert pinned is not None  # run_step raised on every rank otherwise
    with pinned:
        opened_on = c.allgather(OpenedOn(pinned.generation, node_name()))
        generations = [o.generation for o in opened_on]
        node = node_ranks([o.node for o in opened_on], c.rank)
        if len(set(generations)) > 1:
            raise CheckpointChangedError(
                f"rank {c.rank}: {target!r} was replaced while the ranks opened it ({len(set(generations))} "
                f"generations among {c.size} ranks); load it again"
            )
        result = run_step(c, f"load of {target!r}", lambda: read(pinned, node))
    assert result is not None  # run_step raised on every rank otherwise
    return result


@dataclass(frozen=True)
class OpenedOn:
    """What each rank tells the others once it opened the checkpoint: the generation it pinned, and its node."""

    generation: str
    node: str


def read_into(opened: OpenedCheckpoint, c: Communicator, options: LoadOptions, into: Any, strict: bool) -> LoadReport:
    """Fill ``into`` in place from the opened checkpoint, each leaf in its own placements (``loading.into``)."""
    return fill(
        opened.manifest, opened.path, into, strict=strict, options=options, rank=c.rank, size=c.size, pinned=opened
    )


@dataclass(frozen=True, slots=True)
class _Selection:
    """What one rank reads of a manifest: leaf and node keys, per-rank state resolved, non-tensor values."""

    leaf_keys: list[Key]
    node_keys: list[Key]
    per_rank: pr.Resolution
    objects: dict[Key, tuple[str, Any]]


def read_shard(
    opened: OpenedCheckpoint,
    c: Communicator,
    options: LoadOptions,
    own_boxes: Mapping[Key, Box] | None = None,
    node: NodeRanks | None = None,
) -> TensorDict:
    """This rank's part of the opened checkpoint as a TensorDict (``own_boxes``: DTensor boxes it just saved;
    ``node``: the ranks on this rank's node, which share the reads of a resharding load, ``cooperate``)."""
    manifest, target = opened.manifest, opened.path
    shard = options.shard
    if isinstance(shard, SavedRows) and manifest.world_size != c.size:
        raise InvalidArgumentError(
            f"rank {c.rank}: shard='saved' needs the saving world size ({manifest.world_size} ranks), this job has "
            f"{c.size}; use shard='even' to reshard"
        )
    chosen = _select(manifest, target, c, options)
    shared = _shared_reads(manifest, c, options, chosen, node) if node is not None and not own_boxes else None
    loaded = _read_tensors(opened, c, options, chosen, own_boxes or {}, shared)

    def rows(key: Key, batch: tuple[int, ...]) -> int:
        return node_rows(manifest, key, batch[0], shard, c.rank, c.size)

    nodes = {k: manifest.nodes[k] for k in chosen.node_keys}
    return build(nodes, loaded, rows, options.device, chosen.objects, options.share_non_tensor)


def _select(manifest: Manifest, target: str, c: Communicator, options: LoadOptions) -> _Selection:
    """The keys ``keys=``/``exclude=`` leave, per-rank state resolved for this rank, and the non-tensor values."""
    leaf_keys, node_keys = select(list(manifest.leaves) + list(manifest.objects), manifest.nodes, options.keys)
    if options.exclude:
        check_exclude(options.exclude, [*manifest.nodes, *manifest.leaves, *manifest.objects], f"{target!r}")
        leaf_keys = [k for k in leaf_keys if in_scope(k, None, options.exclude)]
        node_keys = [k for k in node_keys if not k or in_scope(k, None, options.exclude)]
    res = pr.resolve(
        manifest, leaf_keys, options.shard, options.per_rank, c.rank, c.size, f"the checkpoint at {target!r}"
    )
    if res.dropped:
        logger.info(
            "rank %d: left out per-rank keys %s: %s",
            c.rank,
            [list(k) for k in res.dropped],
            "; ".join(set(res.dropped.values())),
        )
    objects = {}
    for k in leaf_keys:
        obj = manifest.objects.get(k)
        if obj is None or k in res.dropped:
            continue
        if obj.declared:
            found, value = pr.object_value(obj, res, options.allow_pickle, c.rank, c.size)
            if found:
                objects[k] = ("data", value)
        else:
            objects[k] = object_value(obj, options.shard, c.rank, c.size, options.allow_pickle)
    tensors = [k for k in leaf_keys if k in manifest.leaves and k not in res.dropped]
    return _Selection(tensors, node_keys, res, objects)


def _shared_reads(
    manifest: Manifest, c: Communicator, options: LoadOptions, chosen: _Selection, node: NodeRanks
) -> SharedReads | None:
    """What every rank of this node reads of a resharding load (its plain and sharded leaves, which each rank
    places alike), for ``cooperate``; None where the node has one rank or the load keeps the saved layout
    (each rank then reads files of its own)."""
    if len(node.ranks) < 2 or manifest.world_size == c.size:
        return None
    leaves = [manifest.leaves[k] for k in chosen.leaf_keys if not isinstance(manifest.leaves[k].placement, PerRank)]
    return SharedReads(
        tuple(tuple((leaf, leaf_box(leaf, options.shard, r, c.size)) for leaf in leaves) for r in node.ranks),
        node.ranks.index(c.rank),
    )


def _read_tensors(
    opened: OpenedCheckpoint,
    c: Communicator,
    options: LoadOptions,
    chosen: _Selection,
    own_boxes: Mapping[Key, Box],
    shared: SharedReads | None = None,
) -> dict[Key, Any]:
    """Read every chosen leaf's box (a per-rank leaf: the saving ranks' rows it needs) and move it to ``device``."""
    manifest, res = opened.manifest, chosen.per_rank
    requests: list[tuple[Key, list[Box]]] = []
    for k in chosen.leaf_keys:
        leaf = manifest.leaves[k]
        if isinstance(leaf.placement, PerRank):
            requests.append((k, pr.boxes_to_read(leaf, res)))
        else:
            requests.append((k, [own_boxes.get(k) or leaf_box(leaf, options.shard, c.rank, c.size)]))
    flat = [(manifest.leaves[k], box) for k, boxes in requests for box in boxes]
    read = iter(read_leaves(opened, manifest, flat, options.num_threads, options.verify, shared))
    loaded = {}
    for k, boxes in requests:
        got = [next(read) for _box in boxes]
        leaf = manifest.leaves[k]
        value = pr.tensor_value(k, leaf, got, res, c.rank, c.size) if isinstance(leaf.placement, PerRank) else got[0]
        if value is not None:
            loaded[k] = value if options.device is None else value.to(options.device)
    return loaded
