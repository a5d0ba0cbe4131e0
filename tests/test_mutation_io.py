"""Fast in-process tests of the reader and the writer: byte ranges, threaded reads, durable writes, on real files.

Written against the mutants that survived ``scripts/mutation.sh``: each test
asserts a behaviour on real files (thread ranks, one process).

- ``reader._needed``: the byte range of each chunk a request reads (what a
  load from object storage fetches up front), checked against the bytes of
  real data files: it starts at the first byte of the request's first element
  in the chunk and stops after its last element's last byte (the whole chunk
  when the load verifies).
- ``writer``: what ``write_leaves`` reports it stored, each file closed once
  its last block is written and closed after a failure, a save of many files
  on a system without ``syncfs`` (each file fsynced by a walk of the rank's
  directory), verbatim key names, and nothing written to the working
  directory.
"""

from __future__ import annotations

import os
import stat
import threading
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from pathlib import Path

import numpy as np
import pytest
import torch
from tensordict import TensorDict

import tddist
from tddist import _fs
from tddist import format as fmt
from tddist.checksum import EMPTY, combine_digests, hash_blocks
from tddist.core.finite import ChunkStats
from tddist.core.types import StoredBytes
from tddist.loading import read as reader
from tddist.manifest.locate import ChunkRange, Location, Locator
from tddist.saving.memmaps import allocated_by_torch
from tddist.storage import writer
from tddist.storage.backends import local_files
from tests.helpers import assert_td_equal

# --- reader._needed: the bytes of each chunk a request reads ------------------------------

ROWS = (2, 1, 3)  # rows per rank: rank 1 holds one row (a chunk of one element for ``d``)


def rank_rows(rank: int) -> TensorDict:
    """Rank ``rank``'s rows of four leaves, of item sizes 1, 2, 4 and 8, of 4, 3, 2 and 1 dimensions."""
    n = ROWS[rank]
    return TensorDict(
        h=torch.arange(n * 24, dtype=torch.int16).view(n, 4, 2, 3) + 1000 * rank,
        u8=torch.arange(n * 15, dtype=torch.uint8).view(n, 5, 3) + 50 * rank,
        f=torch.arange(n * 6, dtype=torch.float32).view(n, 6) + 100 * rank,
        d=torch.arange(n, dtype=torch.float64) + 10 * rank,
        batch_size=[n],
    )


@pytest.fixture(scope="module")
def rows_checkpoint(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("needed") / "ckpt"
    results = tddist.run_threads(3, lambda c: tddist.save(rank_rows(c.rank), path, comm=c), timeout=60)
    assert not any(isinstance(r, BaseException) for r in results), results
    return path


def boxes(shape: tuple[int, ...]) -> list[tuple[tuple[int, ...], tuple[int, ...]]]:
    """Boxes of a leaf of ``shape`` (6 rows over 3 chunks): whole, first row, last row, one element of the
    one-row chunk, and a box over every chunk that leaves out the first and last index of each inner dimension."""
    nd = len(shape)
    inner_lo = tuple(1 if s > 2 else 0 for s in shape[1:])
    inner_size = tuple(s - 2 if s > 2 else s for s in shape[1:])
    return [
        ((0,) * nd, shape),
        ((0,) * nd, (1, *shape[1:])),
        ((5, *(0,) * (nd - 1)), (1, *shape[1:])),
        ((2, *(s - 1 for s in shape[1:])), (1,) * nd),
        ((1, *inner_lo), (4, *inner_size)),
        ((3, *(0,) * (nd - 1)), (3, *inner_size)),
    ]


def expected_range(chunk_box, box, itemsize: int) -> tuple[int, int]:
    """Bytes [start, stop) of a chunk from its first to its last element inside ``box`` (row-major)."""
    (co, cs), (bo, bs) = chunk_box, box
    first = [max(c, b) - c for c, b in zip(co, bo)]
    last = [min(c + n, b + m) - 1 - c for c, n, b, m in zip(co, cs, bo, bs)]
    flat_first = flat_last = 0
    for f, la, n in zip(first, last, cs):
        flat_first, flat_last = flat_first * n + f, flat_last * n + la
    return flat_first * itemsize, (flat_last + 1) * itemsize


@pytest.mark.parametrize("verify", [False, True], ids=["plain", "verify"])
def test_needed_ranges_hold_exactly_the_requested_elements(rows_checkpoint, verify):
    """Every (leaf, box) request of one call that is not a whole leaf: one range per chunk the box overlaps, in
    order, whose bytes in the data file run from the box's first element in that chunk to its last one (the whole
    chunk when verified). Whole leaves: ``test_needed_ranges_of_whole_leaves_are_runs_of_each_data_file``."""
    m = tddist.read_manifest(rows_checkpoint)
    source = reader.ChunkSource(str(rows_checkpoint), m)
    locator = Locator(m)
    requests = [(leaf, box) for leaf in m.leaves.values() for box in boxes(leaf.shape)[1:]]
    by_holder = reader._needed(source, requests, verify)
    assert list(by_holder) == [0]  # no references: every range is this checkpoint's
    got = by_holder[0]

    want = []
    for leaf, box in requests:
        for chunk in leaf.overlapping(box):
            loc = locator.locate(leaf, chunk)
            start, stop = (0, loc.nbytes) if verify else expected_range(chunk.box, box, leaf.dtype.itemsize)
            want.append(ChunkRange(loc, start, stop))
    assert got == want
    assert all(type(r.start) is int and type(r.stop) is int for r in got)

    # the bytes themselves: what the rank saved, from the first to the last wanted element of its chunk
    files: dict[str, bytes] = {}
    ranges = iter(got)
    for leaf, box in requests:
        for chunk in leaf.overlapping(box):
            r = next(ranges)
            if r.location.relpath not in files:
                files[r.location.relpath] = (rows_checkpoint / r.location.relpath).read_bytes()
            raw = files[r.location.relpath][r.location.offset + r.start : r.location.offset + r.stop]
            span = torch.frombuffer(bytearray(raw), dtype=leaf.dtype)
            saved = rank_rows(chunk.rank)[leaf.key]
            local = tuple(slice(max(c, b) - c, min(c + n, b + s) - c) for c, n, b, s in zip(*chunk.box, *box))
            wanted = saved[local].reshape(-1)  # values are distinct within a chunk
            if verify:
                assert torch.equal(span, saved.reshape(-1)), (leaf.key, box, chunk.rank)
            else:
                flat = saved.reshape(-1)
                lo = r.start // leaf.dtype.itemsize
                assert torch.equal(span, flat[lo : lo + span.numel()]), (leaf.key, box, chunk.rank)
                assert span[0] == wanted[0] and span[-1] == wanted[-1], (leaf.key, box, chunk.rank)


@pytest.mark.parametrize("verify", [False, True], ids=["plain", "verify"])
def test_needed_ranges_of_whole_leaves_are_runs_of_each_data_file(rows_checkpoint, verify):
    """Whole leaves read every chunk whole: the ranges are runs of each rank's data file (consecutive chunks
    joined across their alignment padding), on the whole file's location, and hold every chunk's bytes and
    nothing past the last chunk of each run."""
    m = tddist.read_manifest(rows_checkpoint)
    source = reader.ChunkSource(str(rows_checkpoint), m)
    locator = Locator(m)
    requests = [(leaf, ((0,) * len(leaf.shape), leaf.shape)) for leaf in m.leaves.values()]
    by_holder = reader._needed(source, requests, verify)
    assert list(by_holder) == [0]
    got = by_holder[0]
    assert len({r.location.relpath for r in got}) == len(got)  # every chunk of a file is read: one run per file
    by_file = {r.location.relpath: r for r in got}
    for leaf in m.leaves.values():
        for chunk in leaf.chunks:
            if not chunk.nbytes:
                continue
            loc = locator.locate(leaf, chunk)
            r = by_file[loc.relpath]
            assert r.location == Location(loc.relpath, 0, loc.file_size, loc.file_size)
            assert r.start <= loc.offset and loc.offset + loc.nbytes <= r.stop, (leaf.key, chunk.rank)
    for r in got:
        ends = [locator.locate(lf, c).offset + c.nbytes for lf in m.leaves.values() for c in lf.chunks if c.nbytes
                and locator.locate(lf, c).relpath == r.location.relpath]  # fmt: skip
        assert r.stop == max(ends) and r.start == 0


def test_needed_of_a_one_element_chunk_and_of_no_request(rows_checkpoint):
    """Rank 1's chunk of ``d`` is one float64: its range is its 8 bytes; no requests need no bytes."""
    m = tddist.read_manifest(rows_checkpoint)
    source = reader.ChunkSource(str(rows_checkpoint), m)
    leaf = m.leaves[("d",)]
    (r,) = reader._needed(source, [(leaf, ((2,), (1,)))], False)[0]
    assert (r.start, r.stop) == (0, 8) and r.location.nbytes == 8
    raw = (rows_checkpoint / r.location.relpath).read_bytes()[r.location.offset : r.location.offset + 8]
    assert np.frombuffer(raw, dtype=np.float64).tolist() == [10.0]
    assert reader._needed(source, [], False) == {} and reader._needed(source, [], True) == {}


# --- writer ---------------------------------------------------------------------------------


def checksum(t: torch.Tensor) -> str:
    return combine_digests(hash_blocks(t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()))


@pytest.mark.parametrize("num_threads", [1, 3])
def test_write_leaves_reports_what_it_stored(tmp_path, num_threads):
    """Each leaf's byte count, checksum and (floating leaves) counts of non-finite values, a file of exactly its
    bytes; an empty leaf: 0 bytes, EMPTY, nothing counted, no file."""
    leaves = [
        writer.LeafToWrite(("a",), torch.arange(10, dtype=torch.int32)),
        writer.LeafToWrite(("n", "e"), torch.zeros(0, 3)),
        writer.LeafToWrite(("n", "b"), torch.full((2, 2), 0.5, dtype=torch.float64)),
    ]
    got = writer.write_leaves(str(tmp_path), 2, leaves, True, num_threads)
    assert got == {
        ("a",): StoredBytes(40, checksum(leaves[0].tensor)),
        ("n", "e"): StoredBytes(0, EMPTY, ChunkStats(0, 0, 0.0)),
        ("n", "b"): StoredBytes(32, checksum(leaves[2].tensor), ChunkStats(0, 0, 0.5)),
    }
    for leaf in (leaves[0], leaves[2]):
        written = (tmp_path / fmt.leaf_relpath(2, leaf.key)).read_bytes()
        assert written == leaf.tensor.numpy().tobytes()
    assert not (tmp_path / fmt.leaf_relpath(2, ("n", "e"))).exists()
    assert sorted(os.listdir(tmp_path / fmt.rank_dir(2))) == ["a.memmap", "n"]


def test_a_file_job_closes_its_file_once_its_last_block_is_written(tmp_path):
    data = np.arange(1000, dtype=np.int64).view(np.uint8)  # bytes, as write_leaves passes them
    job = writer._FileJob(str(tmp_path / "f"), data)
    assert job.nblocks == 1 and job.remaining == 1 and job.fd >= 0
    job.write_block(0)
    assert job.remaining == 0 and job.fd == -1  # closed (and fsynced) by its last block
    assert (tmp_path / "f").read_bytes() == data.tobytes()
    job.close()  # nothing left to close
    assert job.fd == -1

    unfinished = writer._FileJob(str(tmp_path / "g"), data, sync=False)
    fd = unfinished.fd
    assert (tmp_path / "g").stat().st_size == data.nbytes  # space reserved up front
    unfinished.close()
    assert unfinished.fd == -1
    with pytest.raises(OSError):
        os.fstat(fd)
    unfinished.close()  # a second close closes nothing
    assert unfinished.fd == -1
    with pytest.raises(FileExistsError):  # never an existing file
        writer._FileJob(str(tmp_path / "f"), data)
    assert (tmp_path / "f").read_bytes() == data.tobytes()


def open_fds() -> set[str]:
    return set(os.listdir("/proc/self/fd"))


def test_write_leaves_closes_every_file_when_one_cannot_be_created(tmp_path):
    """The second leaf's file exists already: its FileExistsError is raised, and the first file is closed."""
    existing = tmp_path / fmt.leaf_relpath(0, ("b",))
    existing.parent.mkdir(parents=True)
    existing.write_bytes(b"old")
    leaves = [writer.LeafToWrite(("a",), torch.ones(4)), writer.LeafToWrite(("b",), torch.ones(4))]
    before = open_fds()
    with pytest.raises(FileExistsError):
        writer.write_leaves(str(tmp_path), 0, leaves, True, 2)
    assert open_fds() == before
    assert existing.read_bytes() == b"old"


def many_leaves(rank: int) -> TensorDict:
    """More files than ``writer._MANY_FILES``: a save syncs them all at once rather than one by one."""
    return TensorDict({f"x{i}": torch.full((2, 3), float(100 * rank + i)) for i in range(70)}, batch_size=[2])


def snapshot(path: Path) -> dict[str, str]:
    return {str(p.relative_to(path)): os.readlink(p) if p.is_symlink() else "" for p in sorted(path.rglob("*"))}


def test_many_files_without_syncfs_are_fsynced_in_the_checkpoint(tmp_path, monkeypatch):
    """Where syncfs is missing (no C library), a save of many files fsyncs every file of its rank directory,
    found under the checkpoint, never relative to the working directory (which holds a rank-named directory
    with a dangling link here, left untouched)."""
    monkeypatch.setattr(_fs, "_libc", False)
    assert not _fs.syncfs(str(tmp_path))
    cwd = tmp_path / "cwd"
    (cwd / fmt.rank_dir(0)).mkdir(parents=True)
    os.symlink(tmp_path / "nowhere", cwd / fmt.rank_dir(0) / "x0.memmap")
    before = snapshot(cwd)
    monkeypatch.chdir(cwd)
    target = tmp_path / "ckpt"
    assert len(many_leaves(0).keys()) > writer._MANY_FILES
    tddist.save(many_leaves(0), target, layout="memmap")
    assert snapshot(cwd) == before
    assert_td_equal(tddist.load(target, verify=True), many_leaves(0), "many files")


def test_fsync_files_walks_every_file_under_a_directory(tmp_path):
    (tmp_path / "d" / "e").mkdir(parents=True)
    (tmp_path / "d" / "f").write_bytes(b"1")
    (tmp_path / "d" / "e" / "g").write_bytes(b"2")
    writer._fsync_files(str(tmp_path / "d"))
    os.symlink(tmp_path / "nowhere", tmp_path / "d" / "e" / "dangling")
    with pytest.raises(FileNotFoundError):  # every entry is opened, down to the deepest
        writer._fsync_files(str(tmp_path / "d"))


@pytest.mark.parametrize("robust_key", [True, False], ids=["robust", "verbatim"])
def test_memmap_save_names_files_by_key_and_writes_only_under_the_target(tmp_path, monkeypatch, robust_key):
    """Layout "memmap", two ranks: each rank directory is a tensordict memmap of the rank's rows (with a meta.json
    per node), the key "a b" named verbatim or percent-encoded as asked, and the working directory stays empty."""
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    monkeypatch.chdir(cwd)
    target = tmp_path / "ckpt"

    def data(rank: int) -> TensorDict:
        return TensorDict(
            {"a b": torch.arange(6).view(2, 3) + 10 * rank, "n": {"y": torch.ones(2, 2, dtype=torch.int8) * rank}},
            batch_size=[2],
        )

    def save(c):
        return tddist.save(data(c.rank), target, comm=c, layout="memmap", robust_key=robust_key, num_threads=2)

    results = tddist.run_threads(2, save, timeout=60)
    assert not any(isinstance(r, BaseException) for r in results), results
    assert os.listdir(cwd) == []
    name = "a b.memmap" if not robust_key else "a%20b.memmap"
    for rank in range(2):
        rank_dir = target / fmt.rank_dir(rank)
        assert sorted(os.listdir(rank_dir)) == sorted([name, "meta.json", "n"]), os.listdir(rank_dir)
        assert sorted(os.listdir(rank_dir / "n")) == ["meta.json", "y.memmap"]
        assert (rank_dir / name).read_bytes() == data(rank)["a b"].numpy().tobytes()
        assert_td_equal(TensorDict.load_memmap(rank_dir).to_tensordict(), data(rank), f"rank {rank} as a memmap")
    assert_td_equal(tddist.load(target, shard=None, verify=True), torch.cat([data(0), data(1)]), "the whole")


def test_run_all_runs_in_order_here_or_on_named_threads_and_raises_the_first_error():
    """Serially (0 or 1 thread, or a single task) in this thread, in order; else on ``tddist-write`` threads.
    An error: the first in task order is raised, after every task ran or was cancelled."""
    here = threading.current_thread().name
    for num_threads, ntasks in ((0, 3), (1, 3), (4, 1)):
        ran: list[tuple[int, str]] = []
        writer.run_all(
            [partial(lambda i: ran.append((i, threading.current_thread().name)), i) for i in range(ntasks)], num_threads
        )
        assert ran == [(i, here) for i in range(ntasks)]
    names: list[str] = []
    barrier = threading.Barrier(2, timeout=10)  # two tasks meet: they run on two threads at once

    def meet():
        barrier.wait()
        names.append(threading.current_thread().name)

    writer.run_all([meet, meet], 2)
    assert len(names) == 2 and all(n.startswith("tddist-write") for n in names) and names[0] != names[1], names

    first, second = ValueError("first"), KeyError("second")
    raised_second = threading.Event()

    def slow_first():
        raised_second.wait(10)
        raise first

    def quick_second():
        raised_second.set()
        raise second

    with pytest.raises(ValueError) as e:  # the first task's error, though the second one's came first
        writer.run_all([slow_first, quick_second], 2)
    assert e.value is first
    ran = []
    with pytest.raises(KeyError):  # serially, the tasks after the failing one never run
        writer.run_all([lambda: ran.append(0), quick_second, lambda: ran.append(2)], 1)
    assert ran == [0]


# --- reading: one map per file, a view where a box lies in one chunk, exact errors ---------


def two_leaves() -> TensorDict:
    return TensorDict(a=torch.arange(6.0).view(2, 3), b=torch.arange(4, dtype=torch.int64).view(2, 2), batch_size=[2])


@pytest.mark.parametrize("layout", ["packed", "memmap"])
def test_a_box_in_one_chunk_is_a_view_of_its_files_one_map(tmp_path, layout):
    """Packed: both leaves are views of one copy-on-write map of the rank's data file (mapped once); memmap: each
    leaf maps its own file. A box across chunks is a fresh tensor of exactly its bytes."""
    target = tmp_path / "ckpt"
    tddist.save(two_leaves(), target, layout=layout)
    got = tddist.load(target, shard=None, num_threads=2)
    assert_td_equal(got, two_leaves(), layout)
    a, b = got["a"].untyped_storage(), got["b"].untyped_storage()
    if layout == "packed":
        size = (target / fmt.rank_data_name(0)).stat().st_size
        assert a.data_ptr() == b.data_ptr() and a.nbytes() == size
        assert got["b"].data_ptr() - b.data_ptr() == 64  # after "a" (24 bytes), aligned
    else:
        assert a.data_ptr() != b.data_ptr() and (a.nbytes(), b.nbytes()) == (24, 32)

    def save(c):
        return tddist.save(two_leaves() if c.rank == 0 else two_leaves() + 100, target, comm=c, layout=layout)

    assert not any(isinstance(r, BaseException) for r in tddist.run_threads(2, save, timeout=60))
    whole = tddist.load(target, shard=None, num_threads=2)
    assert torch.equal(whole["a"], torch.cat([two_leaves()["a"], two_leaves()["a"] + 100]))
    assert whole["a"].untyped_storage().nbytes() == 48  # copied from two chunks
    rows = tddist.load(target, shard=(2, 4))
    assert torch.equal(rows["b"], two_leaves()["b"] + 100)
    assert not allocated_by_torch(rows["b"]) and allocated_by_torch(whole["b"])  # a view of the map, a copy


def test_a_chunk_is_verified_once_per_source(tmp_path):
    """``ChunkSource.verify`` hashes a chunk once: the map it verified, changed in memory afterwards (copy-on-write:
    never in the file), is not hashed again; a fresh source verifies the file's own bytes."""
    target = tmp_path / "ckpt"
    tddist.save(two_leaves(), target)
    m = tddist.read_manifest(target)
    leaf = m.leaves[("a",)]
    chunk = leaf.chunk_of_rank(0)
    source = reader.ChunkSource(str(target), m)
    source.verify(leaf, chunk, None)
    assert source.tensor(leaf, chunk) is source.tensor(leaf, chunk)  # made once
    source.tensor(leaf, chunk).add_(1)
    source.verify(leaf, chunk, None)
    fresh = reader.ChunkSource(str(target), m)
    fresh.verify(leaf, chunk, None)
    assert torch.equal(fresh.tensor(leaf, chunk), two_leaves()["a"])
    changed = reader.ChunkSource(str(target), m)
    changed.tensor(leaf, chunk).add_(1)
    with pytest.raises(tddist.CorruptCheckpointError, match="checksum mismatch"):
        changed.verify(leaf, chunk, None)


def test_checksum_mismatch_names_file_checkpoint_leaf_rank_and_both_checksums(tmp_path):
    target = tmp_path / "ckpt"
    tddist.save(two_leaves(), target, layout="memmap")
    m = tddist.read_manifest(target)
    chunk = m.leaves[("b",)].chunk_of_rank(0)
    rel = fmt.leaf_relpath(0, ("b",))
    damaged = two_leaves()["b"].clone()
    damaged[1, 1] = 7
    (target / rel).write_bytes(damaged.numpy().tobytes())
    want = (
        f"checksum mismatch in {rel!r} of {str(target)!r} (leaf ('b',), rank 0): expected {chunk.checksum}, found "
        f"{checksum(damaged)}; the data is corrupted, restore it from another checkpoint"
    )
    for num_threads in (0, 2):
        with pytest.raises(tddist.CorruptCheckpointError) as e:
            tddist.load(target, shard=None, verify=True, num_threads=num_threads)
        assert str(e.value) == want
    assert torch.equal(tddist.load(target, shard=None)["b"], damaged)  # unverified, the bytes as they are


@pytest.mark.parametrize("damage", ["truncated", "missing", "directory"])
def test_a_damaged_chunk_file_is_named_with_its_leaf_and_rank(tmp_path, damage):
    target = tmp_path / "ckpt"
    results = tddist.run_threads(
        2, lambda c: tddist.save(two_leaves(), target, comm=c, layout="memmap", check_replicas=False), timeout=60
    )
    assert not any(isinstance(r, BaseException) for r in results), results
    rel = fmt.leaf_relpath(1, ("a",))
    path = target / rel
    if damage == "truncated":
        path.write_bytes(path.read_bytes()[:-1])
        why = f"file {str(path)!r} has 23 bytes, the manifest says 24; the checkpoint is damaged or truncated"
    elif damage == "missing":
        path.unlink()
        why = f"file {str(path)!r} is missing; the checkpoint is damaged"
    else:
        path.unlink()
        path.mkdir()
        why = f"{str(path)!r} is not a regular file; refusing it"
    with pytest.raises(tddist.CorruptCheckpointError) as e:
        tddist.load(target, shard=None)
    assert str(e.value) == f"leaf ('a',) (written by rank 1): {why}"
    assert torch.equal(tddist.load(target, shard=(0, 2), keys="b")["b"], two_leaves()["b"])  # the rest reads


# --- the directory layout -------------------------------------------------------------------


def test_check_target_refusals_and_what_it_finds(tmp_path):
    from tddist.storage.directory import check_target

    assert check_target(str(tmp_path / "absent")) is False
    (tmp_path / "empty").mkdir()
    assert check_target(str(tmp_path / "empty")) is True
    tddist.save(two_leaves(), tmp_path / "ckpt")
    assert check_target(str(tmp_path / "ckpt")) is True
    os.symlink(tmp_path / "ckpt", tmp_path / "link")
    (tmp_path / "file").write_text("x")
    os.mkfifo(tmp_path / "fifo")
    (tmp_path / "foreign").mkdir()
    (tmp_path / "foreign" / "notes.txt").write_text("mine")
    refusals = {
        "link": "is a symbolic link; pass the real path or another target",
        "file": "is an existing file, not a checkpoint directory; choose another path (it was left untouched)",
        "fifo": "exists and is not a directory; choose another path",
        "foreign": "is a non-empty directory that is not a tddist checkpoint; tddist never deletes foreign data: "
        "choose another path or empty it yourself",
    }
    for name, why in refusals.items():
        with pytest.raises(tddist.TargetError) as e:
            check_target(str(tmp_path / name))
        assert str(e.value) == f"target {str(tmp_path / name)!r} {why}"
    assert (tmp_path / "foreign" / "notes.txt").read_text() == "mine"


def test_a_non_atomic_save_replaces_every_entry_of_the_old_checkpoint(tmp_path):
    """Non-atomic, three ranks then two: the old manifest, rank directory 2 and a leftover file go; the parent
    directories of a new target are created."""
    target = tmp_path / "deep" / "er" / "ckpt"

    def save(world: int, layout: str):
        def fn(c):
            data = two_leaves() + 10 * c.rank + world
            return tddist.save(data, target, comm=c, layout=layout, atomic=False)

        results = tddist.run_threads(world, fn, timeout=60)
        assert not any(isinstance(r, BaseException) for r in results), results

    save(3, "memmap")
    assert sorted(os.listdir(target)) == sorted([fmt.MANIFEST_NAME, fmt.INDEX_NAME, *map(fmt.rank_dir, range(3))])
    (target / fmt.rank_data_name(7)).write_bytes(b"stale")
    save(2, "memmap")
    assert sorted(os.listdir(target)) == sorted([fmt.MANIFEST_NAME, fmt.INDEX_NAME, *map(fmt.rank_dir, range(2))])
    save(2, "packed")
    assert sorted(os.listdir(target)) == sorted([fmt.MANIFEST_NAME, fmt.INDEX_NAME, *map(fmt.rank_data_name, range(2))])
    want = torch.cat([two_leaves() + 2, two_leaves() + 12])
    assert_td_equal(tddist.load(target, shard=None, verify=True), want, "the second save")
    assert os.listdir(tmp_path) == ["deep"] and os.listdir(tmp_path / "deep" / "er") == ["ckpt"]
    # a torn target (no manifest), and an empty directory, are replaced as well
    os.unlink(target / fmt.MANIFEST_NAME)
    save(1, "memmap")
    assert sorted(os.listdir(target)) == sorted([fmt.MANIFEST_NAME, fmt.INDEX_NAME, fmt.rank_dir(0)])
    for name in os.listdir(target):
        _fs.remove_tree(str(target / name))
    save(1, "packed")
    assert_td_equal(tddist.load(target, verify=True), two_leaves() + 1, "saved into an empty directory")


def test_local_files_reads_a_directory_or_an_archive_by_path_or_opened(tmp_path):
    from tddist.storage.archive import ArchiveFiles
    from tddist.storage.backends import open_checkpoint
    from tddist.storage.directory import DirectoryFiles

    tddist.save(two_leaves(), tmp_path / "d")
    tddist.save(two_leaves(), tmp_path / "a.tdz", archive=True)
    for name, kind in (("d", DirectoryFiles), ("a.tdz", ArchiveFiles)):
        path = str(tmp_path / name)
        by_path = local_files(path)
        assert type(by_path) is kind and type(reader.ChunkSource(path, tddist.read_manifest(path)).files) is kind
        with open_checkpoint(path) as opened:
            files = local_files(opened)
            assert type(files) is kind and type(opened.files()) is kind and not files.fetches_ahead
            if kind is DirectoryFiles:
                assert files.root == path and files.pin is opened.pin
            else:
                assert files.path == path and files.source == opened.pin.fd_path
            got = reader.read_leaves(
                opened,
                opened.manifest,
                [(leaf, ((0, 0), leaf.shape)) for leaf in opened.manifest.leaves.values()],
                1,
                True,
            )
            assert [torch.equal(g, two_leaves()[k]) for g, k in zip(got, ("a", "b"))] == [True, True]


# --- packed writing: small chunks batched, large ones in blocks ------------------------------


def mixed_sizes(rank: int) -> TensorDict:
    """Small chunks around a large one (at least ``writer._SMALL`` bytes), then enough small ones for several
    batches of ``writer._WRITE_STEP`` bytes, then two more small ones."""
    big = writer._SMALL // 4 + 3
    small_rows = (writer._SMALL - 64) // 8
    leaves = {
        "a": torch.arange(3, dtype=torch.float32) + rank,
        "b": torch.arange(big, dtype=torch.float32).view(1, big) + rank,
        "c": torch.arange(5, dtype=torch.int16) - rank,
    }
    for i in range(9):
        leaves[f"s{i}"] = torch.full((1, small_rows), i + 0.5 + rank, dtype=torch.float64)
    leaves["z"] = torch.tensor([7 + rank], dtype=torch.uint8)
    leaves["zz"] = torch.tensor([-1, rank], dtype=torch.int16)  # a last batch of two chunks, far into the file
    return TensorDict({k: v.reshape(1, -1) for k, v in leaves.items()}, batch_size=[1])


def test_packed_chunks_large_and_small_are_all_written_where_readers_look(tmp_path):
    """Each chunk's bytes lie at the offset readers derive (a batch of small chunks never spans, nor zeroes, the large
    one); the file ends after the last chunk, padded to the alignment."""
    target = tmp_path / "ckpt"
    tddist.save(mixed_sizes(1), target, num_threads=3)
    assert_td_equal(tddist.load(target, verify=True), mixed_sizes(1), "mixed sizes")
    m = tddist.read_manifest(target)
    data = (target / fmt.rank_data_name(0)).read_bytes()
    umask = os.umask(0o022)
    os.umask(umask)
    assert stat.S_IMODE((target / fmt.rank_data_name(0)).stat().st_mode) == 0o644 & ~umask
    loc = Locator(m)
    for key, leaf in m.leaves.items():
        where = loc.locate(leaf, leaf.chunk_of_rank(0))
        assert data[where.offset : where.offset + where.nbytes] == mixed_sizes(1)[key].numpy().tobytes(), key
    assert (len(data), where.nbytes) == (where.file_size, 4) and where.offset + 64 == where.file_size  # "zz" is last


def test_the_midwrite_fault_strikes_the_rank_it_names(tmp_path):
    from tddist._faults import inject
    from tddist.errors import InjectedFault

    target = tmp_path / "ckpt"
    with inject("midwrite", 1):
        results = tddist.run_threads(2, lambda c: tddist.save(two_leaves(), target, comm=c), timeout=10)
    assert isinstance(results[1], InjectedFault) and "commit step 'midwrite'" in str(results[1]), results
    assert all(isinstance(r, tddist.TddistError) for r in results), results
    assert not target.exists()


def test_an_empty_chunk_is_an_empty_tensor_of_its_shape_and_dtype(tmp_path):
    target = tmp_path / "ckpt"
    tddist.save(TensorDict(e=torch.zeros(2, 0, dtype=torch.int16), batch_size=[2]), target)
    m = tddist.read_manifest(target)
    leaf = m.leaves[("e",)]
    chunk = leaf.chunk_of_rank(0)
    assert chunk.nbytes == 0
    source = reader.ChunkSource(str(target), m)
    t = source.tensor(leaf, chunk)
    assert t.shape == (2, 0) and t.dtype == torch.int16
    assert source.tensor(leaf, chunk) is t  # made once
    source.verify(leaf, chunk, None)
    got = tddist.load(target, verify=True, num_threads=2)["e"]
    assert got.shape == (2, 0) and got.dtype == torch.int16


def test_a_threaded_load_leaves_no_reading_thread_behind(tmp_path):
    target = tmp_path / "ckpt"

    def save(c):
        return tddist.save(two_leaves() + c.rank, target, comm=c)

    assert not any(isinstance(r, BaseException) for r in tddist.run_threads(3, save, timeout=60))
    got = tddist.load(target, shard=None, num_threads=4)
    assert torch.equal(got["b"], torch.cat([two_leaves()["b"] + r for r in range(3)]))
    assert [t.name for t in threading.enumerate() if t.name.startswith("tddist-read")] == []


def test_object_storage_chunks_have_their_own_reader_and_no_file_reader(tmp_path):
    """A checkpoint opened on object storage (no request is sent here): its chunks are read by ``S3Files``, and
    operations that need files refuse it, naming it."""
    from tddist.errors import InvalidArgumentError
    from tddist.storage.backends import store_for
    from tddist.storage.opened import OpenedCheckpoint
    from tddist.storage.s3.files import S3Files
    from tddist.storage.s3.pin import S3Pin
    from tddist.storage.s3.url import parse

    tddist.save(two_leaves(), tmp_path / "d")
    store = store_for("s3://bucket/ckpt")
    opened = OpenedCheckpoint(
        S3Pin(parse(store.target), None, False), tddist.read_manifest(tmp_path / "d"), "g", store.files
    )
    files = opened.files()
    assert type(files) is S3Files and files.pin is opened.pin and files.fetches_ahead
    with pytest.raises(InvalidArgumentError) as e:
        local_files(opened)
    assert str(e.value) == "'s3://bucket/ckpt' is on object storage, which this operation does not support"


class RecordingPool(ThreadPoolExecutor):
    """A real thread pool that records how it was made and how often its ``map`` ran."""

    made: list[RecordingPool] = []

    def __init__(self, max_workers=None, thread_name_prefix=""):
        super().__init__(max_workers, thread_name_prefix=thread_name_prefix)
        self.args, self.maps, self.shut = (max_workers, thread_name_prefix), 0, False
        RecordingPool.made.append(self)

    def shutdown(self, *args, **kwargs):
        self.shut = True
        super().shutdown(*args, **kwargs)

    def map(self, fn, *iterables, **kwargs):
        self.maps += 1
        return super().map(fn, *iterables, **kwargs)


@pytest.mark.parametrize("num_threads", [0, 1, 2, 3])
@pytest.mark.parametrize("verify", [False, True], ids=["plain", "verify"])
def test_a_load_with_threads_shares_one_named_pool_for_copies_and_hashes(tmp_path, monkeypatch, num_threads, verify):
    """``num_threads`` > 1: one pool of that many ``tddist-read`` threads copies every box of more than one piece and
    hashes every chunk verified (once each; a whole leaf's copies and hashes go in batches of about 64 MiB, so this
    small one's run on the calling thread, and the chunks it verified are not hashed again); 0 or 1: no pool. The
    results are the same."""
    target = tmp_path / "ckpt"
    assert not any(
        isinstance(r, BaseException)
        for r in tddist.run_threads(3, lambda c: tddist.save(two_leaves() + 10 * c.rank, target, comm=c), timeout=60)
    )
    monkeypatch.setattr(reader, "ThreadPoolExecutor", RecordingPool)
    RecordingPool.made = []
    m = tddist.read_manifest(target)
    leaf = m.leaves[("a",)]
    # 3, 2 and 1 pieces, and one element
    requests = [(leaf, ((0, 0), (6, 3))), (leaf, ((1, 1), (2, 2))), (leaf, ((2, 0), (2, 3))), (leaf, ((3, 1), (1, 1)))]
    got = reader.read_leaves(str(target), m, requests, num_threads, verify)
    whole = torch.cat([two_leaves()["a"] + 10 * r for r in range(3)])
    want = [whole, whole[1:3, 1:3], whole[2:4], whole[3:4, 1:2]]
    assert [g.tolist() for g in got] == [w.tolist() for w in want]
    assert [allocated_by_torch(g) for g in got] == [True, True, False, False]  # copied, or views of the map
    if num_threads <= 1:
        assert RecordingPool.made == []
        return
    (pool,) = RecordingPool.made
    assert pool.args == (num_threads, "tddist-read")
    assert pool.maps == 1  # the copy of the one other box of two pieces; the whole leaf's batch ran in line
    assert pool.shut
