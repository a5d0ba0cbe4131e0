"""Pure geometry of tddist.core.sharding: even splits, tiling checks, read plans."""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tddist.core.sharding import (
    ReadPiece,
    even_split,
    full_box,
    plan_reads,
    ranges_from_counts,
    shard_box,
    tiling_problems,
)

# --- even_split ----------------------------------------------------------------


def test_even_split_matches_tensor_split():
    """even_split must give exactly the row ranges torch.tensor_split gives, since
    load(shard="even") promises torch's convention."""
    for n in list(range(0, 24)) + [97, 1000, 1023]:
        for parts in [1, 2, 3, 4, 5, 6, 7, 8, 16, 33]:
            pieces = torch.tensor_split(torch.arange(n), parts)
            expected = []
            for p in pieces:
                if p.numel():
                    expected.append((int(p[0]), int(p[-1]) + 1))
                else:
                    start = expected[-1][1] if expected else 0
                    expected.append((start, start))
            assert even_split(n, parts) == expected, (n, parts)
            assert [b - a for a, b in expected] == [p.numel() for p in pieces]


@pytest.mark.parametrize("parts", [0, -1])
def test_even_split_rejects_no_parts(parts):
    """Splitting into zero or negative parts is an error, not an empty list."""
    with pytest.raises(ValueError):
        even_split(5, parts)


# --- tiling_problems: exact tilings -----------------------------------------------


def _rows(shape, counts, dim=0):
    return [shard_box(shape, dim, a, b) for a, b in ranges_from_counts(counts)]


@pytest.mark.parametrize(
    "shape, boxes",
    [
        ((10,), _rows((10,), [3, 3, 4])),
        ((10, 4), _rows((10, 4), [0, 5, 0, 5, 0])),  # zero-row ranks anywhere
        ((6, 3), _rows((6, 3), [6])),
        ((4, 9), _rows((4, 9), [2, 0, 7], dim=1)),
        # 2 x 3 grid of a 2-D tensor
        (
            (5, 7),
            [((r0, c0), (r1 - r0, c1 - c0)) for r0, r1 in [(0, 2), (2, 5)] for c0, c1 in [(0, 3), (3, 4), (4, 7)]],
        ),
        ((), [((), ())]),  # scalar: exactly one chunk
        ((0,), []),
        ((0,), [((0,), (0,)), ((0,), (0,))]),
        ((0, 3), _rows((0, 3), [0, 0, 0])),
        ((3, 0), _rows((3, 0), [1, 2])),
        ((3, 0), [((0, 0), (3, 0)), ((0, 0), (3, 0))]),  # zero-size boxes never overlap
        ((2, 3, 4), [((0, 0, 0), (2, 3, 2)), ((0, 0, 2), (2, 1, 2)), ((0, 1, 2), (2, 2, 2))]),
    ],
)
def test_tiling_problems_accepts_exact_tilings(shape, boxes):
    """Exact tilings (with zero-size pieces, grids, scalars, empty tensors) have no problems."""
    assert tiling_problems(shape, boxes) == []


# --- tiling_problems: broken tilings -----------------------------------------------


@pytest.mark.parametrize(
    "shape, boxes, word",
    [
        ((10,), [((0,), (6,)), ((5,), (5,))], "overlap"),
        ((10,), [((0,), (4,)), ((0,), (4,)), ((4,), (6,))], "overlap"),  # duplicate chunk
        ((4, 4), [((0, 0), (4, 4)), ((1, 1), (1, 1))], "overlap"),  # nested inside another
        ((4, 4), [((0, 0), (2, 3)), ((1, 2), (3, 2)), ((2, 0), (2, 2)), ((0, 3), (1, 1))], "overlap"),
        ((10,), [((0,), (4,)), ((5,), (5,))], "gap"),
        ((4, 4), [((0, 0), (4, 2))], "gap"),
        ((4, 4), [((0, 0), (2, 4)), ((2, 0), (2, 3))], "gap"),
        ((5,), [], "gap"),
        ((5,), [((0,), (0,)), ((5,), (0,))], "gap"),
        ((10,), [((0,), (6,)), ((6,), (5,))], "outside"),
        ((10,), [((-1,), (1,)), ((0,), (10,))], "outside"),
        ((10,), [((0,), (10,)), ((11,), (0,))], "outside"),
        ((4, 4), [((0, 0), (4, 5))], "outside"),
        ((10,), [((0,), (12,)), ((12,), (-2,))], "outside"),  # negative size
        ((10,), [((0, 0), (10, 1))], "dims"),
        ((4, 4), [((0,), (4,))], "dims"),
        ((4, 4), [((0, 0), (4,))], "dims"),
        ((), [], "scalar"),
        ((), [((), ()), ((), ())], "scalar"),
    ],
)
def test_tiling_problems_reports_broken_tilings(shape, boxes, word):
    """Overlaps, gaps, out-of-bounds and wrong-rank boxes are each reported by name."""
    problems = tiling_problems(shape, boxes)
    assert problems, f"no problem found in {boxes} for {shape}"
    assert any(word in p for p in problems), problems


def test_tiling_problems_respects_limit():
    """At most ``limit`` problems are listed, so a huge broken manifest gives a short message."""
    boxes = [((i,), (5,)) for i in range(50)]  # massively overlapping and out of bounds
    assert len(tiling_problems((10,), boxes, limit=3)) == 3
    overlapping = [((0,), (10,))] * 20
    assert len(tiling_problems((10,), overlapping, limit=4)) == 4


# --- plan_reads: resharding between world sizes --------------------------------------


def _counts(n_ranks: int, seed: int) -> list[int]:
    """Uneven row counts with zero-row ranks, deterministic for (n_ranks, seed)."""
    return [((r * 7 + seed * 3) % 5) if (r + seed) % 3 else 0 for r in range(n_ranks)]


def _apply_plan(global_t: torch.Tensor, chunks, target):
    """Copy the stored chunks through plan_reads into a buffer for ``target``;
    also count how often each target element is written."""
    stored = [global_t[tuple(slice(o, o + s) for o, s in zip(*c))] for c in chunks]
    out = torch.full(target[1], -1, dtype=global_t.dtype)
    hits = torch.zeros(target[1], dtype=torch.int64)
    for p in plan_reads(target, chunks):
        out[p.dst] = stored[p.chunk_index][p.src]
        hits[p.dst] += 1
    return out, hits


@pytest.mark.parametrize("save_world", range(1, 7))
@pytest.mark.parametrize("load_world", range(1, 7))
@pytest.mark.parametrize("dim", [0, 1])
def test_plan_reads_reshards_every_world_size(save_world, load_world, dim):
    """Loading a checkpoint saved by S ranks (uneven, some with zero rows) on L ranks
    (even split) gives every L-rank exactly its rows, each element read exactly once."""
    for seed in range(3):
        counts = _counts(save_world, seed)
        n = sum(counts)
        shape = (n, 3) if dim == 0 else (2, n)
        g = torch.arange(math.prod(shape)).reshape(shape)
        chunks = _rows(shape, counts, dim)
        assert tiling_problems(shape, chunks) == []
        pieces_total = 0
        for start, stop in even_split(n, load_world):
            target = shard_box(shape, dim, start, stop)
            out, hits = _apply_plan(g, chunks, target)
            assert torch.equal(out, g.narrow(dim, start, stop - start))
            assert bool((hits == 1).all())
            plan = plan_reads(target, chunks)
            # only chunks that really overlap the target are touched
            assert all(counts[p.chunk_index] > 0 and stop > start for p in plan)
            pieces_total += len(plan)
        assert pieces_total >= sum(1 for c in counts if c)


def test_plan_reads_full_box_and_scalar():
    """A full-box read of a replicated scalar is one piece with empty slices."""
    assert plan_reads(full_box(()), [full_box(())]) == [ReadPiece(0, (), ())]
    g = torch.arange(12).reshape(3, 4)
    out, hits = _apply_plan(g, [full_box(g.shape)], full_box(g.shape))
    assert torch.equal(out, g) and bool((hits == 1).all())


def test_plan_reads_empty_target_needs_no_pieces():
    """A zero-row target box (an empty rank) opens no chunk at all."""
    chunks = _rows((6, 2), [2, 4])
    assert plan_reads(shard_box((6, 2), 0, 3, 3), chunks) == []
    assert plan_reads(shard_box((0, 2), 0, 0, 0), _rows((0, 2), [0, 0])) == []


# --- property tests -------------------------------------------------------------------


@st.composite
def grid_tilings(draw):
    """A random shape and a random grid tiling of it (cuts may repeat: zero-size pieces)."""
    ndim = draw(st.integers(1, 3))
    shape = tuple(draw(st.integers(0, 7)) for _ in range(ndim))
    cuts = []
    for n in shape:
        inner = draw(st.lists(st.integers(0, n), max_size=4))
        cuts.append([0, *sorted(inner), n])
    boxes = []
    for ranges in itertools.product(*[list(zip(c[:-1], c[1:])) for c in cuts]):
        boxes.append((tuple(a for a, _ in ranges), tuple(b - a for a, b in ranges)))
    order = draw(st.permutations(range(len(boxes))))
    return shape, [boxes[i] for i in order]


@st.composite
def tiling_and_target(draw):
    shape, boxes = draw(grid_tilings())
    offs, sizes = [], []
    for n in shape:
        a = draw(st.integers(0, n))
        b = draw(st.integers(a, n))
        offs.append(a)
        sizes.append(b - a)
    return shape, boxes, (tuple(offs), tuple(sizes))


@settings(max_examples=150, deadline=None)
@given(tiling_and_target())
def test_random_grid_tilings_are_exact_and_plans_cover_once(case):
    """Any grid tiling passes tiling_problems, and plan_reads covers any target box
    exactly once with the right values."""
    shape, boxes, target = case
    assert tiling_problems(shape, boxes) == []
    g = np.arange(math.prod(shape)).reshape(shape)
    hits = np.zeros(target[1], dtype=np.int64)
    out = np.full(target[1], -1, dtype=g.dtype)
    for p in plan_reads(target, boxes):
        chunk = boxes[p.chunk_index]
        stored = g[tuple(slice(o, o + s) for o, s in zip(*chunk))]
        out[p.dst] = stored[p.src]
        hits[p.dst] += 1
    assert (hits == 1).all()
    assert (out == g[tuple(slice(o, o + s) for o, s in zip(*target))]).all()


@settings(max_examples=100, deadline=None)
@given(grid_tilings(), st.data())
def test_removing_or_duplicating_a_piece_is_reported(case, data):
    """Dropping a non-empty piece leaves a gap; adding a copy of one makes an overlap."""
    shape, boxes = case
    nonempty = [i for i, b in enumerate(boxes) if math.prod(b[1])]
    if not nonempty:
        return
    i = data.draw(st.sampled_from(nonempty))
    gap = tiling_problems(shape, boxes[:i] + boxes[i + 1 :])
    assert gap and any("gap" in p for p in gap)
    dup = tiling_problems(shape, boxes + [boxes[i]])
    assert dup and any("overlap" in p for p in dup)
