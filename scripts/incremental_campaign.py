"""Many incremental saves killed at random steps of the commit while another process's retention runs.

    python scripts/incremental_campaign.py [--cases 200] [--seed 0]

Each case is ``tests/incremental_kills.run_case`` at a random fault point
(or none) with the clean-up starting after a random delay; the summary counts
torn checkpoints, dangling references and removed holders (all must be 0)
and how often the save committed with its references, which tells that the
race between the pin and the clean-up was exercised both ways.
"""

from __future__ import annotations

import argparse
import random
import sys
import tempfile
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tests import incremental_kills as ik


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--cases", type=int, default=200)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    rng = random.Random(args.seed)
    problems: Counter[str] = Counter()
    outcomes: Counter[str] = Counter()
    for i in range(args.cases):
        point = rng.choice((None, *ik.POINTS))
        delay = rng.choice((0.0, rng.uniform(0.0, 0.3)))
        with tempfile.TemporaryDirectory(prefix="tddist-incr-") as d:
            out = ik.run_case(Path(d), point, delay)
        kept = "with holder" if ik.name(ik.HOLDER) in out.committed else "without holder"
        outcomes[
            f"exit {out.exit_code}, {'committed' if ik.name(ik.NEW) in out.committed else 'not committed'}, {kept}"
        ] += 1
        for prob in out.problems:
            problems[prob.split(":")[0]] += 1
            print(f"case {i} ({point}, {delay:.3f}s): {prob}", flush=True)
    print(f"{args.cases} cases")
    for what, n in sorted(outcomes.items()):
        print(f"  {n:5d}  {what}")
    for what in ("torn", "dangling or damaged", "a referenced holder was removed"):
        print(f"  {problems.get(what, 0):5d}  {what}")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
