"""Where a rank puts the copies it receives from one peer (``transfer``): files on its disk, or memory.

The bytes a rank receives from one peer are its shipments' files, one
after the other. ``transfer`` asks its sink for the buffer each round is
received into (``buffer``), says when it arrived (``arrived``), and at the
end which shipments arrived bad (``finish``). Every file is hashed as its
bytes arrive and compared with its shipment's checksum: a sink never
trusts bytes that did not match.

- ``FileSink`` (replication): writes each round into the shipment's files
  while the next one is in flight, fsyncs each file, then the directories.
  It holds two rounds' buffers, whatever the size of the parts.
- ``MemorySink`` (a restore): receives each round in place into one buffer
  holding all the peer's shipments; each file is a view of it. Nothing is
  written: the caller loads the files from memory.
"""

from __future__ import annotations

import bisect
import logging
import os
from collections import deque
from collections.abc import Callable, Mapping
from typing import Protocol

import torch

from .._fs import advise_huge_pages, fsync_path, makedirs_durable
from ..checksum import Hasher
from ..storage.memory import Regions, region_of
from .copies import FileSum, Shipment

logger = logging.getLogger(__name__)

_EMPTY = torch.empty(0, dtype=torch.uint8)


class Sink(Protocol):
    """Takes in what a rank receives from one peer (see the module docstring)."""

    def buffer(self, n: int) -> torch.Tensor:
        """Where the next ``n`` bytes are received (a flat uint8 tensor); valid until the round after next."""
        ...

    def arrived(self, n: int) -> None:
        """The bytes of the oldest buffer handed out and not yet taken in arrived (``n`` of them)."""
        ...

    def finish(self) -> list[Shipment]:
        """All arrived: the shipments that arrived bad (a checksum or size that does not match)."""
        ...


class _Files:
    """The files of one peer's shipments in order, hashed as their bytes come; a file that is done is checked."""

    def __init__(self, todo: list[tuple[Shipment, FileSum]]) -> None:
        self.todo = todo
        self.index = 0
        self.written = 0  # bytes of the current file taken in
        self.hash = Hasher()
        self.bad: set[Shipment] = set()

    def take(self, view: memoryview, write: Callable[[int, memoryview], None]) -> None:
        """Hash ``view``'s bytes into the files they belong to (``write(file index, bytes)`` first)."""
        self.skip_empty()
        while view:
            s, f = self.todo[self.index]
            piece = view[: f.size - self.written]
            write(self.index, piece)
            self.hash.update(piece)
            self.written += len(piece)
            view = view[len(piece) :]
            self.skip_empty()

    def skip_empty(self) -> None:
        """Close every file that is complete (an empty one at once), checking its checksum."""
        while self.index < len(self.todo) and self.written == self.todo[self.index][1].size:
            s, f = self.todo[self.index]
            if self.hash.hexdigest() != f.digest:
                logger.warning("copy of %s: %s arrived with another checksum than its sender's", s.part, f.name)
                self.bad.add(s)
            self.on_close(self.index)
            self.index, self.written, self.hash = self.index + 1, 0, Hasher()

    def on_close(self, index: int) -> None:
        """Called when the file ``index`` is complete (before its checksum's outcome is used)."""

    def short(self) -> list[Shipment]:
        """The shipments whose files did not all arrive (fewer bytes than announced)."""
        return [s for s, _f in self.todo[self.index :]]


class MemorySink:
    """Receives one peer's shipments into memory, each file in a buffer of its own (aligned as a tensor's), hashing
    each round as it arrives.

    A round within one file is received in place; one that straddles files
    (the rounds of ``transfer._exchange``) goes through a buffer of its own
    and is copied into them when it arrived. Bytes of ``direct`` regions (a
    restore's leaves placed in the state, ``jobs.direct``) are received there
    instead, and the file's buffer keeps a hole in their place.
    """

    def __init__(
        self, shipments: list[Shipment], direct: Mapping[Shipment, Mapping[str, Regions]] | None = None
    ) -> None:
        self._files = _Files([(s, f) for s in shipments for f in s.files])
        self.files: dict[Shipment, dict[str, torch.Tensor]] = {s: {} for s in shipments}
        self.direct = {s: dict(direct.get(s, {})) for s in shipments} if direct else {}  # received in the state
        self.offsets: dict[tuple[Shipment, str], int] = {}  # where each file begins in what this peer sends
        self._spans: list[tuple[int, torch.Tensor, Regions]] = []  # (where it begins, its buffer, its regions)
        at = 0
        for s in shipments:
            for f in s.files:
                self.files[s][f.name] = buf = torch.empty(f.size, dtype=torch.uint8)
                regions = self.direct.get(s, {}).get(f.name, ())
                if not regions:  # a file received in the state is mostly never touched here
                    advise_huge_pages(buf.data_ptr(), f.size)  # written once, at once: fewer page faults
                self.offsets[(s, f.name)] = at
                self._spans.append((at, buf, regions))
                at += f.size
        self._begins = [begin for begin, _buf, _regions in self._spans]
        self._handed = 0  # bytes handed out as buffers
        self._queue: deque[tuple[torch.Tensor, bool]] = deque()  # (buffer, whether it is a file's own bytes)

    def buffer(self, n: int) -> torch.Tensor:
        """Where the next ``n`` bytes land: the state's tensor (``direct``) or the file's buffer they belong to,
        when they lie in one, else a buffer of their own (copied into the files when they arrived)."""
        at, self._handed = self._handed, self._handed + n
        i = bisect.bisect_right(self._begins, at) - 1
        while 0 <= i < len(self._spans) and self._spans[i][1].numel() == 0:
            i += 1  # empty files begin where the next one does
        begin, buf, regions = self._spans[i] if 0 <= i < len(self._spans) else (at, _EMPTY, ())
        placed = region_of(regions, at - begin, at - begin + n) if n and regions else None
        if placed is not None:
            out, in_place = placed, True
        elif n and at + n <= begin + buf.numel():
            out, in_place = buf[at - begin : at - begin + n], True
        else:
            out, in_place = torch.empty(n, dtype=torch.uint8), False
        self._queue.append((out, in_place))
        return out

    def arrived(self, n: int) -> None:
        buf, in_place = self._queue.popleft()
        files = self._files

        def copy(index: int, piece: memoryview) -> None:
            if not in_place:  # a round across files (replication's): never one received in the state
                self._spans[index][1][files.written : files.written + len(piece)].numpy()[:] = piece

        files.take(buf[:n].numpy().data, copy)

    def finish(self) -> list[Shipment]:
        self._files.skip_empty()
        bad = self._files.bad | set(self._files.short())
        return [s for s in self.files if s in bad]


class FileSink(_Files):
    """Writes one peer's shipments into their files, checking and fsyncing each (replication's receiver)."""

    def __init__(self, shipments: list[Shipment], target: Callable[[Shipment], str]) -> None:
        super().__init__([(s, f) for s in shipments for f in s.files])
        self._paths = [os.path.join(target(s), f.name) for s, f in self.todo]
        self._shipments = shipments
        self._scratch = [torch.empty(0, dtype=torch.uint8), torch.empty(0, dtype=torch.uint8)]
        self._handed = 0  # buffers handed out
        self._taken = 0  # buffers taken in
        self._fd: int | None = None
        self._broken = False

    def buffer(self, n: int) -> torch.Tensor:
        turn = self._handed % 2
        if self._scratch[turn].numel() < n:
            self._scratch[turn] = torch.empty(n, dtype=torch.uint8)  # at most a chunk
        self._handed += 1
        return self._scratch[turn][:n]

    def arrived(self, n: int) -> None:
        """Write the bytes; a failing disk marks what is left bad (the rounds go on, the bytes are dropped)."""
        data = self._scratch[self._taken % 2][:n].numpy().data
        self._taken += 1
        if self._broken:
            return
        try:
            self.take(data, self._write)
        except OSError as e:
            logger.warning("writing a received copy failed: %s; it is not kept", e)
            self._broken = True
            self.bad.update(s for s, _f in self.todo[self.index :])

    def _write(self, index: int, piece: memoryview) -> None:
        if self._fd is None:
            makedirs_durable(os.path.dirname(self._paths[index]))
            self._fd = os.open(self._paths[index], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.write(self._fd, piece)  # a local file: one write takes it whole (the chunk is bounded)

    def on_close(self, index: int) -> None:
        if self._fd is None:  # an empty file: created here
            self._write(index, memoryview(b""))
        assert self._fd is not None
        os.fsync(self._fd)
        os.close(self._fd)
        self._fd = None

    def finish(self) -> list[Shipment]:
        """Close the files (empty ones are created here), fsync the directories; the shipments that arrived bad."""
        if self._broken:
            if self._fd is not None:
                os.close(self._fd)
            return list(self._shipments)
        try:
            self.skip_empty()
            short = set(self.short())
            if self._fd is not None:
                os.close(self._fd)
            for d in sorted({os.path.dirname(p) for p in self._paths}):
                fsync_path(d)
        except OSError as e:
            logger.warning("syncing the directories of received copies failed: %s; they are not kept", e)
            return list(self._shipments)
        return [s for s in self._shipments if s in self.bad or s in short]
