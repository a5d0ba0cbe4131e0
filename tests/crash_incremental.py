"""Power cuts during a run of incremental saves with a concurrent clean-up: a case of ``tests/crash_harness.py``.

Used by ``tests/test_crash.py`` (a few cuts) and ``scripts/crash_campaign.py
--incremental`` (many random ones). A case runs two forked processes on a
lane's loop-mounted file system:

- the job (two thread ranks): a full save of step 1, then ``RUN`` more steps
  of a mostly frozen state (``shard``: a frozen matrix and three small leaves
  that change every step, every second and every third step), each saved
  incrementally: with ``tddist.save(..., base=...)`` against the last
  committed step or an older one it committed (``mode="save"``), or by a
  ``CheckpointManager(incremental=True, keep_last=2)`` (``mode="manager"``:
  against the last step, with its own retention after each save);
- the clean-up: another process's retention (``keep_last=1``) over the root
  in a loop, as another job's would: it keeps the newest committed step and
  what kept steps reference, and deletes the rest, racing with the job's pins
  and commits. A slow one (``slow``, half of the random cases) pauses a
  second in each deletion between its check of the pins and its rename (the
  fault action ``delay`` at ``delete``), as a preempted process would: the job
  goes on saving meanwhile (up to ``SLOW_RUN`` steps), so the deletion often
  meets a pin or a new reference after its rename and renames back.

The fault (``powercut``: ``FS_IOC_GOINGDOWN`` without log flush, then
SIGKILL) is armed at a point of one process: in the job, for one save of the
run (``at``), any point of its commit, ``pin``, ``unpin``, or, with a manager,
of its retention's deletion (``trash``, ``untrash``, ``discard``); in the
clean-up, a point of its deletions once ``at`` of its passes found something
to delete. A point the run never reaches is no cut: the job cuts the power
itself once its run ended (``cut`` in the report says where the cut struck).

After the remount, the checker (``check_main``) runs ``tddist gc`` on the root
(``cleanup.gc``: ``recover`` of every step name, torn steps removed), checks,
then runs ``tddist gc --keep-last 1`` and checks again:

- torn: a step entry left that is not committed, or a committed one that does
  not load (``verify=True``) bit for bit as the state of its step, or whose
  ``tddist verify`` finds damage other than a dangling reference;
- dangling: a committed checkpoint that references a holder which is missing,
  not committed, or of another generation than recorded;
- removed: a holder that a committed checkpoint references, present after the
  cut (under its name or a trash name), and gone after the clean-up.
"""

from __future__ import annotations

import contextlib
import faulthandler
import json
import os
import random
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from tensordict import TensorDict

#: The steps a job saves after its full save of step 1; with a slow or a struck clean-up, at most ``SLOW_RUN``
#: (it stops at the cut).
RUN, SLOW_RUN = 6, 60
#: Fault points of the job's saves (rank 0), in protocol order; a manager's retention also deletes.
JOB_POINTS = ("pin", "begin", "midwrite", "write", "vote", "validate", "manifest", "renamed", "publish", "unpin",
              "announce")  # fmt: skip
#: Fault points of a deletion (``storage/roots.remove_checkpoint``, ``_fs.remove_tree``).
CLEANUP_POINTS = ("trash", "untrash", "discard")
MODES = ("save", "manager")
CLEANUP_PAUSE = 0.002  # between two passes of the clean-up (two cores shared by the job and the clean-up)
DEADLINE = 50.0  # the job and the clean-up end by then (the lane's own deadline is the harness's)


def name(step: int) -> str:
    """A step's checkpoint name."""
    return f"step-{step:09d}"


def shard(rank: int, step: int) -> TensorDict:
    """Rank ``rank``'s state at ``step``: frozen rows (256 KiB) and three small leaves changing every step,
    every second and every third step (so a save references its base and its base's holders)."""
    frozen = torch.arange(rank * 65536, (rank + 1) * 65536, dtype=torch.float32).reshape(16, 4096)
    return TensorDict(
        {
            "frozen": TensorDict({"w": frozen}, [16]),
            "a": torch.full((8, 8), float(step)),
            "b": torch.full((4, 64), float(step // 2)),
            "c": torch.full((2, 128), float(step // 3)),
        },
        [],
    )


def expected(step: int) -> TensorDict:
    """The global state of ``step``."""
    parts = [shard(r, step) for r in range(2)]
    out = parts[0].clone()
    out["frozen"] = torch.cat([p["frozen"] for p in parts])
    return out


@dataclass(frozen=True)
class IncrementalCase:
    """A cut at ``point`` of the job's save of step ``at`` (``where="job"``), or of the clean-up's deletions
    once ``at`` of its passes found something to delete (``where="clean-up"``), during a run of ``mode``."""

    point: str
    where: str  # "job" or "clean-up"
    mode: str  # "save" or "manager"
    at: int
    fs: str  # "ext4" or "xfs"
    seed: int = 0  # the job's choice of bases (mode "save")
    slow: bool = False  # the clean-up pauses 1 s in each deletion between its check of the pins and its rename
    action: str = "powercut"
    layout: str = "incremental"

    @property
    def id(self) -> str:
        slow = "-slow" if self.slow else ""
        return f"{self.action}-{self.fs}-incremental-{self.mode}-{self.where}-{self.point}-at{self.at}-seed{self.seed}{slow}"

    def processes(self, root: Path, work: Path) -> dict:
        """What the harness forks: key -> (function, args); key 0 is the job."""
        run = str(root / "run")
        return {0: (job_main, (self, run, work, str(root))), 1: (cleaner_main, (self, run, work, str(root)))}

    def checker(self, root: Path, work: Path) -> tuple:
        return check_main, (str(root / "run"), work)

    def problems(self, res) -> list[str]:
        """Every broken guarantee of ``res`` (a ``crash_harness.Result`` of this case)."""
        out = list(res.watchdog)
        if self.struck(res) is None:
            out.append(f"harness: no power cut happened (exits {res.exits}, job's report {res.reports.get(0)})")
        for key, who in ((0, "job"), (1, "clean-up")):
            if res.exits.get(key) not in (0, -9):
                out.append(f"harness: the {who} ended with {res.exits.get(key)}")
        if res.check is None:
            return [*out, "harness: no checker report"]
        return out + res.check["problems"]

    def outcome(self, res) -> str:
        """Where the cut struck: ``armed`` (at the armed point) or ``end`` (the point was not reached)."""
        where = self.struck(res)
        return "harness-error" if res.check is None or where is None else where

    def struck(self, res) -> str | None:
        """``armed`` or ``end`` (see ``outcome``); None: no cut happened."""
        if res.exits.get(1) == -9:
            return "armed"
        cut = (res.reports.get(0) or {}).get("cut")
        if res.exits.get(0) != -9 or not cut:
            return None
        return "end" if cut == "end" else "armed"


def random_incremental(rng: random.Random, fs: str) -> IncrementalCase:
    """A random case: the job or (a third of them) the clean-up struck, at a random point and moment; half of
    them with a slow clean-up."""
    mode, seed, slow = rng.choice(MODES), rng.randrange(1000), rng.random() < 0.5
    if rng.random() < 1 / 3:
        point = rng.choice((*CLEANUP_POINTS, "untrash"))  # the rarest to reach, drawn twice as often
        return IncrementalCase(point, "clean-up", mode, 0 if slow else rng.randrange(3), fs, seed, slow)
    points = JOB_POINTS + (CLEANUP_POINTS if mode == "manager" else ())
    return IncrementalCase(rng.choice(points), "job", mode, rng.randrange(2, RUN + 2), fs, seed, slow)


def ci_cases(fs: str) -> list[IncrementalCase]:
    """The few cuts CI runs on ``fs``: inside the pin, the commit and the unpin, and the clean-up's deletion."""
    return [
        IncrementalCase("pin", "job", "save", 3, fs, 1),
        IncrementalCase("publish", "job", "manager", 4, fs, 2),
        IncrementalCase("unpin", "job", "save", 5, fs, 3),
        IncrementalCase("trash", "clean-up", "save", 0, fs, 4),
    ]


# --- the job and the clean-up (forked by the harness) ----------------------------------------------


def _write_report(work: Path, report: dict) -> None:
    from tests.crash_harness import write_json

    write_json(work / "rank0.json", report)


def job_main(case: IncrementalCase, root: str, work: Path, cut: str) -> None:
    """(forked job) Step 1 in full, then the run with the fault armed for one save; then cut the power."""
    import tddist
    from tddist._faults import ENV, POWERCUT_ENV, power_cut
    from tddist._fs import fsync_path

    torch.set_num_threads(1)
    faulthandler.dump_traceback_later(15, exit=False)  # a job still running then shows where it waits
    os.environ[POWERCUT_ENV] = cut
    os.makedirs(root)
    fsync_path(os.path.dirname(root))
    report: dict = {"committed": [], "failed": [], "cut": None}
    _run_threads(lambda c: tddist.save(shard(c.rank, 1), os.path.join(root, name(1)), comm=c, timeout=20))
    report["committed"].append(1)
    _write_report(work, report)
    (work / "started").touch()
    armed = f"{case.point}:0:powercut"

    def arm(step: int) -> None:
        """(rank 0, before the save of ``step``) Arm the fault for the save ``case.at`` only."""
        if case.where != "job":
            return
        report["cut"] = f"{case.point}@{step}" if step == case.at else None
        _write_report(work, report)
        if step == case.at:
            os.environ[ENV] = armed
        else:
            os.environ.pop(ENV, None)

    outcomes = _run_threads(lambda c: _run(c, case, root, arm))
    report.update(outcomes[0], cut="end")
    os.environ.pop(ENV, None)
    _write_report(work, report)
    with contextlib.suppress(OSError):  # else the clean-up cut it first: the file system is down already
        power_cut(cut)


def _run_threads(fn) -> list:
    import tddist

    results = tddist.run_threads(2, fn, timeout=20)
    for r in results:
        if isinstance(r, BaseException):
            raise r
    return results


def _run(c, case: IncrementalCase, root: str, arm) -> dict:
    """(each thread rank) Save steps 2, 3, ... incrementally (``RUN`` of them, or up to ``SLOW_RUN`` until a
    cut); rank 0 arms the fault before its save."""
    import tddist

    rng = random.Random(case.seed)  # every rank draws the same bases: the outcomes agree
    committed, failed, seconds = [1], [], []
    mgr = tddist.CheckpointManager(root, comm=c, keep_last=2, incremental=True) if case.mode == "manager" else None
    for step in range(2, (SLOW_RUN if case.slow or case.where == "clean-up" else RUN) + 2):
        if c.rank == 0:
            arm(step)
        base = committed[-1] if rng.random() < 0.5 else rng.choice(committed)
        t0 = time.monotonic()
        ok = _save_step(c, mgr, root, step, base)
        seconds.append(round(time.monotonic() - t0, 3))
        # The ranks agree on the outcome: after a cut that follows the commit, a rank may fail to read the
        # committed checkpoint back (a TargetError) where another one returned.
        outcomes = c.allgather((ok, _down(root)))
        (committed if any(o for o, _d in outcomes) else failed).append(step)
        if any(d for _o, d in outcomes):
            break
    if mgr is not None:
        with contextlib.suppress(tddist.TddistError):  # the file system may be down
            mgr.close()
    return {"committed": committed, "failed": failed, "seconds": seconds}


def _save_step(c, mgr, root: str, step: int, base: int) -> bool:
    """(each thread rank) Save ``step`` (with the manager, or against ``base``); whether it returned."""
    import tddist

    try:
        if mgr is not None:
            mgr.save(step, shard(c.rank, step))
        else:
            target, base_path = os.path.join(root, name(step)), os.path.join(root, name(base))
            tddist.save(shard(c.rank, step), target, comm=c, base=base_path, timeout=20)
    except tddist.TddistError as e:  # the clean-up removed the base under it, or the file system is down
        print(f"rank {c.rank}: step {step}: {type(e).__name__}: {e}"[:300], file=sys.stderr, flush=True)
        return False
    return True


def _down(root: str) -> bool:
    """Whether the file system holding ``root`` was shut down (a cut: every access fails)."""
    try:
        os.listdir(root)
    except OSError:
        return True
    return False


def cleaner_main(case: IncrementalCase, root: str, work: Path, cut: str) -> None:
    """(forked clean-up) Retention with ``keep_last=1`` over the root until the harness says stop."""
    from tddist._faults import ENV, POWERCUT_ENV
    from tddist.errors import TddistError
    from tddist.jobs.retention import Retention, delete_checkpoint, retire

    os.environ[POWERCUT_ENV] = cut
    deadline = time.monotonic() + DEADLINE
    while not (work / "started").exists() and not (work / "stop").exists() and time.monotonic() < deadline:
        time.sleep(0.005)
    deleting = 0  # the passes that found something to delete
    while not (work / "stop").exists() and time.monotonic() < deadline:
        try:
            doomed = retire(root, Retention(keep_last=1))
        except (OSError, TddistError):
            doomed = []
        deleting += bool(doomed)
        faults = ["delete:0:delay"] if case.slow else []  # meanwhile the job may pin or reference a doomed one
        if case.where == "clean-up" and deleting > case.at:
            faults.append(f"{case.point}:0:powercut")
        os.environ[ENV] = ",".join(faults)
        for _s, p in doomed:
            if (work / "stop").exists():  # the job ended (a slow clean-up's list is long)
                break
            try:
                delete_checkpoint(p)
            except (OSError, TddistError):  # pinned, referenced, or gone meanwhile
                pass
        time.sleep(CLEANUP_PAUSE)


# --- the checks (forked after the remount) ---------------------------------------------------------


def check_main(root: str, work: Path) -> None:
    """(forked checker) Record what the cut left, ``tddist gc``, check; ``tddist gc --keep-last 1``, check."""
    from tddist._fs import fsync_path, remove_tree
    from tddist.jobs.cleanup import gc
    from tests.crash_harness import write_json

    torch.set_num_threads(1)
    left = _present(root)
    report: dict = {"left": sorted(left), "problems": [], "gc": [], "checked": 0}
    for keep_last in (None, 1):
        report["gc"] += [f"{a.action} {os.path.basename(a.path)}" for a in gc(root, keep_last)]
        report["problems"] += [p for p in _check(root, left, report) if p not in report["problems"]]
    remove_tree(root)
    fsync_path(os.path.dirname(root))
    write_json(work / "check.json", report)


def _present(root: str) -> set[str]:
    """The step names whose committed checkpoint is under the root after the cut, under the name or a trash
    name."""
    from tddist import format as fmt
    from tddist.storage.recovery import is_committed

    out = set()
    for entry in os.listdir(root):
        side = fmt.side_entry_kind(entry)
        if (side is None or side[1] == "trash") and is_committed(os.path.join(root, entry)):
            out.add(side[0] if side else entry)
    return out


def _check(root: str, left: set[str], report: dict) -> list[str]:
    """Torn, dangling and removed, as the module's docstring says."""
    from tddist import format as fmt
    from tddist.jobs.retention import parse_step
    from tddist.storage.recovery import is_committed

    out = []
    for entry in sorted(os.listdir(root)):
        path = os.path.join(root, entry)
        if fmt.side_entry_kind(entry) is not None:
            out.append(f"harness: gc left {entry}")
        elif parse_step(entry) is not None and not is_committed(path):
            out.append(f"torn: {entry} is not committed after gc")
        elif parse_step(entry) is not None:
            report["checked"] += 1
            out += _check_one(path, int(entry.split("-")[1]), left)
    return out


def _check_one(path: str, step: int, left: set[str]) -> list[str]:
    """One committed checkpoint: its holders there at their generation, ``verify`` clean, bit for bit."""
    import tddist
    from tddist.errors import TddistError
    from tddist.storage.incremental import open_manifest
    from tddist.tools.verify import verify

    entry, out = os.path.basename(path), []
    try:
        holders = tddist.read_manifest(path).referenced()
    except TddistError as e:
        return [f"torn: {entry}'s manifest: {type(e).__name__}: {e}"]
    for h in holders:
        holder = os.path.join(os.path.dirname(path), h.name)
        try:
            with open_manifest(holder) as opened:
                generation = opened.generation
        except TddistError as e:
            generation = f"unreadable ({type(e).__name__})"
        if generation != h.generation:
            out.append(f"dangling: {entry} references {h.name}, which is {generation}, not {h.generation}")
            if h.name in left and not os.path.exists(holder):
                out.append(f"removed: {h.name}, referenced by {entry}, was there after the cut")
    if out:
        return out
    report = verify(path)
    if not report.ok:
        return [f"torn: tddist verify {entry}: {report.problems[0].message}"]
    try:
        got = tddist.load(path, verify=True)
        same = bool((got == expected(step)).all())
    except (TddistError, RuntimeError) as e:
        return [f"torn: {entry} does not load: {type(e).__name__}: {e}"]
    return [] if same else [f"torn: {entry} does not hold step {step}'s state"]


def counts(problems: list[str]) -> dict[str, int]:
    """How many problems of each kind (torn, dangling, removed, harness) a case had."""
    out = {"torn": 0, "dangling": 0, "removed": 0, "harness": 0}
    for p in problems:
        kind = p.split(":")[0]
        out[kind if kind in out else "harness"] += 1
    return out


def summary(res) -> str:
    """The job's report and the checker's, for a failure message."""
    return json.dumps({"exits": res.exits, "job": res.reports.get(0), "check": res.check}, default=str)[:4000]


def tally(results: list) -> str:
    """The campaign's counts over incremental cases: cuts (where they struck), torn, dangling, removed."""
    total = {"torn": 0, "dangling": 0, "removed": 0, "harness": 0}
    struck: dict[str, int] = {}
    checked = 0
    for res in results:
        for kind, n in counts(res.problems()).items():
            total[kind] += n
        word = f"{res.case.where}:{res.case.point}:{res.outcome()}"
        struck[word] = struck.get(word, 0) + 1
        checked += (res.check or {}).get("checked", 0)
    lines = [f"incremental: {len(results)} cuts, {checked} checkpoint checks"]
    lines += [f"  {n:5d}  cut {w}" for w, n in sorted(struck.items())]
    lines += [f"  {n:5d}  {kind}" for kind, n in total.items()]
    return "\n".join(lines)
