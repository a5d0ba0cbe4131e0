"""Fault injection at named points of the commit, for the test suite.

Set ``TDDIST_FAULT=<point>:<rank>:<action>[,...]`` or use ``inject()``
in-process. The points are listed in ``commit.py``'s docstring. With nothing
set this is one dict lookup. Actions:

- ``raise``: raise ``InjectedFault``;
- ``kill``: SIGKILL this process (a crashed rank: what it wrote stays in the
  page cache and reaches the disk later);
- ``powercut``: shut the file system named by ``TDDIST_POWERCUT_PATH`` (any
  path on it, such as its mount point) down with ``FS_IOC_GOINGDOWN`` and
  ``FSOP_GOING_FLAGS_NOLOGFLUSH``, then SIGKILL this process. Everything not
  yet fsynced is lost, and from then on every access to that file system
  fails with EIO, as if the machine had lost power. It needs CAP_SYS_ADMIN
  and a file system that supports the call (ext4, XFS); unmount and mount it
  again to replay its journal;
- ``hang``: sleep forever (the process's other threads go on);
- ``stop``: SIGSTOP this process: every thread stops, as under a debugger or
  on a swapped-out node (a store this rank hosts stops answering too);
- ``delay``: sleep one second, then go on;
- (``inject`` only) a function: called there, on the thread that reached the
  point, so a test runs another process's step exactly between two of this
  one's.

``TDDIST_FAULT_THREAD=<prefix>`` strikes only threads whose name starts with
``<prefix>`` (the commit of a background save runs on ``tddist-save-rank<r>``),
so a fault can hit a background commit and not a foreground one of the same
rank number.

``TDDIST_NO_EXCHANGE=1`` (or ``without_exchange()`` in-process) makes
``publish`` behave as where ``renameat2(RENAME_EXCHANGE)`` is unsupported, so
an existing checkpoint is replaced through a backup name.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import signal
import struct
import threading
import time
from collections.abc import Callable, Iterator

from .errors import InjectedFault

ENV = "TDDIST_FAULT"
POWERCUT_ENV = "TDDIST_POWERCUT_PATH"
NO_EXCHANGE_ENV = "TDDIST_NO_EXCHANGE"
THREAD_ENV = "TDDIST_FAULT_THREAD"
FS_IOC_GOINGDOWN = 0x8004587D  # _IOR('X', 125, __u32), shared by XFS and ext4
FSOP_GOING_FLAGS_NOLOGFLUSH = 2  # do not flush the log: what was not fsynced is lost
_injected: dict[tuple[str, int], str | Callable[[], None]] = {}
_no_exchange: list[bool] = []


def _from_env() -> dict[tuple[str, int], str]:
    spec = os.environ.get(ENV, "")
    out = {}
    for item in filter(None, spec.split(",")):
        point, rank, action = item.split(":")
        out[(point, int(rank))] = action
    return out


def fault_point(point: str, rank: int) -> None:
    """Fail here if a fault was injected for (point, rank)."""
    action = _injected.get((point, rank))
    if action is None and ENV in os.environ:
        action = _from_env().get((point, rank))
    if action is None or not threading.current_thread().name.startswith(os.environ.get(THREAD_ENV, "")):
        return
    if callable(action):
        action()
        return
    if action == "raise":
        raise InjectedFault(f"rank {rank}: injected failure at commit step {point!r}")
    if action == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    if action == "powercut":
        power_cut(os.environ.get(POWERCUT_ENV, ""))
    if action == "hang":
        while True:
            time.sleep(3600)
    if action == "stop":
        os.kill(os.getpid(), signal.SIGSTOP)
        return
    if action == "delay":
        time.sleep(1.0)
        return
    raise ValueError(f"unknown fault action {action!r}")


def power_cut(path: str) -> None:
    """Shut down the file system holding ``path`` without flushing its log, then SIGKILL this process.

    Raises OSError (and the process lives on) when the file system cannot be
    shut down, so a test sees that no cut happened.
    """
    if not path:
        raise ValueError(f"the fault action 'powercut' needs {POWERCUT_ENV} set to a path on the file system to cut")
    shut_down(path)
    os.kill(os.getpid(), signal.SIGKILL)


def shut_down(path: str) -> None:
    """Shut down the file system holding ``path`` without flushing its log: from now on its I/O fails with EIO."""
    fd = os.open(path, os.O_RDONLY)
    try:
        fcntl.ioctl(fd, FS_IOC_GOINGDOWN, struct.pack("I", FSOP_GOING_FLAGS_NOLOGFLUSH))
    finally:
        os.close(fd)


def exchange_disabled() -> bool:
    """True when tests make ``publish`` replace through a backup name instead of RENAME_EXCHANGE."""
    return bool(_no_exchange) or os.environ.get(NO_EXCHANGE_ENV) == "1"


@contextlib.contextmanager
def inject(point: str, rank: int, action: str | Callable[[], None] = "raise") -> Iterator[None]:
    """In-process fault injection (thread communicator tests)."""
    _injected[(point, rank)] = action
    try:
        yield
    finally:
        _injected.pop((point, rank), None)


@contextlib.contextmanager
def without_exchange() -> Iterator[None]:
    """In-process: ``publish`` behaves as where RENAME_EXCHANGE is unsupported."""
    _no_exchange.append(True)
    try:
        yield
    finally:
        _no_exchange.pop()
