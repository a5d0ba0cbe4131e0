"""A longer fuzzing campaign over tddist's readers: tests/test_fuzz.py with many random examples.

Usage: python scripts/fuzz.py [--examples N] [--deadline S] [--stats FILE] [-- extra pytest args]

Runs every fuzz test of tests/test_fuzz.py with N random examples each (TDDIST_FUZZ_EXAMPLES), each example
in a forked child under a memory limit and a deadline of S seconds, then prints how the examples ended
(success, or which TddistError) and exits with pytest's status: 0 when no example ended otherwise. A failing
example is shrunk and printed by hypothesis; rerun it with the same command to reproduce it.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--examples", type=int, default=500, help="random examples per fuzz test (default 500)")
    ap.add_argument("--deadline", type=int, default=60, help="seconds one example may take (default 60)")
    ap.add_argument("--stats", help="file to append one JSON line per example to (default: a temporary file)")
    ap.add_argument("pytest_args", nargs="*", help="more pytest arguments, after --")
    args = ap.parse_args()
    stats = args.stats or tempfile.mkstemp(prefix="tddist-fuzz-", suffix=".jsonl")[1]
    env = dict(
        os.environ,
        TDDIST_FUZZ_EXAMPLES=str(args.examples),
        TDDIST_FUZZ_DEADLINE=str(args.deadline),
        TDDIST_FUZZ_STATS=stats,
    )
    cmd = [
        sys.executable,
        "-m",
        "pytest",
        "-q",
        "-p",
        "no:randomly",
        "-k",
        "fuzz_",
        "--timeout",
        "0",
        os.path.join(ROOT, "tests", "test_fuzz.py"),
        *args.pytest_args,
    ]
    start = time.monotonic()
    status = subprocess.call(cmd, cwd=ROOT, env=env)
    outcomes: collections.Counter[tuple[str, str]] = collections.Counter()
    ends: collections.Counter[str] = collections.Counter()
    with open(stats) as f:
        for line in f:
            r = json.loads(line)
            outcomes[(r["test"], r["outcome"])] += 1
            for part in r["detail"].split("; ") if r["outcome"] == "ok" else [r["outcome"]]:
                ends[part.split(": ")[-1] if "Error" in part else part.split(":")[0] + ": ok"] += 1
    print(f"\n{sum(outcomes.values())} examples in {time.monotonic() - start:.0f} s (stats: {stats})")
    for (test, outcome), n in sorted(outcomes.items()):
        print(f"  {test:10s} {outcome:8s} {n}")
    print("how the readers ended:")
    for end, n in ends.most_common():
        print(f"  {n:6d}  {end}")
    return status


if __name__ == "__main__":
    sys.exit(main())
