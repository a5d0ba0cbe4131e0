"""Crash cases at every step of the commit: SIGKILLs and power cuts, what must survive them, and their runner.

Used by ``tests/test_crash.py`` (every step, rank and layout once) and by
``scripts/crash_campaign.py`` (many random ones).

A case: an old checkpoint committed at the target by a 2-rank save, then a
2-rank save of a new one struck at a named fault point of the commit (see
``tddist/commit.py``; ``returned`` is this module's own: after the save
returned on both ranks) on one rank, with

- ``kill``: SIGKILL of that rank (a crashed process; the file system lives on), or
- ``powercut``: ``tddist._faults.power_cut`` on a loop-mounted ext4 or XFS
  (everything not fsynced is lost), then the file system is unmounted and
  mounted again, which replays its journal.

Then the checks (``problems``): the target loads with ``verify=True`` and is
bit-exactly the old or the new checkpoint (where ``publish`` has no
RENAME_EXCHANGE, a crash between its two renames may instead leave the target
absent and a committed backup beside it); it is the new one when the step is
past the durable commit point or when ``save`` returned on any rank (a save
that returned is never lost), the old one when no rank can have committed;
``tddist.recover`` then leaves no staging or backup entry and the target
loads the same; the struck rank ended by SIGKILL; the other rank ended
within its timeout, having returned or raised a ``TddistError``.

Starting interpreters that import torch costs seconds, so one parent process
(this module, imported once) forks every process of every case: the two
ranks (a fresh gloo job each case, rendezvous through a ``FileStore``) and a
checker that loads, recovers and cleans up (a child, so that no memory map
keeps a file system busy at its next unmount). Cases run in several lanes at
once, each lane on its own storage (a directory, or one loop-mounted file
system whose cases run one after the other); every wait has a deadline.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path

if __package__ in (None, ""):  # imported from scripts/: make ``tests`` importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch
from tensordict import TensorDict

from tests.helpers import assert_td_equal

SAVE_TIMEOUT = 20.0  # a rank's collective timeout; a dead peer is noticed long before it
RANK_DEADLINE = 60.0  # both ranks of a case must have ended by then (start-up under load included)
CHECK_DEADLINE = 60.0
XFS_MIN_BYTES = 300 * 1024 * 1024  # mkfs.xfs refuses smaller file systems
EXT4_BYTES = 64 * 1024 * 1024

#: Fault points and the ranks that pass them, in protocol order (``tddist/commit.py``).
#: ``backup`` exists only where publish replaces through a backup name (no RENAME_EXCHANGE).
POINTS = (
    ("begin", (0, 1)),
    ("prepare", (0,)),
    ("midwrite", (0, 1)),
    ("write", (0, 1)),
    ("vote", (0, 1)),
    ("validate", (0,)),
    ("manifest", (0,)),
    ("backup", (0,)),
    ("renamed", (0,)),
    ("replace", (0,)),
    ("publish", (0,)),
    ("discard", (0,)),
    ("announce", (0, 1)),
    ("returned", (0, 1)),
)
ACTIONS = ("kill", "powercut")
LAYOUTS = {"dir": "ckpt", "archive": "ckpt.tdz"}
FILE_SYSTEMS = ("ext4", "xfs")

# --- the data ----------------------------------------------------------------------------

#: Rows of each rank per version: the versions differ in shape and values, so a mix is neither.
ROWS = {"old": (2, 2), "new": (3, 2)}
BASE = {"old": 1000.0, "new": 5000.0}
WIDTH = 131072  # float32 columns of "w": 512 KiB a row, so every rank writes a chunk of >= 1 MiB


def shard(version: str, rank: int) -> TensorDict:
    """What ``rank`` saves for ``version``: rows of ``w`` and ``ids`` (sharded) and ``step`` (replicated).

    A rank's ``w`` is at least 1 MiB, a chunk that the packed writer writes
    on its own, so the fault point ``midwrite`` falls between two writes.
    """
    rows = ROWS[version]
    start, n = sum(rows[:rank]), rows[rank]
    ids = torch.arange(start, start + n)
    w = BASE[version] + ids[:, None].float() * WIDTH + torch.arange(WIDTH, dtype=torch.float32)[None, :]
    data = TensorDict(w=w, ids=ids + int(BASE[version]), batch_size=[n])
    return TensorDict(data=data, step=torch.tensor(int(BASE[version])), batch_size=[])


def expected(version: str) -> TensorDict:
    """The global TensorDict a complete checkpoint of ``version`` holds."""
    parts = [shard(version, r) for r in range(len(ROWS[version]))]
    return TensorDict(data=torch.cat([p["data"] for p in parts], 0), step=parts[0]["step"], batch_size=[])


# --- the cases ---------------------------------------------------------------------------


@dataclass(frozen=True)
class Case:
    """One crash: where (point, rank), how (action), on what (layout, file system, publish path)."""

    layout: str  # "dir" (packed directory) or "archive" (.tdz)
    point: str
    rank: int
    action: str  # "kill" or "powercut"
    fs: str  # "disk" (kills) or "ext4"/"xfs" (power cuts)
    exchange: bool = True  # False: publish replaces through a backup name

    @property
    def id(self) -> str:
        path = "" if self.exchange else "-backup"
        return f"{self.action}-{self.fs}-{self.layout}{path}-{self.point}-rank{self.rank}"

    @property
    def expect(self) -> str:
        """ "old", "new" or "either": what the target must hold after the crash (and ``recover``)."""
        committed_kill = ("renamed", "replace", "discard", "publish", "announce", "returned")
        durable = ("replace", "discard", "publish", "announce", "returned")
        if self.point in (durable if self.action == "powercut" else committed_kill):
            return "new"
        if self.point == "renamed":
            return "either"  # cut before the parent's fsync: the rename may or may not have reached the journal
        if self.point == "vote" and self.rank == 1:
            # Rank 1's "yes" reached rank 0, which commits. A killed rank 1 cannot stop it;
            # a power cut races with rank 0's manifest and renames.
            return "new" if self.action == "kill" else "either"
        return "old"

    def processes(self, root: Path, work: Path) -> dict:
        """What a case forks: key (a rank) -> (function, args), each given ``root`` (the lane's storage)."""
        target, cut = str(root / LAYOUTS[self.layout]), str(root)
        return {r: (rank_main, (r, self, target, work, cut)) for r in (0, 1)}

    def checker(self, root: Path, work: Path) -> tuple:
        """What a case forks once its processes ended (and the lane's file system was mounted again)."""
        return check_main, (str(root / LAYOUTS[self.layout]), work)


def all_cases(actions=ACTIONS, file_systems=FILE_SYSTEMS) -> list[Case]:
    """Every point on every rank that passes it, both layouts, with and without RENAME_EXCHANGE.

    Without RENAME_EXCHANGE only the steps of ``publish`` differ, so only those run there.
    ``returned`` (after both ranks returned) is cut once, on rank 1, and not killed: a
    SIGKILL after ``save`` returned leaves the page cache, and the checkpoint, intact.
    """
    out = []
    for action in actions:
        for fs in file_systems if action == "powercut" else ("disk",):
            for layout in LAYOUTS:
                for point, ranks in POINTS:
                    if point == "returned":
                        ranks = (1,) if action == "powercut" else ()
                    for rank in ranks:
                        if point != "backup":
                            out.append(Case(layout, point, rank, action, fs))
                        if point in ("backup", "renamed", "replace", "discard"):
                            out.append(Case(layout, point, rank, action, fs, exchange=False))
    return out


def random_case(rng: random.Random, action: str, fs: str) -> Case:
    """A case at a random step and rank, layout and publish path."""
    exchange = rng.random() < 0.75
    points = [(p, r) for p, ranks in POINTS for r in ranks if p != "backup" or not exchange]
    point, rank = rng.choice(points)
    return Case(rng.choice(tuple(LAYOUTS)), point, rank, action, fs, exchange)


# --- what the forked children run ----------------------------------------------------------


def write_json(path: Path, obj: dict) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(obj, default=str))
    tmp.replace(path)


def _outcome(fn) -> dict:
    try:
        fn()
    except BaseException as e:
        mro = [c.__name__ for c in type(e).__mro__]
        return {"result": "raised", "cls": type(e).__name__, "tddist": "TddistError" in mro, "msg": str(e)[:2000]}
    return {"result": "ok"}


def rank_main(rank: int, case: Case, target: str, work: Path, cut_path: str) -> None:
    """(forked rank) Commit the old checkpoint, then save the new one with the fault armed; report."""
    import datetime

    import torch.distributed as dist

    import tddist
    from tddist._faults import ENV, NO_EXCHANGE_ENV, POWERCUT_ENV, fault_point

    torch.set_num_threads(1)
    timeout = datetime.timedelta(seconds=SAVE_TIMEOUT)
    dist.init_process_group("gloo", init_method=f"file://{work}/store", rank=rank, world_size=2, timeout=timeout)
    tddist.save(shard("old", rank), target, timeout=SAVE_TIMEOUT)
    dist.barrier()  # no rank arms the fault while the other still opens what the old save committed
    os.environ[ENV] = f"{case.point}:{case.rank}:{case.action}"
    os.environ[POWERCUT_ENV] = cut_path
    os.environ[NO_EXCHANGE_ENV] = "0" if case.exchange else "1"
    out = _outcome(lambda: tddist.save(shard("new", rank), target, timeout=SAVE_TIMEOUT))
    write_json(work / f"rank{rank}.json", out)
    if out["result"] == "ok" and case.point == "returned":
        dist.barrier()  # both returned
        fault_point("returned", rank)


def state_of(target: str) -> str:
    """ "old" or "new" (bit-exact), "absent", "torn" (loads but is neither), or "error: <class>: <message>"."""
    import tddist

    if not os.path.lexists(target):
        return "absent"
    try:
        td = tddist.load(target, verify=True)
    except Exception as e:
        return f"error: {type(e).__name__}: {str(e)[:300]}"
    for version in ("old", "new"):
        try:
            assert_td_equal(td, expected(version))
            return version
        except AssertionError:
            pass
    return "torn"


def check_main(target: str, work: Path) -> None:
    """(forked checker) Load, recover, load again; then remove the target for the next case; report."""
    from tddist import format as fmt
    from tddist import recover
    from tddist._fs import fsync_path, remove_tree

    torch.set_num_threads(1)
    report: dict = {"before": state_of(target), "side": sorted(k for k, _p in fmt.side_entries(target))}
    report["backup_committed"] = any(
        k == "backup" and state_of(p) in ("old", "new") for k, p in fmt.side_entries(target)
    )
    report["recover"] = recover(target)
    report["after"] = report["before"] if not report["recover"] else state_of(target)
    report["left"] = [os.path.basename(p) for _k, p in fmt.side_entries(target)]
    for path in [target, *(p for _k, p in fmt.side_entries(target))]:
        remove_tree(path)
    fsync_path(os.path.dirname(target))
    write_json(work / "check.json", report)


_warm: list[bool] = []


def warm_up() -> None:
    """Import and exercise in this (parent) process what every forked child needs, once.

    A child then starts saving at once instead of importing tddist and
    torch.distributed itself. torch runs on one thread here, so no thread pool
    exists when the children are forked.
    """
    if _warm:
        return
    torch.set_num_threads(1)
    import torch.distributed as _dist  # noqa: F401

    import tddist
    import tddist.comm.gloo

    with tempfile.TemporaryDirectory(prefix="tddist-crash-warm-") as d:
        for name in LAYOUTS.values():
            tddist.save(shard("old", 0), os.path.join(d, name))
            state_of(os.path.join(d, name))
            tddist.recover(os.path.join(d, name))
    _warm.append(True)


def _fork(fn, *args, log: Path | None = None) -> int:
    """Fork a child (in its own process group) that runs ``fn(*args)``; its output goes to ``log``."""
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid == 0:
        code = 3
        try:
            os.setpgid(0, 0)
            if log is not None:
                fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
                os.dup2(fd, 1)
                os.dup2(fd, 2)
                os.close(fd)
            fn(*args)
            code = 0
        except BaseException:
            with contextlib.suppress(Exception):
                sys.stderr.write(traceback.format_exc())
        finally:
            with contextlib.suppress(Exception):
                sys.stdout.flush()
                sys.stderr.flush()
            os._exit(code)
    return pid


# --- storages --------------------------------------------------------------------------------


def mount_problem() -> str | None:
    """Why loop-mounted file systems cannot be used here, or None."""
    if os.geteuid() != 0:
        return "power cuts need root (mount -o loop, FS_IOC_GOINGDOWN)"
    for tool in ("mount", "umount", "mkfs.ext4", "mkfs.xfs"):
        if shutil.which(tool) is None:
            return f"{tool} is not installed (xfsprogs, e2fsprogs)"
    if not os.path.exists("/dev/loop-control") and not os.path.exists("/dev/loop0"):
        return "no loop devices (/dev/loop-control)"
    return None


class LoopFS:
    """A file system of ``kind`` in a sparse image file, loop-mounted at ``mnt``."""

    def __init__(self, kind: str, image: Path, mnt: Path):
        self.kind, self.image, self.mnt = kind, image, mnt

    def create(self) -> None:
        size = XFS_MIN_BYTES if self.kind == "xfs" else EXT4_BYTES
        with open(self.image, "wb") as f:
            f.truncate(size)
        mkfs = ["mkfs.xfs", "-q", "-f"] if self.kind == "xfs" else ["mkfs.ext4", "-q", "-F"]
        _run([*mkfs, str(self.image)])
        self.mnt.mkdir(parents=True, exist_ok=True)
        self.mount()

    def mount(self) -> None:
        _run(["mount", "-t", self.kind, "-o", "loop", str(self.image), str(self.mnt)])

    def unmount(self) -> None:
        deadline = time.monotonic() + 20
        while True:
            r = subprocess.run(["umount", str(self.mnt)], capture_output=True, text=True, timeout=60)
            if r.returncode == 0:
                return
            if time.monotonic() > deadline:
                raise RuntimeError(f"umount {self.mnt} failed: {r.stderr.strip()}")
            time.sleep(0.1)  # a process that used it may still be exiting

    def remount(self) -> None:
        """Unmount the (shut down) file system and mount it again: its journal is replayed."""
        self.unmount()
        self.mount()

    def destroy(self) -> None:
        with contextlib.suppress(Exception):
            self.unmount()
        self.image.unlink(missing_ok=True)


def _run(cmd: list[str]) -> None:
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    if r.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed ({r.returncode}): {r.stderr.strip() or r.stdout.strip()}")


@dataclass
class Lane:
    """Where a lane's cases put their targets; ``fs`` set for a loop-mounted file system."""

    root: Path
    fs: LoopFS | None = None


@contextlib.contextmanager
def lanes(work: Path, disk_lanes: int, file_systems: tuple[str, ...]) -> Iterator[dict[str, list[Lane]]]:
    """``disk_lanes`` directories under ``work`` for kills, and one fresh loop-mounted file system per kind."""
    out: dict[str, list[Lane]] = {"disk": []}
    made: list[LoopFS] = []
    work.mkdir(parents=True, exist_ok=True)
    try:
        for i in range(disk_lanes):
            root = work / f"disk{i}"
            root.mkdir(parents=True)
            out["disk"].append(Lane(root))
        for kind in file_systems:
            fs = LoopFS(kind, work / f"{kind}.img", work / f"{kind}.mnt")
            fs.create()
            made.append(fs)
            out[kind] = [Lane(fs.mnt, fs)]
        yield out
    finally:
        for fs in made:
            fs.destroy()


# --- running cases ---------------------------------------------------------------------------


@dataclass
class Result:
    """What happened in one case: how each rank ended, its report, and what the checker saw."""

    case: Case
    exits: dict[int, int] = field(default_factory=dict)  # rank -> exit code (-9: SIGKILL)
    reports: dict[int, dict] = field(default_factory=dict)
    watchdog: list[str] = field(default_factory=list)
    check: dict | None = None
    error: str | None = None  # the harness itself failed (mount, fork)
    logs: dict[str, str] = field(default_factory=dict)  # the end of each child's output, where it wrote any
    seconds: float = 0.0

    def problems(self) -> list[str]:
        """Every way this case broke the crash guarantees (empty: it held)."""
        c, out = self.case, []
        if self.error:
            return [f"harness: {self.error}"]
        if not isinstance(c, Case):  # another scenario (``crash_incremental``) checks itself
            return c.problems(self)
        out += self.watchdog
        struck = c.rank
        if self.exits.get(struck) != -signal.SIGKILL:
            out.append(
                f"rank {struck} (struck at {c.point!r}) ended with {self.exits.get(struck)}, not SIGKILL; "
                f"report {self.reports.get(struck)}"
            )
        returned = [r for r, rep in self.reports.items() if rep.get("result") == "ok"]
        for r in (0, 1):
            if r == struck:
                continue
            rep = self.reports.get(r)
            if self.exits.get(r) != 0 or rep is None:
                out.append(f"survivor rank {r} ended with {self.exits.get(r)} and report {rep}")
            elif rep["result"] == "raised" and not rep["tddist"]:
                out.append(f"survivor rank {r} raised a {rep['cls']}, not a TddistError: {rep['msg'][:500]}")
        ck = self.check
        if ck is None:
            return [*out, "no checker report"]
        before, after = ck["before"], ck["after"]
        if before not in ("old", "new"):
            backup_gap = not c.exchange and before == "absent" and ck["backup_committed"]
            if not backup_gap:
                out.append(f"after the crash the target is {before!r} (side entries {ck['side']})")
        if after not in ("old", "new"):
            out.append(f"after recover the target is {after!r} (recover: {ck['recover']})")
        elif before in ("old", "new") and after != before:
            out.append(f"recover changed the target from {before} to {after}")
        want = "new" if returned else c.expect
        if want != "either" and after != want:
            why = f"save returned on rank(s) {returned}" if returned else f"expected after {c.action} at {c.point!r}"
            out.append(f"the target holds {after!r}, not {want!r} ({why})")
        if ck["left"]:
            out.append(f"recover left {ck['left']}")
        return out

    def outcome(self) -> str:
        """One word for tables: the state after recover, or "harness-error"."""
        if self.error or self.check is None:
            return "harness-error"
        if not isinstance(self.case, Case):
            return self.case.outcome(self)
        return self.check["after"].split(":")[0] + ("" if self.check["after"] == self.check["before"] else "*")

    def summary(self) -> str:
        """How the ranks ended and what the checker saw, for a failure message."""
        ranks = {
            r: (self.exits.get(r), self.reports.get(r, {}).get("cls", self.reports.get(r, {}).get("result")))
            for r in (0, 1)
        }
        lines = [f"ranks (exit, outcome): {ranks}; {self.seconds:.1f}s"]
        if self.check and not isinstance(self.case, Case):
            lines.append(f"check: {json.dumps(self.check, default=str)[:3000]}")
        elif self.check:
            ck = self.check
            lines.append(f"after the crash: {ck['before']}; side entries {ck['side']}; recover: {ck['recover']}")
            lines.append(f"after recover: {ck['after']}; left {ck['left']}")
        lines += [f"--- {name} ---\n{text}" for name, text in self.logs.items()]
        return "\n".join(lines)

    def as_dict(self) -> dict:
        return {"case": asdict(self.case), "id": self.case.id, **{k: v for k, v in asdict(self).items() if k != "case"}}


class _Running:
    """A lane's case in progress: the forked processes of its current stage.

    A case (``Case``, or ``crash_incremental.IncrementalCase``) says what to
    fork (``processes``: key -> function and arguments, then ``checker``);
    once process 0 ended, a ``stop`` file in the case's work directory tells
    the others (a clean-up running beside a job) to end.
    """

    def __init__(self, lane: Lane, case, work: Path):
        self.lane, self.case, self.work = lane, case, work
        self.result = Result(case)
        self.t0 = time.monotonic()
        self.stage = "ranks"
        self.pids: dict[int, int] = {}
        self.deadline = 0.0

    def start_ranks(self) -> None:
        self.work.mkdir(parents=True)
        self.pids = {
            key: _fork(fn, *args, log=self.work / f"rank{key}.log")
            for key, (fn, args) in self.case.processes(self.lane.root, self.work).items()
        }
        self.deadline = time.monotonic() + RANK_DEADLINE

    def start_check(self) -> None:
        self.stage = "check"
        fn, args = self.case.checker(self.lane.root, self.work)
        self.pids = {-1: _fork(fn, *args, log=self.work / "check.log")}
        self.deadline = time.monotonic() + CHECK_DEADLINE

    def poll(self) -> bool:
        """Reap what ended, enforce the deadline, move to the next stage; True when the case is done."""
        for key, pid in list(self.pids.items()):
            done, status = os.waitpid(pid, os.WNOHANG)
            if not done and time.monotonic() > self.deadline:
                os.killpg(pid, signal.SIGKILL)
                _, status = os.waitpid(pid, 0)
                self.result.watchdog.append(f"{'checker' if key < 0 else f'rank {key}'} killed at its deadline")
                done = pid
            if done:
                if key >= 0:
                    self.result.exits[key] = os.waitstatus_to_exitcode(status)
                if key == 0:
                    (self.work / "stop").touch()
                del self.pids[key]
        if self.pids:
            return False
        if self.stage == "ranks":
            for r in self.result.exits:
                f = self.work / f"rank{r}.json"
                if f.exists():
                    self.result.reports[r] = json.loads(f.read_text())
            if self.lane.fs is not None:
                self.lane.fs.remount()
            self.start_check()
            return False
        f = self.work / "check.json"
        self.result.check = json.loads(f.read_text()) if f.exists() else None
        for log in sorted(self.work.glob("*.log")):
            text = log.read_text(errors="replace").strip()
            if text:
                self.result.logs[log.stem] = text[-3000:]
        self.result.seconds = time.monotonic() - self.t0
        return True


def run_cases(
    plan: dict[str, list[Case]], lanes_by_fs: dict[str, list[Lane]], work: Path, progress=None
) -> list[Result]:
    """Run every case of ``plan`` (file system -> cases) on that file system's lanes, lanes in parallel."""
    warm_up()
    queues = {fs: list(cases) for fs, cases in plan.items()}
    idle = [(fs, lane) for fs, ls in lanes_by_fs.items() if fs in queues for lane in ls]
    running: list[_Running] = []
    results: list[Result] = []
    n = 0
    while idle or running:
        for fs, lane in list(idle):
            if not queues[fs]:
                idle.remove((fs, lane))
                continue
            case = queues[fs].pop(0)
            n += 1
            job = _Running(lane, case, work / f"{n:05d}-{case.id}")
            try:
                job.start_ranks()
            except Exception as e:
                job.result.error = f"{type(e).__name__}: {e}"
                results.append(job.result)
                continue
            idle.remove((fs, lane))
            running.append(job)
        for job in list(running):
            try:
                done = job.poll()
            except Exception as e:
                job.result.error = f"{type(e).__name__}: {e}"
                for pid in job.pids.values():
                    with contextlib.suppress(ProcessLookupError):
                        os.killpg(pid, signal.SIGKILL)
                    with contextlib.suppress(ChildProcessError):
                        os.waitpid(pid, 0)
                done = True
            if done:
                running.remove(job)
                results.append(job.result)
                if job.result.error is None:  # a lane whose file system broke takes no more cases
                    idle.append((job.case.fs, job.lane))
                if progress is not None:
                    progress(job.result)
        time.sleep(0.005)
    return results


@contextlib.contextmanager
def workdir(base: str | None = None) -> Iterator[Path]:
    """A scratch directory for lanes and reports, removed afterwards."""
    path = Path(tempfile.mkdtemp(prefix="tddist-crash-", dir=base))
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


def table(results: list[Result]) -> str:
    """Outcomes per step and layout: counts of old / new / other states, and problems."""
    rows: dict[tuple[str, str], dict[str, int]] = {}
    for res in results:
        c = res.case
        path = f" ({c.where}, {c.mode})" if not isinstance(c, Case) else "" if c.exchange else " (backup path)"
        key = (f"{c.point}{path}", f"{c.action} {c.fs} {c.layout}")
        cell = rows.setdefault(key, {})
        word = "PROBLEM" if res.problems() else res.outcome()
        cell[word] = cell.get(word, 0) + 1
    order = {p: i for i, (p, _r) in enumerate(POINTS)}
    lines = [f"{'step':28} {'action fs layout':24} outcomes"]
    for (step, where), cell in sorted(rows.items(), key=lambda kv: (order.get(kv[0][0].split()[0], -1), kv[0])):
        lines.append(f"{step:28} {where:24} " + ", ".join(f"{k}={v}" for k, v in sorted(cell.items())))
    return "\n".join(lines)
