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
    RootLockedError,
    SaveInProgressError,
    ShardingError,
    StorageError,
    TargetError,
    TddistError,
)

if TYPE_CHECKING:
    from .api import load, read_manifest, recover, save
    from .comm import Communicator, LocalComm, ThreadComm, run_threads
    from .conversion import convert
    from .manager import EXIT_PREEMPTED, CheckpointManager, Restored
    from .manifest import Manifest
    from .packing import pack, unpack
    from .plan import LoadReport
    from .sharding import PerRank, Replicate, Shard
    from .state import get_state, set_state

#: Public name -> the module that defines it.
_LAZY = {
    "save": "api",
    "load": "api",
    "read_manifest": "api",
    "recover": "api",
    "convert": "conversion",
    "pack": "packing",
    "unpack": "packing",
    "get_state": "state",
    "set_state": "state",
    "CheckpointManager": "manager",
    "EXIT_PREEMPTED": "manager",
    "Restored": "manager",
    "LoadReport": "plan",
    "Shard": "sharding",
    "Replicate": "sharding",
    "PerRank": "sharding",
    "Manifest": "manifest",
    "Communicator": "comm",
    "LocalComm": "comm",
    "ThreadComm": "comm",
    "run_threads": "comm",
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'tddist' has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{module}", __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))


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
    "SaveInProgressError",
    "RootLockedError",
    "CorruptCheckpointError",
    "CheckpointChangedError",
    "StorageError",
    "IncompatibleCheckpointError",
    "CommError",
    "CommTimeoutError",
    "CollectiveError",
]
