"""What every checkpoint layout implements (``ShardWriter``), and what all of them share.

A layout is where and how the ranks' bytes are stored: a directory tree
(``layouts.directory``) or one zip archive (``layouts.archive``). The commit
(``commit.two_phase_commit``) drives a ``ShardWriter`` through its steps and
knows nothing else about the layout, so a new layout (packed files, object
storage) is a new ``ShardWriter``, not new branches in the commit.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Protocol

from .. import format as fmt
from ..checksum import checksum_bytes, tensor_bytes
from ..sharding import consistent_batch
from ..types import (
    ArchiveEntryRow,
    Fragment,
    FragmentLeaf,
    FragmentObject,
    Key,
    LocalShard,
    SavePlan,
    Staging,
    StoredBytes,
)

if TYPE_CHECKING:
    import torch


class ShardWriter(Protocol):
    """One rank's side of a save in one layout; ``commit.two_phase_commit`` calls it.

    Call order (rank 0 runs the "all ranks" steps too):

    1. (all ranks) ``plan()``: prepare this rank's part in memory (for an
       archive: hash and compress it) and return the ``SavePlan`` (target,
       layout, bytes its region needs). Raises the error of a shard that could
       not be prepared; it becomes this rank's failure in the first round.
    2. (rank 0) ``open(plans)``: check the target, create the staging area
       and reserve every rank's region; return the ``Staging``. Cleans up
       after itself if it fails.
    3. (all ranks) ``write(staging)``: write this rank's part durably; return
       its ``Fragment``, the rank's vote.
    4. (rank 0) ``finalize(staging, manifest, fragments)``: write the
       manifest (and an archive's central directory) durably.
    5. (rank 0) ``publish(staging)``: make the staging area the target, the
       commit point.

    (rank 0) ``abort(staging)`` after a failure at any step from 3 on (and
    after a fault right after 2): remove what was staged; it never raises.
    """

    target: str

    def plan(self) -> SavePlan: ...

    def open(self, plans: list[SavePlan]) -> Staging: ...

    def write(self, staging: Staging) -> Fragment: ...

    def finalize(self, staging: Staging, manifest: bytes, fragments: list[Fragment]) -> None: ...

    def publish(self, staging: Staging) -> None: ...

    def abort(self, staging: Staging) -> None: ...


def build_fragment(
    rank: int,
    shard: LocalShard,
    stored: dict[Key, StoredBytes],
    check_replicas: bool,
    entries: tuple[ArchiveEntryRow, ...] = (),
) -> Fragment:
    """This rank's vote: its nodes, and each leaf's shape, placement and, if it wrote it, what it stored.

    With ``check_replicas`` the replicas this rank did not write are hashed
    too, so rank 0 can compare them with the copy it writes.
    """
    leaves = tuple(
        FragmentLeaf(
            key=item.key,
            dtype=fmt.dtype_name(item.tensor.dtype),
            shape=tuple(item.tensor.shape),
            placement=item.placement,
            stored=stored.get(item.key),
            dtensor=item.dtensor,
            replica_checksum=(
                checksum_bytes(tensor_bytes(item.tensor)) if check_replicas and not item.writes else None
            ),
        )
        for item in shard.items
    )
    return Fragment(
        rank=rank,
        nodes=tuple((k, tuple(b)) for k, b in shard.nodes.items()),
        leaves=leaves,
        objects=tuple(FragmentObject(k, o.kind, o.value) for k, o in shard.objects.items()),
        entries=entries,
    )


def node_meta_files(rank: int, shard: LocalShard, robust_key: bool) -> dict[str, bytes]:
    """tensordict's meta.json of every node of this rank, by relative path, so
    ``TensorDict.load_memmap(<rank dir>)`` opens what this rank wrote.

    Non-tensor values stored as JSON get tensordict's NonTensorData /
    NonTensorStack entries; pickled ones are left out (tddist never writes pickle files).
    """
    nodes, leaves = shard.nodes, shard.written()
    children: dict[Key, list[str]] = {k: [] for k in nodes}
    node_leaves: dict[Key, dict[str, tuple[list[int], torch.dtype]]] = {k: {} for k in nodes}
    node_objects: dict[Key, dict[str, str]] = {k: {} for k in nodes}
    files: dict[str, bytes] = {}
    for key in nodes:
        if key:
            children[key[:-1]].append(key[-1])
    for key, t in leaves.items():
        node_leaves[key[:-1]][key[-1]] = (list(t.shape), t.dtype)
    for key, obj in shard.objects.items():
        kind = obj.kind
        meta = fmt.td_object_meta(kind, obj.value)
        if meta is not None:
            files[os.path.join(fmt.node_relpath(rank, key, robust_key), fmt.TD_META_NAME)] = fmt.dumps(meta)
            node_objects[key[:-1]][key[-1]] = "NonTensorStack" if kind == "stack" else "NonTensorData"
    for key, saved_batch in nodes.items():
        batch = consistent_batch(saved_batch, [s for s, _ in node_leaves[key].values()])
        meta = fmt.td_meta(batch, node_leaves[key], children[key], node_objects[key])
        files[os.path.join(fmt.node_relpath(rank, key, robust_key), fmt.TD_META_NAME)] = fmt.dumps(meta)
    return files
