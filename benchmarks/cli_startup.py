"""How much CPU the light ``tddist`` commands take to start, and what they import.

    .venv/bin/python benchmarks/cli_startup.py            # best and median of 10 runs per command
    .venv/bin/python benchmarks/cli_startup.py --runs 3

CPU time (user + system of the child) rather than wall time, so a busy machine
changes it less; the best of the runs is the startup cost, the median shows
the spread. Target: every command here under 0.5 s of CPU at best. The last
column says which of the heavy modules one more run (``python -X
importtime``) imported: none of them for ``--version`` and ``--help``, which
import no command's module; numpy and the manifest code, never torch, for
``info`` and ``ls``. (Tests check what makes them light: tests/test_cli.py
asserts that they import no torch, and ``--version`` and ``--help`` no numpy
and no manifest code.)
"""

from __future__ import annotations

import argparse
import resource
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

TARGET_S = 0.5
#: The modules whose import the last column reports (top-level names, or a prefix of tddist's).
HEAVY = ("torch", "numpy", "tensordict", "tddist.manifest")


def cpu_seconds(argv: list[str]) -> float:
    """CPU seconds of one run of ``tddist argv`` (it must succeed)."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    r = subprocess.run([sys.executable, "-m", "tddist.cli", *argv], capture_output=True, text=True, timeout=120)
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if r.returncode != 0:
        raise SystemExit(f"tddist {' '.join(argv)} failed: {r.stderr[-2000:]}")
    return after.ru_utime - before.ru_utime + after.ru_stime - before.ru_stime


def heavy_imports(argv: list[str]) -> list[str]:
    """Which of ``HEAVY`` one run of ``tddist argv`` imports (``python -X importtime`` lists every import)."""
    r = subprocess.run(
        [sys.executable, "-X", "importtime", "-m", "tddist.cli", *argv], capture_output=True, text=True, timeout=120
    )
    names = {line.rsplit("|", 1)[-1].strip() for line in r.stderr.splitlines() if line.startswith("import time:")}
    return [h for h in HEAVY if any(n == h or n.startswith(h + ".") for n in names)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--runs", type=int, default=10)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        ckpt = Path(tmp) / "step-000000005"
        code = f"import torch, tddist; tddist.save({{'w': torch.ones(1000)}}, {str(ckpt)!r})"
        subprocess.run([sys.executable, "-c", code], check=True)
        print(f"{'command':<16} {'best s':>7} {'median s':>9}  {'target':<18} imports")
        for argv in (["--version"], ["--help"], ["info", str(ckpt)], ["ls", tmp]):
            samples = [cpu_seconds(argv) for _ in range(args.runs)]
            best = min(samples)
            status = f"< {TARGET_S} s: " + ("met" if best < TARGET_S else "MISSED")
            heavy = ", ".join(heavy_imports(argv)) or "none of " + ", ".join(HEAVY)
            print(f"{argv[0]:<16} {best:>7.3f} {statistics.median(samples):>9.3f}  {status:<18} {heavy}")


if __name__ == "__main__":
    main()
