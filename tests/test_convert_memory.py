"""A conversion's memory is bounded: converting a checkpoint of 8 ranks (384 MiB, 24 leaves sharded over every
rank) into each destination grows the peak resident size (VmHWM) by at most the largest output tensor + 256 MiB.

Each conversion runs in a fresh process, its peak reset (``/proc/self/clear_refs``) just before ``convert``.
Without the page release (each read leaf's chunks, each leaf written by ``torch.save`` or ``dcp.save``) and the
heap trim, the mapped pages and freed leaves a conversion touched stay resident: the whole checkpoint, or twice it.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from tensordict import TensorDict

import tddist
from tests.launch_util import REPO

RANKS, LEAVES, ROWS, COLS = 8, 24, 128, 4096  # each leaf [1024, 4096] float32: 16 MiB, 2 MiB per rank
LEAF_BYTES = RANKS * ROWS * COLS * 4
BOUND = LEAF_BYTES + (256 << 20)

_PEAK = r"""
import sys
import tddist, tddist.interop.convert, tddist.interop.dcp, tddist.interop.hf, tddist.interop.native
import tddist.interop.torch_file


def status(field):
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith(field))


src, dst, to = sys.argv[1:4]
with open("/proc/self/clear_refs", "w") as f:
    f.write("5")  # the peak (VmHWM) starts again from the current RSS
before = status("VmRSS:")
tddist.convert(src, dst, to, max_shard_size="64MiB")
print(status("VmHWM:") - before)
"""


def _shard(rank: int) -> TensorDict:
    rows = {f"l{i:02d}": torch.full((ROWS, COLS), float(rank * 100 + i)) for i in range(LEAVES)}
    return TensorDict(rows, batch_size=[ROWS])


@pytest.fixture(scope="module")
def many_ranks(tmp_path_factory) -> Path:
    """384 MiB saved by 8 thread ranks: every leaf is 8 chunks, in the ranks' packed data files."""
    path = tmp_path_factory.mktemp("memory") / "ck"
    results = tddist.run_threads(RANKS, lambda c: tddist.save(_shard(c.rank), path, comm=c), timeout=300)
    assert not [r for r in results if isinstance(r, BaseException)], results
    return path


def _peak(src: Path, dst: Path, to: str) -> int:
    out = subprocess.run(
        [sys.executable, "-c", _PEAK, str(src), str(dst), to], capture_output=True, text=True, cwd=REPO, timeout=300,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    return int(out.stdout.split()[-1])


def _expected(name: str) -> torch.Tensor:
    i = int(name.rsplit("l", 1)[1])
    return torch.cat([torch.full((ROWS, COLS), float(r * 100 + i)) for r in range(RANKS)])


@pytest.mark.parametrize(
    "name,to",
    [("one.safetensors", "safetensors"), ("hf", "safetensors"), ("all.pt", "torch"), ("dcp", "dcp")],
    ids=["safetensors", "hf-sharded", "torch", "dcp"],
)
def test_peak_memory_is_bounded_by_the_largest_leaf(many_ranks, tmp_path, name, to):
    dst = tmp_path / name
    peak = _peak(many_ranks, dst, to)
    print(f"{to} {name}: +{peak / 2**20:.0f} MiB (bound {BOUND / 2**20:.0f} MiB)")
    assert 0 < peak <= BOUND, (name, peak)
    if name == "one.safetensors":
        with safe_open(dst, "pt") as f:
            assert torch.equal(f.get_tensor("l05"), _expected("l05"))
    elif name == "hf":
        shards = sorted(dst.glob("model-*.safetensors"))
        assert len(shards) == 6  # 64 MiB files of 4 leaves each
        with safe_open(shards[-1], "pt") as f:
            assert torch.equal(f.get_tensor("l23"), _expected("l23"))
    elif name == "all.pt":
        loaded = torch.load(dst, weights_only=True, mmap=True)
        assert torch.equal(loaded["l07"], _expected("l07"))
    else:
        import torch.distributed.checkpoint as dcp

        back = {"l11": torch.empty(RANKS * ROWS, COLS)}
        dcp.load(back, checkpoint_id=str(dst), no_dist=True)
        assert torch.equal(back["l11"], _expected("l11"))
