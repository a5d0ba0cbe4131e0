"""Checking a committed checkpoint, chunk by chunk, and reporting every problem found.

``verify(path)`` checks every stored chunk of a directory or archive
checkpoint against its manifest and, unless ``quick``, that its bytes match
its checksum. Where a chunk's bytes are is ``locate.Locator``'s business:
a span of its rank's data file (packing "packed", the default of format
version 2), a file of its own (packing "memmap": version 1 and
``layout="memmap"``) or an archive entry. ``quick`` reads no data: it checks
that every file exists, is a regular file inside the checkpoint and has the
size the manifest implies (a rank's data file: the sum of its chunks, each
padded to ``format.PACK_ALIGN``). Unlike ``load(..., verify=True)``, which
stops at the first bad chunk, it goes on and returns a ``VerifyReport``
listing all of them.
"""

from __future__ import annotations

import errno
import logging
import os
import stat
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import numpy as np

from .. import format as fmt
from .._fs import is_inside
from ..checksum import EMPTY, block_digest, blocks, combine_digests
from ..errors import CorruptCheckpointError, InvalidArgumentError, ManifestError, StorageError
from ..manifest.chunks import ChunkColumns, ReplicaChunks, int_checksum
from ..manifest.locate import Location, Locator
from ..manifest.model import Chunk, Leaf, Manifest
from ..manifest.whole import file_offsets
from ..storage.backends import S3_SCHEME, read_manifest, target_of
from .report import (  # noqa: F401  (re-exported: the public names of verify)
    CHECKSUM,
    HOLDER,
    MISSING,
    NOT_A_FILE,
    SIZE,
    STRUCTURE,
    UNREADABLE,
    Problem,
    VerifyReport,
    chunk_count,
    leaf_nbytes,
    stored_bytes,
)

logger = logging.getLogger(__name__)


def data_file_sizes(manifest: Manifest) -> np.ndarray:
    """The size of every rank's data file (packing "packed"), for all ranks at once (int64[world_size])."""
    return file_offsets(manifest).offsets[-1].copy()  # its last row: each file's size (one cumulative sum)


def verify(
    path: str | os.PathLike,
    *,
    quick: bool = False,
    num_threads: int = 2,
    progress: Callable[[int], None] | None = None,
) -> VerifyReport:
    """Check every chunk of the committed checkpoint at ``path``; return all problems found.

    Args:
        path: a checkpoint directory or ``.tdz`` archive, or one on object storage (``s3://``: its chunks are
            read back through the store; ``quick`` then checks the manifest and the holders).
        quick: check only that every file (a rank's data file, a chunk's file,
            an archive entry) exists with the size the manifest implies, and the
            archive's structure; read no data.
        num_threads: threads that read and hash (1: the calling thread only).
        progress: called with the number of bytes just checked, as the check goes.

    Returns:
        A ``VerifyReport``; ``report.ok`` is True when nothing is wrong.

    Raises:
        CheckpointNotFoundError: nothing committed is at ``path``.
        ManifestError: the manifest (or its index) is unreadable or invalid
            (nothing else can be checked), or names more ranks than a packed
            directory of more than ``CHEAP_WORLD`` ranks holds entries.
        InvalidArgumentError: ``num_threads`` is not a positive int.
    """
    path = target_of(path)
    _check_threads(num_threads)
    return verify_manifest(path, read_manifest(path), quick=quick, num_threads=num_threads, progress=progress)


def verify_manifest(
    path: str | os.PathLike,
    manifest: Manifest,
    *,
    quick: bool = False,
    num_threads: int = 2,
    progress: Callable[[int], None] | None = None,
) -> VerifyReport:
    """``verify`` with the checkpoint's manifest already read (``read_manifest(path)``), so it is read once.

    Args:
        path: the checkpoint directory or ``.tdz`` archive ``manifest`` was read from.
        manifest: its manifest.
        quick, num_threads, progress: as for ``verify``.

    Returns:
        A ``VerifyReport``, as ``verify``.
    """
    path = target_of(path)
    _check_threads(num_threads)
    if path.startswith(S3_SCHEME):  # no files: every chunk read back through the store (``verify_objects``)
        from .verify_objects import verify_objects

        return verify_objects(path, quick=quick, num_threads=num_threads, progress=progress)
    archive = os.path.isfile(path)
    check = _Check(path, manifest, quick, progress)
    pool = ThreadPoolExecutor(num_threads, thread_name_prefix="tddist-verify") if num_threads > 1 else None
    check.pool = pool
    try:
        if archive:
            check.archive()
        elif manifest.packing == "packed":
            check.packed()
        else:
            check.memmap()
    finally:
        if pool is not None:
            pool.shutdown()
    return VerifyReport(
        path=path,
        mode="quick" if quick else "full",
        layout="archive" if archive else "directory",
        world_size=manifest.world_size,
        chunks=chunk_count(manifest),
        nbytes=stored_bytes(manifest),
        problems=tuple(check.problems),
        packing=manifest.packing,
        non_finite=tuple(manifest.non_finite()),
    )


def _check_threads(num_threads: object) -> None:
    if type(num_threads) is not int or num_threads < 1:
        raise InvalidArgumentError(f"num_threads must be a positive int, got {num_threads!r}")


_EMPTY_INT = int_checksum(EMPTY)
#: A world of up to this many ranks is checked rank by rank, whatever the directory holds (``_Check._check_world``).
CHEAP_WORLD = 4096


def _empty_chunks_with_bytes_hashed(leaf: Leaf, cols: ChunkColumns | None = None) -> list[int]:
    """The chunks of ``leaf`` that hold no bytes but whose checksum is not that of nothing (a damaged manifest)."""
    t = leaf.table
    if isinstance(t, ReplicaChunks):  # one chunk: no columns needed
        return [0] if not t.nbytes_of_rank(t.writer) and t.checksum != _EMPTY_INT else []
    cols = cols or t.columns()
    return np.flatnonzero((cols.nbytes == 0) & (cols.checksums != np.uint64(_EMPTY_INT))).tolist()


def _where(leaf: Leaf, chunk: Chunk) -> str:
    return f"leaf {list(leaf.key)} (written by rank {chunk.rank})"


@dataclass(frozen=True)
class _Held:
    """A holder of an incremental checkpoint, opened: its manifest and pin, and its chunks' reader."""

    opened: Any
    files: Any


class _Check:
    """One run of ``verify``: the checks of each packing, and the problems found."""

    def __init__(self, root: str, manifest: Manifest, quick: bool, progress: Callable[[int], None] | None):
        self.root, self.manifest, self.quick = root, manifest, quick
        self.real_root = os.path.realpath(root)
        self.spans = manifest.packing == "packed" and not os.path.isfile(root)  # chunks lie at offsets of files
        self.locator = Locator(manifest)
        self.keys = list(manifest.leaves)  # the leaves' keys, by position
        self.tick = progress or (lambda n: None)
        self.pool: ThreadPoolExecutor | None = None
        self.problems: list[Problem] = []

    # --- packing "packed": one data file per rank ---------------------------------------------

    def packed(self) -> None:
        """Each rank's data file (exists, regular, inside, exact size); then, unless quick, every chunk's span."""
        m = self.manifest
        self._check_world()
        sizes = data_file_sizes(m).tolist()
        bad = set()
        for rank in range(m.world_size):
            found = self._check_data_file(rank, sizes[rank])
            if found is not None:
                self.problems.append(found)
                bad.add(rank)
        holders = self._holders()
        if self.quick:
            return
        placed = self.locator.every_rank()  # every chunk by rank: each file is mapped once, then unmapped
        found_in_chunks = [(li, i, p) for li, i, p in self._empty_chunk_problems() if p.rank not in bad]
        leaves = list(m.leaves.values())
        from ..loading.read import held_location
        from ..storage.backends import local_files  # imports torch

        for rank in np.unique(placed.ranks).tolist():
            if rank in bad:
                continue
            own = local_files(self.root)  # this rank's file is mapped once, and unmapped after it
            rows = placed.rows_of(rank)
            name, size = fmt.rank_data_name(rank), sizes[rank]
            # each chunk's offset from the placement's column: no table of the rank's leaves is built per rank
            for li, i, at in zip(
                placed.leaves[rows].tolist(), placed.chunks[rows].tolist(), placed.offsets[rows].tolist()
            ):
                leaf = leaves[li]
                chunk, h = leaf.table.chunk(i), leaf.holder_of(i)
                loc = Location(name, at, chunk.nbytes, size)
                if h and h not in holders:  # its holder is reported already
                    continue
                files = own if not h else holders[h].files
                loc = loc if not h else held_location(holders[h].opened, leaf, chunk, loc)
                problem = self._check_chunk_bytes(files, leaf, chunk, loc)
                if problem is not None:
                    found_in_chunks.append((li, i, problem))
            del own
        found_in_chunks.sort(key=lambda t: (t[0], t[1]))
        self.problems.extend(p for _li, _i, p in found_in_chunks)

    def _holders(self) -> dict[int, _Held]:
        """An incremental checkpoint's holders, opened at the generations it recorded, by number; each one
        missing, unreadable or replaced is a problem (its chunks are not read)."""
        from ..loading.read import open_holder  # imports torch

        out: dict[int, _Held] = {}
        for h, holder in enumerate(self.manifest.referenced(), start=1):
            try:
                opened = open_holder(self.root, self.manifest, h)
            except CorruptCheckpointError as e:
                self.problems.append(Problem(HOLDER, None, None, holder.name, f"{e}"))
                continue
            out[h] = _Held(opened, opened.files())
        return out

    def _check_world(self) -> None:
        """Refuse a world size the directory cannot hold before checking it rank by rank.

        Packing "packed" has a data file per rank, and each missing one is
        reported. A world of up to ``CHEAP_WORLD`` ranks costs nothing to go
        through; a larger one must not exceed the directory's entries
        (counted up to the world size): a manifest naming a million ranks
        beside three files is refused at once, not reported rank by rank.

        Raises:
            ManifestError: more ranks than entries.
        """
        world = self.manifest.world_size
        if world <= CHEAP_WORLD:
            return
        count = 0
        with os.scandir(self.root) as entries:
            for _entry in entries:
                count += 1
                if count >= world:
                    return
        raise ManifestError(
            f"the manifest of {self.root!r} declares {world} ranks, but the directory holds only {count} entries "
            f"(it has a data file per rank): the manifest is damaged or was tampered with; restore the checkpoint "
            f"from a copy"
        )

    def _empty_chunk_problems(self) -> list[tuple[int, int, Problem]]:
        """(leaf position, chunk, problem) for each chunk of no bytes whose checksum is not that of nothing.

        Empty chunks have no bytes to read (nor, with packing "memmap" or in
        an archive, a file); their checksums are checked column by column.
        """
        out = []
        for li, leaf in enumerate(self.manifest.leaves.values()):
            for i in _empty_chunks_with_bytes_hashed(leaf):
                chunk = leaf.table.chunk(i)
                out.append((li, i, self._checksum_problem(leaf, chunk, self.locator.locate(leaf, chunk), EMPTY)))
        return out

    def _check_data_file(self, rank: int, size: int) -> Problem | None:
        rel = fmt.rank_data_name(rank)
        full = os.path.join(self.root, rel)
        what = f"data file {full!r} of rank {rank}"
        held = self._held(rank)
        if not is_inside(self.real_root, os.path.dirname(full)):
            return Problem(NOT_A_FILE, None, rank, rel, f"{what} resolves outside the checkpoint; {held}")
        try:
            st = os.lstat(full)
        except FileNotFoundError:
            return Problem(MISSING, None, rank, rel, f"{what} is missing; {held}; restore the checkpoint from a copy")
        except OSError as e:
            return Problem(UNREADABLE, None, rank, rel, f"cannot stat {what}: {e}; {held}")
        if not stat.S_ISREG(st.st_mode):
            return Problem(
                NOT_A_FILE,
                None,
                rank,
                rel,
                f"{what} is not a regular file (a symbolic link or a directory); {held}; restore the checkpoint "
                f"from a copy",
            )
        if st.st_size != size:
            return Problem(
                SIZE,
                None,
                rank,
                rel,
                f"{what} has {st.st_size} bytes, its chunks need exactly {size} (truncated or overwritten); "
                f"{held}; restore the checkpoint from a copy",
            )
        return None

    def _held(self, rank: int) -> str:
        """What a rank's data file holds, in words (for a problem of the whole file)."""
        placed, leaves = self.locator.every_rank(), self.keys
        keys = [leaves[i] for i in placed.leaves[placed.rows_of(rank)].tolist()]
        shown = ", ".join(str(list(k)) for k in keys[:3]) + (", ..." if len(keys) > 3 else "")
        return f"it holds {len(keys)} chunk(s)" + (f" (leaves {shown})" if keys else "")

    # --- packing "memmap": one file per chunk, in rank directories --------------------------

    def memmap(self) -> None:
        """Each rank directory that should hold files; each chunk's file; unless quick, its bytes."""
        for rank in np.unique(self.locator.every_rank().ranks).tolist():  # the ranks that stored bytes
            d = os.path.join(self.root, fmt.rank_dir(rank))
            if not os.path.isdir(d):
                self.problems.append(
                    Problem(
                        STRUCTURE,
                        None,
                        rank,
                        fmt.rank_dir(rank),
                        f"rank directory {d!r} is missing; the checkpoint is damaged (restore it from a copy)",
                    )
                )
        files: Any = None
        for leaf, chunk in self._chunks():
            loc = self.locator.locate(leaf, chunk)
            found = self._check_file(leaf, chunk, loc.relpath)
            if found is not None:
                self.problems.append(found)
                continue
            if self.quick:
                continue
            if files is None:
                from ..storage.backends import local_files  # imports torch

                files = local_files(self.root)
            found = self._check_chunk_bytes(files, leaf, chunk, loc)
            if found is not None:
                self.problems.append(found)

    def _chunks(self) -> Iterator[tuple[Leaf, Chunk]]:
        """Every chunk of at least one byte, in manifest order (built one at a time); unless quick, a problem
        is recorded in its place for each empty chunk whose checksum is not that of nothing."""
        for leaf in self.manifest.leaves.values():
            cols = leaf.table.columns()
            wrong = set() if self.quick else set(_empty_chunks_with_bytes_hashed(leaf, cols))
            for i in sorted(wrong.union(np.flatnonzero(cols.nbytes).tolist())):
                chunk = leaf.table.chunk(i)
                if i in wrong:
                    self.problems.append(self._checksum_problem(leaf, chunk, self.locator.locate(leaf, chunk), EMPTY))
                else:
                    yield leaf, chunk

    def _check_file(self, leaf: Leaf, chunk: Chunk, rel: str) -> Problem | None:
        """A chunk's own file: a regular file inside the checkpoint, of the declared size."""
        full = os.path.join(self.root, rel)
        if not is_inside(self.real_root, os.path.dirname(full)):
            return Problem(
                NOT_A_FILE,
                leaf.key,
                chunk.rank,
                rel,
                f"{_where(leaf, chunk)}: {full!r} resolves outside the checkpoint",
            )
        try:
            st = os.lstat(full)
        except FileNotFoundError:
            return Problem(
                MISSING,
                leaf.key,
                chunk.rank,
                rel,
                f"{_where(leaf, chunk)}: file {full!r} is missing; restore the checkpoint from a copy",
            )
        except OSError as e:
            return Problem(UNREADABLE, leaf.key, chunk.rank, rel, f"{_where(leaf, chunk)}: cannot stat {full!r}: {e}")
        if not stat.S_ISREG(st.st_mode):
            return Problem(
                NOT_A_FILE,
                leaf.key,
                chunk.rank,
                rel,
                f"{_where(leaf, chunk)}: {full!r} is not a regular file (a symbolic link or a directory)",
            )
        if st.st_size != chunk.nbytes:
            return Problem(
                SIZE,
                leaf.key,
                chunk.rank,
                rel,
                f"{_where(leaf, chunk)}: file {full!r} has {st.st_size} bytes, the manifest says {chunk.nbytes} "
                f"(truncated or overwritten)",
            )
        return None

    # --- archives: one entry per chunk ---------------------------------------------------------

    def archive(self) -> None:
        """The archive's structure; each chunk's entry and its declared size; unless quick, its bytes."""
        from ..storage.backends import local_files  # imports torch

        try:
            files = local_files(self.root)
        except CorruptCheckpointError as e:
            self.problems.append(Problem(STRUCTURE, None, None, None, str(e)))
            return  # nothing in it can be checked
        for leaf, chunk in self._chunks():
            loc = self.locator.locate(leaf, chunk)
            name = loc.relpath.replace(os.sep, "/")
            loc = Location(name, loc.offset, loc.nbytes, loc.file_size)
            found = self._check_entry(files, leaf, chunk, name)
            if found is None and not self.quick:
                found = self._check_chunk_bytes(files, leaf, chunk, loc)
            if found is not None:
                self.problems.append(found)

    @staticmethod
    def _check_entry(files: Any, leaf: Leaf, chunk: Chunk, name: str) -> Problem | None:
        found = files.entries.get(name)
        if found is None:
            return Problem(
                MISSING, leaf.key, chunk.rank, name, f"{_where(leaf, chunk)}: the archive has no entry {name!r}"
            )
        zi = found[1]
        if zi.file_size != chunk.nbytes:
            return Problem(
                SIZE,
                leaf.key,
                chunk.rank,
                name,
                f"{_where(leaf, chunk)}: entry {name!r} declares {zi.file_size} bytes, the manifest says "
                f"{chunk.nbytes}",
            )
        return None

    # --- every packing ----------------------------------------------------------------------

    def _check_chunk_bytes(self, files: Any, leaf: Leaf, chunk: Chunk, loc: Location) -> Problem | None:
        """Read a chunk's bytes where ``loc`` says and compare their checksum with the manifest's."""
        if chunk.nbytes == 0:
            return self._checksum_problem(leaf, chunk, loc, EMPTY) if chunk.checksum != EMPTY else None
        offset = self._offset(loc)
        try:
            data = files.span(loc).numpy()
            views = blocks(data)
            pool = self.pool
            mapper = pool.map if pool is not None and len(views) > 1 else map
            digests = []
            for view, digest in zip(views, mapper(block_digest, views)):
                digests.append(digest)
                self.tick(len(view))
        except CorruptCheckpointError as e:
            return Problem(UNREADABLE, leaf.key, chunk.rank, loc.relpath, f"{_where(leaf, chunk)}: {e}", offset)
        except (OSError, StorageError) as e:  # a directory's reader wraps a failed open in StorageError
            cause = e if isinstance(e, OSError) else e.__cause__
            if isinstance(cause, OSError) and cause.errno == errno.ENOMEM:
                raise
            return Problem(
                UNREADABLE,
                leaf.key,
                chunk.rank,
                loc.relpath,
                f"{_where(leaf, chunk)}: cannot read {self._span_text(loc)}: {e}",
                offset,
            )
        actual = combine_digests(digests)
        if actual != chunk.checksum:
            return self._checksum_problem(leaf, chunk, loc, actual)
        return None

    def _offset(self, loc: Location) -> int | None:
        return loc.offset if self.spans else None

    def _span_text(self, loc: Location) -> str:
        if self._offset(loc) is None:
            return repr(loc.relpath)
        return f"{loc.relpath!r}, offset {loc.offset}, {loc.nbytes} bytes"

    def _checksum_problem(self, leaf: Leaf, chunk: Chunk, loc: Location, actual: str) -> Problem:
        return Problem(
            CHECKSUM,
            leaf.key,
            chunk.rank,
            loc.relpath,
            f"{_where(leaf, chunk)}: checksum mismatch in {self._span_text(loc)} (expected {chunk.checksum}, "
            f"found {actual}); the data is corrupted, restore it from a copy or an older checkpoint",
            self._offset(loc),
        )
