"""A long crash campaign: random SIGKILLs and power cuts at random commit steps (not run in CI).

Each case is one of ``tests/crash_harness.py``: an old checkpoint committed by
two gloo ranks, then their save of a new one struck at a random fault point
of ``tddist/saving/commit.py`` on a random rank, in a random layout (packed
directory or ``.tdz`` archive), with or without RENAME_EXCHANGE; kills run on
the ordinary disk, power cuts on loop-mounted ext4 and XFS (unmounted and
mounted again after each cut). It prints a table of outcomes per step and
layout (the target's state after ``recover``: old, new, or an error kind;
``*`` marks a state that recover changed; PROBLEM a broken guarantee), then
every problem, and exits 1 on any torn or lost checkpoint, 0 otherwise.

    sudo .venv/bin/python scripts/crash_campaign.py --kills 1000 --cuts 200
    .venv/bin/python scripts/crash_campaign.py --kills 100 --cuts 0   # no root needed
    sudo .venv/bin/python scripts/crash_campaign.py --kills 0 --cuts 0 --incremental 200

``--incremental N`` adds N power cuts of ``tests/crash_incremental.py``: a
run of incremental saves (``save(base=...)`` or an incremental
``CheckpointManager``) while another process's retention cleans the root,
cut at a random point of the pins, the commit or the clean-up's deletion;
after the remount ``tddist gc`` and the checks, counted as torn checkpoints,
dangling references and removed holders (all must be 0).

Power cuts need root, loop devices, mkfs.ext4 and mkfs.xfs.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tests import crash_harness as ch
from tests import crash_incremental as ci


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--kills", type=int, default=1000, help="random SIGKILL cases (default 1000)")
    p.add_argument(
        "--cuts", type=int, default=200, help="random power-cut cases, half on ext4, half on XFS (default 200)"
    )
    p.add_argument(
        "--incremental",
        type=int,
        default=0,
        help="random power cuts of incremental saves with a concurrent clean-up, half on ext4 (default 0)",
    )
    p.add_argument("--seed", type=int, default=None, help="random seed (default: from the clock, printed)")
    p.add_argument("--disk-lanes", type=int, default=2, help="kill cases run at once (default 2)")
    p.add_argument("--workdir", default=None, help="where images and reports go (default: the temporary directory)")
    p.add_argument("--json", default=None, help="write every case's result to this file")
    args = p.parse_args(argv)
    seed = args.seed if args.seed is not None else int(time.time())
    rng = random.Random(seed)
    plan: dict[str, list[ch.Case]] = {"disk": [ch.random_case(rng, "kill", "disk") for _ in range(args.kills)]}
    for i in range(args.cuts):
        fs = ch.FILE_SYSTEMS[i % len(ch.FILE_SYSTEMS)]
        plan.setdefault(fs, []).append(ch.random_case(rng, "powercut", fs))
    for i in range(args.incremental):
        fs = ch.FILE_SYSTEMS[i % len(ch.FILE_SYSTEMS)]
        plan.setdefault(fs, []).append(ci.random_incremental(rng, fs))
    if args.cuts or args.incremental:
        why = ch.mount_problem()
        if why:
            print(f"power cuts cannot run here: {why}", file=sys.stderr)
            return 2
    total = sum(len(v) for v in plan.values())
    print(f"seed {seed}: {args.kills} kills, {args.cuts} power cuts, {args.incremental} incremental cuts", flush=True)
    done = [0]
    t0 = time.monotonic()

    def progress(res: ch.Result) -> None:
        done[0] += 1
        bad = res.problems()
        if bad or done[0] % 50 == 0:
            print(
                f"[{done[0]}/{total} {time.monotonic() - t0:.0f}s] {res.case.id}: {'; '.join(bad) or 'ok'}", flush=True
            )

    with ch.workdir(args.workdir) as work:
        with ch.lanes(work / "lanes", args.disk_lanes, tuple(fs for fs in ch.FILE_SYSTEMS if fs in plan)) as lanes:
            results = ch.run_cases(plan, lanes, work / "cases", progress)
    wall = time.monotonic() - t0
    print()
    print(ch.table(results))
    bad = [r for r in results if r.problems()]
    for r in bad:
        print(f"\nPROBLEM {r.case.id}:\n  " + "\n  ".join(r.problems()) + "\n  " + r.summary().replace("\n", "\n  "))
    incremental = [r for r in results if isinstance(r.case, ci.IncrementalCase)]
    if incremental:
        print("\n" + ci.tally(incremental))
    print(f"\n{len(results)} cases in {wall:.0f}s, {len(bad)} with problems (seed {seed})")
    if args.json:
        Path(args.json).write_text(json.dumps([r.as_dict() for r in results], indent=1, default=str))
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
