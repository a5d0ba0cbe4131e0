"""Restore from the node-local copies that survive: own parts, peers' replicas, over the network.

With replication (``replicas=1``), the ranks of a restarted job pool what
their local directories hold (``inventory``: own parts and replicas, each a
``Copy``; one allgather) and pick the newest step of which every part has a
copy (``choose``); a copy found bad is left out and the choice made again.
Each rank then needs some parts (``needs``): its own on the same world size;
on another one, the parts whose rows overlap its even share of each sharded
leaf (and one part for the replicated leaves), and the parts whose DTensor
shards intersect its own (``box_reshard``: their boxes are recorded in each
part's metadata, the ranks' own boxes are pooled with one allgather). A part held by another rank
is sent over the manager's communicator (``transfer.ship_to_memory``) as the
sender's record describes it, received into memory (a rank's own part's
large leaves straight into the state, ``direct``) and hashed as it arrives,
while each rank checks the copies it reads on its own node against their
records; a copy whose bytes do not match its record is reported, and the
ranks choose again without it. A received part is loaded from memory, then
(same world size) written to the rank's local directory in the background
(``keeping``). Nothing is read from the shared root. When no step is whole, or the shared root holds a newer
one, ``restore_from_copies`` returns None and says why in the log.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import torch
from tensordict import TensorDict

from ..api import load
from ..comm.base import Communicator, LocalComm
from ..comm.collective import collective_error, contribute
from ..core.tree import flatten
from ..core.types import Key
from ..errors import CorruptCheckpointError, IncompatibleCheckpointError
from ..loading.share import LoadReport
from ..storage.memory import MemoryStore, Regions
from . import box_reshard, direct, local_shards, transfer
from .copies import CopyRecord, FileSum, LeafSpan, PartId, digest_files, mismatch, read_record
from .keeping import Keeping
from .local_tier import LocalTier
from .peer_choice import Choice, Copy, PeerRestore, choose, even_rows, inventory, part_boxes, route
from .train_state import data_to_save, fill

logger = logging.getLogger(__name__)

#: How many times the ranks choose again after finding bad copies before they give up on the local copies.
ATTEMPTS = 3


@dataclass(frozen=True)
class Fetch:
    """One attempt's sources: for each part a rank reads, a copy on its node or the bytes arriving from a peer.

    A copy without a record (an own part whose replication was never
    confirmed) has no checksums of its own to be checked against: it is
    loaded with ``verify=True``, against its manifest's checksums.
    """

    choice: Choice
    paths: Mapping[int, str]  # part rank -> a copy on this rank's node it reads
    received: Mapping[int, Arrived]  # part rank -> its files arriving from a peer, read from memory
    shipped: bool  # some rank read a copy held by another rank
    unrecorded: frozenset[int]  # parts read from a copy without a record: loaded with verify=True


@dataclass(frozen=True)
class Arrived:
    """A part arriving from the rank that holds a copy of it: its files in memory, as they arrive."""

    copy: Copy
    files: Mapping[str, torch.Tensor]
    sums: tuple[FileSum, ...]
    ready: Callable[[str, int], None]  # waits for the first bytes of a file (``MemoryStore.ready``)
    direct: Mapping[str, Regions] = field(default_factory=dict)  # bytes received in the state (``direct``)
    spans: tuple[LeafSpan, ...] = ()  # where the sender announced its whole leaves


def restore_from_copies(
    comm: Communicator,
    tier: LocalTier,
    node: str,
    state: Any,
    step: int | None,
    shared: int | None,
    load_kwargs: dict[str, Any],
) -> PeerRestore | None:
    """Restore ``state`` from the surviving local copies (collective), or None to restore from the shared root.

    ``node``: this rank's node. ``step``: the step asked for (None: the newest); ``shared``: the newest
    step of the shared root. Returns None, after saying why in the log, when
    no step is whole on the nodes that are up, when the shared root holds a
    newer one, or when copies keep failing their checksums.

    Raises:
        TddistError: loading the parts failed on some rank (the same error on every rank).
        CorruptCheckpointError: copies failed their checksums after the state was filled from them, and no
            attempt succeeded: the shared root must restore all of it (the caller raises this when it has none).
    """
    copies = [c for held in comm.allgather(inventory(tier, node)) for c in held]
    bad: set[tuple[PartId, str, str]] = set()
    touched = False
    targets: dict[int, tuple[local_shards.LeafBox, ...]] | None = None
    for _attempt in range(ATTEMPTS):
        choice, passed = choose(copies, bad, step, comm.size)
        if passed and comm.rank == 0:
            logger.warning("restore from the node-local copies: %s", "; ".join(passed))
        if choice is None:
            if comm.rank == 0:
                logger.warning("no step has a surviving copy of every part on the nodes that are up: "
                               "restoring from the shared root")  # fmt: skip
            _give_up(comm, touched, bad)
            return None
        if step is None and shared is not None and choice.step < shared:
            if comm.rank == 0:
                logger.warning("the newest step whole on the nodes (%d) is older than the shared root's newest (%d): "
                               "restoring from the shared root", choice.step, shared)  # fmt: skip
            _give_up(comm, touched, bad)
            return None
        if choice.world != comm.size:
            targets = _pooled_targets(comm, state) if targets is None else targets
            if not _reshardable(comm, choice, targets):
                _give_up(comm, touched, bad)
                return None
        got = _attempt_restore(comm, tier, state, choice, load_kwargs, targets or {})
        if isinstance(got, PeerRestore):
            return got
        bad |= got.bad
        touched = touched or got.touched
    if comm.rank == 0:
        logger.warning("copies kept failing their checksums (%s): restoring from the shared root", sorted(bad)[:8])
    _give_up(comm, touched, bad)
    return None


def _pooled_targets(comm: Communicator, state: Any) -> dict[int, tuple[local_shards.LeafBox, ...]]:
    """Every rank's DTensor boxes in ``state`` (collective: one allgather), to choose the parts each one reads."""
    _plain, layouts = local_shards.split(data_to_save(state))
    return dict(enumerate(comm.allgather(local_shards.boxes(layouts))))


def _reshardable(comm: Communicator, choice: Choice, targets: Mapping[int, tuple[local_shards.LeafBox, ...]]) -> bool:
    """Whether the parts of ``choice`` say where their DTensor shards lie, if the state holds DTensors (the same
    answer on every rank); rank 0 logs why not."""
    if not any(targets.values()):
        return True
    old = [k for k in range(choice.world) if choice.copies[k][0].boxes is None]
    if old and comm.rank == 0:
        logger.warning("step %d was saved on %d ranks by a tddist that did not record where the DTensor shards of "
                       "its node-local parts lie (parts %s): the state's DTensors cannot be resharded from them; "
                       "restoring from the shared root", choice.step, choice.world, old[:8])  # fmt: skip
    return not old


def _give_up(comm: Communicator, touched: bool, bad: set[tuple[PartId, str, str]]) -> None:
    """Before returning None (the shared root restores the state): after an attempt that filled the state,
    raise instead, so that the caller, if the shared root has nothing, says so rather than start from step 0
    with a filled state."""
    if touched:
        raise CorruptCheckpointError(
            f"rank {comm.rank}: the node-local copies {sorted(bad)[:4]} failed their checksums after the state was "
            f"filled from an attempt to restore them; restore it from the shared root or from a fresh state"
        )


@dataclass(frozen=True)
class Retry:
    """An attempt that found bad copies: their places, and whether some rank had filled the state already."""

    bad: set[tuple[PartId, str, str]]
    touched: bool


def _attempt_restore(
    comm: Communicator,
    tier: LocalTier,
    state: Any,
    choice: Choice,
    load_kwargs: dict[str, Any],
    targets: Mapping[int, tuple[local_shards.LeafBox, ...]],
) -> PeerRestore | Retry:
    """One attempt (collective): bring the copies held elsewhere to their readers and fill ``state`` from the
    parts while they arrive; the restore, or the copies found bad on any rank.

    The senders announce each copy's files with their checksums (its
    record's, else hashed now). While the transfer runs, each rank checks the
    copies it reads on its own node against their records and, if they
    match, fills the state, from them and from the received bytes as they
    arrive (each hashed as it comes). The ranks then agree: a copy whose bytes
    did not match is bad on every rank, and the state is filled again.
    """
    me, routes = comm.rank, route(choice, comm.size, targets)
    sending = sorted({c for (reader, _k), c in routes.items() if c.holder == me and reader != me}, key=_order)
    reading = sorted({c for (r, _k), c in routes.items() if c.holder == me and r == me}, key=_order)
    files: dict[tuple[PartId, int], tuple[FileSum, ...]] = {}
    spans = {(c.part, c.holder): direct.leaf_spans(c.path) for c in sending}
    found = [(c, why) for c in sending if (why := _announce(c, files))]
    announced = comm.allgather((files, spans, found))
    bad = _bad([(f, fs) for f, _spans, fs in announced], comm.rank)
    if bad:
        return Retry(bad, touched=False)
    sums = {k: v for f, _spans, _found in announced for k, v in f.items()}
    laid = {k: v for _f, sp, _found in announced for k, v in sp.items()}
    shipments = [transfer.Shipment(c.holder, r, c.part, _small_first(sums[(c.part, c.holder)]), laid[(c.part, c.holder)])
                 for (r, _k), c in sorted(routes.items()) if c.holder != r]  # fmt: skip
    placed = _placed(comm, choice, [s for s in shipments if routes[(s.dst, s.part.rank)].recorded], state, load_kwargs)
    arriving = transfer.ship_to_memory(comm, shipments, lambda s: _source(routes, s), transfer.chunk_bytes(), placed)
    found = [(c, why) for c in reading if (why := _check(c))]  # while the transfer runs
    fetch = _sources(comm, choice, routes, shipments, arriving)
    outcome = contribute(lambda: _fill(comm, state, fetch, load_kwargs)) if not found else None
    found += [(routes[(me, s.part.rank)], "it arrived with other checksums than its record's") for s in arriving.wait()]
    touched = outcome is not None or bool(arriving.direct)  # bytes received in the state changed it
    agreed = comm.allgather((found, touched, outcome.failure if outcome is not None else None))
    bad = _bad([({}, f) for f, _touched, _failure in agreed], comm.rank)
    if bad:
        return Retry(bad, touched=any(t for _f, t, _failure in agreed))
    failures = {r: f for r, (_found, _touched, f) in enumerate(agreed) if f is not None}
    if failures:
        raise collective_error(f"restoring step {choice.step} from the node-local copies", failures)
    assert outcome is not None and outcome.value is not None  # no rank found a bad copy, none failed
    return _restored(comm, tier, fetch, *outcome.value)


def _placed(
    comm: Communicator, choice: Choice, shipments: list[transfer.Shipment], state: Any, load_kwargs: dict[str, Any]
) -> dict[transfer.Shipment, dict[str, Regions]]:
    """Where this rank receives the leaves of its own part straight into ``state`` (same world size; ``direct``).

    ``shipments``: those of copies with a record. A copy without one is loaded with ``verify=True``
    (its manifest's chunk checksums), which a leaf received in place would skip.
    """
    mine = [s for s in shipments if s.dst == comm.rank and s.part.rank == comm.rank and s.spans]
    if choice.world != comm.size or not mine:
        return {}
    into = direct.targets(state, load_kwargs)
    return {s: regions for s in mine if (regions := direct.places(s, into))}


def _small_first(files: tuple[FileSum, ...]) -> tuple[FileSum, ...]:
    """A copy's files in the order they are sent: the smallest first (the manifest and index, which a load
    reads first), so that a load from the bytes arriving starts at once."""
    return tuple(sorted(files, key=lambda f: (f.size, f.name)))


def _sources(
    comm: Communicator,
    choice: Choice,
    routes: Mapping[tuple[int, int], Copy],
    shipments: list[transfer.Shipment],
    arriving: transfer.Arriving,
) -> Fetch:
    """Where this rank reads each part of the attempt: its node's copies, and the bytes arriving from peers."""
    me = comm.rank
    mine = {k: c for (r, k), c in routes.items() if r == me}
    received = {}
    for s in shipments:
        if s.dst == me:
            ready = partial(arriving.until, s)
            placed = arriving.direct.get(s, {})
            received[s.part.rank] = Arrived(mine[s.part.rank], arriving.files[s], s.files, ready, placed, s.spans)
    paths = {k: c.path for k, c in mine.items() if c.holder == me}
    unrecorded = frozenset(k for k, c in mine.items() if not c.recorded)
    return Fetch(choice, paths, received, bool(shipments), unrecorded)


def _order(c: Copy) -> tuple[PartId, int]:
    return c.part, c.holder


def _source(routes: Mapping[tuple[int, int], Copy], s: transfer.Shipment) -> str:
    return routes[(s.dst, s.part.rank)].path


def _announce(c: Copy, files: dict[tuple[PartId, int], tuple[FileSum, ...]]) -> str | None:
    """Put the files of copy ``c``, which this rank sends, with their checksums in ``files``; or why it cannot.

    A copy with a record is sent as its record says, without reading it (the
    receiver checks every byte against it); one without is hashed first.
    """
    try:
        record = read_record(c.path) if c.recorded else None
        files[(c.part, c.holder)] = record.files if record is not None else digest_files(c.path)
    except OSError as e:
        return f"{c.path} cannot be read: {e}"
    return None


def _check(c: Copy) -> str | None:
    """Why copy ``c``, which this rank reads on its own node, does not match its record, or None (also when
    it has none: it is then loaded with ``verify=True``)."""
    try:
        record = read_record(c.path) if c.recorded else None
        return mismatch(c.path, record.files) if record is not None else None
    except OSError as e:
        return f"{c.path} cannot be read: {e}"


def _bad(announced: Sequence[tuple[Any, list[tuple[Copy, str]]]], rank: int) -> set[tuple[PartId, str, str]]:
    """The places of the copies some rank found bad (rank 0 logs each)."""
    found = [f for _files, fs in announced for f in fs]
    if found and rank == 0:
        for c, why in found:
            logger.warning("the copy of %s at %s on %s is bad (%s): choosing again without it", c.part.name,
                           c.path, c.node, why)  # fmt: skip
    return {c.place for c, _why in found}


def _fill(
    comm: Communicator, state: Any, fetch: Fetch, load_kwargs: dict[str, Any]
) -> tuple[LoadReport, tuple[local_shards.DTensorLayout, ...]]:
    """Fill ``state`` from the parts this rank reads (a received one as its bytes arrive); the report and the
    layouts of the state's DTensor leaves."""
    choice, me = fetch.choice, comm.rank
    layouts: list[tuple[local_shards.DTensorLayout, ...]] = []

    def fill_from_parts(into: Any) -> LoadReport:
        plain, found = local_shards.split(into)
        layouts.append(found)
        if choice.world == comm.size:
            kwargs = {**load_kwargs, "verify": True} if me in fetch.unrecorded else load_kwargs
            report = _read(fetch, me, into=plain, **kwargs)
            assert isinstance(report, LoadReport)  # load(into=...) returns its report
            return report
        return reshard(plain, fetch, me, comm.size, found)

    report = fill(state, fill_from_parts)
    return report, layouts[-1] if layouts else ()


def _restored(
    comm: Communicator,
    tier: LocalTier,
    fetch: Fetch,
    report: LoadReport,
    layouts: tuple[local_shards.DTensorLayout, ...],
) -> PeerRestore:
    """What was restored; on the same world size, a part received from a peer starts being written to this
    rank's local directory, to be its own copy again (``keeping``)."""
    choice, me = fetch.choice, comm.rank
    same = choice.world == comm.size
    keeping = None
    if same and me in fetch.received:
        got = fetch.received[me]
        sums = tuple(sorted(got.sums, key=lambda f: f.name))  # a record lists its files by name
        record = CopyRecord(got.copy.part, sums, got.copy.holder, got.copy.node)
        keeping = Keeping(tier, record, got.files, got.direct)
    path = tier.part(choice.step) if same else _where(fetch, min([*fetch.paths, *fetch.received]))
    tier_name = "peers" if fetch.shipped else "local"
    return PeerRestore(choice.step, path, report, layouts, tier_name, same, keeping)


def _read(fetch: Fetch, k: int, **kwargs: Any) -> TensorDict | LoadReport:
    """``load`` part ``k``: from the bytes arriving if it is received, else from its copy on this node."""
    got = fetch.received.get(k)
    if got is None:
        return load(fetch.paths[k], comm=LocalComm(), **kwargs)
    store = MemoryStore(_where(fetch, k), got.files, got.ready, got.direct)
    if not got.direct:
        return load(store, comm=LocalComm(), **kwargs)
    placed = direct.received_keys(store.open().manifest, got.spans, got.direct)  # already in the state
    report = load(store, comm=LocalComm(), exclude=placed, **kwargs)
    assert isinstance(report, LoadReport)  # only the own part, loaded into the state, is received in it
    for key in placed:
        report.skipped.pop(key, None)
        report.loaded.append(key)
    return report


def _where(fetch: Fetch, k: int) -> str:
    """Part ``k`` as messages name it: its copy on this node, or the copy it was received from."""
    got = fetch.received.get(k)
    return fetch.paths[k] if got is None else f"rank {got.copy.holder}'s copy {got.copy.node}:{got.copy.path}"


def reshard(
    plain: Any, fetch: Fetch, rank: int, world: int, layouts: tuple[local_shards.DTensorLayout, ...] = ()
) -> LoadReport:
    """Fill ``plain`` (this rank's even share of every sharded leaf, the local shards of the DTensor leaves
    ``layouts`` describe) from the parts of another world size.

    Parts whose copies have no record are loaded with ``verify=True``.
    """
    choice = fetch.choice
    datas = {k: _read(fetch, k, verify=k in fetch.unrecorded) for k in [*fetch.paths, *fetch.received]}  # mapped
    sources, targets = part_boxes(choice), local_shards.boxes(layouts)
    boxed = {b.key for found in [targets, *sources] for b in found}
    rows = [{key: n for key, n in choice.copies[k][0].rows if key not in boxed} for k in range(choice.world)]
    _nodes, leaves, objects = flatten(plain)
    if objects:
        raise IncompatibleCheckpointError(
            f"rank {rank}: the state holds non-tensor leaves {sorted(objects)[:5]}: the node-local copies reshard "
            f"tensors only onto another world size"
        )
    read = partial(_part_leaf, datas, rank)
    where = f"rank {rank}: step {choice.step} (saved on {choice.world} ranks)"
    box_reshard.fill(leaves, targets, {k: sources[k] for k in datas}, read, where)
    dtensors = {b.key for b in targets}
    for key, t in leaves.items():
        if key in dtensors:
            continue
        if key in boxed:
            raise IncompatibleCheckpointError(
                f"{where}: {'/'.join(key)} was saved as a DTensor and is a plain tensor in the state; restore "
                f"into a state of the saved layout"
            )
        if key not in rows[0]:
            t.copy_(_leaf(datas[min(datas)], key, rank))
            continue
        lo, hi = even_rows(sum(r.get(key, 0) for r in rows), rank, world)
        if t.shape[0] != hi - lo:
            raise IncompatibleCheckpointError(
                f"rank {rank}: {'/'.join(key)} has {t.shape[0]} rows, its even share of step {choice.step} is {hi - lo}"
            )
        at = 0
        for k, r in enumerate(rows):
            a, b = max(lo, at), min(hi, at + r.get(key, 0))
            if a < b:
                t[a - lo : b - lo].copy_(_leaf(datas[k], key, rank)[a - at : b - at])
            at += r.get(key, 0)
    return LoadReport(loaded=list(leaves))


def _part_leaf(datas: Mapping[int, Any], rank: int, k: int, key: Key) -> torch.Tensor:
    return _leaf(datas[k], key, rank)


def _leaf(data: Any, key: Key, rank: int) -> torch.Tensor:
    try:
        return data.get(key)
    except KeyError:
        raise IncompatibleCheckpointError(f"rank {rank}: the node-local copy has no leaf {'/'.join(key)}") from None
