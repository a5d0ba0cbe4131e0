"""Pure geometry: boxes, even splits, tiling checks and read plans.

A box is ``(offsets, sizes)``, two tuples of ints of the same length. Nothing
here touches files or communicators, so all of it is tested in one process.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

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


def tiling_problems(shape: Sequence[int], boxes: Sequence[Box], limit: int = 5) -> list[str]:
    """Why ``boxes`` do not tile ``shape`` exactly (empty list if they do).

    Checks: rank and bounds of each box, no two non-empty boxes overlap, and the
    volumes add up to the whole (which, with no overlap, means no gap). The
    overlap check sweeps along the dimension with the most distinct starts, so
    the usual layouts (split along one or two dims) cost O(n log n).
    """
    shape = tuple(shape)
    if len(boxes) == 1 and tuple(boxes[0][1]) == shape and not any(boxes[0][0]) and len(boxes[0][0]) == len(shape):
        return []  # one chunk holding the whole tensor: the common case, checked in O(1)
    problems: list[str] = []
    nonempty: list[tuple[int, Box]] = []
    for i, (offs, sizes) in enumerate(boxes):
        if len(offs) != len(shape) or len(sizes) != len(shape):
            problems.append(f"chunk {i} has {len(offs)} dims, tensor has {len(shape)}")
        elif any(o < 0 or s < 0 or o + s > n for o, s, n in zip(offs, sizes, shape)):
            problems.append(f"chunk {i} at {list(offs)} size {list(sizes)} lies outside shape {list(shape)}")
        elif math.prod(sizes):
            nonempty.append((i, (tuple(offs), tuple(sizes))))
        if len(problems) >= limit:
            return problems
    if problems:
        return problems
    total = math.prod(shape)
    if not shape:
        return [] if len(boxes) == 1 else [f"a scalar needs exactly one chunk, got {len(boxes)}"]
    if not nonempty:
        return [] if total == 0 else [f"chunks cover 0 of {total} elements: there is a gap"]
    dim = max(range(len(shape)), key=lambda d: len({b[0][d] for _, b in nonempty}))
    nonempty.sort(key=lambda ib: ib[1][0][dim])
    active: list[tuple[int, Box]] = []
    for i, box in nonempty:
        start = box[0][dim]
        active = [(j, b) for j, b in active if b[0][dim] + b[1][dim] > start]
        for j, other in active:
            if intersect(box, other) is not None:
                problems.append(f"chunks {min(i, j)} and {max(i, j)} overlap")
                if len(problems) >= limit:
                    return problems
        active.append((i, box))
    covered = sum(volume(b) for _, b in nonempty)
    if not problems and covered != total:
        problems.append(f"chunks cover {covered} of {total} elements: there is a gap")
    return problems


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
