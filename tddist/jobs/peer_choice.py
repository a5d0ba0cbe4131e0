"""Which node-local copies a restore reads: what each rank's node holds (``inventory``: own parts and
replicas, each a ``Copy``), the newest step of which every part has a good copy (``choose``), the parts each
rank needs on the saving world size or another one (``needs``) and where each is read from (``route``).
``peer_restore`` pools the inventories and runs the restore."""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from ..core.sharding import Shard
from ..core.types import Key
from ..errors import TddistError
from ..loading.share import LoadReport
from ..storage.backends import read_manifest
from . import box_reshard, local_shards
from .copies import PartId, read_record
from .keeping import Keeping
from .local_tier import LocalTier
from .replication import held_replicas, replica_path
from .retention import parse_step

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Copy:
    """A committed copy of a part held by a rank, as it tells the others.

    Attributes:
        part: the part.
        holder: the rank whose local directory holds it.
        node: the holder's node.
        path: where, on the holder's node.
        replica: a peer's replica (else the owner's own copy).
        recorded: it has a record with checksums (own copies get one once replicated).
        rows: for each sharded leaf of the part, its rows (to reshard onto another world size).
        boxes: where the part's DTensor shards lie in their global tensors (None: a part saved before
            they were recorded, which reshards plain tensors only).
    """

    part: PartId
    holder: int
    node: str
    path: str
    replica: bool
    recorded: bool
    rows: tuple[tuple[Key, int], ...] = field(compare=False)
    boxes: tuple[local_shards.LeafBox, ...] | None = field(default=None, compare=False)

    @property
    def place(self) -> tuple[PartId, str, str]:
        """The bytes it is: every rank of a node that shares a directory lists the same copy."""
        return self.part, self.node, self.path


@dataclass(frozen=True)
class Choice:
    """The step the ranks restore from the local copies and, for each part, the copies they may use."""

    step: int
    world: int
    copies: Mapping[int, tuple[Copy, ...]]


@dataclass(frozen=True)
class PeerRestore:
    """What ``restore_from_copies`` loaded.

    Attributes:
        step: the step.
        path: the copy this rank loaded its own part from (on another world size, the first part it read).
        report: the load's report.
        layouts: the state's DTensor leaves (to promote the copy again).
        tier: ``"local"`` when every rank read only its own node's copies, ``"peers"`` otherwise.
        same_world: the step was saved on this world size (its own part is, or is being written, in this rank's
            local tier).
        keeping: its own part received from a peer, being written to its local tier (wait before using it).
    """

    step: int
    path: str
    report: LoadReport
    layouts: tuple[local_shards.DTensorLayout, ...]
    tier: str
    same_world: bool
    keeping: Keeping | None = None


def inventory(tier: LocalTier, node: str) -> list[Copy]:
    """The committed copies under this rank's local directory: its parts (of any rank, any world) and replicas."""
    out = []
    for step_dir in _listdir(tier.directory):
        step = parse_step(step_dir)
        for name in _listdir(os.path.join(tier.directory, step_dir)) if step is not None else []:
            part = _part_of(step, name)  # type: ignore[arg-type]
            path = os.path.join(tier.directory, step_dir, name)
            if part is not None and os.path.isdir(path):
                out += _described(part, tier.rank, node, path, False)
    for part in held_replicas(tier.directory):
        out += _described(part, tier.rank, node, replica_path(tier.directory, part), True)
    return out


def _described(part: PartId, holder: int, node: str, path: str, replica: bool) -> list[Copy]:
    try:
        manifest = read_manifest(path)
    except (TddistError, OSError):
        return []  # not committed (a save cut off) or unreadable
    rows = tuple(
        (k, leaf.shape[0])
        for k, leaf in manifest.leaves.items()
        if isinstance(leaf.placement, Shard) and leaf.placement.dim == 0
    )
    boxes = local_shards.decode(manifest.metadata.get(local_shards.BOXES_KEY))
    return [Copy(part, holder, node, path, replica, read_record(path) is not None, rows, boxes)]


def choose(
    copies: Sequence[Copy], bad: set[tuple[PartId, str, str]], step: int | None, world: int
) -> tuple[Choice | None, list[str]]:
    """The newest step (or ``step``) of which every part has a copy not in ``bad``; and why newer ones were passed."""
    passed = []
    by_step: dict[tuple[int, int], dict[int, list[Copy]]] = {}
    for c in copies:
        if c.place not in bad:
            by_step.setdefault((c.part.step, c.part.world), {}).setdefault(c.part.rank, []).append(c)
    keys = sorted(by_step, key=lambda k: (k[0], k[1] == world), reverse=True)
    for s, w in keys:
        if step is not None and s != step:
            continue
        held = by_step[(s, w)]
        lost = [r for r in range(w) if r not in held]
        if lost:
            passed.append(f"step {s} (saved on {w} ranks) has no surviving copy of the parts of ranks {lost[:16]}")
            continue
        return Choice(s, w, {r: tuple(held[r]) for r in range(w)}), passed
    return None, passed


def needs(choice: Choice, rank: int, world: int, targets: tuple[local_shards.LeafBox, ...] = ()) -> list[int]:
    """The parts rank ``rank`` of ``world`` reads: its own, or on another world size those overlapping its rows
    and those whose DTensor shards intersect its own (``targets``: its DTensor leaves' boxes)."""
    if choice.world == world:
        return [rank]
    sources = part_boxes(choice)
    boxed = {b.key for found in sources for b in found}
    rows = [{key: n for key, n in choice.copies[k][0].rows if key not in boxed} for k in range(choice.world)]
    want: set[int] = set()
    for key in rows[0]:
        lo, hi = even_rows(sum(r.get(key, 0) for r in rows), rank, world)
        at = 0
        for k, r in enumerate(rows):
            n = r.get(key, 0)
            if at < hi and lo < at + n:
                want.add(k)
            at += n
    want |= box_reshard.overlapping(sources, targets, rank, want)
    return sorted(want) or [min(rank, choice.world - 1)]


def part_boxes(choice: Choice) -> list[tuple[local_shards.LeafBox, ...]]:
    """Each part's DTensor boxes (none for a part saved before they were recorded)."""
    return [choice.copies[k][0].boxes or () for k in range(choice.world)]


def even_rows(total: int, rank: int, world: int) -> tuple[int, int]:
    """Rows ``[lo, hi)`` of rank ``rank``'s even share of ``total`` (as ``torch.tensor_split`` splits)."""
    q, r = divmod(total, world)
    lo = rank * q + min(rank, r)
    return lo, lo + q + (1 if rank < r else 0)


def route(
    choice: Choice, world: int, targets: Mapping[int, tuple[local_shards.LeafBox, ...]] | None = None
) -> dict[tuple[int, int], Copy]:
    """(reader, part) -> the copy it reads: its own holding when it has one, else one spread over the holders.

    ``targets``: each reader's DTensor boxes (on another world size).
    """
    out = {}
    for reader in range(world):
        for k in needs(choice, reader, world, (targets or {}).get(reader, ())):
            held = choice.copies[k]
            own = [c for c in held if c.holder == reader]
            out[(reader, k)] = own[0] if own else held[(reader + k) % len(held)]
    return out


def _part_of(step: int, name: str) -> PartId | None:
    if not name.startswith("rank-") or "." in name:
        return None
    try:
        rank, world = (int(x) for x in name[len("rank-") :].split("-of-"))
    except ValueError:
        return None
    return PartId(step, rank, world)


def _listdir(path: str) -> list[str]:
    try:
        return sorted(os.listdir(path))
    except FileNotFoundError:
        return []
