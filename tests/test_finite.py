"""Certified checkpoints: every floating-point chunk's NaN and Inf values are counted while it is hashed.

The counting (``core.finite``) against torch's own ``isnan``/``isinf`` on every
floating dtype, with values injected at the edges of the pieces the writers
count and on clean data; every writer path records the counts; ``save(...,
require_finite=True)`` refuses to publish on every rank; ``info``/``verify``
report them; ``CheckpointManager(restore="finite")`` and ``tddist latest
--finite`` skip checkpoints that hold any.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest
import torch
from tensordict import TensorDict

import tddist
from tddist.checksum import tensor_bytes
from tddist.core.finite import PIECE, ChunkStats, buffer_stats, is_floating
from tddist.manifest.model import LargestMagnitude

FLOATING = [
    torch.float64,
    torch.float32,
    torch.float16,
    torch.bfloat16,
    torch.complex64,
    torch.complex128,
    torch.float8_e4m3fn,
    torch.float8_e5m2,
]


def _name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _truth(t: torch.Tensor) -> ChunkStats:
    """The counts by torch: NaN, Inf (complex: each component) and the largest finite magnitude."""
    v = torch.view_as_real(t) if t.is_complex() else t
    v = v.to(torch.float64)
    finite = v[torch.isfinite(v)]
    top = float(finite.abs().max()) if finite.numel() else 0.0
    return ChunkStats(int(torch.isnan(v).sum()), int(torch.isinf(v).sum()), top)


def _random(dtype: torch.dtype, n: int, gen: torch.Generator, scale: float = 1.0) -> torch.Tensor:
    """Random values of ``dtype`` (made in float64, then cast: float8 has no arithmetic)."""
    scale *= 100.0 if dtype not in (torch.float8_e4m3fn, torch.float8_e5m2) else 4.0
    real = torch.randn(n, generator=gen, dtype=torch.float64) * scale
    if dtype.is_complex:
        return torch.complex(real, torch.randn(n, generator=gen, dtype=torch.float64) * scale).to(dtype)
    return real.to(dtype)


def _inject(t: torch.Tensor, gen: torch.Generator, count: int) -> torch.Tensor:
    """``t`` with NaN and +-Inf (NaN only where the format has no infinity) at ``count`` random places, the first
    and last elements and both sides of a counting piece's edge among them."""
    t = t.clone()
    flat = torch.view_as_real(t).reshape(-1) if t.is_complex() else t.reshape(-1)
    per_piece = PIECE // flat.element_size()
    edges = [0, flat.numel() - 1] + [i for i in (per_piece - 1, per_piece) if i < flat.numel()]
    places = edges + torch.randint(0, flat.numel(), (count,), generator=gen).tolist()
    has_inf = t.dtype != torch.float8_e4m3fn
    for j, i in enumerate(places):
        value = (float("nan"), float("inf"), float("-inf"))[j % 3] if has_inf else float("nan")
        flat[i] = value
    return t


@pytest.mark.parametrize("dtype", FLOATING, ids=_name)
def test_every_injected_value_is_counted(dtype):
    """100% of injected NaN and Inf values are found, in sizes that span several counting pieces, and the
    largest finite magnitude is exact."""
    gen = torch.Generator().manual_seed(7)
    for n in (1, 3, 1000, 3 * PIECE // max(1, _random(dtype, 1, gen).element_size()) + 5):
        for count in (0, 1, 17):
            t = _inject(_random(dtype, n, gen), gen, count) if count else _random(dtype, n, gen)
            assert buffer_stats(_name(dtype), tensor_bytes(t)) == _truth(t), (n, count)


@pytest.mark.parametrize("dtype", FLOATING, ids=_name)
def test_extremes_are_finite_and_counted_exactly(dtype):
    """The largest finite value, the smallest subnormal, -0.0 and all-negative data are finite; a chunk of
    NaN only has no finite magnitude."""
    real = {torch.complex64: torch.float32, torch.complex128: torch.float64}.get(dtype, dtype)
    info = torch.finfo(real)
    t = torch.tensor([info.max, -info.max, info.smallest_normal, -0.0, 0.0], dtype=torch.float64).to(dtype)
    assert buffer_stats(_name(dtype), tensor_bytes(t)) == _truth(t) == ChunkStats(0, 0, info.max)
    negative = (-torch.rand(100, dtype=torch.float64) - 1).to(dtype)
    assert buffer_stats(_name(dtype), tensor_bytes(negative)) == _truth(negative)
    nan = torch.full((9,), float("nan"), dtype=torch.float64).to(dtype)  # complex: NaN + 0j
    assert buffer_stats(_name(dtype), tensor_bytes(nan)) == _truth(nan) == ChunkStats(9, 0, 0.0)


def test_no_false_finding_on_1000_clean_buffers():
    """1,000 clean buffers of every floating dtype (random sizes and scales, subnormals included): no NaN or
    Inf is ever reported, and the largest magnitude is torch's."""
    gen = torch.Generator().manual_seed(1000)
    rng = np.random.default_rng(1000)
    for i in range(1000):
        dtype = FLOATING[i % len(FLOATING)]
        t = _random(dtype, int(rng.integers(1, 5000)), gen, float(10.0 ** rng.integers(-40, 3)))
        got = buffer_stats(_name(dtype), tensor_bytes(t))
        assert got.finite and got == _truth(t), (i, dtype)


def test_only_floating_dtypes_are_counted():
    assert not any(is_floating(d) for d in ("int64", "int32", "int16", "int8", "uint8", "uint64", "bool"))
    assert all(is_floating(_name(d)) for d in FLOATING)


# --- every writer records the counts -----------------------------------------------------------------------------


def _state(bad: bool) -> TensorDict:
    td = TensorDict(
        {
            "w": torch.linspace(-3, 2, 40).view(10, 4),
            "h": torch.ones(10, 3, dtype=torch.bfloat16),
            "i": torch.arange(10),
            "model": TensorDict({"emb": torch.full((5, 2), -7.5, dtype=torch.float16)}, []),
        },
        [],
    )
    if bad:
        td["w"][3, 1] = float("nan")
        td["h"][9, 2] = float("-inf")
    return td


SAVES = {
    "packed": {},
    "memmap": {"layout": "memmap"},
    "archive": {},
    "return_early": {"return_early": True},
    "budget": {"return_early": True, "snapshot_budget": 1 << 20},
}


@pytest.mark.parametrize("how", sorted(SAVES))
@pytest.mark.parametrize("bad", [False, True], ids=["clean", "injected"])
def test_every_writer_records_the_counts(tmp_path, how, bad):
    target = tmp_path / ("c.tdz" if how == "archive" else "c")
    out = tddist.save(_state(bad), target, **SAVES[how])
    if how in ("return_early", "budget"):
        out.result()
    m = tddist.read_manifest(target)
    assert m.version == 4 and not m.uncounted()
    assert m.leaves[("i",)].stats is None
    expected = _state(bad)
    for key in (("w",), ("h",), ("model", "emb")):
        truth = _truth(expected[key])
        assert m.leaves[key].stats.total() == (truth.nan, truth.inf), key
        assert m.leaves[key].stats.finite == truth.finite, key
    found = [(b.key, b.nan, b.inf) for b in m.non_finite()]
    assert found == ([(("w",), 1, 0), (("h",), 0, 1)] if bad else [])
    assert m.largest_magnitude() == LargestMagnitude(7.5, ("model", "emb"), 0)  # emb's -7.5


def test_each_ranks_chunk_is_counted_on_thread_ranks(tmp_path):
    """Sharded chunks are counted per rank and a replicated leaf once, by its writer; the finding names the
    rank whose chunk holds the value."""

    def rank_main(comm):
        td = TensorDict({"b": TensorDict({"x": torch.full((4, 2), float(comm.rank + 1))}, [4])}, [])
        td["r"] = torch.tensor([0.5, -4.0])  # replicated
        if comm.rank == 2:
            td["b", "x"][1, 1] = float("inf")
        tddist.save(td, tmp_path / "c", comm=comm)
        return "ok"

    assert tddist.run_threads(3, rank_main) == ["ok"] * 3
    m = tddist.read_manifest(tmp_path / "c")
    x = m.leaves[("b", "x")].stats
    assert (x.chunks.tolist(), x.nan.tolist(), x.inf.tolist()) == ([2], [0], [1])  # only the chunk that holds it
    assert m.leaves[("r",)].stats.finite and m.leaves[("r",)].stats.total() == (0, 0)
    assert [(b.key, b.ranks) for b in m.non_finite()] == [(("b", "x"), (2,))]
    # each rank's largest finite magnitude and its leaf: x's value (rank 2: its Inf is not finite), or r's 4.0
    writer, at = m.leaves[("r",)].table.writer, list(m.leaves).index
    expected = [(4.0, at(("r",))) if r == writer else (float(r + 1), at(("b", "x"))) for r in range(3)]
    assert list(zip(m.largest.values.tolist(), m.largest.leaves.tolist())) == expected
    assert m.largest_magnitude() == LargestMagnitude(4.0, ("r",), writer)


# --- save(require_finite=True) ------------------------------------------------------------------------------------


@pytest.mark.parametrize("archive", [False, True], ids=["directory", "archive"])
def test_require_finite_refuses_on_every_rank_and_commits_nothing(tmp_path, archive):
    target = tmp_path / ("c.tdz" if archive else "c")
    tddist.save(TensorDict({"x": torch.zeros(2, 2)}, [2]), target)  # the previous checkpoint
    before = tddist.read_manifest(target).created

    def rank_main(comm):
        td = TensorDict({"x": torch.ones(2, 2) * comm.rank}, [2])
        if comm.rank == 1:
            td["x"][0, 0] = float("nan")
        try:
            tddist.save(td, target, comm=comm, require_finite=True)
        except tddist.NonFiniteError as e:
            return str(e)
        return "saved"

    results = tddist.run_threads(2, rank_main)
    for text in results:
        assert "['x']: 1 NaN and 0 Inf values (ranks [1])" in text and "Nothing was committed" in text, text
    m = tddist.read_manifest(target)
    assert m.world_size == 1 and m.created == before and not m.non_finite()
    assert sorted(os.listdir(tmp_path)) == [target.name]  # no staging area left behind


def test_require_finite_saves_clean_data(tmp_path):
    """Clean saves with require_finite commit as usual (50 in a row: no false refusal)."""
    gen = torch.Generator().manual_seed(3)
    for i in range(50):
        td = TensorDict({"w": torch.randn(64, 8, generator=gen) * 1e30, "b": torch.randn(8, generator=gen)}, [])
        tddist.save(td, tmp_path / "c", require_finite=True, metadata={"i": i})
    assert tddist.read_manifest(tmp_path / "c").metadata == {"i": 49}


# --- info, verify, latest --finite and CheckpointManager(restore="finite") ---------------------------------------


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "tddist.cli", *args], capture_output=True, text=True, timeout=120)


def test_info_and_verify_report_non_finite_leaves_as_findings(tmp_path):
    tddist.save(_state(True), tmp_path / "bad")
    tddist.save(_state(False), tmp_path / "good")
    info = json.loads(_cli("info", "--json", str(tmp_path / "bad")).stdout)
    assert info["finite"] is False
    assert [(b["key"], b["nan"], b["inf"], b["ranks"]) for b in info["non_finite"]] == [
        (["w"], 1, 0, [0]),
        (["h"], 0, 1, [0]),
    ]
    good = json.loads(_cli("info", "--json", str(tmp_path / "good")).stdout)
    assert good["finite"] is True and good["non_finite"] == []
    assert info["largest_magnitude"] == good["largest_magnitude"] == {"value": 7.5, "key": ["model", "emb"], "rank": 0}
    text = _cli("info", str(tmp_path / "bad")).stdout
    assert "2 tensor(s) hold NaN or Inf values" in text and "non-finite: w: 1 NaN, 0 Inf" in text
    assert "largest finite magnitude: 7.5 (model/emb, rank 0)" in text
    verify = _cli("verify", "--json", str(tmp_path / "bad"))
    doc = json.loads(verify.stdout)
    assert verify.returncode == 0 and doc["ok"] and [b["key"] for b in doc["non_finite"]] == [["w"], ["h"]]
    assert json.loads(_cli("verify", "--json", str(tmp_path / "good")).stdout)["non_finite"] == []


def test_manager_restore_finite_and_latest_finite_skip_diverged_checkpoints(tmp_path):
    root = tmp_path / "run"
    with tddist.CheckpointManager(root, keep_last=None) as mgr:
        for step in (10, 20, 30):
            mgr.save(step, _state(step == 30))
    assert _cli("latest", str(root)).stdout.strip().endswith("step-000000030")
    assert _cli("latest", "--finite", str(root)).stdout.strip().endswith("step-000000020")
    target = _state(True)
    with tddist.CheckpointManager(root, keep_last=None, restore="finite") as mgr:
        restored = mgr.restore(target)
    assert int(restored) == 20 and torch.equal(target["w"], _state(False)["w"])
    with tddist.CheckpointManager(root, keep_last=None) as mgr:
        assert int(mgr.restore(_state(False))) == 30
    with pytest.raises(tddist.InvalidArgumentError, match="restore='best'"):
        tddist.CheckpointManager(root, restore="best")
