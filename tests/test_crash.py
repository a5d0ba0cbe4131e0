"""Crashes at every step of the commit: SIGKILLs, and power cuts on loop-mounted ext4 and XFS.

The guarantee under test: after any crash the target holds the old or the new
checkpoint, complete (``load(verify=True)`` returns exactly one of them), a
``save`` that returned on any rank is never lost, and ``recover`` leaves no
staging or backup entry behind. Each case (``tests/crash_harness.py``) commits
an old checkpoint with two gloo ranks, then strikes their save of a new one at
one fault point of ``tddist/commit.py`` on one rank:

- kills: SIGKILL of rank 0 or rank 1 at every point, on the ordinary disk;
- power cuts: ``FS_IOC_GOINGDOWN`` without log flush, then SIGKILL, at every
  point, on a loop-mounted ext4 and XFS that are then unmounted and mounted
  again (journal replay) before the checks;

for packed directories and ``.tdz`` archives, and for the steps of
``publish`` also where it replaces through a backup name (no RENAME_EXCHANGE).

One parent (this pytest process) forks every rank and checker process, so no
case pays for importing torch; the cases selected in this session run once,
in parallel lanes (two directories, one file system of each kind), the first
time a test asks for their results. Power cuts need root and loop devices:
elsewhere those tests skip, with the reason, unless ``CI`` is set, where they
fail.

The same lanes run a few cuts of ``tests/crash_incremental.py``: a run of
incremental saves while another process's retention cleans the root, cut in
the pin, the commit, the unpin and the clean-up's deletion; after the remount
and ``tddist gc`` no checkpoint is torn, no reference dangles, no referenced
holder was removed.
"""

from __future__ import annotations

import contextlib
import os
import signal
from pathlib import Path

import pytest

from tests import crash_harness as ch
from tests import crash_incremental as ci

CASES = ch.all_cases()
CUT_FS = ch.FILE_SYSTEMS
INCREMENTAL = [c for fs in CUT_FS for c in ci.ci_cases(fs)]


def _selected(session: pytest.Session) -> list:
    """The crash cases whose tests this session runs (so ``-k`` runs only those)."""
    out = []
    for item in session.items:
        params = getattr(getattr(item, "callspec", None), "params", {})
        if item.module.__name__ == __name__ and isinstance(params.get("case"), (ch.Case, ci.IncrementalCase)):
            out.append(params["case"])
    return out


def _unavailable(reason: str) -> None:
    """Skip, or fail when ``CI`` is set (CI runs as root with xfsprogs installed)."""
    if os.environ.get("CI"):
        pytest.fail(f"power cuts cannot run here, and CI is set: {reason}")
    pytest.skip(reason)


@pytest.fixture(scope="module")
def results(request, tmp_path_factory) -> dict[str, ch.Result | str]:
    """Run the selected cases once: case id -> its Result, or why it could not run."""
    cases = _selected(request.session)
    work = tmp_path_factory.mktemp("crash")
    cut_fs = tuple(sorted({c.fs for c in cases} - {"disk"}))
    out: dict[str, ch.Result | str] = {}
    why = ch.mount_problem() if cut_fs else None
    if why:
        out.update({c.id: why for c in cases if c.fs != "disk"})
        cases, cut_fs = [c for c in cases if c.fs == "disk"], ()
    plan: dict[str, list[ch.Case]] = {}
    for c in cases:
        plan.setdefault(c.fs, []).append(c)
    with contextlib.ExitStack() as stack:
        try:
            by_fs = stack.enter_context(ch.lanes(work / "lanes", 2, cut_fs))
        except RuntimeError as e:  # mkfs or mount refused: run the kills only
            out.update({c.id: f"cannot set up loop-mounted file systems: {e}" for c in cases if c.fs != "disk"})
            plan = {"disk": plan.get("disk", [])}
            by_fs = stack.enter_context(ch.lanes(work / "disk-lanes", 2, ()))
        for res in ch.run_cases(plan, by_fs, work / "cases"):
            out[res.case.id] = res
    return out


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_crash(case: ch.Case, results: dict[str, ch.Result | str]) -> None:
    """The target holds the old or the new checkpoint (the new one where it must), and recover cleans up."""
    res = results[case.id]
    if isinstance(res, str):
        _unavailable(res)
    assert isinstance(res, ch.Result)
    problems = res.problems()
    assert not problems, f"{case.id} (expected {case.expect!r}):\n" + "\n".join(problems) + f"\n{res.summary()}"


@pytest.mark.parametrize("case", INCREMENTAL, ids=[c.id for c in INCREMENTAL])
def test_power_cut_during_incremental_saves_and_clean_up(case: ci.IncrementalCase, results) -> None:
    """A power cut in a run of incremental saves with another process's retention cleaning the root: after the
    remount and ``tddist gc`` (then ``gc --keep-last 1``), no torn checkpoint, no dangling reference, no
    referenced holder removed."""
    res = results[case.id]
    if isinstance(res, str):
        _unavailable(res)
    assert isinstance(res, ch.Result)
    problems = res.problems()
    assert not problems, f"{case.id}:\n" + "\n".join(problems) + f"\n{res.summary()}"
    assert res.check is not None and res.check["checked"] > 0


@pytest.mark.parametrize("kind", CUT_FS)
def test_power_cut_loses_what_was_not_fsynced(kind: str, tmp_path: Path) -> None:
    """The power cut is real: a file fsynced before it survives the remount, one written after it does not."""
    fs = _mounted(kind, tmp_path)
    try:
        kept, lost = fs.mnt / "fsynced", fs.mnt / "not-fsynced"
        pid = ch._fork(_write_then_cut, str(kept), str(lost), str(fs.mnt))
        _pid, status = _wait(pid, 60)
        assert os.waitstatus_to_exitcode(status) == -signal.SIGKILL, "the cutting process did not end by SIGKILL"
        fs.remount()
        assert kept.read_bytes() == b"kept" * 1000
        assert not lost.exists() or lost.stat().st_size == 0, "a file never fsynced survived the power cut"
    finally:
        fs.destroy()


def _mounted(kind: str, tmp_path: Path) -> ch.LoopFS:
    """A fresh loop-mounted ``kind`` file system under ``tmp_path`` (skip, or fail under CI, where none can be)."""
    why = ch.mount_problem()
    if why:
        _unavailable(why)
    ch.warm_up()
    fs = ch.LoopFS(kind, tmp_path / f"{kind}.img", tmp_path / "mnt")
    try:
        fs.create()
    except RuntimeError as e:
        _unavailable(f"cannot set up a loop-mounted {kind}: {e}")
    return fs


def _write_then_cut(kept: str, lost: str, mnt: str) -> None:
    from tddist._faults import power_cut

    with open(kept, "wb") as f:
        f.write(b"kept" * 1000)
        f.flush()
        os.fsync(f.fileno())
    with open(lost, "wb") as f:
        f.write(b"lost" * 1000)
    power_cut(mnt)


def _wait(pid: int, timeout: float) -> tuple[int, int]:
    import time

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return done, status
        time.sleep(0.01)
    os.killpg(pid, signal.SIGKILL)
    os.waitpid(pid, 0)
    raise AssertionError(f"process {pid} did not end within {timeout}s")


@pytest.mark.parametrize("kind", CUT_FS)
def test_reading_a_failed_file_system_is_a_tddist_error(kind: str, tmp_path: Path) -> None:
    """Reads from a file system that failed under them (EIO) raise TddistErrors, never torch's RuntimeError.

    A rank that survives a power cut reads the checkpoint it just committed
    back; a descriptor it opened before the cut must not turn into a
    RuntimeError from ``torch.from_file`` when it is mapped after.
    """
    fs = _mounted(kind, tmp_path)
    report = tmp_path / "report.json"
    try:
        pid = ch._fork(_read_after_shut_down, str(fs.mnt), str(report), log=tmp_path / "child.log")
        _pid, status = _wait(pid, 120)
        log = (tmp_path / "child.log").read_text() if (tmp_path / "child.log").exists() else ""
        assert os.waitstatus_to_exitcode(status) == 0, f"the reading process failed:\n{log}"
    finally:
        fs.destroy()
    import json

    seen = json.loads(report.read_text())
    assert seen["map"] == "OSError 5", seen
    for what in ("load directory", "load archive", "pinned read directory", "pinned read archive"):
        assert seen[what].startswith("tddist:"), f"{what}: {seen[what]}"


def _read_after_shut_down(mnt: str, report: str) -> None:
    import json
    import traceback

    import torch
    from tensordict import TensorDict

    import tddist
    from tddist._faults import shut_down
    from tddist.core.sharding import full_box
    from tddist.loading.read import read_leaves
    from tddist.storage.backends import open_checkpoint
    from tddist.storage.base import map_copy_on_write

    td = TensorDict({"w": torch.arange(1 << 16, dtype=torch.float32)}, batch_size=[])
    targets = {"directory": os.path.join(mnt, "ckpt"), "archive": os.path.join(mnt, "ckpt.tdz")}
    for target in targets.values():
        tddist.save(td, target)
    data_file = next(os.path.join(r, f) for r, _, fs in os.walk(targets["directory"]) for f in fs if f != "tddist.json")
    opened = {name: open_checkpoint(t) for name, t in targets.items()}
    fd = os.open(data_file, os.O_RDONLY)
    shut_down(mnt)
    seen: dict[str, str] = {}

    def outcome(fn) -> str:
        try:
            fn()
        except tddist.TddistError as e:
            return f"tddist: {type(e).__name__}: {e}"
        except OSError as e:
            return f"OSError {e.errno}" + ("" if fn is map_first_page else f": {traceback.format_exc()}")
        except Exception as e:
            return f"{type(e).__name__}: {e}"
        return "returned"

    def map_first_page() -> None:
        map_copy_on_write(f"/proc/self/fd/{fd}", 4096)

    seen["map"] = outcome(map_first_page)
    for name, target in targets.items():
        seen[f"load {name}"] = outcome(lambda t=target: tddist.load(t))
        o = opened[name]
        requests = [(leaf, full_box(leaf.shape)) for leaf in o.manifest.leaves.values()]
        seen[f"pinned read {name}"] = outcome(lambda o=o, r=requests: read_leaves(o, o.manifest, r, 1, False))
    with open(report, "w") as f:
        json.dump(seen, f)
