"""CheckpointManager's node-local tier: local commits, background promotion to the root, restore, failures, crashes.

In-process tests use one process or thread ranks, each rank with its own
``local_dir`` (``{rank}`` in the path), so nothing relies on a local
directory shared between ranks. The crash and preemption tests run 2-rank
gloo jobs of real processes, all forked from this process (as
tests/crash_harness.py does: importing torch in fresh interpreters would cost
seconds per process); a rank is SIGKILLed at a fault point of the promotion's
commit (``TDDIST_FAULT_THREAD`` restricts the fault to the promotion's worker
thread, so the foreground local commit, which is rank 0 of a one-rank
communicator on every process, is never struck), and a restarted job then
checks what survived.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from tensordict import TensorDict

import tddist
from tddist import _faults
from tddist.jobs.manager import EXIT_PREEMPTED, CheckpointManager
from tddist.jobs.retention import parse_step, step_name
from tests import crash_harness as ch
from tests.helpers import assert_td_equal, leftovers
from tests.manager_rank import expected, local_state, train

BENCH = Path(__file__).resolve().parent.parent / "benchmarks" / "local_tier.py"


def parts(local: Path) -> list[str]:
    """``step-.../rank-r-of-w`` entries under a local directory."""
    return sorted(str(p.relative_to(local)) for p in local.glob("step-*/rank-*"))


def run_steps(mgr: CheckpointManager, state: TensorDict, start: int, stop: int) -> None:
    for s in range(start, stop):
        train(state)
        mgr.step(s + 1, state)


# --- one process and thread ranks ----------------------------------------------------------


def test_one_process_promotion_is_bit_exact_and_restore_prefers_local(tmp_path: Path) -> None:
    root, local = tmp_path / "shared", tmp_path / "local"
    with CheckpointManager(root, every=2, keep_last=2, local_dir=local, preempt_signal=None) as mgr:
        state = local_state(0, 1, 0)
        assert mgr.restore(state).tier is None
        run_steps(mgr, state, 0, 6)
    direct = tmp_path / "direct"
    tddist.save(local_state(0, 1, 6), direct, metadata={"step": 6})
    promoted = root / step_name(6)
    assert_td_equal(tddist.load(promoted, shard=None, verify=True), expected(6), "promoted checkpoint")
    assert_td_equal(tddist.load(promoted, shard=None), tddist.load(direct, shard=None), "promoted vs direct save")
    assert tddist.read_manifest(promoted).metadata == tddist.read_manifest(direct).metadata == {"step": 6}
    assert sorted(os.listdir(root)) == [".tddist-manager.lock", step_name(4), step_name(6)]
    assert parts(local) == [f"{step_name(6)}/rank-0-of-1"], "older local copies are dropped once promoted"

    with CheckpointManager(root, local_dir=local, preempt_signal=None) as mgr:
        state = local_state(0, 1, 0)
        restored = mgr.restore(state)
        assert (restored, restored.tier, restored.path) == (6, "local", str(local / step_name(6) / "rank-0-of-1"))
        assert_td_equal(state, local_state(0, 1, 6), "restored from the local copy")
        assert mgr.restore(local_state(0, 1, 0), step=4).tier == "shared"  # no local copy of step 4


def test_archive_promotion_and_local_restore(tmp_path: Path) -> None:
    root, local = tmp_path / "shared", tmp_path / "local"
    kw = {"save_kwargs": {"archive": True, "compression": "deflate"}, "local_dir": local, "preempt_signal": None}
    with CheckpointManager(root, **kw) as mgr:
        mgr.save(3, local_state(0, 1, 3))
    assert_td_equal(tddist.load(root / step_name(3, archive=True), shard=None, verify=True), expected(3), "archive")
    assert parts(local) == [f"{step_name(3)}/rank-0-of-1"]  # the local copy is a directory (no compression)
    with CheckpointManager(root, **kw) as mgr:
        state = local_state(0, 1, 0)
        assert mgr.restore(state).tier == "local"
        assert_td_equal(state, local_state(0, 1, 3), "restored")


def test_restore_picks_local_then_shared_when_a_part_or_the_world_size_differs(tmp_path: Path) -> None:
    root, local = tmp_path / "shared", str(tmp_path / "node-{rank}")

    def run(size: int, body: Callable[[CheckpointManager, TensorDict], object]) -> list[object]:
        def rank(comm):
            with CheckpointManager(root, every=3, comm=comm, local_dir=local, preempt_signal=None) as mgr:
                return body(mgr, local_state(comm.rank, comm.size, 0))

        out = tddist.run_threads(size, rank)
        assert not any(isinstance(r, BaseException) for r in out), out
        return out

    def train_to_6(mgr: CheckpointManager, state: TensorDict) -> object:
        run_steps(mgr, state, mgr.restore(state), 6)
        return None

    def restore(mgr: CheckpointManager, state: TensorDict) -> object:
        got = mgr.restore(state)
        assert_td_equal(state, local_state(mgr.comm.rank, mgr.comm.size, 6), f"rank {mgr.comm.rank}")
        return (int(got), got.tier)

    run(2, train_to_6)
    assert parts(tmp_path / "node-0") == [f"{step_name(6)}/rank-0-of-2"]
    assert parts(tmp_path / "node-1") == [f"{step_name(6)}/rank-1-of-2"]
    assert run(2, restore) == [(6, "local")] * 2
    assert run(3, restore) == [(6, "shared")] * 3  # a 2-rank local copy on 3 ranks: resharded from the root
    data = tmp_path / "node-1" / step_name(6) / "rank-1-of-2" / "rank-00000.data"
    data.write_bytes(data.read_bytes()[:-4])  # rank 1's part is damaged: every rank loads from the root
    assert run(2, restore) == [(6, "shared")] * 2
    shutil.rmtree(tmp_path / "node-1")  # rank 1's node lost its disk
    assert run(2, restore) == [(6, "shared")] * 2
    assert parts(tmp_path / "node-0") == [f"{step_name(6)}/rank-0-of-2"]


def test_ranks_of_one_node_may_share_a_local_dir(tmp_path: Path) -> None:
    root, local = tmp_path / "shared", tmp_path / "node"

    def body(comm):
        with CheckpointManager(root, every=2, comm=comm, local_dir=local, preempt_signal=None) as mgr:
            run_steps(mgr, local_state(comm.rank, comm.size, 0), 0, 4)
        with CheckpointManager(root, comm=comm, local_dir=local, preempt_signal=None) as mgr:
            state = local_state(comm.rank, comm.size, 0)
            got = mgr.restore(state)
            assert_td_equal(state, local_state(comm.rank, comm.size, 4), f"rank {comm.rank}")
            return int(got), got.tier

    assert tddist.run_threads(2, body) == [(4, "local")] * 2
    assert parts(local) == [f"{step_name(4)}/rank-{r}-of-2" for r in range(2)]  # step 2 dropped by both ranks
    assert os.listdir(local) == [step_name(4)]


def test_restore_prefers_a_newer_shared_checkpoint_and_a_newer_local_copy(tmp_path: Path) -> None:
    root, local = tmp_path / "shared", str(tmp_path / "node-{rank}")

    def body(comm):
        state = local_state(comm.rank, comm.size, 0)
        with CheckpointManager(root, comm=comm, local_dir=local, preempt_signal=None) as mgr:
            run_steps(mgr, state, 0, 2)
            mgr.save(2, state)
        with CheckpointManager(root, comm=comm, preempt_signal=None) as mgr:  # another job, shared root only
            run_steps(mgr, state, 2, 4)
            mgr.save(4, state)
        with CheckpointManager(root, comm=comm, local_dir=local, preempt_signal=None) as mgr:
            fresh = local_state(comm.rank, comm.size, 0)
            first = mgr.restore(fresh)
            assert_td_equal(fresh, local_state(comm.rank, comm.size, 4), f"rank {comm.rank}")
            older = mgr.restore(local_state(comm.rank, comm.size, 0), step=2)
            return (int(first), first.tier, int(older), older.tier)

    assert tddist.run_threads(2, body) == [(4, "shared", 2, "local")] * 2


def test_failed_promotion_to_a_file_is_raised_on_every_rank_the_local_copy_stays_and_a_restart_promotes_it(
    tmp_path: Path,
) -> None:
    root, local = tmp_path / "not-a-dir", str(tmp_path / "node-{rank}")
    root.write_text("a file where the shared root should be")

    def body(comm):
        mgr = CheckpointManager(root, every=1, comm=comm, local_dir=local, preempt_signal=None)
        state = local_state(comm.rank, comm.size, 0)
        with pytest.raises(tddist.TddistError) as info:
            run_steps(mgr, state, 0, 5)  # raised from a later step()
        mgr.close()
        return str(info.value)

    messages = tddist.run_threads(2, body)
    for r, msg in enumerate(messages):
        assert isinstance(msg, str), f"rank {r}: {msg!r}"
        assert "promotion of step 1" in msg and str(root) in msg and "node-local copy" in msg, msg
    assert root.read_text().startswith("a file")
    for r in range(2):
        assert parts(tmp_path / f"node-{r}") == [f"{step_name(1)}/rank-{r}-of-2"]
        part = tddist.load(tmp_path / f"node-{r}" / step_name(1) / f"rank-{r}-of-2", verify=True)
        assert_td_equal(part, local_state(r, 2, 1), f"rank {r}'s local copy")

    root.unlink()  # the shared root is fixed; a restart resumes from the local copy and promotes it

    def restart(comm):
        with CheckpointManager(root, comm=comm, local_dir=local, preempt_signal=None) as mgr:
            state = local_state(comm.rank, comm.size, 0)
            got = mgr.restore(state)
            assert_td_equal(state, local_state(comm.rank, comm.size, 1), f"rank {comm.rank}")
            return int(got), got.tier

    assert tddist.run_threads(2, restart) == [(1, "local")] * 2
    assert_td_equal(tddist.load(root / step_name(1), shard=None, verify=True), expected(1), "promoted on restart")
    assert tddist.read_manifest(root / step_name(1)).metadata == {"step": 1}


def test_a_local_save_failing_on_one_rank_fails_on_every_rank_and_promotes_nothing(tmp_path: Path) -> None:
    root, local = tmp_path / "shared", str(tmp_path / "node-{rank}")
    (tmp_path / "node-1").write_text("rank 1's local storage is not a directory")

    def body(comm):
        with CheckpointManager(root, comm=comm, local_dir=local, preempt_signal=None) as mgr:
            with pytest.raises(tddist.TddistError) as info:
                mgr.save(5, local_state(comm.rank, comm.size, 5))
            return str(info.value)

    for r, msg in enumerate(tddist.run_threads(2, body)):
        assert isinstance(msg, str) and "saving step 5 to the node-local tier" in msg and "rank 1" in msg, (r, msg)
    assert not root.exists(), "nothing was promoted"


def test_failed_rank_keeps_local_copies_until_a_newer_promotion_commits(tmp_path: Path) -> None:
    root, local = tmp_path / "shared", str(tmp_path / "node-{rank}")

    def body(comm):
        with CheckpointManager(root, keep_last=1, comm=comm, local_dir=local, preempt_signal=None) as mgr:
            state = local_state(comm.rank, comm.size, 0)
            run_steps(mgr, state, 0, 2)
            mgr.save(2, state)
            mgr.wait()
            run_steps(mgr, state, 2, 4)
            error = None
            with _faults.inject("write", 1):  # rank 1's write of the promotion (local saves are rank 0 of 1)
                mgr.save(4, state)
                try:
                    mgr.wait()
                except tddist.TddistError as e:
                    error = e
            have = parts(tmp_path / f"node-{comm.rank}")
            comm.barrier()  # every rank looked before any rank saves again
            run_steps(mgr, state, 4, 6)
            mgr.save(6, state)
            mgr.wait()
            return type(error).__name__, str(error), have, parts(tmp_path / f"node-{comm.rank}")

    for r, out in enumerate(tddist.run_threads(2, body)):
        assert not isinstance(out, BaseException), f"rank {r}: {out!r}"
        cls, msg, during, after = out
        assert cls == "InjectedFault" and "promotion of step 4" in msg and "rank 1" in msg, msg
        # 2 was dropped once 4 was complete locally (2 was promoted); 4 stays until a newer promotion commits
        assert during == [f"{step_name(4)}/rank-{r}-of-2"]
        assert after == [f"{step_name(6)}/rank-{r}-of-2"]
    assert sorted(os.listdir(root)) == [".tddist-manager.lock", step_name(6)]
    assert leftovers(root / "*") == []
    assert_td_equal(tddist.load(root / step_name(6), shard=None, verify=True), expected(6), "step 6")


def test_local_dir_options_are_checked(tmp_path: Path) -> None:
    with pytest.raises(tddist.InvalidArgumentError, match="async_save"):
        CheckpointManager(tmp_path / "r", local_dir=tmp_path / "l", async_save=True, preempt_signal=None)
    with pytest.raises(tddist.InvalidArgumentError, match="rank"):
        CheckpointManager(tmp_path / "r", local_dir=str(tmp_path / "{node}"), preempt_signal=None)


def test_benchmark_smoke(tmp_path: Path) -> None:
    import subprocess

    out = subprocess.run(
        [sys.executable, str(BENCH), "--mib", "1", "--rounds", "2", "--dir", str(tmp_path)],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    assert "ratio" in out.stdout, out.stdout


# --- real processes: crashes during promotion, preemption ------------------------------------

OLD, NEW = 10, 20


@dataclass(frozen=True)
class Strike:
    """A SIGKILL of ``rank`` at fault point ``point`` while saving step 20: in its promotion, or its local save."""

    point: str
    rank: int
    tier: str  # "promotion" (the background commit to the root) or "local" (the rank's one-rank local commit)

    @property
    def names(self) -> str:
        """What the error of a rank that survived the strike says."""
        return "promotion of step 20" if self.tier == "promotion" else "saving step 20 to the node-local tier"

    @property
    def restored_locally(self) -> int:
        """The step a restart restores from the local copies: 20 once every rank's part committed."""
        return NEW if self.tier == "promotion" else OLD


#: Every point of the commit, on every rank that passes it, of a promotion to a new step directory (a
#: fresh target: no replace, no discard); and a local save struck before and after writing.
STRIKES = tuple(
    Strike(point, rank, "promotion")
    for point, ranks in ch.POINTS
    if point not in ("backup", "replace", "discard", "returned")
    for rank in ranks
) + (Strike("begin", 0, "local"), Strike("write", 1, "local"))
VERSION = {OLD: "old", NEW: "new"}


def _init(work: Path, tag: str, rank: int) -> None:
    import datetime

    import torch.distributed as dist

    torch.set_num_threads(1)
    timeout = datetime.timedelta(seconds=ch.SAVE_TIMEOUT)
    dist.init_process_group("gloo", init_method=f"file://{work}/store-{tag}", rank=rank, world_size=2, timeout=timeout)


def _manager(work: Path, **kw) -> CheckpointManager:
    kw.setdefault("preempt_signal", None)
    return CheckpointManager(
        work / "shared", local_dir=str(work / "node-{rank}"), save_kwargs={"timeout": ch.SAVE_TIMEOUT}, **kw
    )


def _report(work: Path, name: str, obj: dict) -> None:
    ch.write_json(work / f"{name}.json", obj)


def strike_rank(rank: int, work: Path, strike: Strike) -> None:
    """(forked rank) Save and promote step 10, then save step 20 with a SIGKILL armed."""
    _init(work, "strike", rank)
    mgr = _manager(work, keep_last=None)
    mgr.save(OLD, ch.shard("old", rank))
    mgr.wait()
    mgr.comm.barrier()
    if strike.tier == "promotion":
        os.environ[_faults.ENV] = f"{strike.point}:{strike.rank}:kill"
        os.environ[_faults.THREAD_ENV] = "tddist-save"  # the promotion's worker thread only
    elif rank == strike.rank:  # the local commit is rank 0 of a one-rank communicator on every rank
        os.environ[_faults.ENV] = f"{strike.point}:0:kill"
    _report(work, f"strike{rank}", ch._outcome(lambda: (mgr.save(NEW, ch.shard("new", rank)), mgr.close())))


def restart_rank(rank: int, work: Path, local: int) -> None:
    """(forked rank) Restore the local copy of step ``local`` (and promote it if the root lacks it), then
    without rank 1's local part (from the shared root)."""
    _init(work, "restart", rank)
    out: dict = {}
    with _manager(work) as mgr:
        state = ch.shard(VERSION[local], rank).zero_()
        got = mgr.restore(state)
        out["local"] = [int(got), got.tier, _same(state, ch.shard(VERSION[local], rank))]
    mgr.comm.barrier()
    if rank == 1:
        shutil.rmtree(work / "node-1")
    mgr.comm.barrier()
    with _manager(work) as mgr:
        newest = parse_step(os.path.basename(mgr.latest() or ""))
        state = ch.shard(VERSION[newest], rank).zero_()
        got = mgr.restore(state)
        out["shared"] = [int(got), got.tier, _same(state, ch.shard(VERSION[newest], rank))]
    _report(work, f"restart{rank}", out)


def _same(a: TensorDict, b: TensorDict) -> bool:
    try:
        assert_td_equal(a, b)
    except AssertionError:
        return False
    return True


def run_ranks(fn: Callable[..., None], *args: object, deadline: float = ch.RANK_DEADLINE) -> dict[int, int]:
    """Fork 2 ranks running ``fn(rank, *args)``; their exit codes (-9: SIGKILL); kill both past the deadline."""
    pids = {r: ch._fork(_exit_code_of, fn, r, *args) for r in range(2)}
    codes: dict[int, int] = {}
    end = time.monotonic() + deadline
    while len(codes) < 2:
        for r, pid in pids.items():
            if r in codes:
                continue
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                codes[r] = os.waitstatus_to_exitcode(status)
            elif time.monotonic() > end:
                os.killpg(pid, signal.SIGKILL)
                os.waitpid(pid, 0)
                codes[r] = 999  # hung
        time.sleep(0.02)
    return codes


def _exit_code_of(fn: Callable[..., None], *args: object) -> None:
    try:
        fn(*args)
    except SystemExit as e:  # the training loop's own exit status, without the fork wrapper's
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(e.code if isinstance(e.code, int) else 1)


def test_sigkill_at_every_step_of_a_promotion(tmp_path: Path) -> None:
    ch.warm_up()
    problems = []
    for strike_at in STRIKES:
        point, struck = strike_at.point, strike_at.rank
        work = tmp_path / f"{strike_at.tier}-{point}-{struck}"
        work.mkdir()
        case = ch.Case("dir", point, struck, "kill", "disk")
        expect = case.expect if strike_at.tier == "promotion" else "old"
        codes = run_ranks(strike_rank, work, strike_at)
        survivor = 1 - struck
        strike = json.loads((work / f"strike{survivor}.json").read_text()) if codes[survivor] == 0 else {}
        found = []
        if codes[struck] != -signal.SIGKILL:
            found.append(f"struck rank exited {codes[struck]}")
        if codes[survivor] != 0 or strike.get("result") == "raised" and not strike.get("tddist"):
            found.append(f"survivor exited {codes[survivor]}: {strike}")
        elif strike.get("result") == "raised" and strike_at.names not in strike.get("msg", ""):
            found.append(f"the survivor's error does not say {strike_at.names!r}: {strike}")
        if ch.state_of(str(work / "shared" / step_name(OLD))) != "old":
            found.append("the shared step 10 is damaged")
        for r in range(2):
            part = work / f"node-{r}" / step_name(strike_at.restored_locally) / f"rank-{r}-of-2"
            if not _same(tddist.load(part, verify=True), ch.shard(VERSION[strike_at.restored_locally], r)):
                found.append(f"rank {r}'s local copy of step {strike_at.restored_locally} differs")
        shared = ch.state_of(str(work / "shared" / step_name(NEW)))  # "absent", "new", or damaged
        codes = run_ranks(restart_rank, work, strike_at.restored_locally)
        reports = [json.loads((work / f"restart{r}.json").read_text()) if codes[r] == 0 else {} for r in range(2)]
        if codes != {0: 0, 1: 0}:
            found.append(f"restart exit codes {codes}")
        if shared not in ({"old": ("absent",), "new": ("new",)}.get(expect, ("absent", "new"))):
            found.append(f"shared step 20 is {shared!r}, expected {expect}")
        if leftovers(work / "shared" / "*"):
            found.append(f"leftovers in the shared root: {leftovers(work / 'shared' / '*')}")
        # the restart promoted the local copy it restored where the shared root had only older ones
        newest = strike_at.restored_locally
        after = ch.state_of(str(work / "shared" / step_name(NEW)))
        if after != ("new" if newest == NEW else "absent"):
            found.append(f"after the restart, the shared step 20 is {after!r}")
        for r, rep in enumerate(reports):
            local = [strike_at.restored_locally, "local", True]
            if rep.get("local") != local or rep.get("shared") != [newest, "shared", True]:
                found.append(f"restart rank {r}: {rep}")
        problems += [f"{strike_at}: {p}" for p in found]
    assert not problems, "\n".join(problems)


def dtensor_state(rank: int, step: int) -> TensorDict:
    """A DTensor ``w`` (6 x 4, rows sharded over the 2 ranks) and a replicated ``b``, their values set by ``step``."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard

    mesh = init_device_mesh("cpu", (2,))
    full = torch.arange(24, dtype=torch.float32).view(6, 4) + step
    w = DTensor.from_local(full[3 * rank : 3 * rank + 3].clone(), mesh, [Shard(0)], run_check=False)
    return TensorDict(w=w, b=torch.full((2,), float(step)), batch_size=[])


def dtensor_rank(rank: int, work: Path) -> None:
    """(forked rank) Save DTensor state through the local tier; lose the shared copy; restore locally (which
    promotes it again), then from the root."""
    _init(work, "dtensor", rank)
    with _manager(work) as mgr:
        mgr.save(7, dtensor_state(rank, 7))
    mgr.comm.barrier()
    if rank == 0:  # the shared copy is lost: the local restore promotes step 7 again, DTensors whole
        shutil.rmtree(work / "shared" / step_name(7))
    out = {}
    for tier in ("local", "shared"):
        if tier == "shared" and rank == 1:
            shutil.rmtree(work / "node-1")
        mgr.comm.barrier()
        with _manager(work) as mgr:
            state = dtensor_state(rank, 0)
            got = mgr.restore(state)
            want = torch.arange(24, dtype=torch.float32).view(6, 4) + 7
            w = state["w"].full_tensor()  # collective: every rank gathers the whole tensor
            out[tier] = [int(got), got.tier, torch.equal(w, want) and torch.equal(state["b"], torch.full((2,), 7.0))]
    _report(work, f"dtensor{rank}", out)


def test_dtensor_state_is_saved_locally_as_shards_and_promoted_whole(tmp_path: Path) -> None:
    ch.warm_up()
    codes = run_ranks(dtensor_rank, tmp_path)
    assert codes == {0: 0, 1: 0}, codes
    for r in range(2):
        report = json.loads((tmp_path / f"dtensor{r}.json").read_text())
        assert report == {"local": [7, "local", True], "shared": [7, "shared", True]}, (r, report)
    part = tddist.load(tmp_path / "node-0" / step_name(7) / "rank-0-of-2", verify=True)  # rank 0's shard only
    assert torch.equal(part["w"], torch.arange(12, dtype=torch.float32).view(3, 4) + 7)
    full = tddist.load(tmp_path / "shared" / step_name(7), shard=None, verify=True)
    assert torch.equal(full["w"], torch.arange(24, dtype=torch.float32).view(6, 4) + 7)
    assert torch.equal(full["b"], torch.full((2,), 7.0))


@pytest.mark.multirank
def test_torchrun_fsdp2_training_resumes_from_its_local_tier(tmp_path: Path) -> None:
    """launch/train.py (FSDP2) under torchrun with --local-dir: a second job resumes from the nodes' local copies."""
    import re
    import subprocess

    from tests.launch_util import REPO, _communicate, _env

    def job(steps: int) -> str:
        args = ["--ckpt", str(tmp_path / "ckpt"), "--local-dir", str(tmp_path / "local-{rank}"), "--verbose"]
        proc = subprocess.Popen(
            ["bash", str(REPO / "launch" / "torchrun.sh"), *args, "--steps", str(steps), "--every", "4"],
            env=_env({"PYTHON": sys.executable, "NPROC": "2"}), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
            text=True, start_new_session=True,
        )  # fmt: skip
        rcs, out = _communicate([proc], timeout=240)
        assert rcs == [0], out[-6000:]
        return out

    saved = dict(re.findall(r"^saved step=(\d+) digest=(\w+)$", job(8), re.M))
    out = job(12)
    assert re.findall(r"^resumed step=(\d+) digest=(\w+)$", out, re.M) == [("8", saved["8"])], out[-4000:]
    for r in range(2):
        assert f"rank {r}: resumed from {tmp_path / f'local-{r}' / step_name(8) / f'rank-{r}-of-2'}" in out, out[-4000:]
    for step in (8, 12):
        tddist.load(tmp_path / "ckpt" / step_name(step), shard=None, verify=True)  # promoted whole
    assert parts(tmp_path / "local-1") == [f"{step_name(12)}/rank-1-of-2"]


def preempted_rank(rank: int, work: Path) -> None:
    """(forked rank) Train until rank 1 signals itself (SIGUSR1); exit EXIT_PREEMPTED after the final save."""
    _init(work, "preempt", rank)
    mgr = _manager(work, every=100, preempt_signal="USR1")
    state = local_state(rank, 2, 0)
    for s in range(mgr.restore(state), 50):
        train(state)
        if rank == 1 and s == 3:
            os.kill(os.getpid(), signal.SIGUSR1)
        mgr.step(s + 1, state)
        if mgr.should_stop:
            _report(work, f"preempt{rank}", {"step": s + 1})
            sys.exit(EXIT_PREEMPTED)


def test_preemption_saves_locally_and_waits_for_the_promotion(tmp_path: Path) -> None:
    ch.warm_up()
    codes = run_ranks(preempted_rank, tmp_path)
    assert codes == {0: EXIT_PREEMPTED, 1: EXIT_PREEMPTED}, codes
    steps = [json.loads((tmp_path / f"preempt{r}.json").read_text())["step"] for r in range(2)]
    assert steps == [4, 4]
    assert_td_equal(tddist.load(tmp_path / "shared" / step_name(4), shard=None, verify=True), expected(4), "step 4")
    for r in range(2):
        assert parts(tmp_path / f"node-{r}") == [f"{step_name(4)}/rank-{r}-of-2"]
