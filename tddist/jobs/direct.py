"""A restore receives a part's leaves straight into the state's tensors, where the layout allows.

A rank that lost its node receives its own part from a peer's replica. Kept
in memory first (``receiving.MemorySink``), every byte of it would be
received once and copied into the state once more; on a loaded machine that
copy, and the fresh memory it fills, cost as much as the transfer. So the
sender cuts each file at the bounds of its whole-leaf chunks (``leaf_spans``,
from its manifest, announced with the files), both sides cut the same
messages from them (``cuts``), and the receiver posts the messages of each
leaf that its state holds with the same dtype and shape, contiguous on the
CPU, straight into that tensor's bytes (``places``). Every byte is still
hashed as it arrives, in its file's order, and the file checked against the
sender's record: a copy that does not match is bad as before, and the ranks
fill the state again from other copies (or the shared root). The load then
finds those leaves already in place (``MemoryFiles.span`` serves their bytes
from the state; the copy onto the same memory is skipped).

The state changes once ``restore`` returned, so the received part's own
copy (``keeping``) is written from it and hashed again before it is kept.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch

from .. import format as fmt
from ..core.tree import flatten, is_dtensor
from ..core.types import Key
from ..errors import CorruptCheckpointError, TddistError
from ..manifest.locate import Locator
from ..manifest.model import Manifest
from ..storage.backends import read_manifest
from ..storage.memory import Regions
from .copies import FileSum, LeafSpan, Shipment
from .state import holds_objects
from .train_state import model_pair, state_of

#: The smallest leaf received straight into the state (1 MiB). A smaller one costs little to copy, and it is
#: what a loop changes first (a step counter): kept apart, the part's own copy written after the restore
#: (``keeping``) still matches while the first training step runs.
MIN_BYTES = 1 << 20


def leaf_spans(path: str) -> tuple[LeafSpan, ...]:
    """The leaves of the committed copy at ``path`` stored whole in one chunk of a packed data file (its
    manifest says where); none when it has no such leaves or its manifest cannot be read."""
    try:
        return spans_of(read_manifest(path))
    except (TddistError, OSError):
        return ()  # the receiver finds the copy bad by its record


def spans_of(manifest: Manifest) -> tuple[LeafSpan, ...]:
    """The leaves of ``manifest`` stored whole in one chunk of a packed data file, and where."""
    if manifest.layout != "directory" or manifest.packing != "packed":
        return ()
    locator, out = Locator(manifest), []
    for leaf in manifest.leaves.values():
        if leaf.refs is not None or len(leaf.table) != 1:
            continue
        chunk = leaf.table.chunk(0)
        if chunk.nbytes and tuple(chunk.box[1]) == tuple(leaf.shape):
            at = locator.locate(leaf, chunk)
            out.append(LeafSpan(at.relpath, at.offset, chunk.nbytes, leaf.key, leaf.dtype_name, tuple(leaf.shape)))
    return tuple(out)


def received_keys(manifest: Manifest, announced: Sequence[LeafSpan], regions: Mapping[str, Regions]) -> list[Key]:
    """The leaves received straight into the state, once the part's manifest arrived (and checked itself).

    Raises:
        CorruptCheckpointError: the manifest does not put a leaf where the sender announced it (bytes of the
            file landed in a tensor of the state they do not belong to).
    """
    true = {(s.name, s.offset): s for s in spans_of(manifest)}
    claimed = {(s.name, s.offset): s for s in announced}
    out = []
    for name, found in regions.items():
        for offset, view in found:
            s = claimed.get((name, offset))
            if s is None or true.get((name, offset)) != s or view.numel() != s.nbytes:
                raise CorruptCheckpointError(
                    f"the sender announced a leaf at byte {offset} of {name!r} that its manifest does not place "
                    f"there; the copy is damaged"
                )
            out.append(s.key)
    return out


def cuts(f: FileSum, spans: Sequence[LeafSpan], chunk: int) -> list[tuple[int, int]]:
    """The ``(start, stop)`` byte ranges file ``f`` is sent in: cut at its leaves' bounds, then in pieces of
    at most ``chunk`` bytes (sender and receiver cut the same ones from the same spans)."""
    bounds = {0, f.size} | {x for s in spans if s.name == f.name for x in (s.offset, s.offset + s.nbytes)}
    edges = sorted(x for x in bounds if 0 <= x <= f.size)
    return [(a, min(a + chunk, hi)) for lo, hi in zip(edges, edges[1:]) for a in range(lo, hi, chunk)]


def targets(state: Any, load_kwargs: Mapping[str, Any]) -> dict[Key, torch.Tensor]:
    """The tensors of ``state`` that a received part may land in directly: those a plain load fills in place
    (a TensorDict or nested dict given as is, loaded without options), contiguous on the CPU, not DTensors."""
    if load_kwargs or state_of(state) is not state or model_pair(state) is not None or holds_objects(state):
        return {}
    try:
        _nodes, leaves, _objects = flatten(state)
    except TddistError:
        return {}
    return {
        k: t
        for k, t in leaves.items()
        if not is_dtensor(t) and t.device.type == "cpu" and t.is_contiguous() and t.numel()
    }


def places(shipment: Shipment, into: Mapping[Key, torch.Tensor]) -> dict[str, Regions]:
    """Where the leaves of ``shipment`` that ``into`` holds with their dtype and shape are received, by file
    (those of at least ``MIN_BYTES``)."""
    out: dict[str, list[tuple[int, torch.Tensor]]] = {}
    for s in shipment.spans:
        t = into.get(s.key)
        if t is None or s.nbytes < MIN_BYTES or tuple(t.shape) != s.shape or fmt.dtype_name(t.dtype) != s.dtype:
            continue
        if t.numel() * t.element_size() == s.nbytes:
            out.setdefault(s.name, []).append((s.offset, t.detach().reshape(-1).view(torch.uint8)))
    return {name: tuple(sorted(found, key=lambda r: r[0])) for name, found in out.items()}


def segments(data: torch.Tensor, regions: Regions) -> list[torch.Tensor]:
    """A received file's bytes in order: its ``regions`` (in the state) and the rest of ``data`` around them."""
    out, at = [], 0
    for offset, view in regions:
        if offset > at:
            out.append(data[at:offset])
        out.append(view)
        at = offset + view.numel()
    if at < data.numel():
        out.append(data[at:])
    return out
