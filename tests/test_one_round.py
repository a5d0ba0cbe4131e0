"""The commit's one-round path on real files: what step 1 checked is still checked, and nothing is left behind.

After the first save on a communicator, an atomic directory save skips the
first round (docs/format.md, section 8, "one round"): every rank creates the
staging directory itself and rank 0 checks the plans, the structures and the
target only once the votes are in. These tests make the second save of thread
ranks go wrong in each of those ways and check that every rank raises the
same error, that the target is untouched and that no staging entry is left;
and that a good save makes two collectives.
"""

from __future__ import annotations

import os
import signal
from pathlib import Path
from typing import Any

import pytest
import torch
from tensordict import NonTensorData, TensorDict

import tddist
from tddist._faults import inject
from tddist._fs import fsync_together
from tddist.comm.threads import ThreadComm


def shard(rank: int, extra: bool = False) -> TensorDict:
    td = TensorDict(x=torch.arange(4.0).reshape(2, 2) + 10 * rank, batch_size=[2])
    if extra:
        td["only_here"] = torch.zeros(2)
    return td


def side_entries(parent: Path) -> list[str]:
    """Staging, backup and trash entries in ``parent``."""
    return sorted(n for n in os.listdir(parent) if ".tddist-" in n)


class Counting:
    """A communicator that counts the collectives it runs (and passes them on)."""

    def __init__(self, comm: ThreadComm) -> None:
        self.inner, self.rank, self.size, self.calls = comm, comm.rank, comm.size, 0

    def __getattr__(self, name: str) -> Any:
        op = getattr(self.inner, name)

        def counted(*args: Any, **kwargs: Any) -> Any:
            self.calls += 1
            return op(*args, **kwargs)

        return counted


def two_saves(tmp_path: Path, second, size: int = 3) -> list[Any]:
    """Every rank saves once to ``tmp_path/first`` (the first round runs), then calls ``second(comm)``; each
    rank's result of the second (its value or the error)."""

    def rank_fn(comm: ThreadComm) -> Any:
        tddist.save(shard(comm.rank), str(tmp_path / "first"), comm=comm)
        try:
            return second(comm)
        except tddist.TddistError as e:
            return e

    return tddist.run_threads(size, rank_fn, timeout=60)


def test_later_saves_make_two_collectives_and_load_back(tmp_path: Path) -> None:
    """From the second save on, a save is the votes and the decision; every save is complete, into new
    nested directories too."""

    def rank_fn(comm: ThreadComm) -> list[int]:
        counting = Counting(comm)
        calls = []
        for step in range(4):
            before = counting.calls
            target = tmp_path / "runs" / f"step-{step}" / "ckpt"
            tddist.save(shard(comm.rank) + step, str(target), comm=counting)
            calls.append(counting.calls - before)
        return calls

    calls = tddist.run_threads(3, rank_fn, timeout=60)
    assert all(c[0] == 4 and c[1:] == [2, 2, 2] for c in calls), calls
    for step in range(4):
        got = tddist.load(str(tmp_path / "runs" / f"step-{step}" / "ckpt"), verify=True)
        want = torch.cat([shard(r)["x"] + step for r in range(3)])
        assert torch.equal(got["x"], want)
        assert side_entries(tmp_path / "runs" / f"step-{step}") == []


def test_a_foreign_target_is_refused_and_left_untouched(tmp_path: Path) -> None:
    foreign = tmp_path / "notes"
    foreign.mkdir()
    (foreign / "todo.txt").write_text("keep me")
    results = two_saves(tmp_path, lambda c: tddist.save(shard(c.rank), str(foreign), comm=c))
    for r, res in enumerate(results):
        assert isinstance(res, tddist.TargetError) and "not a tddist checkpoint" in str(res), (r, res)
    assert os.listdir(foreign) == ["todo.txt"] and (foreign / "todo.txt").read_text() == "keep me"
    assert side_entries(tmp_path) == []


def test_ranks_that_disagree_on_the_target_leave_nothing(tmp_path: Path) -> None:
    results = two_saves(tmp_path, lambda c: tddist.save(shard(c.rank), str(tmp_path / f"t{c.rank % 2}"), comm=c))
    for r, res in enumerate(results):
        assert isinstance(res, tddist.InvalidArgumentError) and "disagree on the save's target" in str(res), (r, res)
    assert not (tmp_path / "t0").exists() and not (tmp_path / "t1").exists()
    assert side_entries(tmp_path) == []


def test_a_rank_whose_structure_differs_names_the_difference_everywhere(tmp_path: Path) -> None:
    def second(c: ThreadComm) -> Any:
        return tddist.save(shard(c.rank, extra=c.rank == 2), str(tmp_path / "second"), comm=c)

    results = two_saves(tmp_path, second)
    for r, res in enumerate(results):
        assert isinstance(res, tddist.ShardingError) and "only_here" in str(res) and "rank 2" in str(res), (r, res)
    assert not (tmp_path / "second").exists() and side_entries(tmp_path) == []


@pytest.mark.parametrize("point", ["prepare", "write", "validate", "manifest"])
def test_an_injected_failure_leaves_the_old_checkpoint(tmp_path: Path, point: str) -> None:
    """A failure before the commit point of a one-round save replacing a checkpoint: the old one stays,
    nothing is left beside it, and the next save (which runs the first round again) commits."""
    target = str(tmp_path / "first")

    def second(c: ThreadComm) -> Any:
        with inject(point, 0, "raise"):
            try:
                tddist.save(shard(c.rank) + 100, target, comm=c)
            except tddist.TddistError as e:
                failed = e
        tddist.save(shard(c.rank) + 200, str(tmp_path / "third"), comm=c)
        return failed

    results = two_saves(tmp_path, second)
    for r, res in enumerate(results):
        assert isinstance(res, tddist.TddistError) and "injected failure" in str(res), (r, res)
    assert torch.equal(tddist.load(target, verify=True)["x"], torch.cat([shard(r)["x"] for r in range(3)]))
    assert torch.equal(
        tddist.load(str(tmp_path / "third"), verify=True)["x"], torch.cat([shard(r)["x"] + 200 for r in range(3)])
    )
    assert side_entries(tmp_path) == []


def test_fsyncs_issued_together_work_in_a_forked_child(tmp_path: Path) -> None:
    """The manifest's fsyncs run on a small thread pool; a child forked after the parent used it (the crash
    tests fork their ranks) gets a pool of its own instead of one without threads, which would wait forever."""
    files = [tmp_path / "a", tmp_path / "b"]
    for f in files:
        f.write_bytes(b"x")
    paths = [str(f) for f in files] + [str(tmp_path)]
    fsync_together(paths)
    pid = os.fork()
    if pid == 0:  # pragma: no cover  # the child
        signal.alarm(20)
        fsync_together(paths)
        os._exit(0)
    _, status = os.waitpid(pid, 0)
    assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0, f"the child ended with status {status}"


@pytest.mark.parametrize("leaves", [1, 400])
def test_each_rank_returns_what_a_load_of_its_shard_gives(tmp_path: Path, leaves: int) -> None:
    """A save's returned shard equals ``load(shard="saved")`` on every rank, with a manifest small enough to
    travel with the decision and with one too large (read from the checkpoint); its non-tensor values are
    the checkpoint's, not the caller's own objects."""
    from tddist.saving.committing import share

    def state(rank: int) -> TensorDict:
        td = TensorDict({f"w{i:03d}": torch.arange(3.0).reshape(1, 3) + 100 * i + rank for i in range(leaves)}, [1])
        td["notes"] = NonTensorData([rank, {"tag": "run"}], batch_size=[1])
        return td

    def rank_fn(comm: ThreadComm) -> tuple[TensorDict, TensorDict, TensorDict]:
        mine = state(comm.rank)
        tddist.save(mine, str(tmp_path / "first"), comm=comm)  # the next save takes the one-round path
        got = tddist.save(mine, str(tmp_path / "ckpt"), comm=comm)
        mine.get("notes").data.append("changed after the save")
        return mine, got, tddist.load(str(tmp_path / "ckpt"), shard="saved", comm=comm)

    results = tddist.run_threads(2, rank_fn, timeout=60)
    for rank, (mine, got, loaded) in enumerate(results):
        assert list(got.keys(True, True)) == list(loaded.keys(True, True))
        for key in loaded.keys(True, True):
            if key == "notes":
                assert got[key] == loaded[key] == [rank, {"tag": "run"}], (rank, got[key])
            else:
                assert torch.equal(got[key], loaded[key]) and type(got[key]) is type(loaded[key]), (rank, key)
        assert got.batch_size == loaded.batch_size
    shared = share(tddist.read_manifest(str(tmp_path / "ckpt")))
    assert (shared is not None) == (leaves == 1)
