"""Deferred snapshots: the copy of a ``return_early`` save runs after ``save`` returned, guarded and proven.

Parameters and optimizer state do not change between two optimizer steps,
so ``save(..., return_early=True, snapshot="deferred")`` plans the save and
returns before copying them; the copy runs in the background while the next
forward and backward run. Two things keep the checkpoint one step's state:

- **The guard** (``arm``): a step pre-hook on each optimizer the save was
  given (``guard=``), or by default on each optimizer that ``get_state``
  saw whose parameters or state the save holds (``seen_guarding``), blocks
  the step until the copy is done, so the step
  never changes what is still being copied. What the optimizers do not own
  (buffers that forward changes in place, such as BatchNorm's running
  statistics) and leaves under ``EAGER_BYTES`` are copied before ``save``
  returns (``eager_keys``). Without optimizers (``guard=[]``, or none
  seen) nothing is guarded and every
  leaf is copied later: the caller waits with ``future.wait_snapshot()``
  before changing the state.
- **The proof** (``Proof``): every deferred leaf's version counter
  (``Tensor._version``, which every in-place operation bumps) and storage are
  recorded when ``save`` is called and checked after its copy, and once more
  when the whole copy is done. A leaf that changed makes this rank's vote a
  ``SnapshotChangedError``: the save fails on every rank and nothing is
  committed. A change the version counter does not see (through ``.data``,
  or by another process) is not detected.
"""

from __future__ import annotations

import logging
import operator
import threading
import weakref
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from .._compat import dtensor_local
from ..core.types import Key
from ..errors import SnapshotChangedError

logger = logging.getLogger(__name__)

#: Leaves smaller than this are copied before ``save`` returns, guarded or not by an optimizer: copying them
#: costs less than tracking them (an optimizer's step counter, a scheduler's state).
EAGER_BYTES = 64 * 1024

#: Called on the copying thread with the keys of each slot's leaves before they are copied (the test suite and
#: the benchmarks hold or slow the copy with it, so that a change during the copy is not left to timing).
copy_hooks: list[Callable[[list[Key]], None]] = []

#: Guards the registries below (the optimizers seen, armed and hooked).
_lock = threading.Lock()


@dataclass(frozen=True, slots=True)
class Watched:
    """A deferred leaf the proof checks: the tensor the caller's state holds and the storage its bytes are in
    when ``save`` was called (a kept plan found its address unchanged while it holds that storage:
    ``deferred_plan``). Its version counter is read at every save (``versions``)."""

    key: Key
    tensor: torch.Tensor
    storage: int


def _storage(t: torch.Tensor) -> int:
    """The address of the storage whose bytes are saved (a DTensor's local shard's).

    Not through ``local_source``: an in-place change or a new storage shows on the caller's own tensor
    (detaching keeps its storage, and resolving a conjugate view would make a new one at every call), and
    its checks cost 3 us a call, several calls a leaf, on the blocking path of a deferred save."""
    if hasattr(t, "device_mesh"):
        t = dtensor_local(t)
    return int(t.untyped_storage().data_ptr())


def watch(key: Key, t: torch.Tensor) -> Watched:
    """``t`` (leaf ``key`` as the caller passed it) and its storage as they are now."""
    return Watched(key, t, _storage(t))


_VERSION = operator.attrgetter("_version")


def versions(tensors: Sequence[torch.Tensor]) -> list[int]:
    """Each tensor's version counter now: one pass in C over the leaves, the proof's record at every save
    (a record object per leaf cost a microsecond each on the caller's thread)."""
    return list(map(_VERSION, tensors))


class Proof:
    """The deferred leaves of one save (by their index in the copy; None for a leaf copied eagerly), their
    version counters when ``save`` was called (``recorded``: the deferred leaves' only, in order; ``at`` gives
    each index's place in it, by default the index itself), and the first leaf found changed.

    ``check`` runs after a leaf's bytes are copied; ``seal`` checks every leaf
    once the whole copy is done and then stops checking (whatever changes
    afterwards is the next step's), before the guard lets a step run.
    """

    def __init__(
        self, rank: int, leaves: Sequence[Watched | None], recorded: Sequence[int], at: Sequence[int] | None = None
    ) -> None:
        self.rank = rank
        self.leaves = leaves
        self.versions = recorded
        self._at = range(len(leaves)) if at is None else at
        self.failure: SnapshotChangedError | None = None
        self._sealed = False
        self._lock = threading.Lock()

    def before(self, indices: Iterable[int]) -> None:
        """(the copying thread) Run the copy hooks before the leaves at ``indices`` are copied."""
        if copy_hooks:
            keys = [r.key for r in (self.leaves[i] for i in indices) if r is not None]
            for hook in list(copy_hooks):
                hook(keys)

    def check(self, indices: Iterable[int]) -> bool:
        """Whether the leaves at ``indices``, just copied, are still as recorded (the first change is kept)."""
        with self._lock:
            if self.failure is None and not self._sealed:
                for i in indices:
                    if self.leaves[i] is not None and not self._same(i):
                        break
            return self.failure is None

    def seal(self) -> SnapshotChangedError | None:
        """Check every leaf once (the first call), then stop checking; the failure, if any."""
        with self._lock:
            if not self._sealed:
                for i, r in enumerate(self.leaves):
                    if self.failure is not None or (r is not None and not self._same(i)):
                        break
                self._sealed = True
            return self.failure

    def _same(self, i: int) -> bool:
        r, recorded = self.leaves[i], self.versions[self._at[i]]
        assert r is not None
        version, storage = int(r.tensor._version), _storage(r.tensor)
        if version == recorded and storage == r.storage:
            return True
        what = (
            f"its version counter went from {recorded} to {version}"
            if version != recorded
            else "it was given other storage"
        )
        self.failure = SnapshotChangedError(
            f"rank {self.rank}: leaf {list(r.key)} was changed while the deferred snapshot copied it ({what}); "
            f"nothing was committed. Pass the optimizers that change the state as guard= (their step then waits "
            f"for the copy), or call wait_snapshot() on the save's future before changing the state"
        )
        logger.info("%s", self.failure)
        return False


def guarded_storages(optimizers: Sequence[Any]) -> set[int]:
    """The storages the steps of ``optimizers`` change: their parameters' and their tensor state's."""
    out: set[int] = set()
    for opt in optimizers:
        for group in opt.param_groups:
            out.update(_storage(p) for p in group["params"])
        for state in opt.state.values():
            out.update(_storage(v) for v in state.values() if isinstance(v, torch.Tensor))
    out.discard(0)
    return out


#: The optimizers ``tddist.get_state`` saw (weakly held): a deferred save without ``guard=`` guards those whose
#: parameters or state it holds, so the common ``save(get_state(model, opt), ...)`` is guarded without more code.
_seen: weakref.WeakSet[Any] = weakref.WeakSet()


def remember_optimizer(optimizer: Any) -> None:
    """Remember ``optimizer`` (``get_state`` saw it) as a guard for deferred saves of its state."""
    with _lock:
        _seen.add(optimizer)


def seen_optimizers() -> tuple[Any, ...]:
    """The optimizers ``get_state`` saw, still alive."""
    with _lock:
        return tuple(_seen)


def seen_guarding(sources: Mapping[Key, torch.Tensor]) -> tuple[Any, ...]:
    """The optimizers ``get_state`` saw whose steps change a leaf of ``sources`` (the default guard)."""
    return default_guard(sources)[0]


def default_guard(sources: Mapping[Key, torch.Tensor]) -> tuple[tuple[Any, ...], set[int]]:
    """``seen_guarding``'s optimizers and the storages their steps change (computed once: ``eager_keys`` takes them)."""
    storages = {_storage(t) for t in sources.values()}
    guard, guarded = [], set()
    for opt in seen_optimizers():
        theirs = guarded_storages([opt])
        if theirs & storages:
            guard.append(opt)
            guarded |= theirs
    return tuple(guard), guarded


def eager_keys(
    sources: Mapping[Key, torch.Tensor], optimizers: Sequence[Any], guarded: set[int] | None = None
) -> set[Key]:
    """The leaves a deferred save copies before it returns: with a guard, those under ``EAGER_BYTES`` and those
    the optimizers' steps do not change (buffers); without one, none (the caller waits for the copy).
    ``guarded``: the optimizers' ``guarded_storages``, when already known."""
    if not optimizers:
        return set()
    if guarded is None:
        guarded = guarded_storages(optimizers)
    return {
        k
        for k, t in sources.items()
        if t.numel() * t.element_size() < EAGER_BYTES or t.untyped_storage().data_ptr() not in guarded
    }


class Pending:
    """One save's deferred copy: ``wait`` returns once it is copied and its proof sealed (idempotent)."""

    def __init__(self, wait_copied: Callable[[], None], proof: Proof) -> None:
        self._wait_copied = wait_copied
        self.proof = proof
        self.finished = threading.Event()

    def wait(self) -> None:
        self._wait_copied()
        self.proof.seal()
        self.finished.set()


_armed: weakref.WeakKeyDictionary[Any, list[Pending]] = weakref.WeakKeyDictionary()
_hooked: weakref.WeakKeyDictionary[Any, Any] = weakref.WeakKeyDictionary()


def arm(optimizers: Sequence[Any], pending: Pending) -> None:
    """Make the next step of each of ``optimizers`` wait for ``pending`` (a step pre-hook, registered once)."""
    with _lock:
        for opt in optimizers:
            if opt not in _hooked:
                _hooked[opt] = opt.register_step_pre_hook(_before_step)
            waits = [p for p in _armed.get(opt, []) if not p.finished.is_set()]
            _armed[opt] = [*waits, pending]


def _before_step(optimizer: Any, _args: Any, _kwargs: Any) -> None:
    """(an optimizer's step pre-hook) Wait for the copies of the saves that guard this optimizer."""
    with _lock:
        waits = _armed.pop(optimizer, [])
    for p in waits:
        if not p.finished.is_set():
            logger.debug("optimizer step waits for a deferred snapshot's copy")
        p.wait()
