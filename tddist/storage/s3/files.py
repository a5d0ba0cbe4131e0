"""Reading a committed checkpoint's chunks from object storage with ranged GETs, in parallel.

The object-storage counterpart of ``storage.directory.DirectoryFiles`` and
``storage.archive.ArchiveFiles`` (an ``opened.ChunkFiles``): ``loading.read.ChunkSource`` plans the reads as on
a file system and asks ``span`` for each chunk's bytes. Before that,
``prefetch`` fetches every chunk a load needs (only those byte ranges), cut
into pieces of at most ``PIECE`` bytes, on a thread pool; ``span`` then
returns them from memory. Sizes are checked against the manifest before a
chunk is used, as on a file system.
"""

from __future__ import annotations

import struct
import zipfile
from collections.abc import Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np
import torch

from ... import format as fmt
from ...errors import CorruptCheckpointError
from ...manifest.locate import ChunkRange, FileSpan, Location, merged_ranges
from ..zipcodec import ALIGN, LOCAL_FMT, LOCAL_SIZE, check_compressed_entry, inflate_into
from .pin import S3Pin

#: The largest ranged GET; larger chunks are fetched in pieces, in parallel.
PIECE = 16 << 20
#: Threads fetching pieces when the load asks for fewer (requests wait on the network, not the CPU).
MIN_THREADS = 16
#: The most bytes an archive's local header may have past its fixed part and name: tddist's padding block
#: (at most 4 + 63 bytes) and a zip64 block (20 bytes), with room to spare.
EXTRA_SLACK = 256


@dataclass(frozen=True, slots=True)
class Span:
    """Bytes ``[start, stop)`` of one object, and the object's size (None: not known in advance); of a
    directory's data object, ``rank`` names it (its bytes at the offsets of docs/format.md section 2.3)."""

    key: str
    start: int
    stop: int
    size: int | None
    rank: int = -1


class S3Files:
    """The chunks of one committed checkpoint on object storage, fetched once each (an ``opened.ChunkFiles``)."""

    fetches_ahead = True
    shares_pages = False  # each rank fetches into its own memory

    def __init__(self, pin: S3Pin):
        self.pin = pin
        self.root = pin.path
        self._got: dict[Span, torch.Tensor] = {}
        self._partial: dict[Location, torch.Tensor] = {}

    def span(self, loc: Location) -> torch.Tensor:
        """A chunk's bytes (the uncompressed entry, in an archive) as a uint8 tensor.

        After ``prefetch`` of parts of a chunk, only those parts of the returned
        buffer hold the chunk's bytes: the load reads nothing else of it.
        """
        mine = self.pin.local.get((loc.relpath, loc.offset))
        if mine is not None and len(mine) == loc.nbytes:  # a copy: the caller's tensors stay its own
            return torch.frombuffer(bytearray(mine), dtype=torch.uint8)
        part = self._partial.get(loc)
        if part is not None:
            return part
        if self.pin.archive:
            return self._entry(loc)
        return self._fetch([self._dir_span(loc)], None)[0]

    def release(self, span: torch.Tensor) -> None:
        """Nothing is mapped: fetched bytes are the caller's tensors, freed with them."""

    def warm(self, spans: Sequence[FileSpan]) -> None:
        """Nothing shared to warm: each rank fetches into its own memory."""

    def prefetch(self, ranges: Iterable[ChunkRange], num_threads: int) -> None:
        """Fetch the bytes the load will read now, in parallel, so that ``span`` finds them in memory.

        Only the ranges are fetched (merged per chunk where they overlap),
        from a directory's data objects and from an archive's stored entries
        (after their local headers, which say where the data begins); a
        compressed archive entry is fetched whole, to be inflated.
        """
        local = self.pin.local
        ranges = [r for r in ranges if r.stop > r.start and (r.location.relpath, r.location.offset) not in local]
        whole = [
            r.location
            for r in ranges
            if (r.start, r.stop) == (0, r.location.nbytes)
            or (self.pin.archive and self._info(r.location).compress_type != zipfile.ZIP_STORED)
        ]
        spans = list(dict.fromkeys(self._span(loc) for loc in whole))
        parts: dict[Location, list[tuple[int, int]]] = {}
        full = set(whole)
        for r in ranges:
            if r.location not in full:
                parts.setdefault(r.location, []).append((r.start, r.stop))
        if not spans and not parts:
            return
        with ThreadPoolExecutor(max(num_threads, MIN_THREADS), thread_name_prefix="tddist-s3get") as pool:
            data_spans = self._stored_data_spans(list(parts), pool) if self.pin.archive else {}
            sub = {}
            for loc, rs in parts.items():
                s = data_spans[loc] if self.pin.archive else self._dir_span(loc)
                for lo, hi in merged_ranges(rs):
                    sub[Span(s.key, s.start + lo, s.start + hi, s.size, s.rank)] = (loc, lo)
            got = self._fetch(spans + list(sub), pool)
        for (loc, lo), data in zip(sub.values(), got[len(spans) :]):
            buf = self._partial.get(loc)
            if buf is None:
                buf = self._partial[loc] = torch.empty(loc.nbytes, dtype=torch.uint8)
            buf[lo : lo + len(data)] = data
        for s in sub:
            self._got.pop(s, None)  # copied into the chunk's buffer

    def _stored_data_spans(self, locs: list[Location], pool: ThreadPoolExecutor) -> dict[Location, Span]:
        """Where the data of each stored archive entry lies in the archive object, from its local header.

        The central directory gives where an entry's local header begins, not
        how long its extra field is (tddist pads it to align the data), so the
        headers are fetched first: a small ranged GET each, in parallel.
        """
        heads = {loc: self._header_span(self._info(loc)) for loc in locs}
        got = self._fetch(list(dict.fromkeys(heads.values())), pool)
        raws = dict(zip(dict.fromkeys(heads.values()), got))
        out = {}
        for loc, head in heads.items():
            zi = self._info(loc)
            start = head.start + self._data_offset(raws[head], zi.header_offset - head.start, loc.relpath)
            if zi.compress_size != loc.nbytes or start + loc.nbytes > self.pin.size:
                raise CorruptCheckpointError(
                    f"archive {self.root!r}: stored entry {loc.relpath!r} has inconsistent sizes or extends past the "
                    f"end of the object; the checkpoint is damaged"
                )
            out[loc] = Span(self.pin.url.key, start, start + loc.nbytes, self.pin.size)
        return out

    def _header_span(self, zi: zipfile.ZipInfo) -> Span:
        stop = min(self.pin.size, zi.header_offset + LOCAL_SIZE + len(zi.filename.encode()) + EXTRA_SLACK)
        return Span(self.pin.url.key, zi.header_offset, stop, self.pin.size)

    def _data_offset(self, raw: torch.Tensor, header: int, name: str) -> int:
        """Where an entry's data begins in ``raw``, which holds its local header from offset ``header``."""
        where = f"{self.root!r}: entry {name!r}"
        if len(raw) < header + LOCAL_SIZE:
            raise CorruptCheckpointError(f"archive {where} has a header past the end of the object")
        sig, *_rest, name_len, extra_len = struct.unpack_from(LOCAL_FMT, raw.numpy().data, header)
        if sig != b"PK\x03\x04":
            raise CorruptCheckpointError(f"archive {where} has a bad local header offset")
        return header + LOCAL_SIZE + name_len + extra_len

    def _span(self, loc: Location) -> Span:
        return self._archive_span(loc) if self.pin.archive else self._dir_span(loc)

    def _dir_span(self, loc: Location) -> Span:
        rank = fmt.data_file_rank(loc.relpath) if self.pin.cuts is not None else None
        key = self.pin.data_key(loc.relpath)
        return Span(key, loc.offset, loc.offset + loc.nbytes, loc.file_size, -1 if rank is None else rank)

    def _archive_span(self, loc: Location) -> Span:
        zi = self._info(loc)
        header = zi.header_offset
        stop = min(self.pin.size, header + LOCAL_SIZE + len(zi.filename.encode()) + EXTRA_SLACK + zi.compress_size)
        # from the 64-byte boundary below the header: the data (64-byte aligned in tddist's archives) is then
        # aligned in the buffer too, and viewed as any dtype without a copy
        return Span(self.pin.url.key, header - header % ALIGN, stop, self.pin.size)

    def _fetch(self, spans: list[Span], pool: ThreadPoolExecutor | None) -> list[torch.Tensor]:
        """The bytes of each span: from memory, or fetched in pieces (on ``pool`` when given)."""
        todo = [s for s in spans if s not in self._got]
        outs = {s: torch.empty(s.stop - s.start, dtype=torch.uint8) for s in todo}
        pieces = [(s, lo, min(lo + PIECE, s.stop)) for s in todo for lo in range(s.start, s.stop, PIECE)]

        def get(piece: tuple[Span, int, int]) -> None:
            s, lo, hi = piece
            if s.rank >= 0:
                self._get_kept(s, lo, hi, outs[s])
                return
            data, total = self.pin.get(s.key, lo, hi)
            if s.size is not None and total != s.size:
                raise CorruptCheckpointError(
                    f"object s3://{self.pin.url.bucket}/{s.key} has {total} bytes, the manifest says {s.size}; the "
                    f"checkpoint is damaged or truncated"
                )
            outs[s].numpy()[lo - s.start : hi - s.start] = np.frombuffer(data, dtype=np.uint8)

        if pool is not None and len(pieces) > 1:
            list(pool.map(get, pieces))
        else:
            for p in pieces:
                get(p)
        self._got.update(outs)
        return [self._got[s] for s in spans]

    def _get_kept(self, s: Span, lo: int, hi: int, out: torch.Tensor) -> None:
        """Bytes ``[lo, hi)`` of a data file of a checkpoint with references (docs/format.md 13.3) into ``out``
        (which holds ``s``): the ranges its object keeps, fetched; those of referenced chunks, zeros."""
        cuts = self.pin.cuts
        assert cuts is not None
        view = out.numpy()[lo - s.start : hi - s.start]
        view[:] = 0
        expected = cuts.sizes.get(s.rank, 0)
        for start, stop, at in cuts.pieces(s.rank, lo, hi):
            data, total = self.pin.get(s.key, start, stop)
            if total != expected:
                raise CorruptCheckpointError(
                    f"object s3://{self.pin.url.bucket}/{s.key} has {total} bytes, the manifest says {expected} (the "
                    f"chunks it holds itself); the checkpoint is damaged or truncated"
                )
            view[at : at + stop - start] = np.frombuffer(data, dtype=np.uint8)

    def _info(self, loc: Location) -> zipfile.ZipInfo:
        zi = self.pin.entries.get(loc.relpath)
        if zi is None:
            raise CorruptCheckpointError(
                f"archive {self.root!r} has no entry {loc.relpath!r}; the checkpoint is damaged"
            )
        if zi.file_size != loc.nbytes:
            raise CorruptCheckpointError(
                f"archive {self.root!r}: entry {loc.relpath!r} declares {zi.file_size} bytes, the manifest says "
                f"{loc.nbytes}"
            )
        return zi

    def _entry(self, loc: Location) -> torch.Tensor:
        """An archive entry's uncompressed bytes: its local header parsed, a stored entry's data viewed, else inflated."""
        zi, span = self._info(loc), self._archive_span(loc)
        name = loc.relpath
        where = f"{self.root!r}: entry {name!r}"
        raw = self._fetch([span], None)[0]
        start = self._data_offset(raw, zi.header_offset - span.start, name)
        if start + zi.compress_size > len(raw) and span.start + start + zi.compress_size <= self.pin.size:
            # a longer extra field than tddist writes (another zip tool rewrote the archive): fetch the rest
            span = Span(span.key, span.start, span.start + start + zi.compress_size, span.size)
            raw = self._fetch([span], None)[0]
        if start + zi.compress_size > len(raw):
            raise CorruptCheckpointError(f"archive {where} extends past the end of the object (truncated?)")
        data = raw[start : start + zi.compress_size]
        if zi.compress_type == zipfile.ZIP_STORED:
            if zi.compress_size != loc.nbytes:
                raise CorruptCheckpointError(f"archive {where}: a stored entry with inconsistent sizes")
            return data if start % ALIGN == 0 else data.clone()  # rewritten by another zip tool: unaligned
        check_compressed_entry(zi.compress_type, zi.compress_size, loc.nbytes, where)
        out = torch.empty(loc.nbytes, dtype=torch.uint8)
        crc = inflate_into(zi.compress_type, _BytesSource(data.numpy().data), out.numpy().data, where)
        if crc != zi.CRC:
            raise CorruptCheckpointError(f"archive {where} decompresses to bytes that fail its CRC-32; it is damaged")
        return out


class _BytesSource:
    """Compressed bytes in memory as the file-like ``read`` that ``zipcodec.inflate_into`` consumes."""

    def __init__(self, data: memoryview):
        self.data, self.pos, self.end = data, 0, len(data)

    def read(self, n: int = -1) -> bytes:
        stop = self.end if n < 0 else min(self.end, self.pos + n)
        out = bytes(self.data[self.pos : stop])
        self.pos = stop
        return out
