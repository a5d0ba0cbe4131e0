"""Object collectives in one gloo operation: every object pickled into a fixed-size slot.

torch's object collectives (``gather_object``, ``broadcast_object_list``,
``all_gather_object``) make two operations each: the sizes first, then the
payloads padded to the largest. A commit exchanges a few small objects (a
vote, a decision), and on a busy node every operation costs a scheduling
round trip of every rank (about a millisecond), which is most of a small
save's commit. torch has no single-operation object collective, so this
module writes one: each rank sends a slot of ``slot`` bytes that starts with
the pickled object's length and holds as much of the object as fits; a longer
object's rest follows in a second operation that exactly the ranks which need
it take part in, because every rank that must receive it learns the length
from the slot:

- ``gather``: every rank whose object did not fit sends its rest to the root;
- ``broadcast``: every rank learns the length from the root's slot, and all
  join a second broadcast of the rest when it did not fit;
- ``allgather``: every rank learns every length, and each rank whose object
  did not fit broadcasts its rest.

The slots cost ``slot x ranks`` bytes on a receiving rank, so ``TorchComm``
uses them for small groups only (``SLOTTED_RANKS``) and torch's collectives
beyond. Objects are pickled, like torch's own: they come from the ranks of
one job.
"""

from __future__ import annotations

import pickle
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

#: The largest group whose object collectives use slots (a root then receives at most 64 x ``GATHER_SLOT``).
SLOTTED_RANKS = 64
#: Bytes each rank sends in ``gather`` and ``allgather``: a commit's vote for a thousand leaves fits.
GATHER_SLOT = 64 * 1024
#: Bytes of ``broadcast``'s slot: a decision fits.
BROADCAST_SLOT = 16 * 1024
_HEADER = 8  # the pickled object's length, little endian


@dataclass(frozen=True)
class Packed:
    """An object as sent: its slot (header and head) and the bytes that did not fit (empty if all did)."""

    slot: torch.Tensor
    rest: torch.Tensor


def pack(obj: Any, slot_bytes: int) -> Packed:
    """``obj`` pickled into a slot of ``slot_bytes`` bytes, and its rest."""
    data = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
    head = min(len(data), slot_bytes - _HEADER)
    slot = torch.empty(slot_bytes, dtype=torch.uint8)
    slot[:_HEADER] = torch.frombuffer(bytearray(len(data).to_bytes(_HEADER, "little")), dtype=torch.uint8)
    if head:
        slot[_HEADER : _HEADER + head] = torch.frombuffer(bytearray(data[:head]), dtype=torch.uint8)
    rest = data[head:]
    return Packed(
        slot, torch.frombuffer(bytearray(rest), dtype=torch.uint8) if rest else torch.empty(0, dtype=torch.uint8)
    )


def rest_bytes(slot: torch.Tensor) -> int:
    """How many bytes of the object in ``slot`` did not fit in it."""
    length = int.from_bytes(slot[:_HEADER].numpy().tobytes(), "little")
    return max(0, length - (slot.numel() - _HEADER))


def unpack(slot: torch.Tensor, rest: torch.Tensor | None) -> Any:
    """The object sent as ``slot`` and ``rest``."""
    length = int.from_bytes(slot[:_HEADER].numpy().tobytes(), "little")
    head = slot[_HEADER : _HEADER + min(length, slot.numel() - _HEADER)].numpy().tobytes()
    tail = b"" if rest is None else rest.numpy().tobytes()
    return pickle.loads(head + tail)


def gather(obj: Any, root: int, rank: int, size: int, group: dist.ProcessGroup) -> list[Any] | None:
    """Every rank's object on ``root`` (None elsewhere): one gather, plus a message from each rank whose object
    did not fit in its slot to the root.

    A gather, not an all-gather whose result only the root keeps: gloo's
    all-gather is a ring of ``size - 1`` steps, about 3 ms at 4 ranks on a
    busy node against 1 ms for a gather, whatever the slot's size. A sender
    whose root died learns it in the collective that follows (the decision's
    broadcast), from the closed connection.
    """
    mine = pack(obj, GATHER_SLOT)
    if rank != root:
        dist.gather(mine.slot, None, group=group, group_dst=root)
        if mine.rest.numel():
            dist.send(mine.rest, group=group, group_dst=root)
        return None
    slots = [torch.empty(GATHER_SLOT, dtype=torch.uint8) for _ in range(size)]
    dist.gather(mine.slot, slots, group=group, group_dst=root)

    def receive(r: int, rest: torch.Tensor) -> None:
        if r != rank:
            dist.recv(rest, group=group, group_src=r)

    return _objects(obj, rank, slots, mine, receive)


def broadcast(obj: Any, root: int, rank: int, group: dist.ProcessGroup) -> Any:
    """``root``'s object on every rank: one broadcast, two when it does not fit in the slot."""
    if rank == root:
        mine = pack(obj, BROADCAST_SLOT)
        dist.broadcast(mine.slot, group=group, group_src=root)
        if mine.rest.numel():
            dist.broadcast(mine.rest, group=group, group_src=root)
        return obj
    slot = torch.empty(BROADCAST_SLOT, dtype=torch.uint8)
    dist.broadcast(slot, group=group, group_src=root)
    missing = rest_bytes(slot)
    rest = None
    if missing:
        rest = torch.empty(missing, dtype=torch.uint8)
        dist.broadcast(rest, group=group, group_src=root)
    return unpack(slot, rest)


def allgather(obj: Any, rank: int, size: int, group: dist.ProcessGroup) -> list[Any]:
    """Every rank's object on every rank: one all-gather, plus a broadcast per object that did not fit."""
    mine = pack(obj, GATHER_SLOT)
    slots = [torch.empty(GATHER_SLOT, dtype=torch.uint8) for _ in range(size)]
    dist.all_gather(slots, mine.slot, group=group)
    return _objects(obj, rank, slots, mine, lambda r, rest: dist.broadcast(rest, group=group, group_src=r))


def _objects(
    obj: Any, rank: int, slots: list[torch.Tensor], mine: Packed, move_rest: Callable[[int, torch.Tensor], Any]
) -> list[Any]:
    """Every rank's object from its slot (this rank's own: ``obj``), in rank order; ``move_rest(r, rest)``
    moves the rest of rank ``r``'s object that did not fit, into ``rest`` (this rank's own rest: ``mine``'s)."""
    out: list[Any] = []
    for r, slot in enumerate(slots):
        missing = rest_bytes(slot)
        rest = None
        if missing:
            rest = mine.rest if r == rank else torch.empty(missing, dtype=torch.uint8)
            move_rest(r, rest)
        out.append(obj if r == rank else unpack(slot, rest))
    return out
