"""The path of a save, read top to bottom: prepare, snapshot, write, commit, open.

``save`` (``tddist.save`` checks the arguments into a ``SaveRequest`` and
calls it) runs on every rank:

1. ``prepare``: flatten this rank's data into a ``LocalShard`` (checks,
   placements, non-tensor values); an error becomes this rank's vote, so
   every rank still meets in the commit and all raise the same error;
2. synchronous: ``commit`` (the store's ``ShardWriter`` writes this rank's
   bytes, then ``commit.two_phase_commit`` publishes the checkpoint), then
   ``open_committed`` maps what this rank saved and returns it;
3. ``return_early``: ``start_early`` takes the snapshot on the caller's
   thread, the one way that fits the save (``snapshot_whole``: copy the
   whole state into reused buffers; ``stream``: copy into the channel's
   arena while the worker writes the copied slots; ``in_writer_process``:
   copy into a writer process's shared arena), and hands ``commit`` and
   ``open_committed`` to the channel's worker (``background``); the caller
   gets a Future;
4. ``snapshot="deferred"``: ``start_deferred`` copies only what the guard
   does not cover before it returns (``saving.deferred``); the copy helper
   copies the rest into the channel's arena (or a side stream into pinned
   buffers, for CUDA leaves) while the caller goes on, and the worker
   commits once the copy is done and its proof holds.

The writer process runs ``commit`` alone (``writer_main``); the trainer's
worker then runs ``open_committed``.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from concurrent.futures import Future
from dataclasses import dataclass, replace
from functools import partial
from typing import Any

import torch
from tensordict import TensorDict

from .. import format as fmt
from .._version import __version__
from ..comm.base import Communicator
from ..comm.resolve import resolve
from ..core.tree import build, flatten
from ..core.types import (
    Fragment,
    Key,
    LoadOptions,
    LocalShard,
    ManifestFiles,
    SavedRows,
    SaveOptions,
    SaveRequest,
    Staging,
    Structure,
)
from ..errors import CheckpointChangedError, NonFiniteError, StorageError, TargetError, TddistError
from ..loading.pipeline import read_shard
from ..manifest.merge import MergeCache, merge_fragments
from ..manifest.model import Manifest
from ..manifest.v2 import encode
from ..storage.backends import Store, store_for
from ..storage.base import ShardWriter, hashes_replica
from ..storage.opened import Pin
from . import background, deferred, deferred_plan
from .background import Channel, SaveFuture
from .commit import Retire, two_phase_commit
from .deferred_plan import DeferredPlan, PlanSettings
from .prepare import encode_objects, prepare_shard
from .snapshot import SnapshotBuffers, Snapshotter
from .stream import Stream, StreamingWriter, StreamSources, stream_layout
from .writer_process import ProcessWriter, WriterRequest, supported

logger = logging.getLogger(__name__)

#: A function that prepares this rank's shard, snapshotting its tensors into the given buffers.
Prepare = Callable[[Snapshotter | None], LocalShard | Exception]
#: A function that makes this rank's writer of a save (the store's, or one that writes a streamed snapshot).
WriterFactory = Callable[[SaveOptions, int, LocalShard | Exception, MergeCache], ShardWriter]


def save(data: Any, request: SaveRequest) -> TensorDict | Future:
    """Save ``data`` (this rank's shard) as ``request`` says; see ``tddist.save``."""
    options = request.options
    c = resolve(request.comm, request.timeout)
    ch = background.channel(c)
    ch.wait_idle(request.wait_for_pending, options.target)

    def prepare(buffers: Snapshotter | None) -> LocalShard | Exception:
        return prepare_shard(
            data,
            c.rank,
            c.size,
            buffers,  # type: ignore[arg-type]  # a Snapshotter: buffers, sources or the process writer's
            placements=request.placements,
            robust_key=options.robust_key,
            allow_pickle=options.allow_pickle,
            copy_existing=request.copy_existing,
            placement_cache=ch.placements,
        )

    if request.early is None:
        shard = prepare(None)
        committed = commit(c, options, shard, ch.merges)
        return open_committed(c, options, shard, committed, in_memory=shard)
    if request.early.deferred:
        return start_deferred(ch, options, prepare, _plan_settings(request, c.rank, c.size), data)
    return start_early(ch, options, prepare, request.early.snapshot_budget, request.early.writer)


def store_of(options: SaveOptions) -> Store:
    """The store a save writes to (``storage.backends``)."""
    return store_for(options.target, options.container == "archive")


@dataclass(frozen=True)
class Committed:
    """A save this rank took part in, once committed: what ``open_committed`` reads back exactly."""

    writer: ShardWriter | None  # None: a writer process wrote it
    generation: str  # of the manifest rank 0 published
    pin: Pin | None  # the checkpoint, pinned before it was published (file stores; ``Store.pin_staging``)


def commit(
    c: Communicator,
    options: SaveOptions,
    shard: LocalShard | Exception,
    cache: MergeCache,
    make_writer: WriterFactory | None = None,
    retire: Retire | None = None,
) -> Committed:
    """Write this rank's shard and run the two-phase commit; return what was committed once it is published.

    ``make_writer``: a writer other than the store's own (a streamed
    snapshot's); ``retire``: where the removal of the replaced checkpoint goes
    (``two_phase_commit``). The store pins the staging area on every rank
    before its vote, so a save that replaces this one at once cannot make it
    read back another save's data.
    """
    store = store_of(options)
    writer = (make_writer or store.writer)(options, c.rank, shard, cache)
    pins: list[Pin] = []

    def pin(staging: Staging) -> None:
        held = store.pin_staging(staging)
        if held is not None:
            pins.append(held)

    def build_manifest(fragments: list[Fragment], structure: Structure) -> ManifestFiles:
        m = merge_fragments(
            fragments,
            structure,
            metadata=dict(options.metadata),
            robust_key=options.robust_key,
            version=__version__,
            container=options.container,
            packing=options.packing,
            cache=cache,
        )
        if options.require_finite:
            refuse_non_finite(m, options.target)
        return encode(m)

    try:
        generation = two_phase_commit(c, writer, build_manifest, retire, on_staged=pin)
    except BaseException:
        for p in pins:
            p.close()
        raise
    writer.committed()
    logger.info("rank %d: committed %s", c.rank, options.target)
    return Committed(writer, generation, pins[0] if pins else None)


def refuse_non_finite(m: Manifest, target: str) -> None:
    """(rank 0, before the manifest is written) ``require_finite``: refuse a checkpoint whose leaves hold NaN
    or Inf values; the commit turns it into the same error on every rank and removes the staging area.

    Raises:
        NonFiniteError: naming each such leaf, its counts and the ranks whose chunks hold them.
    """
    bad = m.non_finite()
    if not bad:
        return
    shown = "; ".join(f"{list(b.key)}: {b.nan} NaN and {b.inf} Inf values (ranks {list(b.ranks)[:8]})" for b in bad[:8])
    more = f"; and {len(bad) - 8} more leaves" if len(bad) > 8 else ""
    raise NonFiniteError(
        f"the save to {target!r} was refused (require_finite=True): {len(bad)} leaves hold non-finite values: "
        f"{shown}{more}. Nothing was committed; the target keeps its previous checkpoint. The run has probably "
        f"diverged: restore the last finite checkpoint (CheckpointManager(restore='finite'))"
    )


def open_committed(
    c: Communicator,
    options: SaveOptions,
    shard: LocalShard | Exception,
    committed: Committed,
    in_memory: LocalShard | Exception | None = None,
) -> TensorDict:
    """This rank's saved shard, mapped from the checkpoint ``committed`` names, never another save's.

    Through the pin taken before it was published (file stores), or by name
    with its generation compared (object storage, a writer process). When a
    concurrent save replaced it before it could be read (a store without a
    pin, or a file system without ``flock``), this rank's shard is returned
    from memory instead: ``in_memory``, the snapshot or the caller's own
    tensors, which hold what was written (copied, as a map would be). Raises
    ``TargetError`` only when the commit is durable but could not be read
    back and no such copy exists (a streamed snapshot), or the file system
    failed.
    """
    assert isinstance(shard, LocalShard)  # the commit raised otherwise
    store = store_of(options)
    own = {i.key: i.dtensor.box for i in shard.items if i.dtensor is not None}
    opts = LoadOptions(SavedRows(), allow_pickle=options.allow_pickle, share_non_tensor=options.share_non_tensor)
    try:
        with store.open_saved(committed.writer, committed.pin) as opened:
            if opened.generation != committed.generation:
                raise CheckpointChangedError(
                    f"rank {c.rank}: {options.target!r} holds another save's checkpoint (generation "
                    f"{opened.generation}, this save committed {committed.generation})"
                )
            return read_shard(opened, c, opts, own)
    except CheckpointChangedError as e:
        return _replaced_after_commit(c.rank, options, in_memory, e)
    except StorageError as e:
        raise _unreadable_after_commit(c.rank, options.target, e) from e
    except TddistError:
        raise
    except OSError as e:  # the file system failed after the commit (an I/O error, a power loss)
        raise _unreadable_after_commit(c.rank, options.target, e) from e


def _commit_and_open(
    c: Communicator,
    options: SaveOptions,
    shard: LocalShard | Exception,
    cache: MergeCache,
    make_writer: WriterFactory | None,
    retire: Retire,
    in_memory: LocalShard | Exception | None,
) -> TensorDict:
    """(a ``return_early`` save's worker) ``commit``, then ``open_committed``; ``in_memory``: what was
    written, kept until this save ends (a whole snapshot), or None (a streamed one, whose slots are reused)."""
    committed = commit(c, options, shard, cache, make_writer, retire)
    return open_committed(c, options, shard, committed, in_memory)


def _replaced_after_commit(
    rank: int, options: SaveOptions, in_memory: LocalShard | Exception | None, e: CheckpointChangedError
) -> TensorDict:
    """A concurrent save replaced this one's checkpoint before it was read back: this rank's shard from memory."""
    if not isinstance(in_memory, LocalShard):
        raise TargetError(
            f"rank {rank}: the save to {options.target!r} was committed and is durable, but another save "
            f"replaced it before it could be read back ({e}); save to distinct paths (or one process at a time) "
            f"to get the saved shard back, or load the checkpoint you want"
        ) from e
    logger.info("rank %d: %s; returning the saved shard from memory", rank, e)
    return shard_from_memory(in_memory, options)


def shard_from_memory(shard: LocalShard, options: SaveOptions) -> TensorDict:
    """This rank's shard as ``load(shard="saved")`` returns it, from the tensors that were written (copied).

    Sharded leaves hold this rank's rows, replicated ones its copy (equal to
    the written one: small replicas are compared in every save, larger ones
    with ``check_replicas``), DTensor leaves their local shard.
    """
    leaves = {i.key: i.tensor.detach().to("cpu", copy=True) for i in shard.items}
    objects = {}
    for key, obj in shard.objects.items():
        where = f"non-tensor leaf {list(key)}"
        if obj.kind == "stack":
            objects[key] = ("stack", [fmt.decode_object(v, True, where) for v in obj.value])
        else:
            objects[key] = ("data", fmt.decode_object(obj.value, True, where))
    return build(dict(shard.nodes), leaves, lambda _key, batch: batch[0], None, objects, options.share_non_tensor)


def _unreadable_after_commit(rank: int, target: str, e: OSError | StorageError) -> TargetError:
    """The error of a save whose commit is durable but whose checkpoint could not be read back (the I/O failed)."""
    return TargetError(
        f"rank {rank}: the save to {target!r} was committed and is durable, but opening it to return it failed: "
        f"{e}; once the file system is readable again, tddist.load reads it"
    )


# --- return_early: snapshot on the caller's thread, commit on the channel's worker ---------------------------


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
        return snapshot_whole(ch, options, _snapshot_into(ch.buffers, shard, sources))
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
    shard = _copy_hashed_replicas(shard, sources, options.check_replicas)
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

    fut = ch.submit(partial(_commit_streamed, s, bg, options, shard, ch.merges, factory, ch.defer))
    if s.whole:
        ch.help_copy(s)
    s.produce()
    return fut


def in_writer_process(ch: Channel, options: SaveOptions, prepare: Prepare) -> Future:
    """Copy the shard into this rank's writer process's shared arena; its commit runs there
    (``writer_process``), and the worker maps the result once it answers."""
    pw = ch.process_writer()
    sources = StreamSources()
    shard = prepare(sources)
    request = pw.snapshot(options, shard, sources.sources)
    return ch.submit(partial(_commit_in_process, ch.comm, pw, request, shard))


def _copy_hashed_replicas(shard: LocalShard, sources: StreamSources, check_replicas: bool) -> LocalShard:
    """Copy now the replicas this rank does not write but its vote hashes (``hashes_replica``): only
    written leaves go through the stream's slots."""
    items = tuple(
        replace(i, tensor=sources.sources[i.key].clone()) if hashes_replica(i, check_replicas) else i
        for i in shard.items
    )
    return replace(shard, items=items)


def _snapshot_into(buffers: SnapshotBuffers, shard: LocalShard, sources: StreamSources) -> LocalShard:
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
    return _commit_and_open(comm, options, shard, cache, None, retire, shard)


def _commit_streamed(
    s: Stream,
    comm: Communicator,
    options: SaveOptions,
    shard: LocalShard | Exception,
    cache: MergeCache,
    factory: WriterFactory,
    retire: Retire,
) -> TensorDict:
    """(the worker) Commit a streamed snapshot once its copy is done (nothing competes with the copy the
    caller waits for); a failed commit stops the caller's copy waiting for slots."""
    try:
        s.wait_copied()
        if s.proof is not None:  # a deferred snapshot: a leaf changed during its copy is this rank's vote
            shard = s.proof.failure or shard
        return _commit_and_open(comm, options, shard, cache, factory, retire, None)
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


def start_deferred(
    ch: Channel, options: SaveOptions, prepare: Prepare, settings: PlanSettings, data: Any
) -> SaveFuture:
    """Plan the save, copy what must be copied now, and return; the rest is copied in the background.

    A packed directory streams through the channel's arena, copied by the
    copy helper thread; CUDA leaves are copied on a side stream into pinned
    buffers. Other saves (an archive, ``layout="memmap"``, object storage,
    ``check_replicas``) cannot defer their copy: they copy the whole state now,
    as ``snapshot="copy"`` does. A save of the leaves the channel's kept plan
    was made for reuses it (``deferred_plan``).
    """
    plan = ch.deferred_plan
    if plan is not None and streams(options):
        seen = deferred.seen_optimizers() if settings.guard is None else ()
        values = plan.values_if_same(settings, seen, data, ch.arena, ch.buffers)
        if values is not None:
            found = {k: (kind, v) for (k, kind), v in zip(plan.object_kinds, values)}
            return _deferred_from_plan(ch, options, plan, found)
        try:
            nodes, leaves, objects = flatten(data)
        except Exception:  # ``prepare`` below returns it as this rank's vote
            nodes = None
        if nodes is not None and plan.matches(settings, seen, nodes, leaves, objects, ch.arena, ch.buffers):
            return _deferred_from_plan(ch, options, plan, objects)
    ch.deferred_plan = None
    sources = StreamSources()
    shard = prepare(sources)
    if isinstance(shard, Exception):
        return snapshot_whole(ch, options, shard)
    guard, guarded = settings.guard, None
    if guard is None:
        guard, guarded = deferred.default_guard(sources.given)
    if any(t.device.type != "cpu" for t in sources.sources.values()):
        return _deferred_on_device(ch, options, shard, sources, guard)
    if not streams(options):
        logger.info("rank %d: this save cannot defer its copy; copying it now", ch.comm.rank)
        ch.arena = None
        return snapshot_whole(ch, options, _snapshot_into(ch.buffers, shard, sources))
    plan = _plan(ch, settings, shard, sources, guard, guarded, deferred_plan.tree(data))
    if deferred_plan.keepable(sources.given, sources.sources):
        ch.deferred_plan = plan
    return _deferred_from_plan(ch, options, plan, None)


def _plan_settings(request: SaveRequest, rank: int, world: int) -> PlanSettings:
    o, early = request.options, request.early
    assert early is not None
    placements = tuple(request.placements.items()) if request.placements else None
    return PlanSettings(
        rank, world, placements, o.robust_key, o.allow_pickle, request.copy_existing, o.check_replicas, early.guard
    )


def _plan(
    ch: Channel,
    settings: PlanSettings,
    shard: LocalShard,
    sources: StreamSources,
    guard: tuple[Any, ...],
    guarded: set[int] | None,
    tree: list[deferred_plan.TreeNode] | None,
) -> DeferredPlan:
    """A packed directory's deferred save, planned: the eager leaves' snapshot buffers, what the stream copies
    into the arena (``Stream.produce_deferred``, on the copy helper), and the leaves the proof records."""
    eager = deferred.eager_keys(sources.sources, guard, guarded)
    written: list[tuple[Key, torch.Tensor]] = []
    recorded: list[deferred.Recorded | None] = []
    eager_buffers, eager_sources = [], []
    for i in (i for i in shard.items if i.writes):
        src = sources.sources[i.key]
        if i.key in eager:
            eager_buffers.append(ch.buffers.snapshot(i.key, src))
            eager_sources.append(src)
        written.append((i.key, eager_buffers[-1] if i.key in eager else src))
        recorded.append(None if i.key in eager else deferred.record(i.key, sources.given[i.key]))
    ch.buffers.retain_only({k for k, _t in written if k in eager})
    arena = ch.pipeline_arena(written)
    given = tuple(sources.given.values())
    objects = shard.objects
    return DeferredPlan(
        settings=settings,
        seen=deferred.seen_optimizers() if settings.guard is None else (),
        guard=guard,
        nodes=dict(shard.nodes),
        keys=tuple(sources.given),
        given=given,
        meta=deferred_plan.tensor_meta(given),
        object_kinds=tuple((k, o.kind) for k, o in objects.items()),
        objects_per_rank=tuple(o.per_rank for o in objects.values()),
        shard=shard,
        sources=sources,
        eager_buffers=eager_buffers,
        eager_sources=eager_sources,
        written=written,
        recorded=recorded,
        layout=stream_layout(written, arena.slot_bytes),
        arena=arena,
        buffers_generation=ch.buffers.generation,
        tree=tree,
    )


def _deferred_from_plan(
    ch: Channel, options: SaveOptions, plan: DeferredPlan, objects: Mapping[Key, tuple[str, Any]] | None
) -> SaveFuture:
    """Run a deferred save of ``plan``: encode the non-tensor values (``objects``: those of the save in hand;
    None, the plan's own shard's), copy the eager leaves into their buffers, record the deferred leaves for the
    proof, and hand the rest of the copy to the copy helper and the commit to the worker."""
    bg = ch.background_comm()
    shard = plan.shard
    if objects is not None:
        try:
            encoded = encode_objects(objects, plan.objects_per_rank, ch.comm.rank, plan.settings.allow_pickle)
        except Exception as e:  # this rank's vote, as ``prepare_shard`` returns it
            return snapshot_whole(ch, options, e)
        shard = replace(shard, objects=encoded)
    shard = _copy_hashed_replicas(shard, plan.sources, options.check_replicas)
    if plan.eager_buffers:
        torch._foreach_copy_(plan.eager_buffers, plan.eager_sources)
    s = Stream(plan.arena, plan.written, ch.comm.rank, plan.layout)
    s.proof = deferred.Proof(ch.comm.rank, [None if r is None else deferred.now(r) for r in plan.recorded])

    def factory(o: SaveOptions, rank: int, sh: LocalShard | Exception, cache: MergeCache) -> ShardWriter:
        return StreamingWriter(o, rank, sh, cache, s)

    fut = ch.submit(partial(_commit_streamed, s, bg, options, shard, ch.merges, factory, ch.defer))
    _guard(fut, plan.guard, deferred.Pending(s.wait_copied, s.proof))
    ch.copy_deferred(s)
    return fut


def _deferred_on_device(
    ch: Channel, options: SaveOptions, shard: LocalShard, sources: StreamSources, guard: tuple[Any, ...]
) -> SaveFuture:
    """A deferred snapshot of device leaves: every copy is queued on a side stream into pinned buffers (host
    leaves are copied now). Later work on the current stream waits for the eager leaves' copies only; the
    guard waits for the others' events, and the worker for all of them before it seals the proof."""
    bg = ch.background_comm()
    ch.arena = None
    eager = deferred.eager_keys(sources.sources, guard)
    later = [i for i in shard.items if i.key not in eager]
    copies = {i.key: ch.buffers.snapshot(i.key, sources.sources[i.key]) for i in shard.items if i.key in eager}
    ch.buffers.synchronize()
    proof = deferred.Proof(ch.comm.rank, [deferred.record(i.key, sources.given[i.key]) for i in later])
    copies.update((i.key, ch.buffers.snapshot(i.key, sources.sources[i.key])) for i in later)
    events = ch.buffers.defer_pending()
    ch.buffers.retain_only(set(copies))
    shard = replace(shard, items=tuple(replace(i, tensor=copies[i.key]) for i in shard.items))
    fut = ch.submit(partial(_commit_deferred, ch.buffers, proof, bg, options, shard, ch.merges, ch.defer))
    _guard(fut, guard, deferred.Pending(partial(_synchronize, events), proof))
    return fut


def _synchronize(events: list[Any]) -> None:
    for e in events:
        e.synchronize()


def _guard(fut: SaveFuture, guard: tuple[Any, ...], pending: deferred.Pending) -> None:
    """Let the next step of the ``guard`` optimizers and ``fut.wait_snapshot()`` wait for ``pending``."""
    deferred.arm(guard, pending)
    fut.set_snapshot(pending.wait)


def _commit_deferred(
    buffers: SnapshotBuffers,
    proof: deferred.Proof,
    comm: Communicator,
    options: SaveOptions,
    shard: LocalShard | Exception,
    cache: MergeCache,
    retire: Retire,
) -> TensorDict:
    """(the worker) Wait for a deferred device snapshot's copies, seal its proof (a changed leaf becomes this
    rank's vote: nothing is committed), then commit and open."""
    proof.before(range(len(proof.leaves)))
    buffers.wait_copies()
    shard = proof.seal() or shard
    return _commit_and_open(comm, options, shard, cache, None, retire, shard)
