"""An incremental save (``save(..., base=...)``) to a directory on object storage (docs/format.md 13.3).

As on a file system (``storage.incremental``), each rank reads its base's
manifest, hashes every chunk it stores once (checksum, counts, XXH3-128) and
references the chunks whose bytes its base's holder has. An object has no
holes: the rank's data object keeps only the chunks it writes, at the offsets
``locate.kept_offsets`` derives (``packed_offsets`` with 0 for every
referenced chunk), so a save uploads only what changed. A base must be
another checkpoint beside the target in the same bucket (``arguments``
refuses one in another bucket); a base the rank cannot read, or of another
layout, makes it write every chunk, as on a file system.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import cast

import numpy as np

from ... import format as fmt
from ...checksum import tensor_bytes
from ...core.types import Holder, Key, SaveItem, StoredBytes
from ...errors import TargetError, TddistError
from ...manifest.locate import Location, Locator, kept_offsets, packed_offsets
from .. import incremental
from ..incremental import RankBase, exact_largest, judged, view_of
from ..opened import ChunkFiles, OpenedCheckpoint, Pin, validate
from .files import S3Files
from .holds import DELETION_LEASE, being_deleted
from .pin import S3Pin, open_s3, place_kept
from .url import parse

logger = logging.getLogger(__name__)


def open_object(prefix: str) -> OpenedCheckpoint:
    """The committed checkpoint at ``prefix`` on object storage, opened with its chunks' reader."""
    return place_kept(validate(open_s3(prefix), _reader))


def _reader(pin: Pin) -> ChunkFiles:
    return S3Files(cast(S3Pin, pin))


def eligible(base: str, target: str) -> str | None:
    """Why ``base`` cannot hold references of a save to ``target`` (None: it can): it must be another
    checkpoint beside the target (the same parent prefix of the same bucket)."""
    if base.rstrip("/") == target:
        return "it is the target itself, which this save replaces"
    name = base.rstrip("/").rsplit("/", 1)[-1]
    if fmt.holder_path(target, name) != base.rstrip("/"):
        return "it does not lie beside the target (under the same parent prefix)"
    return None


def read_base(base: str, target: str, rank: int, items: Sequence[SaveItem]) -> RankBase | None:
    """This rank's view of ``base`` on object storage (None: nothing of it may be referenced, said in the log)."""
    name = parse(base).key.rsplit("/", 1)[-1]
    return view_of(base, target, rank, items, eligible(base, target), open_object, name)


@dataclass(frozen=True)
class Decided:
    """What an incremental rank stores, per chunk it writes (in leaf order): its key and bytes, and where it
    lies in the data file of section 2.3 (``full``) and in the data object (``kept``); per key its record,
    its holder (0: uploaded) and its identity; and the data object's size.
    """

    keys: list[Key]
    datas: list[np.ndarray]
    full: np.ndarray
    kept: np.ndarray
    size: int
    stored: dict[Key, StoredBytes] = field(default_factory=dict)
    holders: dict[Key, int] = field(default_factory=dict)
    ids: dict[Key, int] = field(default_factory=dict)


def decide(items: Sequence[SaveItem], rank: int, target: str, view: RankBase | None, reuse: bool) -> Decided:
    """Hash every chunk this rank writes and decide which its base's holders have (equal identities, or equal
    bytes where the base recorded none); place the others in the data object."""
    written = [i for i in items if i.writes]
    datas = [tensor_bytes(i.tensor) for i in written]
    nbytes = np.array([a.size for a in datas], dtype=np.int64)
    full, full_size = packed_offsets(nbytes)
    chunks, holders = [], {}
    compare = _Holders(target, view, rank, int(full_size))
    try:
        for item, data, offset in zip(written, datas, full.tolist()):
            known = None if view is None else view.chunks.get(item.key)
            same = functools.partial(compare.same_bytes, key=item.key, offset=offset, data=data)
            chunk, holders[item.key] = judged(item, data, known, rank if reuse else None, same)
            chunks.append(chunk)
    finally:
        compare.close()
    chunks = exact_largest(written, datas, chunks, 0.0 if view is None else view.largest)
    stored = {i.key: c.stored for i, c in zip(written, chunks)}
    ids = {i.key: c.identity for i, c in zip(written, chunks)}
    kept, size = kept_offsets(nbytes, np.array([holders[i.key] for i in written], dtype=np.int64))
    return Decided([i.key for i in written], datas, full, kept, int(size), stored, holders, ids)


class _Holders:
    """The base's holders of this rank's chunks: which one has a chunk's bytes, comparing bytes (fetched from
    the holder, opened once at its recorded generation) only where the base recorded no identity."""

    def __init__(self, target: str, view: RankBase | None, rank: int, full_size: int) -> None:
        self.target, self.view, self.rank, self.full_size = target, view, rank, full_size
        self.opened: dict[int, OpenedCheckpoint | None] = {}
        self.files: dict[int, S3Files] = {}

    def same_bytes(self, h: int, key: Key, offset: int, data: np.ndarray) -> bool:
        opened = self._open(h)
        if opened is None:
            return False
        m = opened.manifest
        if m.layout == "directory":  # the same layout on this rank: the same offsets
            loc = Location(fmt.rank_data_name(self.rank), offset, int(data.size), self.full_size)
        else:
            leaf = m.leaves[key]
            i = leaf.table.index_of_rank(self.rank)
            assert i is not None
            loc = Locator(m).locate(leaf, leaf.table.chunk(i))
        try:
            held = self.files[h].span(loc).numpy()
        except TddistError as e:
            logger.warning("rank %d: cannot read %s of a holder (%s); it is written", self.rank, list(key), e)
            return False
        return bool(np.array_equal(held, data.view(np.uint8).reshape(-1)))

    def _open(self, h: int) -> OpenedCheckpoint | None:
        if h not in self.opened:
            assert self.view is not None
            holder = self.view.table[h - 1]
            path = fmt.holder_path(self.target, holder.name)
            try:
                opened: OpenedCheckpoint | None = open_object(path)
            except TddistError as e:
                logger.warning("rank %d: cannot read holder %s (%s); its chunks are written", self.rank, path, e)
                opened = None
            if opened is not None and opened.generation != holder.generation:
                opened.close()
                opened = None
            if opened is not None:
                self.files[h] = S3Files(cast(S3Pin, opened.pin))
            self.opened[h] = opened
        return self.opened[h]

    def close(self) -> None:
        for opened in self.opened.values():
            if opened is not None:
                opened.close()


def check_holders(target: str, table: tuple[Holder, ...]) -> None:
    """(rank 0, before the commit, its pins made) No holder is being deleted, then ``incremental.check_holders``:
    each still has the generation the ranks read. In this order: a deletion that marks after the first check
    finds the pin (``holds``).

    Raises:
        TargetError: a holder is being deleted, missing or replaced: nothing is committed; save again.
    """
    for h in table:
        path = fmt.holder_path(target, h.name)
        if being_deleted(path):
            raise TargetError(
                f"rank 0: {path}, which this incremental save references, is being deleted by a clean-up (a "
                f"marker {fmt.deletions_prefix(h.name)}... lies beside it, younger than {DELETION_LEASE:.0f} s); "
                f"nothing was committed: save again, with another base or once the clean-up is done"
            )
    incremental.check_holders(target, table, open_object)
