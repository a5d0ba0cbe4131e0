"""Public entry points: choosing the communicator and delegating (the arguments are checked by ``arguments``).

No I/O happens here; ``commit`` runs the protocol, ``writer`` and ``reader``
touch files.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future
from dataclasses import replace
from typing import Any, TypeVar, cast

import torch
from tensordict import TensorDict

from ._version import __version__
from .arguments import check_budget, check_device, check_int, check_s3, check_save_args, save_options, target_of
from .comm.base import Communicator, LocalComm
from .comm.collective import run_step
from .comm.resolve import resolve
from .core.sharding import Box, PerRank
from .core.tree import build, normalize_keys, select
from .core.types import Fragment, Key, LoadOptions, LocalShard, ManifestFiles, SavedRows, SaveOptions, Structure
from .errors import CheckpointChangedError, InvalidArgumentError, StorageError, TargetError, TddistError
from .loading import per_rank as pr
from .loading.into import fill
from .loading.read import read_leaves
from .loading.share import LoadReport, check_exclude, in_scope, leaf_box, node_rows, object_value, shard_request
from .manifest.merge import PlanCache, merge_fragments
from .manifest.model import Manifest
from .manifest.v2 import encode
from .saving import background
from .saving.commit import Retire, two_phase_commit
from .saving.prepare import prepare_shard
from .saving.snapshot import Snapshotter
from .storage.archive import ArchiveWriter
from .storage.directory import DirectoryWriter
from .storage.open import OpenedCheckpoint, open_checkpoint
from .storage.open import read_manifest as _read_manifest
from .storage.recovery import recover as _recover
from .storage.s3.archive import S3ArchiveWriter
from .storage.s3.client import s3_client
from .storage.s3.directory import S3DirectoryWriter
from .storage.s3.pin import S3Pin
from .storage.s3.recovery import recover as s3_recover
from .storage.s3.url import is_s3

logger = logging.getLogger(__name__)


def save(
    data: Any,
    prefix: str | os.PathLike,
    *,
    comm: Any = None,
    placements: Mapping | None = None,
    num_threads: int = 0,
    return_early: bool = False,
    snapshot_budget: int | None = None,
    async_writer: str = "thread",
    atomic: bool = True,
    metadata: Mapping | None = None,
    copy_existing: bool = False,
    share_non_tensor: bool = False,
    robust_key: bool = True,
    allow_pickle: bool = False,
    check_replicas: bool = False,
    wait_for_pending: bool = True,
    timeout: float | None = None,
    archive: bool | None = None,
    compression: Any = None,
    layout: str | None = None,
) -> TensorDict | Future:
    """Save ``data`` (this rank's shard) collectively to the checkpoint ``prefix``.

    Every rank of ``comm`` calls it with data of the same structure. Leaves
    under a TensorDict with batch dims are sharded along dim 0 (the global
    batch is the ranks' rows in rank order); other leaves are replicated and
    written once, each by one rank (shared out by size). The checkpoint appears at ``prefix`` all at once,
    complete and checksummed, or not at all. See docs/parameters.md for how
    each option compares with tensordict's ``memmap``.

    Args:
        data: this rank's TensorDict, tensorclass or nested dict of tensors,
            DTensors and JSON-able values.
        prefix: the checkpoint directory, or an archive path ending in
            ``.tdz``; on S3-compatible object storage ``s3://bucket/key`` (a
            directory) or ``s3://bucket/key.tdz`` (an archive), see
            docs/object_storage.md (needs ``pip install 'tddist[s3]'``).
        comm: a torch ProcessGroup, an mpi4py communicator or a tddist
            ``Communicator``; None detects it (torch.distributed, MPI,
            torchrun's environment, else one process).
        placements: ``{key: tddist.Shard(dim) | tddist.Replicate()}`` for a
            leaf or a node, overriding the default placement.
        num_threads: threads that write (and hash) this rank's bytes; 0 or 1
            writes on the calling thread.
        return_early: return a Future as soon as the data is snapshotted; the
            write and the commit run in the background.
        snapshot_budget: with ``return_early``, the most bytes of host
            memory the snapshot may take. A larger shard is copied through
            buffers of that size while the background writes them, and
            ``save`` returns once its last byte is copied (packed directory
            layout only). See docs/parameters.md.
        async_writer: with ``return_early``, where the commit runs:
            "thread" (the default: a worker thread of this process) or
            "process" (a persistent writer process per rank, fed through
            shared memory, with its own gloo group; torch.distributed and
            single processes only, MPI falls back to "thread"). See
            docs/parameters.md.
        atomic: False writes into the target itself (directories only); the
            manifest is still written last.
        metadata: a JSON-able dict stored in the manifest.
        copy_existing: allow leaves memory-mapped from a file (for example
            loaded from a checkpoint); their bytes are copied.
        share_non_tensor: the returned TensorDict keeps non-tensor values in
            shared memory, as tensordict does.
        robust_key: percent-encode keys in file names (tensordict's escaping);
            False uses them verbatim and refuses unsafe ones.
        allow_pickle: store non-tensor values that JSON cannot represent with pickle.
        check_replicas: compare every rank's copy of each replicated leaf
            with the copy that is written (by the rank the leaf is given to).
        wait_for_pending: wait for this communicator's asynchronous save in
            flight; False raises ``SaveInProgressError`` instead.
        timeout: seconds any collective may take (default 600 or
            ``TDDIST_TIMEOUT``).
        archive: write one ``.tdz`` zip archive; None infers it from the suffix.
        compression: an archive's compression: None, "deflate", "bzip2",
            "lzma", "zstd", a zipfile constant, ``(name, level)`` or "name:level".
        layout: how a directory checkpoint stores each rank's chunks:
            "packed" (the default: one data file per rank) or "memmap" (one
            file per leaf, each rank directory loadable with
            ``TensorDict.load_memmap``). Archives store one entry per leaf.

    Returns:
        This rank's saved shard, memory-mapped copy-on-write from the
        committed checkpoint, once it is durable on every rank; with
        ``return_early`` a ``concurrent.futures.Future`` of it.

    Raises:
        InvalidArgumentError: an invalid option (on the rank that passed it,
            before any collective).
        InvalidDataError: data that cannot be checkpointed as given (on every rank).
        ShardingError: the ranks' shards do not fit together (on every rank).
        TargetError: the target may not be replaced, or cannot be written;
            or (on one rank) the committed checkpoint could not be opened
            afterwards because the file system failed: it is saved.
        CommError: a peer died or the transport broke; the target then holds
            the previous checkpoint or, if rank 0 committed, the new one.
        CollectiveError: ranks failed with different errors.
    """
    check_save_args(prefix, num_threads, metadata)
    check_budget(snapshot_budget, return_early, check_replicas, archive, layout, prefix)
    if is_s3(prefix):
        check_s3(prefix, snapshot_budget, async_writer, archive)
    if async_writer not in ("thread", "process") or (async_writer == "process" and snapshot_budget is not None):
        raise InvalidArgumentError(
            f"async_writer={async_writer!r} is not supported: use 'thread' or 'process' (snapshot_budget needs "
            f"'thread')"
        )
    options = save_options(
        prefix, metadata, robust_key, num_threads, check_replicas, atomic, share_non_tensor, allow_pickle, archive,
        compression, layout,
    )  # fmt: skip
    c = resolve(comm, timeout)
    ch = background.channel(c)
    ch.wait_idle(wait_for_pending, options.target)

    def prepare(buffers: Snapshotter | None) -> LocalShard | Exception:
        return prepare_shard(
            data,
            c.rank,
            c.size,
            cast(Any, buffers),
            placements=placements,
            robust_key=robust_key,
            allow_pickle=allow_pickle,
            copy_existing=copy_existing,
            layouts=ch.layouts,
        )

    if not return_early:
        return _commit_and_open(c, options, prepare(None), ch.plans)
    options = replace(options, num_threads=max(num_threads, 1))

    def open_saved(o: SaveOptions, s: LocalShard) -> TensorDict:
        return _commit_and_open(c, o, s, ch.plans, open_only=True)

    return background.start_save(ch, options, prepare, snapshot_budget, _commit_and_open, async_writer, open_saved)


def _commit_and_open(
    c: Communicator,
    options: SaveOptions,
    shard: LocalShard | Exception,
    cache: PlanCache,
    make_writer: background.WriterFactory | None = None,
    retire: Retire | None = None,
    open_only: bool = False,
) -> TensorDict:
    """Run the two-phase commit with this rank's prepared shard, then map what it saved.

    ``retire``: where the removal of the replaced checkpoint goes (``two_phase_commit``); ``open_only``:
    another process committed it; only map it.
    """
    writer: DirectoryWriter | ArchiveWriter | S3DirectoryWriter
    if make_writer is not None:
        writer = make_writer(options, c.rank, shard, cache)
    elif is_s3(options.target):
        writer = (S3ArchiveWriter if options.layout == "archive" else S3DirectoryWriter)(options, c.rank, shard, cache)
    else:
        writer = (ArchiveWriter if options.layout == "archive" else DirectoryWriter)(options, c.rank, shard, cache)

    def build_manifest(fragments: list[Fragment], structure: Structure) -> ManifestFiles:
        m = merge_fragments(
            fragments,
            structure,
            metadata=dict(options.metadata),
            robust_key=options.robust_key,
            version=__version__,
            layout=options.layout,
            packing=options.packing,
            cache=cache,
        )
        return encode(m)

    if not open_only:
        two_phase_commit(c, writer, build_manifest, retire)
        writer.committed()
        logger.info("rank %d: committed %s", c.rank, options.target)
    assert isinstance(shard, LocalShard)  # the commit raised otherwise
    try:
        own = {i.key: i.dtensor.box for i in shard.items if i.dtensor is not None}
        opts = LoadOptions(SavedRows(), allow_pickle=options.allow_pickle, share_non_tensor=options.share_non_tensor)
        with open_checkpoint(options.target) as opened:
            if isinstance(writer, (S3DirectoryWriter, S3ArchiveWriter)) and isinstance(opened.pin, S3Pin):
                opened.pin.local = writer.uploaded  # what this rank uploaded is read back from memory
            return _load_from(opened.manifest, options.target, c, opts, own, pinned=opened)
    except StorageError as e:
        raise _unreadable_after_commit(c.rank, options.target, e) from e
    except TddistError:
        raise
    except OSError as e:  # the file system failed after the commit (an I/O error, a power loss)
        raise _unreadable_after_commit(c.rank, options.target, e) from e


def _unreadable_after_commit(rank: int, target: str, e: OSError | StorageError) -> TargetError:
    """The error of a save whose commit is durable but whose checkpoint could not be read back (the I/O failed)."""
    return TargetError(
        f"rank {rank}: the save to {target!r} was committed and is durable, but opening it to return it failed: "
        f"{e}; once the file system is readable again, tddist.load reads it"
    )


def load(
    prefix: str | os.PathLike,
    *,
    comm: Any = None,
    shard: Any = "even",
    keys: Sequence | str | None = None,
    into: Any = None,
    exclude: Sequence | str | None = None,
    per_rank: Any = None,
    strict: bool = True,
    device: torch.device | str | None = None,
    verify: bool = False,
    num_threads: int = 0,
    allow_pickle: bool = False,
    timeout: float | None = None,
) -> TensorDict | LoadReport:
    """Load a committed checkpoint, on any world size.

    Replicated and DTensor leaves come back whole; sharded leaves come back
    as ``shard`` asks. On several ranks every rank returns, or all raise the
    same error (except ``shard=None`` without ``into``, which each process
    runs on its own).

    Args:
        prefix: the checkpoint directory or ``.tdz`` archive, or
            ``s3://bucket/key[.tdz]`` on object storage (ranged GETs of only
            the bytes read, in parallel).
        comm: as in ``save``; not needed for ``shard=None``.
        shard: ``"even"``, this rank's even share of the global rows (as
            ``torch.tensor_split`` splits them); ``"saved"``, exactly the rows
            this rank saved (same world size only); ``(start, stop)``, that
            row range; ``[n_0, n_1, ...]``, per-rank row counts; ``None``, the
            whole global TensorDict.
        keys: read only these leaves or nodes (a key, a tuple key, or a list);
            with ``into``, fill and compare only these.
        into: a TensorDict or nested dict of tensors and DTensors to fill in
            place, each leaf in its own placements (resharded as needed).
        exclude: leave these leaves or nodes out (a key, a tuple key, or a
            list); with ``into`` they are neither compared nor touched.
        per_rank: what ranks get of per-rank state (``tddist.PerRank()``
            leaves) saved by another number of ranks: None (the default)
            raises, naming the keys; ``"drop"`` leaves them out (``into`` keeps
            its values); ``"rank0"`` gives every rank rank 0's value; a
            callable ``(key, values, rank, size)`` gets every saving rank's
            value and returns this rank's (None leaves the key out). On the
            saving world size every rank gets its own value; with
            ``shard=None``, the ranks' values stacked along a new dim 0.
        strict: with ``into``, any missing, unexpected or mismatched key
            raises before anything is touched; False loads what matches.
        device: move the loaded tensors there (default: copy-on-write maps on the CPU).
        verify: check every chunk read against its checksum.
        num_threads: threads that copy (and verify) the data.
        allow_pickle: load non-tensor values saved with pickle (only from a
            source you trust).
        timeout: seconds any collective may take.

    Returns:
        The TensorDict, or with ``into`` a ``LoadReport`` of what was loaded,
        missing, unexpected, mismatched or skipped.

    Raises:
        CheckpointNotFoundError: nothing committed is at ``prefix``.
        ManifestError: the manifest is damaged or from a newer tddist.
        CorruptCheckpointError: a data file is missing, truncated or fails its checksum.
        CheckpointChangedError: another job replaced the checkpoint while it was read, three times in a
            row (a load reads one checkpoint whole, and retries by itself when an overwrite removed the
            files it was about to open); load again.
        IncompatibleCheckpointError: ``into`` does not match the checkpoint
            (strict), or per-rank state saved by another number of ranks
            without ``per_rank=``.
        InvalidArgumentError: an invalid ``shard``, ``keys``, ``exclude``,
            ``per_rank`` or ``device`` (CUDA asked for where it is not available).
    """
    check_int("num_threads", num_threads)
    check_device(device)
    target = target_of(prefix)
    if is_s3(target):
        s3_client()
    c = LocalComm() if shard is None and comm is None and into is None else resolve(comm, timeout)
    options = LoadOptions(
        shard=shard_request(shard, c.size),
        keys=normalize_keys(keys),
        exclude=normalize_keys(exclude) or (),
        per_rank=pr.policy(per_rank),
        device=device,
        verify=verify,
        num_threads=num_threads,
        allow_pickle=allow_pickle,
    )

    def read(opened: OpenedCheckpoint) -> TensorDict | LoadReport:
        if into is not None:
            return fill(
                opened.manifest, target, into, strict=strict, options=options, rank=c.rank, size=c.size, pinned=opened
            )
        return _load_from(opened.manifest, target, c, options, pinned=opened)

    alone = c.size == 1 or (shard is None and into is None)
    for attempt in range(1, _LOAD_ATTEMPTS + 1):
        try:
            return _load_pinned(c, target, read, alone)
        except CheckpointChangedError:
            if attempt == _LOAD_ATTEMPTS:
                raise
            logger.info("rank %d: %s was replaced while it was read; reading it again", c.rank, target)
    raise AssertionError("unreachable")


T = TypeVar("T")

#: How often ``load`` reads a checkpoint that an overwrite keeps replacing before it gives up.
_LOAD_ATTEMPTS = 3


def _load_pinned(c: Communicator, target: str, read: Callable[[OpenedCheckpoint], T], alone: bool) -> T:
    """Open the checkpoint once and ``read`` it; on several ranks, every rank reads the same generation.

    Alone: open, read, close. On several ranks: every rank opens it (or all
    raise), they compare the generations they pinned (an overwrite may have
    committed between two ranks' opens: then every rank raises
    ``CheckpointChangedError``), then every rank reads, or all raise.
    """
    if alone:
        with open_checkpoint(target) as opened:
            return read(opened)
    pinned = run_step(c, f"opening {target!r}", lambda: open_checkpoint(target))
    assert pinned is not None  # run_step raised on every rank otherwise
    with pinned:
        generations = c.allgather(pinned.generation)
        if len(set(generations)) > 1:
            raise CheckpointChangedError(
                f"rank {c.rank}: {target!r} was replaced while the ranks opened it ({len(set(generations))} "
                f"generations among {c.size} ranks); load it again"
            )
        result = run_step(c, f"load of {target!r}", lambda: read(pinned))
    assert result is not None  # run_step raised on every rank otherwise
    return result


def _load_from(
    manifest: Manifest,
    target: str,
    c: Communicator,
    options: LoadOptions,
    own_boxes: Mapping[Key, Box] | None = None,
    *,
    pinned: OpenedCheckpoint | None = None,
) -> TensorDict:
    """This rank's part of the checkpoint as a TensorDict (``own_boxes``: DTensor boxes this rank just saved).

    ``pinned``: the checkpoint ``manifest`` was read from, so the data comes from the same generation.
    """
    shard = options.shard
    if isinstance(shard, SavedRows) and manifest.world_size != c.size:
        raise InvalidArgumentError(
            f"rank {c.rank}: shard='saved' needs the saving world size ({manifest.world_size} ranks), this job has "
            f"{c.size}; use shard='even' to reshard"
        )
    leaf_keys, node_keys = select(list(manifest.leaves) + list(manifest.objects), manifest.nodes, options.keys)
    if options.exclude:
        check_exclude(options.exclude, [*manifest.nodes, *manifest.leaves, *manifest.objects], f"{target!r}")
        leaf_keys = [k for k in leaf_keys if in_scope(k, None, options.exclude)]
        node_keys = [k for k in node_keys if not k or in_scope(k, None, options.exclude)]
    res = pr.resolve(manifest, leaf_keys, shard, options.per_rank, c.rank, c.size, f"the checkpoint at {target!r}")
    if res.dropped:
        logger.info(
            "rank %d: left out per-rank keys %s: %s",
            c.rank,
            [list(k) for k in res.dropped],
            "; ".join(set(res.dropped.values())),
        )
    objects = {}
    for k in leaf_keys:
        obj = manifest.objects.get(k)
        if obj is None or k in res.dropped:
            continue
        if obj.declared:
            found, value = pr.object_value(obj, res, options.allow_pickle, c.rank, c.size)
            if found:
                objects[k] = ("data", value)
        else:
            objects[k] = object_value(obj, shard, c.rank, c.size, options.allow_pickle)
    leaf_keys = [k for k in leaf_keys if k in manifest.leaves and k not in res.dropped]
    own_boxes = own_boxes or {}
    requests: list[tuple[Key, list[Box]]] = []
    for k in leaf_keys:
        leaf = manifest.leaves[k]
        if isinstance(leaf.placement, PerRank):
            requests.append((k, pr.boxes_to_read(leaf, res)))
        else:
            requests.append((k, [own_boxes.get(k) or leaf_box(leaf, shard, c.rank, c.size)]))
    flat = [(manifest.leaves[k], box) for k, boxes in requests for box in boxes]
    read = iter(read_leaves(pinned or target, manifest, flat, options.num_threads, options.verify))
    loaded = {}
    for k, boxes in requests:
        got = [next(read) for _box in boxes]
        leaf = manifest.leaves[k]
        value = pr.tensor_value(k, leaf, got, res, c.rank, c.size) if isinstance(leaf.placement, PerRank) else got[0]
        if value is not None:
            loaded[k] = value if options.device is None else value.to(options.device)

    def rows(key: Key, batch: tuple[int, ...]) -> int:
        return node_rows(manifest, key, batch[0], shard, c.rank, c.size)

    return build(
        {k: manifest.nodes[k] for k in node_keys}, loaded, rows, options.device, objects, options.share_non_tensor
    )


def read_manifest(prefix: str | os.PathLike) -> Manifest:
    """The validated manifest of the checkpoint at ``prefix``, without reading any data.

    Args:
        prefix: the checkpoint directory or ``.tdz`` archive (or ``s3://bucket/key[.tdz]``).

    Returns:
        Shapes, dtypes, placements, chunks, world size and metadata.

    Raises:
        CheckpointNotFoundError: nothing committed is at ``prefix``.
        ManifestError: the manifest is damaged or from a newer tddist.
    """
    return _read_manifest(target_of(prefix))


def recover(prefix: str | os.PathLike) -> list[str]:
    """Remove leftovers of interrupted saves beside ``prefix`` (staging, trash, backups).

    Never touches a committed checkpoint or a foreign file. A backup of a
    replaced checkpoint is moved back if a crash left the target without one.
    Run it only when no save to ``prefix`` is in progress.

    On object storage (``s3://bucket/key[.tdz]``) it aborts the key's
    unfinished multipart uploads and deletes the generations that the
    committed manifest does not name.

    Args:
        prefix: the checkpoint path whose leftovers to remove.

    Returns:
        One line per leftover handled, saying what was done.

    Raises:
        OSError: a leftover could not be removed (permissions, I/O error).
        StorageError: on object storage, a request failed.
    """
    target = target_of(prefix)
    return s3_recover(target) if is_s3(target) else _recover(target)
