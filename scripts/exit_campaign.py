"""Run many four-rank jobs that save, load and exit, and count the ranks that do not exit cleanly.

    .venv/bin/python scripts/exit_campaign.py --runs 100            # every mode of tests/exit_rank.py
    .venv/bin/python scripts/exit_campaign.py --runs 20 --modes tddist-init

Prints, per mode, the jobs run and those in which a rank aborted (exit -6,
"terminate called without an active exception") or failed otherwise; exits
non-zero if any did. Not part of CI: tests/test_exit.py runs each mode once.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tests.launch_util import REPO, run_job

MODES = ["user-destroy", "user-keep", "tddist-init", "async"]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", type=int, default=100, help="jobs per mode (default 100)")
    ap.add_argument("--modes", default=",".join(MODES), help="comma-separated modes (default: all)")
    ap.add_argument("--nproc", type=int, default=4)
    args = ap.parse_args()
    table: dict[str, Counter] = {}
    start = time.monotonic()
    for i in range(args.runs):
        for mode in args.modes.split(","):
            with tempfile.TemporaryDirectory() as d:
                job = run_job("spawn", args.nproc, REPO / "tests" / "exit_rank.py", [mode, d], Path(d) / "r")
            c = table.setdefault(mode, Counter())
            c["jobs"] += 1
            if any(rc == -6 for rc in job.returncodes) or "terminate called" in job.output:
                c["aborted"] += 1
            elif any(rc != 0 for rc in job.returncodes):
                c["failed"] += 1
                print(f"{mode} run {i}: exit codes {job.returncodes}\n{job.output[-2000:]}", file=sys.stderr)
    print(f"{'mode':<14} {'jobs':>5} {'aborted':>8} {'failed':>7}   ({time.monotonic() - start:.0f} s)")
    for mode, c in table.items():
        print(f"{mode:<14} {c['jobs']:>5} {c['aborted']:>8} {c['failed']:>7}")
    return 1 if any(c["aborted"] or c["failed"] for c in table.values()) else 0


if __name__ == "__main__":
    sys.exit(main())
