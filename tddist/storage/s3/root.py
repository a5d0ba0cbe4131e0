"""A root of checkpoints on object storage (``s3://bucket/prefix``): what is under it, and removing one checkpoint.

The object-storage side of ``roots.Root`` and of ``backends.Store.committed``
and ``delete`` (no torch). Under a root, each checkpoint is a prefix
``<prefix>/<name>/`` (a directory checkpoint: its manifest and generations)
or one object ``<prefix>/<name>.tdz`` (an archive). What an interrupted save
leaves there is inside the entry: a generation its manifest does not name,
or an unfinished multipart upload; ``recovery.recover`` removes both.

Removing a directory checkpoint deletes its manifest first (one request: the
checkpoint stops being committed at once, as a rename to a trash name does
on a file system), then its generations; a crash in between leaves a prefix
of generations without a manifest, which clean-up removes. An archive is one
DELETE. A committed checkpoint is deleted only while no incremental save pins
it and nothing beside it references it (``holds``).
"""

from __future__ import annotations

import datetime
import logging
from collections.abc import Iterator
from typing import Any

from ... import format as fmt
from ...errors import StorageError
from ..roots import Leftover, Usage
from .client import client_errors, is_missing, s3_client, s3_failed
from .holds import guarded_delete
from .pin import ARCHIVE_META, GENERATION_META, is_generation
from .url import S3Url, parse

logger = logging.getLogger(__name__)


def delete_prefix(client: Any, bucket: str, prefix: str) -> int:
    """Delete every object under ``prefix`` (1000 per request); return how many."""
    n = 0
    pages = client.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix)
    for page in pages:
        keys = [{"Key": o["Key"]} for o in page.get("Contents", [])]
        if keys:
            client.delete_objects(Bucket=bucket, Delete={"Objects": keys, "Quiet": True})
            n += len(keys)
    return n


def committed_generation(client: Any, url: S3Url) -> str | None:
    """The generation the committed manifest at ``url`` names, or None when nothing is committed there."""
    try:
        head = client.head_object(Bucket=url.bucket, Key=url.child(fmt.MANIFEST_NAME))
    except client_errors() as e:
        if is_missing(e):
            return None
        raise
    gen = head.get("Metadata", {}).get(GENERATION_META, "")
    return gen if is_generation(gen) else ""


def _objects(client: Any, bucket: str, prefix: str, delimiter: str = "") -> Iterator[dict]:
    """Every page of ``list_objects_v2`` under ``prefix``."""
    kwargs = {"Bucket": bucket, "Prefix": prefix}
    if delimiter:
        kwargs["Delimiter"] = delimiter
    yield from client.get_paginator("list_objects_v2").paginate(**kwargs)


def _uploads(client: Any, bucket: str, prefix: str) -> Iterator[dict]:
    """Every unfinished multipart upload under ``prefix``."""
    for page in client.get_paginator("list_multipart_uploads").paginate(Bucket=bucket, Prefix=prefix):
        yield from page.get("Uploads", [])


def _first_level(key: str, prefix: str) -> str:
    return key[len(prefix) :].split("/", 1)[0]


def names(root: str) -> list[str]:
    """The names directly under ``root``: prefixes, objects, and the targets of unfinished uploads.

    Raises:
        CheckpointNotFoundError: the bucket does not exist.
        StorageError: the listing failed.
    """
    url = parse(root)
    client, prefix = s3_client(), url.key + "/"
    found: set[str] = set()
    try:
        for page in _objects(client, url.bucket, prefix, "/"):
            found |= {_first_level(p["Prefix"], prefix) for p in page.get("CommonPrefixes", [])}
            found |= {_first_level(o["Key"], prefix) for o in page.get("Contents", [])}
        found |= {_first_level(u["Key"], prefix) for u in _uploads(client, url.bucket, prefix)}
    except client_errors() as e:
        raise s3_failed("listing", url.url, e) from e
    found.discard("")
    return sorted(found)


def exists(root: str) -> bool:
    """Whether any object lies under ``root`` (a prefix exists only through its objects).

    Raises:
        CheckpointNotFoundError: the bucket does not exist.
        StorageError: the listing failed.
    """
    url = parse(root)
    try:
        page = s3_client().list_objects_v2(Bucket=url.bucket, Prefix=url.key + "/", MaxKeys=1)
    except client_errors() as e:
        raise s3_failed("listing", url.url, e) from e
    return bool(page.get("Contents"))


def partial(entry: str) -> bool | None:
    """For the directory checkpoint ``entry``: None if it is committed or holds no object; True if it holds
    only generations (a save or deletion cut off); False if it holds anything else.

    Objects are listed, not prefixes: some services (SeaweedFS) list an emptied prefix for a while.
    """
    url = parse(entry)
    client, prefix = s3_client(), url.key + "/"
    ours: bool | None = None
    try:
        for page in _objects(client, url.bucket, prefix):
            for o in page.get("Contents", []):
                name = _first_level(o["Key"], prefix)
                if name == fmt.MANIFEST_NAME:
                    return None
                if not is_generation(name) or "/" not in o["Key"][len(prefix) :]:
                    ours = False
                elif ours is None:
                    ours = True
    except client_errors() as e:
        raise s3_failed("listing", url.url, e) from e
    return ours


def usage(entry: str) -> Usage:
    """The bytes of every object of ``entry`` (the object itself, or everything under its prefix) and the
    newest modification time."""
    url = parse(entry)
    client = s3_client()
    nbytes, mtime = 0, 0.0
    try:
        for page in _objects(client, url.bucket, url.key):
            for o in page.get("Contents", []):
                if o["Key"] == url.key or o["Key"].startswith(url.key + "/"):
                    nbytes += int(o["Size"])
                    mtime = max(mtime, o["LastModified"].timestamp())
    except client_errors() as e:
        raise s3_failed("listing", url.url, e) from e
    return Usage(nbytes, mtime)


def leftovers(entry: str) -> tuple[Leftover, ...]:
    """What interrupted saves left in ``entry``: generations beside the one its committed manifest names
    (none when nothing is committed: the entry as a whole is then what a save left), and unfinished uploads.
    """
    url = parse(entry)
    client = s3_client()
    try:
        found = _stray_generations(client, url) + _unfinished_uploads(client, url)
    except client_errors() as e:
        raise s3_failed("listing", url.url, e) from e
    return tuple(sorted(found, key=lambda x: x.path))


def _stray_generations(client: Any, url: S3Url) -> list[Leftover]:
    committed = committed_generation(client, url)
    if not committed:  # nothing committed (the entry is partial), or a manifest naming none (damaged)
        return []
    sizes: dict[str, list[float]] = {}
    prefix = url.key + "/"
    for page in _objects(client, url.bucket, prefix):
        for o in page.get("Contents", []):
            name = _first_level(o["Key"], prefix)
            if is_generation(name) and name != committed:
                got = sizes.setdefault(name, [0, 0.0])
                got[0] += int(o["Size"])
                got[1] = max(got[1], o["LastModified"].timestamp())
    return [Leftover(f"{url.url}/{name}/", "generation", int(n), t) for name, (n, t) in sizes.items()]


def _unfinished_uploads(client: Any, url: S3Url) -> list[Leftover]:
    found = []
    for u in _uploads(client, url.bucket, url.key):
        key = u["Key"]
        if key != url.key and not key.startswith(url.key + "/"):
            continue
        parts = client.get_paginator("list_parts").paginate(Bucket=url.bucket, Key=key, UploadId=u["UploadId"])
        nbytes = sum(int(p["Size"]) for page in parts for p in page.get("Parts", []))
        initiated = u.get("Initiated")
        when = initiated.timestamp() if isinstance(initiated, datetime.datetime) else 0.0
        found.append(Leftover(f"s3://{url.bucket}/{key}?uploadId={u['UploadId']}", "upload", nbytes, when))
    return found


def committed(target: str) -> bool:
    """Whether a checkpoint is committed at ``target``: a directory's manifest object, or an archive object
    tddist wrote. The manifest is not read (``read_manifest`` validates it).

    Raises:
        StorageError: the request failed (other than "not found").
    """
    url = parse(target)
    client = s3_client()
    try:
        if not url.archive:
            return committed_generation(client, url) is not None
        head = client.head_object(Bucket=url.bucket, Key=url.key)
    except client_errors() as e:
        if is_missing(e):
            return False
        raise s3_failed("looking at", url.url, e) from e
    return bool(head.get("Metadata", {}).get(ARCHIVE_META) == "archive")


def delete(target: str) -> None:
    """Remove the checkpoint at ``target``: a directory's manifest first (it is no longer committed), then
    every object under its prefix; an archive's object. A committed one is removed only while no incremental
    save pins it and no checkpoint beside it references it (``holds.guarded_delete``).

    Raises:
        CheckpointPinnedError: an incremental save pins it, or a checkpoint beside it references it; nothing
            was deleted.
        StorageError: a request failed; what is left is removed by ``tddist.recover`` or clean-up.
    """
    url = parse(target)
    client = s3_client()
    try:
        if url.archive or committed_generation(client, url) is not None:
            guarded_delete(url.url, lambda: _remove(client, url))
        else:  # torn: nothing can reference it (a save's check of its holders reads their manifests)
            _remove(client, url)
    except client_errors() as e:
        raise s3_failed("deleting", url.url, e, cls=StorageError) from e
    logger.info("deleted checkpoint %s", url.url)


def _remove(client: Any, url: S3Url) -> None:
    if url.archive:
        client.delete_object(Bucket=url.bucket, Key=url.key)
    else:
        client.delete_object(Bucket=url.bucket, Key=url.child(fmt.MANIFEST_NAME))
        delete_prefix(client, url.bucket, url.key + "/")
