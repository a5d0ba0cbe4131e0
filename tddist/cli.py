"""The ``tddist`` command: inspect, verify, recover, pack and unpack checkpoints."""

from __future__ import annotations

import argparse
import json
import sys

from ._version import __version__
from .api import load, read_manifest, recover
from .convert import pack, unpack
from .errors import TddistError


def _info(args) -> int:
    m = read_manifest(args.path)
    total = sum(c.nbytes for leaf in m.leaves.values() for c in leaf.chunks)
    print(f"{args.path}: tddist format v{m.version} ({m.layout}), written by tddist {m.tddist_version} at {m.created}")
    print(
        f"  world size {m.world_size}, {len(m.leaves)} tensor leaves, {len(m.objects)} non-tensor leaves, {total / 2**20:.1f} MiB"
    )
    if m.metadata:
        print(f"  metadata: {json.dumps(m.metadata)}")
    if args.leaves:
        for leaf in m.leaves.values():
            print(
                f"  {'/'.join(leaf.key)}: {str(leaf.dtype).removeprefix('torch.')} {list(leaf.shape)} "
                f"{type(leaf.placement).__name__}, {len(leaf.chunks)} chunk(s)"
            )
    return 0


def _verify(args) -> int:
    load(args.path, shard=None, verify=True, num_threads=args.threads)
    print(f"{args.path}: every chunk matches its checksum")
    return 0


def _recover(args) -> int:
    done = recover(args.path)
    for line in done:
        print(line)
    print(f"{args.path}: {len(done)} leftover(s) handled" if done else f"{args.path}: nothing to recover")
    return 0


def _pack(args) -> int:
    pack(args.src, args.dst, compression=args.compression, num_threads=args.threads)
    print(f"packed {args.src} into {args.dst}")
    return 0


def _unpack(args) -> int:
    unpack(args.src, args.dst, num_threads=args.threads)
    print(f"unpacked {args.src} into {args.dst}")
    return 0


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="tddist", description="Inspect and maintain tddist checkpoints.")
    p.add_argument("--version", action="version", version=f"tddist {__version__}")
    sub = p.add_subparsers(dest="command", required=True)
    s = sub.add_parser("info", help="print what a checkpoint holds (reads only the manifest)")
    s.add_argument("path")
    s.add_argument("--leaves", action="store_true", help="list every leaf")
    s.set_defaults(fn=_info)
    s = sub.add_parser("verify", help="check every chunk against its checksum")
    s.add_argument("path")
    s.add_argument("--threads", type=int, default=2)
    s.set_defaults(fn=_verify)
    s = sub.add_parser("recover", help="remove leftovers of interrupted saves beside a checkpoint")
    s.add_argument("path")
    s.set_defaults(fn=_recover)
    s = sub.add_parser("pack", help="pack a directory checkpoint into one .tdz archive")
    s.add_argument("src")
    s.add_argument("dst")
    s.add_argument("--compression", default=None, help="deflate, bzip2, lzma or zstd (optionally name:level)")
    s.add_argument("--threads", type=int, default=2)
    s.set_defaults(fn=_pack)
    s = sub.add_parser("unpack", help="unpack a .tdz archive into a directory checkpoint")
    s.add_argument("src")
    s.add_argument("dst")
    s.add_argument("--threads", type=int, default=2)
    s.set_defaults(fn=_unpack)
    return p


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    try:
        return args.fn(args)
    except TddistError as e:
        print(f"tddist {args.command}: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
