"""The checksum of every stored file and chunk: xxh3-64 per block, combined (see ``format.CHECKSUM_ALGORITHM``).

Every writer (directory files, archive entries, pack/unpack) and every
reader (``verify``) hashes through this module, so there is one definition of
the checksum. Blocks of ``format.CHECKSUM_BLOCK`` bytes let several threads
hash one large file in parallel, each block while it is in cache.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, cast

import xxhash

from . import format as fmt

if TYPE_CHECKING:
    import numpy as np
    import torch
    from typing_extensions import Buffer

#: The checksum of zero bytes (no blocks).
EMPTY = xxhash.xxh3_64_hexdigest(b"")


def block_digest(block: memoryview | bytes) -> int:
    """xxh3-64 of one block."""
    return xxhash.xxh3_64_intdigest(block)


#: Bytes hashed per step when a pass also visits the bytes (``digest_visiting``): the visitor reads each
#: step right after the hash did, while it is in the core's cache.
VISIT_STEP = 512 * 1024


def digest_visiting(block: memoryview, visit: Callable[[memoryview], None] | None) -> int:
    """``block_digest(block)``, handing each step of ``VISIT_STEP`` bytes to ``visit`` right after hashing it
    (the counts of non-finite values, ``core.finite``, in the same pass as the checksum)."""
    if visit is None:
        return block_digest(block)
    h = xxhash.xxh3_64()
    for i in range(0, len(block), VISIT_STEP):
        step = block[i : i + VISIT_STEP]
        h.update(step)
        visit(step)
    return h.intdigest()


def blocks(data: memoryview | bytes | np.ndarray) -> list[memoryview]:
    """``data`` cut into CHECKSUM_BLOCK-sized views (no copy)."""
    # An ndarray is a buffer; numpy's stubs declare ``__buffer__`` only for Python >= 3.12.
    mv = memoryview(cast("Buffer", data)).cast("B")
    return [mv[i : i + fmt.CHECKSUM_BLOCK] for i in range(0, len(mv), fmt.CHECKSUM_BLOCK)]


def hash_blocks(
    data: memoryview | bytes | np.ndarray,
    map_fn: Callable[[Callable[[memoryview], int], Iterable[memoryview]], Iterable[int]] = map,
) -> list[int]:
    """The digest of each block of ``data``; ``map_fn`` may be a thread pool's ``map``."""
    return list(map_fn(block_digest, blocks(data)))


def combine_digests(digests: list[int]) -> str:
    """The checksum of a file from its block digests, in order."""
    joined = b"".join(d.to_bytes(8, "big") for d in digests)
    return xxhash.xxh3_64_hexdigest(joined)


def checksum_bytes(data: memoryview | bytes | np.ndarray) -> str:
    """The checksum of a whole in-memory buffer."""
    return combine_digests(hash_blocks(data))


def tensor_bytes(t: torch.Tensor) -> np.ndarray:
    """A flat uint8 view of a contiguous CPU tensor (no copy): what is stored and hashed."""
    import torch

    return t.reshape(-1).view(torch.uint8).numpy()


class Hasher:
    """The checksum of a file fed in pieces of any size (``checksum_bytes`` of their concatenation).

    Keeps one running xxh3-64 of the current block, not the bytes, so a
    file streamed in bounded chunks is hashed in bounded memory.
    """

    def __init__(self) -> None:
        self._digests: list[int] = []
        self._block = xxhash.xxh3_64()
        self._filled = 0

    def update(self, data: memoryview | bytes) -> None:
        """Add the next bytes of the file."""
        view = memoryview(data).cast("B")
        while view:
            take = view[: fmt.CHECKSUM_BLOCK - self._filled]
            self._block.update(take)
            self._filled += len(take)
            view = view[len(take) :]
            if self._filled == fmt.CHECKSUM_BLOCK:
                self._digests.append(self._block.intdigest())
                self._block, self._filled = xxhash.xxh3_64(), 0

    def hexdigest(self) -> str:
        """The file's checksum, as the manifest records one."""
        tail = [self._block.intdigest()] if self._filled else []
        return combine_digests(self._digests + tail)


def identify(data: memoryview | np.ndarray, visit: Callable[[memoryview], None] | None) -> tuple[str, int]:
    """A chunk's checksum and its identity, its XXH3-128 (an incremental save's comparison with its base:
    64 bits are a checksum, not an identity, at billions of chunks), in one pass: each step of ``VISIT_STEP``
    bytes is hashed by both, then handed to ``visit``, while it is in the core's cache."""
    whole = xxhash.xxh3_128()
    digests = []
    for block in blocks(data):
        h = xxhash.xxh3_64()
        for i in range(0, len(block), VISIT_STEP):
            step = block[i : i + VISIT_STEP]
            h.update(step)
            whole.update(step)
            if visit is not None:
                visit(step)
        digests.append(h.intdigest())
    return combine_digests(digests), whole.intdigest()
