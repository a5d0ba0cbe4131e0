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
same chunks from the shipments they all know (each file in pieces of at most
``chunk`` bytes, empty files none), and gloo delivers the messages between
two ranks in the order they were posted.

A file a sender cannot map whole (unreadable, gone, of another size than
announced) is sent as the bytes it can read, padded with zeros: the receiver
finds its checksum wrong.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

from .._faults import fault_point
from ..errors import CommError
from ..storage.base import map_copy_on_write
from .copies import FileSum, Shipment
from .receiving import MemorySink

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Received:
    """What a rank received in memory: each good shipment's files (uint8 tensors, by name), and the bad ones."""

    files: dict[Shipment, dict[str, torch.Tensor]]
    bad: tuple[Shipment, ...]


def pieces(size: int, chunk: int) -> list[tuple[int, int]]:
    """The ``(start, stop)`` byte ranges a file of ``size`` bytes is sent in."""
    return [(a, min(a + chunk, size)) for a in range(0, size, chunk)]


class Streaming:
    """One restore's transfer in flight over a gloo group (see the module docstring)."""

    def __init__(
        self, comm: object, shipments: Sequence[Shipment], source: Callable[[Shipment], str], chunk: int
    ) -> None:
        self._group, self.rank = comm.group, comm.rank  # type: ignore[attr-defined]
        me = self.rank
        self._sinks = {
            s: MemorySink([x for x in shipments if x.dst == me and x.src == s]) for s in _srcs(shipments, me)
        }
        self._sends: list[tuple[dist.Work | None, torch.Tensor]] = []
        self._recvs: list[tuple[dist.Work | None, int, int]] = []  # (work, src, bytes)
        try:
            for src, sink in self._sinks.items():
                for s in sink.files:
                    for f in s.files:
                        for a, b in pieces(f.size, chunk):
                            work = dist.irecv(sink.buffer(b - a), group=self._group, group_src=src)
                            self._recvs.append((work, src, b - a))
            for s in shipments:
                if s.src == me and s.dst != me:
                    for f in s.files:
                        data = _source_bytes(os.path.join(source(s), f.name), f)
                        for a, b in pieces(f.size, chunk):
                            view = data[a:b]
                            self._sends.append((dist.isend(view, group=self._group, group_dst=s.dst), view))
        except Exception as e:
            raise self._failed(e) from e

    def wait(self) -> Received:
        """Wait for every chunk (hashing each received one as it arrives); what this rank received."""
        try:
            for work, src, n in self._recvs:
                if work is not None:
                    work.wait()
                self._sinks[src].arrived(n)
                fault_point("replica.chunk", self.rank)
            for work, _view in self._sends:
                if work is not None:
                    work.wait()
        except RuntimeError as e:  # gloo raises RuntimeError on a dead peer or a timeout
            raise self._failed(e) from e
        finally:
            self._sends.clear()  # sent: the maps may go
        bad = [b for sink in self._sinks.values() for b in sink.finish()]
        files = {s: f for sink in self._sinks.values() for s, f in sink.files.items() if s not in bad}
        return Received(files, tuple(bad))

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
