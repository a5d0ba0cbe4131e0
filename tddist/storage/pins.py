"""Pins: an incremental save in progress keeps the checkpoints it references from being deleted.

A save that references a holder (``save(..., base=...)``) decides what to
reference before its commit; a clean-up running meanwhile (retention,
``tddist gc``) must not delete the holder between that decision and the
commit, after which the committed manifest itself keeps the holder (every
clean-up keeps what a kept checkpoint references). Rank 0 therefore creates
a pin beside each holder (``.<name>.tddist-pin-<32 hex digits>``, an empty
file) before it decides, checks the holders before it publishes, and removes
the pins once the save is committed or aborted.

A deletion (``roots.remove_checkpoint``) checks the pins, renames the
checkpoint away, and checks them again: a pin created between the two checks
makes it rename the checkpoint back. Either the save's check of its holders
sees the rename (the save fails, nothing references a missing holder) or the
deletion sees the pin. A pin older than ``PIN_LEASE`` seconds was left by a
save that died: it is ignored and ``recover`` of the holder removes it.
"""

from __future__ import annotations

import logging
import os
import time

from .. import format as fmt

logger = logging.getLogger(__name__)

#: Seconds a pin holds: far longer than a save takes to commit, after its decision.
PIN_LEASE = 3600.0


def pin(target: str) -> str:
    """Pin the checkpoint at ``target`` (a directory or archive on a file system); returns the pin to remove.

    Raises:
        OSError: the pin could not be created.
    """
    path = fmt.pin_path(target)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    os.close(fd)  # not made durable: a crash ends the save it protects, and a pin a crash lost protects nothing
    return path


def unpin(paths: list[str]) -> None:
    """Remove pins (never raises: a pin left behind expires)."""
    for p in paths:
        try:
            os.unlink(p)
        except OSError as e:
            logger.warning("could not remove pin %s (%s); it expires in %.0f s", p, e, PIN_LEASE)


def pinned(target: str) -> bool:
    """Whether a live pin (younger than ``PIN_LEASE``) holds the checkpoint at ``target``."""
    now = time.time()
    for p in fmt.pin_entries(target):
        try:
            if now - os.stat(p).st_mtime < PIN_LEASE:
                return True
        except FileNotFoundError:
            continue
    return False


def expired_pins(target: str) -> list[str]:
    """The pins of ``target`` that no longer hold it (``recover`` removes them)."""
    now = time.time()
    out = []
    for p in fmt.pin_entries(target):
        try:
            if now - os.stat(p).st_mtime >= PIN_LEASE:
                out.append(p)
        except FileNotFoundError:
            continue
    return out
