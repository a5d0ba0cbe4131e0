"""``tddist gc ROOT``: the checkpoint manager's clean-up and retention, offline."""

from __future__ import annotations

import argparse

from ..jobs import cleanup
from ._output import emit_json, human_bytes, positive_int, shown_path

HELP = "remove leftovers of interrupted saves and old checkpoints under a root, as the manager does"
DESCRIPTION = """\
Apply CheckpointManager's rules to ROOT (a directory or s3://bucket/prefix)
offline: remove the leftovers of interrupted saves and deletions beside every
step-NNNNNNNNN checkpoint (a committed backup whose checkpoint was lost is moved
back instead; on object storage, generations no manifest names and unfinished
uploads), remove step entries without a manifest that hold only tddist's files, and with
--keep-last N delete the committed checkpoints beyond the N newest (never the
newest valid one). Damaged checkpoints and foreign files are left alone. Run it
only when no job is saving to ROOT; --dry-run shows what it would do."""


def register(sub: argparse._SubParsersAction) -> None:
    s = sub.add_parser("gc", help=HELP, description=DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter)
    s.add_argument(
        "root",
        metavar="ROOT",
        help="a CheckpointManager root (a directory or s3://bucket/prefix holding step-NNNNNNNNN checkpoints)",
    )
    s.add_argument(
        "--keep-last",
        type=positive_int,
        default=None,
        metavar="N",
        help="also delete committed checkpoints beyond the N newest (default: keep every checkpoint)",
    )
    s.add_argument("--dry-run", action="store_true", help="print what would be done; change nothing")
    s.add_argument("--json", action="store_true", help="print one JSON object (schema tddist.gc/1, see docs/cli.md)")
    s.set_defaults(run=run)


_PAST = {"remove": "removed", "restore": "restored", "delete": "deleted", "keep": "kept"}
_FUTURE = {"remove": "would remove", "restore": "would restore", "delete": "would delete", "keep": "would keep"}


def run(args: argparse.Namespace) -> int:
    if args.dry_run:
        actions = cleanup.plan_gc(args.root, args.keep_last)
    else:
        actions = cleanup.gc(args.root, args.keep_last)
    freed = sum(a.nbytes for a in actions)
    if args.json:
        emit_json(
            "gc",
            {
                "root": args.root,
                "dry_run": args.dry_run,
                "keep_last": args.keep_last,
                "actions": [
                    {
                        "action": a.action,
                        "path": shown_path(a.path, args.root),
                        "reason": a.reason,
                        "bytes": a.nbytes,
                        "target": shown_path(a.target, args.root) if a.target else None,
                    }
                    for a in actions
                ],
                "freed_bytes": freed,
            },
        )
        return 0
    verbs = _FUTURE if args.dry_run else _PAST
    for a in actions:
        size = f", {human_bytes(a.nbytes)}" if a.nbytes else ""
        to = f" to {shown_path(a.target, args.root)}" if a.target else ""
        print(f"{verbs[a.action]} {shown_path(a.path, args.root)}{to} ({a.reason}{size})")
    if not actions:
        print(f"{args.root}: nothing to do")
    else:
        print(f"{'would free' if args.dry_run else 'freed'} {human_bytes(freed)}")
    return 0
