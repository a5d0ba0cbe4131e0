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
A write that fails is logged and leaves no copy: the replica stays, and the
next restore fetches it again.

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

from .._fs import fsync_path, fsync_tree_dirs, makedirs_durable, remove_tree, write_durable
from .copies import CopyRecord, record_path, write_record
from .local_tier import LocalTier

logger = logging.getLogger(__name__)


def inbox(tier: LocalTier) -> str:
    """Where this rank stages the copies it writes: ``<local_dir>/.fetched-rank<r>`` (never read as a copy)."""
    return os.path.join(tier.directory, f".fetched-rank{tier.rank}")


class Keeping:
    """The thread writing one received part into place (see the module docstring); ``wait`` joins it."""

    def __init__(self, tier: LocalTier, record: CopyRecord, files: Mapping[str, torch.Tensor]) -> None:
        self.tier, self.record = tier, record
        self._files = dict(files)
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
            self.kept = write_in_place(self.tier, self.record, self._files, staging)
        except OSError as e:
            logger.warning("rank %d: writing its part of step %d received from rank %s to %s failed: %s; the "
                           "replica there stays its only copy", self.tier.rank, part.step, self.record.peer_rank,
                           self.tier.directory, e)  # fmt: skip
            remove_tree(staging)
        else:
            logger.info("rank %d: its part of step %d is in %s again", self.tier.rank, part.step, self.kept)
        finally:
            self._files.clear()  # the received bytes may go


def write_in_place(tier: LocalTier, record: CopyRecord, files: Mapping[str, torch.Tensor], staging: str) -> str:
    """Write ``files`` under ``staging`` durably, then make it the own copy of ``record.part``; return where.

    An own copy already there was not read by the restore (a rank reads its
    own copy when it holds a good one): it is replaced.
    """
    remove_tree(os.path.dirname(os.path.dirname(staging)))  # what an earlier write left (cut off)
    for f in record.files:
        path = os.path.join(staging, f.name)
        makedirs_durable(os.path.dirname(path))
        write_durable(path, files[f.name].numpy().data)  # fsynced
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
