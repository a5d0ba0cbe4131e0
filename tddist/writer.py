"""Rank-local writing of one shard into the staging area, with checksums.

The bytes go straight from each tensor's memory into its file with positioned
``pwrite`` calls, in blocks spread over ``num_threads`` threads, and each
block is hashed while it is in cache. This keeps tensordict's file layout
(``<key>.memmap`` files plus ``meta.json`` per node) but not its writer:
tensordict writes through a memory map, which costs an extra page-cache pass
and turns a full disk into SIGBUS instead of an error. ``posix_fallocate``
reserves each file's space first so a full disk fails fast with ENOSPC.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np
import torch

from . import format as fmt
from ._fs import fsync_path, fsync_tree_dirs, syncfs, write_durable
from .checksum import EMPTY, block_digest, checksum_bytes, combine_digests, tensor_bytes
from .manifest import leaf_entry
from .sharding import consistent_batch

_WRITE_STEP = 8 * 1024 * 1024
_MANY_FILES = 64


@dataclass
class LeafToWrite:
    """A tensor this rank writes: its key and its local (contiguous CPU) bytes."""

    key: tuple[str, ...]
    tensor: torch.Tensor


class _FileJob:
    """One output file: its descriptor, the blocks still to write, their digests."""

    def __init__(self, path: str, data: np.ndarray, sync: bool = True):
        self.path = path
        self.sync = sync
        self.data = memoryview(data)
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
        self.digests[index] = block_digest(block)
        pos = 0
        while pos < len(block):
            pos += os.pwrite(self.fd, block[pos : pos + _WRITE_STEP], lo + pos)
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
) -> dict[tuple, tuple[int, str]]:
    """Write each leaf's bytes to ``root/<rank dir>/<key>.memmap``; fsync each file if ``sync_each``.

    Returns ``{key: (nbytes, checksum)}``. Tensors with no elements get no file,
    as in tensordict. Directories are created but not fsynced (``write_shard`` does).
    """
    results: dict[tuple, tuple[int, str]] = {}
    jobs: list[_FileJob] = []
    try:
        for leaf in leaves:
            data = tensor_bytes(leaf.tensor)
            if data.size == 0:
                results[leaf.key] = (0, EMPTY)
                continue
            path = os.path.join(root, fmt.leaf_relpath(rank, leaf.key, robust_key))
            os.makedirs(os.path.dirname(path), exist_ok=True)
            jobs.append(_FileJob(path, data, sync_each))
        tasks: list[Callable[[], None]] = [(lambda j=j, i=i: j.write_block(i)) for j in jobs for i in range(j.nblocks)]
        _run_all(tasks, num_threads)
    finally:
        for j in jobs:
            j.close()
    for leaf, j in zip([lf for lf in leaves if lf.tensor.numel()], jobs):
        results[leaf.key] = (len(j.data), combine_digests(j.digests))
    return results


def _run_all(tasks: list[Callable[[], None]], num_threads: int) -> None:
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


def node_meta_files(
    rank: int,
    nodes: dict[tuple, tuple[int, ...]],
    leaves: dict[tuple, torch.Tensor],
    objects: dict[tuple, tuple[str, object]],
    robust_key: bool,
) -> dict[str, bytes]:
    """tensordict's meta.json of every node of this rank, by relative path, so
    ``TensorDict.load_memmap(<rank dir>)`` opens what this rank wrote.

    Non-tensor values stored as JSON get tensordict's NonTensorData /
    NonTensorStack entries; pickled ones are left out (tddist never writes pickle files).
    """
    children: dict[tuple, list[str]] = {k: [] for k in nodes}
    node_leaves: dict[tuple, dict] = {k: {} for k in nodes}
    node_objects: dict[tuple, dict[str, str]] = {k: {} for k in nodes}
    files: dict[str, bytes] = {}
    for key in nodes:
        if key:
            children[key[:-1]].append(key[-1])
    for key, t in leaves.items():
        node_leaves[key[:-1]][key[-1]] = (list(t.shape), t.dtype)
    for key, (kind, enc) in objects.items():
        meta = fmt.td_object_meta(kind, enc)
        if meta is not None:
            files[os.path.join(fmt.node_relpath(rank, key, robust_key), fmt.TD_META_NAME)] = fmt.dumps(meta)
            node_objects[key[:-1]][key[-1]] = "NonTensorStack" if kind == "stack" else "NonTensorData"
    for key, batch in nodes.items():
        batch = consistent_batch(batch, [s for s, _ in node_leaves[key].values()])
        meta = fmt.td_meta(batch, node_leaves[key], children[key], node_objects[key])
        files[os.path.join(fmt.node_relpath(rank, key, robust_key), fmt.TD_META_NAME)] = fmt.dumps(meta)
    return files


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


def write_shard(
    root: str,
    rank: int,
    nodes: dict[tuple, tuple[int, ...]],
    leaves: list[tuple[tuple, torch.Tensor, object, bool, tuple | None]],
    objects: dict[tuple, tuple[str, object]],
    robust_key: bool,
    num_threads: int,
    check_replicas: bool = False,
) -> dict:
    """Write this rank's part of a directory checkpoint under ``root``; return its fragment (its vote).

    ``leaves`` holds ``(key, local tensor, placement, write, (box, global
    shape) or None)``; ``write`` is False for a replica another rank writes.
    ``objects`` holds the non-tensor leaves, already encoded.
    """
    os.makedirs(os.path.join(root, fmt.rank_dir(rank)), exist_ok=True)
    written = {key: t for key, t, _p, write, _b in leaves if write}
    metas = node_meta_files(rank, nodes, written, objects, robust_key)
    # Many small files: one syncfs costs far less than one fsync each.
    sync_each = len(written) + len(metas) <= _MANY_FILES
    results = write_leaves(
        root, rank, [LeafToWrite(k, t) for k, t in written.items()], robust_key, num_threads, sync_each
    )
    write_files(root, metas, sync_each)
    if sync_each or not syncfs(root):
        if not sync_each:
            _fsync_files(os.path.join(root, fmt.rank_dir(rank)))
        sync_dirs(root, rank)
    return fragment(rank, nodes, leaves, objects, results, check_replicas)


def fragment(rank: int, nodes, leaves, objects, results: dict, check_replicas: bool) -> dict:
    """This rank's vote: its nodes, and each leaf's shape, placement, and (if written) size and checksum.

    With ``check_replicas`` the replicas this rank did not write are hashed
    too, so rank 0 can compare them with the copy it writes.
    """
    entries = []
    for key, t, placement, write, where in leaves:
        nbytes, checksum = results.get(key, (None, None))
        box, global_shape = where or (None, None)
        entry = leaf_entry(key, t.shape, t.dtype, placement, nbytes, checksum, box, global_shape)
        if check_replicas and not write:
            entry["replica"] = checksum_bytes(tensor_bytes(t))
        entries.append(entry)
    return {
        "rank": rank,
        "nodes": [[list(k), list(b)] for k, b in nodes.items()],
        "leaves": entries,
        "objects": [{"key": list(k), "kind": kind, "value": enc} for k, (kind, enc) in objects.items()],
    }
