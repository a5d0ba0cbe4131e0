"""Uploading bytes that lie in many buffers: byte ranges assembled from segments, single PUTs and multipart uploads.

A rank's data object (a packed data file, an archive region) is a sequence
of tensors' bytes at given offsets with zero padding between them. It is
described by ``Segment``s and never copied whole: each request body (one
part, at most ``part_size`` bytes, or a small object) is assembled when it is
sent, so a rank holds at most one body per upload thread beside its data.
"""

from __future__ import annotations

import bisect
import logging
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from functools import partial
from typing import Any

logger = logging.getLogger(__name__)

#: S3's smallest part (all but the last part of a multipart upload) and its largest part number.
MIN_PART = 5 << 20
MAX_PARTS = 10000
#: The part size of a rank's own objects (data files): large enough for few requests, small enough to spread.
PART_SIZE = 32 << 20


@dataclass(frozen=True, slots=True)
class Segment:
    """``data`` at ``offset`` of an object; the bytes no segment covers are zero."""

    offset: int
    data: memoryview


@dataclass(frozen=True, slots=True)
class Part:
    """Part ``number`` of a multipart upload: bytes ``[start, stop)`` of the object."""

    number: int
    start: int
    stop: int


def range_bytes(segments: Sequence[Segment], starts: Sequence[int], lo: int, hi: int) -> bytearray:
    """Bytes ``[lo, hi)`` of the object ``segments`` describe (sorted by offset; ``starts`` their offsets)."""
    out = bytearray(hi - lo)
    i = max(bisect.bisect_right(starts, lo) - 1, 0)
    while i < len(segments) and segments[i].offset < hi:
        s = segments[i]
        a, b = max(lo, s.offset), min(hi, s.offset + len(s.data))
        if a < b:
            out[a - lo : b - lo] = s.data[a - s.offset : b - s.offset]
        i += 1
    return out


def split(start: int, stop: int, part_size: int, first_number: int) -> list[Part]:
    """``[start, stop)`` cut into parts of ``part_size`` (the last one takes the rest, up to twice that)."""
    n = max(1, (stop - start) // part_size)
    bounds = [start + i * part_size for i in range(n)] + [stop]
    return [Part(first_number + i, bounds[i], bounds[i + 1]) for i in range(n)]


def upload_part(client: Any, bucket: str, key: str, upload_id: str, part: Part, body: bytes | bytearray) -> dict:
    r = client.upload_part(Bucket=bucket, Key=key, UploadId=upload_id, PartNumber=part.number, Body=body)
    return {"PartNumber": part.number, "ETag": r["ETag"]}


def run(tasks: Sequence[Callable[[], Any]], threads: int) -> list[Any]:
    """Run ``tasks`` on ``threads`` threads (one: here); re-raise the first error."""
    if threads <= 1 or len(tasks) <= 1:
        return [t() for t in tasks]
    with ThreadPoolExecutor(threads, thread_name_prefix="tddist-s3put") as pool:
        return list(pool.map(lambda t: t(), tasks))


def upload_object(
    client: Any, bucket: str, key: str, segments: Sequence[Segment], size: int, threads: int,
    metadata: dict[str, str] | None = None,
) -> None:  # fmt: skip
    """Write the object ``segments`` describe (``size`` bytes): one PUT when small, else a multipart upload.

    A failed multipart upload is aborted before the error is raised.
    """
    segments = sorted(segments, key=lambda s: s.offset)
    starts = [s.offset for s in segments]
    extra = {"Metadata": metadata} if metadata else {}
    if size <= PART_SIZE:
        client.put_object(Bucket=bucket, Key=key, Body=range_bytes(segments, starts, 0, size), **extra)
        return
    upload_id = client.create_multipart_upload(Bucket=bucket, Key=key, **extra)["UploadId"]
    try:
        parts = split(0, size, PART_SIZE, 1)

        def put(p: Part) -> dict:
            return upload_part(client, bucket, key, upload_id, p, range_bytes(segments, starts, p.start, p.stop))

        done = run([partial(put, p) for p in parts], threads)
        client.complete_multipart_upload(Bucket=bucket, Key=key, UploadId=upload_id, MultipartUpload={"Parts": done})
    except BaseException:
        try:
            client.abort_multipart_upload(Bucket=bucket, Key=key, UploadId=upload_id)
        except Exception as e:  # the error that got us here matters more; recover removes the upload later
            logger.warning("could not abort the multipart upload of s3://%s/%s: %s", bucket, key, e)
        raise
