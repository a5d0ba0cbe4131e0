"""``snapshot="deferred"`` saves: the plan (kept per channel), the eager copies before ``save`` returns, the
copy of the rest while the caller goes on (into the arena, or a side stream into pinned buffers for CUDA
leaves), and the commit once the copy is done and its proof holds (``saving.deferred``)."""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import replace
from functools import partial
from typing import Any

from tensordict import TensorDict

from ..comm.base import Communicator
from ..core.tree import flatten
from ..core.types import (
    Key,
    LocalShard,
    SaveOptions,
    SaveRequest,
)
from ..manifest.merge import MergeCache
from ..storage.base import ShardWriter, hashes_replica
from . import deferred, deferred_plan
from .background import Channel, SaveFuture
from .commit import Retire
from .committing import Prepare, commit_and_open
from .deferred_plan import DeferredPlan, PlanSettings
from .eager import eager_copies
from .early import commit_streamed, copy_hashed_replicas, snapshot_into, snapshot_whole, streams
from .prepare import encode_objects
from .slots import stream_layout
from .snapshot import SnapshotBuffers
from .stream import Stream, StreamingWriter, StreamSources

logger = logging.getLogger(__name__)


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
        return snapshot_whole(ch, options, snapshot_into(ch.buffers, shard, sources))
    plan = _plan(ch, settings, shard, sources, guard, guarded, deferred_plan.tree(data))
    if deferred_plan.keepable(sources.given, sources.sources):
        ch.deferred_plan = plan
    return _deferred_from_plan(ch, options, plan, None)


def plan_settings(request: SaveRequest, rank: int, world: int) -> PlanSettings:
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
    keys = [i.key for i in shard.items if i.writes]
    copies = eager_copies(ch.buffers, [(k, sources.sources[k]) for k in keys if k in eager])
    written = [(k, copies.buffers[k] if k in eager else sources.sources[k]) for k in keys]
    watched = [None if k in eager else deferred.watch(k, sources.given[k]) for k in keys]
    ch.buffers.retain_only(set(copies.buffers), {t.dtype for t in copies.cat_out})
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
        meta=deferred_plan.TensorMeta.of(given),
        object_kinds=tuple((k, o.kind) for k, o in objects.items()),
        objects_per_rank=tuple(o.per_rank for o in objects.values()),
        shard=shard,
        sources=sources,
        eager=copies,
        hashes_replicas=any(hashes_replica(i, settings.check_replicas) for i in shard.items),
        written=written,
        watched=watched,
        watched_tensors=tuple(w.tensor for w in watched if w is not None),
        watched_at=_places(watched),
        layout=stream_layout(written, arena.slot_bytes),
        arena=arena,
        buffers_generation=ch.buffers.generation,
        tree=tree,
    )


def _places(watched: list[deferred.Watched | None]) -> list[int]:
    """Each leaf's place among the watched ones (-1 for a leaf copied eagerly)."""
    out, n = [], 0
    for w in watched:
        out.append(-1 if w is None else n)
        n += w is not None
    return out


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
    if plan.hashes_replicas:
        shard = copy_hashed_replicas(shard, plan.sources, options.check_replicas)
    plan.eager.copy()
    s = Stream(plan.arena, plan.written, ch.comm.rank, plan.layout)
    s.proof = deferred.Proof(ch.comm.rank, plan.watched, deferred.versions(plan.watched_tensors), plan.watched_at)

    def factory(o: SaveOptions, rank: int, sh: LocalShard | Exception, cache: MergeCache) -> ShardWriter:
        return StreamingWriter(o, rank, sh, cache, s)

    fut = ch.submit(partial(commit_streamed, s, bg, options, shard, ch.merges, factory, ch.defer))
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
    given = [sources.given[i.key] for i in later]
    proof = deferred.Proof(
        ch.comm.rank, [deferred.watch(i.key, t) for i, t in zip(later, given)], deferred.versions(given)
    )
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
    return commit_and_open(comm, options, shard, cache, None, retire, shard)
