"""tddist: atomic, checksummed, sharded checkpoints of multi-rank PyTorch state.

Every rank calls ``save`` with its shard; the checkpoint appears at the
target all at once, complete and verified, or not at all.

The public names are imported on first use (PEP 562), so that ``import
tddist`` and the ``tddist`` command's light subcommands do not pay for
importing torch until a name that needs it is used.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from ._version import __version__
from .errors import (
    CheckpointChangedError,
    CheckpointNotFoundError,
    CollectiveError,
    CommError,
    CommTimeoutError,
    CorruptCheckpointError,
    IncompatibleCheckpointError,
    InvalidArgumentError,
    InvalidDataError,
    ManifestError,
    NonFiniteError,
    RootLockedError,
    SaveInProgressError,
    ShardingError,
    SnapshotChangedError,
    StorageError,
    TargetError,
    TddistError,
)

if TYPE_CHECKING:
    from .api import load, read_manifest, recover, save
    from .comm.base import Communicator, LocalComm
    from .comm.threads import ThreadComm, run_threads
    from .core.sharding import PerRank, Replicate, Shard
    from .interop.convert import convert
    from .jobs.manager import EXIT_PREEMPTED, CheckpointManager
    from .jobs.restore import Restored
    from .jobs.state import get_state, set_state
    from .loading.share import LoadReport
    from .manifest.model import Manifest
    from .tools.pack import pack, unpack

#: Public name -> the module that defines it.
_LAZY = {
    "save": "api",
    "load": "api",
    "read_manifest": "api",
    "recover": "api",
    "convert": "interop.convert",
    "pack": "tools.pack",
    "unpack": "tools.pack",
    "get_state": "jobs.state",
    "set_state": "jobs.state",
    "CheckpointManager": "jobs.manager",
    "EXIT_PREEMPTED": "jobs.manager",
    "Restored": "jobs.restore",
    "LoadReport": "loading.share",
    "Shard": "core.sharding",
    "Replicate": "core.sharding",
    "PerRank": "core.sharding",
    "Manifest": "manifest.model",
    "Communicator": "comm.base",
    "LocalComm": "comm.base",
    "ThreadComm": "comm.threads",
    "run_threads": "comm.threads",
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'tddist' has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{module}", __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(__all__)


__all__ = [
    "__version__",
    "save",
    "load",
    "read_manifest",
    "recover",
    "convert",
    "pack",
    "unpack",
    "get_state",
    "set_state",
    "CheckpointManager",
    "EXIT_PREEMPTED",
    "Restored",
    "LoadReport",
    "Shard",
    "Replicate",
    "PerRank",
    "Manifest",
    "Communicator",
    "LocalComm",
    "ThreadComm",
    "run_threads",
    "TddistError",
    "InvalidArgumentError",
    "InvalidDataError",
    "ShardingError",
    "TargetError",
    "CheckpointNotFoundError",
    "ManifestError",
    "NonFiniteError",
    "SaveInProgressError",
    "RootLockedError",
    "CorruptCheckpointError",
    "CheckpointChangedError",
    "SnapshotChangedError",
    "StorageError",
    "IncompatibleCheckpointError",
    "CommError",
    "CommTimeoutError",
    "CollectiveError",
]
