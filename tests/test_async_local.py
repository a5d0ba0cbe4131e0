"""Asynchronous saves in one process (no torch.distributed, no MPI): nothing grows from save to save."""

from __future__ import annotations

import os
import subprocess
import sys

CODE = r"""
import os, sys, threading
import torch
from tensordict import TensorDict
import tddist
from tddist import background
from tddist.comm import resolve

def rss_mib():
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024

root = sys.argv[1]
td = TensorDict({f"w{i}": torch.randn(1024, 1024) for i in range(16)}, [])  # 64 MiB
samples = []
for step in range(20):
    td["w0"].add_(1)  # the training loop goes on changing the state
    fut = tddist.save(td, os.path.join(root, "ckpt"), return_early=True, num_threads=2)
    fut.result()
    ch = background.channel(resolve())
    samples.append((ch.buffers.allocations, threading.active_count(), rss_mib(), len(background._channels)))
print(repr(samples))
assert torch.equal(tddist.load(os.path.join(root, "ckpt"), shard=None, verify=True)["w0"], td["w0"])
"""


def test_twenty_return_early_saves_keep_memory_threads_and_buffers_flat(tmp_path):
    """One channel for the process: snapshot buffers are allocated by the first save only, and the
    thread count and RSS stay flat after it (each save replaces the previous checkpoint)."""
    env = dict(os.environ, OMP_NUM_THREADS="1")
    out = subprocess.run(
        [sys.executable, "-c", CODE, str(tmp_path)], capture_output=True, text=True, timeout=300, env=env
    )
    assert out.returncode == 0, out.stderr[-3000:]
    samples = eval(out.stdout.strip().splitlines()[-1])
    allocations = [s[0] for s in samples]
    threads = [s[1] for s in samples]
    rss = [s[2] for s in samples]
    channels = [s[3] for s in samples]
    assert allocations == [16] * 20, allocations  # one buffer per leaf, reused by every later save
    assert channels == [1] * 20, channels
    assert max(threads[1:]) <= threads[1], threads
    assert max(rss[2:]) - rss[1] < 96, rss  # flat within less than two snapshots' worth of noise
