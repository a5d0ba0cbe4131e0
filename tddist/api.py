"""Public entry points: ``save``, ``load``, ``read_manifest`` and ``recover``, with their documented signatures.

Each checks and normalises its arguments (``arguments``) and hands them to
its pipeline: ``saving.pipeline`` (prepare, snapshot, write, commit, open)
and ``loading.pipeline`` (open one generation on every rank, read). The
prefix's store is chosen by ``storage.backends``. No I/O happens here.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from concurrent.futures import Future
from typing import Any

import torch
from tensordict import TensorDict

from .arguments import check_device, check_int, save_request
from .comm.base import LocalComm
from .comm.resolve import resolve
from .core.tree import normalize_keys
from .core.types import LoadOptions
from .loading import per_rank as pr
from .loading import pipeline as loading
from .loading.share import LoadReport, shard_request
from .manifest.model import Manifest
from .saving import pipeline as saving
from .storage import backends
from .storage.backends import store_for
from .storage.memory import MemoryStore as _HeldCheckpoint


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
    snapshot: str = "copy",
    guard: Any = None,
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
    require_finite: bool = False,
    base: str | os.PathLike | None = None,
    trust_versions: bool = False,
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
        snapshot: with ``return_early``, when the state is copied: "copy"
            (the default: before ``save`` returns) or "deferred" (``save``
            returns once the save is planned, and the state is copied in the
            background while training goes on; whole-state saves only, no
            ``snapshot_budget``, ``async_writer="thread"``). See
            docs/parameters.md: the state must not change until its copy is
            done, which ``guard`` or ``Future.wait_snapshot()`` ensure, and a
            leaf changed during its copy fails the save on every rank
            (``SnapshotChangedError``), nothing committed.
        guard: with ``snapshot="deferred"``, the optimizer (or a list of
            them) whose ``step()`` changes the saved state: each step waits
            for the copy (a step pre-hook), and the leaves they do not own
            (buffers) and small leaves are copied before ``save`` returns.
            None: the optimizers ``tddist.get_state`` saw whose parameters or
            state the save holds; ``[]``: none, every leaf is copied later
            (call ``wait_snapshot()`` on the Future before changing the state).
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
        require_finite: refuse to publish a checkpoint whose floating-point
            leaves hold a NaN or an infinite value (every checkpoint records
            how many each chunk holds, counted while it is hashed): every rank
            raises ``NonFiniteError`` and the target keeps its previous
            checkpoint.
        base: an incremental save: a committed checkpoint beside ``prefix``
            (in the same directory; a packed directory or a ``.tdz``) whose
            chunks this save references instead of writing them when their
            content is unchanged (same leaf, same rank, same size; compared by
            a 128-bit hash). A base that cannot hold references (in another
            directory, of packing "memmap", missing) is ignored: every chunk is
            written. Saves to packed directories; see docs/parameters.md.
        trust_versions: with ``base``, a leaf whose memory and version
            counter (``Tensor._version``) are unchanged since this process's
            last incremental save is not hashed again (its earlier hash is
            taken as its content's). Only for states that change only through
            PyTorch operations: a write through ``tensor.data``, NumPy, or an
            extension that writes through raw pointers (some fused or 8-bit
            optimizers) does not move the version counter, and the save would
            then reference the base's stale bytes. False (the default) hashes
            every chunk.

    Returns:
        This rank's saved shard, memory-mapped copy-on-write from the
        committed checkpoint, once it is durable on every rank; with
        ``return_early`` a ``concurrent.futures.Future`` of it (with
        ``wait_snapshot()``, which returns once the state may change).

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
        SnapshotChangedError: (from a deferred save's Future) a leaf changed
            in place while it was copied; nothing was committed.
        NonFiniteError: ``require_finite`` and the data holds NaN or Inf
            values (on every rank; nothing was committed).
    """
    request = save_request(
        prefix,
        comm=comm,
        placements=placements,
        num_threads=num_threads,
        return_early=return_early,
        snapshot_budget=snapshot_budget,
        async_writer=async_writer,
        snapshot=snapshot,
        guard=guard,
        atomic=atomic,
        metadata=metadata,
        copy_existing=copy_existing,
        share_non_tensor=share_non_tensor,
        robust_key=robust_key,
        allow_pickle=allow_pickle,
        check_replicas=check_replicas,
        wait_for_pending=wait_for_pending,
        timeout=timeout,
        archive=archive,
        compression=compression,
        layout=layout,
        require_finite=require_finite,
        base=base,
        trust_versions=trust_versions,
    )
    return saving.save(data, request)


def load(
    prefix: str | os.PathLike | _HeldCheckpoint,
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
            the bytes read, in parallel); or a checkpoint that no prefix
            names, held in memory (``storage.memory.MemoryStore``: the
            node-local tier loads a copy received from a peer this way).
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
    store = prefix if isinstance(prefix, _HeldCheckpoint) else store_for(prefix)
    check_int("num_threads", num_threads)
    check_device(device)
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
    return loading.load(store, c, options, into, strict)


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
    return backends.read_manifest(prefix)


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
    return backends.recover(prefix)
