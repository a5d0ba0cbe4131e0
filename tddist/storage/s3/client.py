"""The boto3 client tddist uses for ``s3://`` prefixes, and turning its errors into tddist errors.

boto3 is imported here only, and only when an ``s3://`` prefix is used, so
tddist imports and works without it. The client reads the standard AWS
configuration (``AWS_ENDPOINT_URL``, credentials, profiles, region) and uses
botocore's "standard" retry mode, which retries throttling (503 SlowDown) and
transient network errors with backoff. One client per configuration is made
per process and shared by all threads (boto3 clients are thread-safe; making
one is not, and costs tens of milliseconds).
"""

from __future__ import annotations

import logging
import os
import threading
from typing import Any

from ...errors import CheckpointNotFoundError, StorageError, TddistError

logger = logging.getLogger(__name__)

#: Attempts per request (the first one included) unless ``AWS_MAX_ATTEMPTS`` or a profile says otherwise.
MAX_ATTEMPTS = 8
#: Connections per client: the thread pools of loads and saves share them.
MAX_POOL = 64

_ENV = (
    "AWS_ENDPOINT_URL",
    "AWS_ENDPOINT_URL_S3",
    "AWS_ACCESS_KEY_ID",
    "AWS_SECRET_ACCESS_KEY",
    "AWS_SESSION_TOKEN",
    "AWS_PROFILE",
    "AWS_REGION",
    "AWS_DEFAULT_REGION",
    "AWS_MAX_ATTEMPTS",
    "AWS_RETRY_MODE",
)
_lock = threading.Lock()
_clients: dict[tuple[str | None, ...], Any] = {}


def s3_client() -> Any:
    """The process's S3 client for the current AWS environment (made once per configuration).

    Raises:
        TddistError: boto3 is not installed.
    """
    key = tuple(os.environ.get(name) for name in _ENV)
    with _lock:
        client = _clients.get(key)
        if client is None:
            client = _clients[key] = _make_client()
        return client


def _make_client() -> Any:
    try:
        import boto3
        from botocore.config import Config
    except ImportError:
        raise TddistError("s3:// prefixes need boto3, which is not installed: pip install 'tddist[s3]'") from None
    retries: dict[str, Any] = {"mode": os.environ.get("AWS_RETRY_MODE", "standard")}
    if "AWS_MAX_ATTEMPTS" not in os.environ:
        retries["max_attempts"] = MAX_ATTEMPTS
    config = Config(retries=retries, max_pool_connections=MAX_POOL)
    session = boto3.session.Session()
    if session.region_name is None:  # S3-compatible services ignore it, botocore needs one to sign
        session = boto3.session.Session(region_name="us-east-1")
    return session.client("s3", config=config)


def endpoint() -> str:
    """Where requests go, for messages."""
    return os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL") or "AWS S3"


def error_code(e: BaseException) -> str:
    """The S3 error code of a botocore ClientError ("NoSuchKey", "SlowDown", "404", ...), else ""."""
    response = getattr(e, "response", None)
    if isinstance(response, dict):
        return str(response.get("Error", {}).get("Code", ""))
    return ""


def is_missing(e: BaseException) -> bool:
    """A request for an object (or upload) that does not exist."""
    return error_code(e) in ("NoSuchKey", "404", "NotFound", "NoSuchUpload")


def s3_failed(
    what: str, url: str, e: BaseException, rank: int | None = None, cls: type[TddistError] = StorageError
) -> TddistError:
    """The tddist error for a failed request: what failed, on which rank, and how to fix it.

    An unreachable endpoint, a missing bucket, refused or missing credentials
    each get their own advice; other errors keep the service's code and
    message. ``cls`` is the class for errors of the storage itself
    (``TargetError`` on a save, ``StorageError`` on a load).
    """
    who = f"rank {rank}: " if rank is not None else ""
    code = error_code(e)
    name = type(e).__name__
    if code == "NoSuchBucket":
        bucket = url[len("s3://") :].split("/", 1)[0]
        return no_bucket(what, url, bucket, rank, CheckpointNotFoundError if cls is StorageError else cls)
    if code in ("AccessDenied", "InvalidAccessKeyId", "SignatureDoesNotMatch", "403", "Forbidden") or name in (
        "NoCredentialsError",
        "PartialCredentialsError",
    ):
        return cls(
            f"{who}{what} {url!r} failed: the credentials were refused or are missing ({code or name}) at "
            f"{endpoint()}; set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY (or AWS_PROFILE) to credentials that "
            f"may read and write this bucket"
        )
    if name in ("EndpointConnectionError", "ConnectTimeoutError", "ConnectionClosedError", "ReadTimeoutError"):
        return cls(
            f"{who}{what} {url!r} failed: the endpoint {endpoint()} cannot be reached ({e}); check "
            f"AWS_ENDPOINT_URL and the network, then try again"
        )
    detail = f"{code}: {e}" if code else f"{name}: {e}"
    return cls(f"{who}{what} {url!r} failed ({detail}) at {endpoint()}")


def bucket_missing(client: Any, bucket: str) -> bool:
    """Whether ``bucket`` does not exist (a HEAD of the bucket answers 404).

    Asked before a save writes anything, and when a load finds no manifest: some services list a missing
    bucket as empty, or create it on the first PUT, so its absence is checked, not inferred.
    """
    try:
        client.head_bucket(Bucket=bucket)
        return False
    except client_errors() as e:
        if error_code(e) in ("404", "NoSuchBucket", "NotFound"):
            return True
        raise


def no_bucket(what: str, url: str, bucket: str, rank: int | None, cls: type[TddistError]) -> TddistError:
    """The error for a bucket that does not exist."""
    who = f"rank {rank}: " if rank is not None else ""
    return cls(
        f"{who}{what} {url!r} failed: the bucket {bucket!r} does not exist at {endpoint()}; create it first "
        f"(for example: aws s3 mb s3://{bucket}) or fix the URL"
    )


def client_errors() -> tuple[type[BaseException], ...]:
    """The exceptions a boto3 request raises (its ClientError and botocore's transport errors)."""
    from botocore.exceptions import BotoCoreError, ClientError

    return (ClientError, BotoCoreError)
