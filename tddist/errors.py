"""Every exception tddist raises.

All are ``TddistError`` subclasses so callers can catch one type. Messages say
what happened, on which rank, and how to fix it. Each class takes a single
message so an error raised on one rank can be rebuilt, with the same class, on
every other rank (see ``comm.collective_error``).
"""

from __future__ import annotations


class TddistError(Exception):
    """Base class of every tddist error.

    ``failures`` maps each failing rank to its message when the error was
    agreed on collectively; it is empty for a purely local error.

    Args:
        message: what happened, on which rank, and how to fix it.
        failures: each failing rank's message, for an error agreed on by all ranks.
    """

    def __init__(self, message: str, failures: dict[int, str] | None = None):
        super().__init__(message)
        self.failures: dict[int, str] = dict(failures or {})


class InvalidArgumentError(TddistError, ValueError):
    """An argument of ``save``/``load`` is invalid (wrong type, unknown option)."""


class InvalidDataError(TddistError, ValueError):
    """The data handed to ``save`` cannot be checkpointed as given."""


class ShardingError(InvalidDataError):
    """The ranks' shards do not tile their global tensors (gap, overlap, mismatch)."""


class TargetError(TddistError):
    """The target path cannot be written: a file, a foreign directory, unwritable."""


class CheckpointNotFoundError(TddistError, FileNotFoundError):
    """No committed checkpoint (no valid manifest) exists at the given path."""


class ManifestError(TddistError):
    """The manifest is unreadable, of an unknown version, or inconsistent."""


class IncompatibleCheckpointError(TddistError):
    """``load(into=...)``: the checkpoint's keys, shapes or dtypes do not match the target."""


class NonFiniteError(InvalidDataError):
    """``save(..., require_finite=True)``: the data holds NaN or infinite values; nothing was committed."""


class CorruptCheckpointError(TddistError):
    """A data file is missing, of the wrong size, or fails its checksum."""


class CheckpointChangedError(TddistError):
    """A checkpoint was replaced by an overwrite while it was being read; loading it again reads the new one whole."""


class StorageError(TddistError):
    """The storage failed under a read (an I/O error such as EIO, a permission denied); the checkpoint may be intact."""


class CommError(TddistError):
    """A collective operation failed: a peer died or the transport broke."""


class CommTimeoutError(CommError, TimeoutError):
    """A collective operation did not complete within its timeout (a rank hung or died)."""


class CollectiveError(TddistError):
    """Several ranks failed with different errors; ``failures`` lists them all."""


class RootLockedError(TddistError):
    """Another live job holds the lock of a ``CheckpointManager``'s root; the message names its host and pid."""


class SaveInProgressError(TddistError):
    """An asynchronous save is still in flight and the caller asked not to wait for it."""


class SnapshotChangedError(TddistError):
    """A deferred snapshot's leaf was changed in place (or given other storage) while it was being copied; the
    save was refused on every rank and nothing was committed."""


class InjectedFault(TddistError):
    """Raised by the fault-injection hook (tests only, see ``tddist._faults``)."""


class CheckpointPinnedError(TddistError, OSError):
    """A checkpoint was not deleted: an incremental save in progress pins it (it holds chunks the save is
    about to reference); the clean-up leaves it for a later pass."""


def wrap_transport_error(rank: int, op: str, exc: BaseException, elapsed: float, timeout: float) -> CommError:
    """Turn a transport exception into CommError/CommTimeoutError with advice."""
    text = str(exc)
    timed_out = elapsed >= 0.9 * timeout or "timed out" in text.lower() or "timeout" in text.lower()
    cls = CommTimeoutError if timed_out else CommError
    why = f"did not complete within {timeout:.0f}s" if timed_out else "failed"
    return cls(
        f"rank {rank}: {op} {why} after {elapsed:.1f}s ({type(exc).__name__}: {text.splitlines()[0] if text else ''}); "
        f"a peer rank probably died or hung, see the other ranks' logs. During a save, the target now holds "
        f"either the previous checkpoint or, if rank 0 committed before the failure, the new one, never a "
        f"partial one (tddist.read_manifest tells which; run tddist.recover on the target to remove leftovers)"
    )


#: Classes that may be rebuilt by name on another rank.
BY_NAME: dict[str, type[TddistError]] = {
    cls.__name__: cls
    for cls in (
        TddistError,
        InvalidArgumentError,
        InvalidDataError,
        NonFiniteError,
        ShardingError,
        TargetError,
        CheckpointNotFoundError,
        ManifestError,
        IncompatibleCheckpointError,
        CorruptCheckpointError,
        CheckpointChangedError,
        StorageError,
        CommError,
        CommTimeoutError,
        CollectiveError,
        SaveInProgressError,
        RootLockedError,
        SnapshotChangedError,
        InjectedFault,
        CheckpointPinnedError,
    )
}
