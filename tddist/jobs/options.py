"""The ``CheckpointManager`` constructor's options, checked and normalised once, on every rank.

A manager refuses bad options before its first collective, so that every
rank fails the same way without waiting for the others. The checks that need
no communicator (counts, the time interval, the node-local directory, the
``save_kwargs`` the manager reserves, what the root's storage can honour)
live here, apart from the manager's collective work, and hand their result
over as one ``ManagerOptions``. No collectives, no I/O but the root's name.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from ..errors import InvalidArgumentError
from ..storage.backends import root_for, store_for
from ..storage.roots import Root
from .retention import Retention, step_name

#: The ``tddist.save`` arguments the manager sets itself.
RESERVED = frozenset({"return_early", "comm", "prefix", "data"})


@dataclass(frozen=True)
class ManagerOptions:
    """A manager's options once checked: what ``CheckpointManager.__init__`` keeps of its arguments.

    Attributes:
        root: where the step checkpoints are (a directory or ``s3://bucket/prefix``).
        keep_last: as given (also a rule of ``retention``).
        every: save when ``step % every == 0``, or None.
        async_save: save with ``return_early=True``.
        deferred: ``async_save="deferred"``: with ``snapshot="deferred"``, guarded by the state's optimizers.
        retention: the retention rules (``keep_last``, ``keep_best`` by ``metric``, ``keep_period``).
        interval: ``save_interval_minutes`` in seconds, or None (no time-based saves).
        save_kwargs: a copy of the ``save_kwargs`` given, none of them reserved.
        local_dir: the node-local tier's directory, or None.
        replicas: copies of each rank's local part kept on other nodes (0 or 1).
        node: this rank's node as given (None: detected, see ``comm.node.node_name``).
        restore_finite: ``restore="finite"``: restore skips checkpoints that hold NaN or Inf values.
        incremental: each save references what it shares with the last checkpoint (``save(base=...)``).
    """

    root: Root
    keep_last: int | None
    every: int | None
    async_save: bool
    retention: Retention
    interval: float | None
    save_kwargs: dict[str, Any]
    local_dir: str | os.PathLike | None
    deferred: bool = False
    replicas: int = 0
    node: str | None = None
    restore_finite: bool = False
    incremental: bool = False


def check_options(
    root: str | os.PathLike,
    *,
    keep_last: int | None,
    every: int | None,
    async_save: bool | str,
    save_kwargs: dict[str, Any] | None,
    local_dir: str | os.PathLike | None,
    keep_best: int | None,
    metric: str | None,
    mode: str,
    keep_period: int | None,
    save_interval_minutes: float | None,
    replicas: int = 0,
    node: str | None = None,
    restore: str = "newest",
    incremental: bool = False,
) -> ManagerOptions:
    """The manager's options, checked in the order the manager has always checked them.

    Raises:
        InvalidArgumentError: an invalid option, named, with what it must be.
    """
    _check_count("every", every, allow_none=True)
    if async_save not in (True, False, "deferred"):
        raise InvalidArgumentError(f"async_save must be True, False or 'deferred', got {async_save!r}")
    if restore not in ("newest", "finite"):
        raise InvalidArgumentError(f"restore={restore!r} is not supported: use 'newest' or 'finite'")
    retention = Retention(keep_last, keep_best, metric, mode, keep_period)
    interval = _interval_seconds(save_interval_minutes)
    if local_dir is not None:
        _check_local_dir(local_dir)
    if local_dir is not None and async_save:
        raise InvalidArgumentError(
            "async_save=True with local_dir: the local tier already promotes to the root in the background; "
            "pass one of them"
        )
    _check_replicas(replicas, local_dir, node)
    kwargs = dict(save_kwargs or {})
    bad = (RESERVED | ({"snapshot", "guard"} if async_save == "deferred" else set())) & set(kwargs)
    if bad:
        raise InvalidArgumentError(f"save_kwargs may not set {sorted(bad)}: the manager sets them")
    where = root_for(root)
    _check_storage(where, kwargs)
    return ManagerOptions(
        root=where,
        keep_last=keep_last,
        every=every,
        async_save=bool(async_save),
        retention=retention,
        interval=interval,
        save_kwargs=kwargs,
        local_dir=local_dir,
        deferred=async_save == "deferred",
        replicas=replicas,
        node=node,
        restore_finite=restore == "finite",
        incremental=_check_incremental(incremental, local_dir),
    )


def step_path(root: Root, save_kwargs: Mapping[str, Any], step: int) -> str:
    """Where the checkpoint of ``step`` is saved under ``root``: ``.tdz`` when ``save_kwargs`` ask for an archive."""
    archive = bool(save_kwargs.get("archive") or save_kwargs.get("compression"))
    return root.join(step_name(step, archive))


def _check_count(name: str, value: object, allow_none: bool) -> None:
    if value is None and allow_none:
        return
    if type(value) is not int or value < 1:
        raise InvalidArgumentError(f"{name} must be a positive int{' or None' if allow_none else ''}, got {value!r}")


def _interval_seconds(minutes: object) -> float | None:
    """``save_interval_minutes`` in seconds (None: no time-based saves)."""
    if minutes is None:
        return None
    if isinstance(minutes, bool) or not isinstance(minutes, (int, float)) or not minutes > 0:
        raise InvalidArgumentError(f"save_interval_minutes must be a positive number or None, got {minutes!r}")
    return float(minutes) * 60.0


def _check_replicas(replicas: object, local_dir: object, node: object) -> None:
    """``replicas`` is 0 or 1 (one copy on another node), and needs the node-local tier."""
    if type(replicas) is not int or replicas not in (0, 1):
        raise InvalidArgumentError(
            f"replicas must be 0 or 1 (copies of each local part on another node), got {replicas!r}"
        )
    if replicas and local_dir is None:
        raise InvalidArgumentError("replicas=1 replicates the node-local tier: pass local_dir= too")
    if node is not None and (not isinstance(node, str) or not node):
        raise InvalidArgumentError(f"node must be a non-empty string naming this rank's node, or None, got {node!r}")


def _check_local_dir(local_dir: str | os.PathLike) -> None:
    """The node-local tier is a directory on each node's own file system: refuse anything else (``s3://``)."""
    try:
        local = root_for(local_dir).local
    except InvalidArgumentError:
        local = False
    if not local:
        raise InvalidArgumentError(
            f"local_dir={os.fspath(local_dir)!r}: the node-local tier needs a directory on each node's own file "
            f"system (a tmpfs, a local disk); object storage can only be the root"
        )


def _check_storage(root: Root, save_kwargs: Mapping[str, Any]) -> None:
    """Refuse ``save_kwargs`` that the root's storage cannot honour."""
    try:
        store_for(step_path(root, save_kwargs, 0)).check_save(
            atomic=bool(save_kwargs.get("atomic", True)),
            archive=save_kwargs.get("archive"),
            snapshot_budget=save_kwargs.get("snapshot_budget"),
            async_writer=save_kwargs.get("async_writer", "thread"),
        )
    except InvalidArgumentError as e:
        raise InvalidArgumentError(f"save_kwargs of a manager of {root.target!r}: {e}") from None


def _check_incremental(incremental: object, local_dir: object) -> bool:
    if type(incremental) is not bool or (incremental and local_dir is not None):
        raise InvalidArgumentError(f"incremental must be True or False (and False with local_dir), got {incremental!r}")
    return incremental
