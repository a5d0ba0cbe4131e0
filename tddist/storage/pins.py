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
checkpoint away, and checks again, the pins and the committed checkpoints
beside it (``held``): a pin, or a manifest that references the checkpoint,
makes it rename the checkpoint back. A save publishes before it removes its
pins, so either the save's check of its holders sees the rename (the save
fails, nothing references a missing holder), or the deletion sees its pin or
its published manifest (a clean-up that decided before the commit cannot
delete what the commit references). A pin older than ``PIN_LEASE`` seconds was left by a
save that died: it is ignored and ``recover`` of the holder removes it.
"""

from __future__ import annotations

import json
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


def referenced_beside(target: str) -> bool:
    """Whether a committed checkpoint beside ``target`` references it (names it among its ``holders``).

    The writer puts ``holders`` before the manifest's large members, so only
    the first ``HEAD`` bytes of each manifest beside it are read.
    """
    parent, name = os.path.split(os.path.abspath(target))
    try:
        entries = os.listdir(parent)
    except OSError:
        return False
    for entry in entries:
        if entry != name and fmt.side_entry_kind(entry) is None and name in _holders_of(os.path.join(parent, entry)):
            return True
    return False


#: How much of a manifest ``referenced_beside`` reads: its members before ``index``, ``holders`` among them.
HEAD = 1 << 20


def _holders_of(path: str) -> list[str]:
    """The holders' names in the manifest of the directory checkpoint at ``path`` (none: not one, or none)."""
    try:
        with open(os.path.join(path, fmt.MANIFEST_NAME), "rb") as f:
            head = f.read(HEAD)
    except OSError:  # not a directory checkpoint (an archive holds no references tddist writes)
        return []
    return holders_in(head)


def holders_in(head: bytes) -> list[str]:
    """The holders' names in the first ``HEAD`` bytes of a manifest (none: it names none).

    Only the member ``holders`` is decoded, where the writer puts it, before
    the large members: the whole manifest is neither read nor parsed.
    """
    at = head.find(b'"holders":')
    if at < 0:
        return []
    try:
        holders, _end = json.JSONDecoder().raw_decode(head[at + len(b'"holders":') :].decode("utf-8", "replace"))
    except ValueError:
        return []
    return [str(h.get("name")) for h in holders if isinstance(h, dict)] if isinstance(holders, list) else []


def held(target: str) -> bool:
    """Whether the checkpoint at ``target`` must not be deleted now: pinned, or referenced beside it."""
    return pinned(target) or referenced_beside(target)
