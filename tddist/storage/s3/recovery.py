"""Removing what interrupted saves left on object storage (no torch).

A directory save leaves generations (``key/tddist-gen-.../``) that no
committed manifest names, and large objects' unfinished multipart uploads; an
archive save leaves an unfinished multipart upload of ``key``. Neither is
visible to readers, but both are billed. ``recover`` removes them, and the
pins and deletion markers beside the key past their lease (``holds``); like the
file-system ``recover``, run it only when no save to the key is in progress.
"""

from __future__ import annotations

import logging
from typing import Any

from ...errors import StorageError
from .client import client_errors, s3_client, s3_failed
from .holds import expired, unpin
from .pin import is_generation
from .root import committed_generation, delete_prefix
from .url import S3Url, parse

logger = logging.getLogger(__name__)


def recover(target: str) -> list[str]:
    """Abort the key's unfinished multipart uploads, delete its uncommitted generations and its expired pins and
    deletion markers; say what was done.

    Raises:
        StorageError: a request failed (unreachable endpoint, missing bucket, refused credentials).
    """
    url = parse(target)
    client = s3_client()
    try:
        done = _abort_uploads(client, url)
        if not url.archive:
            done += _remove_generations(client, url)
    except client_errors() as e:
        raise s3_failed("recovering", url.url, e, cls=StorageError) from e
    stale = expired(url.url)
    unpin(stale)
    done += [f"removed {m} (a pin or deletion marker past its lease)" for m in stale]
    for line in done:
        logger.info("recover: %s", line)
    return done


def _abort_uploads(client: Any, url: S3Url) -> list[str]:
    done = []
    for page in client.get_paginator("list_multipart_uploads").paginate(Bucket=url.bucket, Prefix=url.key):
        for u in page.get("Uploads", []):
            key = u["Key"]
            if key == url.key or key.startswith(url.key + "/"):
                client.abort_multipart_upload(Bucket=url.bucket, Key=key, UploadId=u["UploadId"])
                done.append(f"aborted the unfinished upload {u['UploadId']} of s3://{url.bucket}/{key}")
    return done


def _remove_generations(client: Any, url: S3Url) -> list[str]:
    committed = committed_generation(client, url)
    if committed == "":
        return [f"kept every generation under {url.url}: its manifest names none (damaged?); nothing was removed"]
    done = []
    names = set()
    for page in client.get_paginator("list_objects_v2").paginate(
        Bucket=url.bucket, Prefix=url.key + "/", Delimiter="/"
    ):
        names |= {p["Prefix"][len(url.key) + 1 :].rstrip("/") for p in page.get("CommonPrefixes", [])}
    for name in sorted(names):
        if is_generation(name) and name != committed:
            n = delete_prefix(client, url.bucket, url.child(name) + "/")
            if n:  # some services list an emptied prefix for a while; there is nothing to remove then
                done.append(f"removed {url.url}/{name}/ ({n} objects of an uncommitted or replaced save)")
    return done
