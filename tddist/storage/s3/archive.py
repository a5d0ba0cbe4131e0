"""The archive layout on object storage: ONE object, written by every rank as parts of one multipart upload.

The object's bytes are exactly a ``.tdz`` archive (docs/format.md section 3):
rank ``r``'s region, then the next rank's, then the index, the manifest and
the central directory. S3 wants every part but the last to be at least 5 MiB,
so each region is zero-padded to at least ``MIN_PART`` (regions are already
zero-padded to 64 bytes; readers find entries through the central directory
and ignore what lies between regions). Steps, on the commit's protocol:

1. (all) ``plan``: hash and compress the entries (as ``ArchiveWriter``).
2. (rank 0) ``open``: check the key, assign the regions' offsets, create the
   multipart upload (``Staging.path`` is its upload id). Every rank derives
   the same part numbers from the regions (``assign_parts``).
3. (all) ``write``: upload this rank's parts.
4. (rank 0) ``finalize``: upload the index, the manifest and the central
   directory as the last part; list the parts, checking every one is there
   with the size it must have. ``publish``: complete the upload, the commit
   point: only now does anything appear under the key (an existing archive is
   replaced in one step).

``abort`` (rank 0, after any failure) aborts the upload; ``recover`` aborts
the uploads a crash left.

One rank whose region is at most ``PART_SIZE`` needs neither parts nor
padding: it keeps the archive in memory and ``publish`` uploads it with one
PUT (``Staging.path`` is then empty).
"""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import Any

from ... import format as fmt
from ..._faults import fault_point
from ...core.types import Fragment, ManifestFiles, SavePlan, Staging
from ...errors import TargetError, TddistError
from ..archive import ArchiveWriter
from ..zipcodec import ALIGN, place_entries, tail_bytes
from .client import bucket_missing, client_errors, error_code, is_missing, no_bucket, s3_client, s3_failed
from .pin import ARCHIVE_META
from .upload import MAX_PARTS, MIN_PART, PART_SIZE, Part, Segment, range_bytes, run, split, upload_part
from .url import parse

logger = logging.getLogger(__name__)

#: Threads uploading a rank's parts (each holds one part body, up to twice the part size, in memory).
THREADS = 4


@dataclass(frozen=True, slots=True)
class PartLayout:
    """Every rank's parts of the upload, and the number of the last part (the tail, uploaded by rank 0)."""

    parts: tuple[tuple[Part, ...], ...]
    tail_number: int


def assign_parts(starts: tuple[int, ...], end: int) -> PartLayout:
    """The parts of each region ``[starts[r], starts[r + 1])`` (the last ends at ``end``); the same on every rank.

    The part size grows with the archive so that all parts fit S3's 10,000.
    """
    bounds = [*starts, end]
    world = len(starts)
    if world + 1 > MAX_PARTS:
        raise TargetError(
            f"an archive on object storage is one multipart upload of at most {MAX_PARTS} parts, one or more per "
            f"rank; {world} ranks need more: save a directory checkpoint (without .tdz) instead"
        )
    budget = MAX_PARTS - 1 - world
    size = max(PART_SIZE, -(-(end - (starts[0] if starts else 0)) // max(budget, 1)))
    size = -(-size // (1 << 20)) << 20
    parts, number = [], 1
    for r in range(world):
        mine = tuple(split(bounds[r], bounds[r + 1], size, number))
        parts.append(mine)
        number += len(mine)
    return PartLayout(tuple(parts), number)


class S3ArchiveWriter(ArchiveWriter):
    """One rank's side of an archive save to object storage (a ``storage.base.ShardWriter``)."""

    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.url = parse(self.target)
        self.completed_parts: list[dict] = []
        self.whole = b""  # one small rank: the whole archive, uploaded by ``publish``
        self.uploaded: dict[tuple[str, int], memoryview] = {}  # (entry, 0) -> uncompressed bytes, see ``S3Pin.local``

    def _failed(self, what: str, e: BaseException) -> TddistError:
        return s3_failed(what, self.url.url, e, self.rank, TargetError)

    def open(self, plans: list[SavePlan]) -> Staging:
        """(rank 0) Check the key, lay the (padded) regions out, create the multipart upload."""
        client = s3_client()
        if len(plans) == 1 and plans[0].region_bytes <= PART_SIZE:  # one small rank: one PUT at the commit
            try:
                self._check_target(client)
            except client_errors() as e:
                raise self._failed("preparing a save to", e) from e
            return Staging("", (0,), plans[0].region_bytes)
        try:
            self._check_target(client)
            starts, end = [], 0
            for p in plans:
                starts.append(end)
                end += max(p.region_bytes, MIN_PART)  # every region's last part must be 5 MiB or more
            layout = assign_parts(tuple(starts), end)
            upload = client.create_multipart_upload(
                Bucket=self.url.bucket, Key=self.url.key, Metadata={ARCHIVE_META: "archive"}
            )
        except client_errors() as e:
            raise self._failed("preparing a save to", e) from e
        assert layout.tail_number <= MAX_PARTS
        return Staging(upload["UploadId"], tuple(starts), end)

    def _check_target(self, client: Any) -> None:
        """The bucket must exist; an existing object at the key must be a tddist archive (its metadata says so)."""
        if bucket_missing(client, self.url.bucket):
            raise no_bucket("a save to", self.url.url, self.url.bucket, 0, TargetError)
        try:
            head = client.head_object(Bucket=self.url.bucket, Key=self.url.key)
        except client_errors() as e:
            if error_code(e) in ("404", "NoSuchKey", "NotFound"):
                return
            raise
        if head.get("Metadata", {}).get(ARCHIVE_META) != "archive":
            raise TargetError(
                f"archive target {self.url.url!r} exists and was not written by tddist; tddist never deletes "
                f"foreign data: choose another key or remove it yourself"
            )

    def write(self, staging: Staging) -> Fragment:
        """Upload this rank's region as its parts of the upload."""
        self.check_reference(staging)
        start = staging.region_start(self.rank)
        place_entries(self.entries, start)
        segments = []
        for e in self.entries:
            segments.append(Segment(e.offset, memoryview(e.header)))
            pos = e.offset + len(e.header)
            payload: list[bytes | memoryview] = list(e.pieces) or [e.data[lo:hi] for lo, hi in e.blocks]
            for piece in payload:
                segments.append(Segment(pos, memoryview(piece)))
                pos += len(piece)
        starts = [s.offset for s in segments]
        self.uploaded = {(e.name, 0): e.data for e in self.entries}
        if not staging.path:  # uploaded whole by publish
            self.whole = bytes(range_bytes(segments, starts, 0, staging.end))
            fault_point("midwrite", self.rank)
            return self.entries_fragment()
        client = s3_client()
        mine = assign_parts(staging.region_starts, staging.end).parts[self.rank]

        def put(p: Part) -> dict:
            body = range_bytes(segments, starts, p.start, p.stop)
            return upload_part(client, self.url.bucket, self.url.key, staging.path, p, body)

        tasks: list[Callable[[], object]] = [partial(put, p) for p in mine]
        tasks.insert(len(tasks) // 2, partial(fault_point, "midwrite", self.rank))
        try:
            run(tasks, min(max(self.options.num_threads, THREADS), len(tasks)))
        except client_errors() as e:
            raise self._failed("uploading to", e) from e
        return self.entries_fragment()

    def finalize(self, staging: Staging, manifest: ManifestFiles, fragments: list[Fragment]) -> None:
        """(rank 0) Upload the tail as the last part; check every part is there with its size."""
        rows = [row for f in fragments for row in f.entries]
        tail = tail_bytes(staging.end, {fmt.INDEX_NAME: manifest.index, fmt.MANIFEST_NAME: manifest.manifest}, rows)
        if not staging.path:
            self.whole += tail
            return
        layout = assign_parts(staging.region_starts, staging.end)
        client = s3_client()
        try:
            upload_part(client, self.url.bucket, self.url.key, staging.path, Part(layout.tail_number, 0, 0), tail)
            listed = {}
            pages = client.get_paginator("list_parts").paginate(
                Bucket=self.url.bucket, Key=self.url.key, UploadId=staging.path
            )
            for page in pages:
                for p in page.get("Parts", []):
                    listed[int(p["PartNumber"])] = (p["ETag"], int(p["Size"]))
        except client_errors() as e:
            raise self._failed("uploading the central directory of", e) from e
        expected = {p.number: p.stop - p.start for mine in layout.parts for p in mine}
        expected[layout.tail_number] = len(tail)
        wrong = [n for n, size in expected.items() if listed.get(n, ("", -1))[1] != size]
        if wrong or len(listed) != len(expected):
            raise TargetError(
                f"rank 0: the upload of {self.url.url!r} lacks parts or has parts of the wrong size "
                f"({len(wrong)} of {len(expected)}, first: part {wrong[:1]}); nothing was committed, save again"
            )
        self.completed_parts = [{"PartNumber": n, "ETag": listed[n][0]} for n in sorted(expected)]
        assert staging.end % ALIGN == 0

    def publish(self, staging: Staging) -> None:
        """(rank 0) The commit point: complete the upload, and the archive appears under the key whole."""
        try:
            if not staging.path:
                s3_client().put_object(
                    Bucket=self.url.bucket, Key=self.url.key, Body=self.whole, Metadata={ARCHIVE_META: "archive"}
                )
                return
            s3_client().complete_multipart_upload(
                Bucket=self.url.bucket,
                Key=self.url.key,
                UploadId=staging.path,
                MultipartUpload={"Parts": self.completed_parts},
            )
        except client_errors() as e:
            if self._completed():  # the service completed it, the answer was lost: it is committed
                logger.warning("rank 0: completing %s reported %s, but the archive is there whole", self.url.url, e)
                return
            raise self._failed("completing the upload of", e) from e

    def _completed(self) -> bool:
        """Whether the object at the key is this upload (its ETag is the multipart ETag of these parts: the MD5
        of the parts' MD5s and their count, as S3 and the services that follow it compute it)."""
        digests = b"".join(bytes.fromhex(p["ETag"].strip('"')) for p in self.completed_parts)
        expected = f'"{hashlib.md5(digests).hexdigest()}-{len(self.completed_parts)}"'
        try:
            head = s3_client().head_object(Bucket=self.url.bucket, Key=self.url.key)
        except Exception:
            return False
        return bool(head.get("ETag") == expected)

    def abort(self, staging: Staging) -> None:
        """(rank 0) Abort the upload: its parts are discarded, nothing appears under the key; never raises."""
        if not staging.path:
            return
        try:
            s3_client().abort_multipart_upload(Bucket=self.url.bucket, Key=self.url.key, UploadId=staging.path)
        except Exception as e:
            if not is_missing(e):
                logger.warning("rank 0: could not abort the upload of %s (%s); run tddist.recover", self.url.url, e)
