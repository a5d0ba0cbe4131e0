"""The commit point: a fully written staging entry replaces the target in one rename.

Used by every file-system writer's ``publish`` and by ``pack``/``unpack``. An absent
target is created with a no-replace rename; an existing one is swapped with
``renameat2(RENAME_EXCHANGE)``, so the target path always holds either the old
or the new checkpoint. Without RENAME_EXCHANGE the old checkpoint is moved to a
backup name first; ``recover`` puts it back if a crash strikes in between.
"""

from __future__ import annotations

import logging
import os

from .. import format as fmt
from .._faults import exchange_disabled, fault_point
from .._fs import exchange, fsync_path, remove_tree, rename_noreplace
from .pinned import wait_for_readers

logger = logging.getLogger(__name__)


def publish(staging: str, target: str) -> None:
    """Make the fully written ``staging`` entry (a directory or a file) the target, durably, and remove the
    checkpoint it replaced."""
    replaced = swap_in(staging, target)
    if replaced is not None:
        discard(replaced, readers=True)


def swap_in(staging: str, target: str) -> str | None:
    """Make the fully written ``staging`` entry the target, durably; return where the replaced checkpoint now
    lies (None when there was none), for the caller to ``discard`` once the commit is announced.

    Removing the old copy is not part of the commit: the new one is durable
    before it starts, and a crash in between leaves the old copy at a staging
    or backup name, which ``recover`` removes.
    """
    parent = os.path.dirname(os.path.abspath(target))
    if not os.path.exists(target):
        rename_noreplace(staging, target)
        fault_point("renamed", 0)
        fsync_path(parent)
        return None
    if not exchange_disabled() and exchange(staging, target):
        fault_point("renamed", 0)
        fsync_path(parent)
        fault_point("replace", 0)
        return staging  # now holds the old checkpoint; the new one is committed either way
    logger.info("RENAME_EXCHANGE unsupported here; replacing %s through a backup name", target)
    backup = fmt.backup_path(target)
    os.rename(target, backup)
    fsync_path(parent)
    fault_point("backup", 0)
    os.rename(staging, target)
    fault_point("renamed", 0)
    fsync_path(parent)
    fault_point("replace", 0)
    return backup


def discard(path: str, readers: bool = False) -> None:
    """Remove a staging area or an old checkpoint; a failure only warns (``recover`` removes it later).

    It must never stop a commit or keep rank 0 from announcing its decision.
    ``readers``: ``path`` is a checkpoint this save replaced, which another
    save may still be reading back: wait for it first (``wait_for_readers``).
    """
    if readers:
        wait_for_readers(path)
    try:
        remove_tree(path)
    except OSError as e:
        logger.warning("could not remove %s (%s); tddist.recover will", path, e)
