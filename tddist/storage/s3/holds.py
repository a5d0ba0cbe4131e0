"""Pins and deletion markers on object storage: an incremental save and a clean-up kept apart (format 13.3).

An incremental save (``save(..., base=...)``) decides which chunks its
holders (checkpoints beside the target) have, then commits a manifest that
references them. A clean-up in another process (``tddist gc``, a manager's
retention) must not delete a holder between that decision and the commit.
A file system renames the checkpoint away and back (``storage/pins.py``);
an object store has no rename, so both sides leave a mark beside the
checkpoint, an empty object, and each looks for the other's:

- the save's rank 0 PUTs a **pin** (``.<name>.tddist-pin-<hex>``) before it
  decides, and before the commit checks, in this order, that no live
  **deletion marker** of the holder exists and that the holder still has the
  generation its ranks read (``check_holders``); it publishes, then deletes
  its pins;
- a deletion PUTs its marker (``.<name>.tddist-deleting-<hex>``), then looks
  for a live pin and for a committed checkpoint beside it whose ``holders``
  name it, and deletes only when it finds neither; then it removes its marker.

Either the save's check sees the marker (or the holder gone) and the save
fails with nothing committed, or the deletion, which marked after that check,
sees the pin, or the manifest the save published before unpinning. This
needs a listing to show every object whose PUT completed before it, which
S3 (since December 2020) and SeaweedFS guarantee.

A mark is live for a lease: a pin for ``pins.PIN_LEASE`` (an hour), a marker
for ``DELETION_LEASE``; a deletion that took more than half its lease to check
gives up instead of deleting, so a marker older than the lease belongs to a
deletion that will not delete (one cut off, or one that gave up), whatever the
clocks of two machines say within half a lease. ``recover`` of a checkpoint
removes its expired marks.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ... import format as fmt
from ..._faults import fault_point
from ...errors import CheckpointPinnedError, StorageError
from ..pins import HEAD, PIN_LEASE, holders_in
from .client import client_errors, is_missing, s3_client, s3_failed
from .url import SCHEME, S3Url, parse

logger = logging.getLogger(__name__)

#: Seconds a deletion marker holds. A deletion takes a few requests between its marker and its first DELETE;
#: one that took more than half of this gives up.
DELETION_LEASE = 600.0


@dataclass(frozen=True)
class Beside:
    """Where the marks of a checkpoint on object storage lie: its bucket, its parent prefix (``""`` or ending
    in ``/``) and its name (the last component of its key)."""

    bucket: str
    parent: str
    name: str

    @classmethod
    def of(cls, target: str) -> Beside:
        url = parse(target)
        parent, _, name = url.key.rpartition("/")
        return cls(url.bucket, parent + "/" if parent else "", name)

    def url(self, key: str) -> str:
        return f"{SCHEME}{self.bucket}/{key}"


@dataclass(frozen=True)
class Mark:
    """One pin or deletion marker found beside a checkpoint: its object key and its age in seconds."""

    key: str
    age: float


def pin(target: str) -> str:
    """(rank 0 of an incremental save) Pin the checkpoint at ``target``; returns the pin's URL for ``unpin``.

    Raises:
        StorageError: the PUT failed.
    """
    return _put(Beside.of(target), fmt.pin_name)


def unpin(pins: list[str]) -> None:
    """Delete pins (never raises: a pin left behind expires)."""
    for p in pins:
        url = parse(p)
        try:
            s3_client().delete_object(Bucket=url.bucket, Key=url.key)
        except client_errors() as e:
            logger.warning("could not delete pin %s (%s); it expires in %.0f s", p, e, PIN_LEASE)


def pinned(target: str) -> bool:
    """Whether a live pin (younger than ``PIN_LEASE``) holds the checkpoint at ``target``."""
    return any(m.age < PIN_LEASE for m in _marks(Beside.of(target), fmt.pins_prefix))


def being_deleted(target: str) -> bool:
    """Whether a live deletion marker (younger than ``DELETION_LEASE``) of the checkpoint at ``target`` exists."""
    return any(m.age < DELETION_LEASE for m in _marks(Beside.of(target), fmt.deletions_prefix))


def expired(target: str) -> list[str]:
    """The URLs of the pins and deletion markers of ``target`` that no longer hold (``recover`` removes them)."""
    b = Beside.of(target)
    old = [m for m in _marks(b, fmt.pins_prefix) if m.age >= PIN_LEASE]
    old += [m for m in _marks(b, fmt.deletions_prefix) if m.age >= DELETION_LEASE]
    return [b.url(m.key) for m in old]


def referenced_beside(target: str) -> bool:
    """Whether a committed directory checkpoint beside ``target`` names it among its ``holders`` (the first
    ``HEAD`` bytes of each manifest beside it are read)."""
    b = Beside.of(target)
    client = s3_client()
    try:
        for page in client.get_paginator("list_objects_v2").paginate(Bucket=b.bucket, Prefix=b.parent, Delimiter="/"):
            for p in page.get("CommonPrefixes", []):
                entry = p["Prefix"][len(b.parent) :].rstrip("/")
                if entry != b.name and not entry.startswith(".") and b.name in _holders_of(client, b, entry):
                    return True
    except client_errors() as e:
        raise s3_failed("listing the checkpoints beside", b.url(b.parent + b.name), e, cls=StorageError) from e
    return False


def guarded_delete(target: str, delete: Callable[[], None]) -> None:
    """Run ``delete`` (the removal of the committed checkpoint at ``target``) unless a save pins it or a
    checkpoint beside it references it, with this deletion's marker beside it meanwhile.

    Raises:
        CheckpointPinnedError: pinned, referenced, or the checks took over half of ``DELETION_LEASE``;
            nothing was deleted.
        StorageError: a request failed.
    """
    started = time.monotonic()
    marker = _put(Beside.of(target), fmt.deletion_name)
    try:
        fault_point("delete", 0)
        if pinned(target) or referenced_beside(target):
            raise CheckpointPinnedError(
                f"{target} is pinned by an incremental save in progress, or referenced by a checkpoint beside it; "
                f"not deleted"
            )
        if time.monotonic() - started > DELETION_LEASE / 2:
            raise CheckpointPinnedError(
                f"{target}: the checks before its deletion took over {DELETION_LEASE / 2:.0f} s, so a save may "
                f"have taken its marker for a stale one; not deleted (a later clean-up tries again)"
            )
        delete()
    finally:
        unpin([marker])


def _put(b: Beside, name: Callable[[str], str]) -> str:
    key = b.parent + name(b.name)
    try:
        s3_client().put_object(Bucket=b.bucket, Key=key, Body=b"")
    except client_errors() as e:
        raise s3_failed("marking", b.url(b.parent + b.name), e, cls=StorageError) from e
    return b.url(key)


def _marks(b: Beside, prefix: Callable[[str], str]) -> list[Mark]:
    """The marks of one kind beside the checkpoint, with their ages (from the store's modification times)."""
    client = s3_client()
    now = time.time()
    found = []
    try:
        for page in client.get_paginator("list_objects_v2").paginate(Bucket=b.bucket, Prefix=b.parent + prefix(b.name)):
            for o in page.get("Contents", []):
                found.append(Mark(o["Key"], now - o["LastModified"].timestamp()))
    except client_errors() as e:
        raise s3_failed("listing the marks of", b.url(b.parent + b.name), e, cls=StorageError) from e
    return found


def _holders_of(client: Any, b: Beside, entry: str) -> list[str]:
    """The holders named by the manifest of the directory checkpoint ``entry`` beside (none: not one)."""
    key = S3Url(b.bucket, b.parent + entry).child(fmt.MANIFEST_NAME)
    try:
        r = client.get_object(Bucket=b.bucket, Key=key, Range=f"bytes=0-{HEAD - 1}")
    except client_errors() as e:
        if is_missing(e):
            return []
        raise
    try:
        return holders_in(r["Body"].read())
    finally:
        r["Body"].close()
