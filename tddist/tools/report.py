"""What ``verify`` reports: the kinds of problem, a ``Problem``, the ``VerifyReport``, and the sizes it counts.

Apart from the checks themselves (``verify`` on files, ``verify_objects`` on
object storage), which both build these.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from .. import format as fmt
from ..manifest.model import Leaf, Manifest, NonFiniteLeaf

#: Kinds of ``Problem``.
MISSING = "missing"  # the chunk's file (a rank's data file) or archive entry is not there
SIZE = "size"  # it has another size than the manifest says
NOT_A_FILE = "not-a-file"  # a symbolic link, a directory, or a path resolving outside the checkpoint
CHECKSUM = "checksum"  # its bytes do not match the checksum
UNREADABLE = "unreadable"  # reading or decompressing it failed
STRUCTURE = "structure"  # the checkpoint as a whole: an archive that is not a valid zip, a missing rank directory
HOLDER = "holder"  # a checkpoint that holds referenced chunks (an incremental one's) is missing, damaged or replaced


@dataclass(frozen=True)
class Problem:
    """One thing wrong with a checkpoint.

    Attributes:
        kind: ``"missing"``, ``"size"``, ``"not-a-file"``, ``"checksum"``,
            ``"unreadable"`` or ``"structure"``.
        key: the leaf the chunk belongs to, or None for a problem of a whole
            file (a rank's data file) or of the whole checkpoint.
        rank: the rank that wrote the chunk (or the file), or None.
        file: the file relative to the checkpoint (a rank's data file, the
            chunk's own file, its archive entry's name), or None.
        message: what is wrong and what to do, in words.
        offset: where the chunk starts in ``file`` (a rank's data file), or
            None when the chunk is the whole file or the problem is not a chunk's.
    """

    kind: str
    key: tuple[str, ...] | None
    rank: int | None
    file: str | None
    message: str
    offset: int | None = None


@dataclass(frozen=True)
class VerifyReport:
    """The outcome of ``verify``.

    Attributes:
        path: the checkpoint checked.
        mode: ``"quick"`` (sizes and structure) or ``"full"`` (checksums too).
        layout: ``"directory"`` or ``"archive"``.
        world_size: the number of ranks that saved it.
        chunks: the number of chunks checked.
        nbytes: the bytes those chunks hold (what a full check reads).
        problems: every problem found: those of whole files and of the
            checkpoint first (by rank), then the chunks' in manifest order.
        packing: ``"packed"`` (one data file per rank) or ``"memmap"`` (one file
            or archive entry per chunk).
        non_finite: the leaves whose recorded counts show NaN or infinite
            values (format version 4): a finding about the data, not damage,
            so ``ok`` does not depend on it.
    """

    path: str
    mode: str
    layout: str
    world_size: int
    chunks: int
    nbytes: int
    problems: tuple[Problem, ...]
    packing: str = "memmap"
    non_finite: tuple[NonFiniteLeaf, ...] = ()

    @property
    def ok(self) -> bool:
        """True when no problem was found."""
        return not self.problems


def leaf_nbytes(leaf: Leaf) -> int:
    """The bytes a leaf's chunks hold together (its chunks tile its shape exactly); builds no chunk."""
    return math.prod(leaf.shape) * fmt.dtype_itemsize(leaf.dtype_name)


def stored_bytes(manifest: Manifest) -> int:
    """The bytes of tensor data a checkpoint holds (what a full ``verify`` reads), from its manifest alone."""
    return sum(leaf_nbytes(leaf) for leaf in manifest.leaves.values())


def chunk_count(manifest: Manifest) -> int:
    """The number of chunks a checkpoint stores (empty ones included), without building them."""
    return sum(len(leaf.table) for leaf in manifest.leaves.values())
