"""Counts of NaN and Inf values and the largest finite magnitude of floating-point bytes (certified checkpoints).

Every writer hashes a chunk's bytes block by block while they are in cache
(``checksum.py``); it counts here in the same pass, so a checkpoint records,
for each floating-point chunk, how many of its values are NaN or infinite
and the largest finite magnitude (``docs/format.md`` section 5.4). A reader
then knows whether a checkpoint holds non-finite values without reading its
data: ``CheckpointManager(restore="finite")`` skips such checkpoints and
``save(..., require_finite=True)`` refuses to publish one.

The common case (every value finite) costs two integer reductions per piece
and no temporary: the values' bit patterns read as signed integers have
their largest positive magnitude as the maximum, read as unsigned integers
their largest negative one (sign bit set); a magnitude at or above the
format's infinity pattern means a non-finite value, and only then are the
values counted one by one. Complex values count each component.
"""

from __future__ import annotations

import math
import struct
from collections.abc import Iterable
from dataclasses import dataclass
from typing import cast

import numpy as np


@dataclass(frozen=True, slots=True)
class ChunkStats:
    """What one floating-point chunk (or a piece of it) holds besides finite values.

    Attributes:
        nan: how many values are NaN (complex: components).
        inf: how many values are +Inf or -Inf (complex: components).
        max_abs: the largest magnitude among its finite values (0.0 when it has none).
    """

    nan: int = 0
    inf: int = 0
    max_abs: float = 0.0

    @property
    def finite(self) -> bool:
        """Every value is finite."""
        return self.nan == 0 and self.inf == 0

    @staticmethod
    def combine(parts: Iterable[ChunkStats]) -> ChunkStats:
        """The stats of a chunk from those of its pieces."""
        nan = inf = 0
        top = 0.0
        for p in parts:
            nan, inf, top = nan + p.nan, inf + p.inf, max(top, p.max_abs)
        return ChunkStats(nan, inf, top)


#: No value of a chunk counted yet (an empty chunk).
EMPTY_STATS = ChunkStats()


@dataclass(frozen=True, slots=True)
class _Bits:
    """How one floating-point format lays out its values' bits.

    Attributes:
        signed: the signed integer type of one component's bits; ``unsigned`` the unsigned one.
        inf: the magnitude bits of infinity (None: the format has none, float8_e4m3fn).
        nan_from: the smallest magnitude bits that are NaN.
    """

    signed: str
    unsigned: str
    inf: int | None
    nan_from: int

    @property
    def finite_below(self) -> int:
        """Magnitudes below this are finite."""
        return self.inf if self.inf is not None else self.nan_from


_F64 = _Bits("<i8", "<u8", 0x7FF0000000000000, 0x7FF0000000000001)
_F32 = _Bits("<i4", "<u4", 0x7F800000, 0x7F800001)
_F16 = _Bits("<i2", "<u2", 0x7C00, 0x7C01)
_BITS: dict[str, _Bits] = {
    "float64": _F64,
    "float32": _F32,
    "float16": _F16,
    "bfloat16": _Bits("<i2", "<u2", 0x7F80, 0x7F81),
    "complex64": _F32,
    "complex128": _F64,
    "float8_e4m3fn": _Bits("<i1", "<u1", None, 0x7F),
    "float8_e5m2": _Bits("<i1", "<u1", 0x7C, 0x7D),
}


def is_floating(dtype_name: str) -> bool:
    """Whether chunks of this dtype (a manifest name) carry stats: the floating-point and complex dtypes."""
    return dtype_name in _BITS


def magnitude_value(dtype_name: str, bits: int) -> float:
    """The value whose magnitude bits (sign cleared) are ``bits`` in format ``dtype_name``, as a float."""
    if bits == 0:
        return 0.0
    if dtype_name in ("float64", "complex128"):
        return cast(float, struct.unpack("<d", struct.pack("<Q", bits))[0])
    if dtype_name in ("float32", "complex64"):
        return cast(float, struct.unpack("<f", struct.pack("<I", bits))[0])
    if dtype_name == "bfloat16":
        return cast(float, struct.unpack("<f", struct.pack("<I", bits << 16))[0])
    if dtype_name == "float16":
        return float(np.array([bits], dtype="<u2").view(np.float16)[0])
    if dtype_name == "float8_e5m2":  # the top byte of a float16
        return float(np.array([bits << 8], dtype="<u2").view(np.float16)[0])
    exponent, mantissa = bits >> 3, bits & 7  # float8_e4m3fn: bias 7, no infinity
    if exponent == 0:
        return math.ldexp(mantissa / 8, -6)
    return math.ldexp(1 + mantissa / 8, exponent - 7)


def piece_stats(dtype_name: str, piece: memoryview | bytes | np.ndarray) -> ChunkStats:
    """The stats of ``piece``, whole values of dtype ``dtype_name`` (a floating one: see ``is_floating``).

    Raises:
        ValueError: the piece does not hold a whole number of values.
    """
    bits = _BITS[dtype_name]
    raw = np.frombuffer(piece, dtype=np.uint8)
    if raw.size == 0:
        return EMPTY_STATS
    signed = raw.view(bits.signed)
    top = int(signed.max())
    positive = top if top >= 0 else 0
    unsigned_top = int(raw.view(bits.unsigned).max())
    sign = 1 << (8 * signed.itemsize - 1)
    negative = unsigned_top - sign if unsigned_top >= sign else 0
    largest = max(positive, negative)
    if largest < bits.finite_below:
        return ChunkStats(0, 0, magnitude_value(dtype_name, largest))
    return _count(dtype_name, bits, raw.view(bits.unsigned), sign - 1)


def _count(dtype_name: str, bits: _Bits, values: np.ndarray, mask: int) -> ChunkStats:
    """The slow path: a piece that holds a non-finite value, counted value by value."""
    magnitudes = values & values.dtype.type(mask)
    nan = int(np.count_nonzero(magnitudes >= bits.nan_from))
    inf = 0 if bits.inf is None else int(np.count_nonzero(magnitudes == bits.inf))
    finite = magnitudes[magnitudes < bits.finite_below]
    largest = int(finite.max()) if finite.size else 0
    return ChunkStats(nan, inf, magnitude_value(dtype_name, largest))


#: Bytes counted per call when a caller walks a large buffer: small enough to stay in a core's cache
#: right after the checksum read it, large enough that the call's overhead is noise.
PIECE = 512 * 1024


def buffer_stats(dtype_name: str, data: memoryview | bytes | np.ndarray) -> ChunkStats:
    """The stats of a whole buffer of values of dtype ``dtype_name``, counted in ``PIECE``-sized pieces."""
    mv = memoryview(cast("bytes", data)).cast("B")
    return ChunkStats.combine(piece_stats(dtype_name, mv[i : i + PIECE]) for i in range(0, len(mv), PIECE))


class StatsCounter:
    """Counts the pieces of one chunk as a checksum pass visits them (``checksum.digest_visiting``).

    Blocks of one chunk may be visited by several threads in any order: each
    call appends one piece's stats (atomic under the interpreter lock), and
    ``result`` combines them. Every piece holds whole values: blocks and the
    streamed slots' pieces start at multiples of 64 bytes within a chunk.
    """

    __slots__ = ("dtype_name", "parts")

    def __init__(self, dtype_name: str) -> None:
        self.dtype_name = dtype_name
        self.parts: list[ChunkStats] = []

    def __call__(self, piece: memoryview) -> None:
        for i in range(0, len(piece), PIECE):
            self.parts.append(piece_stats(self.dtype_name, piece[i : i + PIECE]))

    def result(self) -> ChunkStats:
        """The chunk's stats, once every piece was visited."""
        return ChunkStats.combine(self.parts)


def counter_for(dtype_name: str) -> StatsCounter | None:
    """A counter for a chunk of dtype ``dtype_name``, or None when the dtype is not floating (nothing to count)."""
    return StatsCounter(dtype_name) if is_floating(dtype_name) else None
