"""One rank's side of an incremental save (``save(..., base=...)``) to a packed directory.

The rank reads its base's manifest, decides which of its chunks it may
reference (``read_base``), and writes only the chunks whose identity
(XXH3-128) differs from the base's (``write_packed_incremental``). A chunk
whose base recorded an identity and counts is first hashed for its identity
alone, one pass: when it equals the base's, its checksum and counts are the
base's (the same bytes), so the checksum and the counts are computed only for
the chunks written. Chunks are hashed and written on ``num_threads`` threads. A
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

import functools
import logging
import os
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import xxhash

from .. import format as fmt
from .._faults import fault_point
from .._fs import WRITE_STEP, write_and_start_writeback
from ..checksum import EMPTY, blocks, combine_digests, digest_visiting, identify, tensor_bytes
from ..core.finite import ChunkStats, counter_for, is_floating
from ..core.types import Holder, Key, SaveItem, StoredBytes
from ..errors import TargetError, TddistError
from ..manifest.chunks import hex_checksum
from ..manifest.locate import Location, packed_offsets
from ..manifest.model import Leaf, Manifest
from ..manifest.refs import id_pair
from .opened import ChunkFiles, OpenedCheckpoint, Pin, validate
from .pinned import open_local
from .writer import run_all

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
    stats: Inherited | None = None


@dataclass(frozen=True, slots=True)
class Inherited:
    """What a referenced chunk takes from its base without reading its bytes again: the counts of its
    non-finite values, recorded per chunk, and its largest finite magnitude where the base recorded it (only
    one chunk a rank: the one holding the rank's largest, ``exact``; any other chunk's is at most
    ``RankBase.largest``, and is counted again only when that bound matters, ``rank_largest``).
    ``stats`` is None for a leaf that is not floating (nothing counted)."""

    stats: ChunkStats | None
    exact: bool


@dataclass(frozen=True)
class RankBase:
    """What this rank may reference of its base.

    Attributes:
        path: the base checkpoint (a directory beside the target).
        table: the holders a reference may name, numbered from 1: the base, then the base's own holders.
        chunks: this rank's chunks that may be referenced, by key.
        largest: this rank's largest finite magnitude in the base (0.0: none recorded), a bound of every
            inherited chunk's.
    """

    path: str
    table: tuple[Holder, ...]
    chunks: dict[Key, BaseChunk]
    largest: float = 0.0


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
    name = os.path.basename(os.path.abspath(base))
    return view_of(base, target, rank, items, eligible_base(base, target), open_manifest, name)


def view_of(
    base: str,
    target: str,
    rank: int,
    items: Sequence[SaveItem],
    why: str | None,
    opener: Callable[[str], OpenedCheckpoint],
    name: str,
) -> RankBase | None:
    """This rank's view of ``base``, opened by its store's ``opener`` and named ``name`` beside the target
    (None: nothing of it may be referenced: ``why`` it is not eligible, or it cannot be read; said in the log)."""
    if why is not None:
        logger.info("rank %d: base %s holds no references of %s: %s; every chunk is written", rank, base, target, why)
        return None
    try:
        with opener(base) as opened:
            m, generation = opened.manifest, opened.generation
    except TddistError as e:
        logger.warning("rank %d: cannot read base %s (%s); every chunk is written", rank, base, e)
        return None
    return base_view(m, generation, base, name, rank, items)


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
    return RankBase(base, table, chunks, _RankLargest.of(m, rank).value)


def _same_chunks(m: Manifest, rank: int, items: Sequence[SaveItem]) -> dict[Key, BaseChunk]:
    """An archive base: this rank's chunks of ``m`` by key, each of the same leaf, dtype and size (a DTensor's
    the same box): a reader finds it in the archive's entry of that leaf and rank."""
    out: dict[Key, BaseChunk] = {}
    if rank >= m.world_size:
        return out
    top = _RankLargest.of(m, rank)
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
        out[item.key] = _base_chunk(m, top, leaf, i, int(chunk.checksum, 16))
    return out


@dataclass(frozen=True, slots=True)
class _RankLargest:
    """A rank's largest finite magnitude in the base and the leaf holding it (None: none recorded)."""

    value: float
    key: Key | None

    @staticmethod
    def of(m: Manifest, rank: int) -> _RankLargest:
        if m.largest is None or rank >= len(m.largest.values) or int(m.largest.leaves[rank]) < 0:
            return _RankLargest(0.0, None)
        return _RankLargest(float(m.largest.values[rank]), list(m.leaves)[int(m.largest.leaves[rank])])


def _base_chunk(m: Manifest, top: _RankLargest, leaf: Leaf, i: int, checksum: int) -> BaseChunk:
    """Chunk ``i`` of the base ``m``'s ``leaf`` (``top``: its rank's largest): its holder in the new table, its
    checksum, identity and what it may inherit of its counts."""
    ident = None
    if leaf.refs is not None:
        lo, hi = (int(x) for x in leaf.refs.ids[i])
        ident = lo | (hi << 64)
    return BaseChunk(leaf.holder_of(i) + 1, checksum, ident, _inherited(m, top, leaf, i))


def _inherited(m: Manifest, top: _RankLargest, leaf: Leaf, i: int) -> Inherited | None:
    """What chunk ``i`` of ``leaf`` inherits of its counts; None: they were not recorded (a floating leaf of a
    base without counts), so a save counts them."""
    if not is_floating(leaf.dtype_name):
        return Inherited(None, True)
    if leaf.stats is None or m.largest is None:
        return None
    hit = np.flatnonzero(leaf.stats.chunks == i)
    nan, inf = (int(leaf.stats.nan[hit[0]]), int(leaf.stats.inf[hit[0]])) if len(hit) else (0, 0)
    exact = top.key == leaf.key
    return Inherited(ChunkStats(nan, inf, top.value if exact else 0.0), exact)


def _same_layout(m: Manifest, rank: int, items: Sequence[SaveItem]) -> dict[Key, BaseChunk]:
    """This rank's chunks of ``m`` by key, when its data file there has the layout it has now; else none."""
    if rank >= m.world_size or list(m.leaves) != [i.key for i in items]:
        return {}
    top = _RankLargest.of(m, rank)
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
        out[item.key] = _base_chunk(m, top, leaf, i, int(chunk.checksum, 16))
    return out


@dataclass(frozen=True, slots=True)
class HashedChunk:
    """What hashing one chunk gave: its record (size, checksum, counts), its identity, and whether the counts'
    largest magnitude is the chunk's own (``exact``) or a placeholder of 0.0 for an inherited chunk whose
    largest is bounded by its base's (``Inherited``)."""

    stored: StoredBytes
    identity: int
    exact: bool = True


@dataclass(frozen=True)
class _Seen:
    """A chunk as this process last hashed it: the tensor (kept alive, so no other tensor can take its memory),
    its version counter and address then, and what hashing it gave."""

    tensor: torch.Tensor
    version: int
    address: int
    chunk: HashedChunk

    def unchanged(self, t: torch.Tensor) -> bool:
        """Whether ``t`` is this chunk's memory, changed by no in-place operation since it was hashed."""
        return (
            t.data_ptr() == self.address
            and t.numel() * t.element_size() == self.chunk.stored.nbytes
            and int(t._version) == self.version == int(self.tensor._version)
            and t.untyped_storage().data_ptr() == self.tensor.untyped_storage().data_ptr()
        )


#: Per rank and key, each chunk of the last incremental save of this process (``SaveOptions.reuse_hashes``): a
#: frozen leaf (the same memory, its version counter unchanged) is not hashed again. A change the version
#: counter does not see (through ``.data``, by another process) is not seen either, as with deferred snapshots.
#: Only the chunks of a rank's last such save are kept (``_forget_others``): what they keep alive is that save's
#: state, which its caller holds anyway.
_SEEN: dict[tuple[int, Key], _Seen] = {}
_SEEN_LOCK = threading.Lock()


def _forget_others(rank: int, keys: set[Key]) -> None:
    """Forget what rank ``rank`` remembered of chunks other than ``keys`` (those of its save now)."""
    with _SEEN_LOCK:
        for k in [k for k in _SEEN if k[0] == rank and k[1] not in keys]:
            del _SEEN[k]


@dataclass(frozen=True, slots=True)
class _Outcome:
    """One chunk of an incremental write: what hashing gave, its holder (0: written here), the bytes written."""

    chunk: HashedChunk
    holder: int
    written: int


def write_packed_incremental(
    path: str, items: Sequence[SaveItem], rank: int, base: RankBase | None, reuse: bool = False, num_threads: int = 1
) -> IncrementalStored:
    """Write this rank's data file (packing "packed"), durably, leaving out the chunks the base holds.

    A chunk equal to its base chunk (equal identities, or equal bytes where
    the base recorded no identity) is not written and is recorded as the
    base's holder's; chunks are hashed and written on ``num_threads`` threads
    (the hashes and the positioned writes release the GIL). Chunks changed in
    place since they were made (a version counter above 0: trained leaves,
    optimizer state) go first, a guess of what is written, so that their
    writeback overlaps the hashing of the rest; the order changes no result.
    """
    written = [i for i in items if i.writes]
    datas = [tensor_bytes(i.tensor) for i in written]
    offsets, end = packed_offsets(np.array([a.size for a in datas], dtype=np.int64))
    outcomes: list[_Outcome | None] = [None] * len(written)
    holders = _HolderFiles(base, rank)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)

    def one(n: int, offset: int) -> None:
        if n == len(written) // 2:
            fault_point("midwrite", rank)
        outcomes[n] = _store(written[n], datas[n], holders, fd, int(offset), rank if reuse else None)

    try:
        os.ftruncate(fd, int(end))  # referenced ranges stay holes
        order = sorted(range(len(written)), key=lambda n: written[n].tensor._version == 0)
        run_all([functools.partial(one, n, offsets[n]) for n in order], num_threads)
        os.fsync(fd)
    finally:
        os.close(fd)
        holders.close()
    if reuse:
        _forget_others(rank, {i.key for i in written if i.own_memory})
    done = [o for o in outcomes if o is not None]
    chunks = exact_largest(written, datas, [o.chunk for o in done], 0.0 if base is None else base.largest)
    return IncrementalStored(
        {i.key: c.stored for i, c in zip(written, chunks)},
        {i.key: o.holder for i, o in zip(written, done)},
        {i.key: c.identity for i, c in zip(written, chunks)},
        sum(o.written for o in done),
    )


def _store(item: SaveItem, data: np.ndarray, holders: _HolderFiles, fd: int, offset: int, rank: int | None) -> _Outcome:
    """Hash ``item``'s chunk and write it at ``offset`` of ``fd`` unless the base holds equal bytes."""
    chunk, held = judged(
        item, data, holders.known(item.key), rank, lambda h: holders.same_bytes(h, item.key, offset, data)
    )
    if held or not data.size:
        return _Outcome(chunk, held, 0)
    os.posix_fallocate(fd, offset, int(data.size))
    write_and_start_writeback(fd, memoryview(data.data).cast("B"), offset, WRITE_STEP)
    return _Outcome(chunk, 0, int(data.size))


def judged(
    item: SaveItem, data: np.ndarray, known: BaseChunk | None, rank: int | None, same_bytes: Callable[[int], bool]
) -> tuple[HashedChunk, int]:
    """``item``'s chunk hashed (``hashed``) and the holder of equal bytes in its base (0: none, it is written):
    equal identities, or, where the base recorded none, equal bytes in holder ``h`` (``same_bytes(h)``). A chunk
    written is counted exactly (a remembered one may carry its base's bound)."""
    chunk = hashed(item, data, known, rank)
    held = 0
    if known is not None and data.size and known.checksum == int(chunk.stored.checksum, 16):
        if known.identity is not None:
            held = known.holder if known.identity == chunk.identity else 0
        elif same_bytes(known.holder):
            held = known.holder
    if not held and not chunk.exact:  # remembered as the base's chunk, which this is no longer: counted now
        chunk = _counted(item, data, chunk.identity)
    return chunk, held


def hashed(item: SaveItem, data: np.ndarray, known: BaseChunk | None, rank: int | None) -> HashedChunk:
    """``item``'s chunk's record and identity: remembered from this process's last incremental save of rank
    ``rank`` (None: not remembered) when the tensor is unchanged since; else its identity alone, when its base
    chunk recorded an identity and counts to inherit (one pass); else hashed and counted in full."""
    rank = rank if item.own_memory else None  # a copy made for this save is new every time: never kept
    seen = None if rank is None else _SEEN.get((rank, item.key))
    if seen is not None and seen.unchanged(item.tensor):
        return seen.chunk
    version = int(item.tensor._version)
    if known is None or known.identity is None or known.stats is None or not data.size:
        chunk = _counted(item, data)
    else:
        ident = xxhash.xxh3_128_intdigest(data.data)
        if ident == known.identity:
            chunk = HashedChunk(StoredBytes(int(data.size), hex_checksum(known.checksum), known.stats.stats), ident,
                                known.stats.exact)  # fmt: skip
        else:
            chunk = _counted(item, data, ident)
    if rank is not None and data.size:
        with _SEEN_LOCK:
            _SEEN[(rank, item.key)] = _Seen(item.tensor, version, item.tensor.data_ptr(), chunk)
    return chunk


def _counted(item: SaveItem, data: np.ndarray, ident: int | None = None) -> HashedChunk:
    """``item``'s chunk hashed (checksum and, unless ``ident`` already is, identity) and counted, in one pass."""
    counter = counter_for(fmt.dtype_name(item.tensor.dtype))
    if not data.size:
        checksum, ident = EMPTY, 0
    elif ident is None:
        checksum, ident = identify(data, counter)
    else:
        checksum = combine_digests([digest_visiting(b, counter) for b in blocks(data)])
    return HashedChunk(StoredBytes(int(data.size), checksum, None if counter is None else counter.result()), ident)


def exact_largest(
    items: Sequence[SaveItem], datas: Sequence[np.ndarray], chunks: Sequence[HashedChunk], bound: float
) -> list[HashedChunk]:
    """Each chunk's record with the rank's largest magnitude exact: an inherited chunk's largest is at most
    ``bound`` (its base's rank's), so when a chunk counted here reaches ``bound`` it is the rank's largest
    whatever the inherited ones hold; only otherwise are those counted (one more pass over them)."""
    top = max((c.stored.stats.max_abs for c in chunks if c.exact and c.stored.stats is not None), default=0.0)
    if top >= bound or all(c.exact for c in chunks):
        return list(chunks)
    return [c if c.exact else _counted(i, d) for i, d, c in zip(items, datas, chunks)]


class _HolderFiles:
    """This rank's chunks in each holder, opened once (at its recorded generation) when a base without
    identities makes a comparison of bytes necessary: a packed directory's data file of this rank, or an
    archive's entries."""

    def __init__(self, base: RankBase | None, rank: int) -> None:
        self.base, self.rank = base, rank
        self.opened: dict[int, _Holder | None] = {}
        self.lock = threading.Lock()  # chunks are compared from several threads

    def known(self, key: Key) -> BaseChunk | None:
        return None if self.base is None else self.base.chunks.get(key)

    def same_bytes(self, holder: int, key: Key, offset: int, data: np.ndarray) -> bool:
        """Whether holder ``holder``'s bytes of this rank's chunk of ``key`` (at ``offset`` of a packed data
        file of this checkpoint's layout) equal ``data``."""
        with self.lock:
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


def check_holders(
    target: str, table: tuple[Holder, ...], opener: Callable[[str], OpenedCheckpoint] = open_manifest
) -> None:
    """(rank 0, before the commit) Every holder a save to ``target`` may reference is there, at the generation
    its ranks read (each opened by its store's ``opener``).

    Raises:
        TargetError: one is missing or was replaced since (deleted by a clean-up that ran before the pins, or on
            object storage at any time before this check): nothing is committed; save again.
    """
    for h in table:
        path = fmt.holder_path(target, h.name)
        try:
            with opener(path) as opened:
                gen = opened.generation
        except TddistError as e:
            gen = f"unreadable ({e})"
        if gen != h.generation:
            raise TargetError(
                f"rank 0: {path}, which this incremental save references, changed during the save (generation "
                f"{h.generation}, now {gen}); nothing was committed: save again"
            )
