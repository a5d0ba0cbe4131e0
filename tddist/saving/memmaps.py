"""Which file, if any, a tensor's memory is mapped from (Linux ``/proc/self/maps``).

``save`` refuses, unless ``copy_existing=True``, a tensor mapped from a file
(for example one loaded from a checkpoint), whoever mapped it: a tddist load, a
tensordict ``MemoryMappedTensor`` or ``torch.from_file``. The kernel's list of
this process's mappings is the only source that knows all of them.

Reading it costs about a millisecond with torch loaded, on the blocking path
of every save, so it is read only for storages that torch's allocator may not
own (``allocated_by_torch``) and that no earlier save found unmapped
(``_Unmapped``).
"""

from __future__ import annotations

import bisect
import re
import threading
from collections.abc import Mapping as MappingOf
from typing import NamedTuple, TypeVar

import torch
from torch.multiprocessing.reductions import StorageWeakRef

K = TypeVar("K")


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
    ``numpy.memmap``, ``torch.frombuffer`` of an ``mmap``) is not. So is one
    that torch allocated but exported to numpy (``t.numpy()`` marks it not
    resizable for good), which ``_Unmapped`` then remembers.
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


class _Unmapped:
    """Storages found not mapped from a file by an earlier check, remembered while they live.

    A storage's memory stays where it is for the storage's whole life (only
    ``resize_`` moves it, which the recorded address and size catch), so the
    verdict of one reading of ``/proc/self/maps`` holds for the next saves of
    the same leaves: a training loop whose parameters were ever exported to
    numpy reads it once, not at every save. A storage is held by a weak
    reference (torch's ``StorageWeakRef``): it keeps the storage's C++ object
    from being reused by another storage while the entry exists, and tells
    when the storage is gone.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._seen: dict[int, tuple[StorageWeakRef, int, int]] = {}  # storage object -> (ref, address, bytes)

    @staticmethod
    def _identity(s: torch.UntypedStorage) -> tuple[int, int, int]:
        return s._cdata, s.data_ptr(), s.nbytes()

    def known(self, t: torch.Tensor) -> bool:
        """Whether ``t``'s storage, at its present address and size, was found unmapped before."""
        try:
            cdata, ptr, nbytes = self._identity(t.untyped_storage())
        except RuntimeError:  # no storage (a tensor subclass without one): never remembered
            return False
        with self._lock:
            entry = self._seen.get(cdata)
            return entry is not None and entry[1:] == (ptr, nbytes) and not entry[0].expired()

    def remember(self, tensors: list[torch.Tensor]) -> None:
        """Record the storages of ``tensors`` as unmapped; forget those that died since."""
        with self._lock:
            for k in [k for k, entry in self._seen.items() if entry[0].expired()]:
                del self._seen[k]
            for t in tensors:
                s = t.untyped_storage()
                cdata, ptr, nbytes = self._identity(s)
                self._seen[cdata] = (StorageWeakRef(s), ptr, nbytes)

    def __len__(self) -> int:
        with self._lock:
            return len(self._seen)


_unmapped = _Unmapped()


def mapped_files(tensors: MappingOf[K, torch.Tensor]) -> dict[K, str]:
    """The tensors of ``tensors`` whose memory is mapped from a file, with the file's path.

    ``/proc/self/maps`` is read at most once, and only when some tensor is
    neither ``allocated_by_torch`` nor known unmapped from an earlier call.
    """
    suspects = {k: t for k, t in tensors.items() if not allocated_by_torch(t) and not _unmapped.known(t)}
    if not suspects:
        return {}
    mappings = file_mappings()
    found = {k: path for k, t in suspects.items() if (path := mapped_file(t, mappings)) is not None}
    # every other leaf is remembered too: a save exports its leaves to numpy, which makes them suspects next time
    _unmapped.remember([t for k, t in tensors.items() if k not in found and _has_storage(t)])
    return found


def _has_storage(t: torch.Tensor) -> bool:
    try:
        return bool(t.untyped_storage().data_ptr())
    except RuntimeError:
        return False
