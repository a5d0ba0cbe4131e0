"""The node-local tier of ``CheckpointManager``: each rank's own copy of a checkpoint, on fast local storage.

Node-local storage (a tmpfs, a local NVMe disk) is not shared between nodes,
so no rank may rely on reading what another rank wrote there. Each rank
therefore commits its own shard as a complete one-rank tddist checkpoint,
``<local_dir>/step-<step>/rank-<r>-of-<world>``, with ``LocalComm``: its own
manifest and checksums, its own atomic publish. Ranks that share a node (and
a ``local_dir``) write side by side; ranks on other nodes write to their own
disks. The local copy of a step is complete only when every rank of the same
world size holds its part, which the ranks agree on with one allgather
(``complete_steps``).

This module is what one rank does with its own parts (save, find, load,
drop); the manager runs the collective decisions.
"""

from __future__ import annotations

import logging
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from .._fs import remove_tree
from ..api import load, save
from ..comm.base import Communicator, LocalComm
from ..errors import InvalidArgumentError, TddistError
from ..loading.share import LoadReport
from ..storage.backends import read_manifest
from ..storage.recovery import recover
from . import local_shards
from .copies import RECORD_SUFFIX
from .retention import parse_step, step_name

logger = logging.getLogger(__name__)

_PART_RE = re.compile(r"^rank-(\d+)-of-(\d+)$")

#: Options of the manager's ``save_kwargs`` that a local part is saved with too (the rest, such as
#: ``archive``, ``placements`` or ``check_replicas``, concern the shared checkpoint only).
LOCAL_SAVE_OPTIONS = ("allow_pickle", "robust_key", "num_threads", "share_non_tensor")


@dataclass(frozen=True)
class Holding:
    """What one rank holds locally, as it tells the others (``complete_steps``).

    Attributes:
        rank: the rank that holds the parts.
        steps: the steps of which this rank holds a committed part for the current world size.
    """

    rank: int
    steps: frozenset[int]


@dataclass(frozen=True)
class LocalCopy:
    """This rank's committed part of one step, read back to be promoted.

    Attributes:
        step: the training step.
        path: the part (a one-rank checkpoint).
        data: its contents, memory-mapped copy-on-write from the part's files.
        metadata: the metadata it was saved with (the step included).
    """

    step: int
    path: str
    data: Any
    metadata: Mapping[str, Any]


@dataclass(frozen=True)
class Restoring:
    """What loading a local part did: the load's report, and the DTensor layouts of the state it filled.

    Attributes:
        report: what ``tddist.load(into=...)`` found.
        layouts: the state's DTensor leaves (to promote the part again, see ``LocalTier.read``).
    """

    report: LoadReport
    layouts: tuple[local_shards.DTensorLayout, ...]


def expand(local_dir: str | os.PathLike, rank: int) -> str:
    """The local directory of ``rank``: ``local_dir`` with ``{rank}`` replaced, made absolute.

    Raises:
        InvalidArgumentError: ``local_dir`` has another ``{...}`` field.
    """
    text = os.fspath(local_dir)
    try:
        return os.path.abspath(text.format(rank=rank))
    except (KeyError, IndexError, ValueError) as e:
        raise InvalidArgumentError(
            f"local_dir={text!r}: only the field {{rank}} may appear in it ({type(e).__name__}: {e})"
        ) from None


class LocalTier:
    """One rank's parts of the node-local copies, under ``directory``.

    Every method is local to this rank (no collective): the manager calls
    ``save``, then agrees with the other ranks that every part committed;
    ``held`` before agreeing on what is complete (``complete_steps``);
    ``load_into`` only for a step that every rank holds; ``drop`` for the
    steps that the manager's retention retires, on every rank alike.

    Args:
        directory: this rank's local directory (``expand`` of the manager's ``local_dir``).
        rank: this rank.
        world: the number of ranks.
    """

    def __init__(self, directory: str, rank: int, world: int) -> None:
        self.directory, self.rank, self.world = directory, rank, world
        self._comm = LocalComm()  # one per tier: what tddist keeps per communicator is kept once

    def part(self, step: int, world: int | None = None) -> str:
        """Where this rank's part of ``step`` is: ``<directory>/step-<step>/rank-<r>-of-<world>``."""
        return os.path.join(self.directory, step_name(step), f"rank-{self.rank}-of-{world or self.world}")

    def save(self, data: Any, step: int, metadata: Mapping[str, Any], options: Mapping[str, Any]) -> Any:
        """Commit this rank's shard as the one-rank checkpoint ``part(step)``; return it memory-mapped.

        The maps read the committed local files, so the promotion reads what
        the local copy holds, not the training state (which moves on). A
        DTensor leaf is saved as this rank's local shard and comes back as a
        DTensor of the same layout around the map of that shard; where that
        shard lies in the global tensor is recorded in the part's metadata
        (``local_shards.BOXES_KEY``), which travels with its replicas.
        """
        plain, layouts = local_shards.split(data)  # a DTensor leaf: this rank's shard of it
        kwargs = {k: v for k, v in options.items() if k in LOCAL_SAVE_OPTIONS}
        os.makedirs(os.path.dirname(self.part(step)), exist_ok=True)
        recorded = {**metadata, local_shards.BOXES_KEY: local_shards.encode(local_shards.boxes(layouts))}
        mapped = save(plain, self.part(step), comm=self._comm, metadata=recorded, copy_existing=True, **kwargs)
        return local_shards.join(mapped, layouts)

    def read(self, step: int, layouts: tuple[local_shards.DTensorLayout, ...]) -> LocalCopy:
        """This rank's part of ``step``, mapped, with its metadata (to promote a copy a restart found).

        ``layouts``: the DTensor leaves of the state it was restored into, rebuilt around their shards.
        """
        path = self.part(step)
        data = local_shards.join(load(path, comm=self._comm), layouts)
        metadata = {k: v for k, v in read_manifest(path).metadata.items() if k != local_shards.BOXES_KEY}
        return LocalCopy(step, path, data, metadata)  # the user's metadata, as the shared checkpoint gets it

    def held(self) -> frozenset[int]:
        """Steps of which this rank holds a committed part for the current world size.

        Leftovers of a save cut off by a crash (staging directories) are
        removed on the way; an unreadable part is not held.
        """
        steps = set()
        for step in self._steps_on_disk():
            path = self.part(step)
            if not os.path.isdir(path) and not _has_leftovers(path):
                continue
            try:
                recover(path)
                read_manifest(path)
            except (TddistError, OSError) as e:
                logger.info("rank %d: local part %s is not committed or unreadable: %s", self.rank, path, e)
                continue
            steps.add(step)
        return frozenset(steps)

    def load_into(self, step: int, into: Any, load_kwargs: Mapping[str, Any]) -> Restoring:
        """Fill ``into`` with this rank's part of ``step`` (the rows this rank saved; a DTensor's local shard)."""
        plain, layouts = local_shards.split(into)  # the local tensors of its DTensors, filled in place
        report = load(self.part(step), comm=self._comm, into=plain, **load_kwargs)
        assert isinstance(report, LoadReport)  # load(into=...) returns its report
        return Restoring(report, layouts)

    def drop(self, steps: frozenset[int]) -> None:
        """Delete this rank's parts of ``steps`` (of any world size, with their copy records), and each step
        directory left empty.

        A part that cannot be deleted is logged and left: retention never fails a save.
        """
        for step in steps:
            step_dir = os.path.join(self.directory, step_name(step))
            try:
                names = os.listdir(step_dir)
            except FileNotFoundError:
                continue
            for name in names:
                m = _PART_RE.match(name.split(".tddist-")[0].removesuffix(RECORD_SUFFIX).lstrip("."))
                if m is None or int(m.group(1)) != self.rank:
                    continue
                try:
                    remove_tree(os.path.join(step_dir, name))
                except OSError as e:
                    logger.warning("rank %d: could not delete local part %s: %s", self.rank, name, e)
                else:
                    logger.info("rank %d: dropped its local part %s of step %d", self.rank, name, step)
            try:
                os.rmdir(step_dir)  # only once every rank sharing this directory dropped its part
            except OSError:
                pass

    def on_disk(self) -> frozenset[int]:
        """Steps with a directory under ``directory`` (whatever they hold)."""
        return frozenset(self._steps_on_disk())

    def _steps_on_disk(self) -> list[int]:
        try:
            names = os.listdir(self.directory)
        except FileNotFoundError:
            return []
        return sorted(s for s in map(parse_step, names) if s is not None)


def _has_leftovers(path: str) -> bool:
    parent, name = os.path.split(path)
    try:
        return any(n.startswith(f".{name}.tddist-") for n in os.listdir(parent))
    except FileNotFoundError:
        return False


def complete_steps(comm: Communicator, tier: LocalTier) -> frozenset[int]:
    """The steps of which every rank of ``comm`` holds its part (collective: one allgather).

    Every rank returns the same set; a rank without a part of a step (another
    node's disk, a lost ``local_dir``, another world size) makes the step
    incomplete everywhere.
    """
    holdings: list[Holding] = comm.allgather(Holding(comm.rank, tier.held()))
    steps = frozenset.intersection(*(h.steps for h in holdings))
    return frozenset(steps)
