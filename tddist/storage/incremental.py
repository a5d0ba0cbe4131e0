"""One rank's side of an incremental save (``save(..., base=...)``) to a packed directory.

The rank reads its base's manifest, decides which of its chunks it may
reference (``read_base``), hashes every chunk it stores once for its checksum,
its counts and its identity (XXH3-128), and writes only the chunks whose
identity differs from the base's (``write_packed_incremental``). A
referenced chunk's range of the data file is left unwritten (a hole): every
offset stays the one section 2.3 derives, and a reader takes those bytes
from the holder's data file of the same rank, at the same offset.

A packed directory's chunk may be referenced only when this rank's data file
in the base has exactly the layout of its data file now (the same leaves, in
the same order, each with a chunk of the same size here; a DTensor chunk the
same box): the holder's offsets are then this checkpoint's. An archive's
chunk may be referenced when it is of the same leaf, dtype and size (a
DTensor chunk the same box): a reader finds it in the archive's entry.
Anything else is written.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from .. import format as fmt
from .._faults import fault_point
from .._fs import WRITE_STEP, write_and_start_writeback
from ..checksum import EMPTY, identify, tensor_bytes
from ..core.finite import counter_for
from ..core.types import Holder, Key, SaveItem, StoredBytes
from ..errors import TargetError, TddistError
from ..manifest.locate import Location, packed_offsets
from ..manifest.model import Leaf, Manifest
from ..manifest.refs import id_pair
from .opened import ChunkFiles, OpenedCheckpoint, Pin, validate
from .pinned import open_local

logger = logging.getLogger(__name__)

_U8 = np.dtype("<u8")


@dataclass(frozen=True, slots=True)
class BaseChunk:
    """What the base holds of one of this rank's chunks.

    Attributes:
        holder: which holder of the new manifest's table has its bytes (1: the base itself).
        checksum: its checksum, as an integer.
        identity: its XXH3-128, or None when the base recorded none (a checkpoint saved without a base): the
            bytes are then compared.
    """

    holder: int
    checksum: int
    identity: int | None


@dataclass(frozen=True)
class RankBase:
    """What this rank may reference of its base.

    Attributes:
        path: the base checkpoint (a directory beside the target).
        table: the holders a reference may name, numbered from 1: the base, then the base's own holders.
        chunks: this rank's chunks that may be referenced, by key.
    """

    path: str
    table: tuple[Holder, ...]
    chunks: dict[Key, BaseChunk]


@dataclass(frozen=True)
class IncrementalStored:
    """What an incremental write stored: per key its bytes' record, where its bytes are, and its identity.

    Attributes:
        stored: each written or referenced chunk's size, checksum and counts (as ``write_packed`` returns).
        holders: per key, the holder of its bytes (0: written here).
        ids: per key, the chunk's XXH3-128.
        written: the bytes written to the data file.
    """

    stored: dict[Key, StoredBytes]
    holders: dict[Key, int]
    ids: dict[Key, int]
    written: int


def eligible_base(base: str, target: str) -> str | None:
    """Why ``base`` cannot hold references of a save to ``target`` (None: it can): it must be another
    directory beside the target (references name a holder by its name in the same parent directory)."""
    b, t = os.path.abspath(base), os.path.abspath(target)
    if b == t:
        return "it is the target itself, which this save replaces"
    if os.path.dirname(b) != os.path.dirname(t):
        return "it does not lie beside the target (in the same directory)"
    if not (os.path.isdir(b) or (b.endswith(fmt.ARCHIVE_SUFFIX) and os.path.isfile(b))):
        return "it is not a directory checkpoint or an archive"
    return None


def open_manifest(path: str) -> OpenedCheckpoint:
    """The committed directory checkpoint at ``path`` pinned, with its validated manifest (its chunks are read
    through the pin's own files here, never through ``files()``)."""
    return validate(open_local(path), _no_reader)


def _no_reader(pin: Pin) -> ChunkFiles:
    raise NotImplementedError("an incremental save reads its base's data files through the pin")


def read_base(base: str, target: str, rank: int, items: Sequence[SaveItem]) -> RankBase | None:
    """This rank's view of ``base`` (None: nothing of it may be referenced, said in the log)."""
    why = eligible_base(base, target)
    if why is not None:
        logger.info("rank %d: base %s holds no references of %s: %s; every chunk is written", rank, base, target, why)
        return None
    try:
        with open_manifest(base) as opened:
            m, generation = opened.manifest, opened.generation
    except TddistError as e:
        logger.warning("rank %d: cannot read base %s (%s); every chunk is written", rank, base, e)
        return None
    return base_view(m, generation, base, os.path.basename(os.path.abspath(base)), rank, items)


def base_view(
    m: Manifest, generation: str, base: str, name: str, rank: int, items: Sequence[SaveItem]
) -> RankBase | None:
    """What this rank may reference of the base ``m`` (at ``generation``, named ``name`` beside the target):
    a packed directory's chunks where this rank's data file has its layout, an archive's of the same size."""
    if m.layout == "directory" and m.packing != "packed":
        logger.info("rank %d: base %s is a directory of packing memmap; every chunk is written", rank, base)
        return None
    table = (Holder(name, generation), *m.referenced())
    chunks = _same_layout(m, rank, items) if m.layout == "directory" else _same_chunks(m, rank, items)
    return RankBase(base, table, chunks)


def _same_chunks(m: Manifest, rank: int, items: Sequence[SaveItem]) -> dict[Key, BaseChunk]:
    """An archive base: this rank's chunks of ``m`` by key, each of the same leaf, dtype and size (a DTensor's
    the same box): a reader finds it in the archive's entry of that leaf and rank."""
    out: dict[Key, BaseChunk] = {}
    if rank >= m.world_size:
        return out
    for item in items:
        leaf = m.leaves.get(item.key)
        nbytes = item.tensor.numel() * item.tensor.element_size()
        i = None if leaf is None else leaf.table.index_of_rank(rank)
        if not item.writes or not nbytes or leaf is None or i is None:
            continue
        chunk = leaf.table.chunk(i)
        if leaf.dtype_name != fmt.dtype_name(item.tensor.dtype) or chunk.nbytes != nbytes:
            continue
        if item.dtensor is not None and tuple(map(tuple, chunk.box)) != tuple(map(tuple, item.dtensor.box)):
            continue
        out[item.key] = _base_chunk(leaf, i, int(chunk.checksum, 16))
    return out


def _base_chunk(leaf: Leaf, i: int, checksum: int) -> BaseChunk:
    """Chunk ``i`` of the base's ``leaf``: its holder in the new table, its checksum and identity."""
    ident = None
    if leaf.refs is not None:
        lo, hi = (int(x) for x in leaf.refs.ids[i])
        ident = lo | (hi << 64)
    return BaseChunk(leaf.holder_of(i) + 1, checksum, ident)


def _same_layout(m: Manifest, rank: int, items: Sequence[SaveItem]) -> dict[Key, BaseChunk]:
    """This rank's chunks of ``m`` by key, when its data file there has the layout it has now; else none."""
    if rank >= m.world_size or list(m.leaves) != [i.key for i in items]:
        return {}
    out: dict[Key, BaseChunk] = {}
    for item in items:
        leaf = m.leaves[item.key]
        nbytes = item.tensor.numel() * item.tensor.element_size() if item.writes else 0
        if leaf.dtype_name != fmt.dtype_name(item.tensor.dtype) or leaf.table.nbytes_of_rank(rank) != nbytes:
            return {}
        i = leaf.table.index_of_rank(rank)
        if not nbytes or i is None:
            continue
        chunk = leaf.table.chunk(i)
        if item.dtensor is not None and tuple(map(tuple, chunk.box)) != tuple(map(tuple, item.dtensor.box)):
            return {}
        out[item.key] = _base_chunk(leaf, i, int(chunk.checksum, 16))
    return out


@dataclass(frozen=True)
class _Seen:
    """A chunk as this process last hashed it: the tensor (kept alive, so no other tensor can take its memory),
    its version counter and address then, and what hashing it gave."""

    tensor: torch.Tensor
    version: int
    address: int
    stored: StoredBytes
    identity: int

    def unchanged(self, t: torch.Tensor) -> bool:
        """Whether ``t`` is this chunk's memory, changed by no in-place operation since it was hashed."""
        return (
            t.data_ptr() == self.address
            and t.numel() * t.element_size() == self.stored.nbytes
            and int(t._version) == self.version == int(self.tensor._version)
            and t.untyped_storage().data_ptr() == self.tensor.untyped_storage().data_ptr()
        )


#: Per rank and key, each chunk of the last incremental save of this process (``SaveOptions.reuse_hashes``): a
#: frozen leaf (the same memory, its version counter unchanged) is not hashed again. A change the version
#: counter does not see (through ``.data``, by another process) is not seen either, as with deferred snapshots.
_SEEN: dict[tuple[int, Key], _Seen] = {}
_SEEN_LOCK = threading.Lock()


def write_packed_incremental(
    path: str, items: Sequence[SaveItem], rank: int, base: RankBase | None, reuse: bool = False
) -> IncrementalStored:
    """Write this rank's data file (packing "packed"), durably, leaving out the chunks the base holds.

    Every chunk is hashed once (checksum, counts, identity); one equal to its
    base chunk (equal identities, or equal bytes where the base recorded no
    identity) is not written and is recorded as the base's holder's.
    """
    written = [i for i in items if i.writes]
    datas = [tensor_bytes(i.tensor) for i in written]
    offsets, end = packed_offsets(np.array([a.size for a in datas], dtype=np.int64))
    result = IncrementalStored({}, {}, {}, 0)
    holders = _HolderFiles(base, rank)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    try:
        os.ftruncate(fd, int(end))  # referenced ranges stay holes
        total = 0
        for n, (item, data, offset) in enumerate(zip(written, datas, offsets.tolist())):
            if n == len(written) // 2:
                fault_point("midwrite", rank)
            if not _identify(item, data, holders, offset, result, rank if reuse else None) and data.size:
                os.posix_fallocate(fd, offset, int(data.size))
                write_and_start_writeback(fd, memoryview(data.data).cast("B"), offset, WRITE_STEP)
                total += int(data.size)
        os.fsync(fd)
    finally:
        os.close(fd)
        holders.close()
    return IncrementalStored(result.stored, result.holders, result.ids, total)


def hashed(item: SaveItem, data: np.ndarray, rank: int | None) -> tuple[StoredBytes, int]:
    """``item``'s chunk's record and identity: hashed, or remembered from this process's last incremental save
    of rank ``rank`` (None: not remembered) when the tensor is unchanged since."""
    rank = rank if item.own_memory else None  # a copy made for this save is new every time: never kept
    seen = None if rank is None else _SEEN.get((rank, item.key))
    if seen is not None and seen.unchanged(item.tensor):
        return seen.stored, seen.identity
    version = int(item.tensor._version)
    counter = counter_for(fmt.dtype_name(item.tensor.dtype))
    checksum, ident = identify(data, counter) if data.size else (EMPTY, 0)
    stored = StoredBytes(int(data.size), checksum, None if counter is None else counter.result())
    if rank is not None and data.size:
        with _SEEN_LOCK:
            _SEEN[(rank, item.key)] = _Seen(item.tensor, version, item.tensor.data_ptr(), stored, ident)
    return stored, ident


def _identify(
    item: SaveItem, data: np.ndarray, holders: _HolderFiles, offset: int, out: IncrementalStored, rank: int | None
) -> int:
    """Hash ``item``'s chunk into ``out``; return its holder when the base holds equal bytes (else 0)."""
    stored, ident = hashed(item, data, rank)
    checksum = stored.checksum
    out.stored[item.key] = stored
    out.ids[item.key] = ident
    known = holders.known(item.key)
    held = 0
    if known is not None and data.size and known.checksum == int(checksum, 16):
        if known.identity is not None:
            held = known.holder if known.identity == ident else 0
        elif holders.same_bytes(known.holder, item.key, offset, data):
            held = known.holder
    out.holders[item.key] = held
    return held


class _HolderFiles:
    """This rank's chunks in each holder, opened once (at its recorded generation) when a base without
    identities makes a comparison of bytes necessary: a packed directory's data file of this rank, or an
    archive's entries."""

    def __init__(self, base: RankBase | None, rank: int) -> None:
        self.base, self.rank = base, rank
        self.opened: dict[int, _Holder | None] = {}

    def known(self, key: Key) -> BaseChunk | None:
        return None if self.base is None else self.base.chunks.get(key)

    def same_bytes(self, holder: int, key: Key, offset: int, data: np.ndarray) -> bool:
        """Whether holder ``holder``'s bytes of this rank's chunk of ``key`` (at ``offset`` of a packed data
        file of this checkpoint's layout) equal ``data``."""
        if holder not in self.opened:
            self.opened[holder] = self._open(holder)
        found = self.opened[holder]
        return found is not None and found.equal(key, self.rank, offset, data)

    def _open(self, holder: int) -> _Holder | None:
        assert self.base is not None
        h = self.base.table[holder - 1]
        path = os.path.join(os.path.dirname(os.path.abspath(self.base.path)), h.name)
        try:
            return _Holder.open(path, h.generation, self.rank)
        except (TddistError, OSError) as e:
            logger.warning("rank %d: cannot read holder %s (%s); its chunks are written", self.rank, path, e)
            return None

    def close(self) -> None:
        for found in self.opened.values():
            if found is not None:
                found.close()


@dataclass
class _Holder:
    """One holder, opened for comparisons: a packed directory's data file (``fd``) or an archive's entries."""

    manifest: Manifest
    fd: int = -1
    archive: Any = None  # ``archive.ArchiveFiles``

    @staticmethod
    def open(path: str, generation: str, rank: int) -> _Holder | None:
        from .archive import ArchiveFiles
        from .pinned import PinnedCheckpoint

        with open_manifest(path) as opened:
            pin, m = opened.pin, opened.manifest
            if opened.generation != generation:
                return None
            if m.layout == "archive":
                return _Holder(m, archive=ArchiveFiles(path))
            fd = pin.open_file(fmt.rank_data_name(rank)) if isinstance(pin, PinnedCheckpoint) else None
        return None if fd is None else _Holder(m, fd=fd)

    def equal(self, key: Key, rank: int, offset: int, data: np.ndarray) -> bool:
        view = memoryview(data.data).cast("B")
        if self.archive is not None:
            rel = fmt.leaf_relpath(rank, key, self.manifest.robust_key)
            held = self.archive.span(Location(rel, 0, len(view), len(view))).numpy()
            return bool(np.array_equal(held, data))
        for lo in range(0, len(view), fmt.CHECKSUM_BLOCK):
            block = view[lo : lo + fmt.CHECKSUM_BLOCK]
            if os.pread(self.fd, len(block), offset + lo) != block:
                return False
        return True

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


def identity_columns(ids: list[int]) -> bytes:
    """A vote's identities (``Fragment.ids``): two uint64 per leaf, low half first."""
    return np.asarray([id_pair(i) for i in ids], dtype=_U8).reshape(-1, 2).tobytes()


def check_holders(target: str, table: tuple[Holder, ...]) -> None:
    """(rank 0, before the commit) Every holder a save to ``target`` may reference is there, at the generation
    its ranks read.

    Raises:
        TargetError: one is missing or was replaced since (deleted by a clean-up that ran before the pins):
            nothing is committed; save again.
    """
    for h in table:
        path = fmt.holder_path(target, h.name)
        try:
            with open_manifest(path) as opened:
                gen = opened.generation
        except TddistError as e:
            gen = f"unreadable ({e})"
        if gen != h.generation:
            raise TargetError(
                f"rank 0: {path}, which this incremental save references, changed during the save (generation "
                f"{h.generation}, now {gen}); nothing was committed: save again"
            )
