"""Checking a committed checkpoint, chunk by chunk, and reporting every problem found.

``verify(path)`` checks every stored chunk of a directory or archive
checkpoint against its manifest: that its file (or archive entry) exists and
has the declared size and, unless ``quick``, that its bytes match the
checksum. Unlike ``load(..., verify=True)``, which stops at the first bad
chunk, it goes on and returns a ``VerifyReport`` listing all of them.
"""

from __future__ import annotations

import errno
import os
import stat
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from . import format as fmt
from .checksum import EMPTY, block_digest, blocks, combine_digests
from .errors import CorruptCheckpointError, InvalidArgumentError
from .manifest import Chunk, Leaf, Manifest
from .manifest_io import read_manifest

#: Kinds of ``Problem``.
MISSING = "missing"  # the chunk's file or archive entry is not there
SIZE = "size"  # it has another size than the manifest says
NOT_A_FILE = "not-a-file"  # a symbolic link, a directory, or a path resolving outside the checkpoint
CHECKSUM = "checksum"  # its bytes do not match the checksum
UNREADABLE = "unreadable"  # reading or decompressing it failed
STRUCTURE = "structure"  # the checkpoint as a whole: an archive that is not a valid zip, a missing rank directory


@dataclass(frozen=True)
class Problem:
    """One thing wrong with a checkpoint.

    Attributes:
        kind: ``"missing"``, ``"size"``, ``"not-a-file"``, ``"checksum"``,
            ``"unreadable"`` or ``"structure"``.
        key: the leaf the chunk belongs to, or None for a problem of the whole checkpoint.
        rank: the rank that wrote the chunk, or None.
        file: the chunk's path relative to the checkpoint (its archive entry's name), or None.
        message: what is wrong and what to do, in words.
    """

    kind: str
    key: tuple[str, ...] | None
    rank: int | None
    file: str | None
    message: str


@dataclass(frozen=True)
class VerifyReport:
    """The outcome of ``verify``.

    Attributes:
        path: the checkpoint checked.
        mode: ``"quick"`` (sizes and structure) or ``"full"`` (checksums too).
        layout: ``"directory"`` or ``"archive"``.
        world_size: the number of ranks that saved it.
        chunks: the number of chunks checked.
        nbytes: the bytes those chunks hold (what a full check reads).
        problems: every problem found, in manifest order.
    """

    path: str
    mode: str
    layout: str
    world_size: int
    chunks: int
    nbytes: int
    problems: tuple[Problem, ...]

    @property
    def ok(self) -> bool:
        """True when no problem was found."""
        return not self.problems


def verify(
    path: str | os.PathLike,
    *,
    quick: bool = False,
    num_threads: int = 2,
    progress: Callable[[int], None] | None = None,
) -> VerifyReport:
    """Check every chunk of the committed checkpoint at ``path``; return all problems found.

    Args:
        path: a checkpoint directory or ``.tdz`` archive.
        quick: check only that every chunk's file (archive entry) exists with
            its declared size, and the archive's structure; read no data.
        num_threads: threads that read and hash (1: the calling thread only).
        progress: called with the number of bytes just checked, as the check goes.

    Returns:
        A ``VerifyReport``; ``report.ok`` is True when nothing is wrong.

    Raises:
        CheckpointNotFoundError: nothing committed is at ``path``.
        ManifestError: the manifest is unreadable or invalid (nothing else can be checked).
        InvalidArgumentError: ``num_threads`` is not a positive int.
    """
    if type(num_threads) is not int or num_threads < 1:
        raise InvalidArgumentError(f"num_threads must be a positive int, got {num_threads!r}")
    path = os.path.abspath(os.fspath(path))
    manifest = read_manifest(path)
    archive = os.path.isfile(path)
    chunks = [(leaf, c) for leaf in manifest.leaves.values() for c in leaf.chunks]
    total = sum(c.nbytes for _leaf, c in chunks)
    problems: list[Problem] = []
    tick = progress or (lambda n: None)
    if archive:
        files = _open_archive(path, problems)
    else:
        _check_rank_dirs(path, manifest, problems)
        files = None
    pool = ThreadPoolExecutor(num_threads, thread_name_prefix="tddist-verify") if num_threads > 1 else None
    try:
        for leaf, chunk in chunks:
            rel = fmt.leaf_relpath(chunk.rank, leaf.key, manifest.robust_key)
            if chunk.nbytes == 0:
                if not quick and chunk.checksum != EMPTY:
                    problems.append(_checksum_problem(leaf, chunk, rel, EMPTY))
                continue
            if archive and files is None:
                continue  # the archive itself is unreadable: already reported
            found = _check_archive_entry(files, leaf, chunk, rel) if archive else _check_file(path, leaf, chunk, rel)
            if found is not None:
                problems.append(found)
                tick(chunk.nbytes)
                continue
            if quick:
                tick(chunk.nbytes)
                continue
            if files is None:
                from .reader import open_files  # imports torch

                files = open_files(path)
            found = _check_checksum(files, archive, leaf, chunk, rel, pool, tick)
            if found is not None:
                problems.append(found)
    finally:
        if pool is not None:
            pool.shutdown()
    return VerifyReport(
        path=path,
        mode="quick" if quick else "full",
        layout="archive" if archive else "directory",
        world_size=manifest.world_size,
        chunks=len(chunks),
        nbytes=total,
        problems=tuple(problems),
    )


def _where(leaf: Leaf, chunk: Chunk) -> str:
    return f"leaf {list(leaf.key)} (written by rank {chunk.rank})"


def _check_rank_dirs(path: str, manifest: Manifest, problems: list[Problem]) -> None:
    for rank in range(manifest.world_size):
        d = os.path.join(path, fmt.rank_dir(rank))
        if not os.path.isdir(d):
            problems.append(
                Problem(
                    STRUCTURE,
                    None,
                    rank,
                    fmt.rank_dir(rank),
                    f"rank directory {d!r} is missing; the checkpoint is damaged (restore it from a copy)",
                )
            )


def _check_file(root: str, leaf: Leaf, chunk: Chunk, rel: str) -> Problem | None:
    """Quick check of a directory chunk: a regular file inside the checkpoint, of the declared size."""
    full = os.path.join(root, rel)
    real_root = os.path.realpath(root)
    real_dir = os.path.realpath(os.path.dirname(full))
    if real_dir != real_root and not real_dir.startswith(real_root + os.sep):
        return Problem(
            NOT_A_FILE, leaf.key, chunk.rank, rel, f"{_where(leaf, chunk)}: {full!r} resolves outside the checkpoint"
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


def _open_archive(path: str, problems: list[Problem]) -> Any:
    from .reader import open_files  # imports torch

    try:
        return open_files(path)
    except CorruptCheckpointError as e:
        problems.append(Problem(STRUCTURE, None, None, None, str(e)))
        return None


def _check_archive_entry(files: Any, leaf: Leaf, chunk: Chunk, rel: str) -> Problem | None:
    name = rel.replace(os.sep, "/")
    found = files.entries.get(name)
    if found is None:
        return Problem(MISSING, leaf.key, chunk.rank, name, f"{_where(leaf, chunk)}: the archive has no entry {name!r}")
    zi = found[1]
    if zi.file_size != chunk.nbytes:
        return Problem(
            SIZE,
            leaf.key,
            chunk.rank,
            name,
            f"{_where(leaf, chunk)}: entry {name!r} declares {zi.file_size} bytes, the manifest says {chunk.nbytes}",
        )
    return None


def _check_checksum(
    files: Any,
    archive: bool,
    leaf: Leaf,
    chunk: Chunk,
    rel: str,
    pool: ThreadPoolExecutor | None,
    tick: Callable[[int], None],
) -> Problem | None:
    name = rel.replace(os.sep, "/") if archive else rel
    try:
        data = files.array(name, chunk.nbytes).numpy()
        views = blocks(data)
        mapper = pool.map if pool is not None and len(views) > 1 else map
        digests = []
        for view, digest in zip(views, mapper(block_digest, views)):
            digests.append(digest)
            tick(len(view))
    except CorruptCheckpointError as e:
        return Problem(UNREADABLE, leaf.key, chunk.rank, name, f"{_where(leaf, chunk)}: {e}")
    except OSError as e:
        if e.errno == errno.ENOMEM:
            raise
        return Problem(UNREADABLE, leaf.key, chunk.rank, name, f"{_where(leaf, chunk)}: cannot read {name!r}: {e}")
    actual = combine_digests(digests)
    if actual != chunk.checksum:
        return _checksum_problem(leaf, chunk, name, actual)
    return None


def _checksum_problem(leaf: Leaf, chunk: Chunk, name: str, actual: str) -> Problem:
    return Problem(
        CHECKSUM,
        leaf.key,
        chunk.rank,
        name,
        f"{_where(leaf, chunk)}: checksum mismatch in {name!r} (expected {chunk.checksum}, found {actual}); "
        f"the data is corrupted, restore it from a copy or an older checkpoint",
    )
