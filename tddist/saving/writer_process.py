"""The process writer of asynchronous saves (``save(..., return_early=True, async_writer="process")``).

One persistent writer process per rank and channel, started at the first
such save as ``python -m tddist.saving.writer_main`` (a fresh interpreter, so the
user's script is not imported again, guarded or not), connected by a socket
pair. The trainer copies its shard into one shared-memory
arena (a file in ``/dev/shm`` mapped by both processes; the writer unlinks it as
soon as it has mapped it, so a killed job leaves no file behind; reused by the next saves while it is large enough) and
sends the writer a small message over a pipe: the
options, the shard without its bytes, and where each leaf lies in the arena.
The writer runs the whole two-phase commit (writes, fsyncs, collectives) in
its own interpreter, on its own channel: one gloo group among the writer
processes, rendezvoused through the job's store under a prefix of its own
(``tddist-writer/<restart>/<generation>/``). The trainer's interpreter lock is
never taken by the commit; only mapping the committed result (on the
channel's worker thread, once the writer answers) runs in the trainer.

A writer that dies (killed, out of memory) closes its pipe: the trainer's
worker raises ``CommError`` on that rank; the other ranks' writers lose their
gloo peer and fail their collectives, so every rank's future fails, never
hangs, and nothing is committed unless rank 0 had already published. After
a ``CommError`` every rank replaces its writer (a new generation, a new
group) at its next process save.
"""

from __future__ import annotations

import datetime
import json
import logging
import mmap
import os
import socket
import subprocess
import sys
import tempfile
import uuid
from collections.abc import Callable
from dataclasses import dataclass, replace
from multiprocessing.connection import Connection
from typing import Any, cast

import numpy as np
import torch

from ..comm.base import Communicator, LocalComm
from ..core.types import LocalShard, SaveOptions
from ..errors import CommError, InvalidArgumentError
from ..manifest.locate import packed_offsets
from .arena import copy_bytes

logger = logging.getLogger(__name__)


_DEAD = "dead"  # the store key a trainer sets when its writer died
_POLL = 0.2  # seconds between checks for a dead writer while waiting for one


@dataclass(frozen=True, slots=True)
class Placed:
    """Where one leaf's bytes lie in the shared arena."""

    offset: int
    nbytes: int
    dtype: torch.dtype
    shape: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class WriterRequest:
    """What the trainer sends its writer for one save (no tensor bytes: those are in the arena)."""

    options: SaveOptions
    shard: LocalShard | Exception  # items without tensors
    placed: tuple[Placed, ...]
    arena: str  # the shared file's path
    arena_bytes: int


def supported(comm: Communicator) -> str | None:
    """Why ``comm`` cannot use a writer process (None: it can)."""
    if isinstance(comm, LocalComm) or comm.size == 1:
        return None
    if type(comm).__name__ != "TorchComm":
        return (
            f"{type(comm).__name__} cannot be joined by another process (an MPI communicator belongs to the "
            f"processes mpiexec started); use async_writer='thread'"
        )
    if job_store_address() is None:
        return "torch.distributed's default store is not a TCPStore that a writer process could reach"
    return None


class ProcessWriter:
    """The trainer's side: the writer process, its pipe and the shared arena."""

    def __init__(self, comm: Communicator, timeout: float, generation: int) -> None:
        why = supported(comm)
        if why is not None:
            raise InvalidArgumentError(f"rank {comm.rank}: async_writer='process' is not available: {why}")
        self.rank, self.size = comm.rank, comm.size
        restart = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
        address = job_store_address() if comm.size > 1 else None
        prefix = f"tddist-writer/{restart}/{generation}/"
        mine, theirs = socket.socketpair()
        spec = json.dumps(
            {"rank": comm.rank, "size": comm.size, "address": address, "prefix": prefix, "timeout": timeout}
        )
        self.process = subprocess.Popen(
            [sys.executable, "-m", "tddist.saving.writer_main", str(theirs.fileno()), spec], pass_fds=[theirs.fileno()]
        )
        theirs.close()
        self.conn = Connection(mine.detach())
        self.store: Any = None  # the job's store under this generation's prefix: where a dead writer is announced
        if address is not None:
            import torch.distributed as dist

            td = datetime.timedelta(seconds=timeout)
            self.store = dist.PrefixStore(prefix, dist.TCPStore(address[0], address[1], is_master=False, timeout=td))
        self.map: mmap.mmap | None = None
        self.path = ""
        self.size_bytes = 0
        self.linked = False  # the arena's file still has a name (the writer has not mapped it yet)
        self.broken = False
        logger.info("rank %d: started writer process %d (%s)", self.rank, self.process.pid, prefix)

    def snapshot(self, options: SaveOptions, shard: LocalShard | Exception, sources: dict) -> WriterRequest:
        """Copy the shard into the shared arena (grown if needed); the request that describes it."""
        if isinstance(shard, Exception):
            return WriterRequest(options, shard, (), "", 0)
        tensors = [sources[i.key] for i in shard.items]
        sizes = np.array([t.numel() * t.element_size() for t in tensors], dtype=np.int64)
        offsets, end = packed_offsets(sizes)
        total = max(int(end), 1)
        if self.map is None or self.size_bytes < total:
            self._new_arena(total)
        assert self.map is not None
        arena = torch.frombuffer(self.map, dtype=torch.uint8, count=total)
        placed = []
        for t, offset, n in zip(tensors, offsets.tolist(), sizes.tolist()):
            if n and t.is_cpu and t.is_contiguous():  # host bytes as they lie: one memmove
                copy_bytes(arena.data_ptr() + offset, t.data_ptr(), n)
            elif n:
                dst = arena[offset : offset + n].view(t.dtype).view(t.shape)
                dst.copy_(t)
            placed.append(Placed(int(offset), int(n), t.dtype, tuple(t.shape)))
        del arena
        items = tuple(replace(i, tensor=cast(Any, None)) for i in shard.items)
        return WriterRequest(options, replace(shard, items=items), tuple(placed), self.path, self.size_bytes)

    def _new_arena(self, nbytes: int) -> None:
        self._release()
        where = "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()
        path = os.path.join(where, f"tddist-writer-{os.getpid()}-{uuid.uuid4().hex}")
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.ftruncate(fd, nbytes)
            self.map = mmap.mmap(fd, nbytes)
        finally:
            os.close(fd)
        self.path, self.size_bytes, self.linked = path, nbytes, True

    def run(self, request: WriterRequest) -> str:
        """Hand the request to the writer and wait for its outcome: the generation it committed (raises the
        commit's error)."""
        try:
            self.conn.send(request)
            while not self.conn.poll(_POLL):
                if self.process.poll() is not None:
                    raise EOFError("the writer process exited")
                if self.peer_died():
                    self.broken = True
                    self.process.kill()  # its group lost a member: it could only wait for the timeout
                    raise CommError(
                        f"rank {self.rank}: the writer process of rank {self.store.get(_DEAD).decode()} died during "
                        f"the save to {request.options.target!r}; this rank's save fails with it. The target holds "
                        f"the previous checkpoint or, if rank 0 committed, the new one; the next save starts new "
                        f"writer processes"
                    )
            status, value = self.conn.recv()
            if request.arena == self.path:
                self.linked = False  # the writer mapped and unlinked it
        except (EOFError, OSError) as e:
            self.broken = True
            if self.store is not None:
                self.store.set(_DEAD, str(self.rank))  # the other ranks' trainers stop waiting for their writers
            try:
                self.process.wait(5)
            except subprocess.TimeoutExpired:
                pass
            raise CommError(
                f"rank {self.rank}: the tddist writer process (pid {self.process.pid}) died during the save to "
                f"{request.options.target!r} (exit code {self.process.returncode}; {type(e).__name__}); the other "
                f"ranks' saves fail too. The target holds the previous checkpoint or, if rank 0 committed, the "
                f"new one; the next save starts a new writer process"
            ) from None
        if status != "ok":
            if isinstance(value, CommError):
                self.broken = True  # its group lost a peer: the next save needs a new one
            raise value
        return str(value)

    def arena_shard(self, request: WriterRequest) -> LocalShard | Exception:
        """The shard of ``request`` as it lies in the shared arena (views of it; valid until the next save)."""
        return _rebuild(request, self.map)

    def peer_died(self) -> bool:
        """Whether some rank announced that its writer of this generation died."""
        return self.store is not None and bool(self.store.check([_DEAD]))

    def alive(self) -> bool:
        return self.process.poll() is None

    def close(self) -> None:
        if self.alive():
            try:
                self.conn.send(None)
                self.process.wait(30)
            except (OSError, subprocess.TimeoutExpired):
                self.process.kill()
            if self.process.returncode:
                logger.warning("the tddist writer process %d exited with %s", self.process.pid, self.process.returncode)
        self.conn.close()
        self._release()

    def _release(self) -> None:
        if self.linked:
            try:
                os.unlink(self.path)
            except FileNotFoundError:
                pass
            self.linked = False
        if self.map is not None:
            try:
                self.map.close()
            except BufferError:  # a view is still alive; the mapping goes with it
                pass
            self.map = None


# --- the writer process ---------------------------------------------------------------------


def serve(fd: int, spec: str, commit: Callable[[Communicator, SaveOptions, Any, Any], Any]) -> None:
    """The writer process (``python -m tddist.saving.writer_main FD SPEC``): join the writers' group, then
    commit each request until told to stop or the trainer is gone.

    ``commit`` is ``committing.commit``, passed in by the entry point, since
    the pipeline imports this module; the trainer gets the generation it
    committed.
    """
    conn = Connection(fd)
    s = json.loads(spec)
    rank, size, prefix, timeout = s["rank"], s["size"], s["prefix"], s["timeout"]
    address = tuple(s["address"]) if s["address"] else None
    torch.set_num_threads(1)
    from ..manifest.merge import MergeCache

    comm: Communicator
    if size == 1:
        comm = LocalComm()
    else:
        import torch.distributed as dist

        from ..comm.gloo import TorchComm

        assert address is not None
        td = datetime.timedelta(seconds=timeout)
        store = dist.PrefixStore(prefix, dist.TCPStore(address[0], address[1], is_master=False, timeout=td))
        dist.init_process_group("gloo", store=store, rank=rank, world_size=size, timeout=td)
        comm = TorchComm(cast(Any, dist.group.WORLD), timeout)
    cache = MergeCache()
    arena: tuple[str, mmap.mmap] | None = None
    while True:
        try:
            request = conn.recv()
        except (EOFError, OSError):  # the trainer is gone
            break
        if request is None:
            break
        try:
            if request.arena and (arena is None or arena[0] != request.arena):
                arena = (request.arena, _attach(request.arena, request.arena_bytes, arena))
            shard = _rebuild(request, arena[1] if arena else None)
            committed = commit(comm, request.options, shard, cache)
            if committed.pin is not None:
                committed.pin.close()  # the trainer opens it (by name: it compares the generation)
            conn.send(("ok", committed.generation))
        except Exception as e:
            conn.send(("error", e))
            if isinstance(e, CommError):  # the group lost a peer: leave it, so the other writers see it at once
                break
    conn.close()
    if size > 1:  # free the group before the interpreter finalizes (why: ``comm.gloo``'s docstring)
        import torch.distributed as dist

        del comm
        dist.destroy_process_group()


def _attach(path: str, nbytes: int, old: tuple[str, mmap.mmap] | None) -> mmap.mmap:
    if old is not None:
        try:
            old[1].close()
        except BufferError:
            pass
    fd = os.open(path, os.O_RDWR)
    try:
        return mmap.mmap(fd, nbytes)
    finally:
        os.close(fd)
        os.unlink(path)  # both processes map it: the name is no longer needed


def _rebuild(request: WriterRequest, arena: mmap.mmap | None) -> LocalShard | Exception:
    shard = request.shard
    if isinstance(shard, Exception):
        return shard
    assert arena is not None
    items = []
    for item, p in zip(shard.items, request.placed):
        if p.nbytes:
            t = torch.frombuffer(arena, dtype=torch.uint8, count=p.nbytes, offset=p.offset)
            t = t.view(p.dtype).view(p.shape)
        else:
            t = torch.empty(p.shape, dtype=p.dtype)
        items.append(replace(item, tensor=t))
    return replace(shard, items=tuple(items))


def job_store_address() -> tuple[str, int] | None:
    """(host, port) of torch.distributed's default store when it is a TCPStore, else None.

    Another process (tddist's writer process) can join the job's store with
    it. ``distributed_c10d._get_default_store`` is private; the store of
    ``init_process_group`` is not reachable otherwise.
    """
    import torch.distributed as dist

    if not dist.is_available() or not dist.is_initialized():
        return None
    try:
        store = dist.distributed_c10d._get_default_store()
    except (AttributeError, RuntimeError, ValueError):
        return None
    while isinstance(store, dist.PrefixStore):
        store = store.underlying_store
    if isinstance(store, dist.TCPStore):
        return str(store.host), int(store.port)
    return None
