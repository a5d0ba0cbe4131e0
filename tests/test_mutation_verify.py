"""Fast in-process tests of tddist.tools.verify (the offline checker): each damage it must report, on real checkpoints.

Written against the mutants that survived ``scripts/mutation.sh``: each test
asserts a behaviour on real files (thread ranks, one process).

Every test saves a real checkpoint (a packed directory, ``layout="memmap"`` or
a ``.tdz`` archive), damages it as a disk or a user would (truncates, flips,
deletes, replaces a file by a directory or a symbolic link, rewrites the
archive or the manifest) and asserts the exact problems ``verify`` reports:
their kind, leaf, rank, file, offset and message, in their documented order.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import re
import shutil
import threading
import zipfile
from pathlib import Path

import pytest
import torch
from tensordict import TensorDict

import tddist
from tddist import format as fmt
from tddist.errors import InvalidArgumentError
from tddist.manifest.locate import Location, Locator
from tddist.manifest.v2 import encode
from tddist.tools.verify import (
    CHECKSUM,
    MISSING,
    NOT_A_FILE,
    SIZE,
    STRUCTURE,
    UNREADABLE,
    Problem,
    verify,
    verify_manifest,
)
from tests.helpers import flip

REPO = Path(__file__).resolve().parent.parent
A, B, U, R = ("s", "a"), ("s", "b"), ("s", "u"), ("r",)
EMPTY_SUM = "2d06800538d394c2"  # the checksum of no bytes
LAYOUTS = {"packed": {}, "memmap": {"layout": "memmap"}, "archive": {"archive": True}}


def shard(rank: int, rows: tuple[int, ...]) -> TensorDict:
    """Rank ``rank``'s data: three sharded leaves (float32 x4, int16 x3, uint8: one byte a row) and a replica."""
    n = rows[rank]
    return TensorDict(
        s=TensorDict(
            a=torch.arange(4 * n, dtype=torch.float32).view(n, 4) + 100 * rank,
            b=torch.full((n, 3), rank + 1, dtype=torch.int16),
            u=torch.full((n,), rank + 7, dtype=torch.uint8),
            batch_size=[n],
        ),
        r=torch.arange(5.0),  # not under a batch dim: replicated, written by rank 0
        batch_size=[],
    )


def save(path: Path, rows: tuple[int, ...] = (2, 0, 1), **kwargs) -> Path:
    """Save ``len(rows)`` thread ranks' shards (rank r holds ``rows[r]`` rows) to ``path``."""
    results = tddist.run_threads(
        len(rows), lambda c: tddist.save(shard(c.rank, rows), path, comm=c, **kwargs), timeout=60
    )
    bad = {r: x for r, x in enumerate(results) if isinstance(x, BaseException)}
    assert not bad, bad
    return path


def target(tmp_path: Path, layout: str) -> Path:
    return tmp_path / ("ckpt.tdz" if layout == "archive" else "ckpt")


def locate(ckpt: Path, key: tuple[str, ...], rank: int) -> Location:
    m = tddist.read_manifest(ckpt)
    leaf = m.leaves[key]
    return Locator(m).locate(leaf, leaf.chunk_of_rank(rank))


def checksum_of(ckpt: Path, key: tuple[str, ...], rank: int) -> str:
    return tddist.read_manifest(ckpt).leaves[key].chunk_of_rank(rank).checksum


def entry_offsets(archive: Path) -> dict[str, int]:
    """Where each archive entry's data starts (after its local header, name and extra field)."""
    out = {}
    with zipfile.ZipFile(archive) as zf, open(archive, "rb") as f:
        for zi in zf.infolist():
            f.seek(zi.header_offset + 26)
            name_len, extra_len = (int.from_bytes(f.read(2), "little") for _ in range(2))
            out[zi.filename] = zi.header_offset + 30 + name_len + extra_len
    return out


def flip_chunk(ckpt: Path, key: tuple[str, ...], rank: int, at: int) -> None:
    loc = locate(ckpt, key, rank)
    assert 0 <= at < loc.nbytes
    if ckpt.is_file():
        flip(ckpt, entry_offsets(ckpt)[loc.relpath.replace(os.sep, "/")] + at)
    else:
        flip(ckpt / loc.relpath, loc.offset + at)


def rewrite_archive(archive: Path, replace: dict[str, bytes | None], duplicate: str | None = None) -> None:
    """Rewrite ``archive`` as another zip tool would: entries replaced (None: dropped), one listed twice."""
    with zipfile.ZipFile(archive) as zf:
        entries = [(zi.filename, zf.read(zi)) for zi in zf.infolist()]
    tmp = archive.with_name(archive.name + ".new")
    with zipfile.ZipFile(tmp, "w", zipfile.ZIP_STORED) as out:
        for name, data in entries:
            data = replace.get(name, data)
            if data is not None:
                out.writestr(name, data)
        if duplicate is not None:
            with pytest.warns(UserWarning, match="Duplicate name"):
                out.writestr(duplicate, dict(entries)[duplicate])
    os.replace(tmp, archive)


def set_checksum(ckpt: Path, key: tuple[str, ...], rank: int, value: int) -> None:
    """Edit the manifest (and re-seal it, as a tampering tool would): ``rank``'s chunk of ``key`` gets ``value``."""
    m = tddist.read_manifest(ckpt)
    table = m.leaves[key].table
    table.checksums = table.checksums.copy()  # read from the index: read-only
    table.checksums[rank] = value
    files = encode(m)
    if ckpt.is_file():
        rewrite_archive(ckpt, {fmt.MANIFEST_NAME: files.manifest, fmt.INDEX_NAME: files.index})
    else:
        (ckpt / fmt.MANIFEST_NAME).write_bytes(files.manifest)
        (ckpt / fmt.INDEX_NAME).write_bytes(files.index)
    assert tddist.read_manifest(ckpt).leaves[key].chunk_of_rank(rank).checksum == f"{value:016x}"


def rows_of(problems) -> list[tuple]:
    return [(p.kind, p.key, p.rank, p.file, p.offset) for p in problems]


def checksum_message(key, rank: int, where: str, expected: str, found: str = "[0-9a-f]{16}") -> str:
    """The regular expression of a checksum problem's message."""
    return (
        re.escape(f"leaf {list(key)} (written by rank {rank}): checksum mismatch in {where} (expected {expected}, ")
        + f"found {found}"
        + re.escape("); the data is corrupted, restore it from a copy or an older checkpoint")
    )


# --- the report itself --------------------------------------------------------------------


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_report_describes_the_checkpoint(tmp_path, layout, monkeypatch):
    ckpt = save(target(tmp_path, layout), **LAYOUTS[layout])
    monkeypatch.chdir(tmp_path)
    m = tddist.read_manifest(ckpt)
    chunks = 3 * 3 + 1  # three sharded leaves of three ranks (one chunk each, empty ones too), one replica
    nbytes = 3 * 16 + 3 * 6 + 3 + 20
    for quick in (False, True):
        report = verify(ckpt.name, quick=quick)  # a relative path: the report names the absolute one
        assert report == tddist.tools.verify.VerifyReport(
            path=str(ckpt),
            mode="quick" if quick else "full",
            layout="archive" if layout == "archive" else "directory",
            world_size=3,
            chunks=chunks,
            nbytes=nbytes,
            problems=(),
            packing="packed" if layout == "packed" else "memmap",
        )
        assert report.ok
        assert verify_manifest(ckpt.name, m, quick=quick) == report


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_verify_manifest_checks_checksums_unless_quick(tmp_path, layout):
    ckpt = save(target(tmp_path, layout), **LAYOUTS[layout])
    m = tddist.read_manifest(ckpt)
    flip_chunk(ckpt, A, 0, 3)
    full = verify_manifest(ckpt, m)  # the default is a full check
    assert full.mode == "full" and [(p.kind, p.key, p.rank) for p in full.problems] == [(CHECKSUM, A, 0)]
    assert verify_manifest(ckpt, m, quick=True).ok


def test_num_threads_must_be_a_positive_int(tmp_path):
    ckpt = save(tmp_path / "ckpt")
    for bad in (0, -1, True, 2.0):
        with pytest.raises(InvalidArgumentError, match=rf"^num_threads must be a positive int, got {bad!r}$"):
            verify(ckpt, num_threads=bad)
        with pytest.raises(InvalidArgumentError, match=rf"^num_threads must be a positive int, got {bad!r}$"):
            verify_manifest(ckpt, tddist.read_manifest(ckpt), num_threads=bad)


def test_a_packed_checkpoint_without_tensors(tmp_path):
    tddist.save({"lr": 0.5}, tmp_path / "ckpt")
    report = verify(tmp_path / "ckpt")
    assert report.ok and report.chunks == 0 and report.nbytes == 0 and report.packing == "packed"
    (tmp_path / "ckpt" / fmt.rank_data_name(0)).write_bytes(b"x")
    assert rows_of(verify(tmp_path / "ckpt", quick=True).problems) == [(SIZE, None, 0, fmt.rank_data_name(0), None)]


# --- threads and progress -------------------------------------------------------------------


def verify_watching(ckpt: Path, **kwargs) -> tuple[object, list[int], set[str]]:
    """verify, with the bytes each progress call reports and the threads alive at each call."""
    ticks: list[int] = []
    names: set[str] = set()

    def progress(n: int) -> None:
        ticks.append(n)
        names.update(t.name for t in threading.enumerate())

    return verify(ckpt, progress=progress, **kwargs), ticks, names


def pool_threads(names: set[str]) -> set[str]:
    return {n for n in names if n.startswith("tddist-verify")}


def test_a_chunk_of_several_blocks_is_hashed_by_the_pool(tmp_path):
    """num_threads > 1: a chunk of several checksum blocks is hashed on a pool of at most num_threads threads
    (2 by default); 1: on the caller's thread only."""
    n = (2 * fmt.CHECKSUM_BLOCK + fmt.CHECKSUM_BLOCK // 2) // 4  # two and a half blocks of float32: three blocks
    ckpt = tmp_path / "big"
    tddist.save(TensorDict(big=torch.ones(n), batch_size=[]), ckpt)
    total = 4 * n
    two = {"tddist-verify_0", "tddist-verify_1"}
    for kwargs, allowed in (({}, two), ({"num_threads": 2}, two), ({"num_threads": 3}, {*two, "tddist-verify_2"})):
        report, ticks, names = verify_watching(ckpt, **kwargs)
        assert report.ok and report.nbytes == total
        assert ticks == [fmt.CHECKSUM_BLOCK, fmt.CHECKSUM_BLOCK, total - 2 * fmt.CHECKSUM_BLOCK], ticks
        assert pool_threads(names) and pool_threads(names) <= allowed, (kwargs, names)
    report, ticks, names = verify_watching(ckpt, num_threads=1)
    assert report.ok and len(ticks) == 3 and not pool_threads(names), names
    names = set()
    verify_manifest(ckpt, tddist.read_manifest(ckpt), progress=lambda n: names.update(map(str, threading.enumerate())))
    assert {n for n in two if n in " ".join(names)} and "tddist-verify_2" not in " ".join(names)  # 2 by default
    # the pool is shut down when verify returns
    assert not pool_threads({t.name for t in threading.enumerate()})
    report, ticks, names = verify_watching(ckpt, quick=True)
    assert report.ok and ticks == [] and report.mode == "quick"
    # a chunk of two blocks is hashed by the pool too
    n2 = (fmt.CHECKSUM_BLOCK + fmt.CHECKSUM_BLOCK // 2) // 4
    tddist.save(TensorDict(big=torch.ones(n2), batch_size=[]), tmp_path / "two")
    report, ticks, names = verify_watching(tmp_path / "two", num_threads=2)
    assert report.ok and len(ticks) == 2 and pool_threads(names), names


def test_chunks_of_one_block_are_hashed_by_the_caller(tmp_path):
    ckpt = save(tmp_path / "ckpt")
    report, ticks, names = verify_watching(ckpt, num_threads=4)
    assert report.ok and sorted(ticks) == sorted([32, 16, 12, 6, 2, 1, 20]) and sum(ticks) == report.nbytes
    assert not pool_threads(names)


# --- packing "packed": the data file of each rank ---------------------------------------------


def data_file_message(ckpt: Path, rank: int, what: str, held: str) -> str:
    full = os.path.join(str(ckpt), fmt.rank_data_name(rank))
    return f"data file {full!r} of rank {rank} {what}; {held}"


HELD = {
    0: "it holds 4 chunk(s) (leaves ['s', 'a'], ['s', 'b'], ['s', 'u'], ...)",  # the replica too
    1: "it holds 0 chunk(s)",
    2: "it holds 3 chunk(s) (leaves ['s', 'a'], ['s', 'b'], ['s', 'u'])",
}


def test_each_damaged_data_file_is_reported_with_what_it_holds(tmp_path):
    ckpt = save(tmp_path / "ckpt")  # rank 1 saved no rows: its data file is empty
    assert [os.path.getsize(ckpt / fmt.rank_data_name(r)) for r in range(3)] == [256, 0, 192]
    with open(ckpt / fmt.rank_data_name(0), "r+b") as f:
        f.truncate(100)
    (ckpt / fmt.rank_data_name(1)).unlink()
    (ckpt / fmt.rank_data_name(1)).mkdir()  # a directory where the data file was
    (ckpt / fmt.rank_data_name(2)).unlink()
    expected = (
        Problem(
            SIZE,
            None,
            0,
            fmt.rank_data_name(0),
            data_file_message(ckpt, 0, "has 100 bytes, its chunks need exactly 256 (truncated or overwritten)", HELD[0])
            + "; restore the checkpoint from a copy",
        ),
        Problem(
            NOT_A_FILE,
            None,
            1,
            fmt.rank_data_name(1),
            data_file_message(ckpt, 1, "is not a regular file (a symbolic link or a directory)", HELD[1])
            + "; restore the checkpoint from a copy",
        ),
        Problem(
            MISSING,
            None,
            2,
            fmt.rank_data_name(2),
            data_file_message(ckpt, 2, "is missing", HELD[2]) + "; restore the checkpoint from a copy",
        ),
    )
    for quick in (True, False):
        report = verify(ckpt, quick=quick)
        assert report.problems == expected, report.problems
        assert not report.ok


def test_one_missing_data_file(tmp_path):
    ckpt = save(tmp_path / "ckpt", rows=(1, 1))
    (ckpt / fmt.rank_data_name(1)).unlink()
    held = "it holds 3 chunk(s) (leaves ['s', 'a'], ['s', 'b'], ['s', 'u'])"
    msg = data_file_message(ckpt, 1, "is missing", held) + "; restore the checkpoint from a copy"
    assert verify(ckpt).problems == (Problem(MISSING, None, 1, fmt.rank_data_name(1), msg),)
    # a symbolic link to a copy of the right size is not the checkpoint's file
    shutil.copyfile(ckpt / fmt.rank_data_name(0), tmp_path / "copy")
    (ckpt / fmt.rank_data_name(0)).unlink()
    (ckpt / fmt.rank_data_name(0)).symlink_to(tmp_path / "copy")
    held0 = "it holds 4 chunk(s) (leaves ['s', 'a'], ['s', 'b'], ['s', 'u'], ...)"
    not_a_file = data_file_message(ckpt, 0, "is not a regular file (a symbolic link or a directory)", held0)
    assert verify(ckpt, quick=True).problems == (
        Problem(NOT_A_FILE, None, 0, fmt.rank_data_name(0), not_a_file + "; restore the checkpoint from a copy"),
        Problem(MISSING, None, 1, fmt.rank_data_name(1), msg),
    )


class _CapHeader(ctypes.Structure):
    _fields_ = [("version", ctypes.c_uint32), ("pid", ctypes.c_int)]


class _CapData(ctypes.Structure):
    _fields_ = [("effective", ctypes.c_uint32), ("permitted", ctypes.c_uint32), ("inheritable", ctypes.c_uint32)]


@contextlib.contextmanager
def permissions_enforced():
    """File permissions apply to the calling thread, as to any user: root's override is off meanwhile.

    Capabilities are per thread on Linux: only this thread loses CAP_DAC_OVERRIDE
    and CAP_DAC_READ_SEARCH (kept in its permitted set, so they come back after).
    """
    if os.geteuid() != 0:
        yield
        return
    libc = ctypes.CDLL(None, use_errno=True)
    version3 = 0x20080522
    saved = (_CapData * 2)()
    if libc.capget(ctypes.byref(_CapHeader(version3, 0)), saved) != 0:
        pytest.skip(f"capget failed: {os.strerror(ctypes.get_errno())}")
    lowered = (_CapData * 2)()
    ctypes.memmove(lowered, saved, ctypes.sizeof(saved))
    lowered[0].effective &= ~((1 << 1) | (1 << 2))  # CAP_DAC_OVERRIDE, CAP_DAC_READ_SEARCH
    if libc.capset(ctypes.byref(_CapHeader(version3, 0)), lowered) != 0:
        pytest.skip(f"capset failed: {os.strerror(ctypes.get_errno())}")
    try:
        yield
    finally:
        assert libc.capset(ctypes.byref(_CapHeader(version3, 0)), saved) == 0


def test_a_data_file_that_cannot_be_stated(tmp_path):
    """A checkpoint directory its reader may not search: each data file is unreadable, named with the error."""
    ckpt = save(tmp_path / "ckpt")
    m = tddist.read_manifest(ckpt)
    os.chmod(ckpt, 0o600)  # read, but not search: no file in it can be stat'ed
    try:
        with permissions_enforced():
            reports = [verify_manifest(ckpt, m, quick=quick, num_threads=1) for quick in (True, False)]
    finally:
        os.chmod(ckpt, 0o700)
    expected = []
    for rank in range(3):
        full = os.path.join(str(ckpt), fmt.rank_data_name(rank))
        message = f"cannot stat data file {full!r} of rank {rank}: [Errno 13] Permission denied: {full!r}; {HELD[rank]}"
        expected.append(Problem(UNREADABLE, None, rank, fmt.rank_data_name(rank), message))
    for report in reports:
        assert report.problems == tuple(expected), report.problems
    assert verify(ckpt).ok


def test_packed_chunk_problems_follow_the_manifest_order_after_the_bad_files(tmp_path):
    """Data-file problems first; then the chunks' of the good ranks, by leaf then chunk (not by rank)."""
    ckpt = save(tmp_path / "ckpt", rows=(2, 1, 2))
    (ckpt / fmt.rank_data_name(0)).unlink()  # rank 0's chunks cannot be read: later ranks' still are
    flip_chunk(ckpt, A, 2, 0)
    b1 = locate(ckpt, B, 1)
    assert (b1.offset, b1.nbytes) == (64, 6)
    flip_chunk(ckpt, B, 1, 5)
    report = verify(ckpt)
    assert rows_of(report.problems) == [
        (MISSING, None, 0, fmt.rank_data_name(0), None),
        (CHECKSUM, A, 2, fmt.rank_data_name(2), 0),
        (CHECKSUM, B, 1, fmt.rank_data_name(1), 64),
    ]
    a2, b1 = report.problems[1], report.problems[2]
    assert re.fullmatch(
        checksum_message(A, 2, "'rank-00002.data', offset 0, 32 bytes", checksum_of(ckpt, A, 2)), a2.message
    ), a2.message
    assert re.fullmatch(
        checksum_message(B, 1, "'rank-00001.data', offset 64, 6 bytes", checksum_of(ckpt, B, 1)), b1.message
    ), b1.message
    assert rows_of(verify(ckpt, quick=True).problems) == [(MISSING, None, 0, fmt.rank_data_name(0), None)]


def test_a_rank_without_a_chunk_of_a_leaf_still_has_its_next_leaves_checked(tmp_path):
    """A replica first in the manifest: the ranks that did not write it still have their other chunks checked."""
    ckpt = tmp_path / "ckpt"

    def first_a_replica(c):
        data = TensorDict(r=torch.arange(3.0), s=TensorDict(a=torch.full((2, 2), c.rank), batch_size=[2]))
        return tddist.save(data, ckpt, comm=c)

    assert not [r for r in tddist.run_threads(2, first_a_replica, timeout=60) if isinstance(r, BaseException)]
    assert list(tddist.read_manifest(ckpt).leaves) == [R, A]
    assert verify(ckpt).ok
    flip_chunk(ckpt, A, 1, 0)
    assert rows_of(verify(ckpt).problems) == [(CHECKSUM, A, 1, fmt.rank_data_name(1), 0)]


def test_a_one_byte_chunk_is_not_empty(tmp_path):
    ckpt = save(tmp_path / "ckpt", rows=(2, 0, 1))
    assert locate(ckpt, U, 2).nbytes == 1
    assert verify(ckpt).ok
    flip_chunk(ckpt, U, 2, 0)
    assert rows_of(verify(ckpt).problems) == [(CHECKSUM, U, 2, fmt.rank_data_name(2), 128)]


def test_a_dtensor_leaf_of_a_packed_checkpoint(tmp_path):
    """A DTensor's boxes (found by a search, indexed once) are checked like any chunk."""
    ckpt = tmp_path / "dtensor"
    shutil.copytree(REPO / "tests" / "golden" / "v3" / "dtensor", ckpt)
    m = tddist.read_manifest(ckpt)
    assert m.packing == "packed" and type(m.leaves[("w",)].table).__name__ == "BoxChunks"
    assert verify(ckpt).ok
    flip(ckpt / fmt.rank_data_name(0), 59)
    report = verify(ckpt)
    assert rows_of(report.problems) == [(CHECKSUM, ("w",), 0, fmt.rank_data_name(0), 0)]


# --- empty chunks (no bytes, no file) ----------------------------------------------------------


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_an_empty_chunk_must_have_the_checksum_of_nothing(tmp_path, layout):
    ckpt = save(target(tmp_path, layout), rows=(2, 0, 1), **LAYOUTS[layout])
    assert checksum_of(ckpt, B, 1) == EMPTY_SUM and locate(ckpt, B, 1).nbytes == 0
    assert verify(ckpt).ok and verify(ckpt, quick=True).ok  # no file for it, and its checksum is right
    set_checksum(ckpt, B, 1, 0x1234)  # a manifest that says the chunk of no bytes has other content
    flip_chunk(ckpt, B, 2, 0)  # and the next rank's chunk of the leaf is damaged
    report = verify(ckpt)
    empty, damaged = locate(ckpt, B, 1), locate(ckpt, B, 2)
    if layout == "packed":
        files, offsets = [fmt.rank_data_name(1), fmt.rank_data_name(2)], [0, 64]
        where = ["'rank-00001.data', offset 0, 0 bytes", "'rank-00002.data', offset 64, 6 bytes"]
    else:
        files, offsets = [empty.relpath, damaged.relpath], [None, None]
        where = [repr(empty.relpath), repr(damaged.relpath)]
    assert rows_of(report.problems) == [
        (CHECKSUM, B, 1, files[0], offsets[0]),
        (CHECKSUM, B, 2, files[1], offsets[1]),
    ], report.problems
    assert re.fullmatch(checksum_message(B, 1, where[0], "0000000000001234", EMPTY_SUM), report.problems[0].message)
    assert re.fullmatch(checksum_message(B, 2, where[1], checksum_of(ckpt, B, 2)), report.problems[1].message)
    assert verify(ckpt, quick=True).ok  # quick reads nothing, checks no checksum


# --- packing "memmap": a file per chunk -------------------------------------------------------


def test_each_damaged_chunk_file_is_reported(tmp_path):
    ckpt = save(tmp_path / "ckpt", rows=(2, 1, 2), layout="memmap")
    r0, r1, r2 = (ckpt / fmt.rank_dir(r) for r in range(3))
    with open(r0 / "s" / "a.memmap", "r+b") as f:
        f.truncate(5)
    (r0 / "s" / "b.memmap").unlink()
    (r0 / "s" / "b.memmap").mkdir()
    (r0 / "s" / "u.memmap").unlink()
    shutil.rmtree(r1)
    r1.write_bytes(b"not a directory")  # a file where rank 1's directory was: its files cannot be stat'ed
    shutil.move(r2, tmp_path / "outside")
    r2.symlink_to(tmp_path / "outside")  # rank 2's directory leads outside the checkpoint

    def full(rank, name):
        return os.path.join(str(ckpt), fmt.rank_dir(rank), "s", name)

    def rel(rank, name):
        return os.path.join(fmt.rank_dir(rank), "s", name)

    def where(key, rank):
        return f"leaf {list(key)} (written by rank {rank}): "

    def cannot_stat(key, name):
        return Problem(
            UNREADABLE,
            key,
            1,
            rel(1, name),
            f"{where(key, 1)}cannot stat {full(1, name)!r}: [Errno 20] Not a directory: {full(1, name)!r}",
        )

    def outside(key, name):
        return Problem(
            NOT_A_FILE, key, 2, rel(2, name), f"{where(key, 2)}{full(2, name)!r} resolves outside the checkpoint"
        )

    expected = (
        Problem(
            STRUCTURE,
            None,
            1,
            fmt.rank_dir(1),
            f"rank directory {str(r1)!r} is missing; the checkpoint is damaged (restore it from a copy)",
        ),
        Problem(
            SIZE,
            A,
            0,
            rel(0, "a.memmap"),
            f"{where(A, 0)}file {full(0, 'a.memmap')!r} has 5 bytes, the manifest says 32 (truncated or overwritten)",
        ),
        cannot_stat(A, "a.memmap"),
        outside(A, "a.memmap"),
        Problem(
            NOT_A_FILE,
            B,
            0,
            rel(0, "b.memmap"),
            f"{where(B, 0)}{full(0, 'b.memmap')!r} is not a regular file (a symbolic link or a directory)",
        ),
        cannot_stat(B, "b.memmap"),
        outside(B, "b.memmap"),
        Problem(
            MISSING,
            U,
            0,
            rel(0, "u.memmap"),
            f"{where(U, 0)}file {full(0, 'u.memmap')!r} is missing; restore the checkpoint from a copy",
        ),
        cannot_stat(U, "u.memmap"),
        outside(U, "u.memmap"),
    )
    for quick in (True, False):
        report = verify(ckpt, quick=quick)
        assert report.problems == expected, report.problems


def test_a_missing_rank_directory(tmp_path):
    ckpt = save(tmp_path / "ckpt", rows=(2, 0, 1), layout="memmap")
    shutil.rmtree(ckpt / fmt.rank_dir(1))  # rank 1 stored no bytes: it needs no directory
    assert verify(ckpt).ok
    shutil.rmtree(ckpt / fmt.rank_dir(2))
    problems = verify(ckpt, quick=True).problems
    assert rows_of(problems) == [
        (STRUCTURE, None, 2, fmt.rank_dir(2), None),
        *[(MISSING, key, 2, os.path.join(fmt.rank_dir(2), *key[:-1], key[-1] + ".memmap"), None) for key in (A, B, U)],
    ]
    assert problems[0].message == (
        f"rank directory {str(ckpt / fmt.rank_dir(2))!r} is missing; the checkpoint is damaged (restore it from a copy)"
    )


def test_a_rank_directory_linked_inside_the_checkpoint_is_unreadable(tmp_path):
    """A rank directory replaced by a link to another rank's (same sizes): only reading the chunks finds it."""
    ckpt = save(tmp_path / "ckpt", rows=(2, 2), layout="memmap")
    shutil.rmtree(ckpt / fmt.rank_dir(1))
    (ckpt / fmt.rank_dir(1)).symlink_to(fmt.rank_dir(0))
    assert verify(ckpt, quick=True).ok  # every file is there, inside, of its size
    report = verify(ckpt)
    expected = []
    for key in (A, B, U):
        rel = os.path.join(fmt.rank_dir(1), "s", key[-1] + ".memmap")
        message = (
            f"leaf {list(key)} (written by rank 1): {rel!r} is a symbolic link or passes through one (it could lead "
            f"outside the checkpoint), not a regular file inside it; refusing it"
        )
        expected.append(Problem(UNREADABLE, key, 1, rel, message))
    assert report.problems == tuple(expected), report.problems


def test_memmap_checksum_problems_name_the_file_without_an_offset(tmp_path):
    ckpt = save(tmp_path / "ckpt", rows=(2, 1), layout="memmap")
    flip_chunk(ckpt, B, 1, 0)
    rel = os.path.join(fmt.rank_dir(1), "s", "b.memmap")
    (problem,) = verify(ckpt).problems
    assert (problem.kind, problem.key, problem.rank, problem.file, problem.offset) == (CHECKSUM, B, 1, rel, None)
    assert re.fullmatch(checksum_message(B, 1, repr(rel), checksum_of(ckpt, B, 1)), problem.message), problem.message


# --- archives: an entry per chunk ---------------------------------------------------------------


def test_archive_entries_missing_or_of_another_size(tmp_path):
    ckpt = save(tmp_path / "ckpt.tdz", rows=(2, 1, 2))
    assert verify(ckpt).ok
    rewrite_archive(ckpt, {})  # rewritten by another zip tool, unchanged: still valid
    assert verify(ckpt).ok
    rewrite_archive(ckpt, {"rank-00002/s/a.memmap": None, "rank-00000/s/b.memmap": b"eleven byte"})
    flip_chunk(ckpt, U, 1, 0)
    expected = [
        Problem(
            MISSING,
            A,
            2,
            "rank-00002/s/a.memmap",
            "leaf ['s', 'a'] (written by rank 2): the archive has no entry 'rank-00002/s/a.memmap'",
        ),
        Problem(
            SIZE,
            B,
            0,
            "rank-00000/s/b.memmap",
            "leaf ['s', 'b'] (written by rank 0): entry 'rank-00000/s/b.memmap' declares 11 bytes, the manifest says 12",
        ),
    ]
    assert list(verify(ckpt, quick=True).problems) == expected
    full = verify(ckpt, num_threads=1)
    assert list(full.problems[:2]) == expected
    assert rows_of(full.problems[2:]) == [(CHECKSUM, U, 1, "rank-00001/s/u.memmap", None)]
    assert re.fullmatch(
        checksum_message(U, 1, "'rank-00001/s/u.memmap'", checksum_of(ckpt, U, 1)), full.problems[2].message
    ), full.problems[2].message


def test_an_archive_that_lists_an_entry_twice_is_a_structure_problem(tmp_path):
    ckpt = save(tmp_path / "ckpt.tdz", rows=(2, 1))
    rewrite_archive(ckpt, {}, duplicate="rank-00000/s/a.memmap")
    message = f"archive {str(ckpt)!r} lists entry 'rank-00000/s/a.memmap' twice; refusing it"
    for quick in (True, False):
        report = verify(ckpt, quick=quick)
        assert report.problems == (Problem(STRUCTURE, None, None, None, message),)
        assert report.layout == "archive" and report.chunks == 7


def test_a_damaged_compressed_entry_is_unreadable(tmp_path):
    ckpt = save(tmp_path / "ckpt.tdz", rows=(2, 1), compression="deflate")
    assert verify(ckpt).ok
    name = "rank-00000/s/a.memmap"
    with zipfile.ZipFile(ckpt) as zf:
        zi = zf.getinfo(name)
    assert zi.compress_type == zipfile.ZIP_DEFLATED
    start = entry_offsets(ckpt)[name]
    for at in range(zi.compress_size):
        flip(ckpt, start + at)
    assert verify(ckpt, quick=True).ok  # the entry is there with its declared size
    (problem,) = verify(ckpt).problems
    assert (problem.kind, problem.key, problem.rank, problem.file, problem.offset) == (UNREADABLE, A, 0, name, None)
    prefix = f"leaf ['s', 'a'] (written by rank 0): archive {str(ckpt)!r}: entry {name!r} "
    assert problem.message.startswith(prefix) and "damaged" in problem.message, problem.message


def test_an_archive_that_becomes_unreadable_while_it_is_checked(tmp_path):
    """Its permissions are taken away after the first chunk (from the progress callback): each later
    compressed entry, read from the file again, cannot be read; every one is reported, none stops the check."""
    ckpt = save(tmp_path / "ckpt.tdz", rows=(2, 1), compression="deflate")
    with zipfile.ZipFile(ckpt) as zf:
        compressed = {zi.filename for zi in zf.infolist() if zi.compress_type != zipfile.ZIP_STORED}
    first = "rank-00000/s/a.memmap"
    later = [(key, rank) for key in (A, B, U) for rank in (0, 1) if (key, rank) != (A, 0)] + [(R, 0)]

    def name(key, rank):
        return "/".join([fmt.rank_dir(rank), *key[:-1], key[-1] + ".memmap"])

    assert first in compressed and all(name(k, r) in compressed for k, r in later), compressed

    def take_permissions_away(_n: int) -> None:
        os.chmod(ckpt, 0)

    try:
        with permissions_enforced():
            report = verify(ckpt, num_threads=1, progress=take_permissions_away)
    finally:
        os.chmod(ckpt, 0o600)
    expected = tuple(
        Problem(
            UNREADABLE,
            key,
            rank,
            name(key, rank),
            f"leaf {list(key)} (written by rank {rank}): cannot read {name(key, rank)!r}: [Errno 13] Permission "
            f"denied: {str(ckpt)!r}",
        )
        for key, rank in later
    )
    assert report.problems == expected, report.problems
    assert verify(ckpt).ok


@pytest.mark.parametrize("layout", ["memmap", "packed"])
def test_a_file_that_cannot_be_opened_is_unreadable_and_the_check_goes_on(tmp_path, layout):
    """A leaf file or data file that exists with the right size but cannot be opened (permission denied, an
    I/O error) is reported as unreadable, and the other files are still checked: ``verify`` does not stop
    with the reader's ``StorageError``."""
    ckpt = tmp_path / "ckpt"
    kw = {"layout": "memmap"} if layout == "memmap" else {}
    tddist.save(TensorDict({"x": torch.arange(4.0), "y": torch.ones(3)}, []), ckpt, **kw)
    rel = os.path.join("rank-00000", "x.memmap") if layout == "memmap" else fmt.rank_data_name(0)
    if layout == "memmap":
        (ckpt / "rank-00000" / "y.memmap").write_bytes(bytes(12))
    os.chmod(ckpt / rel, 0)
    try:
        with permissions_enforced():
            report = verify(ckpt, num_threads=1)
    finally:
        os.chmod(ckpt / rel, 0o644)
    unreadable = [p for p in report.problems if p.kind == UNREADABLE]
    assert {p.key for p in unreadable} == ({("x",)} if layout == "memmap" else {("x",), ("y",)}), report.problems
    for p in unreadable:
        assert p.rank == 0 and p.file == rel and "Permission denied" in p.message, p
    if layout == "memmap":  # the other leaf was still read: its zeroed bytes do not match
        assert [(p.kind, p.key) for p in report.problems if p.kind != UNREADABLE] == [(CHECKSUM, ("y",))]
    assert verify(ckpt).ok == (layout == "packed")
