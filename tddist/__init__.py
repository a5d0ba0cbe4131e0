"""tddist: atomic, checksummed, sharded checkpoints of multi-rank PyTorch state.

Every rank calls ``save`` with its shard; the checkpoint appears at the
target all at once, complete and verified, or not at all.
"""

__version__ = "0.1.0"

from .api import load, read_manifest, recover, save
from .comm import Communicator, LocalComm, ThreadComm, run_threads
from .convert import pack, unpack
from .errors import (
    CheckpointNotFoundError,
    CollectiveError,
    CommError,
    CommTimeoutError,
    CorruptCheckpointError,
    IncompatibleCheckpointError,
    InvalidArgumentError,
    InvalidDataError,
    ManifestError,
    SaveInProgressError,
    ShardingError,
    TargetError,
    TddistError,
)
from .manager import EXIT_PREEMPTED, CheckpointManager
from .manifest import Manifest
from .plan import LoadReport
from .sharding import Replicate, Shard
from .state import get_state, set_state

__all__ = [
    "save",
    "load",
    "read_manifest",
    "recover",
    "pack",
    "unpack",
    "get_state",
    "set_state",
    "CheckpointManager",
    "EXIT_PREEMPTED",
    "LoadReport",
    "Shard",
    "Replicate",
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
    "CorruptCheckpointError",
    "IncompatibleCheckpointError",
    "CommError",
    "CommTimeoutError",
    "CollectiveError",
]
