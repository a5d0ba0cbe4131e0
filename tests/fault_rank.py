"""Rank program of the fault-injection tests (``tests/test_faults.py``).

Started by ``launch_util.run_job("spawn", ...)``: one independent process per
rank with torchrun's environment variables, so a killed rank does not take the
others down and every rank's exit code is seen.

Whether a save writes a checkpoint directory or one archive file follows
from its target's name (``ckpt`` or ``ckpt.tdz``), as in ``tddist.save``, so
every unit serves both layouts unchanged.

``python tests/fault_rank.py MODE CONFIG_JSON``, modes:

``batch``
    ``{"waves": [[unit, ...], ...]}``. Importing torch and tddist costs
    seconds per process, and a SIGKILL case ends its processes, so each unit
    runs in a *forked* child of this (already imported) rank process: the two
    ranks' children of a unit form a fresh 2-rank gloo job of their own
    (rendezvous through a file store in the report directory), are really
    killed, and their exit statuses are collected with ``waitpid``. The units
    of a wave run at the same time (a case that mostly waits, such as a hang,
    shares a wave with busy ones), the waves one after the other. A unit is

    * ``{"kind": "save", "name", "target", "old", "fault", "timeout", "deadline"}``:
      with ``old``, commit the "old" data to the target collectively first;
      otherwise warm the communicator up with one collective, so the fault
      strikes a save whose private gloo group exists. Then set
      ``TDDIST_FAULT=fault`` (as a user would) and save the "new" data once
      with ``timeout`` through the communicator tddist detects.
    * ``{"kind": "matrix", "name", "cases": [{"name", "point", "rank", "target", "old", "timeout"}], "deadline"}``:
      many "raise" cases in one child, injected with ``tddist._faults.inject``;
      each outcome also lists the leftovers beside the target once every rank is done.
      Each case runs on a fresh private gloo group: an exception between two
      collectives can leave one rank a collective behind the other on the
      group it used, and that must not leak into the next case.

    The parent is the watchdog of its children: it SIGKILLs a unit's child
    that the unit made hang (a ``hang`` fault on its rank) once the peer's
    child of that unit has reported, any other child only at the unit's
    ``deadline`` (its timeout plus a margin, counted from the start of its
    wave), and records that it did.

    Every child also has the fault point ``reserve`` (see ``reserve_point``).

``die_before_save``
    ``{"target", "timeout"}``: both ranks initialise torch.distributed from
    the environment (rank 0 hosts the TCP store), then rank 0 SIGKILLs itself
    while rank 1 calls ``save`` (its first: tddist creates its private gloo
    group inside it).

The data helpers ``shard`` and ``expected`` are shared with the test module.
A rank or child exits 0 when it ran its program to the end (what the save
did, returned or raised, is in its report) and 3 when the program itself broke.
"""

from __future__ import annotations

import contextlib
import datetime
import json
import os
import signal
import sys
import threading
import time
import traceback
from pathlib import Path

if __name__ == "__main__":  # run as a script: make ``tests.launch_util`` importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch
from tensordict import TensorDict

from tests.helpers import assert_td_equal, leftovers

#: Rows each rank saves, per version. The versions differ in shape and in
#: values, so a mix of both (a partial checkpoint) can never pass for either.
ROWS = {"old": (2, 2), "new": (3, 2)}
BASE = {"old": 1000, "new": 5000}


def shard(version: str, rank: int) -> TensorDict:
    """What ``rank`` saves for ``version``: its rows of ``data`` (sharded) and ``step`` (replicated)."""
    rows = ROWS[version]
    start, n = sum(rows[:rank]), rows[rank]
    base = BASE[version]
    ids = torch.arange(start, start + n)
    data = TensorDict(x=(base + ids[:, None] * 10 + torch.arange(3)[None, :]).float(), y=ids + base, batch_size=[n])
    return TensorDict(data=data, step=torch.tensor(base), batch_size=[])


def expected(version: str) -> TensorDict:
    """The global TensorDict that a complete checkpoint of ``version`` holds."""
    parts = [shard(version, r) for r in range(len(ROWS[version]))]
    return TensorDict(data=torch.cat([p["data"] for p in parts], 0), step=parts[0]["step"], batch_size=[])


def outcome_of(fn) -> dict:
    """Run ``fn``; describe whether it returned or what it raised, and how long it took."""
    t0 = time.monotonic()
    try:
        fn()
    except BaseException as e:
        return {
            "result": "raised",
            "cls": type(e).__name__,
            "mro": [c.__name__ for c in type(e).__mro__],
            "msg": str(e),
            "failures": sorted(getattr(e, "failures", None) or {}),
            "elapsed": time.monotonic() - t0,
            "traceback": traceback.format_exc()[-4000:],
        }
    return {"result": "ok", "elapsed": time.monotonic() - t0}


def save_version(version: str, target: str, rank: int, **kw) -> None:
    """Save ``version``'s shard of this rank and check what ``save`` returns."""
    import tddist

    out = tddist.save(shard(version, rank), target, metadata={"version": version}, **kw)
    assert_td_equal(out, shard(version, rank), f"rank {rank}: what save returned")


#: The reservation (the first round of an archive save, ``ArchiveWriter.plan``) has no fault
#: point of the library's own: ``reserve_point`` adds this one, from the test side.
RESERVE = "reserve"


@contextlib.contextmanager
def reserve_point():
    """While active, every rank passes the fault point ``RESERVE`` in the reservation round.

    ``ArchiveWriter.plan`` is the rank's part of that round, run just before
    its plan (with the region's size) is gathered; the wrapper calls the
    library's own ``fault_point`` once the size is known, so ``TDDIST_FAULT``
    and ``inject`` reach it like any other point.
    """
    from tddist._faults import fault_point
    from tddist.storage.archive import ArchiveWriter

    plan = ArchiveWriter.plan

    def with_point(self):
        planned = plan(self)
        fault_point(RESERVE, self.rank)
        return planned

    ArchiveWriter.plan = with_point
    try:
        yield
    finally:
        ArchiveWriter.plan = plan


# --- what a forked child runs ------------------------------------------------------------


def unit_save(rank: int, unit: dict) -> dict:
    import tddist.comm.resolve

    timeout = float(unit["timeout"])
    if unit["old"]:
        save_version("old", unit["target"], rank, timeout=timeout)
    else:
        tddist.comm.resolve.resolve(None, timeout).barrier()  # creates the group that save(timeout=) reuses
    os.environ["TDDIST_FAULT"] = unit["fault"]
    return outcome_of(lambda: save_version("new", unit["target"], rank, timeout=timeout))


def unit_matrix(rank: int, unit: dict) -> dict:
    import torch.distributed as dist

    from tddist._faults import inject
    from tddist.comm.gloo import TorchComm

    keep = []  # past cases' groups stay alive: a peer may still be blocked on one
    results = {}
    for case in unit["cases"]:
        dist.barrier()  # on the default group, which tddist never uses here
        timeout = float(case["timeout"])
        group = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=timeout))
        keep.append(group)
        comm = TorchComm(group, timeout)
        if case["old"]:
            save_version("old", case["target"], rank, comm=comm)
        with inject(case["point"], case["rank"], "raise"):
            out = outcome_of(lambda: save_version("new", case["target"], rank, comm=comm))
        dist.barrier()  # every rank is done with this save
        out["leftovers"] = leftovers(case["target"])
        results[case["name"]] = out
    return results


def unit_signal(rank: int, unit: dict) -> dict:
    """A peer stopped (SIGSTOP) or killed while it joins the job (``connect``: before its first save, so
    the survivor waits in group creation, or in the rendezvous when tddist initialises torch.distributed
    itself), or at the commit's ``write`` point; the survivor's save must end in a ``CommError`` in time."""
    timeout = float(unit["timeout"])
    victim, sig = int(unit["victim"]), str(unit["signal"])
    if unit.get("init") != "tddist":
        import torch.distributed as dist

        dist.barrier()  # both ranks are in the user's group before one of them leaves
    if unit["phase"] == "connect" and rank == victim:
        os.kill(os.getpid(), signal.SIGSTOP if sig == "stop" else signal.SIGKILL)
    if unit["phase"] == "write":
        os.environ["TDDIST_FAULT"] = f"write:{victim}:{sig}"
    return outcome_of(lambda: save_version("new", unit["target"], rank, timeout=timeout))


UNITS = {"save": unit_save, "matrix": unit_matrix, "signal": unit_signal}


def _child(rank: int, unit: dict, report_dir: Path) -> int:
    import torch.distributed as dist

    own = report_dir / f"{unit['name']}.rank{rank}.json"
    try:
        if unit.get("init") == "tddist":  # tddist initialises torch.distributed from the environment; rank 0 hosts
            os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE="2", MASTER_PORT=str(unit["port"]))
        else:
            store = report_dir / f"{unit['name']}.store"
            timeout = datetime.timedelta(seconds=float(unit.get("init_timeout", unit.get("timeout", 120))))
            dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2, timeout=timeout)
        outcome = UNITS[unit["kind"]](rank, unit)
        code, report = 0, {"status": "ok", "outcome": outcome}
    except BaseException:
        code, report = 3, {"status": "error", "error": traceback.format_exc()}
    tmp = own.with_suffix(".tmp")
    tmp.write_text(json.dumps(report, default=str))
    tmp.replace(own)
    return code


def start_unit(rank: int, unit: dict, report_dir: Path) -> int:
    """Fork the child that runs ``unit``; its pid."""
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid == 0:
        code = 3
        try:
            code = _child(rank, unit, report_dir)
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(code)
    return pid


def made_to_hang(unit: dict, rank: int) -> bool:
    """True if ``unit`` makes ``rank`` hang or stop (its child then never ends on its own)."""
    if unit.get("kind") == "signal":
        return unit["signal"] == "stop" and int(unit["victim"]) == rank
    return any(f.split(":")[1:] == [str(rank), "hang"] for f in filter(None, unit.get("fault", "").split(",")))


def overdue(unit: dict, rank: int, since: float, peer_seen: float | None, now: float) -> str | None:
    """Why the watchdog kills the child of ``unit`` now (started at ``since``), or None.

    A child that the unit makes hang is killed as soon as its peer has reported (the
    peer's outcome is what the unit tests); any other child only when it overran the
    unit's deadline (its save timeout plus a margin): a no-hang bound, never a race.
    """
    if peer_seen is not None and made_to_hang(unit, rank):
        return "still running after the peer reported (this rank was made to hang)"
    if now - since > float(unit["deadline"]):
        return f"still running after the unit's {unit['deadline']}s deadline"
    return None


def run_wave(rank: int, units: list[dict], report_dir: Path) -> dict:
    """Run ``units`` at once, each in a forked child, and watch them all until every one ended.

    Per unit: what the child reported, how it ended, whether the watchdog killed it.
    """
    t0 = time.monotonic()
    running = {u["name"]: (u, start_unit(rank, u, report_dir)) for u in units}
    peer_seen: dict[str, float] = {}
    ended = {}
    while running:
        now = time.monotonic()
        for name, (unit, pid) in list(running.items()):
            done, status = os.waitpid(pid, os.WNOHANG)
            watchdog = None
            if not done:
                if name not in peer_seen and (report_dir / f"{name}.rank{1 - rank}.json").exists():
                    peer_seen[name] = now
                watchdog = overdue(unit, rank, t0, peer_seen.get(name), now)
                if watchdog is None:
                    continue
                os.kill(pid, signal.SIGKILL)
                _, status = os.waitpid(pid, 0)
            own = report_dir / f"{name}.rank{rank}.json"
            ended[name] = {
                "exit": os.waitstatus_to_exitcode(status),
                "watchdog": watchdog,
                "seconds": time.monotonic() - t0,
                "report": json.loads(own.read_text()) if own.exists() else None,
            }
            del running[name]
        time.sleep(0.02)
    return ended


# --- modes ---------------------------------------------------------------------------------------


def run_batch(rank: int, cfg: dict, report_dir: Path) -> dict:

    results = {}
    with reserve_point():
        for wave in cfg["waves"]:
            results.update(run_wave(rank, wave, report_dir))
    return results


def run_die_before_save(rank: int, cfg: dict, report_dir: Path) -> dict:
    import torch.distributed as dist

    timeout = float(cfg["timeout"])
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=timeout))
    dist.barrier()
    if rank == 0:
        os.kill(os.getpid(), signal.SIGKILL)
    return outcome_of(lambda: save_version("new", cfg["target"], rank, timeout=timeout))


def run_stopped_before_save(rank: int, cfg: dict, report_dir: Path) -> dict:
    """Under torchrun (its agent hosts the store), torch.distributed initialised as a training script does it
    (torch's default timeout): rank 0 stops (SIGSTOP) just as its first save begins, before tddist's gloo
    group exists; rank 1 saves, reports, then kills the stopped rank 0."""
    pid_file = report_dir / "rank0.pid"
    if "PMI_RANK" in os.environ:  # under mpiexec, as an MPI program does; tddist then uses a Dup of COMM_WORLD
        from mpi4py import MPI

        MPI.COMM_WORLD.Barrier()
    else:
        import torch.distributed as dist

        dist.init_process_group("gloo")
        dist.barrier()
    if rank == 0:
        pid_file.write_text(str(os.getpid()))
        threading.Timer(float(cfg["stop_after"]), os.kill, (os.getpid(), signal.SIGSTOP)).start()
        save_version("new", cfg["target"], rank, timeout=float(cfg["timeout"]))
        time.sleep(3600)  # rank 1 kills this process
    outcome = outcome_of(lambda: save_version("new", cfg["target"], rank, timeout=float(cfg["timeout"])))
    from tests.launch_util import write_report

    write_report(rank, "ok", outcome=outcome)  # before the peer's death can end this job
    stopped = int(pid_file.read_text())
    os.kill(stopped, signal.SIGKILL)
    _wait_until_dead(stopped)
    return outcome


def _wait_until_dead(pid: int, seconds: float = 10.0) -> None:
    """Return once ``pid`` is gone or a zombie: exiting (0) before the launcher saw the peer die let mpiexec
    sometimes report the job as a success."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        try:
            with open(f"/proc/{pid}/stat") as f:
                if f.read().rsplit(")", 1)[1].split()[0] in ("Z", "X"):
                    return
        except FileNotFoundError:
            return
        time.sleep(0.01)


MODES = {"batch": run_batch, "die_before_save": run_die_before_save, "stopped_before_save": run_stopped_before_save}


def main() -> int:
    from tests.launch_util import write_report

    rank = int(os.environ.get("RANK", os.environ.get("PMI_RANK", "-1")))
    report_dir = Path(os.environ["TDDIST_REPORT_DIR"])
    try:
        mode, cfg = sys.argv[1], json.loads(sys.argv[2])
        write_report(rank, "ok", outcome=MODES[mode](rank, cfg, report_dir))
    except BaseException:
        write_report(rank, "error", error=traceback.format_exc())
        return 3
    return 0


if __name__ == "__main__":
    code = main()
    sys.stdout.flush()
    sys.stderr.flush()
    # Skip interpreter teardown: destroying gloo groups whose peer died or
    # hangs can block, and the outcome is already reported.
    os._exit(code)
