"""Moving copies of local parts between ranks, in bounded chunks, over tddist's private group.

A ``Shipment`` is one copy sent from the rank that holds it to the rank that
needs it. Every rank knows every shipment (they are planned from what the
ranks told each other), so the ranks agree on the number of rounds without a
message: in each round, every sender sends at most ``chunk`` bytes to each of
its receivers, and every receiver writes what it got to its files at once.
Each round is in flight while the previous one is written and the next one
read, so a rank holds at most two chunks per peer it talks to, whatever the
size of the parts. Over a gloo group (``TorchComm``) the chunks go point
to point (``isend``/``irecv``); over another communicator, through one
``allgather`` per round (every rank sees every chunk: correct, not fast).

A receiver checks each file's size and checksum against the shipment's,
fsyncs it, and reports the shipments that failed; it never trusts bytes that
did not match. The fault point ``replica.chunk`` (``_faults``) lies after each
chunk a receiver wrote, so tests can kill a rank in the middle of a copy.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import BinaryIO

from .._faults import fault_point
from .._fs import fsync_path, makedirs_durable
from ..checksum import Hasher
from ..comm.base import Communicator
from ..errors import CommError
from .copies import FileSum, PartId

logger = logging.getLogger(__name__)

#: Bytes one rank sends to one peer per round (16 MiB); ``TDDIST_REPLICA_CHUNK_BYTES`` overrides it.
CHUNK_BYTES = 16 << 20


def chunk_bytes() -> int:
    """The chunk size: ``TDDIST_REPLICA_CHUNK_BYTES`` if set (a positive int), else ``CHUNK_BYTES``."""
    value = os.environ.get("TDDIST_REPLICA_CHUNK_BYTES", "")
    return int(value) if value.isdigit() and int(value) > 0 else CHUNK_BYTES


@dataclass(frozen=True)
class Shipment:
    """One copy of a part sent from ``src`` to ``dst``: its files with their sizes and checksums."""

    src: int
    dst: int
    part: PartId
    files: tuple[FileSum, ...]

    @property
    def size(self) -> int:
        """Its bytes."""
        return sum(f.size for f in self.files)


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
    readers = {
        d: _Reader([s for s in shipments if s.src == me and s.dst == d], source) for d in _peers(shipments, me, "dst")
    }
    writers = {
        s: _Writer([x for x in shipments if x.dst == me and x.src == s], target) for s in _peers(shipments, me, "src")
    }
    totals: dict[tuple[int, int], int] = {}
    for x in shipments:
        totals[(x.src, x.dst)] = totals.get((x.src, x.dst), 0) + x.size
    rounds = max((-(-n // chunk) for n in totals.values()), default=0)
    left = {src: totals[(src, me)] for src in writers}
    outgoing = {d: r.read(chunk) for d, r in readers.items()}
    arrived: dict[int, memoryview] = {}
    for i in range(rounds):  # round i is in flight while round i-1 is written and round i+1 read
        expect = {src: min(chunk, n) for src, n in left.items() if n > 0}
        left = {src: n - expect.get(src, 0) for src, n in left.items()}
        finish = start_exchange(comm, {d: b for d, b in outgoing.items() if b}, expect)
        _write(writers, arrived, me)
        outgoing = {d: r.read(chunk) for d, r in readers.items()} if i + 1 < rounds else {}
        arrived = finish()
    _write(writers, arrived, me)
    bad = []
    for w in writers.values():
        bad.extend(w.finish())
    return bad


def _write(writers: Mapping[int, _Writer], arrived: Mapping[int, memoryview], me: int) -> None:
    for src, data in arrived.items():
        writers[src].write(data)
        fault_point("replica.chunk", me)


def _peers(shipments: Sequence[Shipment], me: int, field: str) -> list[int]:
    other = "src" if field == "dst" else "dst"
    return sorted({getattr(s, field) for s in shipments if getattr(s, other) == me and getattr(s, field) != me})


def start_exchange(
    comm: Communicator, outgoing: Mapping[int, bytearray], incoming: Mapping[int, int]
) -> Callable[[], dict[int, memoryview]]:
    """Start sending ``outgoing[dst]`` to each ``dst`` and receiving ``incoming[src]`` bytes from each ``src``;
    the function returned waits for both and returns what arrived.

    Point to point over a gloo group, in flight until waited for; over any
    other communicator every rank must call it in the same round: it gathers
    the chunks at once.
    """
    from ..comm.gloo import TorchComm

    if isinstance(comm, TorchComm):
        return _point_to_point(comm, outgoing, incoming)
    everyone = comm.allgather({d: bytes(b) for d, b in outgoing.items()})
    got = {s: memoryview(everyone[s][comm.rank]) for s in incoming}
    return lambda: got


def _point_to_point(
    comm: object, outgoing: Mapping[int, bytearray], incoming: Mapping[int, int]
) -> Callable[[], dict[int, memoryview]]:
    import torch
    import torch.distributed as dist

    group = comm.group  # type: ignore[attr-defined]
    rank = comm.rank  # type: ignore[attr-defined]

    def failed(e: Exception) -> CommError:  # gloo raises RuntimeError on a dead peer or a timeout
        return CommError(
            f"rank {rank}: sending a local part's copy to ranks {sorted(outgoing)} and receiving from "
            f"{sorted(incoming)} failed: {type(e).__name__}: {e}. A peer is gone; the copy is not complete"
        )

    try:
        bufs = {s: torch.empty(n, dtype=torch.uint8) for s, n in incoming.items()}
        works = [dist.irecv(b, group=group, group_src=s) for s, b in bufs.items()]
        sends = {d: torch.frombuffer(data, dtype=torch.uint8) for d, data in outgoing.items()}  # no copy
        works += [dist.isend(t, group=group, group_dst=d) for d, t in sends.items()]
    except Exception as e:
        raise failed(e) from e

    def finish() -> dict[int, memoryview]:
        try:
            for w in works:
                if w is not None:
                    w.wait()
        except Exception as e:
            raise failed(e) from e
        sends.clear()  # sent: the buffers may go
        return {s: b.numpy().data for s, b in bufs.items()}

    return finish


class _Reader:
    """The bytes of a rank's shipments to one peer, in order, read a chunk at a time.

    Each file gives exactly the size its shipment announced: a file that
    is shorter, unreadable or gone is padded with zeros (the receiver finds
    the checksum wrong), so the ranks never disagree on how much is sent.
    """

    def __init__(self, shipments: list[Shipment], source: Callable[[Shipment], str]) -> None:
        self._files = [(os.path.join(source(s), f.name), f.size) for s in shipments for f in s.files]
        self._handle: BinaryIO | None = None
        self._index = 0
        self._left = self._files[0][1] if self._files else 0

    def read(self, n: int) -> bytearray:
        out = bytearray()
        while len(out) < n and self._index < len(self._files):
            want = min(n - len(out), self._left)
            block = self._read(want)
            out += block + bytes(want - len(block))
            self._left -= want
            if self._left == 0:
                self._next()
        return out

    def _read(self, want: int) -> bytes:
        path = self._files[self._index][0]
        try:
            if self._handle is None:
                self._handle = open(path, "rb")
            return self._handle.read(want)
        except OSError as e:
            logger.warning("reading %s to send it failed: %s; zeros are sent instead", path, e)
            return b""

    def _next(self) -> None:
        if self._handle is not None:
            self._handle.close()
        self._handle, self._index = None, self._index + 1
        self._left = self._files[self._index][1] if self._index < len(self._files) else 0


class _Writer:
    """Writes the bytes a rank receives from one peer into the files of its shipments, checking each file."""

    def __init__(self, shipments: list[Shipment], target: Callable[[Shipment], str]) -> None:
        self._todo = [(s, f, os.path.join(target(s), f.name)) for s in shipments for f in s.files]
        self._shipments = shipments
        self._bad: set[Shipment] = set()
        self._index = 0
        self._fd: int | None = None
        self._written = 0
        self._hash = Hasher()
        self._broken = False
        self.received = 0

    def write(self, data: memoryview) -> None:
        """Write the next bytes; a failing disk marks what is left bad (the rounds go on, the bytes are dropped)."""
        self.received += len(data)
        if self._broken:
            return
        try:
            self._write(data.cast("B"))
        except OSError as e:
            logger.warning("writing a received copy failed: %s; it is not kept", e)
            self._broken = True
            self._bad.update(s for s, _f, _p in self._todo[self._index :])

    def _write(self, view: memoryview) -> None:
        while view:
            self._open()
            s, f, _path = self._todo[self._index]
            take = view[: f.size - self._written]
            assert self._fd is not None
            os.write(self._fd, take)  # a local file: one write takes it whole (the chunk is bounded)
            self._hash.update(take)
            self._written += len(take)
            view = view[len(take) :]
            if self._written == f.size:
                self._close()

    def _open(self) -> None:
        if self._fd is not None:
            return
        _s, _f, path = self._todo[self._index]
        makedirs_durable(os.path.dirname(path))
        self._fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        self._written, self._hash = 0, Hasher()

    def _close(self) -> None:
        assert self._fd is not None
        s, f, path = self._todo[self._index]
        os.fsync(self._fd)
        os.close(self._fd)
        self._fd = None
        if self._hash.hexdigest() != f.digest:
            logger.warning("copy of %s: %s arrived with another checksum than its sender's", s.part, path)
            self._bad.add(s)
        self._index += 1

    def finish(self) -> list[Shipment]:
        """Close the files (empty ones are created here), fsync the directories; the shipments that arrived bad."""
        if self._broken:
            if self._fd is not None:
                os.close(self._fd)
            return list(self._shipments)
        while self._index < len(self._todo):
            self._open()
            if self._todo[self._index][1].size != self._written:
                self._bad.add(self._todo[self._index][0])  # fewer bytes than announced
            self._close()
        try:
            for d in sorted({os.path.dirname(p) for _s, _f, p in self._todo}):
                fsync_path(d)
        except OSError as e:
            logger.warning("syncing the directories of received copies failed: %s; they are not kept", e)
            return list(self._shipments)
        return [s for s in self._shipments if s in self._bad]
