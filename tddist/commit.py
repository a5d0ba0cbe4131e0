"""The two-phase commit that makes a multi-rank checkpoint appear atomically.

Steps (the names in brackets are the fault-injection points of ``_faults``):

1. (rank 0) Check the target: a file, a symbolic link or a foreign non-empty
   directory is refused, never deleted. Create missing parent directories
   durably, and a staging directory beside the target, on the same file
   system, named ``.<target>.tddist-staging-<uuid>`` (a staging *file* for an
   archive). Broadcast its path, or the error, so no rank waits forever.
                                                                    [prepare]
2. (all ranks) Write the local shard into the staging area; every file and
   directory is fsynced (one ``syncfs`` instead when a rank writes many small
   files). The fragment (or the error) is the vote.                  [write]
   For an archive, a reservation round comes first: every rank prepares its
   entries and reports its region's size, rank 0 assigns offsets and
   pre-sizes the file, then each rank writes its region in place.
3. (all ranks -> rank 0) Gather the votes.                            [vote]
4. (rank 0) Any failure: remove the staging area and decide ABORT with every
   failing rank's error. Otherwise merge and validate the fragments (they
   must tile every global tensor) [validate], write and fsync the manifest
   (for an archive: the manifest entry and the central directory) and fsync
   the staging directory [manifest], then publish: a ``rename`` onto an absent
   target, or a ``renameat2(RENAME_EXCHANGE)`` with an existing one, then
   fsync the parent directory. The rename is the commit point [publish]. The
   old checkpoint, now at the staging name, is removed [replace]; failing to
   remove it only warns (``recover`` removes it later).
5. (rank 0 -> all) Broadcast the decision. Every rank returns only after
   COMMITTED, so a save that returned is durable.                  [announce]

Without RENAME_EXCHANGE the old checkpoint is first renamed to
``.<target>.tddist-backup-<uuid>``; ``recover`` puts it back if a crash struck
before the new one was in place.

With ``atomic=False`` (directories only) the ranks write into the target
itself and the manifest is still written last, so an interrupted save leaves
a directory that readers refuse instead of misread.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from typing import Protocol

from . import format as fmt
from ._faults import archive_base_offset, fault_point
from ._fs import exchange, fsync_path, makedirs_durable, remove_tree, rename_noreplace, write_durable
from .archive import check_archive_target
from .comm import Communicator, collective_error, describe
from .errors import CommError, TargetError
from .recovery import is_tddist_dir

logger = logging.getLogger(__name__)


def check_target(target: str) -> bool:
    """Refuse targets tddist must not replace; return whether one exists."""
    if os.path.islink(target):
        raise TargetError(f"target {target!r} is a symbolic link; pass the real path or another target")
    if os.path.isfile(target):
        raise TargetError(
            f"target {target!r} is an existing file, not a checkpoint directory; choose another path "
            f"(it was left untouched)"
        )
    if not os.path.exists(target):
        return False
    if not os.path.isdir(target):
        raise TargetError(f"target {target!r} exists and is not a directory; choose another path")
    if not is_tddist_dir(target):
        raise TargetError(
            f"target {target!r} is a non-empty directory that is not a tddist checkpoint; tddist never "
            f"deletes foreign data: choose another path or empty it yourself"
        )
    return True


class ArchiveHooks(Protocol):
    """What an archive save adds to the protocol (see ``archive.py``)."""

    def region_size(self) -> int:
        """(all ranks) Prepare this rank's entries; the bytes its region needs (a multiple of 64)."""

    def write(self, staging: str, start: int) -> dict:
        """(all ranks) Write this rank's region at ``start``; fsync; return the fragment."""

    def finalize(self, staging: str, end: int, manifest: bytes, fragments: list[dict]) -> None:
        """(rank 0) Write the manifest entry at ``end`` and the central directory; fsync."""


def _prepare(target: str, atomic: bool, archive: bool) -> str:
    parent = os.path.dirname(os.path.abspath(target))
    makedirs_durable(parent)
    if archive:
        check_archive_target(target)
        staging = fmt.staging_path(target)
        os.close(os.open(staging, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644))
        return staging
    exists = check_target(target)
    if not atomic:
        if exists:
            manifest = os.path.join(target, fmt.MANIFEST_NAME)
            if os.path.exists(manifest):
                os.unlink(manifest)  # the old data stops being trusted first
                fsync_path(target)
            for name in os.listdir(target):
                remove_tree(os.path.join(target, name))
        else:
            os.makedirs(target)
        fsync_path(parent)
        return os.path.abspath(target)
    staging = fmt.staging_path(target)
    os.mkdir(staging)
    return staging


def publish(staging: str, target: str) -> None:
    """Make the fully written ``staging`` directory the target: the commit point."""
    parent = os.path.dirname(os.path.abspath(target))
    if not os.path.exists(target):
        rename_noreplace(staging, target)
        fsync_path(parent)
        return
    if exchange(staging, target):
        fsync_path(parent)
        fault_point("replace", 0)
        _discard(staging)  # now holds the old checkpoint; the new one is committed either way
        return
    logger.info("RENAME_EXCHANGE unsupported here; replacing %s through a backup name", target)
    backup = fmt.backup_path(target)
    os.rename(target, backup)
    fsync_path(parent)
    os.rename(staging, target)
    fsync_path(parent)
    _discard(backup)


def two_phase_commit(
    comm: Communicator,
    target: str,
    write_fragment: Callable[[str], dict],
    build_manifest: Callable[[list[dict]], bytes],
    atomic: bool = True,
    archive: ArchiveHooks | None = None,
) -> None:
    """Run the protocol above. Returns on every rank only once the checkpoint is committed.

    ``write_fragment(root)`` writes this rank's shard under ``root`` and returns
    its fragment; ``build_manifest(fragments)`` (rank 0) validates them and
    returns the manifest bytes. With ``archive``, the staging area is one file
    and step 2 starts with a reservation round: every rank reports the size
    of its region, rank 0 assigns offsets and pre-sizes the file.
    """
    rank = comm.rank
    # 1. prepare (rank 0) -> broadcast the staging path or the error
    staging, error = None, None
    if rank == 0:
        try:
            staging = _prepare(target, atomic, archive is not None)
            fault_point("prepare", 0)
        except Exception as e:
            if isinstance(e, OSError):
                e = TargetError(f"cannot prepare a save to {target!r}: {e} (the target was left untouched)")
            error = describe(e)
            if atomic and staging is not None:
                _discard(staging)
    staging, error = comm.broadcast((staging, error), 0)
    if error is not None:
        raise collective_error(f"save to {target!r}", {0: error})
    end = None
    if archive is not None:
        start, end = _reserve(comm, target, staging, archive)
        write_fragment = lambda root: archive.write(root, start)

    # 2. write (all ranks): the vote is the fragment or the error
    try:
        vote = ("ok", write_fragment(staging))
        fault_point("write", rank)
    except Exception as e:
        logger.debug("rank %d failed to write its shard", rank, exc_info=True)
        vote = ("error", describe(e))

    # 3. vote (all -> rank 0)
    votes = comm.gather(vote, 0)
    if rank != 0:
        fault_point("vote", rank)

    # 4. decide (rank 0): whatever fails here becomes the decision, so every rank hears one
    decision = None
    if rank == 0:
        try:
            fault_point("vote", 0)
            write_manifest = _manifest_writer(archive, end)
            decision = _decide(target, staging, votes, build_manifest, write_manifest, atomic)
        except Exception as e:
            logger.debug("rank 0 failed to decide", exc_info=True)
            if atomic:
                _discard(staging)
            decision = {0: describe(e)}

    # 5. announce (rank 0 -> all)
    try:
        decision = comm.broadcast(decision, 0)
    except CommError as e:
        if decision == "committed":  # rank 0 knows better than the generic advice
            raise type(e)(
                f"{e}\nrank 0 had already committed {target!r}: it holds the new checkpoint, but not every "
                f"rank could be told"
            ) from e
        raise
    fault_point("announce", rank)
    if decision != "committed":
        raise collective_error(f"save to {target!r}", decision)


def _reserve(comm: Communicator, target: str, staging: str, archive: ArchiveHooks) -> tuple[int, int]:
    """Archive step 2a: gather region sizes, assign offsets, pre-size the staging file.

    Returns this rank's start and the end of all regions (where rank 0 puts the manifest).
    """
    try:
        status = ("ok", archive.region_size())
    except Exception as e:
        logger.debug("rank %d failed to prepare its archive entries", comm.rank, exc_info=True)
        status = ("error", describe(e))
    statuses = comm.gather(status, 0)
    decision = None
    if comm.rank == 0:
        failures = {r: s[1] for r, s in enumerate(statuses) if s[0] != "ok"}
        if not failures:
            base = archive_base_offset()
            starts, pos = [], base
            for _ok, size in statuses:
                starts.append(pos)
                pos += size
            try:
                if pos > base:
                    fd = os.open(staging, os.O_WRONLY)
                    try:
                        os.posix_fallocate(fd, base, pos - base)
                    finally:
                        os.close(fd)
                decision = ("ok", starts, pos)
            except OSError as e:
                failures = {0: describe(e)}
        if failures:
            _discard(staging)  # a failure to remove it must not stop the broadcast either
            decision = ("error", failures)
    decision = comm.broadcast(decision, 0)
    if decision[0] != "ok":
        raise collective_error(f"save to {target!r}", decision[1])
    return decision[1][comm.rank], decision[2]


def _manifest_writer(archive: ArchiveHooks | None, end: int | None):
    """How rank 0 puts the manifest into the staging area (a file, or an archive entry)."""
    if archive is None:

        def write(staging, manifest, fragments):
            write_durable(os.path.join(staging, fmt.MANIFEST_NAME), manifest)
            fsync_path(staging)
    else:

        def write(staging, manifest, fragments):
            archive.finalize(staging, end, manifest, fragments)

    return write


def _decide(target: str, staging: str, votes: list, build_manifest, write_manifest, atomic: bool):
    """Rank 0's half of step 4: abort with all failures, or validate, write the manifest, publish."""
    failures = {r: v[1] for r, v in enumerate(votes) if v[0] != "ok"}
    if not failures:
        try:
            fragments = [v[1] for v in votes]
            manifest = build_manifest(fragments)
            fault_point("validate", 0)
            write_manifest(staging, manifest, fragments)
            fault_point("manifest", 0)
            if atomic:
                publish(staging, target)
            else:
                fsync_path(os.path.dirname(os.path.abspath(target)))
            fault_point("publish", 0)
            return "committed"
        except Exception as e:
            logger.debug("rank 0 failed to commit", exc_info=True)
            failures = {0: describe(e)}
    if atomic:
        _discard(staging)
    return failures


def _discard(staging: str) -> None:
    """Remove a staging area or an old checkpoint; failing to must not stop the commit or the announce."""
    try:
        remove_tree(staging)
    except OSError as e:
        logger.warning("could not remove %s (%s); tddist.recover will", staging, e)
