"""Rank 0's merge of the ranks' votes into the manifest, column by column.

Every fragment is a few arrays in the order of the save's ``Structure``
(rank 0's, which the commit compared with every rank's by digest), so the
merge stacks them into matrices (ranks x leaves) and reads each leaf's column:
no object per chunk, no dict per leaf and rank. A save whose structure,
world size and DTensor boxes are those of the previous save on the same
communicator takes the cached path: the ranks leave their boxes out and rank
0 reuses the boxes it validated last time (``MergeCache``).
"""

from __future__ import annotations

import dataclasses
import datetime
import logging
import math
from dataclasses import dataclass, field

import numpy as np

from .. import format as fmt
from ..core.finite import is_floating
from ..core.sharding import Box, Boxes, PerRank, Replicate, Shard, box_tiling_problems, replica_writers
from ..core.types import Fragment, Key, LeafSpec, Structure
from ..errors import ShardingError
from .chunks import FINITE, BoxChunks, ChunkTable, LeafStats, ReplicaChunks, ShardChunks
from .model import Leaf, Manifest, ObjectLeaf, RankMagnitudes
from .refs import RefColumns, merge_leaf_refs, used_holders

logger = logging.getLogger(__name__)

_I8 = np.dtype("<i8")
_U8 = np.dtype("<u8")


@dataclass(frozen=True)
class _PendingMerge:
    """What a merge leaves for the next save's cached path, current once its save commits."""

    world: int
    digest: str
    rank_boxes: list[bytes]
    boxes: dict[Key, BoxChunks]


@dataclass
class MergeCache:
    """What a communicator remembers between saves, for the cached path.

    On rank 0: the world size, structure digest, every rank's boxes and the
    merged DTensor boxes (whose tiling was validated) of the last committed
    save. On every rank: the digest and boxes it sent in its last committed
    save; when both are unchanged it sends no boxes. A merge's state becomes
    current only once its save is committed (``committed``), so a save that
    failed after the merge never feeds the next one.
    """

    world: int = 0
    digest: str = ""
    rank_boxes: list[bytes] = field(default_factory=list)
    boxes: dict[Key, BoxChunks] = field(default_factory=dict)
    sent_digest: str = ""
    sent_boxes: bytes | None = None
    pending: _PendingMerge | None = None  # this merge's state until its save commits
    full_merges: int = 0
    cached_merges: int = 0

    def committed(self, digest: str, boxes: bytes) -> None:
        """The save this rank took part in is committed: what it sent (and rank 0 merged) becomes current."""
        self.sent_digest, self.sent_boxes = digest, boxes
        if self.pending is not None:
            p = self.pending
            self.world, self.digest, self.rank_boxes, self.boxes = p.world, p.digest, p.rank_boxes, p.boxes
            self.pending = None


@dataclass(frozen=True)
class _Columns:
    """The ranks' per-leaf numbers as matrices (ranks x nodes, ranks x leaves), from every fragment's arrays.

    Attributes:
        node_rows: each batched node's rows per rank.
        lengths: each leaf's length along its shard dim per rank.
        checksums: each leaf's chunk checksum per rank.
    """

    node_rows: np.ndarray
    lengths: np.ndarray
    checksums: np.ndarray

    @classmethod
    def stack(cls, fragments: list[Fragment]) -> _Columns:
        """Stack the fragments' arrays, one row per rank, in rank order."""
        world = len(fragments)
        return cls(
            node_rows=np.stack([np.frombuffer(f.node_rows, dtype=_I8) for f in fragments]).reshape(world, -1),
            lengths=np.stack([np.frombuffer(f.lengths, dtype=_I8) for f in fragments]).reshape(world, -1),
            checksums=np.stack([np.frombuffer(f.checksums, dtype=_U8) for f in fragments]).reshape(world, -1),
        )


@dataclass(frozen=True)
class _Counts:
    """The votes' counts of non-finite values (sparse: nothing for a clean save).

    Attributes:
        by_leaf: for each leaf index with chunks that hold a NaN or an Inf: the ranks that stored them and
            their NaN and Inf counts (int64, uint64, uint64 arrays, in rank order).
        uncounted: the leaf indices some rank stored without counting them.
        largest: each rank's largest finite magnitude and the index of the leaf that holds it.
    """

    by_leaf: dict[int, tuple[np.ndarray, np.ndarray, np.ndarray]]
    uncounted: frozenset[int]
    largest: RankMagnitudes

    @classmethod
    def gather(cls, fragments: list[Fragment]) -> _Counts:
        """The counts of every rank's vote (``storage.base.encode_stats``)."""
        rows = [(f.rank, np.frombuffer(f.non_finite, dtype=_U8).reshape(-1, 3)) for f in fragments if f.non_finite]
        by_leaf: dict[int, tuple[np.ndarray, np.ndarray, np.ndarray]] = {}
        if rows:
            ranks = np.concatenate([np.full(len(t), r, dtype=_I8) for r, t in rows])
            triples = np.concatenate([t for _r, t in rows])
            order = np.lexsort((ranks, triples[:, 0]))  # by leaf, then rank
            ranks, triples = ranks[order], triples[order]
            leaves, starts = np.unique(triples[:, 0], return_index=True)
            for leaf, lo, hi in zip(leaves.tolist(), starts.tolist(), [*starts[1:].tolist(), len(ranks)]):
                by_leaf[int(leaf)] = (ranks[lo:hi], triples[lo:hi, 1], triples[lo:hi, 2])
        uncounted = frozenset(int(i) for f in fragments if f.uncounted for i in np.frombuffer(f.uncounted, _I8))
        values = np.array([f.largest for f in fragments], dtype="<f8")
        at = np.array([f.largest_leaf for f in fragments], dtype=_I8)
        return cls(by_leaf, uncounted, RankMagnitudes(values, at))


@dataclass(frozen=True)
class _MergedBoxes:
    """The DTensor boxes a merge uses, and whether they come from the cache.

    Attributes:
        rank_boxes: every rank's encoded boxes (those the cache holds for a rank that sent none).
        cached: every rank's boxes are those of the last committed save, whose tiling was validated.
        by_key: every DTensor leaf's boxes.
    """

    rank_boxes: list[bytes | None]
    cached: bool
    by_key: dict[Key, BoxChunks]


def merge_fragments(
    fragments: list[Fragment],
    reference: Structure,
    *,
    metadata: dict,
    robust_key: bool,
    version: str,
    container: str,
    packing: str,
    cache: MergeCache | None = None,
) -> Manifest:
    """The manifest of a save from every rank's fragment (rank 0).

    Args:
        fragments: every rank's vote, in rank order.
        reference: rank 0's structure; every fragment must have its digest.
        metadata, robust_key, version, packing: stored as given; container: stored as the manifest's
            ``layout`` ("directory" or "archive").
        cache: this communicator's ``MergeCache`` (updated here).

    Raises:
        ShardingError: the ranks' shards do not fit together (a DTensor's
            boxes do not tile it, replicas differ, structures differ).
    """
    world = len(fragments)
    _check_digests(fragments, reference)
    columns = _Columns.stack(fragments)
    boxes = _merge_boxes(fragments, reference, cache)
    m = Manifest(
        world_size=world,
        nodes={},
        leaves={},
        metadata=dict(metadata),
        robust_key=robust_key,
        created=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        tddist_version=version,
        version=fmt.FORMAT_VERSION,
        layout=container,
        packing=packing,
        structure_digest=reference.digest,
    )
    _merge_nodes(m, reference, columns.node_rows)
    counts = _Counts.gather(fragments)
    _merge_leaves(m, reference, columns, counts, boxes)
    m.largest = counts.largest
    _merge_refs(m, fragments)
    m.objects = _merge_objects(fragments, reference)
    if cache is not None:
        _remember(cache, m, reference, boxes)
    logger.debug("merged %d fragments (%s path)", world, "cached" if boxes.cached else "full")
    return m


def _check_digests(fragments: list[Fragment], reference: Structure) -> None:
    """Refuse fragments of another structure than rank 0's: the columns would not line up."""
    for f in fragments:
        if f.digest != reference.digest:
            raise ShardingError(
                f"rank {f.rank} saves a different structure than rank 0 (digest {f.digest} vs {reference.digest})"
            )


def _merge_boxes(fragments: list[Fragment], reference: Structure, cache: MergeCache | None) -> _MergedBoxes:
    """The boxes of the DTensor leaves: the cache's when nothing changed since the last committed save
    (the ranks may then send none), else merged and, later, validated from every rank's (the full path)."""
    world = len(fragments)
    known = cache is not None and cache.world == world and cache.digest == reference.digest
    rank_boxes = [
        f.boxes if f.boxes is not None else (cache.rank_boxes[f.rank] if known and cache is not None else None)
        for f in fragments
    ]
    cached = known and cache is not None and rank_boxes == cache.rank_boxes
    boxes = dict(cache.boxes) if cached and cache is not None else _boxes(rank_boxes, reference)
    return _MergedBoxes(rank_boxes=rank_boxes, cached=cached, by_key=boxes)


def _merge_nodes(m: Manifest, reference: Structure, node_rows: np.ndarray) -> None:
    """Every node's batch size into ``m``: a batched node's rows are the sum of the ranks' (kept per rank too)."""
    for i, node in enumerate(reference.nodes):
        if node.batch:
            rows = node_rows[:, i]
            m.nodes[node.key] = (int(rows.sum()), *node.batch[1:])
            m.node_rows[node.key] = rows.tolist()
        else:
            m.nodes[node.key] = ()


def _merge_leaves(m: Manifest, reference: Structure, columns: _Columns, counts: _Counts, boxes: _MergedBoxes) -> None:
    """Every tensor leaf into ``m``, with its chunk table read from its column of the ranks' numbers."""
    writers = replica_writers(
        {
            s.key: math.prod(s.shape) * fmt.dtype_itemsize(s.dtype)
            for s in reference.leaves
            if isinstance(s.placement, Replicate)
        },
        m.world_size,
    )  # as each rank's prepare_shard chose them
    for i, spec in enumerate(reference.leaves):
        lengths_i = np.ascontiguousarray(columns.lengths[:, i])
        sums_i = np.ascontiguousarray(columns.checksums[:, i])
        table = _table(spec, lengths_i, sums_i, boxes.by_key, boxes.cached, writers.get(spec.key, 0))
        shape = table.shape if isinstance(table, (ShardChunks, ReplicaChunks)) else spec.global_shape or ()
        stats = _leaf_stats(table, counts, i) if is_floating(spec.dtype) else None
        m.leaves[spec.key] = Leaf(spec.key, spec.dtype, tuple(shape), spec.placement, table, stats)


def _stored_by(table: ChunkTable) -> slice | list[int] | np.ndarray:
    """The ranks that stored a leaf's chunks, in chunk order (which rows of a ranks x leaves column to read)."""
    if isinstance(table, ShardChunks):
        return slice(None)
    if isinstance(table, ReplicaChunks):
        return [table.writer]
    return table.ranks


def _merge_refs(m: Manifest, fragments: list[Fragment]) -> None:
    """An incremental save (the votes carry identities): every leaf's holders and identities into ``m``, and
    the holders the chunks name (numbered in the base's table, which every rank that read a base shares).

    Raises:
        ShardingError: two ranks read different generations of the base (it was replaced during the save).
    """
    if not any(f.ids for f in fragments):
        return
    tables = {f.base for f in fragments if f.base is not None}
    if len(tables) > 1:
        raise ShardingError(
            "the ranks read different generations of the base checkpoint (it was replaced during this save); "
            "nothing was committed: save again"
        )
    table = tables.pop() if tables else ()
    columns = RefColumns.stack(fragments)
    refs = [merge_leaf_refs(columns, i, _stored_by(leaf.table)) for i, leaf in enumerate(m.leaves.values())]
    m.holders, refs = used_holders(table, refs)
    for leaf, r in zip(list(m.leaves.values()), refs):
        m.leaves[leaf.key] = dataclasses.replace(leaf, refs=r)


def _leaf_stats(table: ChunkTable, counts: _Counts, i: int) -> LeafStats | None:
    """Leaf ``i``'s counts: its chunks that hold non-finite values, in chunk order, from the ranks that stored
    them; None when one of its ranks did not count it."""
    if i in counts.uncounted:
        return None
    found = counts.by_leaf.get(i)
    if found is None:
        return FINITE
    ranks, nan, inf = found
    if isinstance(table, ShardChunks):  # chunk r is rank r's
        chunks = ranks
    else:
        chunks = np.array([-1 if (c := table.index_of_rank(int(r))) is None else c for r in ranks], dtype=_I8)
    keep = chunks >= 0  # a rank that stored no chunk of the leaf reports none (a guard, not a case)
    order = np.argsort(chunks[keep], kind="stable")
    return LeafStats(chunks[keep][order], nan[keep][order], inf[keep][order])


def _remember(cache: MergeCache, m: Manifest, reference: Structure, boxes: _MergedBoxes) -> None:
    """Keep this merge's boxes as the cache's pending state (current once the save commits) and count the path."""
    merged = {k: t for k, t in ((k, m.leaves[k].table) for k in boxes.by_key) if isinstance(t, BoxChunks)}
    cache.pending = _PendingMerge(m.world_size, reference.digest, [b or b"" for b in boxes.rank_boxes], merged)
    if boxes.cached:
        cache.cached_merges += 1
    else:
        cache.full_merges += 1


def _table(
    spec: LeafSpec, lengths: np.ndarray, sums: np.ndarray, boxes: dict[Key, BoxChunks], cached: bool, writer: int
) -> ChunkTable:
    itemsize = fmt.dtype_itemsize(spec.dtype)
    if isinstance(spec.placement, Shard):
        dim = spec.placement.dim
        shape = spec.shape[:dim] + (int(lengths.sum()),) + spec.shape[dim + 1 :]
        return ShardChunks(shape, dim, itemsize, lengths, sums)
    if isinstance(spec.placement, PerRank):  # the ranks' values stacked along a new dim 0, one row each
        world = len(lengths)
        return ShardChunks((world, *spec.shape), 0, itemsize, np.ones(world, dtype=_I8), sums)
    if isinstance(spec.placement, Replicate):
        differing = [r for r in range(len(sums)) if r != writer and sums[r] not in (0, sums[writer])]
        if differing:
            raise ShardingError(
                f"replicated leaf {_show(spec.key)} differs between ranks: rank(s) {differing[:16]} hold other values "
                f"than rank {writer}, whose copy would be written; if each rank's value is its own (an RNG state, a "
                f"sampler's position), save it with placements={{{_show(spec.key)}: tddist.PerRank()}}; otherwise "
                f"make the replicas equal, or shard the leaf"
            )
        return ReplicaChunks(spec.shape, itemsize, writer, int(sums[writer]))
    assert isinstance(spec.placement, Boxes)
    known = boxes[spec.key]
    table = BoxChunks(itemsize, known.ranks, known.offsets, known.sizes, sums[known.ranks])
    if not cached:
        gshape = spec.global_shape or ()
        problems = box_tiling_problems(gshape, table.offsets, table.sizes)
        if problems:
            raise ShardingError(
                f"the ranks' shards of DTensor leaf {_show(spec.key)} do not tile its global shape {list(gshape)}: "
                f"{'; '.join(problems)}"
            )
    return table


def _boxes(rank_boxes: list[bytes | None], reference: Structure) -> dict[Key, BoxChunks]:
    """Every DTensor leaf's boxes from every rank's (the full path)."""
    specs = [s for s in reference.leaves if isinstance(s.placement, Boxes)]
    if not specs:
        return {}
    per_rank = []
    for r, b in enumerate(rank_boxes):
        if b is None:
            raise ShardingError(f"rank {r} sent no DTensor boxes, and rank 0 has none cached for this save")
        per_rank.append(np.frombuffer(b, dtype=_I8))
    out = {}
    pos = 0
    for spec in specs:
        d = len(spec.global_shape or ())
        cols = np.stack([a[pos : pos + 1 + 2 * d] for a in per_rank])
        pos += 1 + 2 * d
        ranks = np.nonzero(cols[:, 0])[0].astype(_I8)
        out[spec.key] = BoxChunks(0, ranks, cols[ranks, 1 : 1 + d], cols[ranks, 1 + d :], np.zeros(0, dtype=_U8))
    return out


def encode_boxes(boxes: list[tuple[bool, Box]]) -> bytes:
    """A rank's boxes of its DTensor leaves, in structure order: writes (0/1), offsets, sizes (int64)."""
    flat: list[int] = []
    for writes, (offsets, sizes) in boxes:
        flat += [int(writes), *offsets, *sizes]
    return np.asarray(flat, dtype=_I8).tobytes()


def _merge_objects(fragments: list[Fragment], reference: Structure) -> dict[Key, ObjectLeaf]:
    """Non-tensor leaves: equal values on all ranks are stored once, others per rank; stacks are sharded."""
    out: dict[Key, ObjectLeaf] = {}
    for i, spec in enumerate(reference.objects):
        values = [f.objects[i].value for f in fragments]
        encoded = [fmt.dumps(v) for v in values]  # 1, 1.0 and True are ==, but not the same value
        if spec.kind == "stack":
            out[spec.key] = ObjectLeaf(spec.key, "shard", values)
        elif spec.per_rank:
            out[spec.key] = ObjectLeaf(spec.key, "per_rank", values, declared=True)
        elif all(e == encoded[0] for e in encoded):
            out[spec.key] = ObjectLeaf(spec.key, "replicate", values[:1])
        else:
            out[spec.key] = ObjectLeaf(spec.key, "per_rank", values)
    return out


def _show(key: Key) -> str:
    return repr(key[0]) if len(key) == 1 else repr(tuple(key))
