"""The read side of every store: a committed checkpoint opened once (``OpenedCheckpoint``) and its protocols.

A store's ``open`` pins one generation of the checkpoint (a directory or
archive descriptor, an object's ETag, a manifest's data generation), reads
the manifest's bytes of that generation (``ManifestBytes``; its index is read
once the parsed manifest says how large it must be), and ``validate`` turns
them into an ``OpenedCheckpoint``: the checked manifest,
its generation, and the ``Pin`` every chunk is then read through. So a load
reads one generation whole even while an overwrite replaces the checkpoint.

Call order, on every rank that reads (``loading.pipeline`` runs it):

1. (every rank) ``backends.store_for(prefix).open()``: pin one generation and
   read its manifest (the store's ``ManifestBytes``, checked by ``validate``,
   which has the store read the index once the manifest says its size);
   raises ``CheckpointNotFoundError``, ``ManifestError``,
   ``CorruptCheckpointError`` or ``StorageError``.
2. (several ranks) compare ``generation`` on every rank: an overwrite may have
   committed between two ranks' opens (then every rank raises
   ``CheckpointChangedError`` and the load opens again).
3. (every rank) ``files()``: the ``ChunkFiles`` of the pinned generation (the
   store's reader); then ``warm(spans)`` once where ``shares_pages`` and the
   node's ranks read the same files (``loading.cooperate``), then
   ``prefetch(ranges, num_threads)`` once with every range the load reads
   where ``fetches_ahead`` (a store that pays per request fetches them in
   parallel), then ``span(location)`` for each chunk read.
4. (every rank) ``close()``: the pin is released; tensors already mapped stay
   valid.

Nothing here imports torch, so the ``tddist`` command lists and describes
checkpoints without it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

from .. import format as fmt
from ..errors import ManifestError
from ..manifest import checksum as manifest_checksum
from ..manifest.model import Manifest
from ..manifest.parse import IndexSource, parse_manifest, paused_gc

if TYPE_CHECKING:
    import torch

    from ..manifest.locate import ChunkRange, FileSpan, Location


class ChunkFiles(Protocol):
    """The chunks of one pinned generation, read as uint8 tensors (the read-side counterpart of ``ShardWriter``).

    Call order: ``warm`` at most once, with the part of the node's shared
    reads this rank reads for all of them (where ``shares_pages``; see
    ``loading.cooperate``); ``prefetch`` at most once, with every range the
    load will read; then ``span`` for each chunk, in any order, from any thread.
    """

    root: str  # the checkpoint, as errors name it
    #: whether ``prefetch`` fetches anything (object storage); a file system maps chunks in ``span``
    fetches_ahead: bool
    #: whether the ranks of one node read these files through one page cache (a file system), so that what one
    #: rank ``warm``s the others map from memory
    shares_pages: bool

    def warm(self, spans: Sequence[FileSpan]) -> None:
        """Read ``spans`` into the page cache of this node (a no-op where ``shares_pages`` is False) and wait for
        them: bytes other ranks of the node map, read by this one in long sequential requests.

        An optimisation only: a file that cannot be opened is left to ``span``, which says why.
        """
        ...

    def prefetch(self, ranges: Sequence[ChunkRange], num_threads: int) -> None:
        """Fetch ahead the bytes a load will read (a no-op where ``span`` maps files)."""
        ...

    def span(self, location: Location) -> torch.Tensor:
        """The chunk's bytes at ``location``: a copy-on-write map, a decompressed copy or fetched bytes.

        Sizes are checked against the manifest's before the bytes are used.
        Raises ``CorruptCheckpointError`` for a missing or damaged chunk,
        ``CheckpointChangedError`` when an overwrite removed it meanwhile.
        """
        ...

    def release(self, span: torch.Tensor) -> None:
        """Done with a chunk for now (``span``: what ``span`` returned, or a view of all of it): drop the pages of
        it that this process mapped, if it is a view of a file mapped here (else nothing: anonymous memory).

        A streaming reader (``convert``) calls it once a leaf is written, so
        pages it read stop counting in its resident memory. A tensor still
        viewing the chunk stays valid (its pages are mapped again when read).
        """
        ...


class Readable(Protocol):
    """What a load needs of a store (``backends.Store`` is one; ``memory.MemoryStore``, a copy held in memory,
    is another): its name and ``open``."""

    @property
    def target(self) -> str:
        """The checkpoint, as messages name it."""
        ...

    def open(self) -> OpenedCheckpoint:
        """Pin one generation and read its validated manifest."""
        ...


class Pin(Protocol):
    """One generation of a committed checkpoint, held while it is read (see the module's call order); its
    store reads its chunks (``Store.files``)."""

    @property
    def path(self) -> str:
        """The checkpoint, as the user named it."""
        ...

    @property
    def archive(self) -> bool:
        """One zip archive (else a directory tree)."""
        ...

    def close(self) -> None:
        """Release the pin (idempotent)."""
        ...


@dataclass(frozen=True, slots=True)
class ManifestBytes:
    """What a store's ``open`` found: the pin, the manifest's bytes, where its index is read from, how to name them.

    The parser has the index read once the manifest says how large it must
    be (``manifest.model.IndexSource``); a version-1 manifest has none.
    """

    pin: Pin
    raw: bytes
    index: IndexSource
    where: str


@dataclass(frozen=True)
class OpenedCheckpoint:
    """A committed checkpoint opened once: its validated manifest, its generation, and its ``Pin``.

    Every chunk a load reads is read through ``files()``, so manifest and
    data come from one generation even while an overwrite replaces the
    checkpoint. Close it (or use it as a context manager) once the data is
    mapped.
    """

    pin: Pin
    manifest: Manifest
    #: the manifest's checksum (version 3) or the hash of its bytes: equal generations hold equal data
    generation: str
    #: the store's reader of a pin's chunks (``backends.Store.files``)
    reader: Callable[[Pin], ChunkFiles]

    @property
    def path(self) -> str:
        return self.pin.path

    def files(self) -> ChunkFiles:
        """The reader of the pinned generation's chunks (imports torch)."""
        return self.reader(self.pin)

    def close(self) -> None:
        self.pin.close()

    def __enter__(self) -> OpenedCheckpoint:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def validate(found: ManifestBytes, reader: Callable[[Pin], ChunkFiles]) -> OpenedCheckpoint:
    """Check the manifest's own checksum, parse and validate it (with its index); close the pin if it fails.

    ``reader``: how the store reads the pin's chunks.
    """
    try:
        return _validate(found, reader)
    except BaseException:
        found.pin.close()
        raise


def _validate(found: ManifestBytes, reader: Callable[[Pin], ChunkFiles]) -> OpenedCheckpoint:
    where = found.where
    gen, sealed = manifest_checksum.generation(found.raw, where)
    try:
        with paused_gc():  # many small objects: see paused_gc
            obj = fmt.loads(found.raw)
    except (ValueError, UnicodeDecodeError) as e:
        raise ManifestError(f"{where} is not valid JSON ({e}); the checkpoint is damaged") from None
    except RecursionError:
        raise ManifestError(f"{where} is JSON nested too deeply to be a tddist manifest; refusing it") from None
    m = parse_manifest(obj, where=where, index=found.index)
    if m.version >= 3 and not sealed:
        raise ManifestError(f"{where} (format version {m.version}) lacks its manifest_checksum; it was tampered with")
    if found.pin.archive and m.layout != "archive":
        raise ManifestError(
            f"{where} declares layout {m.layout!r}, but the checkpoint is an archive; it was tampered with"
        )
    return OpenedCheckpoint(
        found.pin, m, gen, reader
    )  # a directory may hold an extracted archive: the tree is the same
