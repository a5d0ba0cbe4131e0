"""``tddist diff A B``: how two checkpoints differ."""

from __future__ import annotations

import argparse

from ..tools import diff as difflib
from ._output import emit_json, key_text

HELP = "compare two checkpoints: keys, dtypes, shapes, placements, values and content"
DESCRIPTION = """\
Compare the checkpoints A and B (directories or .tdz archives, saved on any
number of ranks): keys present in one only, dtype, shape and placement changes,
non-tensor values, metadata, and which tensors differ in content. Content is
compared by checksum where both split a tensor into the same pieces, without
reading data; otherwise (another world size or placement) the bytes are
compared, unless --checksums-only. Exit status 0 when they are the same, 1 when
they differ."""


def register(sub: argparse._SubParsersAction) -> None:
    s = sub.add_parser("diff", help=HELP, description=DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter)
    s.add_argument("a", metavar="A", help="a checkpoint directory or .tdz archive")
    s.add_argument("b", metavar="B", help="the checkpoint to compare it with")
    s.add_argument(
        "--checksums-only",
        action="store_true",
        help="never read tensor data: tensors split differently in A and B are reported as not compared",
    )
    s.add_argument("--json", action="store_true", help="print one JSON object (schema tddist.diff/1, see docs/cli.md)")
    s.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    r = difflib.diff(args.a, args.b, read_data=not args.checksums_only)
    if args.json:
        emit_json(
            "diff",
            {
                "a": args.a,
                "b": args.b,
                "identical": r.identical,
                "world_size": list(r.world_size),
                "layout": list(r.layout),
                "only_a": [list(k) for k in r.only_a],
                "only_b": [list(k) for k in r.only_b],
                "changed": [
                    {
                        "key": list(d.key),
                        "kind": d.kind,
                        "changes": [{"what": w, "a": x, "b": y} for w, x, y in d.changes],
                        "content": d.content,
                        "compared_by": d.compared_by,
                    }
                    for d in r.changed
                ],
                "not_compared": [list(k) for k in r.unknown],
                "same": r.same,
                "batch_sizes": [{"key": list(k), "a": x, "b": y} for k, x, y in r.batch_sizes],
                "metadata": [{"key": k, "a": x, "b": y} for k, x, y in r.metadata],
            },
        )
        return 0 if r.identical else 1
    print(f"A: {args.a} ({r.world_size[0]} rank(s), {r.layout[0]})")
    print(f"B: {args.b} ({r.world_size[1]} rank(s), {r.layout[1]})")
    for k in r.only_a:
        print(f"only in A: {key_text(k)}")
    for k in r.only_b:
        print(f"only in B: {key_text(k)}")
    for d in r.changed:
        parts = [f"{what} {x} -> {y}" for what, x, y in d.changes]
        if d.content == difflib.DIFFERENT:
            parts.append(f"content differs (by {d.compared_by})")
        elif d.content == difflib.SAME and d.kind == "tensor":
            parts.append(f"content the same (by {d.compared_by})")
        print(f"changed: {key_text(d.key)}: {'; '.join(parts)}")
    for k in r.unknown:
        print(f"not compared: {key_text(k)} (split differently; run without --checksums-only to compare the data)")
    for node, xs, ys in r.batch_sizes:
        print(f"batch size: {key_text(node) if node else '(root)'}: {xs} -> {ys}")
    for name, x, y in r.metadata:
        print(f"metadata: {name}: {x or '(absent)'} -> {y or '(absent)'}")
    print(f"{r.same} key(s) the same" + ("" if not r.identical else "; the checkpoints hold the same data"))
    return 0 if r.identical else 1
