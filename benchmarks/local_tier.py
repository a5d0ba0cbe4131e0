"""How long ``CheckpointManager.step()`` blocks with the node-local tier, against a direct save to the root.

    .venv/bin/python benchmarks/local_tier.py                        # 64 MiB, 5 rounds
    .venv/bin/python benchmarks/local_tier.py --mib 8 --rounds 3     # quick
    .venv/bin/python benchmarks/local_tier.py --dir /shared/fs --local /dev/shm

One process (one rank), the same state, in one run: each round saves once
through a manager whose every save goes to ``--dir`` directly (the save
returns once the checkpoint is committed there), and once through a manager
with ``local_dir=--local`` (the save returns once the local copy is committed;
the promotion to ``--dir`` runs in the background and is waited for outside
the timing). The two alternate which goes first. Reported: the median
blocking time of ``step()`` for each, and their ratio. ``--local`` defaults to
``/dev/shm`` (a tmpfs) where it exists; on a machine whose ``--dir`` is a fast
local disk too, the ratio shows only the overhead of the local tier.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch
from tensordict import TensorDict

from benchmarks._common import MIB
from tddist.jobs.manager import CheckpointManager


def state_of(mib: int) -> TensorDict:
    """A batch-sharded state of ``mib`` MiB in 8 leaves."""
    rows = max(1, mib * MIB // (8 * 4 * 1024))
    leaves = {f"w{i}": torch.randn(rows, 1024) for i in range(8)}
    return TensorDict(rows=TensorDict(leaves, batch_size=[rows]), step=torch.tensor(0), batch_size=[])


def timed_step(mgr: CheckpointManager, step: int, state: TensorDict) -> float:
    """Seconds that ``mgr.step`` blocked (the save is due at every step); the promotion is waited for after."""
    os.sync()
    start = time.perf_counter()
    mgr.step(step, state)
    blocked = time.perf_counter() - start
    mgr.wait()
    return blocked


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--mib", type=int, default=64, help="size of the state (MiB)")
    parser.add_argument("--rounds", type=int, default=5, help="saves of each kind")
    parser.add_argument("--dir", default=None, help="where the shared root goes (default: a temporary directory)")
    parser.add_argument("--local", default=None, help="node-local storage (default: /dev/shm where it exists)")
    args = parser.parse_args()
    torch.manual_seed(0)
    state = state_of(args.mib)
    base = Path(tempfile.mkdtemp(prefix="tddist-local-tier-", dir=args.dir))
    local_base = args.local or ("/dev/shm" if os.path.isdir("/dev/shm") else None)
    local = Path(tempfile.mkdtemp(prefix="tddist-local-tier-", dir=local_base))
    try:
        direct = CheckpointManager(base / "direct", every=1, keep_last=1, preempt_signal=None)
        tiered = CheckpointManager(base / "tiered", every=1, keep_last=1, local_dir=local, preempt_signal=None)
        times: dict[str, list[float]] = {"direct": [], "local tier": []}
        for r in range(args.rounds):
            order = [("direct", direct), ("local tier", tiered)]
            for name, mgr in order if r % 2 == 0 else order[::-1]:
                state["step"].fill_(r + 1)
                times[name].append(timed_step(mgr, r + 1, state))
        direct.close()
        tiered.close()
        med = {k: statistics.median(v) for k, v in times.items()}
        print(f"state: {args.mib} MiB, {args.rounds} rounds, shared root under {base}, local tier under {local}")
        for name, seconds in med.items():
            print(f"  {name:>10}: step() blocked {seconds * 1e3:8.1f} ms (median; all: "
                  f"{', '.join(f'{t * 1e3:.1f}' for t in times[name])})")  # fmt: skip
        print(f"ratio (local tier / direct): {med['local tier'] / med['direct']:.2f}")
    finally:
        shutil.rmtree(base, ignore_errors=True)
        shutil.rmtree(local, ignore_errors=True)


if __name__ == "__main__":
    main()
