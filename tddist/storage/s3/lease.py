"""The lock of a root on object storage: a lease object, taken with a conditional PUT and renewed while held.

Object storage has no ``flock``, and a lock object alone would outlive a
crashed job. So the lock is a lease: ``<root>/.tddist-manager.lock``, created
with ``If-None-Match: *`` (only one PUT can create it), naming its holder
(host, pid, since) and how long it lasts unrenewed (``LEASE_SECONDS``). A
daemon thread of the holding process rewrites it every third of that time
with ``If-Match`` its last ETag. Releasing deletes it (``If-Match`` too).

A job that finds the lease taken looks at how long ago it was last written
(the service's own clock: its ``Date`` header against the object's
``Last-Modified``). A lease not renewed for its duration belongs to a dead
job and is taken over with ``If-Match`` its ETag (so only one job can take
it over); otherwise the job watches it until its duration has passed: a live
holder renews it meanwhile (its ETag changes) and the job is refused with
``RootLockedError``, a dead one does not and the lease is taken over. So a
second live job is refused within a third of the lease, and a crashed job's
root is free again a lease after its last renewal.

A holder whose renewals fail for a whole lease (a network partition, a
process stopped for that long) may lose the lease to another job; the
renewal thread then logs an error. The service must honour conditional
writes (AWS S3, MinIO, SeaweedFS and Ceph do).
"""

from __future__ import annotations

import atexit
import datetime
import email.utils
import json
import logging
import os
import socket
import threading
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

from ...errors import RootLockedError, StorageError
from .client import client_errors, error_code, is_missing, s3_client, s3_failed
from .url import S3Url, parse

logger = logging.getLogger(__name__)

#: How long a lease lasts without renewal; its holder renews it three times as often.
LEASE_SECONDS = 60.0
#: Attempts at taking a lease that keeps disappearing under us (released between our PUT and our GET).
_ATTEMPTS = 5

_live: set[Lease] = set()  # held by this process: released at exit, so the next job need not wait for them


@atexit.register
def _release_at_exit() -> None:
    for lease in list(_live):
        lease.release()


os.register_at_fork(after_in_child=_live.clear)  # a forked child never releases its parent's lease


def _refused(e: BaseException) -> bool:
    return error_code(e) in ("PreconditionFailed", "412", "ConditionalRequestConflict", "409")


@dataclass(frozen=True)
class _Seen:
    """The lease object as a job found it."""

    etag: str
    holder: dict
    age: float  # seconds since it was last written, by the service's clock

    @property
    def lease(self) -> float:
        value = self.holder.get("lease_seconds", LEASE_SECONDS)
        return float(value) if isinstance(value, (int, float)) and value > 0 else LEASE_SECONDS

    def describe(self) -> str:
        h = self.holder
        return f"host {h.get('host', '?')}, pid {h.get('pid', '?')}, since {h.get('since', '?')}"


@dataclass(eq=False)
class Lease:
    """A lease this process holds (a ``roots.HeldLock``), renewed by a daemon thread until released."""

    url: S3Url  # of the lease object
    root: str
    body: dict
    etag: str
    stop: threading.Event = field(default_factory=threading.Event)
    guard: threading.Lock = field(default_factory=threading.Lock)
    renewer: threading.Thread | None = None

    def start(self) -> None:
        _live.add(self)
        self.renewer = threading.Thread(target=self._renew_loop, daemon=True, name="tddist-lease")
        self.renewer.start()

    def _renew_loop(self) -> None:
        period = float(self.body["lease_seconds"]) / 3
        while not self.stop.wait(period):
            with self.guard:
                if self.stop.is_set():
                    return
                self.body["renewed"] = time.time()
                try:
                    self.etag = _put(self.url, self.body, if_match=self.etag)
                except client_errors() as e:
                    if _refused(e) or is_missing(e):
                        logger.error(
                            "the lease of checkpoint root %s was lost (%s): another job may have taken it over "
                            "after this process could not renew it for %.0f s; stop one of the jobs",
                            self.root, error_code(e), self.body["lease_seconds"],
                        )  # fmt: skip
                        return
                    logger.warning("could not renew the lease of %s (%s); trying again", self.root, e)

    def release(self) -> None:
        """Stop renewing and delete the lease object (unless another job has taken it over)."""
        _live.discard(self)
        self.stop.set()
        with self.guard:
            try:
                s3_client().delete_object(Bucket=self.url.bucket, Key=self.url.key, IfMatch=self.etag)
            except client_errors() as e:
                if not (_refused(e) or is_missing(e)):
                    logger.warning("could not delete the lease of %s (%s); it expires by itself", self.root, e)
        if self.renewer is not None and self.renewer is not threading.current_thread():
            self.renewer.join(timeout=10)

    def forget(self) -> None:
        """In a forked child: leave the object to the parent. The child has no renewal thread, and no lock is
        taken here (one held by a parent's thread at the fork would never be released in the child)."""
        _live.discard(self)


def _put(url: S3Url, body: dict, *, if_match: str = "", if_none_match: bool = False) -> str:
    kwargs: dict[str, Any] = {"Bucket": url.bucket, "Key": url.key, "Body": json.dumps(body).encode()}
    if if_match:
        kwargs["IfMatch"] = if_match
    if if_none_match:
        kwargs["IfNoneMatch"] = "*"
    return str(s3_client().put_object(**kwargs)["ETag"])


def _look(url: S3Url) -> _Seen | None:
    """The lease object now, or None if there is none."""
    try:
        r = s3_client().get_object(Bucket=url.bucket, Key=url.key)
        raw = r["Body"].read()
    except client_errors() as e:
        if is_missing(e):
            return None
        raise
    try:
        holder = json.loads(raw.decode() or "{}")
    except ValueError:
        holder = {}
    date = r.get("ResponseMetadata", {}).get("HTTPHeaders", {}).get("date")
    now = email.utils.parsedate_to_datetime(date) if date else datetime.datetime.now(datetime.timezone.utc)
    modified = r.get("LastModified") or now
    return _Seen(str(r.get("ETag", "")), holder if isinstance(holder, dict) else {}, (now - modified).total_seconds())


def take(root: str, lock_name: str) -> Lease:
    """Take the lease of ``root`` (its object ``lock_name``), waiting up to a lease to tell a dead holder.

    Raises:
        RootLockedError: another live job holds it.
        StorageError: the service cannot be reached, refuses the credentials or conditional writes.
        CheckpointNotFoundError: the bucket does not exist.
    """
    base = parse(root)
    url = S3Url(base.bucket, base.child(lock_name))
    body = {
        "host": socket.gethostname(),
        "pid": os.getpid(),
        "since": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "lease_seconds": LEASE_SECONDS,
        "token": uuid.uuid4().hex,
    }
    try:
        for _attempt in range(_ATTEMPTS):
            etag = _try_take(url, root, body)
            if etag:
                lease = Lease(url, root, body, etag)
                lease.start()
                logger.debug("took the lease %s", url.url)
                return lease
    except client_errors() as e:
        raise s3_failed("taking the lease of checkpoint root", root, e) from e
    raise StorageError(f"the lease object {url.url} of {root!r} kept changing; try again")


def _try_take(url: S3Url, root: str, body: dict) -> str:
    """One attempt: the new ETag, or "" when the object vanished meanwhile (try again)."""
    try:
        return _put(url, body, if_none_match=True)
    except client_errors() as e:
        if not _refused(e):
            raise
    seen = _look(url)
    if seen is None:
        return ""
    deadline = time.monotonic() + max(0.0, seen.lease - seen.age)
    while time.monotonic() < deadline:
        time.sleep(min(0.5, seen.lease / 12, max(0.0, deadline - time.monotonic())))
        now = _look(url)
        if now is None:
            return ""
        if now.etag != seen.etag:
            raise _locked(root, url, now)
    try:
        etag = _put(url, body, if_match=seen.etag)
    except client_errors() as e:
        if _refused(e) or is_missing(e):
            now = _look(url)
            if now is None:
                return ""
            raise _locked(root, url, now) from None
        raise
    logger.warning(
        "took over the lease of checkpoint root %s from %s: it was not renewed for %.0f s (that job is gone)",
        root, seen.describe(), seen.lease,
    )  # fmt: skip
    return etag


def _locked(root: str, url: S3Url, seen: _Seen) -> RootLockedError:
    return RootLockedError(
        f"checkpoint root {root!r} is in use by another live job ({seen.describe()}): it renews its lease "
        f"{url.url}. Two jobs saving into one root would retire each other's checkpoints. Stop that job, or "
        f"give this one another root; a crashed job's lease is taken over once it has not been renewed for "
        f"{seen.lease:.0f} s"
    )
