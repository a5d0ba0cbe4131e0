"""Store conformance: the guarantees every tddist store keeps, checked the same way on each.

Modelled on zarr-python's ``StoreTests``: ``StoreConformance`` is one base
class of test methods (no ``Test`` prefix, so pytest collects nothing from it
directly) and ``tests/test_store_conformance.py`` subclasses it once per
store that ``tddist.storage.backends.store_for`` can choose: a packed
directory, a directory of one file per leaf (``layout="memmap"``), a local
``.tdz`` archive, a directory on S3 and an archive on S3 (a real SeaweedFS
server, ``s3_env`` in tests/conftest.py).

A subclass provides:

- ``target``: a fixture giving a fresh checkpoint prefix (a path under
  ``tmp_path``, or ``s3://bucket/prefix/...``);
- ``save_kwargs``: the keyword arguments of ``tddist.save`` that pick the store
  (``layout="memmap"``), and ``layout``/``packing``: what its manifest says;
- ``flip(target, location)``: invert one byte of a chunk where it is stored;
- ``stray(target)``: everything at the store that is not the committed
  checkpoint (staging areas, uncommitted generations, unfinished uploads);
- ``cleanup_fails()``: a context in which removing an aborted save's staging
  area fails, so that the save leaves it behind (as a crash would);
- what a load that pinned the checkpoint before it was replaced, or before
  one of its bytes was flipped, gets when it reads afterwards.

Every guarantee is asserted on real files and objects: several ranks are
threads (``tddist.run_threads``), faults are the library's own injection
points (``tddist._faults``), and reads are observed, never replaced, through
a recording ``ChunkFiles`` proxy.
"""

from __future__ import annotations

import contextlib
import io
import itertools
import math
import re
import struct
import zipfile
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar

import pytest
import torch
from tensordict import TensorDict

import tddist
from tddist import format as fmt
from tddist._faults import inject
from tddist.comm.base import LocalComm
from tddist.core.types import LoadOptions
from tddist.errors import CheckpointChangedError, CorruptCheckpointError, InjectedFault, ShardingError
from tddist.loading.pipeline import read_shard
from tddist.loading.share import shard_request
from tddist.manifest.locate import ChunkRange, Location, Locator, PackedChunks
from tddist.storage.backends import store_for
from tddist.storage.opened import ChunkFiles, OpenedCheckpoint
from tests.helpers import assert_td_equal

#: Every dtype the format lists (``tddist.format``), as torch dtypes.
DTYPES = sorted(
    {
        d
        for d in vars(torch).values()
        if isinstance(d, torch.dtype) and fmt.is_dtype_name(str(d).removeprefix("torch."))
    },
    key=str,
)
#: The dtypes every store must hold (the format may list more; all are tested).
REQUIRED_DTYPES = {
    torch.float16, torch.float32, torch.float64, torch.bfloat16, torch.int8, torch.int16, torch.int32,
    torch.int64, torch.uint8, torch.bool, torch.complex64,
}  # fmt: skip
#: Rows of the batched leaves saved by each rank of the round trip: uneven, and one rank holds none.
ROWS = (3, 0, 5)


# --- data ----------------------------------------------------------------------------------------


def random_bits(dtype: torch.dtype, shape: Sequence[int], g: torch.Generator) -> torch.Tensor:
    """A tensor of random bytes viewed as ``dtype`` (every bit pattern: NaN payloads, -0.0, subnormals)."""
    if dtype == torch.bool:
        return torch.randint(0, 2, tuple(shape), generator=g).bool()
    n = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    return torch.randint(0, 256, (n,), dtype=torch.uint8, generator=g).view(dtype).reshape(tuple(shape))


def every_kind(rows: int) -> TensorDict:
    """The global TensorDict of the round trip: every dtype in rows, a sub-TensorDict with batch dims
    ``[rows, 2]``, a leaf without columns, and replicated leaves (0-d, empty, non-contiguous)."""
    g = torch.Generator().manual_seed(0)
    batch = TensorDict({fmt.dtype_name(d): random_bits(d, (rows, 3), g) for d in DTYPES}, batch_size=[rows])
    batch["nested"] = TensorDict(
        grid=random_bits(torch.float32, (rows, 2, 4), g),
        flag=random_bits(torch.bool, (rows, 2), g),
        batch_size=[rows, 2],
    )
    batch["strided"] = random_bits(torch.int32, (rows, 3), g)  # each rank passes its rows as a strided view
    batch["transposed"] = random_bits(torch.float64, (rows, 4), g)  # ... and these as a transposed one
    batch["no_columns"] = torch.empty(rows, 0, dtype=torch.float32)
    return TensorDict(
        batch=batch,
        scalar=torch.tensor(-2.5, dtype=torch.float64),
        empty=torch.empty(0, 4, dtype=torch.int16),
        table=random_bits(torch.bfloat16, (5, 3), g).t(),  # replicated, non-contiguous
        batch_size=[],
    )


def rows_of(whole: TensorDict, start: int, stop: int) -> TensorDict:
    """``whole`` with its batched part cut to rows ``[start, stop)`` (what a rank saves or loads)."""
    out = whole.clone()
    out["batch"] = whole["batch"][start:stop].clone()
    return out


def non_contiguous(part: TensorDict) -> TensorDict:
    """``part`` with its "strided" and "transposed" rows passed as non-contiguous views (same values)."""
    strided, transposed = part["batch", "strided"], part["batch", "transposed"]
    wide = torch.zeros(strided.shape[0], 6, dtype=strided.dtype)
    wide[:, ::2] = strided
    part["batch", "strided"] = wide[:, ::2]
    part["batch", "transposed"] = transposed.t().contiguous().t()
    if strided.shape[0] > 1:
        assert not part["batch", "strided"].is_contiguous() and not part["batch", "transposed"].is_contiguous()
    return part


def bounds(rows: Sequence[int]) -> list[tuple[int, int]]:
    """Each rank's ``[start, stop)`` of the global rows, in rank order."""
    ends = list(itertools.accumulate(rows))
    return [(end - n, end) for n, end in zip(rows, ends)]


def batched(rows: int, version: int, rank: int, columns: int = 4) -> TensorDict:
    """Rank ``rank``'s shard of save number ``version``: ``rows`` rows under "batch", and "w", replicated."""
    x = torch.arange(rows * columns, dtype=torch.float32).reshape(rows, columns) + 1000 * version + 100 * rank
    return TensorDict(
        batch=TensorDict(x=x, ids=torch.arange(rows, dtype=torch.int64) + 10 * rank, batch_size=[rows]),
        w=torch.full((7,), float(version)),
        batch_size=[],
    )


def joined(parts: Sequence[TensorDict]) -> TensorDict:
    """The global TensorDict of ranks that saved ``parts``: rows concatenated, replicated leaves from rank 0."""
    out = parts[0].clone()
    out["batch"] = torch.cat([p["batch"] for p in parts])
    return out


# --- running ranks -----------------------------------------------------------------------------


def attempt(parts: Sequence[Any], target: str, timeout: float = 60, **kwargs: Any) -> list:
    """Every rank (a thread) saves its part to ``target``; each rank's result or exception."""
    return tddist.run_threads(
        len(parts), lambda c: tddist.save(parts[c.rank], target, comm=c, **kwargs), timeout=timeout
    )


def save_ranks(parts: Sequence[Any], target: str, **kwargs: Any) -> list[TensorDict]:
    """As ``attempt``, raising the first rank's exception if any rank failed."""
    results = attempt(parts, target, **kwargs)
    errors = [r for r in results if isinstance(r, BaseException)]
    if errors:
        raise errors[0]
    return results


def load_ranks(size: int, target: str, **kwargs: Any) -> list[TensorDict]:
    """Every rank of ``size`` thread ranks loads ``target``; raises the first rank's exception."""
    results = tddist.run_threads(size, lambda c: tddist.load(target, comm=c, **kwargs), timeout=60)
    errors = [r for r in results if isinstance(r, BaseException)]
    if errors:
        raise errors[0]
    return results


def read_opened(opened: OpenedCheckpoint, verify: bool = True) -> TensorDict:
    """The whole checkpoint read through ``opened`` (the generation it pinned), as a load does."""
    options = LoadOptions(shard=shard_request(None, 1), verify=verify)
    return read_shard(opened, LocalComm(), options)


def data_locations(manifest: Any) -> list[Location]:
    """Where every non-empty chunk of the checkpoint is stored."""
    locator = Locator(manifest)
    return [locator.locate(leaf, c) for leaf in manifest.leaves.values() for c in leaf.chunks if c.nbytes]


def location_of(target: str, key: tuple[str, ...], rank: int) -> Location:
    """Where the chunk of leaf ``key`` that ``rank`` saved is stored."""
    manifest = tddist.read_manifest(target)
    leaf = manifest.leaves[key]
    chunk = leaf.chunk_of_rank(rank)
    assert chunk is not None and chunk.nbytes, f"rank {rank} stored no bytes of {key}"
    return Locator(manifest).locate(leaf, chunk)


def stored_data_offset(archive: bytes, name: str) -> int:
    """Where the data of the stored entry ``name`` begins in the zip archive ``archive``."""
    with zipfile.ZipFile(io.BytesIO(archive)) as zf:
        zi = zf.getinfo(name)
    assert zi.compress_type == zipfile.ZIP_STORED, f"{name} is compressed"
    sig, *_fields, name_len, extra_len = struct.unpack_from("<4s5H3L2H", archive, zi.header_offset)
    assert sig == b"PK\x03\x04", f"no local header for {name} at {zi.header_offset}"
    return zi.header_offset + 30 + name_len + extra_len


# --- observing reads ---------------------------------------------------------------------------


@dataclass
class ReadLog:
    """What a load asked of the ``ChunkFiles`` of the checkpoints it opened."""

    fetches_ahead: list[bool] = field(default_factory=list)
    prefetched: list[list[ChunkRange]] = field(default_factory=list)
    spans: list[Location] = field(default_factory=list)


class RecordingFiles:
    """A ``ChunkFiles`` that records every ``prefetch`` and ``span`` and passes them on unchanged."""

    def __init__(self, inner: ChunkFiles, log: ReadLog):
        self.inner, self.log = inner, log
        self.root = inner.root
        self.fetches_ahead = inner.fetches_ahead
        log.fetches_ahead.append(inner.fetches_ahead)

    def prefetch(self, ranges: Sequence[ChunkRange], num_threads: int) -> None:
        ranges = list(ranges)
        self.log.prefetched.append(ranges)
        self.inner.prefetch(ranges, num_threads)

    def span(self, location: Location) -> torch.Tensor:
        self.log.spans.append(location)
        return self.inner.span(location)


@contextlib.contextmanager
def recording_reads() -> Iterator[ReadLog]:
    """Within: every opened checkpoint's ``files()`` is a ``RecordingFiles`` writing to the log given."""
    log = ReadLog()
    files = OpenedCheckpoint.files
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(OpenedCheckpoint, "files", lambda self: RecordingFiles(files(self), log))
        yield log


class HeldFiles:
    """A ``ChunkFiles`` answering ``span`` with the chunks it was given (what a load had already mapped or
    fetched), and nothing else."""

    fetches_ahead = False

    def __init__(self, root: str, held: dict[Location, torch.Tensor]):
        self.root, self.held = root, held

    def prefetch(self, ranges: Sequence[ChunkRange], num_threads: int) -> None:
        pass

    def span(self, location: Location) -> torch.Tensor:
        assert location in self.held, f"the load asked for a chunk it had not mapped: {location}"
        return self.held[location]


def hold(opened: OpenedCheckpoint) -> HeldFiles:
    """Every chunk of the opened checkpoint fetched (``prefetch``) and mapped (``span``) now, held for later; with
    packing "packed" every rank's whole data file too (a whole read maps each one once)."""
    files = opened.files()
    locations = data_locations(opened.manifest)
    if opened.manifest.packing == "packed":
        sizes = PackedChunks.of(opened.manifest).file_sizes()
        locations += [Location(fmt.rank_data_name(r), 0, n, n) for r, n in sorted(sizes.items()) if n]
    if files.fetches_ahead:
        files.prefetch([ChunkRange(loc, 0, loc.nbytes) for loc in locations], 4)
    return HeldFiles(files.root, {loc: files.span(loc) for loc in locations})


# --- the guarantees ----------------------------------------------------------------------------

#: The failures a save may meet after the old checkpoint was committed: a fault at a step of the commit (see
#: tddist/saving/commit.py), or ranks whose data differ in structure; and the error every rank must raise.
FAILURES = {
    "prepare-rank0": (("prepare", 0), InjectedFault),
    "write-rank1": (("write", 1), InjectedFault),
    "vote-rank0": (("vote", 0), InjectedFault),
    "manifest-rank0": (("manifest", 0), InjectedFault),
    "structure-differs": (None, ShardingError),
}


class StoreConformance:
    """The guarantees of a tddist store; subclass it per store (see the module docstring)."""

    #: keyword arguments of ``tddist.save`` that choose the store
    save_kwargs: ClassVar[dict[str, Any]] = {}
    #: what the manifest says: "directory" or "archive", and the packing
    layout: ClassVar[str]
    packing: ClassVar[str]
    #: what reading through a checkpoint opened before an overwrite gets: None, the old checkpoint whole;
    #: else this error (never a byte of the new one)
    pinned_overwrite_error: ClassVar[type[Exception] | None] = CheckpointChangedError
    #: what reading through a checkpoint opened before one of its bytes was flipped gets, with verify=True
    pinned_flip_error: ClassVar[type[Exception]] = CorruptCheckpointError
    #: whether ``tddist.tools.verify.verify`` checks this store
    tool_verifies: ClassVar[bool] = False

    # -- what a subclass provides ------------------------------------------------------------

    @pytest.fixture
    def target(self) -> str:
        """A fresh checkpoint prefix of this store."""
        raise NotImplementedError

    def flip(self, target: str, location: Location) -> None:
        """Invert one byte in the middle of the chunk at ``location`` of the committed checkpoint."""
        raise NotImplementedError

    def stray(self, target: str) -> list[str]:
        """Everything at the store beside the committed checkpoint at ``target``, sorted."""
        raise NotImplementedError

    def cleanup_fails(self) -> contextlib.AbstractContextManager:
        """A context in which removing an aborted save's staging area fails (it is left behind)."""
        raise NotImplementedError

    # -- helpers -------------------------------------------------------------------------------

    def save(self, parts: Sequence[Any], target: str, **kwargs: Any) -> list[TensorDict]:
        return save_ranks(parts, target, **self.save_kwargs, **kwargs)

    def assert_clean(self, target: str, when: str) -> None:
        left = self.stray(target)
        assert left == [], f"{when}: the store holds more than the committed checkpoint: {left}"

    # -- round trip ----------------------------------------------------------------------------

    def test_round_trip_every_dtype_and_shape(self, target: str) -> None:
        """Saved by 3 ranks (uneven rows, one empty), loaded bit for bit with shard="saved" on 3 ranks,
        shard="even" on 2 and shard=None in one process, verified."""
        whole = every_kind(sum(ROWS))
        spans = bounds(ROWS)
        parts = [non_contiguous(rows_of(whole, a, b)) for a, b in spans]
        returned = self.save(parts, target)
        for r, (a, b) in enumerate(spans):
            assert_td_equal(returned[r], rows_of(whole, a, b), f"returned by save on rank {r}")
        manifest = tddist.read_manifest(target)
        assert (manifest.layout, manifest.packing, manifest.world_size) == (self.layout, self.packing, len(ROWS))
        self.assert_clean(target, "after the save")

        assert_td_equal(tddist.load(target, shard=None, verify=True), whole, "shard=None")
        for r, got in enumerate(load_ranks(len(ROWS), target, shard="saved", verify=True)):
            assert_td_equal(got, rows_of(whole, *spans[r]), f"shard='saved', rank {r} of {len(ROWS)}")
        even = torch.tensor_split(torch.arange(sum(ROWS)), 2)
        for r, got in enumerate(load_ranks(2, target, shard="even", verify=True)):
            rows = even[r]
            assert_td_equal(got, rows_of(whole, int(rows[0]), int(rows[-1]) + 1), f"shard='even', rank {r} of 2")

    def test_a_rank_with_no_rows(self, target: str) -> None:
        """Rank 0 saves no rows (its chunks are empty), rank 1 saves 4: every way of loading gets the rows."""
        parts = [batched(0, 1, 0), batched(4, 1, 1)]
        self.save(parts, target)
        whole = joined(parts)
        assert_td_equal(tddist.load(target, shard=None, verify=True), whole, "shard=None")
        for r, got in enumerate(load_ranks(2, target, shard="saved", verify=True)):
            assert_td_equal(got, parts[r], f"shard='saved', rank {r}")
        for r, got in enumerate(load_ranks(3, target, shard="even", verify=True)):
            rows = torch.tensor_split(torch.arange(4), 3)[r]
            assert_td_equal(got, rows_of(whole, int(rows[0]), int(rows[-1]) + 1), f"shard='even', rank {r} of 3")
        self.assert_clean(target, "after the save")

    def test_every_leaf_empty(self, target: str) -> None:
        """A checkpoint without a single byte of data (every leaf has 0 elements) commits and loads."""
        parts = [
            TensorDict(
                batch=TensorDict(x=torch.empty(0, 3), b=torch.empty(0, dtype=torch.bool), batch_size=[0]),
                w=torch.empty(0, 5, dtype=torch.float16),
                batch_size=[],
            )
            for _ in range(2)
        ]
        self.save(parts, target)
        manifest = tddist.read_manifest(target)
        assert all(c.nbytes == 0 for leaf in manifest.leaves.values() for c in leaf.chunks), manifest.leaves
        assert_td_equal(tddist.load(target, shard=None, verify=True), joined(parts), "shard=None")
        for r, got in enumerate(load_ranks(2, target, shard="saved", verify=True)):
            assert_td_equal(got, parts[r], f"shard='saved', rank {r}")
        for r, got in enumerate(load_ranks(3, target, shard="even", verify=True)):
            assert_td_equal(got, parts[0], f"shard='even', rank {r} of 3")
        self.assert_clean(target, "after the save")

    # -- overwrite -----------------------------------------------------------------------------

    def test_an_overwrite_replaces_the_checkpoint_whole(self, target: str) -> None:
        """B (3 ranks, other keys and shapes) saved over A (2 ranks): a load sees exactly B, and A is gone."""
        a = [batched(3, 1, 0), batched(2, 1, 1)]
        b = [batched(2, 2, r, columns=6).exclude("w").set("v", torch.arange(3)) for r in range(3)]
        self.save(a, target)
        self.save(b, target)
        manifest = tddist.read_manifest(target)
        assert manifest.world_size == 3 and sorted(manifest.leaves) == [("batch", "ids"), ("batch", "x"), ("v",)]
        assert_td_equal(tddist.load(target, shard=None, verify=True), joined(b), "after the overwrite")
        self.assert_clean(target, "after the overwrite")

    def test_a_load_pinned_before_an_overwrite_never_reads_the_new_one(self, target: str) -> None:
        """A checkpoint opened before B replaced A, then read: A whole where the store keeps the pinned
        generation readable, else ``pinned_overwrite_error``; never a byte of B. A new load reads B."""
        a = [batched(64, 1, 0), batched(32, 1, 1)]
        b = [batched(64, 2, 0), batched(32, 2, 1)]
        self.save(a, target)
        with store_for(target).open() as opened:
            self.save(b, target)
            if self.pinned_overwrite_error is None:
                assert_td_equal(read_opened(opened), joined(a), "read through the checkpoint opened before")
            else:
                with pytest.raises(self.pinned_overwrite_error, match="was replaced while it was being read"):
                    read_opened(opened)
        assert_td_equal(tddist.load(target, shard=None, verify=True), joined(b), "a load after the overwrite")
        self.assert_clean(target, "after the overwrite")

    def test_chunks_mapped_before_an_overwrite_keep_the_old_bytes(self, target: str) -> None:
        """A load that had mapped (or fetched) every chunk of A before B replaced it reads A whole, verified,
        from what it holds: the overwrite never writes into the files or objects A's readers hold."""
        a = [batched(64, 1, 0), batched(32, 1, 1)]
        b = [batched(64, 2, 0), batched(32, 2, 1)]
        self.save(a, target)
        with store_for(target).open() as opened:
            held = hold(opened)
            self.save(b, target)
            with pytest.MonkeyPatch.context() as mp:
                mp.setattr(OpenedCheckpoint, "files", lambda self: held)
                assert_td_equal(read_opened(opened), joined(a), "read after the overwrite")
        assert_td_equal(tddist.load(target, shard=None, verify=True), joined(b), "a load after the overwrite")

    # -- failures ------------------------------------------------------------------------------

    @pytest.mark.parametrize("failure", list(FAILURES))
    def test_a_failed_save_keeps_the_old_checkpoint(self, target: str, failure: str) -> None:
        """A save that fails (a fault at a step of the commit, or ranks whose data differ in structure) raises
        the same error class on every rank, leaves the old checkpoint loadable unchanged and nothing else."""
        fault, error = FAILURES[failure]
        old = [batched(3, 1, 0), batched(5, 1, 1)]
        self.save(old, target)
        new = [batched(4, 2, 0), batched(4, 2, 1)]
        if fault is None:
            new[1]["batch", "extra"] = torch.zeros(4, 2)
        with inject(*fault) if fault else contextlib.nullcontext():
            results = attempt(new, target, **self.save_kwargs)
        assert all(type(r) is error for r in results), f"expected {error.__name__} on every rank: {results}"
        assert_td_equal(tddist.load(target, shard=None, verify=True), joined(old), "the old checkpoint")
        self.assert_clean(target, "after the failed save")

    @pytest.mark.parametrize("old", [True, False], ids=["over-old", "no-old"])
    def test_recover_removes_what_a_failed_save_left(self, target: str, old: bool) -> None:
        """A save whose rank 1 fails after writing, and whose staging area could not be removed, leaves it;
        ``recover`` reports and removes it, the store holds only the committed checkpoint (or nothing), which
        still loads; a second ``recover`` has nothing to do."""
        parts = [batched(3, 1, 0), batched(5, 1, 1)]
        if old:
            self.save(parts, target)
        with inject("write", 1), self.cleanup_fails():
            results = attempt([batched(4, 2, 0), batched(4, 2, 1)], target, **self.save_kwargs)
        assert all(isinstance(r, tddist.TddistError) for r in results), results
        left = self.stray(target)
        assert left, "the failed save left nothing behind: the test did not exercise recover"
        done = tddist.recover(target)
        name = target.rstrip("/").rsplit("/", 1)[-1]
        assert done and all(name in line for line in done), f"recover reported {done} for {left}"
        self.assert_clean(target, f"after recover (it did {done})")
        if old:
            assert_td_equal(tddist.load(target, shard=None, verify=True), joined(parts), "the committed checkpoint")
        else:
            with pytest.raises(tddist.CheckpointNotFoundError):
                tddist.load(target, shard=None)
        assert tddist.recover(target) == []

    # -- damage --------------------------------------------------------------------------------

    def test_verify_finds_a_flipped_byte(self, target: str) -> None:
        """One byte of rank 1's chunk of ("batch", "x") inverted where it is stored: a verified load raises
        CorruptCheckpointError naming the leaf (and so does one opened before the flip, or the store's
        ``pinned_flip_error``); what does not read that chunk still loads; the verify tool reports it."""
        key = ("batch", "x")
        parts = [batched(40, 1, 0), batched(60, 1, 1)]
        self.save(parts, target)
        whole = joined(parts)
        location = location_of(target, key, 1)
        with store_for(target).open() as opened:
            self.flip(target, location)
            with pytest.raises(self.pinned_flip_error) as pinned:
                read_opened(opened)
        if self.pinned_flip_error is CorruptCheckpointError:
            assert repr(key) in str(pinned.value), pinned.value
        else:
            assert "was replaced while it was being read" in str(pinned.value), pinned.value
        with pytest.raises(CorruptCheckpointError, match=re.escape(repr(key))) as loaded:
            tddist.load(target, shard=None, verify=True)
        assert "rank 1" in str(loaded.value) and "checksum mismatch" in str(loaded.value), loaded.value
        # the damage is confined to that chunk: rank 0's rows of the leaf and the other leaves are intact
        assert_td_equal(tddist.load(target, shard=(0, 40), verify=True), rows_of(whole, 0, 40), "rank 0's rows")
        assert_td_equal(
            tddist.load(target, shard=None, exclude=[key], verify=True), whole.exclude(key), "the other leaves"
        )
        if self.tool_verifies:
            from tddist.tools.verify import verify

            report = verify(target)
            assert not report.ok
            assert [(p.kind, p.key, p.rank) for p in report.problems] == [("checksum", key, 1)], report.problems

    # -- ranged reads --------------------------------------------------------------------------

    def test_a_row_range_reads_only_its_rows(self, target: str) -> None:
        """4 ranks save 256 rows each of one leaf; a load of rows inside rank 2's chunk asks only for that
        chunk and, where the store fetches ahead, only the bytes of those rows; a range across ranks 1 and 2
        asks for the tail of one and the head of the other; verify=True fetches the whole chunks it checks."""
        per_rank, columns = 256, 64
        row = columns * 4
        rows = torch.arange(4 * per_rank * columns, dtype=torch.float32).reshape(4 * per_rank, columns)
        parts = [TensorDict(x=rows[r * per_rank : (r + 1) * per_rank], batch_size=[per_rank]) for r in range(4)]
        self.save(parts, target)
        chunk = {r: location_of(target, ("x",), r) for r in range(4)}
        assert all(chunk[r].nbytes == per_rank * row for r in range(4)), chunk

        cases = [
            ((2 * per_rank + 10, 2 * per_rank + 50), False, {2: (10, 50)}),
            ((per_rank + 200, 2 * per_rank + 30), False, {1: (200, per_rank), 2: (0, 30)}),
            ((2 * per_rank + 10, 2 * per_rank + 50), True, {2: (0, per_rank)}),
        ]
        for (start, stop), verify, wanted in cases:
            with recording_reads() as log:
                got = tddist.load(target, shard=(start, stop), verify=verify)
            what = f"rows [{start}, {stop}), verify={verify}"
            assert torch.equal(got["x"], rows[start:stop]), what
            assert len(log.fetches_ahead) == 1, f"{what}: the load read {len(log.fetches_ahead)} times"
            assert sorted(log.spans, key=lambda loc: loc.relpath) == [chunk[r] for r in sorted(wanted)], (
                f"{what}: asked for chunks {log.spans}, expected only those of ranks {sorted(wanted)}"
            )
            expected = [ChunkRange(chunk[r], lo * row, hi * row) for r, (lo, hi) in sorted(wanted.items())]
            if log.fetches_ahead[0]:
                assert len(log.prefetched) == 1, f"{what}: prefetch was called {len(log.prefetched)} times"
                assert sorted(log.prefetched[0], key=lambda r: r.location.relpath) == expected, (
                    f"{what}: prefetched {log.prefetched[0]}, expected exactly {expected}"
                )
            else:
                assert log.prefetched == [], f"{what}: a store that maps its files was asked to prefetch"


# --- shared by the subclasses ------------------------------------------------------------------


def flip_file(path: str, offset: int) -> None:
    """Invert the byte at ``offset`` of the file ``path``."""
    with open(path, "r+b") as f:
        f.seek(offset)
        byte = f.read(1)
        assert len(byte) == 1, f"{path} has no byte at {offset}"
        f.seek(offset)
        f.write(bytes([byte[0] ^ 0xFF]))
