"""Leaves handed to a writer as maps of files, whose pages are dropped once the writer has written them.

``torch.save`` and ``dcp.save`` take every leaf at once, then write them one
after another. A leaf handed to them is a copy-on-write map of a file
(``Selection.spilled_leaves``): its pages cost no anonymous memory, but every
page the writer reads stays in the process's resident memory while the leaf
is mapped, so without help a conversion's resident size would grow to the
whole checkpoint. ``MappedLeaves`` records each such leaf; once the writer has
written one, its pages are dropped (``_fs.drop_pages``): ``torch.save``
writes each storage in one call to the file object it is given
(``ReleasingFile`` sees it go by), ``dcp.save`` asks its planner for each
item just before writing it (the previous one is written by then).
"""

from __future__ import annotations

import io
from typing import TYPE_CHECKING, Any

import numpy as np

from .._fs import _load_libc, drop_pages

if TYPE_CHECKING:
    import torch


class MappedLeaves:
    """The address ranges of the leaves that are maps of files nobody writes to (only those may be dropped)."""

    def __init__(self) -> None:
        self._ends: dict[int, int] = {}  # first byte's address -> past the last byte
        self._last: int | None = None  # the leaf a writer asked for last (``resolved``)
        self._written: int | None = None  # the leaf last written through ``written``

    def add(self, t: torch.Tensor) -> None:
        """Record ``t``, a whole map of a file (its own storage), as droppable."""
        nbytes = t.numel() * t.element_size()
        if nbytes:
            self._ends[t.data_ptr()] = t.data_ptr() + nbytes

    def written(self, address: int, nbytes: int) -> None:
        """``nbytes`` at ``address`` were written out: drop their pages if they are one recorded leaf's.

        The leaf written before is dropped again: ``torch.save`` reads the
        first 2 MiB of a storage once more after writing it (measured, torch
        2.13), which would otherwise stay resident for every leaf.
        """
        end = self._ends.get(address)
        if end is None or address + nbytes > end:
            return
        if self._written is not None and self._written != address:
            drop_pages(self._written, self._ends[self._written] - self._written)
        drop_pages(address, nbytes)
        self._written = address

    def resolved(self, data: Any) -> None:
        """A writer asked for ``data`` to write next: the leaf it asked for before is written, drop it."""
        if self._last is not None:
            self.written(self._last, self._ends[self._last] - self._last)
            self._last = None
        ptr = data.data_ptr() if hasattr(data, "data_ptr") else None
        if ptr in self._ends:
            self._last = ptr


def trim_heap() -> None:
    """Hand the free memory inside malloc's heap back to the kernel (glibc's ``malloc_trim``).

    A leaf read into memory and freed once spilled leaves a hole in the heap
    (glibc serves large blocks from the heap once one was freed); small
    objects kept meanwhile land in the hole, so the next leaf extends the heap
    and, without a trim, the process keeps every leaf's worth of freed memory
    resident. A no-op where the C library has no ``malloc_trim``.
    """
    trim = getattr(_load_libc(), "malloc_trim", None)
    if trim is not None:
        trim(0)


class ReleasingFile(io.RawIOBase):
    """A binary file for ``torch.save`` that drops a recorded leaf's pages once its bytes are written."""

    def __init__(self, f: io.BufferedWriter, leaves: MappedLeaves) -> None:
        super().__init__()
        self._f = f
        self._leaves = leaves

    def writable(self) -> bool:
        return True

    def write(self, b: Any) -> int:
        view = memoryview(b)
        n = self._f.write(view)
        if view.nbytes >= 1 << 16:  # a storage (a header is a few bytes)
            address = np.frombuffer(view.cast("B"), np.uint8).ctypes.data
            self._leaves.written(address, view.nbytes)
        return n
