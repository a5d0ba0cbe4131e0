"""The directory layout on object storage: data objects under a generation's prefix, then the manifest.

Object layout of ``s3://bucket/key`` (docs/format.md, "Object storage"):

    key/tddist.json                          the manifest: the commit point, written last
    key/tddist-gen-<32 hex>/tddist.idx       the manifest's index
    key/tddist-gen-<32 hex>/rank-NNNNN.data  each rank's packed data file (or rank-NNNNN/... with "memmap")

Rank 0 picks a fresh generation (``open``); every rank uploads its objects
under it (``write``); rank 0 uploads the index (``finalize``) and then the
manifest, whose metadata names the generation (``publish``: one PUT, atomic
on every S3-compatible service). An overwrite uploads a new generation, then
the new manifest, and only then deletes the old generation, so a reader holds
one generation whole or is told that the checkpoint changed. A generation no
committed manifest names is invisible to readers and removed by ``abort`` or
``recover``.
"""

from __future__ import annotations

import dataclasses
import logging
import uuid
from collections.abc import Callable
from functools import partial
from typing import Any

import numpy as np

from ... import format as fmt
from ..._faults import fault_point
from ...checksum import tensor_bytes
from ...core.types import Fragment, ManifestFiles, SavePlan, Staging
from ...errors import TargetError, TddistError
from ...manifest.locate import packed_offsets
from ..base import Retirement, WriterBase
from ..incremental import RankBase, identity_columns
from ..tdmeta import node_meta_files
from ..writer import stored_bytes
from .client import bucket_missing, client_errors, no_bucket, s3_client, s3_failed
from .holds import pin, unpin
from .incremental import Decided, check_holders, decide, eligible, read_base
from .pin import GENERATION_META, GENERATION_PREFIX, is_generation
from .root import committed_generation, delete_prefix
from .upload import Segment, run, upload_object
from .url import S3Url, parse

logger = logging.getLogger(__name__)

#: Threads uploading a rank's objects when the save asks for fewer (requests wait on the network).
MIN_THREADS = 8


def check_target(client: Any, url: S3Url) -> str | None:
    """Refuse a missing bucket, or a prefix holding objects tddist did not write; return the committed
    generation (None: none)."""
    if bucket_missing(client, url.bucket):
        raise no_bucket("a save to", url.url, url.bucket, 0, TargetError)
    page = client.list_objects_v2(Bucket=url.bucket, Prefix=url.key + "/", Delimiter="/", MaxKeys=1000)
    names = [o["Key"][len(url.key) + 1 :] for o in page.get("Contents", [])]
    names += [p["Prefix"][len(url.key) + 1 :].rstrip("/") for p in page.get("CommonPrefixes", [])]
    foreign = [n for n in names if n != fmt.MANIFEST_NAME and not is_generation(n)]
    if foreign:
        raise TargetError(
            f"target {url.url!r} holds objects tddist did not write ({', '.join(sorted(foreign)[:5])}); tddist "
            f"never deletes foreign data: choose another key or remove them yourself"
        )
    return committed_generation(client, url)


class S3DirectoryWriter(WriterBase):
    """One rank's side of a directory save to object storage (a ``storage.base.ShardWriter``)."""

    container = "directory"

    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.url = parse(self.target)
        self.old_generation: str | None = None  # rank 0: what the commit replaces
        self.uploaded: dict[tuple[str, int], memoryview] = {}  # (file, offset) -> bytes, see ``S3Pin.local``
        self.manifest = b""
        self.view: RankBase | None = None  # an incremental save: what this rank may reference of its base

    def _failed(self, what: str, e: BaseException) -> TddistError:
        return s3_failed(what, self.url.url, e, self.rank, TargetError)

    def plan(self) -> SavePlan:
        return self.make_plan()

    def open(self, plans: list[SavePlan]) -> Staging:
        """(rank 0) Check the target; pick the new generation (nothing is written yet)."""
        try:
            self.old_generation = check_target(s3_client(), self.url)
        except client_errors() as e:
            raise self._failed("preparing a save to", e) from e
        return Staging(GENERATION_PREFIX + uuid.uuid4().hex)

    def write(self, staging: Staging) -> Fragment:
        """Upload this rank's objects under the generation's prefix."""
        self.check_reference(staging)
        o, shard = self.options, self.local_shard()
        client = s3_client()
        prefix = self.url.child(staging.path)
        stored: dict = {}
        objects: list[tuple[str, list[Segment], int]] = []
        decided: Decided | None = None
        if o.packing == "packed" and o.base is not None:
            decided = self.decide_incremental(o.base)
            stored = decided.stored
            objects.append((fmt.rank_data_name(self.rank), self.kept_segments(decided), decided.size))
        elif o.packing == "packed":
            written = [(i.key, tensor_bytes(i.tensor), fmt.dtype_name(i.tensor.dtype)) for i in shard.items if i.writes]
            offsets, end = packed_offsets(np.array([a.size for _k, a, _d in written], dtype=np.int64))
            segments = []
            for (key, data, dtype), offset in zip(written, offsets):
                stored[key] = stored_bytes(data, dtype)
                if data.size:
                    segments.append(Segment(int(offset), memoryview(data.data).cast("B")))
                    self.uploaded[(fmt.rank_data_name(self.rank), int(offset))] = segments[-1].data
            objects.append((fmt.rank_data_name(self.rank), segments, int(end)))
        else:
            for key, t in shard.written().items():
                data = tensor_bytes(t)
                stored[key] = stored_bytes(data, fmt.dtype_name(t.dtype))
                if data.size:  # a chunk with no elements has no file (as in tensordict)
                    rel = fmt.leaf_relpath(self.rank, key, o.robust_key)
                    objects.append((rel, [Segment(0, memoryview(data.data).cast("B"))], int(data.size)))
                    self.uploaded[(rel, 0)] = objects[-1][1][0].data
            for rel, raw in node_meta_files(self.rank, shard, o.robust_key).items():
                objects.append((rel, [Segment(0, memoryview(raw))], len(raw)))
        threads = max(o.num_threads, MIN_THREADS)
        tasks: list[Callable[[], object]] = [
            partial(upload_object, client, self.url.bucket, f"{prefix}/{rel}", segs, size, threads)
            for rel, segs, size in objects
        ]
        tasks.insert(len(tasks) // 2, partial(fault_point, "midwrite", self.rank))
        try:
            run(tasks, min(threads, len(tasks)))
        except client_errors() as e:
            raise self._failed("uploading to", e) from e
        return self.fragment(stored) if decided is None else self.incremental_fragment(decided)

    def decide_incremental(self, base: str) -> Decided:
        """An incremental save: which of this rank's chunks its base's holders have (docs/format.md 13.3)."""
        items = self.local_shard().items
        if self.rank == 0 and eligible(base, self.target) is None:
            self.pins.append(pin(base))  # before this rank decides; ``check_holders`` looks again before the commit
        self.view = read_base(base, self.target, self.rank, items)
        if self.rank == 0 and self.view is not None:
            self.pins += [pin(fmt.holder_path(self.target, h.name)) for h in self.view.table[1:]]
        fault_point("pin", self.rank)
        return decide(items, self.rank, self.target, self.view, self.options.reuse_hashes)

    def kept_segments(self, decided: Decided) -> list[Segment]:
        """The data object of an incremental save: the chunks no holder has, at their kept offsets; each also
        remembered at its offset of section 2.3, where a load of what was saved looks for it."""
        segments = []
        name = fmt.rank_data_name(self.rank)
        for key, data, full, kept in zip(decided.keys, decided.datas, decided.full.tolist(), decided.kept.tolist()):
            if data.size and not decided.holders[key]:
                segments.append(Segment(int(kept), memoryview(data.data).cast("B")))
                self.uploaded[(name, int(full))] = segments[-1].data
        written = sum(len(s.data) for s in segments)
        logger.debug("rank %d: uploads %d bytes, references the rest of %s", self.rank, written, self.options.base)
        return segments

    def incremental_fragment(self, decided: Decided) -> Fragment:
        """This rank's vote with each leaf's holder and identity (a leaf it stores no bytes of: 0 and 0)."""
        items = self.local_shard().items
        return dataclasses.replace(
            self.fragment(decided.stored),
            holders=np.asarray([decided.holders.get(i.key, 0) for i in items], dtype="<i8").tobytes(),
            ids=identity_columns([decided.ids.get(i.key, 0) for i in items]),
            base=None if self.view is None else self.view.table,
        )

    def finalize(self, staging: Staging, manifest: ManifestFiles, fragments: list[Fragment]) -> None:
        """(rank 0) Upload the index into the generation; keep the manifest for ``publish``."""
        for table in {f.base for f in fragments if f.base is not None}:
            check_holders(self.target, table)  # an incremental save: its holders are still what it read
        key = self.url.child(f"{staging.path}/{fmt.INDEX_NAME}")
        try:
            s3_client().put_object(Bucket=self.url.bucket, Key=key, Body=manifest.index)
        except client_errors() as e:
            raise self._failed("uploading the index of", e) from e
        self.manifest = manifest.manifest

    def publish(self, staging: Staging) -> None:
        """(rank 0) The commit point: PUT the manifest naming the generation (``retirement`` deletes the old one)."""
        client = s3_client()
        try:
            client.put_object(
                Bucket=self.url.bucket,
                Key=self.url.child(fmt.MANIFEST_NAME),
                Body=self.manifest,
                Metadata={GENERATION_META: staging.path},
            )
        except client_errors() as e:
            raise self._failed("committing the manifest of", e) from e
        unpin(self.pins)  # committed: the manifest references the holders now
        self.pins = []
        fault_point("replace", 0)
        old = self.old_generation
        if old and old != staging.path:
            self.replaced = old

    def removal(self, replaced: str) -> Retirement:
        """(rank 0, once the commit is announced) The deletion of the generation the commit replaced."""
        return Retirement(
            0, f"the old generation {replaced} of {self.url.url}", partial(_delete_generation, self.url, replaced)
        )

    def abort(self, staging: Staging) -> None:
        """(rank 0) Delete what was uploaded under the generation, and the pins; never raises."""
        unpin(self.pins)
        self.pins = []
        try:
            delete_prefix(s3_client(), self.url.bucket, self.url.child(staging.path) + "/")
        except Exception as e:
            logger.warning(
                "rank 0: could not delete the staged generation of %s (%s); run tddist.recover", self.url.url, e
            )


def _delete_generation(url: S3Url, generation: str) -> None:
    """Delete every object of a replaced generation (``Retirement`` turns a failure into a warning)."""
    delete_prefix(s3_client(), url.bucket, url.child(generation) + "/")
