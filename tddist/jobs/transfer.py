"""Moving copies of local parts between ranks, in bounded chunks, over tddist's private group.

A ``Shipment`` is one copy sent from the rank that holds it to the rank that
needs it. Every rank knows every shipment (they are planned from what the
ranks told each other), so the ranks agree on the number of rounds without a
message: in each round, every sender sends at most ``chunk`` bytes to each of
its receivers, and every receiver takes in what it got at once (``receiving``:
written to its files by replication's ``ship``, kept in memory by a
restore's ``ship_to_memory``). Each round is in flight while the previous one
is taken in and the next one read, so ``ship`` holds at most two chunks per
peer it talks to, whatever the size of the parts. Over a gloo group
(``TorchComm``) the chunks go point to point (``isend``/``irecv``), and a
restore's transfer posts all its chunks at once (``streaming``); over another
communicator, through one ``allgather`` per round (every rank sees every
chunk: correct, not fast).

A receiver checks each file's size and checksum against the shipment's as
its bytes arrive, and reports the shipments that failed; it never trusts
bytes that did not match. ``ship`` fsyncs the files it wrote. The fault
point ``replica.chunk`` (``_faults``) lies after each chunk a receiver took
in, so tests can kill a rank in the middle of a copy.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Mapping, Sequence
from io import BufferedReader

import torch

from .._faults import fault_point
from ..comm.base import Communicator
from ..errors import CommError
from ..storage.memory import Regions
from .copies import Shipment
from .receiving import FileSink, MemorySink, Sink
from .streaming import Arriving, Streaming

__all__ = ["CHUNK_BYTES", "Arriving", "Shipment", "chunk_bytes", "ship", "ship_to_memory", "start_exchange"]

logger = logging.getLogger(__name__)

#: Bytes one rank sends to one peer per round (16 MiB); ``TDDIST_REPLICA_CHUNK_BYTES`` overrides it.
CHUNK_BYTES = 16 << 20


def chunk_bytes() -> int:
    """The chunk size: ``TDDIST_REPLICA_CHUNK_BYTES`` if set (a positive int), else ``CHUNK_BYTES``."""
    value = os.environ.get("TDDIST_REPLICA_CHUNK_BYTES", "")
    return int(value) if value.isdigit() and int(value) > 0 else CHUNK_BYTES


def ship(
    comm: Communicator,
    shipments: Sequence[Shipment],
    source: Callable[[Shipment], str],
    target: Callable[[Shipment], str],
    chunk: int,
) -> list[Shipment]:
    """Send and receive ``shipments`` (collective: the same list on every rank); return those that arrived bad.

    ``source(s)``: where the sending rank reads the copy; ``target(s)``: the
    directory the receiving rank writes it into (created). Files arrive
    fsynced, directories too.
    """
    me = comm.rank
    sinks: dict[int, Sink] = {
        s: FileSink([x for x in shipments if x.dst == me and x.src == s], target) for s in _peers(shipments, me, "src")
    }
    _exchange(comm, shipments, source, sinks, chunk)
    return [bad for sink in sinks.values() for bad in sink.finish()]


def ship_to_memory(
    comm: Communicator,
    shipments: Sequence[Shipment],
    source: Callable[[Shipment], str],
    chunk: int,
    direct: Mapping[Shipment, Mapping[str, Regions]] | None = None,
) -> Arriving:
    """Start ``ship``, except that the receiving rank keeps what it receives in memory (nothing is written):
    what arrives (``streaming.Arriving``: wait for part of it, or all).

    Over a gloo group the transfer runs in the background until waited for
    (``streaming.Streaming``); over another communicator it runs in rounds
    here, and has ended when this returns. Either way each chunk is received
    in place into its files' buffers and hashed as it arrives; a shipment any
    of whose files does not match its checksum is bad. Over a gloo group, the
    leaves ``direct`` places in the state are received there (``direct``).
    """
    from ..comm.gloo import TorchComm

    if isinstance(comm, TorchComm):
        return Streaming(comm, shipments, source, chunk, direct)
    me = comm.rank
    sinks = {s: MemorySink([x for x in shipments if x.dst == me and x.src == s]) for s in _peers(shipments, me, "src")}
    _exchange(comm, shipments, source, dict(sinks), chunk)
    bad = tuple(b for sink in sinks.values() for b in sink.finish())
    return Arriving({s: f for sink in sinks.values() for s, f in sink.files.items()}, bad)


def _exchange(
    comm: Communicator,
    shipments: Sequence[Shipment],
    source: Callable[[Shipment], str],
    sinks: Mapping[int, Sink],
    chunk: int,
) -> None:
    """The rounds of ``ship``: this rank sends its shipments' bytes and hands what it receives to ``sinks``."""
    me = comm.rank
    readers = {
        d: _Reader([s for s in shipments if s.src == me and s.dst == d], source, chunk)
        for d in _peers(shipments, me, "dst")
    }
    totals: dict[tuple[int, int], int] = {}
    for x in shipments:
        totals[(x.src, x.dst)] = totals.get((x.src, x.dst), 0) + x.size
    rounds = max((-(-n // chunk) for n in totals.values()), default=0)
    left = {src: totals[(src, me)] for src in sinks}
    outgoing = {d: r.read() for d, r in readers.items()}
    arrived: dict[int, int] = {}
    for i in range(rounds):  # round i is in flight while round i-1 is taken in and round i+1 read
        expect = {src: min(chunk, n) for src, n in left.items() if n > 0}
        left = {src: n - expect.get(src, 0) for src, n in left.items()}
        into = {src: sinks[src].buffer(n) for src, n in expect.items()}
        finish = start_exchange(comm, {d: b for d, b in outgoing.items() if len(b)}, into)
        _take(sinks, arrived, me)
        outgoing = {d: r.read() for d, r in readers.items()} if i + 1 < rounds else {}
        finish()
        arrived = expect
    _take(sinks, arrived, me)


def _take(sinks: Mapping[int, Sink], arrived: Mapping[int, int], me: int) -> None:
    for src, n in arrived.items():
        sinks[src].arrived(n)
        fault_point("replica.chunk", me)


def _peers(shipments: Sequence[Shipment], me: int, field: str) -> list[int]:
    other = "src" if field == "dst" else "dst"
    return sorted({getattr(s, field) for s in shipments if getattr(s, other) == me and getattr(s, field) != me})


def start_exchange(
    comm: Communicator, outgoing: Mapping[int, memoryview], incoming: Mapping[int, torch.Tensor]
) -> Callable[[], None]:
    """Start sending ``outgoing[dst]`` to each ``dst`` and receiving into ``incoming[src]`` (a flat uint8 tensor,
    filled whole) from each ``src``; the function returned waits for both.

    Point to point over a gloo group, in flight until waited for; over any
    other communicator every rank must call it in the same round: it gathers
    the chunks at once.
    """
    from ..comm.gloo import TorchComm

    if isinstance(comm, TorchComm):
        return _point_to_point(comm, outgoing, incoming)
    everyone = comm.allgather({d: bytes(b) for d, b in outgoing.items()})
    for s, into in incoming.items():
        into.copy_(torch.frombuffer(bytearray(everyone[s][comm.rank]), dtype=torch.uint8))
    return lambda: None


def _point_to_point(
    comm: object, outgoing: Mapping[int, memoryview], incoming: Mapping[int, torch.Tensor]
) -> Callable[[], None]:
    import torch.distributed as dist

    group = comm.group  # type: ignore[attr-defined]
    rank = comm.rank  # type: ignore[attr-defined]

    def failed(e: Exception) -> CommError:  # gloo raises RuntimeError on a dead peer or a timeout
        return CommError(
            f"rank {rank}: sending a local part's copy to ranks {sorted(outgoing)} and receiving from "
            f"{sorted(incoming)} failed: {type(e).__name__}: {e}. A peer is gone; the copy is not complete"
        )

    try:
        works = [dist.irecv(b, group=group, group_src=s) for s, b in incoming.items()]
        sends = {d: torch.frombuffer(data, dtype=torch.uint8) for d, data in outgoing.items()}  # no copy
        works += [dist.isend(t, group=group, group_dst=d) for d, t in sends.items()]
    except Exception as e:
        raise failed(e) from e

    def finish() -> None:
        try:
            for w in works:
                if w is not None:
                    w.wait()
        except Exception as e:
            raise failed(e) from e
        sends.clear()  # sent: the buffers may go

    return finish


class _Reader:
    """The bytes of a rank's shipments to one peer, in order, read a chunk at a time into two buffers in turn
    (one is in flight while the other is filled).

    Each file gives exactly the size its shipment announced: a file that
    is shorter, unreadable or gone is padded with zeros (the receiver finds
    the checksum wrong), so the ranks never disagree on how much is sent.
    """

    def __init__(self, shipments: list[Shipment], source: Callable[[Shipment], str], chunk: int) -> None:
        self._files = [(os.path.join(source(s), f.name), f.size) for s in shipments for f in s.files]
        total = sum(size for _path, size in self._files)
        self._buffers = [bytearray(min(chunk, total)) for _turn in range(2 if total > chunk else 1)]
        self._turn = 0
        self._handle: BufferedReader | None = None
        self._index = 0
        self._left = self._files[0][1] if self._files else 0

    def read(self) -> memoryview:
        """The next chunk (at most the chunk size; empty once all was read), valid until the call after next."""
        buf = memoryview(self._buffers[self._turn]) if self._buffers else memoryview(b"")
        self._turn = (self._turn + 1) % max(1, len(self._buffers))
        filled = 0
        while filled < len(buf) and self._index < len(self._files):
            want = min(len(buf) - filled, self._left)
            got = self._read(buf[filled : filled + want])
            buf[filled + got : filled + want] = bytes(want - got)
            filled += want
            self._left -= want
            if self._left == 0:
                self._next()
        return buf[:filled]

    def _read(self, into: memoryview) -> int:
        path = self._files[self._index][0]
        try:
            if self._handle is None:
                self._handle = open(path, "rb")
            got = 0
            while got < len(into) and (n := self._handle.readinto(into[got:])):
                got += n
            return got
        except OSError as e:
            logger.warning("reading %s to send it failed: %s; zeros are sent instead", path, e)
            return 0

    def _next(self) -> None:
        if self._handle is not None:
            self._handle.close()
        self._handle, self._index = None, self._index + 1
        self._left = self._files[self._index][1] if self._index < len(self._files) else 0
