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
from ...manifest.locate import CutFiles
from ...manifest.parse import check_manifest_size, paused_gc
from ..opened import ManifestBytes, OpenedCheckpoint
from ..pinned import read_stored_entry
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
    #: a directory checkpoint with references: where its data objects keep the chunks it holds itself
    #: (docs/format.md 13.3); None: each data object is the data file of section 2.3
    cuts: CutFiles | None = None

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

    def read_at(self, offset: int, n: int) -> bytes:
        """``n`` bytes of the archive object from ``offset`` (a ranged GET, If-Match its ETag)."""
        return self.get(self.url.key, offset, offset + n)[0] if n else b""

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


def open_s3(prefix: str) -> ManifestBytes:
    """Find the committed checkpoint at ``prefix`` and read its manifest (not validated here; its index is read
    once the manifest says how large it is: ``manifest.parse`` checks that size against ``MAX_INDEX_BYTES``).

    Raises:
        CheckpointNotFoundError: nothing committed is there (or the bucket does not exist).
        StorageError: the endpoint cannot be reached, the credentials are refused.
    """
    url = parse(prefix)
    client = s3_client()
    if url.archive:
        return _open_archive(url, client)
    return _open_directory(url, client)


def _read_manifest(client: Any, url: S3Url, key: str) -> tuple[bytes, dict[str, str]] | None:
    """The manifest object and its metadata, or None if it does not exist; its size is checked before its body
    is read (``check_manifest_size``)."""
    try:
        r = client.get_object(Bucket=url.bucket, Key=key)
        try:
            check_manifest_size(int(r.get("ContentLength", 0)), f"manifest s3://{url.bucket}/{key}")
        except ManifestError:
            r["Body"].close()
            raise
        return r["Body"].read(), dict(r.get("Metadata", {}))
    except client_errors() as e:
        if is_missing(e):
            return None
        raise s3_failed("reading the manifest of", url.url, e) from e


def _open_directory(url: S3Url, client: Any) -> ManifestBytes:
    found = _read_manifest(client, url, url.child(fmt.MANIFEST_NAME))
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
    return ManifestBytes(pin, raw, _DirectoryIndex(pin), where)


@dataclass(frozen=True)
class _DirectoryIndex:
    """The index object of a pinned generation (an ``IndexSource``): one ranged GET of the expected size, whose
    ``Content-Range`` must name exactly that size."""

    pin: S3Pin

    def read_index(self, size: int) -> bytes | None:
        pin = self.pin
        key = pin.data_key(fmt.INDEX_NAME)
        shown = f"index s3://{pin.url.bucket}/{key}"
        try:
            if size == 0:  # no range to ask for: the object's size alone
                data, total = b"", int(pin.client.head_object(Bucket=pin.url.bucket, Key=key).get("ContentLength", 0))
            else:
                r = pin.client.get_object(Bucket=pin.url.bucket, Key=key, Range=f"bytes=0-{size - 1}")
                total = _total_size(r.get("ContentRange", ""), r.get("ContentLength", -1))
                data = r["Body"].read(size) if total == size else b""
                r["Body"].close()
        except client_errors() as e:
            if is_missing(e):
                if pin.replaced():
                    raise pin.changed("the index") from None
                return None  # the parser refuses a version-2 manifest without one
            if error_code(e) in ("InvalidRange", "416"):  # an empty object, asked for bytes it lacks
                total = 0
            else:
                raise s3_failed("reading the index of", pin.url.url, e) from e
        if total != size:
            raise ManifestError(
                f"{shown} has {total} bytes, its manifest implies {size}; the checkpoint is damaged or was "
                f"tampered with (restore it from a copy)"
            )
        return data


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


def _open_archive(url: S3Url, client: Any) -> ManifestBytes:
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
        with paused_gc(), zipfile.ZipFile(_RangedFile(pin)) as zf:
            pin.entries = {zi.filename: zi for zi in zf.infolist()}
    except (zipfile.BadZipFile, ValueError, EOFError, NotImplementedError) as e:
        raise _not_a_zip(url, e) from None
    found = pin.entries.get(fmt.MANIFEST_NAME)
    if found is None:
        raise CheckpointNotFoundError(
            f"archive {url.url!r} has no {fmt.MANIFEST_NAME} entry; it is not a tddist checkpoint"
        )
    check_manifest_size(found.file_size, f"archive {url.url!r}: entry {found.filename!r}")
    raw = read_stored_entry(pin.read_at, found, found.file_size, f"archive {url.url!r}")
    return ManifestBytes(pin, raw, _ArchiveIndex(pin, pin.entries.get(fmt.INDEX_NAME)), where)


def _not_a_zip(url: S3Url, e: Exception) -> CorruptCheckpointError:
    return CorruptCheckpointError(f"{url.url!r} is not a readable zip archive ({e}); the checkpoint is damaged")


@dataclass(frozen=True)
class _ArchiveIndex:
    """The ``tddist.idx`` entry of a pinned archive object (an ``IndexSource``): its declared sizes first, then
    ranged GETs of exactly that many bytes."""

    pin: S3Pin
    entry: zipfile.ZipInfo | None

    def read_index(self, size: int) -> bytes | None:
        if self.entry is None:
            return None
        return read_stored_entry(self.pin.read_at, self.entry, size, f"archive {self.pin.url.url!r}")


def place_kept(opened: OpenedCheckpoint) -> OpenedCheckpoint:
    """``opened``, whose pin knows where its data objects keep its chunks when it references others' (a packed
    directory with ``holders``, docs/format.md 13.3: only the chunks it holds itself are in its objects)."""
    m, pin = opened.manifest, opened.pin
    if isinstance(pin, S3Pin) and not pin.archive and m.holders is not None and m.packing == "packed":
        pin.cuts = CutFiles.of(m)
    return opened
