"""Snapshots for asynchronous saves, into buffers reused from one save to the next.

``save(return_early=True)`` must return as soon as the data is safe from the
training loop's in-place updates: one memory copy of the local shard into
CPU buffers. Allocating the whole state at every save would double the peak
memory and cost page faults, so buffers are kept per (key, shape, dtype) and
reused; at most one save per communicator is in flight, so a buffer is never
written while the previous save still reads it.
"""

from __future__ import annotations

import os
import threading
from concurrent.futures import ThreadPoolExecutor

import torch

from .sharding import even_split
from .types import Key

_PARALLEL_COPY_BYTES = 64 * 1024 * 1024
_COPY_THREADS = max(1, min(4, len(os.sched_getaffinity(0))))


class SnapshotBuffers:
    """CPU buffers keyed by leaf, reused across saves of the same state."""

    def __init__(self) -> None:
        self._buffers: dict[Key, torch.Tensor] = {}
        self._lock = threading.Lock()
        self.allocations = 0  # how many buffers were ever allocated (tests and benchmarks read it)
        self._copier: ThreadPoolExecutor | None = None

    def snapshot(self, key: Key, t: torch.Tensor) -> torch.Tensor:
        """A CPU copy of ``t`` (a DTensor's local shard) in this key's reusable buffer."""
        if hasattr(t, "to_local") and hasattr(t, "device_mesh"):
            t = t.to_local()
        t = t.detach()
        if t.is_conj():
            t = t.resolve_conj()
        if t.is_neg():
            t = t.resolve_neg()
        with self._lock:
            buf = self._buffers.get(key)
            if buf is None or buf.shape != t.shape or buf.dtype != t.dtype:
                pin = t.device.type == "cuda" and torch.cuda.is_available()
                buf = torch.empty(t.shape, dtype=t.dtype, pin_memory=pin)
                self._buffers[key] = buf
                self.allocations += 1
        if buf.is_pinned() or t.numel() * t.element_size() < _PARALLEL_COPY_BYTES or not t.is_contiguous():
            buf.copy_(t, non_blocking=buf.is_pinned())
        else:  # one large host copy: split over threads (copy_ releases the GIL)
            src, dst = t.reshape(-1), buf.view(-1)
            bounds = even_split(src.numel(), _COPY_THREADS)
            list(self._pool().map(lambda b: dst[b[0] : b[1]].copy_(src[b[0] : b[1]]), bounds))
        return buf

    def _pool(self) -> ThreadPoolExecutor:
        if self._copier is None:
            self._copier = ThreadPoolExecutor(_COPY_THREADS, thread_name_prefix="tddist-snapshot")
        return self._copier

    def synchronize(self) -> None:
        """Wait for device-to-host copies issued with ``non_blocking``."""
        if torch.cuda.is_available() and any(b.is_pinned() for b in self._buffers.values()):
            torch.cuda.synchronize()

    def retain_only(self, keys: set[Key]) -> None:
        """Free buffers of keys that the latest save no longer has."""
        with self._lock:
            for k in [k for k in self._buffers if k not in keys]:
                del self._buffers[k]
