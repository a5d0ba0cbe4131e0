"""The score of a mutmut run, per module: killed mutants over all mutants, and every survivor.

Reads the ``mutants/**/*.py.meta`` files mutmut 3 writes (each mutant's test exit code).
A mutant counts as killed when a test failed (exit code 1 or 3), timed out, or crashed
the test process; anything else (it survived, no test covers it, not checked) is a
survivor. ``--diffs`` also prints each survivor's diff (``mutmut show``).

    python scripts/mutation_score.py [--diffs] [--commit SHA] MUTATION_DIR
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

KILLED = {"killed", "timeout", "segfault", "caught by type check"}


def status(code: int | None) -> str:
    from mutmut.stats import status_by_exit_code

    return status_by_exit_code[code]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("workdir", type=Path, help="the directory mutmut ran in (it holds mutants/)")
    p.add_argument("--commit", default=None, help="the commit that was scored, for the header")
    p.add_argument("--diffs", action="store_true", help="print each survivor's diff")
    p.add_argument("--json", action="store_true", help="print one JSON object instead")
    args = p.parse_args()
    os.chdir(args.workdir)  # mutmut reads its configuration (pyproject.toml) from there
    args.workdir = Path(".")
    metas = sorted((args.workdir / "mutants").rglob("*.py.meta"))
    if not metas:
        print(f"no mutmut results under {args.workdir / 'mutants'}", file=sys.stderr)
        return 2
    rows, survivors, unchecked = [], [], 0
    for meta in metas:
        module = str(meta.relative_to(args.workdir / "mutants")).removesuffix(".meta")
        codes = json.loads(meta.read_text())["exit_code_by_key"]
        checked = {k: c for k, c in codes.items() if status(c) != "not checked"}  # a run cut short
        unchecked += len(codes) - len(checked)
        killed = sum(status(c) in KILLED for c in checked.values())
        rows.append((module, killed, len(checked)))
        survivors += [(name, status(c)) for name, c in sorted(checked.items()) if status(c) not in KILLED]
    total_killed, total = sum(r[1] for r in rows), sum(r[2] for r in rows)
    if args.json:
        doc = {
            "commit": args.commit,
            "modules": {m: {"killed": k, "mutants": n} for m, k, n in rows},
            "killed": total_killed,
            "mutants": total,
            "survivors": [{"mutant": n, "status": s} for n, s in survivors],
            "not_checked": unchecked,
        }
        print(json.dumps(doc, indent=1))
        return 0
    if args.commit:
        print(f"commit {args.commit}")
    width = max(len(m) for m, _k, _n in rows)
    for module, killed, n in rows:
        print(f"{module:<{width}}  {killed:5d} / {n:5d} killed  {100 * killed / max(n, 1):5.1f}%")
    print(f"{'total':<{width}}  {total_killed:5d} / {total:5d} killed  {100 * total_killed / max(total, 1):5.1f}%")
    if unchecked:
        print(f"({unchecked} mutant(s) not checked: the run was cut short; the counts above are of the checked ones)")
    print(f"\n{len(survivors)} survivor(s):")
    for name, st in survivors:
        print(f"  {name}  ({st})")
        if args.diffs:
            shown = subprocess.run(
                [sys.executable, "-m", "mutmut", "show", name], cwd=args.workdir, capture_output=True, text=True
            )
            print("    " + (shown.stdout or shown.stderr).strip().replace("\n", "\n    "))
    return 0


if __name__ == "__main__":
    sys.exit(main())
