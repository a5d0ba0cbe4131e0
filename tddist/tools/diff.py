"""Comparing two checkpoints: keys, dtypes, shapes, placements, non-tensor values, metadata and content.

``diff(a, b)`` compares two committed checkpoints (directories or archives,
saved on any world sizes, in any packing or format version). Content is
compared by checksum where both checkpoints split a leaf into the same
chunks (read from the chunk tables' columns), so no data is read; only
where the chunks differ (another world size, another placement) are the
bytes compared, chunk against the overlapping pieces of the other, through
memory maps. ``read_data=False`` never reads data.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field

import numpy as np

from .. import format as fmt
from ..core.sharding import Boxes, PerRank, Replicate, Shard
from ..manifest.chunks import ReplicaChunks, ShardChunks
from ..manifest.model import Leaf, Manifest, ObjectLeaf
from ..storage.backends import read_manifest

#: How the content of a leaf present in both was compared (``LeafDiff.content``).
SAME = "same"
DIFFERENT = "different"
UNKNOWN = "unknown"  # not compared: dtype or shape differ, or the chunks differ and data was not read


@dataclass(frozen=True)
class LeafDiff:
    """A key present in both checkpoints whose entries differ.

    Attributes:
        key: the key, as a tuple of its components.
        kind: ``"tensor"``, ``"value"`` (a non-tensor value), or ``"type"`` (a tensor in one, a value in the other).
        changes: what differs, each as ``(what, in a, in b)``, with ``what`` one of
            ``"dtype"``, ``"shape"``, ``"placement"``, ``"value"``, ``"type"``.
        content: for tensors, ``"same"``, ``"different"`` or ``"unknown"``; None for values.
        compared_by: ``"checksum"`` (no data read), ``"data"`` (bytes compared) or None.
    """

    key: tuple[str, ...]
    kind: str
    changes: tuple[tuple[str, str, str], ...]
    content: str | None
    compared_by: str | None


@dataclass(frozen=True)
class DiffReport:
    """The outcome of ``diff``.

    Attributes:
        a: the first checkpoint.
        b: the second checkpoint.
        only_a: keys (leaves and non-tensor values) present in ``a`` only.
        only_b: keys present in ``b`` only.
        changed: the keys present in both whose entries differ.
        same: how many keys are present in both and equal (tensors of the same dtype,
            shape, placement and content; equal values).
        unknown: keys present in both whose content was not compared (``read_data=False``).
        batch_sizes: nodes whose batch size differs, as ``(key, in a, in b)``.
        metadata: metadata keys whose values differ, as ``(key, in a, in b)`` (JSON text; ``""`` when absent).
        world_size: the world sizes of ``a`` and ``b`` (informational, not a difference).
        layout: their layouts, ``"directory"`` or ``"archive"`` (informational).
    """

    a: str
    b: str
    only_a: tuple[tuple[str, ...], ...]
    only_b: tuple[tuple[str, ...], ...]
    changed: tuple[LeafDiff, ...]
    same: int
    unknown: tuple[tuple[str, ...], ...]
    batch_sizes: tuple[tuple[tuple[str, ...], list[int], list[int]], ...]
    metadata: tuple[tuple[str, str, str], ...]
    world_size: tuple[int, int]
    layout: tuple[str, str]

    @property
    def identical(self) -> bool:
        """True when the two hold the same keys, types, shapes, placements, values, content and metadata."""
        return not (self.only_a or self.only_b or self.changed or self.unknown or self.batch_sizes or self.metadata)


def placement_text(leaf: Leaf) -> str:
    """A leaf's placement in words: ``sharded on dim 0``, ``replicated``, ``DTensor``."""
    p = leaf.placement
    if isinstance(p, Shard):
        return f"sharded on dim {p.dim}"
    if isinstance(p, Replicate):
        return "replicated"
    if isinstance(p, PerRank):
        return "per rank"
    assert isinstance(p, Boxes)
    return "DTensor"


def diff(a: str | os.PathLike, b: str | os.PathLike, *, read_data: bool = True) -> DiffReport:
    """Compare the committed checkpoints ``a`` and ``b``.

    Args:
        a: a checkpoint directory or ``.tdz`` archive.
        b: the checkpoint to compare it with.
        read_data: compare bytes where checksums cannot tell (the leaf is split
            into other chunks in ``b``); False marks such leaves ``"unknown"``.

    Raises:
        CheckpointNotFoundError, ManifestError: ``a`` or ``b`` is not a readable checkpoint.
        CorruptCheckpointError: a chunk whose bytes had to be compared is missing or truncated.
    """
    a, b = os.path.abspath(os.fspath(a)), os.path.abspath(os.fspath(b))
    ma, mb = read_manifest(a), read_manifest(b)
    keys_a, keys_b = _key_kinds(ma), _key_kinds(mb)
    tally = _compare_common(ma, mb, keys_a, keys_b, read_data)
    if tally.pending:
        _compare_data(tally, _DataComparer(a, ma, b, mb))
    order = {k: i for i, k in enumerate(keys_a)}
    tally.changed.sort(key=lambda d: order[d.key])
    return DiffReport(
        a=a,
        b=b,
        only_a=tuple(k for k in keys_a if k not in keys_b),
        only_b=tuple(k for k in keys_b if k not in keys_a),
        changed=tuple(tally.changed),
        same=tally.same,
        unknown=tuple(tally.unknown),
        batch_sizes=_batch_size_changes(ma, mb),
        metadata=_metadata_changes(ma, mb),
        world_size=(ma.world_size, mb.world_size),
        layout=(_layout(a), _layout(b)),
    )


@dataclass(frozen=True)
class _PendingData:
    """A tensor in both whose chunks differ: its bytes are compared once every checksum has been.

    Attributes:
        a: its leaf in the first checkpoint.
        b: its leaf in the second.
        changes: what already differs (its placement), as in ``LeafDiff.changes``.
    """

    a: Leaf
    b: Leaf
    changes: tuple[tuple[str, str, str], ...]


@dataclass
class _Tally:
    """What comparing the keys present in both has found so far (``DiffReport.changed``, ``same``, ``unknown``),
    and the tensors left to compare by their bytes."""

    changed: list[LeafDiff] = field(default_factory=list)
    unknown: list[tuple[str, ...]] = field(default_factory=list)
    same: int = 0
    pending: list[_PendingData] = field(default_factory=list)

    def count_tensor(
        self, key: tuple[str, ...], changes: tuple[tuple[str, str, str], ...], content: str, how: str | None
    ) -> None:
        """Count a tensor whose content was compared (or not, ``"unknown"``): the same, unknown or changed."""
        if content == SAME and not changes:
            self.same += 1
        elif content == UNKNOWN and not changes:
            self.unknown.append(key)
        else:
            self.changed.append(LeafDiff(key, "tensor", changes, content, how))


def _key_kinds(m: Manifest) -> dict[tuple[str, ...], str]:
    """Every key of a checkpoint, tensors then non-tensor values, as ``"tensor"`` or ``"value"``."""
    return {**{k: "tensor" for k in m.leaves}, **{k: "value" for k in m.objects}}


def _compare_common(
    ma: Manifest, mb: Manifest, keys_a: dict[tuple[str, ...], str], keys_b: dict[tuple[str, ...], str], read_data: bool
) -> _Tally:
    """Compare every key present in both, in ``a``'s order, without reading data (see ``_compare_tensor``)."""
    tally = _Tally()
    for key, kind in keys_a.items():
        if key not in keys_b:
            continue
        if kind != keys_b[key]:
            kinds = (("type", _type_text(ma, key), _type_text(mb, key)),)
            tally.changed.append(LeafDiff(key, "type", kinds, None, None))
        elif kind == "value":
            d = _diff_value(ma.objects[key], mb.objects[key], ma.world_size, mb.world_size)
            if d is None:
                tally.same += 1
            else:
                tally.changed.append(d)
        else:
            _compare_tensor(tally, key, ma.leaves[key], mb.leaves[key], read_data)
    return tally


def _compare_tensor(tally: _Tally, key: tuple[str, ...], la: Leaf, lb: Leaf, read_data: bool) -> None:
    """Compare a tensor in both: its dtype, shape and placement, then its content by checksum where both
    checkpoints store it in the same chunks; else it is left to ``_compare_data`` (or unknown, without ``read_data``).

    Content of another dtype or shape is not compared: it differs in any case.
    """
    changes = _header_changes(la, lb)
    if any(c[0] in ("dtype", "shape") for c in changes):
        tally.changed.append(LeafDiff(key, "tensor", changes, UNKNOWN, None))
        return
    boxes_a, boxes_b = _stored_boxes(la), _stored_boxes(lb)
    if _same_boxes(boxes_a, boxes_b):
        equal = bool(np.array_equal(boxes_a[2], boxes_b[2]))
        tally.count_tensor(key, changes, SAME if equal else DIFFERENT, "checksum")
    elif read_data:
        tally.pending.append(_PendingData(a=la, b=lb, changes=changes))
    else:
        tally.count_tensor(key, changes, UNKNOWN, None)


def _header_changes(la: Leaf, lb: Leaf) -> tuple[tuple[str, str, str], ...]:
    """What differs between a tensor's two leaves but their content: dtype, shape, placement."""
    changes: list[tuple[str, str, str]] = []
    if la.dtype_name != lb.dtype_name:
        changes.append(("dtype", la.dtype_name, lb.dtype_name))
    if la.shape != lb.shape:
        changes.append(("shape", str(list(la.shape)), str(list(lb.shape))))
    if placement_text(la) != placement_text(lb):
        changes.append(("placement", placement_text(la), placement_text(lb)))
    return tuple(changes)


def _compare_data(tally: _Tally, compare: _DataComparer) -> None:
    """Compare the bytes of the tensors whose chunks differ (``tally.pending``), and count them."""
    for pending in tally.pending:
        content = SAME if compare.equal(pending.a, pending.b) else DIFFERENT
        tally.count_tensor(pending.a.key, pending.changes, content, "data")


def _batch_size_changes(ma: Manifest, mb: Manifest) -> tuple[tuple[tuple[str, ...], list[int], list[int]], ...]:
    """The nodes in both whose batch size differs, as ``(key, in a, in b)``."""
    return tuple(
        (k, list(ma.nodes[k]), list(mb.nodes[k])) for k in ma.nodes if k in mb.nodes and ma.nodes[k] != mb.nodes[k]
    )


def _metadata_changes(ma: Manifest, mb: Manifest) -> tuple[tuple[str, str, str], ...]:
    """The metadata keys whose values differ, as ``(key, in a, in b)`` in JSON text (``""`` when absent)."""
    meta = []
    for k in list(ma.metadata) + [k for k in mb.metadata if k not in ma.metadata]:
        va = _json(ma.metadata[k]) if k in ma.metadata else ""
        vb = _json(mb.metadata[k]) if k in mb.metadata else ""
        if va != vb:
            meta.append((k, va, vb))
    return tuple(meta)


def _layout(path: str) -> str:
    """``"archive"`` (a file) or ``"directory"``."""
    return "archive" if os.path.isfile(path) else "directory"


def _stored_boxes(leaf: Leaf) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The offsets, sizes (int64[n, ndim]) and checksums (uint64[n]) of a leaf's non-empty chunks,
    ordered by offset, from its table's columns (no ``Chunk`` is built)."""
    t, ndim = leaf.table, len(leaf.shape)
    if isinstance(t, ShardChunks):
        n = len(t)
        offsets = np.zeros((n, ndim), dtype=np.int64)
        offsets[:, t.dim] = t.starts()[:-1]
        sizes = np.tile(np.asarray(t.shape, dtype=np.int64), (n, 1))
        sizes[:, t.dim] = t.lengths
        sums = np.asarray(t.checksums, dtype=np.uint64)
    elif isinstance(t, ReplicaChunks):
        offsets = np.zeros((1, ndim), dtype=np.int64)
        sizes = np.asarray(t.shape, dtype=np.int64).reshape(1, ndim)
        sums = np.array([t.checksum], dtype=np.uint64)
    else:
        offsets = np.asarray(t.offsets, dtype=np.int64).reshape(-1, ndim)
        sizes = np.asarray(t.sizes, dtype=np.int64).reshape(-1, ndim)
        sums = np.asarray(t.checksums, dtype=np.uint64)
    keep = sizes.prod(axis=1) > 0  # chunks of no elements hold nothing to compare
    offsets, sizes, sums = offsets[keep], sizes[keep], sums[keep]
    if ndim and len(sums) > 1:  # non-empty chunks never overlap: their offsets differ
        order = np.lexsort(offsets.T[::-1])
        offsets, sizes, sums = offsets[order], sizes[order], sums[order]
    return offsets, sizes, sums


def _same_boxes(a: tuple[np.ndarray, ...], b: tuple[np.ndarray, ...]) -> bool:
    """True when two leaves of the same shape are stored in the same (non-empty) chunks."""
    return bool(np.array_equal(a[0], b[0]) and np.array_equal(a[1], b[1]))


def _json(v: object) -> str:
    return fmt.dumps(v).decode("utf-8")


def _type_text(m: Manifest, key: tuple[str, ...]) -> str:
    if key in m.leaves:
        return f"tensor {m.leaves[key].dtype_name} {list(m.leaves[key].shape)}"
    return "non-tensor value"


def _global_values(o: ObjectLeaf, world: int) -> tuple[str, list]:
    """A non-tensor entry as one comparable value: (form, encoded values)."""
    if o.placement == "replicate":
        return "one value", o.values
    if o.placement == "per_rank":
        return f"one value per rank ({world})", o.values
    return "a stack of rows", [v for rows in o.values for v in rows]


def _diff_value(oa: ObjectLeaf, ob: ObjectLeaf, wa: int, wb: int) -> LeafDiff | None:
    fa, va = _global_values(oa, wa)
    fb, vb = _global_values(ob, wb)
    changes: list[tuple[str, str, str]] = []
    if fa != fb:
        changes.append(("placement", fa, fb))
    if _json(va) != _json(vb):
        changes.append(("value", _short(va), _short(vb)))
    if not changes:
        return None
    return LeafDiff(oa.key, "value", tuple(changes), None, None)


def _short(values: list, limit: int = 60) -> str:
    shown = [v["json"] if isinstance(v, dict) and "json" in v else "<pickled>" for v in values]
    text = _json(shown[0] if len(shown) == 1 else shown)
    return text if len(text) <= limit else text[: limit - 3] + "..."


#: a leaf whose chunks differ in the two checkpoints is read whole on both sides up to this size, else compared
#: chunk by chunk (the memory of two copies of it)
WHOLE_BYTES = 256 << 20


class _DataComparer:
    """Byte comparison of one leaf in two checkpoints whose chunks differ (imports torch)."""

    def __init__(self, a: str, ma: Manifest, b: str, mb: Manifest):
        from ..loading.read import ChunkSource

        self.a = ChunkSource(a, ma)
        self.b = ChunkSource(b, mb)

    def equal(self, la: Leaf, lb: Leaf) -> bool:
        """Whether the two leaves hold the same bytes: read whole on both sides (planned in columns, each rank's
        file mapped once) up to ``WHOLE_BYTES``; a larger leaf chunk by chunk against the other's pieces."""
        import torch

        from ..core.sharding import full_box, plan_reads
        from ..loading.read import read_box

        if math.prod(la.shape) * fmt.dtype_itemsize(la.dtype_name) <= WHOLE_BYTES:
            box = full_box(la.shape)
            x, y = read_box(self.a, la, box, None, False), read_box(self.b, lb, box, None, False)
            return torch.equal(x.reshape(-1).view(torch.uint8), y.reshape(-1).view(torch.uint8))
        self.a.placed(None)  # every rank's offsets, once: chunks are then located without a table per rank
        self.b.placed(None)
        for i in range(len(la.table)):
            ca = la.table.chunk(i)
            if ca.nbytes == 0:
                continue
            ta = self.a.tensor(la, ca)
            overlapping = [c for c in lb.overlapping(ca.box) if c.nbytes]  # only these are built
            for piece in plan_reads(ca.box, [c.box for c in overlapping]):
                cb = overlapping[piece.chunk_index]
                x = ta[piece.dst].contiguous().reshape(-1).view(torch.uint8)
                y = self.b.tensor(lb, cb)[piece.src].contiguous().reshape(-1).view(torch.uint8)
                if not torch.equal(x, y):
                    return False
        return True
