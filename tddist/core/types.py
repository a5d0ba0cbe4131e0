"""The values that cross the seams between modules, as frozen dataclasses.

``api`` builds them at the edge (the public string shortcuts, such as
``shard="even"``, are normalised here once); ``commit``, the stores, the
manifest and the reader consume them. Everything a rank sends to another
(a failure, a plan, a fragment, a decision) is one of these, so it pickles
the same over every communicator. Nothing here imports torch at run time.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Generic, Literal, TypeVar

from .finite import ChunkStats
from .sharding import Box, Placement

if TYPE_CHECKING:
    import torch

Key = tuple[str, ...]
T = TypeVar("T")

#: A checkpoint's container: a directory tree or one zip archive (stored in the manifest as ``layout``).
ContainerName = Literal["directory", "archive"]


# --- agreement between ranks ------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Failure:
    """One rank's error, as sent to the other ranks: its class name and its message."""

    error_class: str
    message: str


@dataclass(frozen=True, slots=True)
class Contribution(Generic[T]):
    """What one rank brings to a decision: a value, or the failure that kept it from having one."""

    value: T | None = None
    failure: Failure | None = None


@dataclass(frozen=True, slots=True)
class Decision(Generic[T]):
    """What rank 0 decided and every rank learns: a value, or the failures of the ranks that failed."""

    value: T | None = None
    failures: Mapping[int, Failure] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return not self.failures


# --- what a rank saves --------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class DTensorBox:
    """Where a rank's local shard of a DTensor lies in the global tensor."""

    box: Box
    global_shape: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class SaveItem:
    """One tensor leaf this rank saves: its local bytes (contiguous, on the CPU), placement and role.

    ``writes`` is False for a replica that another rank writes.
    """

    key: Key
    tensor: torch.Tensor
    placement: Placement
    writes: bool
    dtensor: DTensorBox | None = None
    own_memory: bool = False  # ``tensor`` views the caller's memory (not a copy made for the save)


@dataclass(frozen=True, slots=True)
class EncodedObject:
    """A non-tensor leaf, encoded for the manifest: ``kind`` "data" (one value) or "stack" (one per row)."""

    kind: Literal["data", "stack"]
    value: Any
    per_rank: bool = False  # under a PerRank placement: kept per rank even when equal on every rank


@dataclass(frozen=True, slots=True)
class LocalShard:
    """This rank's prepared shard: its nodes (batch sizes), tensor leaves and non-tensor leaves."""

    nodes: Mapping[Key, tuple[int, ...]]
    items: tuple[SaveItem, ...]
    objects: Mapping[Key, EncodedObject]

    def written(self) -> dict[Key, torch.Tensor]:
        """The tensors this rank writes, by key."""
        return {i.key: i.tensor for i in self.items if i.writes}


@dataclass(frozen=True, slots=True)
class Compression:
    """A zip compression method (``zipfile.ZIP_*`` or 93 for zstd) and its level (None: the default)."""

    method: int
    level: int | None = None


@dataclass(frozen=True, slots=True)
class SaveOptions:
    """The options of one save that the commit and the stores need, normalised by ``arguments.save_request``."""

    target: str
    container: ContainerName
    metadata: Mapping[str, Any]
    robust_key: bool
    num_threads: int
    check_replicas: bool
    atomic: bool
    share_non_tensor: bool
    allow_pickle: bool
    compression: Compression | None = None
    packing: Literal["packed", "memmap"] = "packed"  # directories: one data file per rank, or per leaf
    require_finite: bool = False  # refuse to publish a checkpoint that holds NaN or Inf values
    base: str | None = None  # an incremental save: the checkpoint whose equal chunks are referenced, not written
    # an incremental synchronous save: a leaf whose storage and version counter are those it had when this process
    # last hashed it is not hashed again (asynchronous saves write snapshot buffers, reused without a new version)
    reuse_hashes: bool = False


@dataclass(frozen=True, slots=True)
class EarlyReturn:
    """How a ``return_early=True`` save snapshots its data and where its commit runs."""

    snapshot_budget: int | None  # the most bytes the snapshot may hold (None: the whole state)
    writer: Literal["thread", "process"]  # ``async_writer``
    deferred: bool = False  # ``snapshot="deferred"``: copied after ``save`` returns (``saving.deferred``)
    # the optimizers whose steps wait for a deferred copy; None: those ``get_state`` saw that change a saved leaf
    guard: tuple[Any, ...] | None = None


@dataclass(frozen=True)
class SaveRequest:
    """A save's keyword arguments, checked and normalised in one place (``save_request``).

    ``options`` is what the commit and the stores need; the rest is how the
    pipeline runs the save (``saving.pipeline.save``).
    """

    options: SaveOptions
    comm: Any  # as the caller passed it; resolved by the pipeline
    timeout: float | None
    placements: Mapping[Any, Any] | None
    copy_existing: bool
    wait_for_pending: bool
    early: EarlyReturn | None  # None: a synchronous save


# --- the structure every rank must share ---------------------------------------------------

#: The size along a leaf's shard dim (or a node's dim 0), which differs between ranks.
VARIES = -1


@dataclass(frozen=True, slots=True)
class LeafSpec:
    """What every rank must agree on about one tensor leaf."""

    key: Key
    dtype: str
    shape: tuple[int, ...]  # the local shape, VARIES along a Shard dim
    placement: Placement
    global_shape: tuple[int, ...] | None = None  # a DTensor's


@dataclass(frozen=True, slots=True)
class NodeSpec:
    """A node (a sub-TensorDict) and its batch size, VARIES in dim 0 when it has batch dims."""

    key: Key
    batch: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class ObjectSpec:
    """A non-tensor leaf: its key, kind ("data" or "stack"), and whether it is under a PerRank placement."""

    key: Key
    kind: str
    per_rank: bool = False


@dataclass(frozen=True, slots=True)
class Structure:
    """A rank's structure, in the order the arrays of its fragment follow."""

    nodes: tuple[NodeSpec, ...]
    leaves: tuple[LeafSpec, ...]
    objects: tuple[ObjectSpec, ...]
    digest: str


# --- the commit protocol -------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class SavePlan:
    """A rank's contribution to the first round of the commit.

    Rank 0 compares every rank's target, container, atomicity and packing (they
    must be equal) and reserves ``region_bytes`` for each rank (archives).
    """

    target: str
    container: ContainerName
    atomic: bool
    region_bytes: int = 0
    digest: str = ""  # of the rank's Structure
    structure: Structure | None = None  # rank 0's plan only (its own value never leaves it)
    packing: str = ""  # "packed" or "memmap": ranks of one save must write their chunks alike


@dataclass(frozen=True, slots=True)
class Staging:
    """Where the ranks write before the commit: the staging path, and each rank's region start (archives)."""

    path: str
    region_starts: tuple[int, ...] = ()
    end: int = 0  # where the regions end (rank 0 puts the manifest and index there)
    reference: Structure | None = None  # rank 0's, when some rank's structure digest differs from it
    seed: str = ""  # rank 0's random seed of the next saves' staging names (the commit's one-round path)

    def region_start(self, rank: int) -> int:
        return self.region_starts[rank] if self.region_starts else 0


@dataclass(frozen=True, slots=True)
class ManifestFiles:
    """A manifest as written: the bytes of ``tddist.json`` and of its index ``tddist.idx``."""

    manifest: bytes
    index: bytes


@dataclass(frozen=True, slots=True)
class StoredBytes:
    """What a rank wrote for one leaf: the byte count, the checksum and, for a floating-point leaf, the counts
    of its non-finite values (``core.finite``, computed in the checksum's pass; None for other dtypes)."""

    nbytes: int
    checksum: str
    stats: ChunkStats | None = None


@dataclass(frozen=True, slots=True)
class FragmentObject:
    """One non-tensor leaf of a rank's fragment."""

    key: Key
    kind: Literal["data", "stack"]
    value: Any


@dataclass(frozen=True, slots=True)
class ArchiveEntryRow:
    """What rank 0 needs of one archive entry to write the central directory."""

    name: str
    offset: int
    method: int
    crc: int
    size: int
    csize: int


@dataclass(frozen=True, slots=True)
class Holder:
    """A checkpoint that holds the bytes of chunks an incremental checkpoint references (docs/format.md 5.10).

    Attributes:
        name: its name beside the referencing checkpoint: one path component.
        generation: its manifest's checksum when the reference was made.
    """

    name: str
    generation: str


@dataclass(frozen=True, slots=True)
class Fragment:
    """What one rank reports after writing its shard (its vote), as compact arrays.

    The arrays follow the order of the rank's ``Structure``; every rank of a
    save has the same one (equal ``digest``), so rank 0 merges them column
    by column. 16 bytes per leaf and rank, plus the boxes of DTensor leaves
    when they changed since this rank's previous save; the counts of
    non-finite values add nothing per leaf for a clean state.
    """

    rank: int
    digest: str
    node_rows: bytes  # int64 per node: its dim-0 rows here (0 for a node without batch dims)
    lengths: bytes  # int64 per leaf: its size along its Shard dim here (0 for other placements)
    checksums: bytes  # uint64 per leaf: what this rank stored; with check_replicas, a replica's; else 0
    boxes: bytes | None = None  # int64 per Boxes leaf: writes (0/1), offsets, sizes; None: as last time
    objects: tuple[FragmentObject, ...] = ()
    entries: tuple[ArchiveEntryRow, ...] = ()
    # Counts of non-finite values (format version 4), sparse: nothing per leaf for a clean state.
    non_finite: bytes = b""  # uint64 triples (leaf index, NaN count, Inf count), only for chunks that hold any
    uncounted: bytes = b""  # int64 leaf indices: floating leaves stored here without counts (none by tddist's writers)
    largest: float = 0.0  # the largest finite magnitude among the values of every counted chunk stored here
    largest_leaf: int = -1  # the leaf index of the chunk that holds it; -1: no counted value here is nonzero
    # An incremental save (``base=``) only: per leaf, which holder of ``base`` holds this rank's chunk (int64,
    # 0: written here, ``h``: ``base[h - 1]``) and its chunk's XXH3-128 (two uint64); ``base``: the holders this
    # rank's numbering refers to (None: it read no base).
    holders: bytes = b""
    ids: bytes = b""
    base: tuple[Holder, ...] | None = None


@dataclass(frozen=True)
class StagedVote:
    """A rank's only contribution to a commit that staged without rank 0 (the one-round path).

    ``plan`` is what the first round would have sent (rank 0 compares them);
    ``fragment`` is the vote; ``created`` is the top-most parent directory of
    the target that this rank created (None: every one existed), which rank 0
    makes durable before it publishes; ``wants_shared``: whether this rank
    uses what rank 0 shares with the decision (``two_phase_commit``'s
    ``share``), which rank 0 then builds only if some rank does.
    """

    plan: SavePlan
    fragment: Fragment
    created: str | None = None
    wants_shared: bool = True


# --- what a rank loads ----------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class EvenRows:
    """``shard="even"``: this rank's even share of the rows, as ``torch.tensor_split`` splits them."""


@dataclass(frozen=True, slots=True)
class SavedRows:
    """``shard="saved"``: exactly the rows this rank saved (same world size only)."""


@dataclass(frozen=True, slots=True)
class RowRange:
    """``shard=(start, stop)``: the same row range on every sharded leaf."""

    start: int
    stop: int


@dataclass(frozen=True, slots=True)
class RowCounts:
    """``shard=[n_0, n_1, ...]``: per-rank row counts, in rank order."""

    counts: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class AllRows:
    """``shard=None``: the whole global checkpoint."""


ShardRequest = EvenRows | SavedRows | RowRange | RowCounts | AllRows


@dataclass(frozen=True, slots=True)
class PerRankPolicy:
    """What a load does with per-rank leaves on another world size, from the public ``per_rank=`` value.

    ``kind``: "error" (the default: refuse, naming the keys), "drop", "rank0",
    or "call" (``fn(key, values, rank, size)`` picks each rank's value).
    """

    kind: Literal["error", "drop", "rank0", "call"] = "error"
    fn: Any = None


@dataclass(frozen=True, slots=True)
class LoadOptions:
    """The options of one load, normalised by ``api.load``."""

    shard: ShardRequest
    keys: tuple[Key, ...] | None = None
    exclude: tuple[Key, ...] = ()
    per_rank: PerRankPolicy = PerRankPolicy()
    device: Any = None
    verify: bool = False
    num_threads: int = 0
    allow_pickle: bool = False
    share_non_tensor: bool = False
