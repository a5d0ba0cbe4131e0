"""Assertions shared by the test modules and the rank programs.

One definition each, importable both by pytest (``tests/conftest.py``
re-exports them) and by the rank programs that torchrun, mpiexec or the
"spawn" launcher start (``tests/launch_util.py`` puts the repository on their
``PYTHONPATH``, so ``from tests.helpers import ...`` works there too).

- ``assert_td_equal(actual, expected, what)``: two TensorDicts are the same:
  structure, batch sizes, dtypes, shapes, bits, non-tensor values.
- ``leftovers(target)``: what saves, replaces or removals left beside a
  checkpoint target.
- ``require(component, why)`` / ``missing(component, why)``: a test needs a
  real component (SLURM, a mountable tmpfs, ``unzip``, ...). Missing, it
  skips on a developer's machine and FAILS when ``CI`` is set, so a green CI
  run never hides an untested guarantee. Only hardware that a CPU machine
  cannot have (``HARDWARE``) may skip in CI too.
"""

from __future__ import annotations

import fnmatch
import os
import shutil
from pathlib import Path
from typing import NoReturn

import pytest
import torch
from tensordict import TensorDictBase, is_non_tensor

__all__ = ["HARDWARE", "assert_td_equal", "in_ci", "leftovers", "missing", "require"]

# --- components a test needs -----------------------------------------------------------

#: The one place that lists what may skip even in CI: hardware a CPU-only machine cannot have.
#: Everything else a test needs (SLURM, a tmpfs or loop mount, unzip, mpiexec, a free port) CI
#: must provide; ``launch/test.sh`` installs it and fails when it cannot.
HARDWARE: dict[str, str] = {"cuda": "a CUDA device"}

#: The prefix of the reason of every skip ``missing`` makes; ``tests/conftest.py`` lets only
#: skips of ``HARDWARE`` components through when ``CI`` is set.
SKIP_PREFIX = "missing component"


def in_ci() -> bool:
    """True when the environment variable ``CI`` is set (to anything but empty, "0" or "false")."""
    return os.environ.get("CI", "").strip().lower() not in ("", "0", "false", "no")


def missing(component: str, why: str) -> NoReturn:
    """The test cannot run: ``component`` is missing, for reason ``why``.

    Skips (with the reason, shown by ``pytest -ra``) outside CI and for
    ``HARDWARE``; with ``CI`` set, fails the test with the reason instead.
    """
    reason = f"{SKIP_PREFIX} {component!r}: {why}"
    if in_ci() and component not in HARDWARE:
        pytest.fail(f"{reason} (CI is set: a test whose component is missing fails instead of skipping)")
    pytest.skip(reason)


def require(component: str, why: str, *, available: bool | None = None) -> None:
    """Go on only if ``component`` is there; otherwise ``missing(component, why)``.

    ``available`` says whether it is; when None, ``component`` is taken as a
    command to find on ``PATH`` (``require("unzip", "to test the archive with Info-ZIP")``).
    """
    if available is None:
        available = shutil.which(component) is not None
    if not available:
        missing(component, why)


# --- TensorDict equality -------------------------------------------------------------


def _walk(td: TensorDictBase, prefix: tuple = ()):
    """Yield (key, kind, value) for every entry below ``td``: kind is "node", "tensor" or "object"."""
    for name in td.keys():
        value = td.get(name)
        key = prefix + (name,)
        if is_non_tensor(value):
            yield key, "object", value
        elif isinstance(value, TensorDictBase):
            yield key, "node", value
            yield from _walk(value, key)
        else:
            yield key, "tensor", value


def _bits(t: torch.Tensor) -> torch.Tensor:
    """The tensor's bytes as a flat uint8 tensor (NaN payloads, -0.0, conj and neg bits resolved)."""
    if hasattr(t, "full_tensor"):  # a DTensor: compare the global value
        t = t.full_tensor()
    t = t.detach().cpu().resolve_conj().resolve_neg().contiguous().reshape(-1)
    return t.view(torch.uint8)


def _show(t: torch.Tensor) -> str:
    text = str(t.detach().cpu())
    return text if len(text) < 1500 else text[:1500] + " ..."


def assert_td_equal(actual, expected, what: str = "", *, batch_sizes: bool = True) -> None:
    """``actual`` is the same TensorDict as ``expected``.

    Same keys and nesting (sub-TensorDicts, empty ones included), the same
    batch size at the root and at every sub-TensorDict, and for every tensor
    leaf the same dtype, shape and bytes (so NaN equals the same NaN, and -0.0
    differs from 0.0); non-tensor values (``NonTensorData``/``NonTensorStack``)
    compare equal as ``tolist()`` (so a stack of equal values and one value
    over the same batch are the same). ``what`` prefixes every message.
    ``batch_sizes=False`` leaves the batch sizes out (everything else is compared).
    """
    where = f"{what}: " if what else ""
    assert isinstance(actual, TensorDictBase), f"{where}got a {type(actual).__name__}, expected a TensorDict"
    assert isinstance(expected, TensorDictBase), f"{where}expected value is a {type(expected).__name__}"
    assert not batch_sizes or actual.batch_size == expected.batch_size, (
        f"{where}batch size {tuple(actual.batch_size)} != expected {tuple(expected.batch_size)}"
    )
    got = {k: (kind, v) for k, kind, v in _walk(actual)}
    want = {k: (kind, v) for k, kind, v in _walk(expected)}
    missing, extra = sorted(set(want) - set(got), key=repr), sorted(set(got) - set(want), key=repr)
    assert not missing and not extra, f"{where}keys missing {missing}, unexpected {extra}"
    for key, (kind, exp) in want.items():
        got_kind, act = got[key]
        assert got_kind == kind, f"{where}{key}: a {got_kind}, expected a {kind}"
        if kind == "node":
            assert not batch_sizes or act.batch_size == exp.batch_size, (
                f"{where}{key}: batch size {tuple(act.batch_size)} != expected {tuple(exp.batch_size)}"
            )
        elif kind == "object":
            a, b = act.tolist(), exp.tolist()
            assert type(a) is type(b) and a == b, f"{where}{key}: non-tensor value {a!r} != expected {b!r}"
        else:
            assert act.dtype == exp.dtype, f"{where}{key}: dtype {act.dtype} != expected {exp.dtype}"
            assert act.shape == exp.shape, f"{where}{key}: shape {tuple(act.shape)} != expected {tuple(exp.shape)}"
            assert torch.equal(_bits(act), _bits(exp)), (
                f"{where}{key}: values differ (compared bit for bit)\n{_show(act)}\n!=\n{_show(exp)}"
            )


# --- entries left beside a target ----------------------------------------------------


#: The lock file a CheckpointManager keeps in its root (tddist.jobs.root_lock.LOCK_NAME): not a leftover.
MANAGER_LOCK = ".tddist-manager.lock"


def leftovers(target, *, strict: bool = False) -> list[str]:
    """Sorted names of the entries beside ``target`` that a save, replace or removal left behind.

    ``target`` is a checkpoint path; its last component may be an ``fnmatch``
    pattern (``root / "step-*"``, ``root / "*"``) standing for every checkpoint
    of that name in the directory. Found:

    - the staging, trash and backup entries of the target, as
      ``tddist.format.side_entries`` finds them (and ``side_entry_kind`` for a
      pattern), and
    - every other hidden ``.<name>.tddist-*`` entry, even one whose name the
      library would not recognise (a malformed id, an unknown kind).

    With ``strict=True``, also every other entry of the directory that is not
    the target itself (not matching the pattern) or a manager's lock file: for a
    directory that should hold the target(s) and nothing else.
    """
    from tddist import format as fmt  # here, so that importing the helpers (conftest) never imports tddist

    target = Path(target)
    parent, name = target.parent, target.name
    try:
        names = os.listdir(parent)
    except FileNotFoundError:
        return []
    found = {os.path.basename(p) for _kind, p in fmt.side_entries(str(target))}
    for n in names:
        side = fmt.side_entry_kind(n)
        if side is not None and fnmatch.fnmatchcase(side[0], name):
            found.add(n)
        elif fnmatch.fnmatchcase(n, f".{name}.tddist-*"):
            found.add(n)
        elif strict and not fnmatch.fnmatchcase(n, name) and n != MANAGER_LOCK:
            found.add(n)
    return sorted(found)


def flip(path, offset: int) -> None:
    """Invert the byte at ``offset`` of the file ``path`` (damage one byte in place)."""
    with open(path, "r+b") as f:
        f.seek(offset)
        byte = f.read(1)
        f.seek(offset)
        f.write(bytes([byte[0] ^ 0xFF]))


def second_manager_refusals(root) -> list[str | None]:
    """Two thread ranks open a ``CheckpointManager`` on ``root`` while another job holds it (rank 0 tries the
    lock, every rank must raise the same ``RootLockedError``): each rank's message, or None if it opened."""
    import tddist

    def second_job(comm):
        try:
            tddist.CheckpointManager(root, comm=comm, preempt_signal=None)
        except tddist.RootLockedError as err:
            return str(err)
        return None

    return tddist.run_threads(2, second_job)
