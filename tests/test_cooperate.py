"""The ranks of one node split the reads of a resharding load (``tddist.loading.cooperate``).

Residency is read from the kernel (``mincore``) on real files whose pages
were dropped first (``POSIX_FADV_DONTNEED`` on a clean, fsynced file): a
lazily mapped load reads nothing until touched, so pages in memory after
``load`` returned were read by the warm-up.
"""

from __future__ import annotations

import ctypes
import mmap
import os
from pathlib import Path

import torch
from tensordict import TensorDict

import tddist
from tddist import format as fmt
from tddist.loading.cooperate import MIN_SHARED_BYTES, node_ranks, share_of
from tddist.manifest.locate import FileSpan
from tddist.storage.directory import DirectoryFiles
from tests.helpers import assert_td_equal

MIB = 1 << 20
PAGE = mmap.PAGESIZE


def resident(path: Path) -> list[bool]:
    """Whether each page of the file at ``path`` is in the page cache (``mincore`` of a map that touches none)."""
    size = path.stat().st_size
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
    with open(path, "rb") as f, mmap.mmap(f.fileno(), size, access=mmap.ACCESS_COPY) as m:
        npages = (size + PAGE - 1) // PAGE
        vec = (ctypes.c_ubyte * npages)()
        view = ctypes.c_char.from_buffer(m)  # an export of the map: released before the map closes
        try:
            failed = libc.mincore(ctypes.c_void_p(ctypes.addressof(view)), ctypes.c_size_t(size), vec) != 0
        finally:
            del view  # even when mincore fails: a live export would turn the map's close into a BufferError
        if failed:
            raise OSError(ctypes.get_errno(), "mincore")
        return [bool(v & 1) for v in vec]


def dropped(path: Path) -> Path:
    """``path`` with its pages dropped from the page cache (it is fsynced, so every page is clean)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)
    share = sum(resident(path)) / max(len(resident(path)), 1)
    assert share < 0.1, f"{share:.0%} of {path} stayed in memory after POSIX_FADV_DONTNEED: residency says nothing here"
    return path


def test_share_of_cuts_the_shared_union_into_equal_parts() -> None:
    needs = [
        [FileSpan("a", 0, 100), FileSpan("b", 0, 40), FileSpan("own0", 0, 1000)],
        [FileSpan("a", 50, 200), FileSpan("b", 40, 80)],  # "a" overlaps rank 0's; "b" touches it
        [FileSpan("a", 300, 340)],
    ]
    parts = [share_of(needs, me) for me in range(3)]
    # Files one rank reads alone ("own0") are left to it; the shared union: a [0, 200) + [300, 340), b [0, 80).
    covered = sorted((s.relpath, s.start, s.stop) for part in parts for s in part)
    assert {rel for rel, _lo, _hi in covered} == {"a", "b"}
    total = 200 + 40 + 80
    sizes = [sum(s.stop - s.start for s in part) for part in parts]
    assert sum(sizes) == total and max(sizes) - min(sizes) <= 1, sizes
    by_file: dict[str, list[tuple[int, int]]] = {}
    for rel, lo, hi in covered:
        by_file.setdefault(rel, []).append((lo, hi))
    for rel, ranges in by_file.items():  # disjoint, and exactly the union
        merged: list[list[int]] = []
        for lo, hi in sorted(ranges):
            assert not merged or lo >= merged[-1][1], (rel, ranges)
            if merged and lo == merged[-1][1]:
                merged[-1][1] = hi
            else:
                merged.append([lo, hi])
        assert merged == {"a": [[0, 200], [300, 340]], "b": [[0, 80]]}[rel]
    assert share_of([[FileSpan("x", 0, 10)], [FileSpan("y", 0, 10)]], 0) == []  # nothing shared
    assert node_ranks(["n0", "n1", "n0", "n1"], 2).ranks == (0, 2)


def test_warm_reads_the_spans_into_the_page_cache(tmp_path: Path) -> None:
    td = TensorDict(x=torch.arange(2 * MIB, dtype=torch.int32), batch_size=[])
    tddist.save(td, tmp_path / "ck", comm=tddist.LocalComm())
    data = dropped(tmp_path / "ck" / fmt.rank_data_name(0))
    files = DirectoryFiles(str(tmp_path / "ck"))
    files.warm([FileSpan(fmt.rank_data_name(0), 3 * MIB + 100, 5 * MIB)])
    pages = resident(data)
    assert all(pages[3 * MIB // PAGE : 5 * MIB // PAGE]), "a page of the warmed span is not in the page cache"
    files.warm([FileSpan("no-such-file", 0, MIB), FileSpan(fmt.rank_data_name(0), 8 * MIB, 9 * MIB)])  # left to span


def test_resharding_load_has_the_node_read_its_shared_files(tmp_path: Path) -> None:
    rows = 1 << 20  # 72 MiB: each rank reads 18 MiB, above ``MIN_SHARED_BYTES``
    assert rows * (16 * 4 + 8) // 4 >= MIN_SHARED_BYTES
    td = TensorDict(
        w=torch.arange(rows * 16, dtype=torch.float32).reshape(rows, 16),
        b=torch.arange(rows, dtype=torch.int64),
        batch_size=[rows],
    )
    tddist.save(td, tmp_path / "one", comm=tddist.LocalComm())
    data = dropped(tmp_path / "one" / fmt.rank_data_name(0))
    parts = tddist.run_threads(4, lambda c: tddist.load(tmp_path / "one", comm=c, shard="even"), timeout=60)
    pages = resident(data)  # before any rank touched a byte of what it loaded
    assert sum(pages) / len(pages) > 0.95, f"only {sum(pages)} of {len(pages)} pages were read by the node's ranks"
    for r, part in enumerate(parts):
        assert isinstance(part, TensorDict), part
        assert_td_equal(part, td[r * rows // 4 : (r + 1) * rows // 4], f"rank {r}'s quarter")


def test_same_layout_load_reads_nothing_ahead(tmp_path: Path) -> None:
    """Each rank reads its own file: nothing is shared, so nothing is read before the ranks touch their data."""
    rows = 1 << 19  # 32 MiB: a rank reads 16 MiB
    full = torch.arange(rows * 16, dtype=torch.float32).reshape(rows, 16)

    def save(c: tddist.ThreadComm) -> None:
        lo, hi = c.rank * rows // 2, (c.rank + 1) * rows // 2
        tddist.save(TensorDict(w=full[lo:hi], batch_size=[hi - lo]), tmp_path / "two", comm=c)

    assert tddist.run_threads(2, save, timeout=60) == [None, None]
    files = [dropped(tmp_path / "two" / fmt.rank_data_name(r)) for r in range(2)]
    parts = tddist.run_threads(2, lambda c: tddist.load(tmp_path / "two", comm=c, shard="even"), timeout=60)
    assert all(isinstance(p, TensorDict) for p in parts), parts
    for f in files:
        pages = resident(f)
        assert sum(pages) / len(pages) < 0.5, f"{sum(pages)} of {len(pages)} pages of {f.name} were read ahead"
