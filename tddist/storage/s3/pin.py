"""A committed checkpoint on object storage, opened once: where its objects are, and its manifest's bytes.

Object-storage counterpart of ``pinned.PinnedCheckpoint`` (no torch here):

- a directory checkpoint is pinned by its manifest object: the generation it
  names (``tddist-generation`` in the object's metadata) is the prefix every
  data object is read from. An overwrite commits a new manifest naming a new
  generation and then deletes the old one, so a load either finds every
  object of the generation it pinned or is told the checkpoint changed;
- an archive is pinned by its ETag: every ranged GET carries ``If-Match``, so
  a load never mixes bytes of two archives (412 means it was replaced).
"""

from __future__ import annotations

import re
import zipfile
from dataclasses import dataclass, field
from typing import Any

from ... import format as fmt
from ...errors import CheckpointChangedError, CheckpointNotFoundError, CorruptCheckpointError, ManifestError
from ..opened import ManifestBytes
from .client import bucket_missing, client_errors, error_code, is_missing, no_bucket, s3_client, s3_failed
from .url import S3Url, parse

#: The metadata member (``x-amz-meta-tddist-generation``) of a directory's manifest object.
GENERATION_META = "tddist-generation"
#: The metadata member marking an archive object as tddist's.
ARCHIVE_META = "tddist-layout"
GENERATION_PREFIX = "tddist-gen-"
_GENERATION = re.compile(r"[0-9a-f]{32}")
#: The part of an archive's end read at once when it is opened (end records and, usually, the central directory).
TAIL_BYTES = 64 << 10


def is_generation(name: str) -> bool:
    """True for a generation's prefix name, ``tddist-gen-`` and 32 lower-case hex digits."""
    return name.startswith(GENERATION_PREFIX) and _GENERATION.fullmatch(name[len(GENERATION_PREFIX) :]) is not None


@dataclass
class S3Pin:
    """One committed checkpoint on object storage, as the load found it."""

    url: S3Url
    client: Any
    archive: bool
    generation: str = ""  # a directory's data prefix name (``tddist-gen-...``)
    size: int = 0  # an archive's object size
    etag: str = ""  # an archive's ETag, sent with If-Match
    entries: dict[str, zipfile.ZipInfo] = field(default_factory=dict)  # an archive's central directory
    #: bytes this process uploaded to this generation, by (file or entry name, offset): a save reads its own
    #: shard back from them instead of downloading what it just uploaded
    local: dict[tuple[str, int], memoryview] = field(default_factory=dict)

    @property
    def path(self) -> str:
        return self.url.url

    def data_key(self, relpath: str) -> str:
        """The object key of a directory checkpoint's file ``relpath`` (in the pinned generation)."""
        return self.url.child(f"{self.generation}/{relpath}")

    def get(self, key: str, start: int, stop: int) -> tuple[bytes, int]:
        """Bytes ``[start, stop)`` of object ``key`` and the object's whole size (a ranged GET)."""
        kwargs: dict[str, Any] = {"Bucket": self.url.bucket, "Key": key, "Range": f"bytes={start}-{stop - 1}"}
        if self.etag:
            kwargs["IfMatch"] = self.etag
        try:
            r = self.client.get_object(**kwargs)
            data = r["Body"].read()
        except client_errors() as e:
            if error_code(e) in ("PreconditionFailed", "412"):
                raise self.changed("the archive") from None
            if is_missing(e):
                raise self.missing(key) from None
            raise s3_failed("reading", f"s3://{self.url.bucket}/{key}", e) from e
        total = _total_size(r.get("ContentRange", ""), r.get("ContentLength", len(data)))
        if len(data) != stop - start:
            raise CorruptCheckpointError(
                f"s3://{self.url.bucket}/{key}: asked for bytes [{start}, {stop}), got {len(data)} (the object has "
                f"{total}); the checkpoint is damaged or truncated"
            )
        return data, total

    def missing(self, key: str) -> Exception:
        """A data object the manifest names is gone: the checkpoint was replaced meanwhile, or is damaged."""
        if self.replaced():
            return self.changed(f"object {key!r}")
        return CorruptCheckpointError(f"object s3://{self.url.bucket}/{key} is missing; the checkpoint is damaged")

    def changed(self, what: str) -> CheckpointChangedError:
        return CheckpointChangedError(
            f"checkpoint {self.path!r} was replaced while it was being read ({what} of the old one is gone); "
            f"load it again"
        )

    def replaced(self) -> bool:
        """Whether the committed manifest names another generation now (or is gone)."""
        try:
            if self.archive:
                head = self.client.head_object(Bucket=self.url.bucket, Key=self.url.key)
                return bool(head.get("ETag", "") != self.etag)
            head = self.client.head_object(Bucket=self.url.bucket, Key=self.url.child(fmt.MANIFEST_NAME))
            return bool(head.get("Metadata", {}).get(GENERATION_META) != self.generation)
        except client_errors():
            return True

    def close(self) -> None:
        """Nothing is held open (an ``opened.Pin``)."""


def _no_bucket(client: Any, url: S3Url) -> bool:
    try:
        return bucket_missing(client, url.bucket)
    except client_errors() as e:
        raise s3_failed("opening", url.url, e) from e


def _total_size(content_range: str, default: int) -> int:
    """The object size from a ``Content-Range: bytes a-b/total`` header."""
    _, _, total = content_range.rpartition("/")
    return int(total) if total.isdigit() else int(default)


def open_s3(prefix: str, max_manifest: int, max_index: int) -> ManifestBytes:
    """Find the committed checkpoint at ``prefix`` and read its manifest and index (not validated here).

    Raises:
        CheckpointNotFoundError: nothing committed is there (or the bucket does not exist).
        StorageError: the endpoint cannot be reached, the credentials are refused.
    """
    url = parse(prefix)
    client = s3_client()
    if url.archive:
        return _open_archive(url, client, max_manifest, max_index)
    return _open_directory(url, client, max_manifest, max_index)


def _read_object(client: Any, url: S3Url, key: str, limit: int, what: str) -> tuple[bytes, dict[str, str]] | None:
    """A whole small object and its metadata, or None if it does not exist; larger than ``limit`` is refused."""
    try:
        r = client.get_object(Bucket=url.bucket, Key=key)
        if int(r.get("ContentLength", 0)) > limit:
            r["Body"].close()
            raise ManifestError(f"{what} s3://{url.bucket}/{key} has {r['ContentLength']} bytes; refusing it")
        return r["Body"].read(), dict(r.get("Metadata", {}))
    except client_errors() as e:
        if is_missing(e):
            return None
        raise s3_failed(f"reading the {what} of", url.url, e) from e


def _open_directory(url: S3Url, client: Any, max_manifest: int, max_index: int) -> ManifestBytes:
    found = _read_object(client, url, url.child(fmt.MANIFEST_NAME), max_manifest, "manifest")
    if found is None and _no_bucket(client, url):
        raise no_bucket("opening", url.url, url.bucket, None, CheckpointNotFoundError)
    if found is None:
        raise CheckpointNotFoundError(
            f"checkpoint {url.url!r} has no committed manifest (s3://{url.bucket}/{url.child(fmt.MANIFEST_NAME)}); "
            f"if a save to it was interrupted, tddist.recover({url.url!r}) removes what it left"
        )
    raw, meta = found
    where = f"manifest s3://{url.bucket}/{url.child(fmt.MANIFEST_NAME)}"
    generation = meta.get(GENERATION_META, "")
    if not is_generation(generation):
        raise ManifestError(
            f"{where} does not name its data generation (metadata {GENERATION_META!r} is {generation!r}); it was "
            f"not written by tddist or was tampered with"
        )
    pin = S3Pin(url, client, archive=False, generation=generation)
    got = _read_object(client, url, pin.data_key(fmt.INDEX_NAME), max_index, "index")
    if got is None and pin.replaced():
        raise pin.changed("the index")
    return ManifestBytes(pin, raw, None if got is None else got[0], where)


class _RangedFile:
    """A read-only, seekable file over one object, for ``zipfile``: ranged GETs (If-Match the ETag), with the
    object's last ``TAIL_BYTES`` (its end records and central directory) read at once."""

    def __init__(self, pin: S3Pin):
        self.pin, self.pos = pin, 0
        start = max(0, pin.size - TAIL_BYTES)
        self.window = (start, pin.get(pin.url.key, start, pin.size)[0] if pin.size else b"")

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self.pos

    def seek(self, offset: int, whence: int = 0) -> int:
        self.pos = offset if whence == 0 else self.pos + offset if whence == 1 else self.pin.size + offset
        return self.pos

    def read(self, n: int = -1) -> bytes:
        stop = self.pin.size if n < 0 else min(self.pin.size, self.pos + n)
        if stop <= self.pos:
            return b""
        start, data = self.window
        if not (start <= self.pos and stop <= start + len(data)):
            lo, hi = self.pos, max(stop, min(self.pin.size, self.pos + (256 << 10)))
            self.window = start, data = lo, self.pin.get(self.pin.url.key, lo, hi)[0]
        out = data[self.pos - start : stop - start]
        self.pos = stop
        return out

    def close(self) -> None:
        pass


def _open_archive(url: S3Url, client: Any, max_manifest: int, max_index: int) -> ManifestBytes:
    try:
        head = client.head_object(Bucket=url.bucket, Key=url.key)
    except client_errors() as e:
        if is_missing(e) and _no_bucket(client, url):
            raise no_bucket("opening", url.url, url.bucket, None, CheckpointNotFoundError) from None
        if is_missing(e):
            raise CheckpointNotFoundError(
                f"checkpoint {url.url!r} does not exist; if a save to it was interrupted, "
                f"tddist.recover({url.url!r}) aborts what it left"
            ) from None
        raise s3_failed("opening", url.url, e) from e
    pin = S3Pin(url, client, archive=True, size=int(head["ContentLength"]), etag=head.get("ETag", ""))
    where = f"manifest of archive {url.url!r}"
    try:
        with zipfile.ZipFile(_RangedFile(pin)) as zf:
            pin.entries = {zi.filename: zi for zi in zf.infolist()}
            raw = _entry(zf, pin.entries.get(fmt.MANIFEST_NAME), max_manifest, url)
            index = _entry(zf, pin.entries.get(fmt.INDEX_NAME), max_index, url)
    except (zipfile.BadZipFile, ValueError, EOFError, NotImplementedError) as e:
        raise CorruptCheckpointError(
            f"{url.url!r} is not a readable zip archive ({e}); the checkpoint is damaged"
        ) from None
    if raw is None:
        raise CheckpointNotFoundError(
            f"archive {url.url!r} has no {fmt.MANIFEST_NAME} entry; it is not a tddist checkpoint"
        )
    return ManifestBytes(pin, raw, index, where)


def _entry(zf: zipfile.ZipFile, zi: zipfile.ZipInfo | None, limit: int, url: S3Url) -> bytes | None:
    """A manifest or index entry: stored (as the format requires) and bounded."""
    if zi is None:
        return None
    if zi.compress_type != zipfile.ZIP_STORED or zi.file_size > limit or zi.compress_size != zi.file_size:
        raise ManifestError(f"archive {url.url!r}: entry {zi.filename!r} is compressed or too large; refusing it")
    return zf.read(zi)
