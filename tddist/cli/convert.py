"""``tddist convert``: a checkpoint from or to DCP, torch.save, safetensors or Hugging Face sharded form."""

from __future__ import annotations

import argparse
import contextlib
import os
from collections.abc import Callable, Iterator

from ..errors import CheckpointNotFoundError
from ._output import emit_json, positive_int, progress, progress_enabled

DESCRIPTION = """\
Convert the checkpoint SRC into DST. SRC is detected: a tddist directory or
.tdz archive, a DCP directory (.metadata), a torch.save file (.pt/.pth), a
.safetensors file, or a Hugging Face directory (model.safetensors, or shards
and model.safetensors.index.json). The format written is --to, or DST's suffix
(.tdz, .pt/.pth, .safetensors), else a tddist directory when DST has no suffix
(another suffix needs --to); --to safetensors with a DST without suffix writes
a sharded directory. Leaves are read one at a time; sharded leaves are written
whole. DST appears complete or not at all; an existing DST is replaced only
with --force, and only by the same format."""

FORMATS = ("tddist", "tdz", "dcp", "torch", "safetensors")


def register(sub: argparse._SubParsersAction) -> None:
    s = sub.add_parser(
        "convert",
        help="convert between tddist, DCP, torch.save and safetensors checkpoints",
        description=DESCRIPTION,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    s.add_argument("src", metavar="SRC", help="the checkpoint to read")
    s.add_argument("dst", metavar="DST", help="what to write")
    s.add_argument("--to", choices=FORMATS, default=None, metavar="FORMAT", help=f"one of {', '.join(FORMATS)}")
    s.add_argument(
        "--prefix",
        default=None,
        metavar="PREFIX",
        help="convert only keys under PREFIX and strip it (parts joined with '/': model/)",
    )
    s.add_argument("--dtype", default=None, metavar="DTYPE", help="cast floating-point leaves (bfloat16, float16, ...)")
    s.add_argument(
        "--max-shard-size",
        default="5GB",
        metavar="SIZE",
        help="largest file of a sharded safetensors directory (default: 5GB; 500MB, 2GiB or bytes)",
    )
    s.add_argument("--compression", default=None, metavar="METHOD", help="a .tdz destination's compression")
    s.add_argument(
        "--consolidate",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="write sharded leaves whole (default; --no-consolidate keeps ranks' shards from tddist to .tdz and back)",
    )
    s.add_argument(
        "--allow-pickle",
        action="store_true",
        help="read pickled objects and store non-JSON values with pickle (only for sources you trust)",
    )
    s.add_argument(
        "--trust-pickle",
        action="store_true",
        help="unpickle a DCP source's .metadata even when it names objects beyond DCP's own (it can run code)",
    )
    s.add_argument(
        "--nested",
        action="store_true",
        help="keep the nesting of a torch.save or DCP source as nested keys (model/tok.weight), not flat names",
    )
    s.add_argument("--force", action="store_true", help="replace DST if it exists (a checkpoint of the same format)")
    s.add_argument("--threads", type=positive_int, default=2, metavar="N", help="threads for tddist (default: 2)")
    s.add_argument("--json", action="store_true", help="print one JSON object (schema tddist.convert/1)")
    s.set_defaults(run=run)


@contextlib.contextmanager
def _bar() -> Iterator[Callable[[int, int], None]]:
    """``progress(done, total)`` for ``convert``: a tqdm bar on a terminal, opened at the first call."""
    if not progress_enabled():
        yield lambda done, total: None
        return
    with contextlib.ExitStack() as stack:
        state: dict[str, Callable[[int], None]] = {}
        shown = 0

        def report(done: int, total: int) -> None:
            nonlocal shown
            if "update" not in state:
                state["update"] = stack.enter_context(progress(total, "convert"))
            state["update"](done - shown)
            shown = done

        yield report


def run(args: argparse.Namespace) -> int:
    from ..interop.convert import convert, detect_format, target_format

    with _bar() as report:
        dst = convert(
            args.src,
            args.dst,
            args.to,
            prefix=args.prefix,
            dtype=args.dtype,
            consolidate=args.consolidate,
            max_shard_size=args.max_shard_size,
            compression=args.compression,
            allow_pickle=args.allow_pickle,
            trust_pickle=args.trust_pickle,
            nested=args.nested,
            overwrite=args.force,
            num_threads=args.threads,
            progress=report,
        )
    src_format, dst_format = detect_format(args.src), target_format(dst, args.to)
    if args.json:
        emit_json(
            "convert",
            {"src": args.src, "dst": args.dst, "from": src_format, "to": dst_format, "bytes": _size(dst)},
        )
    else:
        print(f"converted {args.src} ({src_format}) into {args.dst} ({dst_format})")
    return 0


def _size(path: str) -> int:
    """Bytes of what was written (all files of a directory)."""
    if os.path.isfile(path):
        return os.path.getsize(path)
    return sum(os.path.getsize(os.path.join(d, f)) for d, _s, files in os.walk(path) for f in files)


def foreign_error(path: str) -> CheckpointNotFoundError | None:
    """For ``tddist info`` and ``verify``: what ``path`` is, when it is a checkpoint of a format ``convert`` reads."""
    from ..interop.guard import foreign_kind

    kind = foreign_kind(path)
    if kind is None:
        return None
    return CheckpointNotFoundError(
        f"{path!r} is {kind}, not a tddist checkpoint; tddist convert reads it: 'tddist convert {path} DST' "
        f"writes it as a tddist checkpoint at DST"
    )
