"""Pure geometry: boxes, even splits, tiling checks and read plans.

A box is ``(offsets, sizes)``, two tuples of ints of the same length. Nothing
here touches files or communicators, so all of it is tested in one process.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np

Box = tuple[tuple[int, ...], tuple[int, ...]]


@dataclass(frozen=True)
class Shard:
    """The leaf is split along ``dim``; the global tensor is the ranks' pieces concatenated in rank order.

    A placement for ``save(placements={key: Shard(dim)})``, per leaf or per
    sub-TensorDict; it is the default for leaves under batch dims (``Shard(0)``).
    The ranks' pieces may have different sizes along ``dim``; every other
    dim must be equal on all ranks.

    Args:
        dim: the dimension the ranks' pieces are concatenated along.
    """

    dim: int = 0


@dataclass(frozen=True)
class Replicate:
    """Every rank holds the whole leaf; one copy is written.

    A placement for ``save(placements={key: Replicate()})``; it is the default
    for leaves outside batch dims. Rank 0's copy is written; with
    ``check_replicas=True`` the other ranks' copies are compared with it.
    """


@dataclass(frozen=True)
class PerRank:
    """Each rank keeps its own value of the leaf (RNG states, a sampler's position); every rank's is written.

    A placement for ``save(placements={key: PerRank()})``, per leaf or per
    sub-TensorDict (then its non-tensor values too are kept per rank). The
    ranks' values must have the same shape and dtype. Loaded on the saving
    world size, each rank gets its own value back; on another world size,
    ``load(per_rank=...)`` says what to do (by default it raises, naming the
    keys). The stored leaf is the ranks' values stacked along a new dim 0:
    ``load(shard=None)`` returns that stack.
    """


@dataclass(frozen=True)
class Boxes:
    """Each rank holds an arbitrary box of the leaf (a DTensor's local shard); replicas are written once."""


Placement = Shard | Replicate | Boxes | PerRank


def even_split(n: int, parts: int) -> list[tuple[int, int]]:
    """Split ``range(n)`` into ``parts`` contiguous ranges as ``torch.tensor_split`` does.

    The first ``n % parts`` ranges get one more element.
    """
    if parts <= 0:
        raise ValueError(f"cannot split into {parts} parts")
    q, r = divmod(n, parts)
    out, start = [], 0
    for i in range(parts):
        stop = start + q + (1 if i < r else 0)
        out.append((start, stop))
        start = stop
    return out


def replica_writers(nbytes: Mapping[tuple[str, ...], int], world: int) -> dict[tuple[str, ...], int]:
    """Which rank writes each replicated leaf, from the leaves' sizes: the same answer on every rank.

    The largest leaf first (ties by key), each to the rank that has been given
    the fewest bytes so far (ties: the lowest rank), so that N ranks share the
    writing of a replicated state instead of rank 0 copying and writing all of
    it. A function of the sizes and keys alone: every rank computes it from
    its own structure, which the commit checks is the same on all ranks.
    """
    if world <= 0:
        raise ValueError(f"world size must be positive, got {world}")
    loads = [(0, r) for r in range(world)]  # (bytes given, rank): a heap, ordered as the ties are broken
    out: dict[tuple[str, ...], int] = {}
    for key, n in sorted(nbytes.items(), key=lambda kv: (-kv[1], kv[0])):
        given, rank = heapq.heappop(loads)
        out[key] = rank
        heapq.heappush(loads, (given + n, rank))
    return out


def ranges_from_counts(counts: Sequence[int]) -> list[tuple[int, int]]:
    """Contiguous ranges with the given lengths, in order."""
    out, start = [], 0
    for c in counts:
        out.append((start, start + c))
        start += c
    return out


def volume(box: Box) -> int:
    return math.prod(box[1])


def intersect(a: Box, b: Box) -> Box | None:
    """The intersection of two boxes, or None if it is empty (zero-size boxes never intersect)."""
    offs, sizes = [], []
    for ao, asz, bo, bsz in zip(a[0], a[1], b[0], b[1]):
        lo, hi = max(ao, bo), min(ao + asz, bo + bsz)
        if hi <= lo:
            return None
        offs.append(lo)
        sizes.append(hi - lo)
    return tuple(offs), tuple(sizes)


def contains(outer: Box, inner: Box) -> bool:
    return all(oo <= io and io + isz <= oo + osz for oo, osz, io, isz in zip(outer[0], outer[1], inner[0], inner[1]))


#: Work bounds of ``tiling_problems``: up to ``_SMALL`` non-empty boxes are swept in Python while that
#: compares at most ``_SWEEP_PER_BOX`` pairs per box; else a coordinate grid of at most ``_GRID_MIN``
#: cells (or ``_GRID_PER_BOX`` per box, up to ``_GRID_MAX``) is marked cell by cell; else a numpy sweep
#: compares at most ``_SWEEP_PAIRS`` pairs of boxes. Boxes that need more are refused as too irregular.
_SMALL = 256
_SWEEP_PER_BOX = 16
_GRID_MIN = 1 << 20
_GRID_PER_BOX = 64
_GRID_MAX = 1 << 23
_SWEEP_PAIRS = 1 << 21
_PAIR_BATCH = 1 << 19


def tiling_problems(shape: Sequence[int], boxes: Sequence[Box], limit: int = 5) -> list[str]:
    """Why ``boxes`` do not tile ``shape`` exactly (empty list if they do).

    A box must have the tensor's rank and lie inside it; no two non-empty
    boxes may overlap; their volumes must add up to the whole (with no
    overlap, that means no gap). The boxes may come from an untrusted
    manifest, so the cost is near-linear in their number and bounded (see
    ``box_tiling_problems``); at most ``limit`` problems are listed.
    """
    shape = tuple(shape)
    n, d = len(boxes), len(shape)
    if n == 1 and tuple(boxes[0][1]) == shape and not any(boxes[0][0]) and len(boxes[0][0]) == d:
        return []  # one chunk holding the whole tensor: the common case, checked in O(1)
    if n > _SMALL:
        try:  # integers of any size (JSON) or ragged boxes fail here, and are named by the loop below
            offsets = np.array([b[0] for b in boxes], dtype=np.int64)
            sizes = np.array([b[1] for b in boxes], dtype=np.int64)
        except (OverflowError, ValueError, TypeError):
            pass
        else:
            if offsets.shape == sizes.shape == (n, d):
                return box_tiling_problems(shape, offsets, sizes, limit)
    problems: list[str] = []
    nonempty: list[tuple[int, Box]] = []
    for i, (offs, sizes_) in enumerate(boxes):
        if len(offs) != d or len(sizes_) != d:
            problems.append(f"chunk {i} has {len(offs)} dims, tensor has {d}")
        elif any(o < 0 or s < 0 or o + s > m for o, s, m in zip(offs, sizes_, shape)):
            problems.append(f"chunk {i} at {list(offs)} size {list(sizes_)} lies outside shape {list(shape)}")
        elif math.prod(sizes_):
            nonempty.append((i, (tuple(offs), tuple(sizes_))))
        if len(problems) >= limit:
            return problems
    if problems:
        return problems
    if not d:
        return [] if n == 1 else [f"a scalar needs exactly one chunk, got {n}"]
    if not nonempty:
        return _volume_problems(0, math.prod(shape))
    found = _python_sweep(nonempty, limit) if len(nonempty) <= _SMALL else None
    if found is None:  # many boxes, or irregular ones; the loop named no problem, so they fit in int64
        offsets = np.array([b[0] for b in boxes], dtype=np.int64).reshape(n, d)
        sizes = np.array([b[1] for b in boxes], dtype=np.int64).reshape(n, d)
        return box_tiling_problems(shape, offsets, sizes, limit, small=False)
    overlaps = [f"chunks {min(i, j)} and {max(i, j)} overlap" for i, j in found]
    return overlaps or _volume_problems(sum(volume(b) for _, b in nonempty), math.prod(shape))


def _python_sweep(nonempty: list[tuple[int, Box]], limit: int) -> list[tuple[int, int]] | None:
    """Overlapping pairs of a few boxes, swept along the dimension with the most distinct starts (cheap
    for the usual layouts); None once it compares more than a few pairs per box (the caller uses numpy)."""
    ndim = len(nonempty[0][1][0])
    dim = max(range(ndim), key=lambda k: len({b[0][k] for _, b in nonempty}))
    budget = _SWEEP_PER_BOX * len(nonempty)
    found: list[tuple[int, int]] = []
    active: list[tuple[int, Box]] = []
    for i, box in sorted(nonempty, key=lambda ib: ib[1][0][dim]):
        start = box[0][dim]
        active = [(j, b) for j, b in active if b[0][dim] + b[1][dim] > start]
        budget -= len(active) + 1
        if budget < 0:
            return None
        for j, other in active:
            if intersect(box, other) is not None:
                found.append((i, j))
                if len(found) >= limit:
                    return found
        active.append((i, box))
    return found


def _volume_problems(covered: int, total: int) -> list[str]:
    return [] if covered == total else [f"chunks cover {covered} of {total} elements: there is a gap"]


def box_tiling_problems(
    shape: Sequence[int], offsets: np.ndarray, sizes: np.ndarray, limit: int = 5, small: bool = True
) -> list[str]:
    """``tiling_problems`` of the boxes ``offsets[i], sizes[i]`` (int64[n, ndim]), in numpy.

    Bounds and the volume sum are checked for all boxes at once. Then the box
    edges are compressed per dimension and, when the resulting grid is small
    (DTensor tilings are grids: about one cell per box), each cell is checked
    to be covered at most once; otherwise a sort-and-sweep compares the pairs
    of boxes that overlap along the dimension where they are fewest, counted
    beforehand and bounded. Boxes that would need more work are reported as
    too irregular to check (tddist never writes such).
    """
    shape = tuple(int(s) for s in shape)
    n, d = len(offsets), len(shape)
    if small and n <= _SMALL:  # a few boxes: Python is quicker than numpy
        return tiling_problems(shape, [(tuple(o), tuple(s)) for o, s in zip(offsets.tolist(), sizes.tolist())], limit)
    if d == 0:
        return [f"a scalar needs exactly one chunk, got {n}"]
    lim = np.asarray(shape, dtype=np.int64)
    bad = np.nonzero(((offsets < 0) | (sizes < 0) | (sizes > lim) | (offsets > lim - sizes)).any(axis=1))[0]
    if len(bad):
        return [
            f"chunk {i} at {offsets[i].tolist()} size {sizes[i].tolist()} lies outside shape {list(shape)}"
            for i in bad[:limit].tolist()
        ]
    keep = np.nonzero((sizes > 0).all(axis=1))[0]  # zero-size boxes hold nothing and overlap nothing
    total = math.prod(shape)
    covered = sum(np.prod(sizes[keep], axis=1, dtype=np.int64).tolist())  # each inside the shape: below 2**56
    if not len(keep):
        return _volume_problems(0, total)
    lo, hi = offsets[keep], offsets[keep] + sizes[keep]
    overlaps = _grid_overlaps(shape, lo, hi, keep, limit)
    if overlaps is None:
        overlaps = _sweep_overlaps(lo, hi, keep, limit)
    if overlaps is None:
        if covered > total:
            return [f"chunks cover {covered} elements of a tensor of {total}: some overlap"]
        if covered < total:
            return _volume_problems(covered, total)
        return [
            f"the {len(keep)} chunk boxes are too irregular to check within tddist's work bound (they neither "
            f"form a small grid nor sweep along any dimension in under {_SWEEP_PAIRS} comparisons); tddist "
            f"writes DTensor shards, which form grids, so this manifest was not written by it"
        ]
    return [f"chunks {min(i, j)} and {max(i, j)} overlap" for i, j in overlaps[:limit]] or _volume_problems(
        covered, total
    )


def _grid_overlaps(
    shape: tuple[int, ...], lo: np.ndarray, hi: np.ndarray, ids: np.ndarray, limit: int
) -> list[tuple[int, int]] | None:
    """Overlapping pairs (ids), found by marking the cells of the compressed grid; None if the grid is too big."""
    n, d = lo.shape
    cuts = [np.unique(np.concatenate((lo[:, k], hi[:, k], [0, shape[k]]))) for k in range(d)]
    cells = 1
    budget = min(_GRID_MAX, max(_GRID_MIN, _GRID_PER_BOX * n))
    for c in cuts:
        cells *= len(c) - 1
        if cells > budget:
            return None
    first = np.stack([np.searchsorted(c, lo[:, k]) for k, c in enumerate(cuts)], axis=1)
    last = np.stack([np.searchsorted(c, hi[:, k]) for k, c in enumerate(cuts)], axis=1)
    grid_shape = tuple(len(c) - 1 for c in cuts)
    owner = np.full(grid_shape, -1, dtype=np.int32 if n < (1 << 31) else np.int64)
    single = (last - first == 1).all(axis=1)
    flat = np.ravel_multi_index(tuple(first[single].T), grid_shape) if single.any() else np.zeros(0, np.int64)
    found: list[tuple[int, int]] = []
    single_ids = np.nonzero(single)[0]
    if len(flat):  # boxes of one cell each (every box of a DTensor grid): all at once
        order = np.argsort(flat, kind="stable")
        sf = flat[order]
        dup = np.nonzero(sf[1:] == sf[:-1])[0]
        for k in dup[:limit].tolist():
            found.append((int(ids[single_ids[order[k]]]), int(ids[single_ids[order[k + 1]]])))
        owner.reshape(-1)[flat[order]] = single_ids[order]  # the last of equal cells wins: pairs are already named
    for b in np.nonzero(~single)[0].tolist():  # larger boxes: their cells were counted into the budget
        if len(found) >= limit:
            break
        block = owner[tuple(slice(a, z) for a, z in zip(first[b].tolist(), last[b].tolist()))]
        taken = block[block >= 0]
        if len(taken):
            found.append((int(ids[taken[0]]), int(ids[b])))
        else:
            block[...] = b
    return found


def _sweep_overlaps(lo: np.ndarray, hi: np.ndarray, ids: np.ndarray, limit: int) -> list[tuple[int, int]] | None:
    """Overlapping pairs (ids) by sort-and-sweep along the best dimension; None if that needs too many comparisons.

    Along a dimension, sorted by start, box ``i`` can overlap only the boxes
    after it that start before it ends; their number is counted for every
    dimension first (a binary search per box), and the cheapest is swept.
    """
    n, d = lo.shape
    best: tuple[int, np.ndarray, np.ndarray] | None = None
    for k in range(d):
        order = np.argsort(lo[:, k], kind="stable")
        starts = lo[order, k]
        counts = np.searchsorted(starts, hi[order, k], side="left") - np.arange(1, n + 1)
        work = int(counts.sum(dtype=np.int64))
        if best is None or work < best[0]:
            best = (work, order, counts)
    assert best is not None
    work, order, counts = best
    if work > _SWEEP_PAIRS:
        return None
    found: list[tuple[int, int]] = []
    batch = max(1024, _PAIR_BATCH // d)
    ends = np.cumsum(counts)
    row = 0
    while row < n and len(found) < limit:
        stop = max(int(np.searchsorted(ends, (ends[row - 1] if row else 0) + batch, side="right")), row + 1)
        c = counts[row:stop]
        a = np.repeat(np.arange(row, stop), c)
        b = a + 1 + np.arange(len(a)) - np.repeat(np.cumsum(c) - c, c)
        i, j = order[a], order[b]
        hit = (np.maximum(lo[i], lo[j]) < np.minimum(hi[i], hi[j])).all(axis=1)
        for x, y in zip(i[hit][:limit].tolist(), j[hit][:limit].tolist()):
            found.append((int(ids[x]), int(ids[y])))
        row = stop
    return found[:limit]


@dataclass(frozen=True)
class ReadPiece:
    """Copy ``chunk[src]`` into ``target[dst]``; slices are relative to each box."""

    chunk_index: int
    src: tuple[slice, ...]
    dst: tuple[slice, ...]


def plan_reads(target: Box, chunks: Sequence[Box]) -> list[ReadPiece]:
    """The pieces of stored ``chunks`` that fill the ``target`` box."""
    pieces = []
    for i, chunk in enumerate(chunks):
        inter = intersect(target, chunk)
        if inter is None:
            continue
        offs, sizes = inter
        src = tuple(slice(o - co, o - co + s) for o, s, co in zip(offs, sizes, chunk[0]))
        dst = tuple(slice(o - to, o - to + s) for o, s, to in zip(offs, sizes, target[0]))
        pieces.append(ReadPiece(i, src, dst))
    return pieces


def shard_box(shape: Sequence[int], dim: int, start: int, stop: int) -> Box:
    """The box of rows ``[start, stop)`` along ``dim`` of a tensor of ``shape``."""
    offs = [0] * len(shape)
    sizes = list(shape)
    offs[dim] = start
    sizes[dim] = stop - start
    return tuple(offs), tuple(sizes)


def full_box(shape: Sequence[int]) -> Box:
    return tuple(0 for _ in shape), tuple(shape)


def consistent_batch(batch: Sequence[int], shapes: Sequence[Sequence[int]]) -> list[int]:
    """The longest prefix of ``batch`` that every shape in ``shapes`` starts with."""
    n = len(batch)
    for s in shapes:
        while n and list(s[:n]) != list(batch[:n]):
            n -= 1
    return list(batch[:n])
