"""The archive store on a file system: one zip file for the whole checkpoint, whose entries are exactly the directory tree.

Every rank prepares (hashes and, if asked, compresses) its entries in memory
and reports the size of its region (``plan``); rank 0 creates the staging
file and reserves every region at once (``open``); each rank writes its
local headers and payloads into its own region with positioned writes from
several threads (``write``); rank 0 writes the manifest entry and the central
directory (``finalize``), then the staging file replaces the target
(``publish``). The zip details are in ``zipcodec``.
"""

from __future__ import annotations

import os
import re
import stat
import zipfile
from collections.abc import Sequence

import numpy as np
import torch

from .. import format as fmt
from .._fs import drop_pages, makedirs_durable
from ..checksum import EMPTY, combine_digests
from ..core.finite import counter_for
from ..core.types import Compression, Fragment, Key, ManifestFiles, SavePlan, Staging, StoredBytes
from ..errors import CorruptCheckpointError, TargetError
from ..manifest.locate import ChunkRange, FileSpan, Location
from ..manifest.parse import paused_gc
from .base import WriterBase, map_copy_on_write
from .pinned import storage_failed
from .publish import discard, swap_in
from .recovery import is_tddist_archive
from .tdmeta import node_meta_files
from .zipcodec import (
    ALIGN,
    LOCAL_SIZE,
    Entry,
    EntryReader,
    check_compressed_entry,
    entry_rows,
    inflate_into,
    place_entries,
    prepare_entries,
    write_region,
    write_tail_and_directory,
)


def _central_directory(path: str, source: str) -> list[zipfile.ZipInfo]:
    """The entries of the archive ``source`` (named ``path`` in errors), as zipfile reads its central directory."""
    try:
        with paused_gc(), zipfile.ZipFile(source) as zf:
            return zf.infolist()
    except OSError as e:
        raise storage_failed(path, e) from e
    except (zipfile.BadZipFile, ValueError, EOFError, NotImplementedError) as e:  # "zip file version"
        raise CorruptCheckpointError(
            f"{path!r} is not a readable zip archive ({e}); the checkpoint is damaged"
        ) from None


def check_archive_target(target: str) -> bool:
    """Refuse archive targets tddist must not replace; return whether one exists."""
    if os.path.islink(target):
        raise TargetError(f"archive target {target!r} is a symbolic link; pass the real path or another target")
    if os.path.isdir(target):
        raise TargetError(f"archive target {target!r} is a directory; choose a file path (ending in .tdz)")
    if not os.path.exists(target):
        return False
    if not is_tddist_archive(target):
        raise TargetError(
            f"archive target {target!r} exists and is not a tddist archive; tddist never deletes foreign data: "
            f"choose another path or remove it yourself"
        )
    return True


class ArchiveWriter(WriterBase):
    """One rank's side of an archive save (a ``base.ShardWriter``)."""

    #: Where the first rank's region starts. Only tests change it: a large
    #: value leaves a sparse hole, so zip64 offsets beyond 4 GiB are checked
    #: without writing 4 GiB.
    first_region_offset = 0

    container = "archive"
    entries: list[Entry]
    names: dict[Key, str]

    def plan(self) -> SavePlan:
        """Hash and compress this rank's entries; the plan carries the bytes its region needs."""
        o, shard = self.options, self.local_shard()
        written = shard.written()
        files = node_meta_files(self.rank, shard, o.robust_key)
        self.names = {k: fmt.leaf_relpath(self.rank, k, o.robust_key) for k, t in written.items() if t.numel()}
        leaves = {self.names[k]: written[k] for k in self.names}
        compression = o.compression or Compression(zipfile.ZIP_STORED)
        self.entries = prepare_entries(files, leaves, compression, o.num_threads)
        return self.make_plan(place_entries(self.entries, 0))

    def open(self, plans: list[SavePlan]) -> Staging:
        """Create the staging file beside the target and reserve every rank's region in it."""
        makedirs_durable(os.path.dirname(os.path.abspath(self.target)))
        check_archive_target(self.target)
        staging = fmt.staging_path(self.target)
        base = self.first_region_offset - self.first_region_offset % ALIGN
        starts, end = [], base
        for p in plans:
            starts.append(end)
            end += p.region_bytes
        os.close(os.open(staging, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644))
        try:
            self._reserve(staging, base, end)
        except OSError:
            discard(staging)
            raise
        return Staging(staging, tuple(starts), end)

    @staticmethod
    def _reserve(staging: str, start: int, end: int) -> None:
        """Allocate ``[start, end)`` of the staging file, so a full disk fails here, before any rank writes."""
        if end > start:
            fd = os.open(staging, os.O_WRONLY)
            try:
                os.posix_fallocate(fd, start, end - start)
            finally:
                os.close(fd)

    def write(self, staging: Staging) -> Fragment:
        """Write this rank's entries into its region; fsync."""
        self.check_reference(staging)
        place_entries(self.entries, staging.region_start(self.rank))
        write_region(staging.path, self.entries, self.options.num_threads, self.rank)
        return self.entries_fragment()

    def entries_fragment(self) -> Fragment:
        """This rank's vote: each written leaf's stored size and checksum (from its entry), and the entry rows."""
        by_name = {e.name: e for e in self.entries}
        stored = {}
        for key, t in self.local_shard().written().items():
            e = by_name.get(self.names.get(key, ""))
            if e is None:  # no elements, no entry
                counter = counter_for(fmt.dtype_name(t.dtype))
                stored[key] = StoredBytes(0, EMPTY, None if counter is None else counter.result())
            else:
                stats = None if e.counter is None else e.counter.result()
                stored[key] = StoredBytes(len(e.data), combine_digests(e.digests), stats)
        return self.fragment(stored, entry_rows(self.entries))

    def finalize(self, staging: Staging, manifest: ManifestFiles, fragments: list[Fragment]) -> None:
        rows = [row for f in fragments for row in f.entries]
        tail = {fmt.INDEX_NAME: manifest.index, fmt.MANIFEST_NAME: manifest.manifest}
        write_tail_and_directory(staging.path, staging.end, tail, rows)

    def publish(self, staging: Staging) -> None:
        self.replaced = swap_in(staging.path, self.target)

    def abort(self, staging: Staging) -> None:
        discard(staging.path)


#: What an entry's name may not have: a leading "/", a backslash, a NUL, or an empty, "." or ".." component.
_BAD_NAME = re.compile(r"^/|\\|\x00|(?:^|/)\.{0,2}(?:/|$)")


class ArchiveFiles:
    """The entries of a committed archive, validated, read from one memory map (an ``opened.ChunkFiles``)."""

    def __init__(self, path: str, opened_as: str | None = None, entries: list[zipfile.ZipInfo] | None = None):
        """Open the archive ``path``; ``opened_as`` opens the same file pinned (``/proc/self/fd/N``), whose
        central directory ``entries`` the pin has already read (else it is read here)."""
        self.path = self.root = path
        self.source = source = opened_as or path
        if entries is None:
            entries = _central_directory(path, source)
        try:
            size = os.path.getsize(source)
            self.tensor = map_copy_on_write(source, size) if size else torch.empty(0, dtype=torch.uint8)
        except OSError as e:  # EIO after a power loss: the storage failed, not the checkpoint
            raise storage_failed(path, e) from e
        self.map = self.tensor.numpy()
        self.entries: dict[str, tuple[int, zipfile.ZipInfo]] = {}
        with paused_gc():  # one tuple per entry: see paused_gc
            self._check_names(entries)
            starts = self._check_places(entries, size)
            self.entries = dict(zip([zi.filename for zi in entries], zip(starts.tolist(), entries)))

    def _check_names(self, infos: list[zipfile.ZipInfo]) -> None:
        """Every name stays inside the root and is listed once; no entry is a symbolic link."""
        for zi in infos:
            name = zi.filename
            if _BAD_NAME.search(name) is not None:
                raise CorruptCheckpointError(
                    f"archive {self.path!r} has an entry named {name!r} that escapes its root; refusing it"
                )
            if stat.S_ISLNK(zi.external_attr >> 16):
                raise CorruptCheckpointError(f"archive {self.path!r} has a symbolic-link entry {name!r}; refusing it")
        names = [zi.filename for zi in infos]
        if len(set(names)) != len(names):
            seen: set[str] = set()
            twice = next(n for n in names if n in seen or seen.add(n))  # type: ignore[func-returns-value]
            raise CorruptCheckpointError(f"archive {self.path!r} lists entry {twice!r} twice; refusing it")

    def _check_places(self, infos: list[zipfile.ZipInfo], size: int) -> np.ndarray:
        """Where each entry's data starts, once every local header is where the central directory says, every
        entry lies inside the file and no two overlap: checked for all entries at once, in numpy."""
        path, n = self.path, len(infos)
        offsets = np.fromiter((zi.header_offset for zi in infos), np.int64, n)
        stored = np.fromiter((zi.compress_size for zi in infos), np.int64, n)
        past = np.flatnonzero(offsets + LOCAL_SIZE > size)
        if len(past):
            name = infos[int(past[0])].filename
            raise CorruptCheckpointError(f"archive {path!r}: entry {name!r} has a header past the end of the file")
        head = self.map[offsets[:, None] + np.arange(LOCAL_SIZE)]  # every local header, one row each
        bad = np.flatnonzero((head[:, :4] != np.frombuffer(b"PK\x03\x04", np.uint8)).any(axis=1))
        if len(bad):
            name = infos[int(bad[0])].filename
            raise CorruptCheckpointError(f"archive {path!r}: entry {name!r} has a bad local header offset")
        lengths = head[:, LOCAL_SIZE - 4 :].astype(np.int64)  # the name's and the extra field's lengths
        starts = offsets + LOCAL_SIZE + lengths[:, 0] + (lengths[:, 1] << 8) + lengths[:, 2] + (lengths[:, 3] << 8)
        ends = starts + stored
        beyond = np.flatnonzero(ends > size)
        if len(beyond):
            name = infos[int(beyond[0])].filename
            raise CorruptCheckpointError(
                f"archive {path!r}: entry {name!r} extends past the end of the file (truncated?)"
            )
        order = np.argsort(offsets, kind="stable")
        clash = np.flatnonzero(offsets[order][1:] < ends[order][:-1])
        if len(clash):
            a, b = infos[int(order[clash[0]])].filename, infos[int(order[clash[0] + 1])].filename
            raise CorruptCheckpointError(f"archive {path!r}: entries {a!r} and {b!r} overlap; refusing it")
        return starts

    fetches_ahead = False
    shares_pages = False  # spans name entries of the archive, not files (a node's ranks map it on demand)

    def prefetch(self, ranges: Sequence[ChunkRange], num_threads: int) -> None:
        """Nothing to fetch ahead: the archive is mapped."""

    def warm(self, spans: Sequence[FileSpan]) -> None:
        """Nothing shared to warm: the archive's ranks map it on demand."""

    def span(self, loc: Location) -> torch.Tensor:
        """A chunk's bytes (archives hold one entry per chunk)."""
        return self.array(loc.relpath, loc.nbytes)

    def release(self, span: torch.Tensor) -> None:
        """Drop the pages of a stored entry from the archive's map (an inflated or realigned copy is anonymous
        memory, freed with its tensor)."""
        if span.numel() and self.tensor.numel() and span.untyped_storage().data_ptr() == self.tensor.data_ptr():
            drop_pages(span.data_ptr(), span.numel() * span.element_size())

    def array(self, name: str, nbytes: int) -> torch.Tensor:
        """The uncompressed bytes of ``name`` as uint8: a view of the map when stored, else decompressed.

        A compressed entry is checked first (its sizes against the manifest's
        ``nbytes``, its method, its bounds in the file); only then is its
        buffer allocated, and the stream inflated into it block by block.
        """
        found = self.entries.get(name)
        if found is None:
            raise CorruptCheckpointError(f"archive {self.path!r} has no entry {name!r}; the checkpoint is damaged")
        start, zi = found
        if zi.file_size != nbytes:
            raise CorruptCheckpointError(
                f"archive {self.path!r}: entry {name!r} declares {zi.file_size} bytes, the manifest says {nbytes}"
            )
        if zi.compress_type == zipfile.ZIP_STORED:
            if zi.compress_size != nbytes:
                raise CorruptCheckpointError(f"archive {self.path!r}: stored entry {name!r} has inconsistent sizes")
            view = self.tensor[start : start + nbytes]
            return view if start % ALIGN == 0 else view.clone()  # rewritten by another zip tool: unaligned
        where = f"{self.path!r}: entry {name!r}"
        check_compressed_entry(zi.compress_type, zi.compress_size, nbytes, where)
        out = torch.empty(nbytes, dtype=torch.uint8)  # only now: its size is the manifest's, its bounds checked
        fd = os.open(self.source, os.O_RDONLY)
        try:
            crc = inflate_into(zi.compress_type, EntryReader(fd, start, zi.compress_size), out.numpy().data, where)
        finally:
            os.close(fd)
        if crc != zi.CRC:  # a damaged stream may still decompress, to other bytes
            raise CorruptCheckpointError(
                f"archive {where} decompresses to bytes that fail its CRC-32; the checkpoint is damaged"
            )
        return out
