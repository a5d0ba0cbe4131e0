"""The write side of every store (``ShardWriter``, its call order) and what the writers share (``WriterBase``).

A store's writer is where and how one rank's bytes of a save go: a
directory tree (``directory``) or one zip archive (``archive``), on a file
system or on object storage (``s3``); ``backends`` chooses it for a prefix.
The commit (``saving.commit.two_phase_commit``) drives a ``ShardWriter``
through its steps and knows nothing else about the store, so a new store is
a new ``ShardWriter`` (and a ``backends.Store``), not new branches in the
commit. The read side is ``opened``.
"""

from __future__ import annotations

import errno
import logging
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import Any, Protocol

import numpy as np
import torch

from .. import format as fmt
from ..checksum import checksum_bytes, tensor_bytes
from ..core.finite import is_floating
from ..core.sharding import Shard
from ..core.structure import describe_difference, structure_of
from ..core.types import (
    ArchiveEntryRow,
    ContainerName,
    Fragment,
    FragmentObject,
    Key,
    LocalShard,
    ManifestFiles,
    SaveItem,
    SaveOptions,
    SavePlan,
    Staging,
    StoredBytes,
    Structure,
)
from ..manifest.chunks import int_checksum
from ..manifest.merge import MergeCache, encode_boxes
from .publish import discard

logger = logging.getLogger(__name__)

#: Replicas of at most this many bytes are hashed on every rank and compared with rank 0's copy even without
#: ``check_replicas``: a small non-batched leaf whose value differs by rank (an RNG state, a step counter) is
#: refused instead of replicated silently; larger ones are compared only with ``check_replicas=True``.
REPLICA_DIGEST_BYTES = 64 * 1024


class ShardWriter(Protocol):
    """One rank's side of a save to one store; ``saving.commit.two_phase_commit`` calls it.

    Call order (rank 0 runs the "all ranks" steps too):

    1. (all ranks) ``plan()``: prepare this rank's part in memory (for an
       archive: hash and compress it) and return the ``SavePlan`` (target,
       container, bytes its region needs). Raises the error of a shard that could
       not be prepared; it becomes this rank's failure in the first round.
    2. (rank 0) ``open(plans)``: check the target, create the staging area
       and reserve every rank's region; return the ``Staging``. Cleans up
       after itself if it fails.
    3. (all ranks) ``write(staging)``: write this rank's part durably; return
       its ``Fragment``, the rank's vote.
    4. (rank 0) ``finalize(staging, manifest, fragments)``: write the
       manifest and its index (and an archive's central directory) durably.
    5. (rank 0) ``publish(staging)``: make the staging area the target, the
       commit point.
    6. (rank 0, once it committed and announced) ``retirement()``: the
       removal of the checkpoint that ``publish`` replaced (None if none), a
       function that never raises; the commit runs it at once, or a
       ``return_early`` save on its worker after resolving its future.

    7. (all ranks, once the commit is announced) ``committed()``: remember
       what this rank sent, the cached path of the next save (``MergeCache``).

    (rank 0) ``abort(staging)`` after a failure at any step from 3 on (and
    after a fault right after 2): remove what was staged; it never raises.

    A writer whose ``stages_alone`` is true can skip rank 0's step 2, once
    every rank knows the staging path (the commit's one-round path): then
    each rank calls ``plan()``, ``stage(path)`` (create the staging area, or
    find it created by another rank) and ``write``; rank 0 calls
    ``check_staged(created)`` (what ``open`` would check of the target, and
    the parent directories any rank created made durable) before
    ``finalize``. ``stages_alone`` depends only on the save's options, so it
    is the same on every rank.
    """

    target: str
    structure: Structure | None  # set by plan()

    @property
    def stages_alone(self) -> bool: ...

    def plan(self) -> SavePlan: ...

    def open(self, plans: list[SavePlan]) -> Staging: ...

    def write(self, staging: Staging) -> Fragment: ...

    def finalize(self, staging: Staging, manifest: ManifestFiles, fragments: list[Fragment]) -> None: ...

    def publish(self, staging: Staging) -> None: ...

    def stage(self, path: str) -> str | None: ...

    def check_staged(self, created: str | None) -> None: ...

    def retirement(self) -> Retirement | None: ...

    def abort(self, staging: Staging) -> None: ...

    def committed(self) -> None: ...


@dataclass(frozen=True)
class Retirement:
    """The removal of the checkpoint a commit replaced (protocol step 6).

    It holds only what the removal needs, so one deferred to a
    ``return_early`` save's worker keeps none of the save's leaves alive.
    Calling it never raises: the commit is announced already, so a failure
    only warns (``recover`` removes what is left) and every rank's outcome
    stays the same.
    """

    rank: int
    what: str  # the replaced checkpoint, as the warning names it
    remove: Callable[[], None]

    def __call__(self) -> None:
        try:
            self.remove()
        except Exception as e:  # an injected fault, an object store's error (discard itself warns on OSError)
            logger.warning("rank %d: could not remove %s (%s); tddist.recover will", self.rank, self.what, e)


class WriterBase:
    """What every store's writer shares: the options, this rank's shard and structure, the vote."""

    container: ContainerName = "directory"

    def __init__(self, options: SaveOptions, rank: int, shard: LocalShard | Exception, cache: MergeCache | None = None):
        self.options = options
        self.target = options.target
        self.rank = rank
        self.shard = shard
        self.cache = cache
        self.structure: Structure | None = None
        self.boxes = b""
        self.replaced: str | None = None  # rank 0, after publish: where the replaced checkpoint now lies
        self.pins: list[str] = []  # rank 0 of an incremental save: the pins of its holders, until it commits

    @property
    def stages_alone(self) -> bool:
        """False unless the store says otherwise: its rank 0 reserves or checks something before any rank writes."""
        return False

    def stage(self, path: str) -> str | None:
        """(one-round path) Create the staging area at ``path``; only writers that ``stages_alone`` can."""
        raise NotImplementedError(f"{type(self).__name__} cannot stage without rank 0")

    def check_staged(self, created: str | None) -> None:
        """(one-round path, rank 0) Check the target as ``open`` does; make the parents any rank created durable."""
        raise NotImplementedError(f"{type(self).__name__} cannot stage without rank 0")

    def retirement(self) -> Retirement | None:
        """The removal of the checkpoint that ``publish`` replaced (None when it replaced none); once."""
        replaced, self.replaced = self.replaced, None
        return None if replaced is None else self.removal(replaced)

    def removal(self, replaced: str) -> Retirement:
        """How ``replaced``, what ``publish`` recorded, is removed: here the path of the old checkpoint."""
        return Retirement(self.rank, replaced, partial(discard, replaced, readers=True))

    def local_shard(self) -> LocalShard:
        """The prepared shard, or the error that preparing it raised."""
        if isinstance(self.shard, Exception):
            raise self.shard
        return self.shard

    def make_plan(self, region_bytes: int = 0) -> SavePlan:
        """This rank's plan; rank 0's carries its whole structure (its own value is not sent anywhere)."""
        shard = self.local_shard()
        self.structure = structure_of(shard)
        self.boxes = encode_boxes([(item.writes, item.dtensor.box) for item in shard.items if item.dtensor is not None])
        return SavePlan(
            self.target,
            self.container,
            self.options.atomic,
            region_bytes,
            self.structure.digest,
            self.structure if self.rank == 0 else None,
            self.options.packing,
        )

    def check_reference(self, staging: Staging) -> None:
        """Refuse to write when this rank's structure differs from rank 0's, naming the difference."""
        assert self.structure is not None
        if staging.reference is not None and staging.reference.digest != self.structure.digest:
            raise describe_difference(self.structure, self.rank, staging.reference)

    def fragment(self, stored: dict[Key, StoredBytes], entries: tuple[ArchiveEntryRow, ...] = ()) -> Fragment:
        """This rank's vote: its rows, what it stored, and its DTensor boxes unless unchanged.

        The replicas this rank did not write are hashed too (all of them with
        ``check_replicas``, else those of at most ``REPLICA_DIGEST_BYTES``), so
        rank 0 can compare them with the copy it writes.
        """
        shard = self.local_shard()
        assert self.structure is not None
        check = self.options.check_replicas
        sums = []
        for item in shard.items:
            s = stored.get(item.key)
            if s is not None:
                sums.append(int_checksum(s.checksum))
            elif hashes_replica(item, check):
                sums.append(int_checksum(checksum_bytes(tensor_bytes(item.tensor))))
            else:
                sums.append(0)
        cache = self.cache
        unchanged = cache is not None and (cache.sent_digest, cache.sent_boxes) == (self.structure.digest, self.boxes)
        return Fragment(
            rank=self.rank,
            digest=self.structure.digest,
            node_rows=np.asarray([b[0] if b else 0 for b in shard.nodes.values()], dtype="<i8").tobytes(),
            lengths=np.asarray(
                [i.tensor.shape[i.placement.dim] if isinstance(i.placement, Shard) else 0 for i in shard.items],
                dtype="<i8",
            ).tobytes(),
            checksums=np.asarray(sums, dtype="<u8").tobytes(),
            **encode_stats([(stored.get(i.key), is_floating(fmt.dtype_name(i.tensor.dtype))) for i in shard.items]),
            boxes=None if unchanged else self.boxes,
            objects=tuple(FragmentObject(k, o.kind, o.value) for k, o in shard.objects.items()),
            entries=entries,
        )

    def committed(self) -> None:
        """Remember what this rank sent, once the save is committed (the cached path of the next save)."""
        if self.cache is not None and self.structure is not None:
            self.cache.committed(self.structure.digest, self.boxes)


def encode_stats(items: list[tuple[StoredBytes | None, bool]]) -> dict[str, Any]:
    """A vote's counts of non-finite values (``Fragment.non_finite``, ``uncounted``, ``largest``,
    ``largest_leaf``), from each leaf's stored bytes (None: not stored here) and whether its dtype is floating.

    Sparse, so that a vote of a clean state is as small as one without counts: the counts only of the rare
    chunks that hold a NaN or an Inf, the floating leaves stored without counts (none by tddist's writers;
    the merge records them as uncounted, never as finite), and one largest finite magnitude for the whole
    rank with the leaf that holds it, not one per leaf (8 bytes a leaf and rank: 31 MiB gathered at 4,096
    ranks x 1,000 leaves).
    """
    bad: list[int] = []
    uncounted: list[int] = []
    largest, largest_leaf = 0.0, -1
    for i, (s, floating) in enumerate(items):
        if s is None or not floating:
            continue
        if s.stats is None:
            uncounted.append(i)
            continue
        if s.stats.max_abs > largest:
            largest, largest_leaf = s.stats.max_abs, i
        if not s.stats.finite:
            bad += [i, s.stats.nan, s.stats.inf]
    return {
        "non_finite": np.asarray(bad, dtype="<u8").tobytes(),
        "uncounted": np.asarray(uncounted, dtype="<i8").tobytes(),
        "largest": largest,
        "largest_leaf": largest_leaf,
    }


def map_copy_on_write(path: str, nbytes: int) -> torch.Tensor:
    """The first ``nbytes`` of the file at ``path`` as a uint8 tensor mapped copy-on-write.

    ``torch.from_file`` reports a failing file system (EIO after a power
    loss, say) as a RuntimeError; this raises it as the OSError it is, so
    that readers report it as an I/O failure of the checkpoint.
    """
    try:
        return torch.from_file(path, shared=False, size=nbytes, dtype=torch.uint8)
    except RuntimeError as e:
        raise OSError(errno.EIO, f"cannot map {nbytes} bytes of {path!r}: {e}") from e


def hashes_replica(item: SaveItem, check_replicas: bool) -> bool:
    """Whether this rank's vote hashes ``item``, a replica it does not write, for rank 0 to compare
    (``ShardWriter.fragment``): every such replica with ``check_replicas``, else the small plain ones."""
    return not item.writes and (
        check_replicas or (item.dtensor is None and _nbytes(item.tensor) <= REPLICA_DIGEST_BYTES)
    )


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()
