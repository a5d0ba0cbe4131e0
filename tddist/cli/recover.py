"""``tddist recover PATH``: remove what interrupted saves left beside one checkpoint."""

from __future__ import annotations

import argparse

from ._output import emit_json

HELP = "remove leftovers of interrupted saves beside a checkpoint (or restore its backup)"
DESCRIPTION = """\
Remove the staging, trash and backup entries that interrupted saves left beside
the checkpoint PATH (hidden entries named .NAME.tddist-*). A backup that holds the
only committed copy (a replace cut off between its two renames) is moved back to
PATH instead. Committed checkpoints and foreign files are never touched. Run it
only when no save to PATH is running. For a CheckpointManager root, tddist gc does
this for every checkpoint."""


def register(sub: argparse._SubParsersAction) -> None:
    s = sub.add_parser(
        "recover", help=HELP, description=DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    s.add_argument("path", metavar="PATH", help="the checkpoint path (it need not exist)")
    s.add_argument(
        "--json", action="store_true", help="print one JSON object (schema tddist.recover/1, see docs/cli.md)"
    )
    s.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from ..storage.backends import recover  # s3://bucket/key[.tdz]: unfinished uploads and uncommitted generations

    done = recover(args.path)
    if args.json:
        emit_json("recover", {"path": args.path, "done": done})
        return 0
    for line in done:
        print(line)
    print(f"{args.path}: {len(done)} leftover(s) handled" if done else f"{args.path}: nothing to recover")
    return 0
