"""tensordict's ``meta.json`` files of a rank directory, so ``TensorDict.load_memmap(<rank dir>)`` opens it.

The directory and archive stores write them beside the leaves of
``layout="memmap"`` rank directories (and archives, whose entries are the
same tree), so a rank's part stays a plain tensordict memmap directory.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

from .. import format as fmt
from ..core.sharding import consistent_batch
from ..core.types import (
    EncodedObject,
    Key,
    LocalShard,
)


def node_meta_files(rank: int, shard: LocalShard, robust_key: bool) -> dict[str, bytes]:
    """tensordict's meta.json of every node of this rank's shard, by relative path (see ``meta_files``)."""
    leaves = {k: (list(t.shape), fmt.dtype_name(t.dtype)) for k, t in shard.written().items()}
    return meta_files(rank, shard.nodes, leaves, shard.objects, robust_key)


def meta_files(
    rank: int,
    nodes: Mapping[Key, tuple[int, ...]],
    leaves: Mapping[Key, tuple[list[int], str]],
    objects: Mapping[Key, EncodedObject],
    robust_key: bool,
) -> dict[str, bytes]:
    """tensordict's meta.json of every node of one rank, by relative path, so
    ``TensorDict.load_memmap(<rank dir>)`` opens what that rank stored.

    ``nodes`` are the rank's batch sizes, ``leaves`` the local shape and dtype
    name of every leaf it stored. Non-tensor values stored as JSON get
    tensordict's NonTensorData / NonTensorStack entries; pickled ones are left
    out (tddist never writes pickle files).
    """
    children: dict[Key, list[str]] = {k: [] for k in nodes}
    node_leaves: dict[Key, dict[str, tuple[list[int], str]]] = {k: {} for k in nodes}
    node_objects: dict[Key, dict[str, str]] = {k: {} for k in nodes}
    files: dict[str, bytes] = {}
    for key in nodes:
        if key:
            children[key[:-1]].append(key[-1])
    for key, (shape, dtype) in leaves.items():
        node_leaves[key[:-1]][key[-1]] = (shape, f"torch.{dtype}")
    for key, obj in objects.items():
        meta = fmt.td_object_meta(obj.kind, obj.value)
        if meta is not None:
            files[os.path.join(fmt.node_relpath(rank, key, robust_key), fmt.TD_META_NAME)] = fmt.dumps(meta)
            node_objects[key[:-1]][key[-1]] = "NonTensorStack" if obj.kind == "stack" else "NonTensorData"
    for key, saved_batch in nodes.items():
        batch = consistent_batch(saved_batch, [s for s, _ in node_leaves[key].values()])
        meta = fmt.td_meta(batch, node_leaves[key], children[key], node_objects[key])
        files[os.path.join(fmt.node_relpath(rank, key, robust_key), fmt.TD_META_NAME)] = fmt.dumps(meta)
    return files
