"""Public entry points: argument checks, choosing the communicator, delegating.

No I/O happens here; ``commit`` runs the protocol, ``writer`` and ``reader``
touch files.
"""

from __future__ import annotations

import logging
import os
from typing import Any, Mapping, Sequence

import torch
from tensordict import TensorDict

from . import __version__
from . import format as fmt
from .comm import LocalComm, agree, resolve
from .commit import recover as _recover
from .commit import two_phase_commit
from .errors import InvalidArgumentError, InvalidDataError
from .manifest import Manifest, merge_fragments, to_json
from .reader import read_leaves
from .reader import read_manifest as _read_manifest
from .sharding import Replicate, Shard, even_split, full_box, shard_box
from .tree import build, flatten, local_bytes, resolve_placements, select
from .writer import write_shard

logger = logging.getLogger(__name__)

_UNSUPPORTED_YET = {
    "return_early": False,
    "archive": False,
    "compression": None,
    "copy_existing": False,
    "share_non_tensor": False,
}


def save(
    data: Any,
    prefix: str | os.PathLike,
    *,
    comm: Any = None,
    placements: Mapping | None = None,
    num_threads: int = 0,
    atomic: bool = True,
    metadata: Mapping | None = None,
    robust_key: bool = True,
    check_replicas: bool = False,
    timeout: float | None = None,
    **options: Any,
) -> TensorDict:
    """Save ``data`` (this rank's shard) collectively to the checkpoint directory ``prefix``.

    Every rank of ``comm`` must call it with data of the same structure. Leaves
    under a TensorDict with batch dims are sharded along dim 0 (the global batch
    is the ranks' rows in rank order); other leaves are replicated and written
    once, by rank 0. ``placements`` overrides this per key (or per node).
    Returns this rank's saved shard, memory-mapped (copy-on-write) from the
    committed checkpoint. Returns only once the checkpoint is durable on every rank.
    """
    for name, value in options.items():
        if name not in _UNSUPPORTED_YET:
            raise InvalidArgumentError(f"save() got an unexpected argument {name!r}")
        if value != _UNSUPPORTED_YET[name]:
            raise InvalidArgumentError(f"save({name}={value!r}) is not supported by this version of tddist")
    if prefix is None:
        raise InvalidArgumentError("save() needs a prefix: the checkpoint directory to create or replace")
    _check_int("num_threads", num_threads)
    if metadata is not None:
        try:
            fmt.dumps(dict(metadata))
        except (TypeError, ValueError) as e:
            raise InvalidArgumentError(f"metadata must be a JSON-able dict: {e}") from None
    target = os.path.abspath(os.fspath(prefix))
    c = resolve(comm, timeout)

    def prepare():
        nodes, leaves = flatten(data)
        if not robust_key:
            _check_verbatim_keys(nodes, leaves)
        chosen = resolve_placements(nodes, leaves, placements)
        return nodes, [(k, local_bytes(t), chosen[k], isinstance(chosen[k], Shard) or c.rank == 0) for k, t in leaves.items()]

    prepared = None

    def write_fragment(root: str) -> dict:
        nonlocal prepared
        prepared = prepare()
        nodes, items = prepared
        return write_shard(root, c.rank, nodes, items, robust_key, num_threads, check_replicas)

    def build_manifest(fragments: list[dict]) -> bytes:
        m = merge_fragments(fragments, metadata=dict(metadata or {}), robust_key=robust_key, version=__version__)
        return fmt.dumps(to_json(m))

    two_phase_commit(c, target, write_fragment, build_manifest, atomic=atomic)
    logger.info("rank %d: committed %s", c.rank, target)
    manifest = _read_manifest(target)
    return _load_from(manifest, target, c, shard="saved", keys=None, device=None, verify=False, num_threads=0)


def load(
    prefix: str | os.PathLike,
    *,
    comm: Any = None,
    shard: str | None = "even",
    keys: Sequence | str | None = None,
    device: torch.device | str | None = None,
    verify: bool = False,
    num_threads: int = 0,
    timeout: float | None = None,
) -> TensorDict:
    """Load a committed checkpoint.

    ``shard="even"``: this rank's even share of the global rows (split as
    ``torch.tensor_split`` does), on any world size. ``shard="saved"``: exactly
    the rows this rank saved (same world size only). ``shard=None``: the whole
    global TensorDict, in any process. ``keys`` reads only those leaves (or
    nodes). ``verify`` checks every chunk read against its checksum.
    Replicated leaves come back whole.
    """
    if shard not in ("even", "saved", None):
        raise InvalidArgumentError(f"shard={shard!r} is not supported; use 'even', 'saved' or None")
    _check_int("num_threads", num_threads)
    target = os.path.abspath(os.fspath(prefix))
    c = LocalComm() if shard is None and comm is None else resolve(comm, timeout)
    if c.size == 1 or shard is None:
        return _load_from(_read_manifest(target), target, c, shard, keys, device, verify, num_threads)
    result, error = None, None
    try:
        result = _load_from(_read_manifest(target), target, c, shard, keys, device, verify, num_threads)
    except Exception as e:
        error = e
    agree(c, f"load of {target!r}", error)
    return result


def _load_from(manifest: Manifest, target: str, c, shard, keys, device, verify: bool, num_threads: int) -> TensorDict:
    if shard == "saved" and manifest.world_size != c.size:
        raise InvalidArgumentError(
            f"rank {c.rank}: shard='saved' needs the saving world size ({manifest.world_size} ranks), this job has "
            f"{c.size}; use shard='even' to reshard"
        )
    leaf_keys, node_keys = select(manifest.leaves, manifest.nodes, keys)
    leaves = [manifest.leaves[k] for k in leaf_keys]
    boxes = [_box(leaf, shard, c.rank, c.size) for leaf in leaves]
    tensors = read_leaves(target, manifest, zip(leaves, boxes), num_threads, verify)
    if device is not None:
        tensors = [t.to(device) for t in tensors]
    loaded = dict(zip(leaf_keys, tensors))

    def node_rows(key, batch):
        return _rows(manifest, key, batch[0], shard, c.rank, c.size)

    return build({k: manifest.nodes[k] for k in node_keys}, loaded, node_rows, device)


def _box(leaf, shard, rank: int, size: int):
    if shard is None or isinstance(leaf.placement, Replicate):
        return full_box(leaf.shape)
    d = leaf.placement.dim
    if shard == "saved":
        return leaf.chunks[rank].box
    start, stop = even_split(leaf.shape[d], size)[rank]
    return shard_box(leaf.shape, d, start, stop)


def _rows(manifest: Manifest, node_key, global_rows: int, shard, rank: int, size: int) -> int:
    """How many rows of a node's dim-0 batch this rank gets."""
    if shard is None:
        return global_rows
    if shard == "saved":
        for leaf in manifest.leaves.values():
            if leaf.key[: len(node_key)] == node_key and leaf.placement == Shard(0):
                return leaf.chunks[rank].box[1][0]
    start, stop = even_split(global_rows, size)[rank]
    return stop - start


def read_manifest(prefix: str | os.PathLike) -> Manifest:
    """The validated manifest of the checkpoint at ``prefix``, without reading any data."""
    return _read_manifest(os.path.abspath(os.fspath(prefix)))


def recover(prefix: str | os.PathLike) -> list[str]:
    """Remove leftovers of interrupted saves beside ``prefix`` (staging, trash, backups).

    Never touches a committed checkpoint or a foreign file. Returns what it did.
    Run it only when no save to ``prefix`` is in progress.
    """
    return _recover(os.path.abspath(os.fspath(prefix)))


def _check_int(name: str, value) -> None:
    if type(value) is not int or value < 0:
        raise InvalidArgumentError(f"{name} must be a non-negative int, got {value!r}")


def _check_verbatim_keys(nodes, leaves) -> None:
    for key in list(nodes) + list(leaves):
        for part in key:
            why = fmt.verbatim_key_problem(part)
            if why:
                raise InvalidDataError(
                    f"key {list(key)} cannot be used verbatim as a file name with robust_key=False: {why}; "
                    f"use robust_key=True (the default) or rename the key"
                )

