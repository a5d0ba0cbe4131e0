"""A part restored from a peer's replica becomes this rank's own local copy again, written after the restore.

A restore after a lost node (``peer_restore``) receives this rank's part
from the peer that kept its replica and loads it from memory; writing it to
this rank's local directory is not on the restore's path. ``keep`` starts a
thread that writes the received files into a staging directory
(``<local_dir>/.fetched-rank<r>/...``), fsyncs every file and directory, and
only then renames it into place as ``step-<step>/rank-<r>-of-<world>`` (one
rename: the copy appears whole or not at all) and writes its record, naming
the rank whose replica it came from. The bytes written are exactly those
whose checksums matched the sender's record as they arrived (``receiving``).
Leaves received straight into the state (``direct``) are written from it:
the state may have changed since, so such a file is hashed again once
written, and kept only if it still matches the record. A write that fails
(or no longer matches) is logged and leaves no copy: the replica stays, and
the next restore fetches it again.

The manager waits for the thread (``Keeping.wait``) before anything else
touches the local tier: the next save, a promotion of the restored step,
another restore, ``close``.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Mapping

import torch

from .._fs import fsync_path, fsync_tree_dirs, makedirs_durable, remove_tree
from ..checksum import Hasher
from ..storage.base import map_copy_on_write
from ..storage.memory import Regions
from .copies import CopyRecord, record_path, write_record
from .direct import segments
from .local_tier import LocalTier

logger = logging.getLogger(__name__)


def inbox(tier: LocalTier) -> str:
    """Where this rank stages the copies it writes: ``<local_dir>/.fetched-rank<r>`` (never read as a copy)."""
    return os.path.join(tier.directory, f".fetched-rank{tier.rank}")


class Keeping:
    """The thread writing one received part into place (see the module docstring); ``wait`` joins it."""

    def __init__(
        self,
        tier: LocalTier,
        record: CopyRecord,
        files: Mapping[str, torch.Tensor],
        direct: Mapping[str, Regions] | None = None,
    ) -> None:
        self.tier, self.record = tier, record
        self._files = dict(files)
        self._direct = dict(direct or {})
        self.kept: str | None = None  # the own copy, once written, renamed and recorded
        self._thread = threading.Thread(target=self._run, name=f"tddist-keep-rank{tier.rank}")
        self._thread.start()

    def wait(self) -> None:
        """Wait until the copy is in place (or its write failed, which was logged)."""
        self._thread.join()

    def _run(self) -> None:
        part = self.record.part
        staging = os.path.join(inbox(self.tier), str(part.step), part.name)
        try:
            self.kept = write_in_place(self.tier, self.record, self._files, staging, self._direct)
        except OSError as e:
            logger.warning("rank %d: writing its part of step %d received from rank %s to %s failed: %s; the "
                           "replica there stays its only copy", self.tier.rank, part.step, self.record.peer_rank,
                           self.tier.directory, e)  # fmt: skip
            remove_tree(staging)
        else:
            if self.kept is None:
                logger.info("rank %d: its part of step %d changed in the state before it was written back to %s; "
                            "the replica stays its only copy until the next save", self.tier.rank, part.step,
                            self.tier.directory)  # fmt: skip
            else:
                logger.info("rank %d: its part of step %d is in %s again", self.tier.rank, part.step, self.kept)
        finally:
            self._files.clear()  # the received bytes may go
            self._direct.clear()


def write_in_place(
    tier: LocalTier,
    record: CopyRecord,
    files: Mapping[str, torch.Tensor],
    staging: str,
    direct: Mapping[str, Regions] | None = None,
) -> str | None:
    """Write ``files`` under ``staging`` durably, then make it the own copy of ``record.part``; return where
    (None, nothing kept: bytes of ``direct``, written from the state, no longer match the record).

    An own copy already there was not read by the restore (a rank reads its
    own copy when it holds a good one): it is replaced.
    """
    remove_tree(os.path.dirname(os.path.dirname(staging)))  # what an earlier write left (cut off)
    for f in record.files:
        path = os.path.join(staging, f.name)
        makedirs_durable(os.path.dirname(path))
        regions = (direct or {}).get(f.name, ())
        _write_segments(path, segments(files[f.name], regions))  # fsynced
        if regions and _digest_written(path, f.size) != f.digest:
            remove_tree(os.path.dirname(os.path.dirname(staging)))
            return None
    fsync_tree_dirs(staging)
    own = tier.part(record.part.step, record.part.world)
    remove_tree(record_path(own))
    remove_tree(own)
    makedirs_durable(os.path.dirname(own))
    os.rename(staging, own)
    fsync_path(os.path.dirname(own))
    write_record(own, record)
    remove_tree(os.path.dirname(os.path.dirname(staging)))
    return own


def _digest_written(path: str, size: int) -> str:
    """The checksum of the file just written at ``path`` (``size`` bytes), read through a map (no copy)."""
    h = Hasher()
    if size:
        h.update(map_copy_on_write(path, size).numpy().data)
    return h.hexdigest()


def _write_segments(path: str, parts: list[torch.Tensor]) -> None:
    """Write the bytes of ``parts`` one after the other to a new file at ``path``, fsynced."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        for part in parts:
            view = part.numpy().data if part.numel() else memoryview(b"")
            while view:
                view = view[os.write(fd, view) :]
        os.fsync(fd)
    finally:
        os.close(fd)
