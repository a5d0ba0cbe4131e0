"""One live job per checkpoint root: the root's lock, shared by the managers of one process.

Two jobs saving step checkpoints into the same root would retire each
other's checkpoints and interleave their steps. ``CheckpointManager`` takes
the root's lock on rank 0 and holds it for its lifetime. The root's storage
provides the lock (``storage.roots.Root.lock``): on a file system an
``fcntl.flock`` on ``.tddist-manager.lock`` in the root, which the kernel
releases when the holding process dies (even by SIGKILL); on object storage a
lease object renewed while held, which another job takes over once it has not
been renewed for a lease (``storage/s3/lease.py``). Within one process the
lock is shared (counted), so several managers of one job (thread ranks, a
manager created again after a restore) do not refuse each other. A forked
child drops its copy, so a data-loader worker that outlives its parent does
not keep the lock.
"""

from __future__ import annotations

import logging
import os
import threading

from ..storage.backends import root_for
from ..storage.roots import LOCK_NAME, HeldLock

logger = logging.getLogger(__name__)

__all__ = ["LOCK_NAME", "acquire", "release"]

_lock = threading.Lock()
_held: dict[str, tuple[HeldLock, list[int]]] = {}  # the root's lock key -> (the lock, [users])


def _close_in_child() -> None:
    for held, _users in _held.values():
        held.forget()  # the child's copy only: the parent keeps its lock
    _held.clear()


os.register_at_fork(after_in_child=_close_in_child)


def _key(root: str) -> str:
    r = root_for(root)
    return os.path.realpath(r.target) if r.local else r.target


def acquire(root: str) -> None:
    """Take (or share, within this process) the lock of ``root``; a root on a file system must exist.

    Raises:
        RootLockedError: another live job holds it; the message names its host and pid.
        StorageError: on object storage, the lease could not be written.
    """
    key = _key(root)
    with _lock:
        held = _held.get(key)
        if held is not None:
            held[1][0] += 1
            return
        _held[key] = (root_for(root).lock(), [1])
        logger.debug("locked %s", root)


def release(root: str) -> None:
    """Give back one use of the lock of ``root``; the last one unlocks it."""
    key = _key(root)
    with _lock:
        held = _held.get(key)
        if held is None:
            return
        held[1][0] -= 1
        if held[1][0] == 0:
            del _held[key]
            held[0].release()
