"""Rank-local writing of one shard into the staging area, with checksums.

The bytes go straight from each tensor's memory into its file with positioned
``pwrite`` calls, in blocks spread over ``num_threads`` threads, and each
block is hashed while it is in cache; each block's write-back starts as soon
as it is written (``_fs.start_writeback``), so the disk works while the rest
is copied into the page cache. This keeps tensordict's file layout
(``<key>.memmap`` files plus ``meta.json`` per node) but not its writer:
tensordict writes through a memory map, which costs an extra page-cache pass
and turns a full disk into SIGBUS instead of an error. ``posix_fallocate``
reserves each file's space first so a full disk fails fast with ENOSPC.
"""

from __future__ import annotations

import functools
import os
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from functools import partial

import numpy as np
import torch

from .. import format as fmt
from .._faults import fault_point
from .._fs import WRITE_STEP, fsync_path, fsync_tree_dirs, syncfs, write_and_start_writeback, write_durable
from ..checksum import EMPTY, combine_digests, digest_visiting, tensor_bytes
from ..core.finite import StatsCounter, counter_for
from ..core.types import Key, LocalShard, SaveItem, StoredBytes
from ..manifest.locate import packed_offsets
from .tdmeta import node_meta_files

_MANY_FILES = 64


@dataclass(frozen=True, slots=True)
class LeafToWrite:
    """A tensor this rank writes: its key and its local (contiguous CPU) bytes."""

    key: tuple[str, ...]
    tensor: torch.Tensor


class _FileJob:
    """One output file: its descriptor, the blocks still to write, their digests."""

    def __init__(self, path: str, data: np.ndarray, sync: bool = True, counter: StatsCounter | None = None) -> None:
        self.path = path
        self.sync = sync
        self.counter = counter
        self.data = memoryview(data.data)
        self.nblocks = (len(self.data) + fmt.CHECKSUM_BLOCK - 1) // fmt.CHECKSUM_BLOCK
        self.digests: list[int] = [0] * self.nblocks
        self.remaining = self.nblocks
        self.lock = threading.Lock()
        self.fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        try:
            os.posix_fallocate(self.fd, 0, len(self.data))
        except OSError:
            os.close(self.fd)
            raise

    def write_block(self, index: int) -> None:
        lo = index * fmt.CHECKSUM_BLOCK
        block = self.data[lo : lo + fmt.CHECKSUM_BLOCK]
        self.digests[index] = digest_visiting(block, self.counter)
        write_and_start_writeback(self.fd, block, lo, WRITE_STEP)
        with self.lock:
            self.remaining -= 1
            last = self.remaining == 0
        if last:
            self.finish()

    def finish(self) -> None:
        if self.sync:
            os.fsync(self.fd)
        os.close(self.fd)
        self.fd = -1

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


def write_leaves(
    root: str, rank: int, leaves: list[LeafToWrite], robust_key: bool, num_threads: int, sync_each: bool = True
) -> dict[Key, StoredBytes]:
    """Write each leaf's bytes to ``root/<rank dir>/<key>.memmap``; fsync each file if ``sync_each``.

    Returns what was stored for each key. Tensors with no elements get no file,
    as in tensordict. Directories are created but not fsynced (``write_shard`` does).
    """
    results: dict[Key, StoredBytes] = {}
    jobs: list[_FileJob] = []
    try:
        for leaf in leaves:
            data = tensor_bytes(leaf.tensor)
            counter = counter_for(fmt.dtype_name(leaf.tensor.dtype))
            if data.size == 0:
                results[leaf.key] = StoredBytes(0, EMPTY, None if counter is None else counter.result())
                continue
            path = os.path.join(root, fmt.leaf_relpath(rank, leaf.key, robust_key))
            os.makedirs(os.path.dirname(path), exist_ok=True)
            jobs.append(_FileJob(path, data, sync_each, counter))
        tasks: list[Callable[[], None]] = [functools.partial(j.write_block, i) for j in jobs for i in range(j.nblocks)]
        run_all(tasks, num_threads)
    finally:
        for j in jobs:
            j.close()
    for leaf, j in zip([lf for lf in leaves if lf.tensor.numel()], jobs):
        results[leaf.key] = StoredBytes(
            len(j.data), combine_digests(j.digests), None if j.counter is None else j.counter.result()
        )
    return results


def run_all(tasks: list[Callable[[], None]], num_threads: int) -> None:
    """Run tasks in order on ``num_threads`` threads (0 or 1: this thread); re-raise the first error."""
    if num_threads <= 1 or len(tasks) <= 1:
        for t in tasks:
            t()
        return
    with ThreadPoolExecutor(max_workers=num_threads, thread_name_prefix="tddist-write") as ex:
        futures = [ex.submit(t) for t in tasks]
        error = None
        for f in futures:
            try:
                f.result()
            except BaseException as e:  # keep draining so every file gets closed
                error = error or e
                for g in futures:
                    g.cancel()
        if error is not None:
            raise error


def write_files(root: str, files: dict[str, bytes], sync_each: bool = True) -> None:
    """Write small files (the meta.json) under ``root``, each fsynced if ``sync_each``."""
    for rel, data in files.items():
        path = os.path.join(root, rel)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        write_durable(path, data, sync=sync_each)


def _fsync_files(top: str) -> None:
    for dirpath, _dirs, files in os.walk(top):
        for name in files:
            fsync_path(os.path.join(dirpath, name))


def sync_dirs(root: str, rank: int) -> None:
    """fsync every directory this rank created."""
    top = os.path.join(root, fmt.rank_dir(rank))
    if os.path.isdir(top):
        fsync_tree_dirs(top)


def write_shard(root: str, rank: int, shard: LocalShard, robust_key: bool, num_threads: int) -> dict[Key, StoredBytes]:
    """Write this rank's part of a directory checkpoint under ``root``, durably; return what it stored.

    Leaves go to ``<rank dir>/<key>.memmap`` files and each node gets
    tensordict's ``meta.json``, so ``TensorDict.load_memmap(<rank dir>)``
    opens what this rank wrote. Replicas that another rank writes are skipped.
    """
    os.makedirs(os.path.join(root, fmt.rank_dir(rank)), exist_ok=True)
    written = shard.written()
    metas = node_meta_files(rank, shard, robust_key)
    # Many small files: one syncfs costs far less than one fsync each.
    sync_each = len(written) + len(metas) <= _MANY_FILES
    stored = write_leaves(
        root, rank, [LeafToWrite(k, t) for k, t in written.items()], robust_key, num_threads, sync_each
    )
    write_files(root, metas, sync_each)
    if sync_each or not syncfs(root):
        if not sync_each:
            _fsync_files(os.path.join(root, fmt.rank_dir(rank)))
        sync_dirs(root, rank)
    return stored


_SMALL = 1024 * 1024  # chunks below this are copied into one buffer and written with one call


def write_packed(path: str, items: Sequence[SaveItem], num_threads: int, rank: int) -> dict[Key, StoredBytes]:
    """Write every chunk this rank stores into one data file (packing "packed"), durably.

    Chunks follow ``items`` (the save's structure order) at the offsets of
    ``manifest.locate.packed_offsets``, which readers derive the same way. Large chunks
    are written in CHECKSUM_BLOCK blocks from several threads, each block
    hashed while in cache; small ones are gathered into batches of about
    ``WRITE_STEP`` bytes and written with one positioned write each (one
    file and one fsync per rank instead of one per leaf). ``rank`` (the
    writer's) names the fault point ``midwrite``, halfway through the writes.
    """
    written = [(i.key, tensor_bytes(i.tensor)) for i in items if i.writes]
    counters = {i.key: counter_for(fmt.dtype_name(i.tensor.dtype)) for i in items if i.writes}
    sizes = np.array([a.size for _k, a in written], dtype=np.int64)
    offsets, end = packed_offsets(sizes)
    total = int(end)
    stored: dict[Key, StoredBytes] = {}
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    try:
        if total:
            os.posix_fallocate(fd, 0, total)
        tasks: list[Callable[[], None]] = []
        digests: dict[Key, list[int]] = {}
        batch: list[tuple[int, memoryview]] = []
        batch_bytes = 0
        for (key, data), offset in zip(written, offsets.tolist()):
            view = memoryview(data.data).cast("B")
            blocks = [view[lo : lo + fmt.CHECKSUM_BLOCK] for lo in range(0, len(view), fmt.CHECKSUM_BLOCK)]
            digests[key] = [0] * len(blocks)
            if len(view) >= _SMALL:
                if batch:  # a batch is one contiguous write: it must not span this chunk (it would zero it)
                    tasks.append(partial(_put_batch, fd, batch))
                    batch, batch_bytes = [], 0
                for j, block in enumerate(blocks):
                    at = offset + j * fmt.CHECKSUM_BLOCK
                    tasks.append(partial(_put, fd, digests[key], j, block, at, counters[key]))
                continue
            digests[key] = [digest_visiting(b, counters[key]) for b in blocks]
            batch.append((offset, view))
            batch_bytes += len(view)
            if batch_bytes >= WRITE_STEP:
                tasks.append(partial(_put_batch, fd, batch))
                batch, batch_bytes = [], 0
        if batch:
            tasks.append(partial(_put_batch, fd, batch))
        threads = num_threads if len(tasks) > 1 else 1  # a small shard: one write, no threads to start
        tasks.insert(len(tasks) // 2, partial(fault_point, "midwrite", rank))
        run_all(tasks, threads)
        os.fsync(fd)
    finally:
        os.close(fd)
    for key, data in written:
        counter = counters[key]
        stats = None if counter is None else counter.result()
        stored[key] = StoredBytes(int(data.size), combine_digests(digests[key]), stats)
    return stored


def stored_bytes(data: np.ndarray, dtype_name: str) -> StoredBytes:
    """What storing the bytes ``data`` of a chunk of dtype ``dtype_name`` records: its size, its checksum and,
    for a floating dtype, its counts of non-finite values, in one pass (a store that uploads from memory)."""
    counter = counter_for(dtype_name)
    mv = memoryview(data.data).cast("B")
    digests = [digest_visiting(mv[i : i + fmt.CHECKSUM_BLOCK], counter) for i in range(0, len(mv), fmt.CHECKSUM_BLOCK)]
    return StoredBytes(len(mv), combine_digests(digests), None if counter is None else counter.result())


def _put(fd: int, digests: list[int], index: int, block: memoryview, at: int, counter: StatsCounter | None) -> None:
    digests[index] = digest_visiting(block, counter)
    write_and_start_writeback(fd, block, at, WRITE_STEP)


def _put_batch(fd: int, batch: list[tuple[int, memoryview]]) -> None:
    """Write consecutive small chunks with one positioned write (the padding between them is zeros)."""
    start = batch[0][0]
    end = batch[-1][0] + len(batch[-1][1])
    buf = bytearray(end - start)
    for offset, view in batch:
        buf[offset - start : offset - start + len(view)] = view
    write_and_start_writeback(fd, memoryview(buf), start, WRITE_STEP)
