"""``return_early`` saves: the snapshot taken on the caller's thread, the one way that fits the save (the whole
state into reused buffers, a stream into the channel's arena while the worker writes, or a writer process's
shared arena), then ``committing.commit`` and ``open_committed`` handed to the channel's worker."""

from __future__ import annotations

import logging
import os
from concurrent.futures import Future
from dataclasses import replace
from functools import partial

from tensordict import TensorDict

from .._fs import waits_for_writeback
from ..comm.base import Communicator
from ..comm.node import ranks_on_this_node
from ..core.types import (
    LocalShard,
    SaveOptions,
)
from ..manifest.merge import MergeCache
from ..storage.base import ShardWriter, hashes_replica
from .background import Channel, SaveFuture
from .commit import Retire
from .committing import Committed, Prepare, WriterFactory, commit_and_open, open_committed, store_of
from .snapshot import SnapshotBuffers
from .stream import EARLY_WRITE_MIN, Stream, StreamingWriter, StreamSources
from .writer_process import ProcessWriter, WriterRequest, supported

logger = logging.getLogger(__name__)


def start_early(ch: Channel, options: SaveOptions, prepare: Prepare, budget: int | None, writer: str) -> Future:
    """Snapshot this rank's data and hand the commit to the channel's worker; return the save's Future.

    With ``writer="process"`` the shard is copied into the writer process's
    shared arena and the commit runs there. Otherwise, without ``budget``
    and where the store cannot stream, the whole shard is copied into the
    reusable snapshot buffers (``snapshot_whole``); else it streams through
    the channel's arena (``stream``), and this returns only once its last
    byte is copied. The removal of a replaced checkpoint is deferred to the
    worker (``Channel.defer``), after the Future is resolved.
    """
    if writer == "process":
        why = supported(ch.comm)
        if why is None:
            return in_writer_process(ch, options, prepare)
        logger.info("rank %d: async_writer='process' falls back to the thread writer: %s", ch.comm.rank, why)
    if budget is None and not streams(options):
        return snapshot_whole(ch, options, prepare(ch.buffers))
    sources = StreamSources()
    shard = prepare(sources)
    if isinstance(shard, Exception):
        return snapshot_whole(ch, options, shard)
    total = sum(t.numel() * t.element_size() for t in sources.sources.values())
    on_gpu = any(t.device.type != "cpu" for t in sources.sources.values())
    if (budget is None and on_gpu) or (budget is not None and total <= budget):
        ch.arena = None  # a whole snapshot (GPU leaves: pinned buffers, copies on a side stream)
        return snapshot_whole(ch, options, snapshot_into(ch.buffers, shard, sources))
    return stream(ch, options, shard, sources, budget, on_gpu)


def streams(options: SaveOptions) -> bool:
    """Whether a save without ``snapshot_budget`` is copied into the channel's arena while it is written.

    Only the packed directory of a store that ``streams`` can write a
    slot before the whole state is copied (``stream.py``); an archive,
    ``layout="memmap"``, object storage, ``check_replicas`` (which
    compares the replicas' snapshots) and an incremental save (``base``: each
    chunk is compared with the base's before it is written or not) copy the
    whole state first.
    """
    return (
        options.container == "directory"
        and options.packing == "packed"
        and not options.check_replicas
        and options.base is None
        and store_of(options).streams
    )


def snapshot_whole(ch: Channel, options: SaveOptions, shard: LocalShard | Exception) -> SaveFuture:
    """Commit a shard already copied into the snapshot buffers (or the error preparing it) on the worker."""
    bg = ch.background_comm()
    return ch.submit(partial(_commit_snapshot, ch.buffers, bg, options, shard, ch.merges, ch.defer))


def stream(
    ch: Channel, options: SaveOptions, shard: LocalShard, sources: StreamSources, budget: int | None, on_gpu: bool
) -> Future:
    """Copy the written leaves into the channel's arena while the worker writes the copied slots.

    Without ``budget`` the whole state fits in the arena: the copy helper
    copies from the last slot back while the caller copies from the first
    one on, and the worker commits once both are done. With it, the state
    streams through slots of the budget, and the worker writes each slot
    as soon as it is copied.
    """
    bg = ch.background_comm()
    ch.buffers.retain_only(set())  # the arena holds the state: no whole-state buffers beside it
    shard = copy_hashed_replicas(shard, sources, options.check_replicas)
    written = [(i.key, sources.sources[i.key]) for i in shard.items if i.writes]
    if budget is None:
        s = Stream(ch.pipeline_arena(written), written, ch.comm.rank)
    else:
        s = Stream(ch.arena_for(budget, on_gpu), written, ch.comm.rank)
        logger.info(
            "rank %d: %d bytes to save exceed snapshot_budget=%d; streaming them through %d slots of %d bytes",
            ch.comm.rank, s.nbytes, budget, s.arena.nslots, s.arena.slot_bytes,
        )  # fmt: skip

    def factory(o: SaveOptions, rank: int, sh: LocalShard | Exception, cache: MergeCache) -> ShardWriter:
        return StreamingWriter(o, rank, sh, cache, s)

    if s.whole and writes_early(s):
        ch.write_early(s)
    fut = ch.submit(partial(commit_streamed, s, bg, options, shard, ch.merges, factory, ch.defer))
    if s.whole:
        ch.help_copy(s)
    s.produce()
    return fut


def writes_early(s: Stream) -> bool:
    """Whether a whole-state stream is written while it is copied (``Stream.write_early``): when it is large
    enough for the disk to take a share during the copy, the writes can be held to the disk's pace, and the
    node has a core for each rank's early writer (``spare_core_per_rank``)."""
    return s.nbytes >= EARLY_WRITE_MIN and waits_for_writeback() and spare_core_per_rank()


def spare_core_per_rank() -> bool:
    """Whether this process may use two of the cores it runs on per rank of its node (``ranks_on_this_node``):
    one for the caller's copy, one for the early writer.

    The early writes cost the copy cores and memory bandwidth: copying into
    the page cache at the disk's pace takes about a third of a core. Where a
    core is free that is no cost to the caller; where the ranks' copies
    already take every core it lengthens them. Measured with 1 GiB on 2 cores
    (blocking against a plain ``copy_``, completion against a synchronous
    save, without -> with early writes): 2 ranks 1.05x -> 1.34x and 1.06x ->
    1.02x, 4 ranks 1.22x -> 1.33x and 1.08x -> 1.04x (one run, alternated); 1
    rank, in ``benchmarks/run.py``: 0.95x -> 0.72-0.73x and 1.17x -> 1.03-1.05x.
    """
    return len(os.sched_getaffinity(0)) >= 2 * ranks_on_this_node()


def in_writer_process(ch: Channel, options: SaveOptions, prepare: Prepare) -> Future:
    """Copy the shard into this rank's writer process's shared arena; its commit runs there
    (``writer_process``), and the worker maps the result once it answers."""
    pw = ch.process_writer()
    sources = StreamSources()
    shard = prepare(sources)
    request = pw.snapshot(options, shard, sources.sources)
    return ch.submit(partial(_commit_in_process, ch.comm, pw, request, shard))


def copy_hashed_replicas(shard: LocalShard, sources: StreamSources, check_replicas: bool) -> LocalShard:
    """Copy now the replicas this rank does not write but its vote hashes (``hashes_replica``): only
    written leaves go through the stream's slots."""
    items = tuple(
        replace(i, tensor=sources.sources[i.key].clone()) if hashes_replica(i, check_replicas) else i
        for i in shard.items
    )
    return replace(shard, items=items)


def snapshot_into(buffers: SnapshotBuffers, shard: LocalShard, sources: StreamSources) -> LocalShard:
    items = tuple(replace(i, tensor=buffers.snapshot(i.key, sources.sources[i.key])) for i in shard.items)
    buffers.synchronize()
    buffers.retain_only({i.key for i in items})
    return replace(shard, items=items)


def _commit_snapshot(
    buffers: SnapshotBuffers,
    comm: Communicator,
    options: SaveOptions,
    shard: LocalShard | Exception,
    cache: MergeCache,
    retire: Retire,
) -> TensorDict:
    """(the worker) Wait for device-to-host copies of the snapshot, if any, then commit and open."""
    buffers.wait_copies()
    return commit_and_open(comm, options, shard, cache, None, retire, shard)


def commit_streamed(
    s: Stream,
    comm: Communicator,
    options: SaveOptions,
    shard: LocalShard | Exception,
    cache: MergeCache,
    factory: WriterFactory,
    retire: Retire,
) -> TensorDict:
    """(the worker) Commit a streamed snapshot: at once where its writer writes the slots as they are
    copied (``Stream.early_writes``), else once its copy is done (nothing competes with the copy the caller
    waits for); a failed commit stops the caller's copy waiting for slots."""
    try:
        if s.early_writes is None:
            s.wait_copied()
        if s.proof is not None:  # a deferred snapshot: a leaf changed during its copy is this rank's vote
            shard = s.proof.failure or shard
        return commit_and_open(comm, options, shard, cache, factory, retire, None)
    finally:
        s.cancel()


def _commit_in_process(
    c: Communicator, pw: ProcessWriter, request: WriterRequest, shard: LocalShard | Exception
) -> TensorDict:
    """(the worker) Wait for the writer process's commit, then map what this rank saved (from the shared arena
    if another save replaced it at once)."""
    generation = pw.run(request)
    return open_committed(c, request.options, shard, Committed(None, generation, None), pw.arena_shard(request))


# --- snapshot="deferred": plan on the caller's thread, copy after it returned (``deferred``) -----------------
