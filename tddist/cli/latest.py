"""``tddist latest ROOT``: the path of the newest committed checkpoint, for scripts."""

from __future__ import annotations

import argparse
import sys

from ..errors import CheckpointNotFoundError
from ..jobs import inventory
from ._output import emit_json, shown_path

HELP = "print the newest committed checkpoint under a directory or s3:// prefix (for scripts)"
DESCRIPTION = """\
Print the path (or s3:// URL) of the newest committed checkpoint under ROOT: the one a
CheckpointManager would resume from (the highest step-NNNNNNNNN with a valid
manifest; without step names, the one committed last). Exit status 1 and nothing
on stdout when there is none. Never imports torch.

With --finite, skip checkpoints whose floating-point values include NaN or Inf
(counted when they were saved, format version 4; older checkpoints are not
counted and are not skipped), as CheckpointManager(restore="finite") does.

  ckpt=$(tddist latest ckpt/run) && python eval.py "$ckpt" """


def register(sub: argparse._SubParsersAction) -> None:
    s = sub.add_parser(
        "latest", help=HELP, description=DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    s.add_argument(
        "root",
        metavar="ROOT",
        help="a directory or s3://bucket/prefix of checkpoints, such as a CheckpointManager root",
    )
    s.add_argument(
        "--finite", action="store_true", help="skip checkpoints that hold NaN or Inf values (counted at save)"
    )
    s.add_argument(
        "--json", action="store_true", help="print one JSON object (schema tddist.latest/1, see docs/cli.md)"
    )
    s.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    try:
        entry = inventory.newest(args.root, finite=args.finite)
        what = "committed checkpoint without NaN or Inf values" if args.finite else "committed checkpoint"
        message = f"no {what} under {args.root!r}"
    except CheckpointNotFoundError as e:  # a missing root (or bucket): no checkpoint, exit status 1
        entry, message = None, str(e)
    if entry is None:
        if args.json:
            emit_json("latest", {"root": args.root, "path": None, "step": None})
        sys.stderr.write(f"tddist latest: {message}\n")
        return 1
    path = shown_path(entry.path, args.root)
    if args.json:
        emit_json(
            "latest",
            {
                "root": args.root,
                "path": path,
                "step": entry.step,
                "layout": entry.layout,
                "world_size": entry.world_size,
                "created": entry.created,
            },
        )
    else:
        print(path)
    return 0
