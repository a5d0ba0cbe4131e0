"""Pack a committed directory checkpoint into one archive, or unpack an archive into a directory.

Both run in one process, verify every checksum on the way (corrupt data is
never copied into a new checkpoint), and publish the result with the same
staging-and-rename commit as ``save``, so the destination appears complete or
not at all. The source is never modified.
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Iterator
from dataclasses import replace
from typing import Any

import torch

from .. import format as fmt
from .._fs import fsync_tree_dirs, makedirs_durable, remove_tree, write_durable
from ..checksum import combine_digests, hash_blocks
from ..core.sharding import PerRank
from ..core.types import EncodedObject, Key
from ..errors import CorruptCheckpointError
from ..loading.read import held_location, open_holder
from ..manifest.locate import Location, Locator
from ..manifest.model import Chunk, Leaf, Manifest
from ..manifest.v2 import encode
from ..storage.archive import ArchiveFiles, check_archive_target
from ..storage.backends import local_files, open_checkpoint, target_of
from ..storage.directory import DirectoryFiles, check_target
from ..storage.opened import OpenedCheckpoint
from ..storage.publish import publish
from ..storage.tdmeta import meta_files
from ..storage.zipcodec import (
    entry_rows,
    place_entries,
    prepare_entries,
    resolve_compression,
    write_region,
    write_tail_and_directory,
)

logger = logging.getLogger(__name__)


def _files(manifest: Manifest, src: OpenedCheckpoint) -> tuple[dict[str, bytes], dict[str, tuple[torch.Tensor, str]]]:
    """meta.json files of every rank directory (bytes), and each chunk's bytes and checksum by entry name.

    Entries are named as in the "memmap" layout (one file per chunk), whatever
    the source's packing: an archive always holds that tree. The files are
    read through ``src``'s pinned descriptor: the generation its manifest describes.
    """
    held = HeldFiles(src.path, manifest, src.files())  # any store: a packed checkpoint is read in spans
    files = local_files(src) if manifest.packing == "memmap" else None
    locator = Locator(manifest)
    leaves = {}
    for leaf in manifest.leaves.values():
        for i, c in enumerate(leaf.chunks):
            if c.nbytes:
                data = held.span(leaf, i, c, locator.locate(leaf, c))
                leaves[fmt.leaf_relpath(c.rank, leaf.key, manifest.robust_key)] = (data, c.checksum)
    if manifest.packing != "memmap":  # a packed directory has no meta.json: write what each rank's would be
        return {
            name: data for r in range(manifest.world_size) for name, data in _rank_meta_files(manifest, r).items()
        }, leaves
    metas = {}
    assert files is not None
    for name in _meta_names(manifest, files):
        metas[name] = bytes(files.array(name, _size(files, name)).numpy())
    return metas, leaves


class HeldFiles:
    """The chunk readers of a checkpoint and of its holders (an incremental checkpoint's), each opened once, so a
    copy of it holds every byte itself."""

    def __init__(self, path: str, manifest: Manifest, own: Any) -> None:
        self.path, self.manifest, self.own = path, manifest, own
        self.opened: dict[int, tuple[OpenedCheckpoint, Any]] = {}

    def span(self, leaf: Leaf, i: int, chunk: Chunk, own: Location) -> torch.Tensor:
        """Chunk ``i`` of ``leaf`` (``own``: where it would lie here), from the checkpoint that holds it.

        Raises:
            CorruptCheckpointError: its holder is missing, damaged or replaced.
        """
        h = leaf.holder_of(i)
        if not h:
            return self.own.span(own)
        if h not in self.opened:
            opened = open_holder(self.path, self.manifest, h)
            self.opened[h] = (opened, opened.files())
        opened, files = self.opened[h]
        return files.span(held_location(opened, leaf, chunk, own))


def _rank_meta_files(m: Manifest, rank: int) -> dict[str, bytes]:
    """tensordict's meta.json files of ``rank``'s directory, from the manifest (as the rank would have written them)."""
    nodes: dict[Key, tuple[int, ...]] = {}
    for key, batch in m.nodes.items():
        rows = m.rows_of(key) if batch else None
        nodes[key] = (rows[rank], *batch[1:]) if rows is not None else batch
    leaves = {}
    for key, leaf in m.leaves.items():
        chunk = leaf.chunk_of_rank(rank)
        if chunk is not None:
            # a per-rank leaf's chunk is row ``rank`` of the stack; the rank saved (and its file holds) the value alone
            shape = list(chunk.box[1][1:]) if isinstance(leaf.placement, PerRank) else list(chunk.box[1])
            leaves[key] = (shape, leaf.dtype_name)
    objects = {}
    for key, o in m.objects.items():
        if o.placement == "shard":
            objects[key] = EncodedObject("stack", o.values[rank])
        else:
            objects[key] = EncodedObject("data", o.values[0] if o.placement == "replicate" else o.values[rank])
    return meta_files(rank, nodes, leaves, objects, m.robust_key)


def _meta_names(manifest: Manifest, files: ArchiveFiles | DirectoryFiles) -> list[str]:
    """The meta.json files of the source that belong to a node or a non-tensor value of the manifest.

    Only these are copied: a foreign entry (``junk/meta.json``) or one that
    collides with a leaf's file never reaches the destination.
    """
    expected = set()
    for rank in range(manifest.world_size):
        for key in [*manifest.nodes, *manifest.objects]:
            expected.add(os.path.join(fmt.node_relpath(rank, key, manifest.robust_key), fmt.TD_META_NAME))
    if isinstance(files, ArchiveFiles):
        present = set(files.entries)
    else:
        present = {n for n in expected if os.path.isfile(os.path.join(files.root, n))}
    return sorted(expected & present)


def _size(files: ArchiveFiles | DirectoryFiles, name: str) -> int:
    if hasattr(files, "entries"):
        return files.entries[name][1].file_size
    return os.path.getsize(os.path.join(files.root, name))


def _check(name: str, digests: list[int], checksum: str, src: str) -> None:
    if combine_digests(digests) != checksum:
        raise CorruptCheckpointError(
            f"{name!r} in {src!r} fails its checksum; nothing was written (restore the source first)"
        )


def pack(src: str | os.PathLike, dst: str | os.PathLike, *, compression: Any = None, num_threads: int = 0) -> str:
    """Write the committed directory checkpoint ``src`` as the archive ``dst``; returns ``dst``.

    One archive file is easier to copy, upload or keep than a tree of files,
    and loads the same. Every chunk's checksum is verified on the way, and
    ``dst`` appears complete or not at all (an existing archive is
    replaced); ``src`` is never modified. Runs in one process.

    Args:
        src: the committed directory checkpoint.
        dst: the archive to write (conventionally ending in ``.tdz``).
        compression: as ``save(compression=...)``: None (stored), ``"deflate"``,
            ``"bzip2"``, ``"lzma"``, ``"zstd"``, a zipfile constant,
            ``(name, level)`` or ``"name:level"``.
        num_threads: threads that hash, compress and write.

    Returns:
        ``dst`` as an absolute path.

    Raises:
        CheckpointNotFoundError: nothing committed is at ``src``.
        ManifestError: the manifest of ``src`` is damaged or from a newer tddist.
        CorruptCheckpointError: a file of ``src`` is missing, truncated or fails its checksum.
        TargetError: ``dst`` is a directory, a symbolic link or a file that is not a tddist archive.
        InvalidArgumentError: ``compression`` is not supported (or zstandard is not installed).
    """
    src, dst = os.path.abspath(os.fspath(src)), os.path.abspath(os.fspath(dst))
    with open_checkpoint(src) as opened:
        return _pack(opened, dst, compression, num_threads)


def _pack(opened: OpenedCheckpoint, dst: str, compression: Any, num_threads: int) -> str:
    src, manifest = opened.path, opened.manifest
    codec = resolve_compression(compression)
    metas, leaves = _files(manifest, opened)
    tensors = {name: data for name, (data, _c) in leaves.items()}
    entries = prepare_entries(metas, tensors, codec, num_threads)
    for e in entries:
        if e.name in leaves:
            _check(e.name, e.digests, leaves[e.name][1], src)
    makedirs_durable(os.path.dirname(dst))
    check_archive_target(dst)
    with staged(dst) as staging:
        os.close(os.open(staging, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644))
        end = place_entries(entries, 0)
        write_region(staging, entries, num_threads)
        as_archive = encode(
            replace(manifest, layout="archive", packing="memmap", version=fmt.FORMAT_VERSION, holders=None)
        )
        tail = {fmt.INDEX_NAME: as_archive.index, fmt.MANIFEST_NAME: as_archive.manifest}
        write_tail_and_directory(staging, end, tail, list(entry_rows(entries)))
    logger.info("packed %s into %s", src, dst)
    return dst


def unpack(src: str | os.PathLike, dst: str | os.PathLike, *, num_threads: int = 0) -> str:
    """Write the committed archive ``src`` as the directory checkpoint ``dst``; returns ``dst``.

    The inverse of ``pack``: the directory holds the same files as the
    archive's entries, decompressed. Every chunk's checksum is verified on the
    way, and ``dst`` appears complete or not at all (an existing checkpoint
    directory is replaced); ``src`` is never modified. Runs in one process.

    Args:
        src: the committed archive.
        dst: the checkpoint directory to write.
        num_threads: accepted for symmetry with ``pack``; unpacking runs on one thread.

    Returns:
        ``dst`` as an absolute path.

    Raises:
        CheckpointNotFoundError: nothing committed is at ``src``.
        ManifestError: the manifest of ``src`` is damaged or from a newer tddist.
        CorruptCheckpointError: an entry of ``src`` is missing, malformed or fails its checksum.
        TargetError: ``dst`` is a file, a symbolic link or a directory that is not a tddist checkpoint.
    """
    src, dst = os.path.abspath(os.fspath(src)), os.path.abspath(os.fspath(dst))
    with open_checkpoint(src) as opened:
        return _unpack(opened, dst)


def _unpack(opened: OpenedCheckpoint, dst: str) -> str:
    src, manifest = opened.path, opened.manifest
    metas, leaves = _files(manifest, opened)
    makedirs_durable(os.path.dirname(dst))
    check_target(dst)
    with staged(dst) as staging:
        os.mkdir(staging)
        for name, data in metas.items():
            _write(staging, name, data)
        for name, (chunk, checksum) in leaves.items():
            array = chunk.numpy()
            _check(name, hash_blocks(array), checksum, src)
            _write(staging, name, memoryview(array.data))
        as_directory = encode(
            replace(manifest, layout="directory", packing="memmap", version=fmt.FORMAT_VERSION, holders=None)
        )
        write_durable(os.path.join(staging, fmt.INDEX_NAME), as_directory.index)
        write_durable(os.path.join(staging, fmt.MANIFEST_NAME), as_directory.manifest)
        fsync_tree_dirs(staging)
    logger.info("unpacked %s into %s", src, dst)
    return dst


def materialize(src: str | os.PathLike, dst: str | os.PathLike) -> str:
    """Write the committed checkpoint ``src`` as the self-contained directory checkpoint ``dst``; returns ``dst``.

    An incremental checkpoint's referenced chunks are read from their holders
    and written into ``dst``, which references nothing: it stays loadable
    after its holders are deleted, and can be moved or copied alone. Every
    chunk's checksum is verified on the way; ``dst`` (packing "memmap", the
    layout ``unpack`` writes) appears complete or not at all; ``src`` is never
    modified. Any checkpoint may be materialized (one that references
    nothing is copied). Runs in one process.

    Raises:
        CheckpointNotFoundError: nothing committed is at ``src``.
        CorruptCheckpointError: a chunk of ``src`` or of a holder is missing or damaged, or a holder was replaced.
        TargetError: ``dst`` is a file, a symbolic link or a directory that is not a tddist checkpoint.
    """
    src, dst = target_of(src), os.path.abspath(os.fspath(dst))
    with open_checkpoint(src) as opened:
        return _unpack(opened, dst)


@contextlib.contextmanager
def staged(dst: str) -> Iterator[str]:
    """A fresh staging name beside ``dst``: published onto ``dst`` if the block succeeds, removed if not."""
    staging = fmt.staging_path(dst)
    try:
        yield staging
        publish(staging, dst)
    except BaseException:
        remove_tree(staging)
        raise


def _write(root: str, name: str, data: bytes | memoryview) -> None:
    path = os.path.join(root, name)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    write_durable(path, data)
