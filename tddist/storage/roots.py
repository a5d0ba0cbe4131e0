"""A directory of checkpoints (a root), on a file system: its names, its entries' sizes, its lock.

A ``CheckpointManager`` keeps its step checkpoints under a root, and the
``tddist`` command lists and cleans one. ``Root`` is what they ask of it,
whatever holds it; ``backends.root_for`` chooses the implementation for a
prefix (``FileRoot`` here, the object-storage one in ``storage/s3/root.py``).
What a single checkpoint under it is (committed or not) and removing one are
its ``Store``'s (``backends.Store.committed`` and ``delete``).

The root's lock keeps a second live job out of the root: on a file system an
``fcntl.flock`` on ``LOCK_NAME`` in it, which the kernel releases when the
holding process dies (even by SIGKILL). The file records the holder's host
and pid, for the error of the job that is refused.

Only the standard library is needed: the ``tddist`` command lists a root
without torch.
"""

from __future__ import annotations

import datetime
import fcntl
import json
import logging
import os
import socket
import stat
from dataclasses import dataclass
from typing import Protocol

from .. import format as fmt
from .._faults import fault_point
from .._fs import fsync_path, remove_tree
from ..errors import CheckpointPinnedError, RootLockedError
from .pins import held, pinned
from .recovery import is_committed, is_tddist_dir

logger = logging.getLogger(__name__)

#: The lock file (or object) in a manager's root: never a step name, so retention and clean-up leave it alone.
LOCK_NAME = ".tddist-manager.lock"


@dataclass(frozen=True)
class Usage:
    """What an entry of a root takes.

    Attributes:
        nbytes: on a file system, the blocks allocated (like ``du``); on
            object storage, the sum of its objects' sizes.
        mtime: its last modification, in seconds since the epoch.
    """

    nbytes: int
    mtime: float


@dataclass(frozen=True)
class Leftover:
    """Something an interrupted save left inside one entry of a root on object storage.

    (On a file system, what an interrupted save leaves is an entry of its own
    beside the checkpoint: ``.step-....tddist-staging-...``.)

    Attributes:
        path: where it is: a generation's prefix (``.../tddist-gen-<id>/``)
            or an unfinished multipart upload (``s3://bucket/key?uploadId=<id>``).
        what: ``"generation"`` (objects no committed manifest names) or
            ``"upload"`` (an unfinished multipart upload).
        nbytes: the bytes it holds.
        mtime: when it was last written (seconds since the epoch).
    """

    path: str
    what: str
    nbytes: int
    mtime: float


class HeldLock(Protocol):
    """A root's lock, held by this process."""

    def release(self) -> None:
        """Give the lock back."""
        ...

    def forget(self) -> None:
        """In a forked child: drop this process's copy without giving the parent's lock back."""
        ...


class Root(Protocol):
    """A directory of checkpoints: a path on a file system, or an ``s3://bucket/prefix``.

    Nothing here reads a manifest or deletes a checkpoint: ``store_for(root.join(name))``
    does (``Store.committed``, ``Store.delete``, ``Store.recover``).
    """

    @property
    def target(self) -> str:
        """The normalised root: an absolute path, or the ``s3://`` URL without a trailing "/"."""
        ...

    @property
    def local(self) -> bool:
        """On this machine's file system (its paths are what ``os`` functions take)."""
        ...

    def join(self, name: str) -> str:
        """The path (or URL) of the entry ``name`` directly under the root."""
        ...

    def exists(self) -> bool:
        """A directory (on a file system), or a prefix holding at least one object."""
        ...

    def create(self) -> None:
        """Make the root exist before a save into it (a directory; nothing on object storage)."""
        ...

    def names(self) -> list[str]:
        """Every entry directly under the root, leftovers of interrupted saves and deletions included; empty
        when the root does not exist."""
        ...

    def partial(self, name: str) -> bool | None:
        """For an entry that is not a committed checkpoint: True if it is a directory (or prefix) holding only
        what tddist writes (a save or deletion cut off), False if it holds anything else; None if it is
        committed, missing, empty or not a directory."""
        ...

    def usage(self, name: str) -> Usage:
        """What the entry ``name`` takes (zero for a missing one)."""
        ...

    def leftovers(self, name: str) -> tuple[Leftover, ...]:
        """What interrupted saves left inside the entry ``name`` (always empty on a file system)."""
        ...

    def lock(self) -> HeldLock:
        """Take the root's lock for this process.

        Raises:
            RootLockedError: another live job holds it; the message names it.
        """
        ...


def disk_usage(path: str) -> int:
    """Bytes allocated on disk for ``path`` and everything below it (symbolic links not followed)."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return 0
    total = st.st_blocks * 512
    if stat.S_ISDIR(st.st_mode):
        for dirpath, dirnames, filenames in os.walk(path):
            for name in dirnames + filenames:
                try:
                    total += os.lstat(os.path.join(dirpath, name)).st_blocks * 512
                except FileNotFoundError:
                    pass
    return total


def remove_checkpoint(path: str) -> None:
    """Remove a checkpoint on a file system: first renamed away in one step, then removed.

    So a crash in the middle never leaves a half-deleted checkpoint under its
    own name, where it could look valid; ``recover`` removes the trash entry.

    Raises:
        OSError: ``path`` could not be renamed or removed.
    """
    if pinned(path):
        raise CheckpointPinnedError(f"{path} is pinned by an incremental save in progress; not deleted")
    fault_point("delete", 0)
    trash = fmt.trash_path(path)
    parent = os.path.dirname(trash)
    os.rename(path, trash)
    fault_point("trash", 0)
    if held(path):  # a save pinned it, or committed a reference to it, since this deletion was decided
        os.rename(trash, path)
        fsync_path(parent)  # back for good (a crash before this leaves a trash entry that ``recover`` restores)
        fault_point("untrash", 0)
        raise CheckpointPinnedError(
            f"{path} is pinned by an incremental save in progress, or referenced by a checkpoint beside it; not deleted"
        )
    fsync_path(parent)
    remove_tree(trash)
    logger.info("deleted checkpoint %s", path)


@dataclass(frozen=True)
class FileRoot:
    """A root on a file system (a ``Root``)."""

    target: str
    local = True

    def join(self, name: str) -> str:
        return os.path.join(self.target, name)

    def exists(self) -> bool:
        return os.path.isdir(self.target)

    def create(self) -> None:
        os.makedirs(self.target, exist_ok=True)

    def names(self) -> list[str]:
        try:
            return os.listdir(self.target)
        except (FileNotFoundError, NotADirectoryError):
            return []

    def partial(self, name: str) -> bool | None:
        path = self.join(name)
        if not os.path.isdir(path) or is_committed(path):
            return None
        try:
            return is_tddist_dir(path)
        except OSError:
            return None

    def usage(self, name: str) -> Usage:
        path = self.join(name)
        try:
            mtime = os.lstat(path).st_mtime
        except FileNotFoundError:
            return Usage(0, 0.0)
        return Usage(disk_usage(path), mtime)

    def leftovers(self, name: str) -> tuple[Leftover, ...]:
        return ()

    def lock(self) -> HeldLock:
        return FileLock.take(self.target)


@dataclass
class FileLock:
    """An ``fcntl.flock`` on ``<root>/LOCK_NAME`` (a ``HeldLock``); the kernel drops it when the process dies."""

    path: str
    fd: int

    @classmethod
    def take(cls, root: str) -> FileLock:
        """Lock the file in ``root`` (which must exist), recording this process as the holder.

        Raises:
            RootLockedError: another process holds it; the message names its host and pid.
        """
        path = os.path.realpath(os.path.join(root, LOCK_NAME))
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
        logger.debug("locked %s", path)
        return cls(path, fd)

    def release(self) -> None:
        """Unlock (the file stays)."""
        os.close(self.fd)

    def forget(self) -> None:
        """Close the child's copy of the descriptor only: the parent keeps its lock."""
        try:
            os.close(self.fd)
        except OSError:
            pass


def _holder(fd: int) -> str:
    try:
        info = json.loads(os.pread(fd, 4096, 0).decode() or "{}")
        return f"host {info.get('host', '?')}, pid {info.get('pid', '?')}, since {info.get('since', '?')}"
    except (OSError, ValueError):
        return "holder unknown: the lock file is unreadable"
