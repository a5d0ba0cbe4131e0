"""What each rank reads: boxes for a ``shard=`` request, node rows, non-tensor values,
and the compatibility report of a ``load(into=...)`` target. Pure; no I/O.

A request is one of the ``types.ShardRequest`` variants that ``shard_request``
makes of the public ``shard=`` values:

- ``"even"`` (``EvenRows``): rows ``[start_r, end_r)`` as ``torch.tensor_split`` splits them;
- ``"saved"`` (``SavedRows``): exactly the rows this rank saved (same world size only);
- ``(start, stop)`` (``RowRange``): an explicit row range, the same for every sharded leaf;
- ``[n_0, n_1, ...]`` (``RowCounts``): per-rank row counts (one per rank, summing to the global rows);
- ``None`` (``AllRows``): everything.

Rows are along each leaf's shard dim; replicated and DTensor leaves come back whole.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from .. import format as fmt
from ..core.sharding import Box, PerRank, Shard, even_split, full_box, ranges_from_counts, shard_box
from ..core.types import AllRows, EvenRows, Key, RowCounts, RowRange, SavedRows, ShardRequest
from ..errors import InvalidArgumentError
from ..manifest.model import Leaf, Manifest, ObjectLeaf

if TYPE_CHECKING:
    import torch


def shard_request(shard: Any, size: int) -> ShardRequest:
    """The typed request for a public ``shard=`` value; refuses a malformed one before any reading."""
    if isinstance(shard, str) and shard == "even":
        return EvenRows()
    if isinstance(shard, str) and shard == "saved":
        return SavedRows()
    if shard is None:
        return AllRows()
    if isinstance(shard, tuple) and len(shard) == 2 and all(type(v) is int for v in shard):
        if not 0 <= shard[0] <= shard[1]:
            raise InvalidArgumentError(
                f"shard={shard!r} is not a valid row range (start, stop) with 0 <= start <= stop"
            )
        return RowRange(shard[0], shard[1])
    if isinstance(shard, list) and all(type(v) is int and v >= 0 for v in shard):
        if len(shard) != size:
            raise InvalidArgumentError(f"shard= lists {len(shard)} row counts for {size} ranks; give one per rank")
        return RowCounts(tuple(shard))
    raise InvalidArgumentError(
        f"shard={shard!r} is not supported; use 'even', 'saved', None, a (start, stop) row range or a list of "
        f"per-rank row counts"
    )


def row_range(n: int, shard: EvenRows | RowRange | RowCounts, rank: int, size: int, what: str) -> tuple[int, int]:
    """This rank's rows of ``n`` global rows for an even, range or counts request."""
    if isinstance(shard, EvenRows):
        return even_split(n, size)[rank]
    if isinstance(shard, RowRange):
        if shard.stop > n:
            raise InvalidArgumentError(
                f"rank {rank}: shard={(shard.start, shard.stop)!r} ends past the {n} rows of {what}"
            )
        return shard.start, shard.stop
    if sum(shard.counts) != n:
        raise InvalidArgumentError(f"shard= row counts sum to {sum(shard.counts)}, but {what} has {n} rows")
    return ranges_from_counts(shard.counts)[rank]


def leaf_box(leaf: Leaf, shard: ShardRequest, rank: int, size: int) -> Box:
    """The box of ``leaf`` this rank gets."""
    if isinstance(shard, AllRows) or not isinstance(leaf.placement, Shard):
        return full_box(leaf.shape)
    d = leaf.placement.dim
    if isinstance(shard, SavedRows):
        chunk = leaf.chunk_of_rank(rank)  # one chunk, not every rank's
        if chunk is None:
            raise InvalidArgumentError(f"rank {rank}: the checkpoint holds no chunk of leaf {list(leaf.key)} for it")
        return chunk.box
    start, stop = row_range(leaf.shape[d], shard, rank, size, f"leaf {list(leaf.key)}")
    return shard_box(leaf.shape, d, start, stop)


def node_rows(manifest: Manifest, node_key: Key, global_rows: int, shard: ShardRequest, rank: int, size: int) -> int:
    """How many rows of a node's dim-0 batch this rank gets."""
    if isinstance(shard, AllRows):
        return global_rows
    if isinstance(shard, SavedRows):
        rows = manifest.rows_of(node_key)
        if rows is not None:
            return rows[rank]
        raise InvalidArgumentError(
            f"rank {rank}: the checkpoint does not record how many rows of node {list(node_key)} each rank saved; "
            f"load it with shard='even', a row range or per-rank row counts"
        )
    start, stop = row_range(global_rows, shard, rank, size, f"node {list(node_key)}")
    return stop - start


def object_value(obj: ObjectLeaf, shard: ShardRequest, rank: int, size: int, allow_pickle: bool) -> tuple[str, Any]:
    """A non-tensor leaf as (kind, value) for this rank (see docs/parameters.md)."""
    where = f"non-tensor leaf {list(obj.key)}"
    values = obj.values
    saved = isinstance(shard, SavedRows)
    if obj.placement == "replicate":
        return "data", fmt.decode_object(values[0], allow_pickle, where)
    if obj.placement == "per_rank":
        if saved or (isinstance(shard, EvenRows) and len(values) == size):
            return "data", fmt.decode_object(values[rank], allow_pickle, where)
        return "data", [fmt.decode_object(v, allow_pickle, where) for v in values]
    rows = [v for per_rank in (values[rank : rank + 1] if saved else values) for v in per_rank]
    if not isinstance(shard, (SavedRows, AllRows)):
        start, stop = row_range(len(rows), shard, rank, size, where)
        rows = rows[start:stop]
    return "stack", [fmt.decode_object(v, allow_pickle, where) for v in rows]


@dataclass
class LoadReport:
    """What ``load(into=...)`` found: keys missing from the checkpoint, keys the target
    lacks, and leaves whose shape or dtype differ (key -> why). ``ok`` when all three are empty.

    ``load(into=...)`` returns it. Unless it is ``ok``, ``strict=True`` (the
    default) raises ``IncompatibleCheckpointError`` with ``describe()``
    instead, before anything is touched; ``strict=False`` loads what matches.
    Keys are tuples of strings. Keys outside ``keys=`` or under ``exclude=``
    are not compared, and are neither missing nor unexpected.

    Attributes:
        missing: keys of the target that the checkpoint does not hold.
        unexpected: keys of the checkpoint that the target does not hold.
        mismatched: keys in both whose dtype, shape or kind differ, each with the reason.
        loaded: keys that were filled in the target.
        skipped: keys in both that were left untouched on purpose, each with the reason
            (``exclude=``, or per-rank state dropped with ``per_rank="drop"``).
    """

    missing: list[Key] = field(default_factory=list)
    unexpected: list[Key] = field(default_factory=list)
    mismatched: dict[Key, str] = field(default_factory=dict)
    loaded: list[Key] = field(default_factory=list)
    skipped: dict[Key, str] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        """True if nothing is missing, unexpected or mismatched."""
        return not (self.missing or self.unexpected or self.mismatched)

    def describe(self) -> str:
        """The differences in words (the first 20 of each kind), for an error message or a log.

        Returns:
            The missing, unexpected and mismatched keys, separated by "; "
            (empty if ``ok``).
        """
        parts = []
        if self.missing:
            parts.append(f"missing from the checkpoint: {_keys(self.missing)}")
        if self.unexpected:
            parts.append(f"in the checkpoint but not in the target: {_keys(self.unexpected)}")
        for m in list(self.mismatched.values())[:20]:
            parts.append(m)
        if len(self.mismatched) > 20:
            parts.append(f"... and {len(self.mismatched) - 20} more mismatches")
        return "; ".join(parts)


def _keys(keys: list[Key]) -> str:
    shown = [k[0] if len(k) == 1 else "/".join(k) for k in keys[:20]]
    return f"{shown}{' ...' if len(keys) > 20 else ''}"


def in_scope(key: Key, keys: tuple[Key, ...] | None, exclude: tuple[Key, ...]) -> bool:
    """Whether ``key`` is under one of ``keys`` (None: every key) and under none of ``exclude``."""
    if any(key[: len(e)] == e for e in exclude):
        return False
    return keys is None or any(key[: len(w)] == w for w in keys)


def check_exclude(exclude: tuple[Key, ...], known: Iterable[Key], where: str) -> None:
    """Every ``exclude=`` key must name something (a leaf, a node, a value), so a typo does not load everything."""
    known = list(known)
    for e in exclude:
        if not any(k[: len(e)] == e for k in known):
            shown = sorted("/".join(k) for k in known if k)[:8]
            raise InvalidArgumentError(f"exclude names key {list(e)}, which is not in {where}; it holds {shown}")


def compare(
    manifest: Manifest,
    tensors: Mapping[Key, torch.Tensor],
    objects: Mapping[Key, Any],
    global_shape: Callable[[torch.Tensor], Iterable[int]],
    scope: Callable[[Key], bool] = lambda _key: True,
) -> LoadReport:
    """Check a target's leaves against the manifest (``global_shape(t)`` gives a target tensor's global shape).

    Only keys for which ``scope(key)`` holds are compared (``keys=`` and ``exclude=``).
    """
    report = LoadReport()
    tensors = {k: t for k, t in tensors.items() if scope(k)}
    objects = {k: v for k, v in objects.items() if scope(k)}
    stored = set(manifest.leaves) | set(manifest.objects)
    wanted = set(tensors) | set(objects)
    report.missing = [k for k in list(tensors) + list(objects) if k not in stored]
    report.unexpected = [k for k in list(manifest.leaves) + list(manifest.objects) if k not in wanted and scope(k)]
    for key, t in tensors.items():
        leaf = manifest.leaves.get(key)
        if leaf is None:
            if key in manifest.objects:
                report.mismatched[key] = (
                    f"{list(key)} is a tensor in the target but a non-tensor value in the checkpoint"
                )
            continue
        if t.dtype != leaf.dtype:
            report.mismatched[key] = f"{list(key)} has dtype {t.dtype} in the target, {leaf.dtype} in the checkpoint"
        elif isinstance(leaf.placement, PerRank):
            if tuple(global_shape(t)) not in (tuple(leaf.shape[1:]), tuple(leaf.shape)):
                report.mismatched[key] = (
                    f"{list(key)} has shape {list(global_shape(t))} in the target; each rank's value of this "
                    f"per-rank leaf has shape {list(leaf.shape[1:])} in the checkpoint"
                )
        elif tuple(global_shape(t)) != tuple(leaf.shape) and not _fits_part(t, leaf):
            report.mismatched[key] = (
                f"{list(key)} has shape {list(global_shape(t))} in the target, {list(leaf.shape)} in the checkpoint"
            )
    for key in objects:
        if key in manifest.leaves:
            report.mismatched[key] = f"{list(key)} is a non-tensor value in the target but a tensor in the checkpoint"
    return report


def _fits_part(t: torch.Tensor, leaf: Leaf) -> bool:
    """A plain target tensor may hold a row range of a sharded leaf (same other dims)."""
    if not isinstance(leaf.placement, Shard) or t.dim() != len(leaf.shape):
        return False
    d = leaf.placement.dim
    return all(a == b for i, (a, b) in enumerate(zip(t.shape, leaf.shape)) if i != d) and t.shape[d] <= leaf.shape[d]
