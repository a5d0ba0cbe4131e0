"""``tddist ls ROOT``: the checkpoints under a directory, and what interrupted saves left there."""

from __future__ import annotations

import argparse

from ..jobs import inventory
from ._output import emit_json, entry_name, human_age, human_bytes, shown_path, table

HELP = "list the checkpoints under a directory or s3:// prefix, with leftovers of interrupted saves"
DESCRIPTION = """\
List the checkpoints under ROOT (a CheckpointManager root or any directory, or
s3://bucket/prefix): step, state, layout, number of ranks, size (on disk; on object
storage, of the objects) and age. Leftovers of interrupted saves (hidden staging,
trash and backup entries; on object storage, generations no manifest names and
unfinished uploads) and partial saves are listed too, each with the command that
removes it. Reads only manifests; never imports torch."""


def register(sub: argparse._SubParsersAction) -> None:
    s = sub.add_parser("ls", help=HELP, description=DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter)
    s.add_argument("root", metavar="ROOT", help="a directory or s3://bucket/prefix of checkpoints (or one checkpoint)")
    s.add_argument("--json", action="store_true", help="print one JSON object (schema tddist.ls/1, see docs/cli.md)")
    s.set_defaults(run=run)


def entry_json(e: inventory.Entry, root_arg: str) -> dict:
    return {
        "path": shown_path(e.path, root_arg),
        "name": entry_name(e.path),
        "kind": e.kind,
        "committed": e.committed,
        "step": e.step,
        "layout": e.layout,
        "world_size": e.world_size,
        "bytes": e.nbytes,
        "created": e.created,
        "mtime": e.mtime,
        "age_seconds": round(e.age_seconds, 3),
        "target": shown_path(e.target, root_arg) if e.target else None,
        "problem": e.problem,
        "fix": e.fix,
    }


_STATE = {
    inventory.CHECKPOINT: "committed",
    inventory.DAMAGED: "DAMAGED",
    inventory.PARTIAL: "partial",
    inventory.STAGING: "leftover",
    inventory.TRASH: "leftover",
    inventory.BACKUP: "leftover",
    inventory.FOREIGN: "foreign",
}


def run(args: argparse.Namespace) -> int:
    entries = inventory.scan(args.root)
    if args.json:
        emit_json("ls", {"root": args.root, "entries": [entry_json(e, args.root) for e in entries]})
        return 0
    if not entries:
        print(f"{args.root}: no checkpoints")
        return 0
    rows = []
    for e in entries:
        state = _STATE[e.kind] + (
            f" ({e.kind})" if e.kind in (inventory.STAGING, inventory.TRASH, inventory.BACKUP) else ""
        )
        rows.append(
            [
                "-" if e.step is None else str(e.step),
                state,
                e.layout,
                "-" if e.world_size is None else str(e.world_size),
                human_bytes(e.nbytes),
                human_age(e.age_seconds),
                entry_name(e.path),
            ]
        )
    print(table(rows, ["STEP", "STATE", "LAYOUT", "RANKS", "SIZE", "AGE", "NAME"]))
    committed = [e for e in entries if e.committed]
    print(f"{len(committed)} committed checkpoint(s), {human_bytes(sum(e.nbytes for e in committed))}")
    problems = [e for e in entries if not e.committed]
    if problems:
        print()
        by_fix: dict[str | None, list[inventory.Entry]] = {}
        for e in problems:
            by_fix.setdefault(e.fix, []).append(e)
        for e in problems:
            print(f"{entry_name(e.path)}: {e.problem}")
        for fix, group in by_fix.items():
            size = human_bytes(sum(e.nbytes for e in group))
            if fix is None:
                print(
                    f"{len(group)} entr{'y' if len(group) == 1 else 'ies'} ({size}) need a look: nothing removes them safely"
                )
            else:
                print(
                    f"to remove {len(group)} entr{'y' if len(group) == 1 else 'ies'} ({size}), when no save is running: {fix}"
                )
    return 0
