"""The one place that chooses the storage: a checkpoint prefix -> its ``Store``.

A prefix names a local directory, a local ``.tdz`` archive (or a directory
saved with ``archive=True``), ``s3://bucket/key`` (a directory on object
storage) or ``s3://bucket/key.tdz`` (an archive there). ``store_for`` maps it
to one ``Store`` object that gives its writer (a ``base.ShardWriter``), its
opened-checkpoint reader (``opened.OpenedCheckpoint``) and its recovery.
``api``, ``arguments``, the save and load pipelines, the tools and the
command line ask it; none of them tests for S3 itself, and no module outside
``storage/s3/`` but this one imports it. A new store is a module in
``storage/`` plus one branch in ``store_for``.

Nothing is imported until it is used: ``tddist ls`` and ``tddist info`` open
manifests without torch, and without boto3 unless a prefix is on S3.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol, cast

from .. import format as fmt
from ..errors import InvalidArgumentError
from .opened import ChunkFiles, OpenedCheckpoint, Pin, validate

if TYPE_CHECKING:
    from ..core.types import LocalShard, SaveOptions
    from ..manifest.merge import MergeCache
    from ..manifest.model import Manifest
    from .archive import ArchiveFiles
    from .base import ShardWriter
    from .directory import DirectoryFiles
    from .pinned import PinnedCheckpoint

#: How a prefix on object storage begins.
S3_SCHEME = "s3://"


class Store(Protocol):
    """Where one checkpoint lives: how it is written, opened and cleaned up.

    Call order: a save asks ``check_save`` (every rank, before any
    collective), then ``writer`` (every rank; the commit drives it, see
    ``base.ShardWriter``), then ``open_saved`` with that writer (every rank,
    once the commit is announced). A load asks ``open`` (every rank; see
    ``opened`` for what follows). ``recover`` runs alone, when no save to the
    target is in flight.
    """

    @property
    def target(self) -> str:
        """The normalised prefix: an absolute path, or the ``s3://`` URL without a trailing "/"."""
        ...

    @property
    def archive(self) -> bool:
        """One zip archive, else a directory tree."""
        ...

    @property
    def streams(self) -> bool:
        """Whether a save may write the packed data file slot by slot while the snapshot is still copied."""
        ...

    def check_save(self, *, atomic: bool, archive: bool | None, snapshot_budget: int | None, async_writer: str) -> None:
        """Refuse (``InvalidArgumentError``) options this store cannot honour."""
        ...

    def writer(self, options: SaveOptions, rank: int, shard: LocalShard | Exception, cache: MergeCache) -> ShardWriter:
        """This rank's writer of one save to this store."""
        ...

    def open(self) -> OpenedCheckpoint:
        """Pin the committed checkpoint's generation and read its validated manifest."""
        ...

    def files(self, pin: Pin) -> ChunkFiles:
        """The reader of ``pin``'s chunks (``OpenedCheckpoint.files``; imports torch)."""
        ...

    def open_saved(self, writer: ShardWriter) -> OpenedCheckpoint:
        """Open the checkpoint ``writer`` just committed (a store may read this rank's own bytes from memory)."""
        ...

    def recover(self) -> list[str]:
        """Remove what interrupted saves left at this target; one line per leftover handled."""
        ...


@dataclass(frozen=True)
class FileStore:
    """A checkpoint on a file system: a directory tree (``directory``) or one zip archive (``archive``)."""

    target: str
    archive: bool

    @property
    def streams(self) -> bool:
        return not self.archive

    def check_save(self, *, atomic: bool, archive: bool | None, snapshot_budget: int | None, async_writer: str) -> None:
        """Every option works on a file system (``arguments`` checks the container's own limits)."""

    def writer(self, options: SaveOptions, rank: int, shard: LocalShard | Exception, cache: MergeCache) -> ShardWriter:
        if self.archive:
            from .archive import ArchiveWriter

            return ArchiveWriter(options, rank, shard, cache)
        from .directory import DirectoryWriter

        return DirectoryWriter(options, rank, shard, cache)

    def open(self) -> OpenedCheckpoint:
        from .pinned import open_local

        return validate(open_local(self.target), self.files)

    def files(self, pin: Pin) -> ChunkFiles:
        return local_files(cast("PinnedCheckpoint", pin))

    def open_saved(self, writer: ShardWriter) -> OpenedCheckpoint:
        return self.open()

    def recover(self) -> list[str]:
        from .recovery import recover

        return recover(self.target)


@dataclass(frozen=True)
class ObjectStore:
    """A checkpoint on S3-compatible object storage: objects under ``key/``, or one ``key.tdz`` object.

    The key's suffix decides the container; writes are always atomic (a
    manifest object names its data generation, an archive is completed by
    one multipart upload). See docs/object_storage.md.
    """

    target: str
    archive: bool
    streams = False

    def check_save(self, *, atomic: bool, archive: bool | None, snapshot_budget: int | None, async_writer: str) -> None:
        if not atomic:
            raise InvalidArgumentError(
                f"atomic=False is not supported on object storage ({self.target!r}): a save there is always "
                f"atomic; drop it"
            )
        if archive is not None and archive != self.archive:
            raise InvalidArgumentError(
                f"{self.target!r}: on object storage the key's suffix decides the layout (an archive ends in "
                f"{fmt.ARCHIVE_SUFFIX}, a directory does not); drop archive= or change the key"
            )
        if snapshot_budget is not None or async_writer != "thread":
            raise InvalidArgumentError(
                f"{self.target!r}: snapshot_budget and async_writer='process' are for file systems; on object "
                f"storage use return_early=True alone"
            )
        from .s3.client import s3_client

        s3_client()  # raises the error that says how to install boto3, on every rank before any collective

    def writer(self, options: SaveOptions, rank: int, shard: LocalShard | Exception, cache: MergeCache) -> ShardWriter:
        if self.archive:
            from .s3.archive import S3ArchiveWriter

            return S3ArchiveWriter(options, rank, shard, cache)
        from .s3.directory import S3DirectoryWriter

        return S3DirectoryWriter(options, rank, shard, cache)

    def open(self) -> OpenedCheckpoint:
        from .s3.pin import open_s3

        return validate(open_s3(self.target), self.files)

    def files(self, pin: Pin) -> ChunkFiles:
        """Ranged GETs of the pinned generation's objects, in parallel (``s3.files.S3Files``)."""
        from .s3.files import S3Files
        from .s3.pin import S3Pin

        return S3Files(cast(S3Pin, pin))

    def open_saved(self, writer: ShardWriter) -> OpenedCheckpoint:
        """Open it, reading back from memory what this rank uploaded instead of downloading it again."""
        from .s3.pin import S3Pin

        opened = self.open()
        uploaded = getattr(writer, "uploaded", None)
        if uploaded is not None:
            cast(S3Pin, opened.pin).local = uploaded
        return opened

    def recover(self) -> list[str]:
        from .s3.recovery import recover

        return recover(self.target)


def store_for(prefix: str | os.PathLike, archive: bool | None = None) -> Store:
    """The store of the checkpoint at ``prefix``.

    Args:
        prefix: a directory, a ``.tdz`` path, ``s3://bucket/key`` or ``s3://bucket/key.tdz``.
        archive: for a save, ``save(archive=...)``: None infers it from the
            ``.tdz`` suffix. A load finds out what is at a local path by
            itself (a directory or an archive file), whatever this says.

    Raises:
        InvalidArgumentError: an ``s3://`` URL that cannot name a checkpoint.
    """
    p = os.fspath(prefix)
    if isinstance(p, str) and p.startswith(S3_SCHEME):
        from .s3.url import parse

        url = parse(p)  # refuses a URL that cannot name a checkpoint
        return ObjectStore(url.url, url.archive)
    target = os.path.abspath(p)
    return FileStore(target, target.endswith(fmt.ARCHIVE_SUFFIX) if archive is None else archive)


def target_of(prefix: str | os.PathLike) -> str:
    """The checkpoint's location: an ``s3://`` URL as given (without a trailing "/"), else an absolute path."""
    return store_for(prefix).target


def open_checkpoint(prefix: str | os.PathLike) -> OpenedCheckpoint:
    """Open the committed checkpoint at ``prefix`` once (its store's ``open``) and read its manifest.

    Raises:
        CheckpointNotFoundError: nothing committed is at ``prefix``.
        ManifestError: the manifest is not valid JSON, fails its checksum or its validation.
        CorruptCheckpointError: an archive that is not a readable zip file.
        StorageError: the storage failed (an I/O error, an unreachable endpoint).
    """
    return store_for(prefix).open()


def read_manifest(prefix: str | os.PathLike) -> Manifest:
    """Read and validate the manifest of the committed checkpoint at ``prefix``; no tensor data is read.

    Raises:
        CheckpointNotFoundError: nothing committed is at ``prefix``.
        ManifestError: the manifest is not valid JSON, fails its checksum or its validation.
        CorruptCheckpointError: an archive that is not a readable zip file.
    """
    with open_checkpoint(prefix) as opened:
        return opened.manifest


def recover(prefix: str | os.PathLike) -> list[str]:
    """Remove leftovers of interrupted saves at ``prefix`` (its store's ``recover``)."""
    return store_for(prefix).recover()


def local_files(checkpoint: str | OpenedCheckpoint | PinnedCheckpoint) -> ArchiveFiles | DirectoryFiles:
    """The files of a checkpoint on this file system: ``ArchiveFiles`` for an archive, else ``DirectoryFiles``.

    Opened (or pinned), they are read through the pinned descriptor, so they
    belong to the generation the manifest describes; a path is opened as it
    is now. For the tools that work on files (``verify``, ``pack``) and the
    file store's reader; a load reads any store through ``files()``.

    Raises:
        InvalidArgumentError: the checkpoint is not on a file system.
    """
    from .archive import ArchiveFiles
    from .directory import DirectoryFiles
    from .pinned import PinnedCheckpoint

    if isinstance(checkpoint, str):
        return ArchiveFiles(checkpoint) if os.path.isfile(checkpoint) else DirectoryFiles(checkpoint)
    pin = checkpoint.pin if isinstance(checkpoint, OpenedCheckpoint) else checkpoint
    if not isinstance(pin, PinnedCheckpoint):
        raise InvalidArgumentError(f"{pin.path!r} is on object storage, which this operation does not support")
    if pin.archive:
        return ArchiveFiles(pin.path, opened_as=pin.fd_path, entries=pin.zip_entries)
    return DirectoryFiles(pin.path, pin)
