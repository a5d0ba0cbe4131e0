"""Every store tddist writes passes the same conformance tests (tests/store_conformance.py).

Local stores live under ``tmp_path``; the S3 stores on the real SeaweedFS
server of the session (``s3_env``), each test under a prefix of its own
(the ``s3`` fixture of tests/conftest.py). Each class says how to damage a
byte, what counts as a leftover and how to make an aborted save's clean-up
fail on its store.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator

import pytest

from tddist import format as fmt
from tddist._faults import inject
from tddist.errors import CheckpointChangedError
from tddist.manifest.locate import Location
from tddist.storage.s3.client import s3_client
from tddist.storage.s3.pin import GENERATION_META
from tests.helpers import leftovers
from tests.store_conformance import DTYPES, REQUIRED_DTYPES, StoreConformance, flip_file, stored_data_offset


def test_the_round_trip_holds_every_dtype_the_format_lists():
    """The conformance round trip saves every dtype of tddist.format, and those include the ones every store
    must hold."""
    assert {fmt.dtype_name(d) for d in DTYPES} == set(fmt._DTYPE_SIZES), DTYPES
    assert REQUIRED_DTYPES <= set(DTYPES), sorted(map(str, REQUIRED_DTYPES - set(DTYPES)))


# --- local stores ------------------------------------------------------------------------------


class LocalStore(StoreConformance):
    """A checkpoint in a directory of its own under ``tmp_path``."""

    name = "ckpt"
    tool_verifies = True

    @pytest.fixture
    def target(self, tmp_path) -> str:
        return str(tmp_path / self.name)

    def stray(self, target: str) -> list[str]:
        return leftovers(target, strict=True)

    def cleanup_fails(self) -> contextlib.AbstractContextManager:
        """Removing a tree on rank 0 raises after its first entry is gone, as when rank 0 dies there."""
        return inject("discard", 0)

    def flip(self, target: str, location: Location) -> None:
        flip_file(os.path.join(target, location.relpath), location.offset + location.nbytes // 2)


class TestPackedDirectory(LocalStore):
    layout, packing = "directory", "packed"


class TestMemmapDirectory(LocalStore):
    save_kwargs = {"layout": "memmap"}
    layout, packing = "directory", "memmap"


class TestArchive(LocalStore):
    name = "ckpt" + fmt.ARCHIVE_SUFFIX
    layout, packing = "archive", "memmap"
    #: the archive file stays open (and whole) once pinned, whatever replaces it at the path
    pinned_overwrite_error = None

    def flip(self, target: str, location: Location) -> None:
        with open(target, "rb") as f:
            raw = f.read()
        flip_file(target, stored_data_offset(raw, location.relpath) + location.offset + location.nbytes // 2)


# --- S3 stores ---------------------------------------------------------------------------------


def split(url: str) -> tuple[str, str]:
    """``s3://bucket/key`` -> (bucket, key)."""
    bucket, _, key = url.removeprefix("s3://").partition("/")
    return bucket, key


@contextlib.contextmanager
def failing(operation: str) -> Iterator[None]:
    """Every request ``operation`` of this process's S3 client fails before it is sent (no connection)."""

    from botocore.exceptions import EndpointConnectionError  # here: without boto3 the local stores still run

    def refuse(**_kw):
        raise EndpointConnectionError(endpoint_url="refused by the test")

    events = s3_client().meta.events
    events.register_first(f"before-call.s3.{operation}", refuse)
    try:
        yield
    finally:
        events.unregister(f"before-call.s3.{operation}", refuse)


class S3Store(StoreConformance):
    """A checkpoint under a prefix of its own in the test bucket."""

    suffix = ""
    #: the request whose failure leaves an aborted save's staged data behind
    cleanup_request: str

    @pytest.fixture
    def target(self, s3) -> str:
        _client, where = s3
        return f"s3://{where}/ckpt{self.suffix}"

    def committed(self, target: str) -> set[str] | None:
        """The keys of the committed checkpoint, a prefix of them (a directory's generation), or None."""
        raise NotImplementedError

    def stray(self, target: str) -> list[str]:
        """Objects under the test's prefix that are not the committed checkpoint, and unfinished uploads."""
        client = s3_client()
        bucket, key = split(target)
        prefix = key.rsplit("/", 1)[0] + "/"
        pages = client.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix)
        keep = self.committed(target) or set()
        found = [
            f"object {o['Key']}"
            for page in pages
            for o in page.get("Contents", [])
            if not any(o["Key"] == k or (k.endswith("/") and o["Key"].startswith(k)) for k in keep)
        ]
        uploads = client.list_multipart_uploads(Bucket=bucket, Prefix=prefix).get("Uploads", [])
        return sorted(found + [f"unfinished upload of {u['Key']}" for u in uploads])

    def cleanup_fails(self) -> contextlib.AbstractContextManager:
        return failing(self.cleanup_request)

    def rewrite(self, bucket: str, key: str, offset: int) -> None:
        """Download the object, invert the byte at ``offset``, upload it again with put_object (same metadata)."""
        client = s3_client()
        got = client.get_object(Bucket=bucket, Key=key)
        raw = bytearray(got["Body"].read())
        raw[offset] ^= 0xFF
        client.put_object(Bucket=bucket, Key=key, Body=bytes(raw), Metadata=got.get("Metadata", {}))


class TestS3Directory(S3Store):
    layout, packing = "directory", "packed"
    cleanup_request = "DeleteObjects"  # aborting deletes the staged generation's objects

    def generation(self, target: str) -> str | None:
        bucket, key = split(target)
        try:
            head = s3_client().head_object(Bucket=bucket, Key=f"{key}/{fmt.MANIFEST_NAME}")
        except s3_client().exceptions.ClientError:
            return None
        return head["Metadata"][GENERATION_META]

    def committed(self, target: str) -> set[str] | None:
        gen = self.generation(target)
        _bucket, key = split(target)
        return None if gen is None else {f"{key}/{fmt.MANIFEST_NAME}", f"{key}/{gen}/"}

    def flip(self, target: str, location: Location) -> None:
        bucket, key = split(target)
        data_key = f"{key}/{self.generation(target)}/{location.relpath}"
        self.rewrite(bucket, data_key, location.offset + location.nbytes // 2)


class TestS3Archive(S3Store):
    suffix = fmt.ARCHIVE_SUFFIX
    layout, packing = "archive", "memmap"
    cleanup_request = "AbortMultipartUpload"  # aborting ends the multipart upload of the ranks' parts
    #: the rewritten object has another ETag, and a pinned load's ranged GETs carry If-Match the old one
    pinned_flip_error = CheckpointChangedError

    def committed(self, target: str) -> set[str] | None:
        return {split(target)[1]}

    def flip(self, target: str, location: Location) -> None:
        bucket, key = split(target)
        raw = s3_client().get_object(Bucket=bucket, Key=key)["Body"].read()
        self.rewrite(bucket, key, stored_data_offset(raw, location.relpath) + location.offset + location.nbytes // 2)
