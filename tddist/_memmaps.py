"""Which file, if any, a tensor's memory is mapped from (Linux ``/proc/self/maps``).

``save`` refuses, unless ``copy_existing=True``, a tensor mapped from a file
(for example one loaded from a checkpoint), whoever mapped it: a tddist load, a
tensordict ``MemoryMappedTensor`` or ``torch.from_file``. The kernel's list of
this process's mappings is the only source that knows all of them.
"""

from __future__ import annotations

import bisect
import re
from typing import NamedTuple

import torch


class Mapping(NamedTuple):
    """One memory map of a regular file: ``[start, end)`` in this process's address space."""

    start: int
    end: int
    path: str


#: A line of ``/proc/self/maps`` that maps a file: ``start-end perms offset dev inode   /path``.
_FILE_LINE = re.compile(rb"^([0-9a-f]+)-([0-9a-f]+) \S+ \S+ \S+ \S+ +(/[^\n]*)$", re.MULTILINE)


def file_mappings() -> list[Mapping]:
    """This process's memory maps of regular files, sorted by address (empty where /proc is missing).

    Parsed with one compiled pattern over the whole text: a save calls this on
    its blocking path, and a process with torch loaded has hundreds of maps.
    """
    try:
        with open("/proc/self/maps", "rb") as f:
            text = f.read()
    except OSError:
        return []
    out = [
        Mapping(int(m.group(1), 16), int(m.group(2), 16), m.group(3).decode(errors="replace"))
        for m in _FILE_LINE.finditer(text)
        if not m.group(3).startswith((b"/dev/", b"/memfd:"))
    ]
    out.sort()
    return out


def allocated_by_torch(t: torch.Tensor) -> bool:
    """Whether ``t``'s memory comes from torch's own allocator, which never maps a file.

    Such a storage is resizable; one that wraps memory torch did not allocate
    (``torch.from_file``, a ``MemoryMappedTensor``, ``torch.from_numpy`` of a
    ``numpy.memmap``, ``torch.frombuffer`` of an ``mmap``) is not. It lets a
    save skip reading ``/proc/self/maps`` (about a millisecond on its blocking
    path) when no leaf could be mapped from a file.
    """
    if getattr(t, "filename", None):
        return False
    try:
        return bool(t.untyped_storage().resizable())
    except RuntimeError:
        return False


def mapped_file(t: torch.Tensor, mappings: list[Mapping] | None = None) -> str | None:
    """The file ``t``'s memory is mapped from, or None."""
    name = getattr(t, "filename", None)
    if name:
        return str(name)
    try:
        ptr = t.untyped_storage().data_ptr()
    except RuntimeError:
        return None
    if not ptr:
        return None
    mappings = file_mappings() if mappings is None else mappings
    i = bisect.bisect_right(mappings, (ptr, float("inf"), "")) - 1
    if i >= 0 and mappings[i].start <= ptr < mappings[i].end:
        return mappings[i].path
    return None
