"""``tddist pack`` and ``tddist unpack``: a directory checkpoint to one .tdz archive and back."""

from __future__ import annotations

import argparse
import os

from ..errors import TargetError
from ._output import emit_json, positive_int, written_bytes_progress

PACK_DESCRIPTION = """\
Write the committed directory checkpoint SRC as the single-file archive DST
(.tdz), verifying every checksum on the way; DST appears complete or not at all.
An existing DST is replaced only with --force."""
UNPACK_DESCRIPTION = """\
Write the committed archive SRC as the directory checkpoint DST, verifying every
checksum on the way; DST appears complete or not at all. An existing DST is
replaced only with --force."""


def register(sub: argparse._SubParsersAction) -> None:
    fmt = argparse.RawDescriptionHelpFormatter
    s = sub.add_parser(
        "pack",
        help="pack a directory checkpoint into one .tdz archive",
        description=PACK_DESCRIPTION,
        formatter_class=fmt,
    )
    s.add_argument("src", metavar="SRC", help="a committed directory checkpoint")
    s.add_argument("dst", metavar="DST", help="the archive to write (conventionally NAME.tdz)")
    s.add_argument(
        "--compression",
        default=None,
        metavar="METHOD",
        help="compress tensor data: deflate, bzip2, lzma or zstd, optionally METHOD:LEVEL (default: stored)",
    )
    _common(s, "pack")
    s.set_defaults(run=run_pack)
    s = sub.add_parser(
        "unpack",
        help="unpack a .tdz archive into a directory checkpoint",
        description=UNPACK_DESCRIPTION,
        formatter_class=fmt,
    )
    s.add_argument("src", metavar="SRC", help="a committed .tdz archive")
    s.add_argument("dst", metavar="DST", help="the directory checkpoint to write")
    _common(s, "unpack")
    s.set_defaults(run=run_unpack)


def _common(s: argparse.ArgumentParser, name: str) -> None:
    s.add_argument("--force", action="store_true", help="replace DST if it exists (a tddist checkpoint only)")
    s.add_argument(
        "--threads",
        type=positive_int,
        default=2,
        metavar="N",
        help="threads that hash, compress and write (default: 2)",
    )
    s.add_argument(
        "--json", action="store_true", help=f"print one JSON object (schema tddist.{name}/1, see docs/cli.md)"
    )


def _refuse_existing(args: argparse.Namespace) -> None:
    if os.path.lexists(args.dst) and not args.force:
        raise TargetError(
            f"{args.dst!r} exists; pass --force to replace it (only a tddist checkpoint is ever replaced, "
            f"and only once the new one is complete)"
        )


def _total(path: str) -> int:
    from ..storage.backends import read_manifest
    from ..tools.verify import stored_bytes

    return stored_bytes(read_manifest(path))


def _done(args: argparse.Namespace, name: str) -> int:
    if args.json:
        emit_json(name, {"src": args.src, "dst": args.dst, "bytes": _total(args.dst)})
    else:
        print(f"{name}ed {args.src} into {args.dst}")
    return 0


def run_pack(args: argparse.Namespace) -> int:
    from ..tools.pack import pack

    _refuse_existing(args)
    with written_bytes_progress(_total(args.src), "pack"):
        pack(args.src, args.dst, compression=args.compression, num_threads=args.threads)
    return _done(args, "pack")


def run_unpack(args: argparse.Namespace) -> int:
    from ..tools.pack import unpack

    _refuse_existing(args)
    with written_bytes_progress(_total(args.src), "unpack"):
        unpack(args.src, args.dst, num_threads=args.threads)
    return _done(args, "unpack")
