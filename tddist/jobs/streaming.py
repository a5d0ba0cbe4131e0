"""A restore's transfer over a gloo group: every chunk posted at once, sent from maps of the files, received
in place into memory.

Replication moves copies in rounds of bounded chunks (``transfer.ship``:
bounded memory, on any communicator). A restore needs the whole part in
memory anyway (it loads it from there), so over a gloo group (``TorchComm``)
``start`` posts every chunk of every shipment at once: the sender's are
views of its files mapped copy-on-write (no copy, no read before the send),
the receiver's are the places in its ``receiving.MemorySink`` where the
bytes belong. The transfer then runs in gloo's threads while this rank does
other work (a sender checks and loads its own copy); ``Streaming.wait``
hashes each chunk as it arrives and returns what came. Both sides cut the
same chunks from the shipments they all know (each file cut at its whole
leaves' bounds, then in pieces of at most ``chunk`` bytes, empty files none:
``direct.cuts``; the pieces of a leaf the receiver's state holds are received
straight into it, ``direct``), and gloo delivers the messages between
two ranks in the order they were posted.

A file a sender cannot map whole (unreadable, gone, of another size than
announced) is sent as the bytes it can read, padded with zeros: the receiver
finds its checksum wrong.
"""

from __future__ import annotations

import logging
import os
import threading
from collections import deque
from collections.abc import Callable, Mapping, Sequence

import torch
import torch.distributed as dist

from .._faults import fault_point
from ..errors import CommError
from ..storage.base import map_copy_on_write
from ..storage.memory import Regions
from .copies import FileSum, Shipment
from .direct import cuts
from .receiving import MemorySink

logger = logging.getLogger(__name__)


class Arriving:
    """What a rank receives in memory, arriving: each shipment's files (uint8 tensors, by name, filled as the
    bytes arrive), ``until`` to wait for some of them, ``wait`` for all.

    This base class is a transfer that already ended (``transfer.ship_to_memory`` over a communicator that
    is not gloo): every byte is there.
    """

    def __init__(
        self,
        files: dict[Shipment, dict[str, torch.Tensor]],
        bad: tuple[Shipment, ...] = (),
        direct: Mapping[Shipment, Mapping[str, Regions]] | None = None,
    ) -> None:
        self.files = files
        self.direct = dict(direct or {})  # the bytes of each shipment's files received in the state (``direct``)
        self._bad = bad

    def until(self, shipment: Shipment, name: str, end: int) -> None:
        """Wait until the first ``end`` bytes of the file ``name`` of ``shipment`` arrived (hashed, not checked
        yet: the file's checksum is known once it arrived whole, ``wait``)."""

    def wait(self) -> tuple[Shipment, ...]:
        """Wait for every chunk; the shipments that arrived bad (their bytes must not be used)."""
        return self._bad


class Streaming(Arriving):
    """One restore's transfer in flight over a gloo group (see the module docstring)."""

    def __init__(
        self,
        comm: object,
        shipments: Sequence[Shipment],
        source: Callable[[Shipment], str],
        chunk: int,
        direct: Mapping[Shipment, Mapping[str, Regions]] | None = None,
    ) -> None:
        self._group, self.rank = comm.group, comm.rank  # type: ignore[attr-defined]
        me = self.rank
        self._sinks = {
            s: MemorySink([x for x in shipments if x.dst == me and x.src == s], direct) for s in _srcs(shipments, me)
        }
        files = {s: f for sink in self._sinks.values() for s, f in sink.files.items()}
        super().__init__(files, direct={s: r for sink in self._sinks.values() for s, r in sink.direct.items() if r})
        self._sends: list[tuple[dist.Work | None, torch.Tensor]] = []
        self._recvs: dict[int, deque[tuple[dist.Work | None, int]]] = {src: deque() for src in self._sinks}
        self._done = dict.fromkeys(self._sinks, 0)  # bytes arrived from each peer
        self._lock = threading.Lock()  # a load may read the files from several threads
        try:
            for src, sink in self._sinks.items():
                for s in sink.files:
                    for f in s.files:
                        for a, b in cuts(f, s.spans, chunk):
                            work = dist.irecv(sink.buffer(b - a), group=self._group, group_src=src)
                            self._recvs[src].append((work, b - a))
            for s in shipments:
                if s.src == me and s.dst != me:
                    for f in s.files:
                        data = _source_bytes(os.path.join(source(s), f.name), f)
                        for a, b in cuts(f, s.spans, chunk):
                            view = data[a:b]
                            self._sends.append((dist.isend(view, group=self._group, group_dst=s.dst), view))
        except Exception as e:
            raise self._failed(e) from e

    def until(self, shipment: Shipment, name: str, end: int) -> None:
        src = shipment.src
        self._take(src, self._sinks[src].offsets[(shipment, name)] + end)

    def wait(self) -> tuple[Shipment, ...]:
        """Wait for every chunk (hashing each received one as it arrives); the shipments that arrived bad."""
        for src in self._sinks:
            self._take(src, None)
        try:
            for work, _view in self._sends:
                if work is not None:
                    work.wait()
        except RuntimeError as e:  # gloo raises RuntimeError on a dead peer or a timeout
            raise self._failed(e) from e
        finally:
            self._sends.clear()  # sent: the maps may go
        return tuple(b for sink in self._sinks.values() for b in sink.finish())

    def _take(self, src: int, end: int | None) -> None:
        """Take in the chunks from ``src`` in order until ``end`` bytes (None: all) arrived."""
        with self._lock:
            pending = self._recvs[src]
            while pending and (end is None or self._done[src] < end):
                work, n = pending.popleft()
                try:
                    if work is not None:
                        work.wait()
                except RuntimeError as e:  # gloo raises RuntimeError on a dead peer or a timeout
                    raise self._failed(e) from e
                self._sinks[src].arrived(n)
                self._done[src] += n
                fault_point("replica.chunk", self.rank)

    def _failed(self, e: Exception) -> CommError:
        return CommError(
            f"rank {self.rank}: sending local parts' copies and receiving from ranks {sorted(self._sinks)} failed: "
            f"{type(e).__name__}: {e}. A peer is gone; the copy is not complete"
        )


def _srcs(shipments: Sequence[Shipment], me: int) -> list[int]:
    return sorted({s.src for s in shipments if s.dst == me and s.src != me})


def _source_bytes(path: str, f: FileSum) -> torch.Tensor:
    """The file's ``f.size`` bytes: its copy-on-write map, or what can be read of it padded with zeros."""
    try:
        if f.size and os.path.getsize(path) == f.size:
            return map_copy_on_write(path, f.size)
    except OSError as e:
        logger.warning("mapping %s to send it failed: %s; reading it instead", path, e)
    out = torch.zeros(f.size, dtype=torch.uint8)
    view, got = out.numpy().data, 0
    try:
        with open(path, "rb") as fh:
            while got < f.size and (n := fh.readinto(view[got:])):
                got += n
    except OSError as e:
        logger.warning("reading %s to send it failed: %s; zeros are sent instead", path, e)
    if got != f.size:
        logger.warning("%s has %d bytes of the %d announced: the rest is sent as zeros", path, got, f.size)
    return out
