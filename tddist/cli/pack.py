"""``tddist pack`` and ``tddist unpack``: a directory checkpoint to one .tdz archive and back."""

from __future__ import annotations

import argparse
import os

from .. import format as fmt
from ..errors import InvalidArgumentError, TargetError
from ._output import emit_json, positive_int, written_bytes_progress

PACK_DESCRIPTION = """\
Write the committed directory checkpoint SRC as the single-file archive DST
(.tdz), verifying every checksum on the way; DST appears complete or not at all.
An existing DST is replaced only with --force. An archive as SRC, or a directory
as DST, is refused: that is what 'tddist unpack' takes."""
UNPACK_DESCRIPTION = """\
Write the committed archive SRC as the directory checkpoint DST, verifying every
checksum on the way; DST appears complete or not at all. An existing DST is
replaced only with --force. A directory as SRC, or a file or a name ending in
.tdz as DST, is refused: that is what 'tddist pack' takes."""

MATERIALIZE_DESCRIPTION = """\
Write the committed checkpoint SRC as the directory checkpoint DST that holds
every byte itself: the chunks an incremental checkpoint references are read from
the checkpoints that hold them (beside SRC) and written into DST, so DST stays
loadable after they are deleted. Every checksum is verified on the way; DST
appears complete or not at all. An existing DST is replaced only with --force."""


def register(sub: argparse._SubParsersAction) -> None:
    s = _copy_command(
        sub, "pack", "pack a directory checkpoint into one .tdz archive", PACK_DESCRIPTION,
        "a committed directory checkpoint", "the archive to write (conventionally NAME.tdz)",
    )  # fmt: skip
    s.add_argument(
        "--compression",
        default=None,
        metavar="METHOD",
        help="compress tensor data: deflate, bzip2, lzma or zstd, optionally METHOD:LEVEL (default: stored)",
    )
    s.set_defaults(run=run_pack)
    s = _copy_command(
        sub, "unpack", "unpack a .tdz archive into a directory checkpoint", UNPACK_DESCRIPTION,
        "a committed .tdz archive", "the directory checkpoint to write",
    )  # fmt: skip
    s.set_defaults(run=run_unpack)
    s = _copy_command(
        sub, "materialize", "copy a checkpoint with the chunks it references into a self-contained directory",
        MATERIALIZE_DESCRIPTION, "a committed checkpoint (an incremental one's holders beside it)",
        "the directory checkpoint to write",
    )  # fmt: skip
    s.set_defaults(run=run_materialize)


def _copy_command(
    sub: argparse._SubParsersAction, name: str, summary: str, description: str, src: str, dst: str
) -> argparse.ArgumentParser:
    """A subcommand that copies the checkpoint SRC to DST, with the options every copy takes (``_common``)."""
    s = sub.add_parser(
        name, help=summary, description=description, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    s.add_argument("src", metavar="SRC", help=src)
    s.add_argument("dst", metavar="DST", help=dst)
    _common(s, name)
    return s


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


def _refuse_wrong_kinds_for_pack(src: str, dst: str) -> None:
    """``pack`` reads a directory and writes a file: refuse an archive as SRC and a directory as DST."""
    if os.path.isfile(src):
        raise InvalidArgumentError(
            f"{src!r} is a file, not a checkpoint directory: 'tddist pack' turns a directory checkpoint into a .tdz "
            f"archive. If {src!r} is an archive already, there is nothing to pack: 'tddist unpack {src} DIR' "
            f"writes it as a directory (and 'tddist pack DIR ARCHIVE.tdz --compression METHOD' recompresses that)"
        )
    if os.path.isdir(dst):
        raise TargetError(
            f"{dst!r} is a directory: 'tddist pack' writes one archive file, so name a file, such as "
            f"'{dst.rstrip(os.sep)}{fmt.ARCHIVE_SUFFIX}' ('tddist unpack ARCHIVE DIR' is the command that writes a "
            f"directory); it was left untouched"
        )


def _refuse_wrong_kinds_for_unpack(src: str, dst: str) -> None:
    """``unpack`` reads a file and writes a directory: refuse a directory as SRC, a file or a .tdz name as DST."""
    if os.path.isdir(src):
        raise InvalidArgumentError(
            f"{src!r} is a directory, not a .tdz archive: 'tddist unpack' turns an archive into a directory "
            f"checkpoint. To make an archive of this directory, run 'tddist pack {src} "
            f"{src.rstrip(os.sep)}{fmt.ARCHIVE_SUFFIX}'"
        )
    if os.path.isfile(dst):
        raise TargetError(
            f"{dst!r} is a file: 'tddist unpack' writes a directory checkpoint, so name a directory "
            f"('tddist pack DIR ARCHIVE' is the command that writes an archive file); it was left untouched"
        )
    if dst.rstrip(os.sep).endswith(fmt.ARCHIVE_SUFFIX):
        raise TargetError(
            f"{dst!r} ends in {fmt.ARCHIVE_SUFFIX}, which names an archive (tddist.save writes one there), but "
            f"'tddist unpack' writes a directory checkpoint: name it without {fmt.ARCHIVE_SUFFIX}, such as "
            f"'{dst.rstrip(os.sep)[: -len(fmt.ARCHIVE_SUFFIX)]}'"
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
        print(f"{name.removesuffix('e')}ed {args.src} into {args.dst}")
    return 0


def run_pack(args: argparse.Namespace) -> int:
    _refuse_wrong_kinds_for_pack(args.src, args.dst)  # before importing torch: a mistake is told at once
    _refuse_existing(args)
    from ..tools.pack import pack

    with written_bytes_progress(_total(args.src), "pack"):
        pack(args.src, args.dst, compression=args.compression, num_threads=args.threads)
    return _done(args, "pack")


def run_unpack(args: argparse.Namespace) -> int:
    _refuse_wrong_kinds_for_unpack(args.src, args.dst)  # before importing torch: a mistake is told at once
    _refuse_existing(args)
    from ..tools.pack import unpack

    with written_bytes_progress(_total(args.src), "unpack"):
        unpack(args.src, args.dst, num_threads=args.threads)
    return _done(args, "unpack")


def run_materialize(args: argparse.Namespace) -> int:
    if args.dst.startswith("s3://"):
        raise TargetError(f"{args.dst!r} is on object storage: 'tddist materialize' writes a local directory")
    if os.path.isfile(args.dst) or args.dst.rstrip(os.sep).endswith(fmt.ARCHIVE_SUFFIX):
        raise TargetError(f"{args.dst!r} names a file or an archive: 'tddist materialize' writes a directory")
    _refuse_existing(args)
    from ..tools.pack import materialize

    with written_bytes_progress(_total(args.src), "materialize"):
        materialize(args.src, args.dst)
    return _done(args, "materialize")
