#!/usr/bin/env python
"""Write the results of a benchmark run into benchmarks/README.md, and only those of the code in the tree.

    .venv/bin/python benchmarks/publish.py [--results benchmarks/results.json] [--readme benchmarks/README.md]

``run.py`` stamps its JSON with ``source_digest``: a digest of every ``.py``
file of the ``tddist/`` package and of ``benchmarks/`` as the run snapshotted
them. This program recomputes that digest from the tree (``--root``, default
this repository) and refuses, naming the files that differ, when the results
came from other code: a table in the README always describes the code next
to it. It also refuses ``--quick`` runs (a few MB say nothing about the
targets) and runs with a failed job (rows would be missing), unless told
otherwise.

What it writes: the two regions of the README between
``<!-- benchmark-results:NAME begin ... -->`` and
``<!-- benchmark-results:NAME end -->`` (``targets``: the targets judged
from the run; ``table``: where and on what the run measured, every row, and
the manifest model), each headed by the run's source digest. The prose
around them (the profiles of the misses) is written by hand.

Exit status: 0 written, 2 refused, 1 a usage or file error.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
from pathlib import Path

import _common as C
import run as R

HERE = Path(__file__).resolve().parent
REGIONS = ("targets", "table")


class Refused(Exception):
    """The results must not be published (the message says why and what to do)."""


def region_re(name: str) -> re.Pattern:
    return re.compile(
        rf"(<!-- benchmark-results:{name} begin[^>]*-->\n)(.*?)(<!-- benchmark-results:{name} end -->)", re.S
    )


def check_publishable(result: dict, root: Path, *, allow_quick: bool, allow_failed: bool, what: str) -> str:
    """The run's source digest, if ``result`` may be published from the tree at ``root``; else ``Refused``."""
    lib = result.get("tddist") or {}
    digest, then = lib.get("source_digest"), lib.get("source_files")
    if not digest or not isinstance(then, dict):
        raise Refused(
            f"{what} holds no source digest of tddist/ and benchmarks/ (written by an older run.py): "
            "run benchmarks/run.py again on this tree and publish its results"
        )
    now = C.source_files(root / "tddist", root / "benchmarks")
    current = C.source_digest(now)
    if digest != current:
        changed = C.changed_files(then, now)
        shown = ", ".join(changed[:20]) + (f", and {len(changed) - 20} more" if len(changed) > 20 else "")
        raise Refused(
            f"{what} was measured on source digest {digest}, but tddist/ and benchmarks/ under {root} now "
            f"digest to {current}; changed since the run: {shown or 'none listed (the run recorded other paths)'}. "
            "Its numbers describe other code: run benchmarks/run.py again on this tree (the full run), then publish"
        )
    if C.source_digest(then) != digest:
        raise Refused(f"{what}: its file list does not match its own source digest {digest} (edited by hand?)")
    if (result.get("config") or {}).get("quick") and not allow_quick:
        raise Refused(f"{what} is a --quick run (a few MB, one repeat): publish a full run, or pass --allow-quick")
    failed = [f"{j.get('job')} (exit {j.get('rc')})" for j in result.get("jobs", []) if j.get("rc") != 0]
    if failed and not allow_failed:
        raise Refused(f"{what}: jobs failed, so rows are missing: {', '.join(failed)}; pass --allow-failed to publish")
    return digest


def provenance(result: dict) -> str:
    """One line: which code, what payload, on what machine, when, how loaded."""
    lib, m, cfg = result["tddist"], result.get("machine", {}), result.get("config", {})
    load = m.get("load_average_at_start") or [float("nan")]
    jobs = result.get("jobs") or []
    ends = [j["load_average_at_end"][0] for j in jobs if j.get("load_average_at_end")]
    worlds = ", ".join(str(w) for w in cfg.get("worlds", []))
    return (
        f"Source digest **`{lib['source_digest']}`** (every `.py` file of `tddist/` and `benchmarks/`; "
        f"`publish.py` refuses results of any other code), tddist {lib.get('version')}. "
        f"{cfg.get('payload_mib', 0):.0f} MiB payload, worlds {worlds}, {cfg.get('repeats')} repeat(s)"
        + (f" (asynchronous saves: {cfg['async_repeats']})" if cfg.get("async_repeats") else "")
        + "; "
        f"{m.get('cpus')} CPUs, {m.get('memory_gib')} GiB, {m.get('filesystem')} ({m.get('filesystem_device')}), "
        f"kernel {m.get('kernel')}, Python {m.get('python')}, torch {m.get('torch', '?')}; "
        f"started {result.get('started_utc', '?')}, wall time {result.get('seconds', 0):,.0f} s; "
        f"load average (1 min) {load[0]:.2f} at the start"
        + (f", {max(ends):.2f} at its highest after a job" if ends else "")
        + (f"; {m['host_memory']}" if m.get("host_memory") else "")
        + "."
    )


def render(result: dict) -> dict[str, str]:
    """The text of each README region."""
    head = provenance(result)
    targets = ["| target | status | measured |", "|---|---|---|"]
    for t in result.get("targets", []):
        targets.append(f"| {t['target']} | {t['status']} | {t.get('detail') or '-'} |")
    table = [head, "", R.format_table(result.get("summary", []))]
    model = R.format_model(result.get("summary", []))
    if model:
        table += ["", "Manifest model (medians; peak = the process's peak RSS during the stage, fragments included):"]
        table += ["", model]
    notes = result.get("notes") or []
    if notes:
        table += ["", "Notes from the run:", ""] + [f"- {n}" for n in notes]
    return {"targets": head + "\n\n" + "\n".join(targets) + "\n", "table": "\n".join(table) + "\n"}


def publish(readme_text: str, regions: dict[str, str], readme: Path) -> str:
    out = readme_text
    for name in REGIONS:
        pattern = region_re(name)
        if not pattern.search(out):
            raise Refused(
                f"{readme} has no region <!-- benchmark-results:{name} begin --> ... "
                f"<!-- benchmark-results:{name} end -->: add the markers where the {name} belongs"
            )
        text = regions[name]
        out = pattern.sub(lambda m: m.group(1) + text + m.group(3), out, count=1)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--results", help="run.py's JSON (default: <root>/benchmarks/results.json)")
    ap.add_argument("--readme", help="the README to write into (default: <root>/benchmarks/README.md)")
    ap.add_argument("--root", default=str(HERE.parent), help="the tree whose tddist/ and benchmarks/ must match")
    ap.add_argument("--allow-quick", action="store_true", help="publish a --quick run")
    ap.add_argument("--allow-failed", action="store_true", help="publish a run in which a job failed")
    args = ap.parse_args(argv)
    root = Path(args.root).resolve()
    results = Path(args.results) if args.results else root / "benchmarks" / "results.json"
    readme = Path(args.readme) if args.readme else root / "benchmarks" / "README.md"
    try:
        result = json.loads(results.read_text())
        text = readme.read_text()
    except (OSError, ValueError) as e:
        print(f"publish: cannot read {e}", file=sys.stderr)
        return 1
    try:
        digest = check_publishable(
            result, root, allow_quick=args.allow_quick, allow_failed=args.allow_failed, what=str(results)
        )
        new = publish(text, render(result), readme)
    except Refused as e:
        print(f"publish: refused: {e}", file=sys.stderr)
        return 2
    tmp = readme.with_name(readme.name + ".publish-tmp")
    tmp.write_text(new)
    os.replace(tmp, readme)
    print(f"published {results} (source digest {digest}) into {readme}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
