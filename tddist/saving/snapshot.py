"""Snapshots for asynchronous saves, into buffers reused from one save to the next.

``save(return_early=True)`` must return as soon as the data is safe from the
training loop's in-place updates: one memory copy of the local shard into
CPU buffers. Allocating the whole state at every save would double the peak
memory and cost page faults, so buffers are kept per (key, shape, dtype) and
reused; at most one save per communicator is in flight, so a buffer is never
written while the previous save still reads it.

A CUDA source is copied into pinned buffers with non-blocking copies on a
side stream, which first waits for the work already queued on the source's
current stream (so the copy sees every update enqueued before ``save``). The
current stream then waits for the copies (an event, not a host wait), so an
in-place update enqueued after ``save`` returns cannot overtake them, and the
background writer waits for the event before it reads a buffer
(``wait_copies``). The trainer's thread never waits for the device.
"""

from __future__ import annotations

import os
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Protocol

import torch

from .._compat import dtensor_local
from ..core.sharding import even_split
from ..core.types import Key

_PARALLEL_COPY_BYTES = 64 * 1024 * 1024
_COPY_THREADS = max(1, min(4, len(os.sched_getaffinity(0))))


class Snapshotter(Protocol):
    """What ``prepare.prepare_shard`` needs to take the bytes of an asynchronous save."""

    def snapshot(self, key: Key, t: torch.Tensor) -> torch.Tensor:
        """What the save item holds for leaf ``key`` (a copy, or a stand-in with its shape and dtype)."""
        ...

    def synchronize(self) -> None:
        """Called once every leaf was taken."""
        ...

    def retain_only(self, keys: set[Key]) -> None:
        """Forget what belongs to leaves the latest save no longer has."""
        ...


def local_source(t: torch.Tensor) -> torch.Tensor:
    """The tensor whose bytes are saved: a DTensor's local shard, detached, conjugation and negation resolved."""
    if hasattr(t, "to_local") and hasattr(t, "device_mesh"):
        t = dtensor_local(t)
    if t.requires_grad:  # only then is there an autograd graph to leave (a detached view costs 1 us a leaf)
        t = t.detach()
    if t.is_conj():
        t = t.resolve_conj()
    if t.is_neg():
        t = t.resolve_neg()
    return t


class SnapshotBuffers:
    """CPU buffers keyed by leaf, reused across saves of the same state."""

    def __init__(self) -> None:
        self._buffers: dict[Key, torch.Tensor] = {}
        self._flat: dict[torch.dtype, torch.Tensor] = {}  # one flat buffer per dtype (``flat``)
        self._lock = threading.Lock()
        self.allocations = 0  # how many buffers were ever allocated (tests and benchmarks read it)
        self.generation = 0  # bumped whenever a buffer is allocated or freed (a kept deferred plan checks it)
        self._copier: ThreadPoolExecutor | None = None
        self._streams: dict[torch.device, Any] = {}  # a side stream per CUDA device
        self._pending: list[Any] = []  # CUDA events of copies issued since the last synchronize()
        self._events: list[Any] = []  # events the writer waits for (wait_copies)

    def snapshot(self, key: Key, t: torch.Tensor) -> torch.Tensor:
        """A CPU copy of ``t`` (a DTensor's local shard) in this key's reusable buffer."""
        t = local_source(t)
        cuda = t.device.type == "cuda"
        with self._lock:
            buf = self._buffers.get(key)
            if buf is None or buf.shape != t.shape or buf.dtype != t.dtype or buf.is_pinned() != cuda:
                buf = torch.empty(t.shape, dtype=t.dtype, pin_memory=cuda)
                self._buffers[key] = buf
                self.allocations += 1
                self.generation += 1
        if cuda:
            self._copy_on_side_stream(buf, t)
        elif t.numel() * t.element_size() < _PARALLEL_COPY_BYTES or not t.is_contiguous():
            buf.copy_(t)
        else:  # one large host copy: split over threads (copy_ releases the GIL)
            src, dst = t.reshape(-1), buf.view(-1)
            bounds = even_split(src.numel(), _COPY_THREADS)
            list(self._pool().map(lambda b: dst[b[0] : b[1]].copy_(src[b[0] : b[1]]), bounds))
        return buf

    def _copy_on_side_stream(self, buf: torch.Tensor, t: torch.Tensor) -> None:
        """Queue the device-to-host copy on the device's side stream, after the work queued so far."""
        stream = self._streams.get(t.device)
        if stream is None:
            stream = self._streams[t.device] = torch.cuda.Stream(device=t.device)
        stream.wait_stream(torch.cuda.current_stream(t.device))
        with torch.cuda.stream(stream):
            buf.copy_(t, non_blocking=True)
        t.record_stream(stream)  # the caching allocator must not reuse t's memory before the copy ran
        event = torch.cuda.Event()
        event.record(stream)
        self._pending.append((t.device, event))

    def _pool(self) -> ThreadPoolExecutor:
        if self._copier is None:
            self._copier = ThreadPoolExecutor(_COPY_THREADS, thread_name_prefix="tddist-snapshot")
        return self._copier

    def synchronize(self) -> None:
        """Order later work on each device's current stream after the copies (no host wait)."""
        for device, event in self._pending:
            torch.cuda.current_stream(device).wait_event(event)
        self._events, self._pending = [e for _d, e in self._pending], []

    def defer_pending(self) -> list[Any]:
        """The events of the copies issued since the last ``synchronize``, which later work on the current
        streams does not wait for (a deferred snapshot: its guard waits for them); the writer still does."""
        events = [e for _d, e in self._pending]
        self._events, self._pending = [*self._events, *events], []
        return events

    def wait_copies(self) -> None:
        """Block until the device-to-host copies of the latest snapshot are done (the writer calls it)."""
        for event in self._events:
            event.synchronize()
        self._events = []

    def flat(self, dtype: torch.dtype, numel: int) -> torch.Tensor:
        """A reusable one-dimensional host buffer of ``numel`` elements of ``dtype`` (one per dtype): the small
        leaves of a deferred save, each a view of it, copied by one ``torch.cat`` (``saving.eager``)."""
        with self._lock:
            buf = self._flat.get(dtype)
            if buf is None or buf.numel() != numel:
                buf = self._flat[dtype] = torch.empty(numel, dtype=dtype)
                self.allocations += 1
                self.generation += 1
        return buf

    def retain_only(self, keys: set[Key], flat: set[torch.dtype] | None = None) -> None:
        """Free buffers of keys that the latest save no longer has, and the flat buffers of other dtypes
        than ``flat`` (all of them by default: only a deferred save uses them)."""
        with self._lock:
            for k in [k for k in self._buffers if k not in keys]:
                del self._buffers[k]
                self.generation += 1
            for d in [d for d in self._flat if d not in (flat or ())]:
                del self._flat[d]
                self.generation += 1

    def nbytes(self) -> int:
        """Bytes held in buffers."""
        with self._lock:
            return sum(b.numel() * b.element_size() for b in [*self._buffers.values(), *self._flat.values()])
