"""The arguments of ``save`` and ``load``: checked and normalised before any collective.

Every rank checks its own arguments the same way, so a bad argument fails
every rank with the same ``InvalidArgumentError`` before any rank waits for
another; ``save_request`` turns a save's keyword arguments into the typed
``SaveRequest`` (with the ``SaveOptions`` that the commit and the stores use),
asking the prefix's store (``storage.backends``) what it cannot do.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any, cast

import torch

from . import format as fmt
from .core.types import EarlyReturn, SaveOptions, SaveRequest
from .errors import InvalidArgumentError
from .saving.arena import MIN_BUDGET
from .storage.backends import S3_SCHEME, store_for
from .storage.zipcodec import resolve_compression


def save_request(
    prefix: Any,
    *,
    comm: Any,
    placements: Mapping | None,
    num_threads: int,
    return_early: bool,
    snapshot_budget: int | None,
    async_writer: str,
    snapshot: str,
    guard: Any,
    atomic: bool,
    metadata: Mapping | None,
    copy_existing: bool,
    share_non_tensor: bool,
    robust_key: bool,
    allow_pickle: bool,
    check_replicas: bool,
    wait_for_pending: bool,
    timeout: float | None,
    archive: bool | None,
    compression: Any,
    layout: str | None,
    require_finite: bool = False,
    base: Any = None,
    trust_versions: bool = False,
) -> SaveRequest:
    """``save``'s keyword arguments (tensordict's, plus tddist's), checked and normalised; every rank
    refuses a bad argument the same way, before any collective."""
    check_save_args(prefix, num_threads, metadata)
    check_budget(snapshot_budget, return_early, check_replicas, archive, layout, prefix)
    store = store_for(prefix, archive)
    store.check_save(atomic=atomic, archive=archive, snapshot_budget=snapshot_budget, async_writer=async_writer)
    if async_writer not in ("thread", "process") or (async_writer == "process" and snapshot_budget is not None):
        raise InvalidArgumentError(
            f"async_writer={async_writer!r} is not supported: use 'thread' or 'process' (snapshot_budget needs "
            f"'thread')"
        )
    check_container(store.archive, atomic, compression, layout)
    options = SaveOptions(
        target=store.target,
        container="archive" if store.archive else "directory",
        metadata=dict(metadata or {}),
        robust_key=robust_key,
        num_threads=max(num_threads, 1) if return_early else num_threads,
        check_replicas=check_replicas,
        atomic=atomic,
        share_non_tensor=share_non_tensor,
        allow_pickle=allow_pickle,
        compression=resolve_compression(compression) if store.archive else None,
        packing="memmap" if store.archive or layout == "memmap" else "packed",
        require_finite=bool(require_finite),
        base=check_base(base, store.target),
        reuse_hashes=check_trust_versions(trust_versions, base) and not return_early,
    )
    deferred, optimizers = check_snapshot(snapshot, guard, return_early, snapshot_budget, async_writer)
    early = EarlyReturn(snapshot_budget, cast(Any, async_writer), deferred, optimizers) if return_early else None
    return SaveRequest(options, comm, timeout, placements, copy_existing, wait_for_pending, early)


def check_trust_versions(trust_versions: Any, base: Any) -> bool:
    """``trust_versions=``: a bool, and only with ``base=`` (it skips the hashing of an incremental save)."""
    if not isinstance(trust_versions, bool):
        raise InvalidArgumentError(f"trust_versions must be True or False, got {trust_versions!r}")
    if trust_versions and base is None:
        raise InvalidArgumentError(
            "trust_versions=True reuses the hashes of an incremental save's unchanged leaves; pass base= with it"
        )
    return trust_versions


def check_base(base: Any, target: str) -> str | None:
    """``base=``: the checkpoint an incremental save to ``target`` references (a path or ``s3://`` URL), or None.

    Raises:
        InvalidArgumentError: not a path; or, for a target on object storage, a base that is not in its bucket
            (a reference names its holder beside the referencing checkpoint, in the same bucket).
    """
    if base is None:
        return None
    if not isinstance(base, (str, os.PathLike)) or not os.fspath(base):
        raise InvalidArgumentError(f"base must be a checkpoint path (str or os.PathLike), got {base!r}")
    text = os.fspath(base)
    if not isinstance(text, str):
        raise InvalidArgumentError(f"base must be a str path, got bytes {base!r}")
    if target.startswith(S3_SCHEME):
        _same_bucket(text, target)
    return text.rstrip("/") if text.startswith(S3_SCHEME) else os.path.abspath(text)


def _same_bucket(base: str, target: str) -> None:
    """Refuse the base of a save to object storage that lies elsewhere than the target's bucket."""
    bucket = target[len(S3_SCHEME) :].split("/", 1)[0]
    if not base.startswith(S3_SCHEME) or base[len(S3_SCHEME) :].split("/", 1)[0] != bucket:
        where = "on a file system" if not base.startswith(S3_SCHEME) else "in another bucket"
        raise InvalidArgumentError(
            f"base {base!r} is {where}, but {target!r} is in bucket {bucket!r}: an incremental checkpoint on object "
            f"storage references chunks of a checkpoint beside it in the same bucket (docs/format.md 13.3); save "
            f"the base under the same prefix of {bucket!r} first, or save without base="
        )


def check_snapshot(
    snapshot: object, guard: object, return_early: bool, budget: int | None, writer: str
) -> tuple[bool, tuple[Any, ...] | None]:
    """``snapshot`` ("copy" or "deferred") and ``guard`` (optimizers), checked: whether the save is deferred,
    and the optimizers that guard it (None: those ``get_state`` saw, chosen when the save's leaves are known)."""
    if snapshot not in ("copy", "deferred"):
        raise InvalidArgumentError(f"snapshot must be 'copy' or 'deferred', got {snapshot!r}")
    optimizers = _optimizers(guard)
    if snapshot == "copy":
        if optimizers:
            raise InvalidArgumentError("guard= guards a deferred snapshot; pass snapshot='deferred' with it")
        return False, None
    if not return_early:
        raise InvalidArgumentError("snapshot='deferred' copies after save returns; pass return_early=True")
    if budget is not None or writer == "process":
        raise InvalidArgumentError(
            "snapshot='deferred' copies the whole state into the thread writer's arena: it takes neither "
            "snapshot_budget nor async_writer='process'"
        )
    return True, optimizers


def _optimizers(guard: object) -> tuple[Any, ...] | None:
    """``guard``: None (the default guard), an optimizer, or a sequence of them (anything with
    ``register_step_pre_hook``; an empty one guards nothing)."""
    if guard is None:
        return None
    items = (guard,) if hasattr(guard, "register_step_pre_hook") else guard
    if not isinstance(items, (list, tuple)) or not all(hasattr(o, "register_step_pre_hook") for o in items):
        raise InvalidArgumentError(
            f"guard must be a torch.optim.Optimizer or a list of them, got {type(guard).__name__}"
        )
    return tuple(items)


def check_container(archive: bool, atomic: bool, compression: Any, layout: str | None) -> None:
    """Refuse options the container (an archive or a directory) cannot honour."""
    if archive and not atomic:
        raise InvalidArgumentError(
            "atomic=False is not supported for archives: an archive is always written whole to a staging "
            "file and renamed; drop atomic=False or save a directory"
        )
    if not archive and compression is not None:
        raise InvalidArgumentError(
            f"compression={compression!r} needs an archive: pass archive=True or a prefix ending in .tdz"
        )
    if layout not in (None, "packed", "memmap"):
        raise InvalidArgumentError(
            f"layout={layout!r} is not supported; use 'packed' (one data file per rank, the default) or 'memmap' "
            f"(one file per leaf, loadable with TensorDict.load_memmap)"
        )
    if archive and layout == "packed":
        raise InvalidArgumentError(
            "layout='packed' is for directories: an archive stores one entry per leaf (layout 'memmap'); "
            "drop layout= or save a directory"
        )


def check_save_args(prefix: Any, num_threads: int, metadata: Mapping[str, Any] | None) -> None:
    """``prefix`` names a checkpoint, ``num_threads`` is a count, ``metadata`` is JSON-able with str keys."""
    if prefix is None:
        raise InvalidArgumentError(
            "save(prefix=None) is not supported: tensordict would write into the TensorDict's own memmap "
            "directory or anonymous memory, which no other rank can see; pass the checkpoint path"
        )
    check_int("num_threads", num_threads)
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


def check_budget(
    budget: int | None, return_early: bool, check_replicas: bool, archive: bool | None, layout: str | None, prefix: Any
) -> None:
    """``snapshot_budget`` is a byte count of at least ``MIN_BUDGET``, with ``return_early`` and a packed directory."""
    if budget is None:
        return
    if type(budget) is not int or budget < MIN_BUDGET:
        raise InvalidArgumentError(f"snapshot_budget must be an int of at least {MIN_BUDGET} bytes, got {budget!r}")
    if not return_early:
        raise InvalidArgumentError("snapshot_budget bounds the snapshot of return_early=True; pass return_early=True")
    if check_replicas:
        raise InvalidArgumentError(
            "snapshot_budget cannot be combined with check_replicas=True (replicas are not snapshotted when the "
            "data is streamed); drop one of them"
        )
    if archive or (archive is None and os.fspath(prefix).endswith(fmt.ARCHIVE_SUFFIX)) or layout == "memmap":
        raise InvalidArgumentError(
            "snapshot_budget needs the packed directory layout (an archive hashes and compresses every entry "
            "before writing, and layout='memmap' writes a file per leaf); save a directory with the default layout"
        )


def _str_keys(value: Any) -> bool:
    if isinstance(value, Mapping):
        return all(type(k) is str and _str_keys(v) for k, v in value.items())
    if isinstance(value, (list, tuple)):
        return all(_str_keys(v) for v in value)
    return True


def check_device(device: Any) -> None:
    """A device that cannot be used fails here, before anything is read, with a TddistError."""
    if device is None:
        return
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError, ValueError) as e:
        raise InvalidArgumentError(
            f"device={device!r} is not a torch device ({e}); use None, 'cpu' or 'cuda:N'"
        ) from None
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise InvalidArgumentError(
            f"device={device!r}: CUDA is not available in this process (torch {torch.__version__} "
            f"{'has no CUDA support' if torch.version.cuda is None else 'sees no GPU'}); load with device=None (or "
            f"'cpu') and move the tensors later, or run where a GPU is visible"
        )


def check_int(name: str, value: Any) -> None:
    """``value`` is a non-negative int (a bool is not)."""
    if type(value) is not int or value < 0:
        raise InvalidArgumentError(f"{name} must be a non-negative int, got {value!r}")
