"""The directory store on a file system: a checkpoint directory with one directory per rank.

Each rank directory keeps tensordict's memmap layout (``<key>.memmap`` files
plus a ``meta.json`` per node), written by ``writer.write_shard``. Rank 0
writes the manifest last, then the staging directory replaces the target
(``publish``). With ``atomic=False`` the ranks write into the target itself;
the manifest is still written last, so an interrupted save leaves a directory
that readers refuse instead of misread.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import stat
import weakref
from collections.abc import Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from functools import partial

import numpy as np
import torch

from .. import format as fmt
from .._faults import fault_point
from .._fs import (
    drop_pages,
    fsync_path,
    fsync_together,
    in_background,
    makedirs_durable,
    makedirs_top,
    read_into_page_cache,
    remove_tree,
    sync_created,
    write_all,
)
from ..core.types import Fragment, ManifestFiles, SavePlan, Staging
from ..errors import CorruptCheckpointError, TargetError
from ..manifest.locate import ChunkRange, FileSpan, Location
from .base import WriterBase, map_copy_on_write
from .incremental import check_holders, eligible_base, identity_columns, read_base, write_packed_incremental
from .pinned import PinnedCheckpoint
from .pins import pin, unpin
from .publish import discard, swap_in
from .recovery import is_tddist_dir
from .writer import write_packed, write_shard

logger = logging.getLogger(__name__)


def check_target(target: str) -> bool:
    """Refuse directory targets tddist must not replace; return whether one exists."""
    if os.path.islink(target):
        raise TargetError(f"target {target!r} is a symbolic link; pass the real path or another target")
    if os.path.isfile(target):
        raise TargetError(
            f"target {target!r} is an existing file, not a checkpoint directory; choose another path "
            f"(it was left untouched)"
        )
    if not os.path.exists(target):
        return False
    if not os.path.isdir(target):
        raise TargetError(f"target {target!r} exists and is not a directory; choose another path")
    if not is_tddist_dir(target):
        raise TargetError(
            f"target {target!r} is a non-empty directory that is not a tddist checkpoint; tddist never "
            f"deletes foreign data: choose another path or empty it yourself"
        )
    return True


class DirectoryWriter(WriterBase):
    """One rank's side of a directory save (a ``base.ShardWriter``)."""

    container = "directory"
    #: (rank 0 of an atomic save) the manifest's files, created empty before this rank's data (``_ManifestFiles``)
    manifest_files: _ManifestFiles | None = None

    @property
    def stages_alone(self) -> bool:
        """An atomic save's staging directory needs nothing from rank 0 first: any rank may create it."""
        return self.options.atomic

    def plan(self) -> SavePlan:
        return self.make_plan()

    def stage(self, path: str) -> str | None:
        created = makedirs_top(os.path.dirname(os.path.abspath(self.target)))
        try:
            os.mkdir(path)
        except FileExistsError:  # another rank was first
            pass
        return created

    def check_staged(self, created: str | None) -> None:
        check_target(self.target)
        if created is not None:
            sync_created(created, os.path.dirname(os.path.abspath(self.target)))

    def open(self, plans: list[SavePlan]) -> Staging:
        parent = os.path.dirname(os.path.abspath(self.target))
        makedirs_durable(parent)
        exists = check_target(self.target)
        if self.options.atomic:
            staging = fmt.staging_path(self.target)
            os.mkdir(staging)
            return Staging(staging)
        if exists:
            manifest = os.path.join(self.target, fmt.MANIFEST_NAME)
            if os.path.exists(manifest):
                os.unlink(manifest)  # the old data stops being trusted first
                fsync_path(self.target)
            for name in os.listdir(self.target):
                remove_tree(os.path.join(self.target, name))
        else:
            os.makedirs(self.target)
        fsync_path(parent)
        return Staging(os.path.abspath(self.target))

    def write(self, staging: Staging) -> Fragment:
        self.check_reference(staging)
        o, shard = self.options, self.local_shard()
        if self.rank == 0 and o.atomic:
            self.manifest_files = _ManifestFiles.create(staging.path)
        if o.packing == "packed" and o.base is not None:
            return self.write_incremental(staging, o.base)
        if o.packing == "packed":
            data = os.path.join(staging.path, fmt.rank_data_name(self.rank))
            stored = write_packed(data, shard.items, o.num_threads, self.rank)
        else:
            stored = write_shard(staging.path, self.rank, shard, o.robust_key, o.num_threads)
        return self.fragment(stored)

    def write_incremental(self, staging: Staging, base: str) -> Fragment:
        """An incremental save's write: the chunks equal to the base's are referenced, the others written."""
        items = self.local_shard().items
        if self.rank == 0 and eligible_base(base, self.target) is None:
            self.pins.append(pin(base))  # before this rank decides; checked again before the commit
        view = read_base(base, self.target, self.rank, items)
        if self.rank == 0 and view is not None:
            self.pins += [pin(fmt.holder_path(self.target, h.name)) for h in view.table[1:]]
        fault_point("pin", self.rank)
        data = os.path.join(staging.path, fmt.rank_data_name(self.rank))
        done = write_packed_incremental(
            data, items, self.rank, view, self.options.reuse_hashes, self.options.num_threads
        )
        logger.debug("rank %d: wrote %d bytes, referenced the rest of %s", self.rank, done.written, base)
        fragment = self.fragment(done.stored)
        return dataclasses.replace(
            fragment,
            holders=np.asarray([done.holders.get(i.key, 0) for i in items], dtype="<i8").tobytes(),
            ids=identity_columns([done.ids.get(i.key, 0) for i in items]),
            base=None if view is None else view.table,
        )

    def finalize(self, staging: Staging, manifest: ManifestFiles, fragments: list[Fragment]) -> None:
        for table in {f.base for f in fragments if f.base is not None}:
            check_holders(self.target, table)  # pinned: what is there now stays until the commit
        files, self.manifest_files = self.manifest_files, None
        if files is None or files.staging != staging.path:  # not created ahead (``atomic=False``): now, here
            files = _ManifestFiles.create_now(staging.path)
        try:
            index, written = files.descriptors()
            write_all(index, manifest.index)
            write_all(written, manifest.manifest)
            fsync_together([index, written, staging.path])  # the rename (publish) follows all three
        finally:
            files.close()

    def publish(self, staging: Staging) -> None:
        if self.options.atomic:
            self.replaced = swap_in(staging.path, self.target)
        else:
            fsync_path(os.path.dirname(os.path.abspath(self.target)))
        unpin(self.pins)  # committed: the manifest references the holders now
        self.pins = []
        fault_point("unpin", self.rank)

    def abort(self, staging: Staging) -> None:
        if self.manifest_files is not None:
            self.manifest_files.close()
            self.manifest_files = None
        unpin(self.pins)
        self.pins = []
        # A torn non-atomic target has no manifest: readers refuse it. A staging area can be absent: another
        # rank of a one-round save removed it first, or this rank never created it.
        if self.options.atomic and os.path.lexists(staging.path):
            discard(staging.path)


@dataclass(frozen=True)
class _ManifestFiles:
    """(rank 0) The manifest's two files in a staging directory, created empty and held open until written.

    Rank 0 creates them while it writes its data, not when it decides: a
    file created while the ranks' fsyncs commit the file system's journal
    waits for that commit (about a millisecond each on ext4), and the
    decision is the one step no rank can overlap. They are created on a
    helper thread (``_fs.in_background``): created first on rank 0's own
    thread, they delayed its data, the last vote, by about a millisecond
    where the ranks create their files in the staging directory at once.
    Created in the staging directory, they are never read before the rename
    publishes them written.
    """

    staging: str
    created: Future[tuple[int, int]]  # the index's and the manifest's descriptors

    @classmethod
    def create(cls, staging: str) -> _ManifestFiles:
        return cls(staging, in_background(partial(_create_manifest_files, staging)))

    @classmethod
    def create_now(cls, staging: str) -> _ManifestFiles:
        """Created on the caller's thread, for a caller that needs them at once (no thread to hand over to)."""
        created: Future[tuple[int, int]] = Future()
        created.set_result(_create_manifest_files(staging))
        return cls(staging, created)

    def descriptors(self) -> tuple[int, int]:
        """The index's and the manifest's descriptors, once created (raises the creation's error)."""
        return self.created.result()

    def close(self) -> None:
        try:
            fds = self.created.result()
        except Exception:  # never created: nothing to close (``descriptors`` raised what failed, if anyone asked)
            return
        for fd in fds:
            try:
                os.close(fd)
            except OSError:  # closing a file written and fsynced, or one about to be removed: nothing is lost
                pass


def _create_manifest_files(staging: str) -> tuple[int, int]:
    """``tddist.idx`` and ``tddist.json`` created empty in ``staging``; their descriptors."""
    flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | getattr(os, "O_CLOEXEC", 0)
    index = os.open(os.path.join(staging, fmt.INDEX_NAME), flags, 0o644)
    try:
        return index, os.open(os.path.join(staging, fmt.MANIFEST_NAME), flags, 0o644)
    except BaseException:
        os.close(index)
        raise


class DirectoryFiles:
    """The files of a committed directory checkpoint, each mapped copy-on-write (``MAP_PRIVATE``); an
    ``opened.ChunkFiles``.

    Every file is opened through the pinned directory descriptor (see
    ``pinned.py``): one generation is read whole even while an overwrite
    replaces the checkpoint, and no name can lead outside it.
    """

    def __init__(self, root: str, pin: PinnedCheckpoint | None = None):
        self.root = root
        self.pin = pin if pin is not None else PinnedCheckpoint(root)  # kept open while this object lives
        self._maps: dict[str, torch.Tensor] = {}
        # Every file this object mapped, by address, while its map lives (``release`` drops pages of those
        # only: an address freed and reused by anonymous memory would read back as zeros).
        self._mapped: dict[int, weakref.ref[torch.Tensor]] = {}

    fetches_ahead = False
    shares_pages = True

    def prefetch(self, ranges: Sequence[ChunkRange], num_threads: int) -> None:
        """Nothing to fetch ahead: files are mapped."""

    def warm(self, spans: Sequence[FileSpan]) -> None:
        """Read ``spans`` into the node's page cache, each file opened through the pin (``read_into_page_cache``:
        mapped nowhere once read). A file that is missing, not a regular file or shorter than the spans is left
        to ``span``, which says what is wrong with it."""
        by_file: dict[str, list[FileSpan]] = {}
        for s in spans:
            by_file.setdefault(s.relpath, []).append(s)
        for rel, parts in by_file.items():
            fd = self.pin.open_file(rel)
            if fd is None:
                continue
            try:
                st = os.fstat(fd)
                for p in parts if stat.S_ISREG(st.st_mode) else ():
                    read_into_page_cache(fd, p.start, min(p.stop, st.st_size))
            finally:
                os.close(fd)

    def span(self, loc: Location) -> torch.Tensor:
        """A chunk's bytes: a view of its file's copy-on-write map (each file is mapped once)."""
        if loc.nbytes == loc.file_size:
            return self._mapped_file(loc.relpath, loc.nbytes)
        whole = self._maps.get(loc.relpath)
        if whole is None:
            whole = self._maps[loc.relpath] = self._mapped_file(loc.relpath, loc.file_size)
        return whole[loc.offset : loc.offset + loc.nbytes]

    def _mapped_file(self, rel: str, nbytes: int) -> torch.Tensor:
        """``array``, remembered for ``release`` while the map lives."""
        t = self.array(rel, nbytes)
        if nbytes:
            self._mapped[t.untyped_storage().data_ptr()] = weakref.ref(t)
        return t

    def release(self, span: torch.Tensor) -> None:
        """Drop the pages of a chunk inside a mapped data file (a chunk that is its own file is unmapped when
        its last tensor goes)."""
        ref = self._mapped.get(span.untyped_storage().data_ptr()) if span.numel() else None
        if ref is not None and ref() is not None:
            drop_pages(span.data_ptr(), span.numel() * span.element_size())  # a map of a file nobody writes to

    def array(self, rel: str, nbytes: int) -> torch.Tensor:
        """The file's bytes as a uint8 tensor mapped copy-on-write (no file descriptor stays open)."""
        path = os.path.join(self.root, rel)
        fd = self.pin.open_file(rel)
        if fd is None:
            raise self.pin.missing(rel, "file")
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                raise CorruptCheckpointError(f"{path!r} is not a regular file; refusing it")
            if st.st_size != nbytes:
                raise CorruptCheckpointError(
                    f"file {path!r} has {st.st_size} bytes, the manifest says {nbytes}; the checkpoint is damaged or "
                    f"truncated"
                )
            # the descriptor's own inode, whatever is at ``path`` now
            return map_copy_on_write(f"/proc/self/fd/{fd}", nbytes)
        finally:
            os.close(fd)
