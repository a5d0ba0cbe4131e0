"""References of an incremental checkpoint (format version 4): chunks whose bytes another checkpoint holds.

A save with a base (``save(..., base=...)``) does not write a chunk whose
content equals the base's chunk of the same leaf and rank: its manifest
names the checkpoint that physically holds those bytes (a **holder**: the
base, or the holder the base itself referenced, never a chain) and, per
chunk, which holder has it. An incremental manifest also records every
chunk's identity, its XXH3-128, so the next incremental save compares
hashes instead of bytes. A manifest saved without a base has none of this:
no member in the JSON, no section in the index (docs/format.md 5.10).

Here: the model (``Holder``, ``LeafRefs``), the JSON member and the index's
section 7 (written and parsed), and rank 0's merge of the ranks' columns.
No torch, no file.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..core.types import Fragment, Holder

__all__ = ["Holder", "LeafRefs", "id_pair", "merge_leaf_refs", "parse_holders", "refs_index_size"]

_I8 = np.dtype("<i8")
_U8 = np.dtype("<u8")
_HEX16 = re.compile(r"[0-9a-f]{16}")
#: A holder's name: one path component beside the checkpoint (no separator, no ``..``, no control character).
_NAME = re.compile(r"[^/\\\x00-\x1f]{1,255}")


@dataclass(frozen=True, slots=True)
class LeafRefs:
    """A leaf's chunks in an incremental manifest, in chunk order.

    Attributes:
        holders: which checkpoint holds each chunk's bytes (int64[n]): 0 this one, ``h`` the manifest's
            ``holders[h - 1]``.
        ids: each chunk's XXH3-128 (uint64[n, 2]: the low 64 bits, then the high 64 bits).
    """

    holders: np.ndarray
    ids: np.ndarray

    def held_elsewhere(self) -> np.ndarray:
        """The chunks whose bytes another checkpoint holds."""
        return np.nonzero(self.holders)[0]


def id_pair(digest: int) -> tuple[int, int]:
    """A 128-bit XXH3 digest (``xxh3_128_intdigest``) as the index stores it: its low, then high, 64 bits."""
    return digest & ((1 << 64) - 1), digest >> 64


def holders_member(holders: tuple[Holder, ...]) -> list[dict[str, str]]:
    """The JSON member ``holders``."""
    return [{"name": h.name, "generation": h.generation} for h in holders]


def leaf_section(refs: LeafRefs) -> list[bytes]:
    """A leaf's part of the index's section 7: its chunks' holders, then their identities."""
    return [np.ascontiguousarray(refs.holders, dtype=_I8).tobytes(), np.ascontiguousarray(refs.ids, _U8).tobytes()]


def parse_holders(obj: dict[str, Any], fail: Any) -> tuple[Holder, ...] | None:
    """The ``holders`` member (None when absent: not an incremental manifest), checked; ``fail(why)`` raises."""
    if "holders" not in obj:
        return None
    raw = obj["holders"]
    if not isinstance(raw, list):
        fail("has a non-list 'holders'")
    out = []
    for h in raw:
        ok = isinstance(h, dict) and set(h) == {"name", "generation"}
        name, gen = (h.get("name"), h.get("generation")) if ok else (None, None)
        ok = ok and isinstance(name, str) and _NAME.fullmatch(name) is not None and name not in (".", "..")
        if not (ok and isinstance(gen, str) and _HEX16.fullmatch(gen)):
            fail(f"has an invalid holder {h!r} (a name beside the checkpoint and a generation of 16 hex digits)")
        out.append(Holder(str(name), str(gen)))
    if len({h.name for h in out}) != len(out):
        fail("names a holder twice")
    return tuple(out)


def refs_index_size(chunks: int) -> int:
    """The numbers section 7 adds for ``chunks`` chunks in all: a holder and two halves of an identity each."""
    return 3 * chunks


def read_leaf_refs(take: Any, n: int, holders: int, fail: Any) -> LeafRefs:
    """A leaf's part of section 7 (``take(dtype, count)`` reads the index), its holders checked."""
    h = take(_I8, n)
    ids = take(_U8, 2 * n).reshape(n, 2)
    if n and not bool(((h >= 0) & (h <= holders)).all()):
        fail(f"names a holder outside 0..{holders}")
    return LeafRefs(h, ids)


@dataclass(frozen=True)
class RefColumns:
    """Every rank's holders and identities per leaf (ranks x leaves), from the votes.

    Attributes:
        holders: int64[ranks, leaves], in the numbering of each vote's table (``Fragment.base``).
        lo, hi: uint64[ranks, leaves]: the two halves of each chunk's XXH3-128.
    """

    holders: np.ndarray
    lo: np.ndarray
    hi: np.ndarray

    @classmethod
    def stack(cls, fragments: list[Fragment]) -> RefColumns:
        world, leaves = len(fragments), len(fragments[0].checksums) // 8
        holders = np.zeros((world, leaves), dtype=_I8)
        ids = np.zeros((world, leaves, 2), dtype=_U8)
        for r, f in enumerate(fragments):
            if f.holders:
                holders[r] = np.frombuffer(f.holders, dtype=_I8)
            if f.ids:
                ids[r] = np.frombuffer(f.ids, dtype=_U8).reshape(leaves, 2)
        return cls(holders, np.ascontiguousarray(ids[:, :, 0]), np.ascontiguousarray(ids[:, :, 1]))


def merge_leaf_refs(columns: RefColumns, i: int, pick: slice | list[int] | np.ndarray) -> LeafRefs:
    """Leaf ``i``'s refs in chunk order, from the ranks that stored its chunks (``pick``)."""
    ids = np.stack([columns.lo[pick, i], columns.hi[pick, i]], axis=1)
    return LeafRefs(np.ascontiguousarray(columns.holders[pick, i]), np.ascontiguousarray(ids))


def used_holders(table: tuple[Holder, ...], leaves: list[LeafRefs]) -> tuple[tuple[Holder, ...], list[LeafRefs]]:
    """Drop the holders no chunk names and number the rest in order (the base's own holders may be unused)."""
    used = sorted({int(h) for refs in leaves for h in np.unique(refs.holders).tolist() if h})
    renumber = np.zeros(len(table) + 1, dtype=_I8)
    renumber[used] = np.arange(1, len(used) + 1, dtype=_I8)
    kept = tuple(table[h - 1] for h in used)
    return kept, [LeafRefs(renumber[refs.holders], refs.ids) for refs in leaves]
