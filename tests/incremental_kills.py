"""Incremental saves killed at every step of the commit while another process cleans the root up.

Used by ``tests/test_incremental_kills.py`` (a few kill points) and by
``scripts/incremental_campaign.py`` (many random ones).

A case: a root holds ``step-000000001`` (a full save: the holder) and
``step-000000009`` (a full save, the newest). A job (a forked process, two
thread ranks) saves ``step-000000002`` with ``base=step-000000001`` and is
SIGKILLed at a fault point of the commit (or not at all), while a second
forked process runs retention (``keep_last=1``) over the root in a loop, as
another job's clean-up would: it wants to delete ``step-000000001`` (not the
newest) all along. Then a last retention pass, ``recover`` of every entry,
and the checks (``problems``):

- 0 torn checkpoints: every committed checkpoint loads, ``verify=True``, bit
  for bit the state its step saved;
- 0 dangling references: ``tddist verify`` finds nothing wrong in any
  committed checkpoint (a missing or replaced holder is a problem);
- 0 referenced holders removed: when ``step-000000002`` is committed and
  references ``step-000000001``, the latter is there;
- nothing is left beside the checkpoints after ``recover`` but the pins of a
  killed save (they expire).
"""

from __future__ import annotations

import multiprocessing
import os
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
from tensordict import TensorDict

HOLDER, NEW, NEWEST = 1, 2, 9
#: Fault points an incremental save passes (``saving/commit.py``; ``midwrite`` in ``storage/incremental.py``).
POINTS = ("begin", "midwrite", "write", "vote", "validate", "manifest", "renamed", "publish", "announce")
CASE_DEADLINE = 90.0


def name(step: int) -> str:
    """A step's checkpoint name."""
    return f"step-{step:09d}"


def shard(rank: int, step: int) -> TensorDict:
    """A rank's LoRA-like state: the frozen rows never change, the adapter is the step."""
    frozen = torch.arange(rank * 4096, (rank + 1) * 4096, dtype=torch.float32).reshape(16, 256)
    return TensorDict({"frozen": TensorDict({"w": frozen}, [16]), "adapter": torch.full((8, 8), float(step))}, [])


def expected(step: int) -> TensorDict:
    """The global state of ``step``."""
    parts = [shard(r, step) for r in range(2)]
    return TensorDict({"frozen": torch.cat([p["frozen"] for p in parts]), "adapter": parts[0]["adapter"]}, [])


@dataclass
class Outcome:
    """What a case left: the job's exit code, what was committed, and every violated guarantee."""

    point: str | None
    exit_code: int | None
    committed: list[str] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)


def _save_all(path: str, step: int, base: str | None = None) -> None:
    import tddist

    results = tddist.run_threads(2, lambda c: tddist.save(shard(c.rank, step), path, comm=c, base=base), timeout=30)
    for r in results:
        if isinstance(r, BaseException):
            raise r


def _job(root: str, point: str | None, started: str) -> None:
    """(forked job) The incremental save, killed at ``point`` on rank 0 (a crashed job: every rank dies)."""
    from tddist._faults import ENV

    torch.set_num_threads(1)
    if point is not None:
        os.environ[ENV] = f"{point}:0:kill"
    Path(started).touch()
    try:
        _save_all(os.path.join(root, name(NEW)), NEW, base=os.path.join(root, name(HOLDER)))
    except Exception:
        os._exit(2)  # a failed save (the holder went away before the pin): nothing committed
    os._exit(0)


def _cleaner(root: str, started: str, delay: float, stop: str) -> None:
    """(forked clean-up) From ``delay`` seconds after the job started until ``stop`` exists: retention with
    ``keep_last=1`` over the root, keeping the step the job saves (as that job's own retention does)."""
    from tddist.errors import TddistError
    from tddist.jobs.retention import Retention, delete_checkpoint, retire

    deadline = time.monotonic() + CASE_DEADLINE
    while not os.path.exists(started) and time.monotonic() < deadline:
        time.sleep(0.001)
    time.sleep(delay)
    while not os.path.exists(stop) and time.monotonic() < deadline:
        try:
            for _s, p in retire(root, Retention(keep_last=1), keep=(NEW,)):
                try:
                    delete_checkpoint(p)
                except OSError:  # pinned, or gone meanwhile
                    pass
        except (TddistError, OSError):
            pass
    os._exit(0)


def run_case(work: Path, point: str | None, delay: float = 0.0) -> Outcome:
    """One case in ``work`` (an empty directory), the clean-up starting ``delay`` seconds after the job; see
    the module's docstring."""
    root = str(work / "root")
    os.makedirs(root)
    _save_all(os.path.join(root, name(HOLDER)), HOLDER)
    _save_all(os.path.join(root, name(NEWEST)), NEWEST)
    ctx = multiprocessing.get_context("fork")
    stop, started = str(work / "stop"), str(work / "started")
    cleaner = ctx.Process(target=_cleaner, args=(root, started, delay, stop))
    job = ctx.Process(target=_job, args=(root, point, started))
    cleaner.start()
    job.start()
    job.join(CASE_DEADLINE)
    Path(stop).touch()
    cleaner.join(CASE_DEADLINE)
    for p in (job, cleaner):
        if p.is_alive():
            p.kill()
            p.join()
    out = Outcome(point, job.exitcode)
    if cleaner.exitcode != 0:
        out.problems.append(f"the clean-up ended with {cleaner.exitcode}")
    check(root, out)
    return out


def check(root: str, out: Outcome) -> None:
    """The guarantees, after a last retention pass and ``recover`` of every entry."""
    import tddist
    from tddist import format as fmt
    from tddist.jobs.retention import Retention, delete_checkpoint, retire
    from tddist.storage.recovery import is_committed
    from tddist.tools.verify import verify

    for _s, p in retire(root, Retention(keep_last=1), keep=(NEW,)):
        try:
            delete_checkpoint(p)
        except OSError:
            pass
    for step in (HOLDER, NEW, NEWEST):
        tddist.recover(os.path.join(root, name(step)))
    for entry in sorted(os.listdir(root)):
        path = os.path.join(root, entry)
        if fmt.side_entry_kind(entry) is not None:
            out.problems.append(f"left beside the checkpoints: {entry}")
            continue
        if not is_committed(path):
            if not entry.startswith(".") or ".tddist-pin-" not in entry:
                out.problems.append(f"torn: {entry} is not committed")
            continue
        out.committed.append(entry)
        step = int(entry.split("-")[1])
        report = verify(path)
        if not report.ok:
            out.problems.append(f"dangling or damaged: {entry}: {report.problems[0].message}")
            continue
        got = tddist.load(path, verify=True)
        if not (got == expected(step)).all():
            out.problems.append(f"torn: {entry} does not hold step {step}'s state")
    if name(NEW) in out.committed:
        holders = [h.name for h in tddist.read_manifest(os.path.join(root, name(NEW))).referenced()]
        if name(HOLDER) in holders and name(HOLDER) not in out.committed:
            out.problems.append("a referenced holder was removed")
