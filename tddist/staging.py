"""Snapshots for asynchronous saves, into buffers reused from one save to the next.

``save(return_early=True)`` must return as soon as the data is safe from the
training loop's in-place updates: one memory copy of the local shard into
CPU buffers. Allocating the whole state at every save would double the peak
memory and cost page faults, so buffers are kept per (key, shape, dtype) and
reused; at most one save per communicator is in flight, so a buffer is never
written while the previous save still reads it.
"""

from __future__ import annotations

import logging
import threading

import torch

logger = logging.getLogger(__name__)


class SnapshotBuffers:
    """CPU buffers keyed by leaf, reused across saves of the same state."""

    def __init__(self) -> None:
        self._buffers: dict[tuple, torch.Tensor] = {}
        self._lock = threading.Lock()
        self.allocations = 0  # how many buffers were ever allocated (tests and benchmarks read it)

    def snapshot(self, key: tuple, t: torch.Tensor) -> torch.Tensor:
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
        buf.copy_(t, non_blocking=buf.is_pinned())
        return buf

    def synchronize(self) -> None:
        """Wait for device-to-host copies issued with ``non_blocking``."""
        if torch.cuda.is_available() and any(b.is_pinned() for b in self._buffers.values()):
            torch.cuda.synchronize()

    def retain_only(self, keys: set) -> None:
        """Free buffers of keys that the latest save no longer has."""
        with self._lock:
            for k in [k for k in self._buffers if k not in keys]:
                del self._buffers[k]
