"""One live job per checkpoint root: an ``fcntl.flock`` on a lock file in the root.

Two jobs saving step checkpoints into the same root would retire each
other's checkpoints and interleave their steps. ``CheckpointManager`` takes
this lock on rank 0 and holds it for its lifetime; the kernel releases it
when the holding process dies (even by SIGKILL), so a crashed job never
leaves a stale lock behind. The file records the holder's host and pid,
for the error of the job that is refused. Within one process the lock is
shared (counted), so several managers of one job (thread ranks, a manager
created again after a restore) do not refuse each other. A forked child
closes its copy of the descriptor, so a data-loader worker that outlives
its parent does not keep the lock.
"""

from __future__ import annotations

import datetime
import fcntl
import json
import logging
import os
import socket
import threading

from ..errors import RootLockedError

logger = logging.getLogger(__name__)

#: The lock file in a manager's root (never a step name: retention and clean-up leave it alone).
LOCK_NAME = ".tddist-manager.lock"

_lock = threading.Lock()
_held: dict[str, list[int]] = {}  # real path of the lock file -> [fd, users]


def _close_in_child() -> None:
    for fd, _users in _held.values():
        try:
            os.close(fd)  # closes the child's reference only: the parent keeps its lock
        except OSError:
            pass
    _held.clear()


os.register_at_fork(after_in_child=_close_in_child)


def lock_path(root: str) -> str:
    return os.path.join(root, LOCK_NAME)


def acquire(root: str) -> None:
    """Take (or share, within this process) the lock of ``root``, which must exist.

    Raises:
        RootLockedError: another process holds it; the message names its host and pid.
    """
    path = os.path.realpath(lock_path(root))
    with _lock:
        held = _held.get(path)
        if held is not None:
            held[1] += 1
            return
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _holder(fd)
            os.close(fd)
            raise RootLockedError(
                f"checkpoint root {root!r} is in use by another live job ({holder}); two jobs saving into one "
                f"root would retire each other's checkpoints. Stop that job, or give this one another root; the "
                f"lock ({path}) is released as soon as the holding process exits or is killed"
            ) from None
        except BaseException:
            os.close(fd)
            raise
        info = {
            "host": socket.gethostname(),
            "pid": os.getpid(),
            "since": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        }
        os.ftruncate(fd, 0)
        os.pwrite(fd, json.dumps(info).encode(), 0)
        _held[path] = [fd, 1]
        logger.debug("locked %s", path)


def release(root: str) -> None:
    """Give back one use of the lock of ``root``; the last one unlocks it (the file stays)."""
    path = os.path.realpath(lock_path(root))
    with _lock:
        held = _held.get(path)
        if held is None:
            return
        held[1] -= 1
        if held[1] == 0:
            del _held[path]
            os.close(held[0])


def _holder(fd: int) -> str:
    try:
        info = json.loads(os.pread(fd, 4096, 0).decode() or "{}")
        return f"host {info.get('host', '?')}, pid {info.get('pid', '?')}, since {info.get('since', '?')}"
    except (OSError, ValueError):
        return "holder unknown: the lock file is unreadable"
