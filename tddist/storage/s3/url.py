"""``s3://bucket/key`` prefixes: recognising and parsing them (no boto3 needed)."""

from __future__ import annotations

from dataclasses import dataclass

from ... import format as fmt
from ...errors import InvalidArgumentError

SCHEME = "s3://"


def is_s3(prefix: object) -> bool:
    """True if ``prefix`` is a string naming an object-storage checkpoint (``s3://...``)."""
    return isinstance(prefix, str) and prefix.startswith(SCHEME)


@dataclass(frozen=True, slots=True)
class S3Url:
    """A checkpoint on object storage: the bucket and the key (no leading or trailing ``/``)."""

    bucket: str
    key: str

    @property
    def url(self) -> str:
        return f"{SCHEME}{self.bucket}/{self.key}"

    @property
    def archive(self) -> bool:
        """An archive (one object at ``key``) when the key ends in ``.tdz``; else a directory (objects under ``key/``)."""
        return self.key.endswith(fmt.ARCHIVE_SUFFIX)

    def child(self, name: str) -> str:
        """The key of ``name`` under the directory prefix ``key/``."""
        return f"{self.key}/{name}"


def parse(prefix: str) -> S3Url:
    """Split ``s3://bucket/key`` into bucket and key; refuse what cannot name a checkpoint."""
    rest = prefix[len(SCHEME) :]
    bucket, _, key = rest.partition("/")
    key = key.rstrip("/")
    if not bucket or not key:
        raise InvalidArgumentError(
            f"{prefix!r} does not name a checkpoint: use s3://bucket/key (a directory checkpoint) or "
            f"s3://bucket/key.tdz (an archive); the bucket itself cannot be a checkpoint"
        )
    parts = key.split("/")
    if any(p in ("", ".", "..") for p in parts) or "\0" in key:
        raise InvalidArgumentError(f"{prefix!r}: the key has an empty, '.' or '..' component; use a plain key")
    return S3Url(bucket, key)
