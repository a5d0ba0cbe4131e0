"""Tiling checks on hostile box lists: near-linear in the number of boxes, bounded, and exact.

A manifest's DTensor boxes come from the file, so ``tiling_problems`` must answer quickly whatever they are:
grids of 4,000 and 40,000 boxes (valid, overlapping, with gaps) and adversarial layouts that made the old
sweep quadratic (every box starting at a distinct row and reaching the end). Each case runs under a generous
no-hang timeout, never a timing assert. The fast paths (Python sweep, compressed grid, numpy sweep) are each
checked against a brute-force cell count on random boxes, and a crafted version-2 checkpoint of 4,000 boxes
still loads with its data verified.
"""

from __future__ import annotations

import json
import math
import random

import numpy as np
import pytest
import torch
import xxhash
from hypothesis import given, settings
from hypothesis import strategies as st

import tddist
from tddist import ManifestError
from tddist import format as fmt
from tddist.checksum import checksum_bytes
from tddist.core import sharding
from tddist.core.sharding import box_tiling_problems, tiling_problems

# --- crafted layouts ----------------------------------------------------------------------------------------


def grid(rows: int, cols: int, r: int = 3, c: int = 5) -> tuple[tuple[int, int], list]:
    """A rows x cols grid of r x c boxes, shuffled (the manifest may list them in any order)."""
    boxes = [((i * r, j * c), (r, c)) for i in range(rows) for j in range(cols)]
    random.Random(rows * cols).shuffle(boxes)
    return (rows * r, cols * c), boxes


def staircase(n: int) -> tuple[tuple[int, int], list]:
    """Box i starts at row i and reaches the last row, in column i: the old sweep compared every pair."""
    return (n, n), [((i, i), (n - i, 1)) for i in range(n)]


def bricks(n: int) -> tuple[tuple[int, int], list]:
    """An exact tiling whose cuts move from row to row (2n boxes, 2n distinct column edges): not a grid."""
    boxes = []
    for i in range(n):
        boxes += [((i, 0), (1, i + 1)), ((i, i + 1), (1, 2 * n - i - 1))]
    return (n, 2 * n), boxes


def triangles(n: int) -> tuple[tuple[int, int], list]:
    """An exact tiling by horizontal strips above the anti-diagonal and vertical strips below it: along either
    dimension, about n**2 pairs of boxes overlap, and the edges make an n x n grid (2n boxes)."""
    boxes = [((i, 0), (1, n - i)) for i in range(n)] + [((n - j, j), (j, 1)) for j in range(1, n + 1)]
    return (n, n + 1), boxes


SIZES = {4000: (40, 100), 40000: (200, 200)}


@pytest.mark.timeout(120)
@pytest.mark.parametrize("n", sorted(SIZES))
def test_large_grids_valid_overlapping_and_with_gaps(n):
    """A valid grid passes; a duplicated box, a box moved by one, a missing box, a box moved outside are named."""
    shape, boxes = grid(*SIZES[n])
    assert len(boxes) == n
    assert tiling_problems(shape, boxes) == []
    assert box_tiling_problems(shape, np.array([b[0] for b in boxes]), np.array([b[1] for b in boxes])) == []

    dup = tiling_problems(shape, [*boxes, boxes[n // 2]])
    assert dup == [f"chunks {n // 2} and {n} overlap"]
    (r, c), size = boxes[7]
    moved = tiling_problems(shape, [*boxes[:7], ((r, c + 1), size), *boxes[8:]])
    assert moved and all("overlap" in p for p in moved), moved
    gap = tiling_problems(shape, boxes[:-1])
    assert gap == [f"chunks cover {math.prod(shape) - 15} of {math.prod(shape)} elements: there is a gap"]
    outside = tiling_problems(shape, [*boxes[:-1], ((shape[0], 0), (3, 5))])
    assert outside and "outside" in outside[0]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("n", sorted(SIZES))
def test_adversarial_layouts_end_quickly(n):
    """Layouts that defeat a grid and a naive sweep: a gap, an overlap, a valid non-grid tiling, and an exact
    tiling too irregular to check within the work bound, which is refused by name."""
    assert any("gap" in p for p in tiling_problems(*staircase(n)))
    shape, boxes = staircase(n)
    full = [((0, i), (n, 1)) for i in range(n)]  # every column whole, plus the staircase: overlaps
    assert any("overlap" in p for p in tiling_problems(shape, full + boxes))
    assert tiling_problems(*bricks(n // 2)) == []
    irregular = tiling_problems(*triangles(n // 2))
    assert len(irregular) == 1 and "too irregular to check" in irregular[0], irregular
    shape, boxes = triangles(n // 2)
    assert any("gap" in p for p in tiling_problems(shape, boxes[1:]))
    assert any("overlap" in p for p in tiling_problems(shape, [*boxes, boxes[0]]))


@pytest.mark.timeout(120)
def test_many_copies_of_the_whole_box_stop_at_the_limit():
    """40,000 boxes each covering the whole tensor: five overlaps are named, not 800 million pairs compared."""
    problems = tiling_problems((100, 100), [((0, 0), (100, 100))] * 40000)
    assert problems == [f"chunks {i} and {i + 1} overlap" for i in range(5)]


def test_integers_beyond_int64_are_named_not_overflowed():
    """A version-1 manifest's JSON integers have no bound: boxes that do not fit in int64 are outside the shape."""
    boxes = [((i,), (1,)) for i in range(300)] + [((2**70,), (1,))]
    assert "outside" in tiling_problems((301,), boxes)[0]
    ragged = [((i,), (1,)) for i in range(300)] + [((300, 0), (1, 1))]
    assert "dims" in tiling_problems((301,), ragged)[0]


# --- every path against brute force -------------------------------------------------------------------------


def _brute_force(shape: tuple[int, ...], boxes: list) -> str:
    """'ok', 'overlap' or 'gap' by counting every element's covers."""
    counts = np.zeros(shape, dtype=np.int64)
    for offs, sizes in boxes:
        counts[tuple(slice(o, o + s) for o, s in zip(offs, sizes))] += 1
    return "overlap" if (counts > 1).any() else "gap" if (counts == 0).any() else "ok"


@st.composite
def random_boxes(draw):
    """A small shape and boxes inside it: a grid tiling with some boxes dropped, merged, duplicated or moved."""
    ndim = draw(st.integers(1, 3))
    shape = tuple(draw(st.integers(1, 6)) for _ in range(ndim))
    cuts = [sorted({0, n, *draw(st.lists(st.integers(0, n), max_size=3))}) for n in shape]
    boxes = []
    for idx in np.ndindex(*[len(c) - 1 for c in cuts]):
        boxes.append((tuple(c[i] for c, i in zip(cuts, idx)), tuple(c[i + 1] - c[i] for c, i in zip(cuts, idx))))
    for _ in range(draw(st.integers(0, 3))):
        op = draw(st.sampled_from(["drop", "dup", "random", "empty"]))
        if op == "drop" and boxes:
            boxes.pop(draw(st.integers(0, len(boxes) - 1)))
        elif op == "dup" and boxes:
            boxes.append(boxes[draw(st.integers(0, len(boxes) - 1))])
        else:
            offs = tuple(draw(st.integers(0, n)) for n in shape)
            sizes = tuple(0 if op == "empty" else draw(st.integers(0, n - o)) for n, o in zip(shape, offs))
            boxes.append((offs, sizes))
    return shape, boxes


@settings(max_examples=150, deadline=None, derandomize=True)
@given(random_boxes(), st.sampled_from(["python", "grid", "sweep"]))
def test_every_path_agrees_with_brute_force(case, path):
    """The Python sweep, the compressed grid and the numpy sweep each find exactly the broken tilings."""
    shape, boxes = case
    expected = _brute_force(shape, boxes)
    offsets = np.array([b[0] for b in boxes], dtype=np.int64).reshape(len(boxes), len(shape))
    sizes = np.array([b[1] for b in boxes], dtype=np.int64).reshape(len(boxes), len(shape))
    saved = sharding._GRID_MIN, sharding._GRID_PER_BOX
    try:
        if path == "python":
            problems = tiling_problems(shape, boxes)
        else:
            if path == "sweep":
                sharding._GRID_MIN = sharding._GRID_PER_BOX = 0
            problems = box_tiling_problems(shape, offsets, sizes, small=False)
    finally:
        sharding._GRID_MIN, sharding._GRID_PER_BOX = saved
    if expected == "ok":
        assert problems == [], (shape, boxes, problems)
    else:
        assert problems and any(expected in p for p in problems), (shape, boxes, problems, expected)


# --- a crafted checkpoint of many boxes ---------------------------------------------------------------------


def _boxes_checkpoint(path, shape, boxes, data_files: bool):
    """A version-2 packed directory checkpoint of one float32 leaf ``x`` stored as ``boxes``, one rank each;
    with ``data_files`` each rank's data file holds its box of ``arange`` (padded as format.md 2.3 says) and the
    index its checksum; without, no data file exists and the checksums are 0."""
    world = len(boxes)
    whole = torch.arange(math.prod(shape), dtype=torch.float32).reshape(shape)
    sums = [0] * world
    path.mkdir()
    for r, (offs, sizes) in enumerate(boxes if data_files else []):
        piece = whole[tuple(slice(o, o + s) for o, s in zip(offs, sizes))].contiguous()
        raw = piece.numpy().tobytes()
        sums[r] = int(checksum_bytes(raw), 16)
        (path / f"rank-{r:05d}.data").write_bytes(raw + b"\0" * (-len(raw) % fmt.PACK_ALIGN))
    index = b"".join(
        [
            np.asarray(sums, dtype="<u8").tobytes(),
            np.arange(world, dtype="<i8").tobytes(),
            np.asarray([b[0] for b in boxes], dtype="<i8").tobytes(),
            np.asarray([b[1] for b in boxes], dtype="<i8").tobytes(),
        ]
    )
    obj = {
        "format": "tddist",
        "version": 2,
        "tddist_version": tddist.__version__,
        "created": "2026-01-01T00:00:00+00:00",
        "world_size": world,
        "layout": "directory",
        "packing": "packed",
        "robust_key": True,
        "checksum": {"algorithm": fmt.CHECKSUM_ALGORITHM, "block_size": fmt.CHECKSUM_BLOCK},
        "index": {"size": len(index), "checksum": xxhash.xxh3_64_hexdigest(index)},
        "metadata": {},
        "nodes": [{"key": [], "batch_size": []}],
        "leaves": [
            {"key": ["x"], "dtype": "float32", "shape": list(shape), "placement": {"type": "boxes"}, "chunks": world}
        ],
        "objects": [],
    }
    (path / "tddist.json").write_text(json.dumps(obj))
    (path / "tddist.idx").write_bytes(index)
    return whole


@pytest.mark.timeout(300)
def test_crafted_checkpoint_of_4000_boxes_loads_and_40000_validate(tmp_path):
    """4,000 ranks' boxes: the checkpoint loads, every chunk verified; 40,000: the manifest validates."""
    shape, boxes = grid(*SIZES[4000])
    whole = _boxes_checkpoint(tmp_path / "small", shape, boxes, data_files=True)
    assert torch.equal(tddist.load(tmp_path / "small", shard=None, verify=True)["x"], whole)
    shape, boxes = grid(*SIZES[40000])
    _boxes_checkpoint(tmp_path / "large", shape, boxes, data_files=False)
    assert len(tddist.read_manifest(tmp_path / "large").leaves[("x",)].table) == 40000


@pytest.mark.timeout(300)
@pytest.mark.parametrize("layout", ["staircase", "triangles", "overlap"])
def test_crafted_hostile_manifests_are_refused(tmp_path, layout):
    """The boxes that took seconds to validate are a ManifestError naming the leaf, at once."""
    shape, boxes = {
        "staircase": lambda: staircase(4000),
        "triangles": lambda: triangles(20000),
        "overlap": lambda: (grid(200, 200)[0], [*grid(200, 200)[1][:-1], ((0, 0), (3, 5))]),
    }[layout]()
    _boxes_checkpoint(tmp_path / "c", shape, boxes, data_files=False)
    with pytest.raises(ManifestError, match=r"leaf \('x',\) chunks do not tile"):
        tddist.read_manifest(tmp_path / "c")
