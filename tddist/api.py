"""Public entry points: argument checks, choosing the communicator, delegating.

No I/O happens here; ``commit`` runs the protocol, ``writer`` and ``reader``
touch files.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping, Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

import torch
from tensordict import TensorDict

from . import background
from . import format as fmt
from ._memmaps import file_mappings, mapped_file
from ._version import __version__
from .archive import ArchiveWriter, resolve_compression
from .comm import LocalComm, resolve, run_step
from .commit import two_phase_commit
from .errors import InvalidArgumentError, InvalidDataError
from .into import fill
from .manifest import Manifest, merge_fragments, to_json
from .manifest_io import read_manifest as _read_manifest
from .plan import LoadReport, check_shard, leaf_box, node_rows, object_value
from .reader import read_leaves
from .recovery import recover as _recover
from .sharding import Boxes, Shard
from .tree import build, dtensor_box, flatten, is_dtensor, local_bytes, resolve_placements, select
from .writer import write_shard

logger = logging.getLogger(__name__)


def save(
    data: Any,
    prefix: str | os.PathLike,
    *,
    comm: Any = None,
    placements: Mapping | None = None,
    num_threads: int = 0,
    return_early: bool = False,
    atomic: bool = True,
    metadata: Mapping | None = None,
    copy_existing: bool = False,
    share_non_tensor: bool = False,
    robust_key: bool = True,
    allow_pickle: bool = False,
    check_replicas: bool = False,
    wait_for_pending: bool = True,
    timeout: float | None = None,
    archive: bool | None = None,
    compression: Any = None,
) -> TensorDict | Future:
    """Save ``data`` (this rank's shard) collectively to the checkpoint directory ``prefix``.

    Every rank of ``comm`` must call it with data of the same structure. Leaves
    under a TensorDict with batch dims are sharded along dim 0 (the global batch
    is the ranks' rows in rank order); other leaves are replicated and written
    once, by rank 0. ``placements`` overrides this per key (or per node).
    Returns this rank's saved shard, memory-mapped (copy-on-write) from the
    committed checkpoint, once the checkpoint is durable on every rank; with
    ``return_early=True`` returns a ``concurrent.futures.Future`` of it as
    soon as the data is snapshotted. See docs/parameters.md for every option.
    """
    _check_save_args(prefix, num_threads, metadata)
    target = os.path.abspath(os.fspath(prefix))
    if archive is None:
        archive = target.endswith(fmt.ARCHIVE_SUFFIX)
    if archive:
        resolve_compression(compression)
        if not atomic:
            raise InvalidArgumentError(
                "atomic=False is not supported for archives: an archive is always written whole to a staging "
                "file and renamed; drop atomic=False or save a directory"
            )
    elif compression is not None:
        raise InvalidArgumentError(
            f"compression={compression!r} needs an archive: pass archive=True or a prefix ending in .tdz"
        )
    c = resolve(comm, timeout)
    ch = background.channel(c)
    ch.wait_idle(wait_for_pending, target)
    options = dict(placements=placements, robust_key=robust_key, allow_pickle=allow_pickle, copy_existing=copy_existing)
    job = _SaveJob(
        target,
        metadata,
        robust_key,
        num_threads,
        check_replicas,
        atomic,
        share_non_tensor,
        allow_pickle,
        compression if archive else False,
    )
    if not return_early:
        local = _prepare_local(data, c.rank, None, **options)
        return _commit_and_open(c, job, local)
    bg = ch.background_comm()
    local = _prepare_local(data, c.rank, ch.buffers, **options)
    job.num_threads = max(num_threads, 1)
    return ch.submit(lambda: _commit_and_open(bg, job, local))


def _check_save_args(prefix, num_threads, metadata) -> None:
    if prefix is None:
        raise InvalidArgumentError(
            "save(prefix=None) is not supported: tensordict would write into the TensorDict's own memmap "
            "directory or anonymous memory, which no other rank can see; pass the checkpoint path"
        )
    _check_int("num_threads", num_threads)
    if metadata is not None:
        try:
            fmt.dumps(dict(metadata))
        except (TypeError, ValueError) as e:
            raise InvalidArgumentError(f"metadata must be a JSON-able dict: {e}") from None
        if not _str_keys(dict(metadata)):
            raise InvalidArgumentError(
                "metadata must be a JSON-able dict: every dict key must be a str (JSON would turn other keys "
                "into strings, and keys such as 1 and '1' into one)"
            )


def _str_keys(value) -> bool:
    if isinstance(value, Mapping):
        return all(type(k) is str and _str_keys(v) for k, v in value.items())
    if isinstance(value, (list, tuple)):
        return all(_str_keys(v) for v in value)
    return True


@dataclass
class _Local:
    """This rank's prepared shard, or the error that preparing it raised (it becomes this rank's vote)."""

    nodes: dict = None
    items: list = None
    objects: dict = None
    error: Exception | None = None


def _prepare_local(data, rank: int, buffers, *, placements, robust_key, allow_pickle, copy_existing) -> _Local:
    """Flatten and check the data; with ``buffers``, snapshot it (asynchronous save).

    Errors are captured, not raised: every rank must still take part in the
    commit so that all of them raise the same error instead of some hanging.
    """
    try:
        nodes, leaves, objects = flatten(data)
        if not robust_key:
            _check_verbatim_keys(nodes, {**leaves, **objects})
        _check_file_names(nodes, leaves, objects, robust_key)
        if not copy_existing:
            _check_not_mapped(leaves, rank)
        chosen = resolve_placements(nodes, leaves, placements)
        encoded = {}
        for k, (kind, value) in objects.items():
            where = f"rank {rank}: non-tensor leaf {list(k)}"
            if kind == "stack":
                encoded[k] = (kind, [fmt.encode_object(v, allow_pickle, where) for v in value])
            else:
                encoded[k] = (kind, fmt.encode_object(value, allow_pickle, where))
        items = []
        for k, t in leaves.items():
            if isinstance(chosen[k], Boxes):
                box, write = dtensor_box(t, k)
                where = (box or ((0,) * t.dim(), (0,) * t.dim()), tuple(t.shape))
            else:
                write, where = isinstance(chosen[k], Shard) or rank == 0, None
            local = buffers.snapshot(k, t) if buffers is not None else local_bytes(t)
            items.append((k, local, chosen[k], write, where))
        if buffers is not None:
            buffers.synchronize()
            buffers.retain_only(set(leaves))
        return _Local(nodes, items, encoded)
    except Exception as e:
        return _Local(error=e)


def _check_not_mapped(leaves, rank: int) -> None:
    mappings = file_mappings()
    for k, t in leaves.items():
        path = mapped_file(t.to_local() if is_dtensor(t) else t, mappings)
        if path is not None:
            raise InvalidDataError(
                f"rank {rank}: leaf {list(k)} is memory-mapped from {path!r} (for example, loaded from a "
                f"checkpoint); pass copy_existing=True to copy its data into the new checkpoint"
            )


@dataclass
class _SaveJob:
    """The options of one save that the commit needs (``compression`` False: a directory)."""

    target: str
    metadata: Mapping | None
    robust_key: bool
    num_threads: int
    check_replicas: bool
    atomic: bool
    share_non_tensor: bool
    allow_pickle: bool
    compression: Any


def _commit_and_open(c, job: _SaveJob, local: _Local) -> TensorDict:
    """Run the two-phase commit with this rank's prepared shard, then map what it saved."""
    archive = None
    if job.compression is not False:
        archive = ArchiveWriter(c.rank, local, job.robust_key, job.compression, job.num_threads, job.check_replicas)

    def write_fragment(root: str) -> dict:
        if local.error is not None:
            raise local.error
        return write_shard(
            root, c.rank, local.nodes, local.items, local.objects, job.robust_key, job.num_threads, job.check_replicas
        )

    def build_manifest(fragments: list[dict]) -> bytes:
        m = merge_fragments(
            fragments,
            metadata=dict(job.metadata or {}),
            robust_key=job.robust_key,
            version=__version__,
            layout="directory" if archive is None else "archive",
        )
        return fmt.dumps(to_json(m))

    two_phase_commit(c, job.target, write_fragment, build_manifest, atomic=job.atomic, archive=archive)
    logger.info("rank %d: committed %s", c.rank, job.target)
    manifest = _read_manifest(job.target)
    own = {k: where[0] for k, _t, _p, _w, where in local.items if where is not None}
    return _load_from(
        manifest, job.target, c, "saved", None, None, False, 0, job.allow_pickle, job.share_non_tensor, own
    )


def load(
    prefix: str | os.PathLike,
    *,
    comm: Any = None,
    shard: Any = "even",
    keys: Sequence | str | None = None,
    into: Any = None,
    strict: bool = True,
    device: torch.device | str | None = None,
    verify: bool = False,
    num_threads: int = 0,
    allow_pickle: bool = False,
    timeout: float | None = None,
) -> TensorDict | LoadReport:
    """Load a committed checkpoint, on any world size.

    ``shard="even"``: this rank's even share of the global rows (split as
    ``torch.tensor_split`` does). ``shard="saved"``: exactly the rows this
    rank saved (same world size only). ``shard=(start, stop)``: that row
    range; ``shard=[n_0, n_1, ...]``: per-rank row counts. ``shard=None``:
    the whole global TensorDict, in any process. Replicated and DTensor
    leaves come back whole. ``keys`` reads only those leaves (or nodes).
    ``verify`` checks every chunk read against its checksum.

    ``into=target`` (a TensorDict or nested dict of tensors and DTensors)
    fills the target in place instead, each leaf in its own placements, and
    returns a ``LoadReport``. Every key is checked first: with ``strict``,
    any missing, unexpected or mismatched key raises
    ``IncompatibleCheckpointError`` listing all of them and nothing is
    touched; ``strict=False`` loads what matches.
    """
    _check_int("num_threads", num_threads)
    target = os.path.abspath(os.fspath(prefix))
    c = LocalComm() if shard is None and comm is None and into is None else resolve(comm, timeout)
    check_shard(shard, c.size)

    def run():
        manifest = _read_manifest(target)
        if into is not None:
            return fill(
                manifest,
                target,
                into,
                strict=strict,
                shard=shard,
                rank=c.rank,
                size=c.size,
                num_threads=num_threads,
                verify=verify,
                allow_pickle=allow_pickle,
            )
        return _load_from(manifest, target, c, shard, keys, device, verify, num_threads, allow_pickle)

    if c.size == 1 or (shard is None and into is None):
        return run()
    return run_step(c, f"load of {target!r}", run)


def _load_from(
    manifest: Manifest,
    target: str,
    c,
    shard,
    keys,
    device,
    verify: bool,
    num_threads: int,
    allow_pickle: bool = False,
    share_non_tensor: bool = False,
    own_boxes: dict | None = None,
) -> TensorDict:
    if shard == "saved" and manifest.world_size != c.size:
        raise InvalidArgumentError(
            f"rank {c.rank}: shard='saved' needs the saving world size ({manifest.world_size} ranks), this job has "
            f"{c.size}; use shard='even' to reshard"
        )
    leaf_keys, node_keys = select(list(manifest.leaves) + list(manifest.objects), manifest.nodes, keys)
    objects = {
        k: object_value(manifest.objects[k], shard, c.rank, c.size, allow_pickle)
        for k in leaf_keys
        if k in manifest.objects
    }
    leaf_keys = [k for k in leaf_keys if k in manifest.leaves]
    leaves = [manifest.leaves[k] for k in leaf_keys]
    own_boxes = own_boxes or {}
    boxes = [own_boxes.get(leaf.key) or leaf_box(leaf, shard, c.rank, c.size) for leaf in leaves]
    tensors = read_leaves(target, manifest, zip(leaves, boxes), num_threads, verify)
    if device is not None:
        tensors = [t.to(device) for t in tensors]
    loaded = dict(zip(leaf_keys, tensors))

    def rows(key, batch):
        return node_rows(manifest, key, batch[0], shard, c.rank, c.size)

    return build({k: manifest.nodes[k] for k in node_keys}, loaded, rows, device, objects, share_non_tensor)


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


def _check_file_names(nodes, leaves, objects, robust_key: bool) -> None:
    """Refuse keys whose files would collide in a rank directory (with each other or with meta.json),
    or whose encoded names are too long for a file system."""
    taken: dict[tuple, dict[str, tuple | None]] = {k: {fmt.TD_META_NAME: None} for k in nodes}
    entries = [(k, fmt.encode_key(k[-1], robust_key)) for k in nodes if k]
    entries += [(k, fmt.encode_key(k[-1], robust_key) + fmt.LEAF_SUFFIX) for k in leaves]
    entries += [(k, fmt.encode_key(k[-1], robust_key)) for k in objects]
    for key, name in entries:
        if len(os.fsencode(name)) > 255:
            raise InvalidDataError(
                f"key {list(key)[:3]}... is stored as a file name of more than 255 bytes; shorten it"
            )
        names = taken[key[:-1]]
        if name in names:
            other = names[name]
            clash = "tensordict's meta.json" if other is None else f"the file of key {list(other)}"
            raise InvalidDataError(
                f"key {list(key)} would be stored as {name!r}, which clashes with {clash}; rename it"
            )
        names[name] = key
