"""The zip codec of the archive container: compression methods, CRC-32 combination, entries laid
out in regions, local headers and the central directory.

Header bytes come from ``zipfile`` (through ``_compat``): ``ZipInfo.FileHeader``
for local headers and ``ZipFile``'s own end-record writer for the central
directory (zip64 when needed). What zipfile cannot do, and is written here, is
laying the entries out in parallel regions (each rank prepares its entries,
then writes them at offsets rank 0 assigned), hashing and compressing one
entry's blocks on several threads, and combining their CRCs (zlib exposes no
``crc32_combine`` to Python). Payloads start on 64-byte boundaries (a padding
block in the local header's extra field), so a reader maps the archive once
and views stored leaves without copying.
"""

from __future__ import annotations

import bz2
import io
import lzma
import os
import stat
import struct
import zipfile
import zlib
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import IO, TYPE_CHECKING, Any, Protocol, cast

from .. import format as fmt
from .._compat import local_header, write_central_directory, zip_lzma_compressor
from .._faults import fault_point
from .._fs import pwrite_all, write_and_start_writeback
from ..checksum import digest_visiting, tensor_bytes
from ..core.finite import StatsCounter, counter_for
from ..core.types import ArchiveEntryRow, Compression
from ..errors import CorruptCheckpointError, InvalidArgumentError

if TYPE_CHECKING:
    import torch

ALIGN = 64
_PAD_EXTRA_ID = 0x7464  # extra-field id of the alignment padding block
_DATE = (1980, 1, 1, 0, 0, 0)
LOCAL_FMT = "<4s5H3I2H"
LOCAL_SIZE = struct.calcsize(LOCAL_FMT)
ZIP_ZSTD = 93

_METHODS = {
    "stored": zipfile.ZIP_STORED,
    "deflate": zipfile.ZIP_DEFLATED,
    "deflated": zipfile.ZIP_DEFLATED,
    "bzip2": zipfile.ZIP_BZIP2,
    "lzma": zipfile.ZIP_LZMA,
    "zstd": ZIP_ZSTD,
}


def resolve_compression(compression: Any) -> Compression:
    """(zip method, level) from ``None``, a name, a zipfile constant, ``(name, level)`` or ``"name:level"``."""
    level = None
    if isinstance(compression, tuple) and len(compression) == 2:
        compression, level = compression
    elif isinstance(compression, str) and ":" in compression:
        compression, lv = compression.split(":", 1)
        level = int(lv) if lv.lstrip("-").isdigit() else None
    if compression is None or compression is False:
        return Compression(zipfile.ZIP_STORED)
    method = _METHODS.get(compression.lower()) if isinstance(compression, str) else compression
    if method not in set(_METHODS.values()):
        raise InvalidArgumentError(
            f"compression={compression!r} is not supported; use None, 'deflate', 'bzip2', 'lzma', 'zstd', a zipfile "
            f"constant (ZIP_STORED, ZIP_DEFLATED, ZIP_BZIP2, ZIP_LZMA, or 93 for zstd), or (name, level)"
        )
    if method == ZIP_ZSTD:
        try:
            import zstandard  # noqa: F401
        except ImportError:
            raise InvalidArgumentError(
                "compression='zstd' needs the zstandard package: pip install zstandard"
            ) from None
    return Compression(method, level)


# --- CRC-32 of blocks hashed in parallel --------------------------------------------


def _gf2_times(mat: list[int], vec: int) -> int:
    out, i = 0, 0
    while vec:
        if vec & 1:
            out ^= mat[i]
        vec >>= 1
        i += 1
    return out


def _gf2_square(mat: list[int]) -> list[int]:
    return [_gf2_times(mat, mat[n]) for n in range(32)]


_ZERO_OPS: dict[int, list[int]] = {}


def _zeros_operator(length: int) -> list[int]:
    """The GF(2) matrix that advances a CRC-32 over ``length`` zero bytes (cached)."""
    op = _ZERO_OPS.get(length)
    if op is None:
        one_bit = [0xEDB88320] + [1 << n for n in range(31)]
        op = [1 << n for n in range(32)]  # identity
        power = _gf2_square(_gf2_square(_gf2_square(one_bit)))  # one zero byte
        n = length
        while n:
            if n & 1:
                op = [_gf2_times(power, v) for v in op]
            n >>= 1
            if n:
                power = _gf2_square(power)
        _ZERO_OPS[length] = op
    return op


def crc32_combine(crc1: int, crc2: int, len2: int) -> int:
    """CRC-32 of A+B from crc(A), crc(B) and len(B), as zlib's crc32_combine."""
    if len2 == 0:
        return crc1
    return _gf2_times(_zeros_operator(len2), crc1) ^ crc2


# --- writing -----------------------------------------------------------------------


@dataclass
class Entry:
    """One archive entry of this rank: its bytes, compressed pieces, sizes and hashes."""

    name: str
    data: memoryview
    method: int = zipfile.ZIP_STORED
    blocks: list[tuple[int, int]] = field(default_factory=list)  # (start, stop) of each piece of ``data``
    pieces: list[bytes] = field(default_factory=list)  # compressed pieces; empty when stored
    crcs: list[int] = field(default_factory=list)  # CRC-32 of each block
    crc: int = 0
    csize: int = 0
    digests: list[int] = field(default_factory=list)  # xxh3-64 of each CHECKSUM_BLOCK
    counter: StatsCounter | None = None  # a floating leaf's counts of non-finite values, made while hashing
    header: bytes = b""
    offset: int = 0  # of the local header, absolute


def _compress_piece(method: int, level: int | None, block: memoryview, last: bool) -> bytes:
    if method == zipfile.ZIP_DEFLATED:
        c = zlib.compressobj(6 if level is None else level, zlib.DEFLATED, -15)
        return c.compress(block) + c.flush(zlib.Z_FINISH if last else zlib.Z_FULL_FLUSH)
    if method == ZIP_ZSTD:
        import zstandard

        return zstandard.ZstdCompressor(level=3 if level is None else level).compress(block)
    if method == zipfile.ZIP_BZIP2:
        return bz2.compress(block, 9 if level is None else level)
    c = zip_lzma_compressor()
    return c.compress(block) + c.flush()


def _hash_and_compress(e: Entry, i: int, level: int | None) -> None:
    lo, hi = e.blocks[i]
    block = e.data[lo:hi]
    e.crcs[i] = zlib.crc32(block)
    cb = fmt.CHECKSUM_BLOCK
    for j in range(lo // cb, -(-hi // cb)):
        e.digests[j] = digest_visiting(e.data[j * cb : (j + 1) * cb], e.counter)
    if e.method != zipfile.ZIP_STORED:
        e.pieces[i] = _compress_piece(e.method, level, block, i == len(e.blocks) - 1)


def prepare_entries(
    files: dict[str, bytes], leaves: dict[str, torch.Tensor], compression: Compression, num_threads: int
) -> list[Entry]:
    """Hash (xxh3 blocks and CRC-32) and compress every entry, with ``num_threads`` threads.

    ``files`` are small metadata files, always stored; ``leaves`` maps entry
    names to tensors. Stored, deflate and zstd entries are processed in 32 MiB
    blocks by all threads (a full flush ends each deflate block, zstd blocks
    are separate frames); bzip2 and lzma entries are one piece each.
    """
    entries = [Entry(name, memoryview(data)) for name, data in files.items()]
    method, level = compression.method, compression.level
    entries += [
        Entry(name, memoryview(tensor_bytes(t).data), method, counter=counter_for(fmt.dtype_name(t.dtype)))
        for name, t in leaves.items()
    ]
    tasks = []
    for e in entries:
        n = len(e.data)
        step = fmt.CHECKSUM_BLOCK if e.method in (zipfile.ZIP_STORED, zipfile.ZIP_DEFLATED, ZIP_ZSTD) else max(n, 1)
        e.blocks = [(lo, min(lo + step, n)) for lo in range(0, max(n, 1), step)]
        e.crcs = [0] * len(e.blocks)
        e.pieces = [b""] * len(e.blocks) if e.method != zipfile.ZIP_STORED else []
        e.digests = [0] * (-(-n // fmt.CHECKSUM_BLOCK))
        tasks += [(e, i) for i in range(len(e.blocks))]
    if num_threads > 1 and len(tasks) > 1:
        with ThreadPoolExecutor(num_threads, thread_name_prefix="tddist-zip") as ex:
            list(ex.map(lambda t: _hash_and_compress(t[0], t[1], level), tasks))
    else:
        for e, i in tasks:
            _hash_and_compress(e, i, level)
    for e in entries:
        e.crc = e.crcs[0]
        for (lo, hi), c in zip(e.blocks[1:], e.crcs[1:]):
            e.crc = crc32_combine(e.crc, c, hi - lo)
        e.csize = sum(len(p) for p in e.pieces) if e.pieces else len(e.data)
    return entries


def _zipinfo(name: str, method: int, crc: int, size: int, csize: int) -> zipfile.ZipInfo:
    zi = zipfile.ZipInfo(name, date_time=_DATE)
    zi.compress_type = method
    zi.CRC = crc
    zi.file_size = size
    zi.compress_size = csize
    zi.create_system = 3
    zi.external_attr = (stat.S_IFREG | 0o644) << 16
    return zi


def place_entries(entries: list[Entry], start: int) -> int:
    """Assign each entry its header offset from ``start`` (a multiple of ALIGN); return the region's end.

    Each payload starts on an ALIGN boundary: the local header carries a
    padding block in its extra field.
    """
    pos = start
    for e in entries:
        zi = _zipinfo(e.name, e.method, e.crc, len(e.data), e.csize)
        base = len(local_header(zi))
        pad = -(pos + base + 4) % ALIGN
        zi.extra = struct.pack("<HH", _PAD_EXTRA_ID, pad) + b"\0" * pad
        e.header = local_header(zi)
        e.offset = pos
        pos += len(e.header) + e.csize
    return pos + (-pos % ALIGN)


def write_region(path: str, entries: list[Entry], num_threads: int, rank: int = -1) -> None:
    """pwrite every entry's header and payload at its offset, from several threads; fsync.

    ``rank`` (the writer's, -1 for none) names the fault point ``midwrite``, halfway through the writes.
    """
    fd = os.open(path, os.O_WRONLY)
    try:
        tasks = []
        for e in entries:
            tasks.append((e.offset, memoryview(e.header)))
            pos = e.offset + len(e.header)
            payload: Sequence[bytes | memoryview] = e.pieces or [e.data[lo:hi] for lo, hi in e.blocks]
            for piece in payload:
                tasks.append((pos, memoryview(piece)))
                pos += len(piece)
        midway = (-1, memoryview(b""))
        tasks.insert(len(tasks) // 2, midway)

        def put(task: tuple[int, memoryview]) -> None:
            if task is midway:
                fault_point("midwrite", rank)
                return
            pos, view = task
            write_and_start_writeback(fd, view, pos)

        if num_threads > 1 and len(tasks) > 1:
            with ThreadPoolExecutor(num_threads, thread_name_prefix="tddist-zipw") as ex:
                list(ex.map(put, tasks))
        else:
            for t in tasks:
                put(t)
        os.fsync(fd)
    finally:
        os.close(fd)


def entry_rows(entries: list[Entry]) -> tuple[ArchiveEntryRow, ...]:
    """What rank 0 needs of these entries for the central directory."""
    return tuple(ArchiveEntryRow(e.name, e.offset, e.method, e.crc, len(e.data), e.csize) for e in entries)


def write_tail_and_directory(path: str, end: int, files: dict[str, bytes], rows: list[ArchiveEntryRow]) -> None:
    """(rank 0) Write ``files`` (stored, in order) at ``end``, then the central directory of every entry; fsync."""
    tail = tail_bytes(end, files, rows)
    fd = os.open(path, os.O_WRONLY)
    try:
        pwrite_all(fd, memoryview(tail), end)
        os.ftruncate(fd, end + len(tail))
        os.fsync(fd)
    finally:
        os.close(fd)


def tail_bytes(end: int, files: dict[str, bytes], rows: list[ArchiveEntryRow]) -> bytes:
    """What follows the regions, from ``end``: ``files`` as stored entries (in order), then the central
    directory of every entry (``rows`` and those files) and the end records."""
    tail = prepare_entries(files, {}, Compression(zipfile.ZIP_STORED), 0)
    place_entries(tail, end)
    out = _ShiftedBuffer(end)
    for e in tail:
        out.seek(e.offset)
        out.write(e.header)
        out.write(e.data)
    m = tail[-1]
    cd_start = m.offset + len(m.header) + m.csize
    infos = []
    for row in [*rows, *entry_rows(tail)]:
        zi = _zipinfo(row.name, row.method, row.crc, row.size, row.csize)
        zi.header_offset = row.offset
        infos.append(zi)
    write_central_directory(cast(IO[bytes], out), cd_start, infos)
    return out.inner.getvalue()


class _ShiftedBuffer:
    """An in-memory file whose first byte is at offset ``base`` of the archive, for zipfile's central directory
    writer (which seeks to and records absolute offsets); nothing before ``base`` is held."""

    def __init__(self, base: int):
        self.base, self.inner = base, io.BytesIO()

    def tell(self) -> int:
        return self.base + self.inner.tell()

    def seek(self, pos: int, whence: int = 0) -> int:
        if whence == 0:
            pos -= self.base
        return self.base + self.inner.seek(pos, whence)

    def write(self, data: bytes | memoryview) -> int:
        return self.inner.write(data)

    def truncate(self, size: int | None = None) -> int:
        return self.base + self.inner.truncate(None if size is None else size - self.base)

    def flush(self) -> None:
        pass


# --- reading ----------------------------------------------------------------------

#: Compressed bytes read, and uncompressed bytes produced, per step of ``inflate_into``: what decompression
#: holds in memory beside the destination buffer.
STREAM_BLOCK = 4 << 20
#: Deflate's largest possible expansion (a 258-byte match per 2 bits): a deflate entry that declares more
#: is a bomb, refused before any memory is allocated for it.
DEFLATE_MAX_RATIO = 1032
KNOWN_METHODS = frozenset(_METHODS.values())


class ByteSource(Protocol):
    """Compressed bytes read in steps (``EntryReader`` from a file; object storage reads from memory);
    ``pos`` is where the next read starts, ``end`` where the bytes end."""

    pos: int
    end: int

    def read(self, n: int = -1) -> bytes: ...


class EntryReader:
    """The compressed bytes of one archive entry, read from ``fd`` with ``pread`` in blocks (a file-like
    ``read``): nothing but the block being decompressed is held in memory, and the map is not touched."""

    def __init__(self, fd: int, start: int, length: int):
        self.fd, self.pos, self.end = fd, start, start + length

    def read(self, n: int = -1) -> bytes:
        n = self.end - self.pos if n < 0 else min(n, self.end - self.pos)
        data = os.pread(self.fd, n, self.pos) if n > 0 else b""
        self.pos += len(data)
        if n > 0 and not data:
            self.end = self.pos  # the file is shorter than its directory says: the stream ends here
        return data


def check_compressed_entry(method: int, csize: int, size: int, where: str) -> None:
    """Refuse, before anything is allocated for it, an entry of an unknown method or an impossible size."""
    if method not in KNOWN_METHODS:
        raise CorruptCheckpointError(f"archive {where} uses unknown compression method {method}")
    if method == zipfile.ZIP_DEFLATED and size > DEFLATE_MAX_RATIO * csize + 64:
        raise CorruptCheckpointError(
            f"archive {where} declares {size} bytes from {csize} deflated ones, more than deflate can expand to; "
            f"refusing it (corrupted or a zip bomb)"
        )


def inflate_into(method: int, src: ByteSource, out: memoryview, where: str) -> int:
    """Decompress the entry read from ``src`` straight into ``out`` (its declared size), block by block;
    return the CRC-32 of the bytes. Anything more or less than ``len(out)`` bytes, or a damaged stream, is a
    CorruptCheckpointError; decompression stops one byte past the declared size."""
    sink = _Sink(out, where)
    try:
        if method == ZIP_ZSTD:
            _inflate_zstd(src, sink)
        elif method == zipfile.ZIP_DEFLATED:
            _inflate_zlib(src, sink)
        elif method in (zipfile.ZIP_BZIP2, zipfile.ZIP_LZMA):
            _inflate_stream(method, src, sink, len(out))
        else:
            raise CorruptCheckpointError(f"archive {where} uses unknown compression method {method}")
    except (CorruptCheckpointError, MemoryError):
        raise
    except Exception as e:  # zlib.error, lzma.LZMAError, OSError (bz2), zstandard.ZstdError, struct.error, ...
        raise CorruptCheckpointError(
            f"archive {where} does not decompress ({type(e).__name__}: {e}); the checkpoint is damaged"
        ) from None
    if sink.pos != len(out):
        raise CorruptCheckpointError(
            f"archive {where} decompresses to fewer bytes ({sink.pos}) than its declared {len(out)}; refusing it "
            f"(truncated or corrupted)"
        )
    return sink.crc


class _Sink:
    """Where decompressed blocks go: the destination, with a running CRC-32 and the declared size enforced."""

    def __init__(self, out: memoryview, where: str):
        self.out, self.where, self.pos, self.crc = out, where, 0, 0

    @property
    def room(self) -> int:
        """How much the next step may produce: up to one byte past the declared size, to notice more."""
        return min(STREAM_BLOCK, len(self.out) - self.pos + 1)

    def put(self, data: bytes) -> None:
        end = self.pos + len(data)
        if end > len(self.out):
            self.more()
        self.out[self.pos : end] = data
        self.crc = zlib.crc32(data, self.crc)
        self.pos = end

    def more(self) -> None:
        raise CorruptCheckpointError(
            f"archive {self.where} decompresses to more bytes than its declared {len(self.out)}; refusing it "
            f"(corrupted or a zip bomb)"
        )


def _inflate_zlib(src: ByteSource, sink: _Sink) -> None:
    d = zlib.decompressobj(-15)
    tail = b""
    while not d.eof:
        fresh = not tail
        if fresh:
            tail = src.read(STREAM_BLOCK)
        chunk = d.decompress(tail, sink.room)
        tail = d.unconsumed_tail
        if not chunk and not tail and fresh and src.pos >= src.end:
            break  # input exhausted and nothing more comes out: truncated (or complete without an end block)
        sink.put(chunk)


def _inflate_stream(method: int, src: ByteSource, sink: _Sink, size: int) -> None:
    """bzip2 (concatenated streams allowed) and zip's raw LZMA, through their incremental decompressors."""
    new = bz2.BZ2Decompressor if method == zipfile.ZIP_BZIP2 else lambda: _zip_lzma_decompressor(src, size)
    d: Any = new()
    data = b""
    idle = 0
    while True:
        if d.eof:
            data = d.unused_data or src.read(STREAM_BLOCK)
            if not data or method != zipfile.ZIP_BZIP2:
                return
            d = new()
        if d.needs_input and not data:
            data = src.read(STREAM_BLOCK)
            if not data:
                return  # truncated: the caller sees fewer bytes than declared
        chunk = d.decompress(data, sink.room)
        idle = 0 if chunk or data else idle + 1
        if idle > 2:
            raise CorruptCheckpointError(f"archive {sink.where} makes no progress when decompressed; it is damaged")
        data = b""
        sink.put(chunk)


def _zip_lzma_decompressor(src: ByteSource, size: int) -> Any:
    """A raw LZMA1 decompressor from a zip entry's properties header (version, size, properties). The
    dictionary is never larger than the entry needs, whatever the header claims (up to 4 GiB)."""
    head = src.read(4)
    props_size = struct.unpack("<2xH", head)[0]
    props = src.read(props_size)
    if props_size != 5 or len(props) != 5 or props[0] >= 9 * 5 * 5:
        raise ValueError(f"malformed LZMA properties header ({props_size} bytes: {props[:5].hex()})")
    lclppb = props[0]
    filt = {
        "id": lzma.FILTER_LZMA1,
        "lc": lclppb % 9,
        "lp": (lclppb // 9) % 5,
        "pb": lclppb // 45,
        "dict_size": max(4096, min(int.from_bytes(props[1:5], "little"), size)),
    }
    return lzma.LZMADecompressor(lzma.FORMAT_RAW, filters=[filt])


def _inflate_zstd(src: ByteSource, sink: _Sink) -> None:
    """zstd frames (tddist writes one per 32 MiB piece) decompressed by ``readinto`` straight into ``out``."""
    import zstandard

    out = sink.out
    reader = zstandard.ZstdDecompressor().stream_reader(
        cast("IO[bytes]", src), read_size=STREAM_BLOCK, read_across_frames=True, closefd=False
    )
    with reader:
        while sink.pos < len(out):
            n = reader.readinto(out[sink.pos : sink.pos + STREAM_BLOCK])
            if not n:
                return
            sink.crc = zlib.crc32(out[sink.pos : sink.pos + n], sink.crc)
            sink.pos += n
        if reader.read(1):
            sink.more()
