"""``tddist info PATH``: what a checkpoint holds, read from its manifest alone."""

from __future__ import annotations

import argparse
import datetime
import json
import os

import numpy as np

from .. import format as fmt
from ..core.sharding import PerRank, Replicate, Shard
from ..errors import CheckpointNotFoundError
from ..jobs import inventory
from ..manifest.model import Leaf, Manifest, ObjectLeaf
from ..storage.backends import read_manifest
from ..tools.diff import placement_text
from ..tools.verify import leaf_nbytes
from ._output import (
    emit_json,
    human_age,
    human_bytes,
    key_text,
    largest_json,
    non_finite_json,
    non_finite_lines,
    table,
    value_text,
)
from .convert import foreign_error

HELP = "describe a checkpoint: contents, sizes, metadata, non-tensor values (reads only the manifest)"
DESCRIPTION = """\
Describe the checkpoint at PATH (a directory or a .tdz archive) from its manifest:
its format version and packing ("packed": one data file per rank, the default;
"memmap": one file per leaf and rank, as layout="memmap", format version 1 and
archives store it), when and by how many ranks it was saved, its tensors and
their total size, its non-tensor values (shown, cut at 60 characters) and
metadata, and any leftovers of interrupted saves beside it. --leaves lists every
tensor with its dtype, global shape, placement and number of stored pieces.
Reads no tensor data; never imports torch.

Placements: "sharded on dim D" (each rank saved a slab along dimension D; the
global tensor is the slabs in rank order), "replicated" (one copy, saved by rank
0), "DTensor" (each rank saved its local shard of a DTensor: a block of the
global tensor, written once per distinct block)."""

#: Non-tensor values shown in the summary (all of them with --leaves).
SUMMARY_VALUES = 20


def register(sub: argparse._SubParsersAction) -> None:
    s = sub.add_parser("info", help=HELP, description=DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter)
    s.add_argument("path", metavar="PATH", help="a checkpoint directory or .tdz archive")
    s.add_argument("--leaves", action="store_true", help="list every tensor and non-tensor value in a table")
    s.add_argument("--json", action="store_true", help="print one JSON object (schema tddist.info/1, see docs/cli.md)")
    s.set_defaults(run=run)


def _is_archive(path: str) -> bool:
    """A file (on a file system), or an ``s3://`` key ending in .tdz (one object)."""
    return os.path.isfile(path) or (path.startswith("s3://") and path.endswith(fmt.ARCHIVE_SUFFIX))


def _read(path: str) -> Manifest:
    try:
        return read_manifest(path)
    except CheckpointNotFoundError:
        if os.path.isdir(path) and not os.path.isfile(os.path.join(path, fmt.MANIFEST_NAME)):
            found = [e for e in inventory.scan(path) if e.committed]
            if found:
                newest = inventory.newest(path)
                hint = f"; the newest is {os.path.join(path, os.path.basename(newest.path))}" if newest else ""
                raise CheckpointNotFoundError(
                    f"{path!r} is not a checkpoint but a directory of {len(found)} checkpoint(s){hint}. "
                    f"List them with: tddist ls {path}; describe the newest with: tddist info $(tddist latest {path})"
                ) from None
        foreign = foreign_error(path)
        if foreign is not None:
            raise foreign from None
        raise


#: How each packing stores the ranks' chunks, in words.
PACKINGS = {"packed": "packed: one data file per rank", "memmap": "memmap: one file per leaf"}


def packing_text(m: Manifest, archive: bool) -> str:
    text = PACKINGS.get(m.packing, m.packing)
    return text + ", as archive entries" if archive else text


def placement_json(leaf: Leaf) -> dict:
    if isinstance(leaf.placement, Shard):
        return {"type": "shard", "dim": leaf.placement.dim}
    if isinstance(leaf.placement, PerRank):
        return {"type": "per_rank"}
    return {"type": "replicate" if isinstance(leaf.placement, Replicate) else "dtensor"}


def object_values(o: ObjectLeaf) -> list:
    """Stored values: JSON values as they are, pickled ones as ``{"pickled_bytes": n}``."""

    def one(v: object) -> object:
        if isinstance(v, dict) and "json" in v:
            return v["json"]
        if isinstance(v, dict) and isinstance(v.get("pickle"), str):
            return {"pickled_bytes": len(v["pickle"]) * 3 // 4}
        return None

    if o.placement == "shard":
        return [[one(v) for v in rows] for rows in o.values]
    return [one(v) for v in o.values]


def object_text(o: ObjectLeaf, limit: int = 60) -> str:
    if o.placement == "replicate":
        return value_text(o.values[0], limit)
    if o.placement == "per_rank":
        parts = [f"rank {r}: {value_text(v, 24)}" for r, v in enumerate(o.values[:4])]
        more = f", ... ({len(o.values)} ranks)" if len(o.values) > 4 else ""
        return "per rank: " + ", ".join(parts) + more
    rows = [v for rs in o.values for v in rs]
    shown = ", ".join(value_text(v, 20) for v in rows[:4])
    return f"{len(rows)} row(s): {shown}" + (", ..." if len(rows) > 4 else "")


def leftovers(path: str) -> list[dict]:
    out = []
    for kind, p in fmt.side_entries(path):
        out.append(
            {
                "kind": kind,
                "path": os.path.join(os.path.dirname(path), os.path.basename(p)),
                "bytes": inventory.disk_usage(p),
            }
        )
    return out


def run(args: argparse.Namespace) -> int:
    """``tddist info``: print the summary (or, with ``--json``, the JSON object) of the checkpoint at PATH."""
    m = _read(args.path)
    total = sum(leaf_nbytes(leaf) for leaf in m.leaves.values())
    left = leftovers(args.path)
    if args.json:
        emit_json("info", _info_json(args.path, m, total, left))
        return 0
    _print_header(args.path, m, total)
    _print_references(m)
    _print_finite(m)
    if m.metadata:
        print(f"  metadata: {value_text({'json': m.metadata}, 200)}")
    _print_groups(m)
    _print_values(m, args.leaves)
    if args.leaves:
        _print_leaves(m)
    elif m.leaves:
        print("  (--leaves lists every tensor with its dtype, shape and placement)")
    _print_leftovers(args.path, left)
    return 0


def _info_json(path: str, m: Manifest, total: int, left: list[dict]) -> dict:
    """The ``--json`` object (schema tddist.info/1, docs/cli.md): the whole manifest, every leaf and value."""
    return {
        "path": path,
        "format_version": m.version,
        "layout": "archive" if _is_archive(path) else "directory",
        "packing": m.packing,
        "tddist_version": m.tddist_version,
        "created": m.created or None,
        "world_size": m.world_size,
        "robust_key": m.robust_key,
        "bytes": total,
        "metadata": m.metadata,
        "nodes": [{"key": list(k), "batch_size": list(b)} for k, b in m.nodes.items()],
        "leaves": [_leaf_json(leaf) for leaf in m.leaves.values()],
        "objects": [
            {"key": list(o.key), "placement": o.placement, "values": object_values(o)} for o in m.objects.values()
        ],
        "leftovers": left,
        "finite": _finite_state(m),
        "non_finite": [non_finite_json(b) for b in m.non_finite()],
        "references": _references_json(m),
        "largest_magnitude": largest_json(m.largest_magnitude()),
    }


def _held_bytes(m: Manifest) -> dict[int, int]:
    """An incremental checkpoint's referenced bytes by holder number (0: those it holds itself)."""
    out: dict[int, int] = {}
    for leaf in m.leaves.values():
        if leaf.refs is None:
            continue
        nbytes = leaf.table.columns().nbytes
        for h in np.unique(leaf.refs.holders).tolist():
            out[h] = out.get(h, 0) + int(nbytes[leaf.refs.holders == h].sum())
    return out


def _references_json(m: Manifest) -> list[dict] | None:
    """The holders of an incremental checkpoint (None: saved without a base) with the bytes each holds."""
    if m.holders is None:
        return None
    held = _held_bytes(m)
    return [{"name": h.name, "generation": h.generation, "bytes": held.get(i, 0)} for i, h in enumerate(m.holders, 1)]


def _print_references(m: Manifest) -> None:
    """An incremental checkpoint: which checkpoints beside it hold the chunks it references."""
    if m.holders is None:
        return
    held = _held_bytes(m)
    print(f"  incremental: holds {human_bytes(held.get(0, 0))} itself, references {len(m.holders)} checkpoint(s)")
    for i, h in enumerate(m.holders, 1):
        print(f"    {h.name} (generation {h.generation}): {human_bytes(held.get(i, 0))}")


def _finite_state(m: Manifest) -> bool | None:
    """True: every floating leaf was counted and holds only finite values; False: some hold NaN or Inf;
    None: some floating leaf was not counted (format versions before 4)."""
    if m.non_finite():
        return False
    return None if m.uncounted() else True


def _print_finite(m: Manifest) -> None:
    """Whether the tensors are certified finite, and which leaves hold NaN or Inf values (a finding, not damage)."""
    bad = m.non_finite()
    if bad:
        print(f"  values: {len(bad)} tensor(s) hold NaN or Inf values (counted at save):")
        for line in non_finite_lines(bad):
            print("  " + line)
    elif m.uncounted():
        print(f"  values: not counted ({len(m.uncounted())} floating tensor(s) saved before format version 4)")
    else:
        print("  values: every floating-point value is finite (counted at save)")
    top = m.largest_magnitude()
    if top is not None:
        print(f"  largest finite magnitude: {top.value:.6g} ({key_text(top.key)}, rank {top.rank})")


def _leaf_json(leaf: Leaf) -> dict:
    """One tensor of the ``--json`` object: its key, dtype, global shape, placement, pieces and size."""
    return {
        "key": list(leaf.key),
        "dtype": leaf.dtype_name,
        "shape": list(leaf.shape),
        "placement": placement_json(leaf),
        "chunks": len(leaf.table),
        "bytes": leaf_nbytes(leaf),
    }


def _print_header(path: str, m: Manifest, total: int) -> None:
    """The summary's first lines: what the checkpoint is, who saved it when, and its tensors by placement."""
    archive = _is_archive(path)
    layout = "archive" if archive else "directory"
    when = m.created or "an unknown time"
    age = _age_seconds(path, m.created)
    if age is not None and m.created:
        when += f" ({human_age(age)} ago)"
    print(f"{path}: tddist checkpoint, {layout}, format version {m.version} ({packing_text(m, archive)})")
    print(f"  world size {m.world_size} (ranks that saved it), saved at {when} by tddist {m.tddist_version or '?'}")
    split = ", ".join(f"{n} {k}" for k, n in _placement_counts(m).items())
    print(f"  {len(m.leaves)} tensor(s){f' ({split})' if split else ''}, {human_bytes(total)} of tensor data")


def _age_seconds(path: str, created: str) -> float | None:
    """Seconds since the checkpoint at ``path`` was committed: its manifest's time (else the file's modification
    time), as ``tddist ls`` shows it; None off the local file system. The manifest read once is enough (asking
    ``inventory.describe`` would read and validate it again)."""
    try:
        mtime = os.lstat(path).st_mtime
    except OSError:
        return None
    try:
        t = datetime.datetime.fromisoformat(created)
        when = (t if t.tzinfo else t.replace(tzinfo=datetime.timezone.utc)).timestamp()
    except ValueError:
        when = mtime
    return max(0.0, datetime.datetime.now(datetime.timezone.utc).timestamp() - when)


def _placement_counts(m: Manifest) -> dict[str, int]:
    """How many tensors have each kind of placement ("sharded", "replicated", ...), in the order first met."""
    kinds: dict[str, int] = {}
    for leaf in m.leaves.values():
        kind = placement_text(leaf).split(" on ")[0]
        kinds[kind] = kinds.get(kind, 0) + 1
    return kinds


def _print_values(m: Manifest, listed: bool) -> None:
    """The non-tensor values: the first ``SUMMARY_VALUES`` shown, or only their count when ``--leaves`` lists them."""
    if m.objects and not listed:
        shown = list(m.objects.values())
        print(f"  {len(shown)} non-tensor value(s):")
        for o in shown[:SUMMARY_VALUES]:
            print(f"    {key_text(o.key)} = {object_text(o)}")
        if len(shown) > SUMMARY_VALUES:
            print(f"    ... {len(shown) - SUMMARY_VALUES} more (--leaves lists all)")
    elif m.objects:
        print(f"  {len(m.objects)} non-tensor value(s)")


def _print_leftovers(path: str, left: list[dict]) -> None:
    """The leftovers of interrupted saves beside the checkpoint, if any, with the command that removes them."""
    if left:
        size = human_bytes(sum(e["bytes"] for e in left))
        print(
            f"  {len(left)} leftover(s) of interrupted saves beside it ({size}): "
            + ", ".join(sorted({e["kind"] for e in left}))
        )
        print(f"    remove them, when no save to it is running: tddist recover {path}")


def _print_groups(m: Manifest) -> None:
    """Tensors and bytes under each top-level key (when there is more than one)."""
    groups: dict[str, list[int]] = {}
    for leaf in m.leaves.values():
        g = groups.setdefault(leaf.key[0], [0, 0])
        g[0] += 1
        g[1] += leaf_nbytes(leaf)
    nested = {k[0] for k in m.leaves if len(k) > 1}
    if len(groups) < 2 or not nested:
        return
    rows = []
    for name, (count, nbytes) in groups.items():
        node = m.nodes.get((name,))
        batch = f"batch {list(node)}" if node else ""
        rows.append(
            [name if (name and "/" not in name) else json.dumps(name), f"{count} tensor(s)", human_bytes(nbytes), batch]
        )
    print("  contents:")
    for line in table(rows, ["key", "tensors", "size", ""]).splitlines()[1:]:
        print(f"    {line}")


def _print_leaves(m: Manifest) -> None:
    if m.leaves:
        rows = [
            [
                key_text(leaf.key),
                leaf.dtype_name,
                str(list(leaf.shape)),
                placement_text(leaf),
                str(len(leaf.table)),
                human_bytes(leaf_nbytes(leaf)),
            ]
            for leaf in m.leaves.values()
        ]
        print()
        print(table(rows, ["KEY", "DTYPE", "SHAPE", "PLACEMENT", "PIECES", "SIZE"]))
    if m.objects:
        print()
        rows = [[key_text(o.key), o.placement.replace("_", "-"), object_text(o)] for o in m.objects.values()]
        print(table(rows, ["KEY", "STORED", "VALUE"]))
