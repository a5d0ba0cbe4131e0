"""A save's commit and its read-back, on every rank: this rank's shard written and the checkpoint published
(``commit``), then what this rank saved mapped from the checkpoint that commit named (``open_committed``).

The synchronous save runs both on the caller's thread (``pipeline.save``); an early or deferred save hands
them to its channel's worker (``early``, ``deferred_save``); the writer process runs ``commit`` alone.
"""

from __future__ import annotations

import logging
import pickle
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial

from tensordict import TensorDict

from .. import format as fmt
from .._version import __version__
from ..comm.base import Communicator
from ..core.tree import build
from ..core.types import (
    Fragment,
    LoadOptions,
    LocalShard,
    ManifestFiles,
    SavedRows,
    SaveOptions,
    Staging,
    Structure,
)
from ..errors import CheckpointChangedError, NonFiniteError, StorageError, TargetError, TddistError
from ..loading.pipeline import read_shard
from ..manifest.merge import MergeCache, merge_fragments
from ..manifest.model import Manifest
from ..manifest.v2 import encode
from ..storage.backends import Store, store_for
from ..storage.base import ShardWriter
from ..storage.opened import OpenedCheckpoint, Pin
from .commit import Retire, two_phase_commit
from .own_rows import map_own_rows, maps_own_rows
from .snapshot import Snapshotter

logger = logging.getLogger(__name__)

#: The largest manifest (pickled, in bytes) that rank 0 sends every rank with its decision, so that they read
#: back their shard without reading and parsing it again; a larger one is read. A decision with one still fits
#: the gloo communicator's broadcast slot (``comm.slots.BROADCAST_SLOT``), so it costs no other operation.
SHARED_MANIFEST_BYTES = 12 << 10

#: A function that prepares this rank's shard, snapshotting its tensors into the given buffers.
Prepare = Callable[[Snapshotter | None], LocalShard | Exception]
#: A function that makes this rank's writer of a save (the store's, or one that writes a streamed snapshot).
WriterFactory = Callable[[SaveOptions, int, LocalShard | Exception, MergeCache], ShardWriter]


def store_of(options: SaveOptions) -> Store:
    """The store a save writes to (``storage.backends``)."""
    return store_for(options.target, options.container == "archive")


@dataclass(frozen=True)
class Committed:
    """A save this rank took part in, once committed: what ``open_committed`` reads back exactly."""

    writer: ShardWriter | None  # None: a writer process wrote it
    generation: str  # of the manifest rank 0 published
    pin: Pin | None  # the checkpoint, pinned before it was published (file stores; ``Store.pin_staging``)
    #: the manifest rank 0 published, pickled and sent with the decision (a small one; ``share``); None: read it.
    #: Unpickled only by a read-back that needs it (``open_saved``): most map their own rows without it.
    shared: bytes | None = None
    #: this rank's saved shard, mapped from its own data file through ``pin`` while rank 0 decided
    #: (``map_own_rows``); None: ``open_committed`` reads it back after the decision.
    rows: TensorDict | None = None


def commit(
    c: Communicator,
    options: SaveOptions,
    shard: LocalShard | Exception,
    cache: MergeCache,
    make_writer: WriterFactory | None = None,
    retire: Retire | None = None,
    read_back: bool = True,
) -> Committed:
    """Write this rank's shard and run the two-phase commit; return what was committed once it is published.

    ``make_writer``: a writer other than the store's own (a streamed
    snapshot's); ``retire``: where the removal of the replaced checkpoint goes
    (``two_phase_commit``). The store pins the staging area on every rank
    before its vote, so a save that replaces this one at once cannot make it
    read back another save's data. A rank whose rows ``map_own_rows`` returns
    maps them through that pin once it has voted, while it waits for the
    decision (``Committed.rows``). ``read_back=False`` (a writer process,
    whose trainer reads back itself): no rows are mapped.
    """
    store = store_of(options)
    writer = (make_writer or store.writer)(options, c.rank, shard, cache)
    pins: list[Pin] = []
    built: list[tuple[Manifest, ManifestFiles]] = []
    own_rows = isinstance(shard, LocalShard) and maps_own_rows(options, shard)
    mapped: list[TensorDict] = []

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
        files = encode(m)
        built.append((m, files))
        return files

    try:
        published = two_phase_commit(
            c,
            writer,
            build_manifest,
            retire,
            on_staged=pin,
            share=lambda: share(*built[-1]),
            wants_shared=not own_rows,
            after_vote=partial(_map_while_waiting, store, c.rank, shard, pins, mapped)
            if read_back and own_rows
            else None,
        )
    except BaseException:
        for p in pins:
            p.close()
        raise
    writer.committed()
    logger.info("rank %d: committed %s", c.rank, options.target)
    shared = published.shared if isinstance(published.shared, bytes) else None
    return Committed(writer, published.generation, pins[0] if pins else None, shared, mapped[0] if mapped else None)


def _map_while_waiting(
    store: Store, rank: int, shard: LocalShard | Exception, pins: list[Pin], mapped: list[TensorDict]
) -> None:
    """(``two_phase_commit``'s ``after_vote``, for a shard ``maps_own_rows`` holds for) This rank's rows,
    mapped into ``mapped`` from the data file it wrote and fsynced, through the pin of the tree rank 0
    publishes if it commits: the read-back's CPU spent while rank 0 gathers and decides, not after the
    decision, when every rank would spend it at once on the save's critical path. Dropped if the save
    aborts; a failure here is left to the read-back after the decision, which reports it."""
    if not (pins and not pins[0].archive and isinstance(shard, LocalShard)):  # a failed vote pinned nothing
        return
    try:
        mapped.append(map_own_rows(store.files(pins[0]), rank, shard))
    except Exception:
        logger.debug("rank %d: mapping the saved rows before the decision failed", rank, exc_info=True)


def share(m: Manifest, files: ManifestFiles | None = None) -> bytes | None:
    """(rank 0) The manifest it built, pickled, to send with the decision: None when larger than
    ``SHARED_MANIFEST_BYTES`` (every rank then reads it). A manifest whose written ``files`` already exceed
    that is not pickled at all: a large one would be copied once more on the commit's path for nothing.

    Every rank, rank 0 included, reads back through a copy (``received``), as it would through a parsed
    manifest: the built one holds the caller's own non-tensor values and tables the ``MergeCache`` keeps.
    """
    if files is not None and len(files.manifest) + len(files.index) > SHARED_MANIFEST_BYTES:
        return None
    data = pickle.dumps(m, protocol=pickle.HIGHEST_PROTOCOL)
    return data if len(data) <= SHARED_MANIFEST_BYTES else None


def received(shared: object) -> Manifest | None:
    """The manifest rank 0 sent with its decision (``share``), a copy of its own, or None."""
    return pickle.loads(shared) if isinstance(shared, bytes) else None


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
    store, pin = store_of(options), committed.pin
    try:
        if committed.rows is not None and pin is not None:  # mapped while rank 0 decided
            pin.close()
            return committed.rows
        if pin is not None and not pin.archive and maps_own_rows(options, shard):
            try:  # the pinned tree is the one rank 0 committed: no generation to compare
                return map_own_rows(store.files(pin), c.rank, shard)
            finally:
                pin.close()
        own = {i.key: i.dtensor.box for i in shard.items if i.dtensor is not None}
        opts = LoadOptions(SavedRows(), allow_pickle=options.allow_pickle, share_non_tensor=options.share_non_tensor)
        with open_saved(store, committed) as opened:
            if opened.generation != committed.generation:
                raise CheckpointChangedError(
                    f"rank {c.rank}: {options.target!r} holds another save's checkpoint (generation "
                    f"{opened.generation}, this save committed {committed.generation})"
                )
            return read_shard(opened, c, opts, own)
    except CheckpointChangedError as e:
        return replaced_after_commit(c.rank, options, in_memory, e)
    except StorageError as e:
        raise unreadable_after_commit(c.rank, options.target, e) from e
    except TddistError:
        raise
    except OSError as e:  # the file system failed after the commit (an I/O error, a power loss)
        raise unreadable_after_commit(c.rank, options.target, e) from e


def open_saved(store: Store, committed: Committed) -> OpenedCheckpoint:
    """The committed checkpoint opened to read this rank's shard back: through the pin with the manifest this
    rank already holds (a directory on a file system: the pin holds the very tree rank 0 wrote that manifest
    into), else by the store, which reads the manifest again."""
    pin, manifest = committed.pin, received(committed.shared)
    if manifest is not None and pin is not None and not pin.archive:
        return OpenedCheckpoint(pin, manifest, committed.generation, store.files)
    return store.open_saved(committed.writer, committed.pin)


def commit_and_open(
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


def replaced_after_commit(
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


def unreadable_after_commit(rank: int, target: str, e: OSError | StorageError) -> TargetError:
    """The error of a save whose commit is durable but whose checkpoint could not be read back (the I/O failed)."""
    return TargetError(
        f"rank {rank}: the save to {target!r} was committed and is durable, but opening it to return it failed: "
        f"{e}; once the file system is readable again, tddist.load reads it"
    )


# --- return_early: snapshot on the caller's thread, commit on the channel's worker ---------------------------
