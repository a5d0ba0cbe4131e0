"""Which file, if any, a tensor's memory is mapped from (Linux ``/proc/self/maps``).

``save`` refuses, unless ``copy_existing=True``, a tensor mapped from a file
(for example one loaded from a checkpoint), whoever mapped it: a tddist load, a
tensordict ``MemoryMappedTensor`` or ``torch.from_file``. The kernel's list of
this process's mappings is the only source that knows all of them.
"""

from __future__ import annotations

import bisect
from typing import NamedTuple

import torch


class Mapping(NamedTuple):
    """One memory map of a regular file: ``[start, end)`` in this process's address space."""

    start: int
    end: int
    path: str


def file_mappings() -> list[Mapping]:
    """This process's memory maps of regular files, sorted by address (empty where /proc is missing)."""
    out = []
    try:
        with open("/proc/self/maps") as f:
            for line in f:
                parts = line.split(maxsplit=5)
                if len(parts) < 6 or not parts[5].startswith("/") or parts[5].startswith(("/dev/", "/memfd:")):
                    continue
                lo, hi = (int(x, 16) for x in parts[0].split("-"))
                out.append(Mapping(lo, hi, parts[5].rstrip("\n")))
    except OSError:
        return []
    out.sort()
    return out


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
