"""``tddist verify PATH``: check every chunk and list every problem."""

from __future__ import annotations

import argparse
import sys

from ..errors import CheckpointNotFoundError
from ._output import emit_json, human_bytes, key_text, non_finite_json, non_finite_lines, positive_int, progress
from .convert import foreign_error

HELP = "check every chunk of a checkpoint (sizes, structure and checksums) and list every problem"
DESCRIPTION = """\
Check the checkpoint at PATH against its manifest and list every problem found,
not only the first. Full mode (the default) reads every chunk and compares its
checksum; --quick reads no data and only checks that every file exists with the
size the manifest implies: each rank's data file (the default "packed" layout:
one file per rank, its chunks at aligned offsets), each chunk's file (layout
"memmap" and format version 1) or archive entry, and the archive's structure.
A bad chunk in a data file is reported with the file and its offset there.
Leaves that hold NaN or infinite values (counted when the checkpoint was saved,
format version 4) are listed as findings: they are not damage.
Exit status 0 when all is well, 1 when a problem was found."""


def register(sub: argparse._SubParsersAction) -> None:
    s = sub.add_parser(
        "verify", help=HELP, description=DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    s.add_argument("path", metavar="PATH", help="a checkpoint directory or .tdz archive")
    s.add_argument("--quick", action="store_true", help="check sizes and structure only; read no data")
    s.add_argument(
        "--threads", type=positive_int, default=2, metavar="N", help="threads that read and hash chunks (default: 2)"
    )
    s.add_argument(
        "--json", action="store_true", help="print one JSON object (schema tddist.verify/1, see docs/cli.md)"
    )
    s.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from ..storage.backends import read_manifest
    from ..tools.verify import stored_bytes, verify_manifest

    try:
        manifest = read_manifest(args.path)
    except CheckpointNotFoundError:
        foreign = foreign_error(args.path)
        if foreign is None:
            raise
        raise foreign from None
    with progress(0 if args.quick else stored_bytes(manifest), "verify") as update:
        report = verify_manifest(args.path, manifest, quick=args.quick, num_threads=args.threads, progress=update)
    if args.json:
        emit_json(
            "verify",
            {
                "path": args.path,
                "mode": report.mode,
                "layout": report.layout,
                "packing": report.packing,
                "world_size": report.world_size,
                "chunks": report.chunks,
                "bytes": report.nbytes,
                "ok": report.ok,
                "non_finite": [non_finite_json(b) for b in report.non_finite],
                "problems": [
                    {
                        "kind": p.kind,
                        "key": list(p.key) if p.key is not None else None,
                        "rank": p.rank,
                        "file": p.file,
                        "offset": p.offset,
                        "message": p.message,
                    }
                    for p in report.problems
                ],
            },
        )
        return 0 if report.ok else 1
    what = "sizes and structure" if args.quick else "sizes and checksums"
    checked = f"{report.chunks} chunk(s), {human_bytes(report.nbytes)}"
    for line in non_finite_lines(report.non_finite):
        print(line)
    if report.ok:
        print(f"{args.path}: OK ({what} of {checked})")
        return 0
    print(f"{args.path}: {len(report.problems)} problem(s) in {checked} ({what}):")
    for p in report.problems:
        if p.key is not None:
            where = key_text(p.key) + f" (rank {p.rank})"
        elif p.file is not None:
            where = p.file + (f" (rank {p.rank})" if p.rank is not None else "")
        else:
            where = "checkpoint"
        print(f"  {p.kind}: {where}: {p.message}")
    sys.stdout.flush()
    first = report.problems[0].message
    sys.stderr.write(f"tddist verify: {args.path}: {len(report.problems)} problem(s) found; the first: {first}\n")
    return 1
