"""What a save returns: its own rows mapped straight from its data file when it wrote every leaf, the general
read-back otherwise; the manifest sent with the decision only to ranks that read it; the manifest's files
created beside rank 0's write."""

from __future__ import annotations

import os
from unittest.mock import Mock

import pytest
import torch
from tensordict import TensorDict

import tddist
from tddist.saving import committing
from tddist.storage import directory
from tests.helpers import assert_td_equal


def rows_td(rank: int, rows: int = 3) -> TensorDict:
    """A state whose every tensor leaf is batched (so each rank writes all of its own): mixed dtypes, a nested
    node with two batch dims, an empty leaf and trailing dims."""
    base = torch.arange(rows * 4, dtype=torch.float32).reshape(rows, 4) + 100 * rank
    return TensorDict(
        {
            "w": base,
            "half": base.to(torch.bfloat16),
            "mask": (base.long() % 3 == 0),
            "ids": base.to(torch.int16),
            "cplx": torch.complex(base, -base).to(torch.complex64),
            "none": torch.zeros(rows, 0),
            "sub": TensorDict({"x": base.reshape(rows, 2, 2).to(torch.float64)}, [rows, 2]),
        },
        [rows],
    )


def counted(monkeypatch: pytest.MonkeyPatch, owner: object, name: str) -> Mock:
    """``owner.name`` replaced by a Mock that calls it and counts the calls (``call_count``)."""
    spy = Mock(wraps=getattr(owner, name))
    monkeypatch.setattr(owner, name, spy)
    return spy


def test_a_rank_that_wrote_every_leaf_returns_its_rows_without_reading_the_manifest(tmp_path, monkeypatch):
    """Two ranks save a state of batched leaves only, twice: each save returns exactly what
    load(shard="saved") returns, mapped from the rank's own data file; no rank reads the manifest back, and
    rank 0 pickles it for the others only in the communicator's first save (whose first round carries no
    word of who reads it)."""
    reads, shares = counted(monkeypatch, committing, "read_shard"), counted(monkeypatch, committing, "share")

    def job(comm):
        out = []
        for name, rows in (("first", 3), ("second", 2)):
            got = tddist.save(rows_td(comm.rank, rows), tmp_path / name, comm=comm)
            out.append((rows, got, tddist.load(tmp_path / name, shard="saved", comm=comm)))
        return out

    results = tddist.run_threads(2, job)
    for rank, result in enumerate(results):
        assert not isinstance(result, BaseException), result
        for rows, got, loaded in result:
            assert_td_equal(got, rows_td(rank, rows))
            assert_td_equal(got, loaded)
            assert got["sub"].batch_size == torch.Size([rows, 2])
            assert got["half"].dtype == torch.bfloat16 and got["none"].shape == (rows, 0)
    assert (reads.call_count, shares.call_count) == (0, 1)


def test_returned_rows_are_a_copy_on_write_map_of_the_committed_file(tmp_path):
    """Writing into what save returned changes neither the checkpoint nor the caller's state."""
    td = rows_td(0)
    out = tddist.save(td, tmp_path / "ckpt")
    out["w"].add_(1)
    assert_td_equal(tddist.load(tmp_path / "ckpt", verify=True), td)
    assert torch.equal(td["w"], rows_td(0)["w"])


def test_a_rank_holding_another_ranks_replica_reads_the_manifest_rank_0_sent(tmp_path, monkeypatch):
    """With a replicated leaf rank 0 writes alone, rank 1 reads back through the manifest rank 0 shared with
    the decision (one pickled copy per save), rank 0 maps its own rows; both return what a load returns."""
    reads, shares = counted(monkeypatch, committing, "read_shard"), counted(monkeypatch, committing, "share")
    target = tmp_path / "ckpt"

    def job(comm):
        td = TensorDict({"rows": rows_td(comm.rank), "step": torch.tensor(11)}, [])
        first = tddist.save(td, target, comm=comm)
        second = tddist.save(td, target, comm=comm)  # the one-round path
        return td, first, second

    results = tddist.run_threads(2, job)
    for result in results:
        assert not isinstance(result, BaseException), result
        td, first, second = result
        assert_td_equal(first, td)
        assert_td_equal(second, td)
    assert (reads.call_count, shares.call_count) == (2, 2)


def test_a_failed_creation_of_the_manifest_files_aborts_the_save_on_every_rank(tmp_path, monkeypatch):
    """The manifest's files are created on a helper thread while rank 0 writes: when that fails, every rank
    raises the same error, the previous checkpoint stays, and no staging area is left behind."""
    target = tmp_path / "ckpt"
    tddist.run_threads(2, lambda comm: tddist.save(rows_td(comm.rank), target, comm=comm))

    def fail(staging: str) -> tuple[int, int]:
        raise OSError(28, "No space left on device", os.path.join(staging, "tddist.json"))

    monkeypatch.setattr(directory, "_create_manifest_files", fail)
    results = tddist.run_threads(2, lambda comm: tddist.save(rows_td(comm.rank, rows=5), target, comm=comm))
    assert all(isinstance(r, tddist.TddistError) for r in results), results
    assert {str(r) for r in results} == {str(results[0])} and "No space left on device" in str(results[0])
    assert sorted(os.listdir(tmp_path)) == ["ckpt"]
    loaded = tddist.load(target, shard=None, verify=True)
    assert loaded.batch_size == torch.Size([6])  # the two ranks' 3 rows each, from before


def test_each_rank_maps_its_rows_while_rank_0_decides(tmp_path, monkeypatch):
    """Every rank maps its rows once it has voted, inside the commit (before the decision reaches it), not
    after it; the read-back after the decision maps nothing again."""
    events: list[tuple[str, int]] = []
    real_map, real_commit = committing.map_own_rows, committing.two_phase_commit

    def mapping(files, rank, shard):
        events.append(("map", rank))
        return real_map(files, rank, shard)

    def committing_(comm, *args, **kwargs):
        try:
            return real_commit(comm, *args, **kwargs)
        finally:
            events.append(("decided", comm.rank))

    monkeypatch.setattr(committing, "map_own_rows", mapping)
    monkeypatch.setattr(committing, "two_phase_commit", committing_)

    def job(comm):
        got = [tddist.save(rows_td(comm.rank), tmp_path / f"s{i}", comm=comm) for i in range(2)]
        return got, tddist.load(tmp_path / "s1", shard="saved", comm=comm)

    results = tddist.run_threads(2, job)
    for rank, result in enumerate(results):
        assert not isinstance(result, BaseException), result
        got, loaded = result
        for td in got:
            assert_td_equal(td, rows_td(rank))
        assert_td_equal(got[1], loaded)
        mine = [kind for kind, r in events if r == rank]
        assert mine == ["map", "decided"] * 2, mine


def test_an_aborted_save_drops_the_rows_it_mapped_and_leaves_nothing(tmp_path):
    """Rank 0 refuses the save after every rank mapped its rows (``require_finite`` with a NaN): every rank
    raises the same error, the previous checkpoint stays whole and no staging area is left."""
    target = tmp_path / "ckpt"
    tddist.run_threads(2, lambda comm: tddist.save(rows_td(comm.rank), target, comm=comm))

    def job(comm):
        td = rows_td(comm.rank, rows=5)
        if comm.rank == 1:
            td["w"][0, 0] = float("nan")
        return tddist.save(td, target, comm=comm, require_finite=True)

    results = tddist.run_threads(2, job)
    assert all(isinstance(r, tddist.NonFiniteError) for r in results), results
    assert str(results[0]) == str(results[1])
    assert sorted(os.listdir(tmp_path)) == ["ckpt"]
    loaded = tddist.load(target, shard=None, verify=True)
    assert loaded.batch_size == torch.Size([6])


def test_a_failed_map_while_waiting_is_retried_after_the_decision(tmp_path, monkeypatch):
    """A map that fails while rank 0 decides is not the save's error: the read-back after the decision maps
    the rows again and returns them."""
    calls: list[int] = []
    real_map = committing.map_own_rows

    def flaky(files, rank, shard):
        calls.append(rank)
        if calls.count(rank) == 1:
            raise OSError(24, "Too many open files")
        return real_map(files, rank, shard)

    monkeypatch.setattr(committing, "map_own_rows", flaky)
    results = tddist.run_threads(2, lambda comm: tddist.save(rows_td(comm.rank), tmp_path / "ckpt", comm=comm))
    for rank, result in enumerate(results):
        assert not isinstance(result, BaseException), result
        assert_td_equal(result, rows_td(rank))
    assert sorted(calls) == [0, 0, 1, 1]
