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

A directory of checkpoints (a ``CheckpointManager``'s root) is a ``Root``
(``roots.Root``): ``root_for`` maps a directory to ``roots.FileRoot`` and
``s3://bucket/prefix`` to ``ObjectRoot``; each checkpoint under it is the
``Store`` of ``root.join(name)``, which says whether it is committed and
removes it (``Store.committed``, ``Store.delete``).

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
from .roots import LOCK_NAME, FileRoot, HeldLock, Leftover, Root, Usage

if TYPE_CHECKING:
    from ..core.types import LocalShard, SaveOptions, Staging
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
    ``base.ShardWriter``), ``pin_staging`` once the commit's first round
    named the staging area (every rank, before it votes), then
    ``open_saved`` with that writer and pin (every rank, once the commit is
    announced; a rank that reads back only the rows it wrote itself asks
    ``files`` of that pin instead, once it has voted). A load asks ``open``
    (every rank; see ``opened`` for what follows). ``recover`` runs alone,
    when no save to the target is in flight.
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

    def pin_staging(self, staging: Staging) -> Pin | None:
        """Pin the staging area a save writes, before it is published, so the save reads back exactly what it
        committed even if another save replaces it at once (None: this store cannot pin it; the save then
        compares generations, ``open_saved``)."""
        ...

    def open_saved(self, writer: ShardWriter | None, pin: Pin | None) -> OpenedCheckpoint:
        """Open the checkpoint ``writer`` just committed: through ``pin`` when there is one, else by name (then
        it may be another save's by now: the caller compares generations). A store may read this rank's own
        bytes from memory."""
        ...

    def recover(self) -> list[str]:
        """Remove what interrupted saves left at this target; one line per leftover handled."""
        ...

    def committed(self) -> bool:
        """Whether a checkpoint is committed here (its commit point exists; the manifest is not validated)."""
        ...

    def delete(self) -> None:
        """Remove the checkpoint here, so that a crash midway never leaves it looking committed.

        Raises:
            OSError: a file-system operation failed.
            StorageError: a request to object storage failed.
        """
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

    def pin_staging(self, staging: Staging) -> Pin | None:
        """The staging directory or archive file, opened (it becomes the target when it is published) and held
        against removal by a concurrent save until the save has read it back (``hold_off_removal``)."""
        from .pinned import PinnedCheckpoint

        pin = PinnedCheckpoint(self.target, opened_as=staging.path)
        pin.hold_off_removal()
        return pin

    def open_saved(self, writer: ShardWriter | None, pin: Pin | None) -> OpenedCheckpoint:
        if pin is None:
            return self.open()
        from .pinned import pin_and_read

        return validate(pin_and_read(cast("PinnedCheckpoint", pin)), self.files)

    def recover(self) -> list[str]:
        from .recovery import recover

        return recover(self.target)

    def committed(self) -> bool:
        from .recovery import is_committed

        return is_committed(self.target)

    def delete(self) -> None:
        """Renamed to a trash name in one step, then removed (``recover`` removes a half-deleted one)."""
        from .roots import remove_checkpoint

        remove_checkpoint(self.target)


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
        from .s3.pin import open_s3, place_kept

        return place_kept(validate(open_s3(self.target), self.files))

    def files(self, pin: Pin) -> ChunkFiles:
        """Ranged GETs of the pinned generation's objects, in parallel (``s3.files.S3Files``)."""
        from .s3.files import S3Files
        from .s3.pin import S3Pin

        return S3Files(cast(S3Pin, pin))

    def pin_staging(self, staging: Staging) -> Pin | None:
        """Nothing to pin: objects have no descriptors; the save compares generations instead."""
        return None

    def open_saved(self, writer: ShardWriter | None, pin: Pin | None) -> OpenedCheckpoint:
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

    def committed(self) -> bool:
        from .s3.root import committed

        return committed(self.target)

    def delete(self) -> None:
        """A directory's manifest first (uncommitted at once), then its objects; an archive's one object."""
        from .s3.root import delete

        delete(self.target)


@dataclass(frozen=True)
class ObjectRoot:
    """A root on object storage, ``s3://bucket/prefix`` (a ``roots.Root``; see ``s3/root.py``, ``s3/lease.py``)."""

    target: str
    local = False

    def join(self, name: str) -> str:
        return f"{self.target}/{name}"

    def exists(self) -> bool:
        from .s3.root import exists

        return exists(self.target)

    def create(self) -> None:
        """Nothing: a prefix exists through its objects."""

    def names(self) -> list[str]:
        from .s3.root import names

        return names(self.target)

    def partial(self, name: str) -> bool | None:
        if self.join(name).endswith(fmt.ARCHIVE_SUFFIX):
            return None
        from .s3.root import partial

        return partial(self.join(name))

    def usage(self, name: str) -> Usage:
        from .s3.root import usage

        return usage(self.join(name))

    def leftovers(self, name: str) -> tuple[Leftover, ...]:
        from .s3.root import leftovers

        return leftovers(self.join(name))

    def lock(self) -> HeldLock:
        """A lease object renewed while held (``s3/lease.py``): object storage has no ``flock``."""
        from .s3.lease import take

        return take(self.target, LOCK_NAME)


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


def root_for(root: str | os.PathLike) -> Root:
    """The ``Root`` of a directory of checkpoints: ``roots.FileRoot`` for a path, ``ObjectRoot`` for
    ``s3://bucket/prefix``. A path is made absolute; nothing is created.

    Raises:
        InvalidArgumentError: an ``s3://`` URL without a prefix under its bucket.
    """
    p = os.fspath(root)
    if isinstance(p, str) and p.startswith(S3_SCHEME):
        from .s3.url import parse

        try:
            url = parse(p)
        except InvalidArgumentError:
            raise InvalidArgumentError(
                f"{p!r} cannot be a checkpoint root: use s3://bucket/prefix (the checkpoints go under the prefix)"
            ) from None
        return ObjectRoot(url.url)
    return FileRoot(os.path.abspath(p))


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
