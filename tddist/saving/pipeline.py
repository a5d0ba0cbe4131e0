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
from concurrent.futures import Future
from typing import Any

from tensordict import TensorDict

from ..comm.resolve import resolve
from ..core.types import (
    LocalShard,
    SaveRequest,
)
from . import background
from .committing import commit, open_committed
from .deferred_save import plan_settings, start_deferred
from .early import start_early
from .prepare import prepare_shard
from .snapshot import Snapshotter

logger = logging.getLogger(__name__)


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
        return start_deferred(ch, options, prepare, plan_settings(request, c.rank, c.size), data)
    return start_early(ch, options, prepare, request.early.snapshot_budget, request.early.writer)
