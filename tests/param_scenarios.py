"""Scenarios for save's tensordict-style parameters, run on every rank of a job.

Each function takes ``(comm, work, rank, size)``: ``comm`` is passed as
``comm=`` (None lets tddist detect it), ``work`` is a directory shared by all
ranks. They run on in-process thread ranks (tests/test_parameters.py) and
inside the real torchrun/mpiexec jobs of tests/async_rank.py.
"""

from __future__ import annotations

from pathlib import Path

import torch
from tensordict import NonTensorData, NonTensorStack, TensorDict

import tddist
from tddist import _faults
from tddist import format as fmt
from tests.helpers import leftovers


def _rows(rank: int) -> int:
    return 2 + rank


def _td(rank: int, offset: float = 0.0) -> TensorDict:
    n = _rows(rank)
    return TensorDict(x=torch.arange(n * 3, dtype=torch.float32).view(n, 3) + 100 * rank + offset, batch_size=[n])


def _expect_error(cls, fn, *needles: str):
    try:
        fn()
    except cls as e:
        for n in needles:
            assert n in str(e), f"{n!r} not in error message: {e}"
        return e
    raise AssertionError(f"{cls.__name__} was not raised")


def scenario_copy_existing(comm, work: Path, rank: int, size: int) -> None:
    """A leaf mapped from a checkpoint file needs copy_existing=True, also when saving over that very checkpoint."""
    target = work / "copy"
    loaded = tddist.save(_td(rank), target, comm=comm)
    _expect_error(
        tddist.InvalidDataError,
        lambda: tddist.save(loaded, work / "copy-other", comm=comm),
        "copy_existing=True",
    )
    assert not (work / "copy-other").exists()
    again = tddist.load(target, comm=comm, shard="saved")
    again["x"].add_(1.0)  # copy-on-write: the file keeps the old values
    out = tddist.save(again, target, comm=comm, copy_existing=True)  # replaces the checkpoint it reads from
    assert torch.equal(out["x"], _td(rank)["x"] + 1.0)
    assert torch.equal(tddist.load(target, comm=comm, shard="saved", verify=True)["x"], _td(rank)["x"] + 1.0)


def scenario_non_tensor(comm, work: Path, rank: int, size: int) -> None:
    """Replicated non-tensor values are stored once, per-rank ones keep their rank, stacks are sharded."""
    td = _td(rank)
    td["same"] = NonTensorData({"lr": 0.1, "tags": ["a", "b"]})
    td.set_non_tensor("mine", f"rank-{rank}")
    td["per_row"] = NonTensorStack.from_list([f"{rank}:{i}" for i in range(_rows(rank))])
    out = tddist.save(td, work / "objects", comm=comm, layout="memmap")
    assert out["same"] == {"lr": 0.1, "tags": ["a", "b"]}
    assert out["mine"] == f"rank-{rank}"
    assert out.get("per_row").tolist() == [f"{rank}:{i}" for i in range(_rows(rank))]
    m = tddist.read_manifest(work / "objects")
    assert m.objects[("same",)].placement == "replicate" and len(m.objects[("same",)].values) == 1
    assert m.objects[("mine",)].placement == ("per_rank" if size > 1 else "replicate")
    full = tddist.load(work / "objects", shard=None)
    assert full["mine"] == ([f"rank-{r}" for r in range(size)] if size > 1 else "rank-0")
    assert full.get("per_row").tolist() == [f"{r}:{i}" for r in range(size) for i in range(_rows(r))]
    even = tddist.load(work / "objects", comm=comm, shard="even")
    assert len(even.get("per_row").tolist()) == even.batch_size[0]
    # with layout="memmap", each rank directory still opens with tensordict alone, with that rank's values
    plain = TensorDict.load_memmap(work / "objects" / fmt.rank_dir(rank))
    assert plain["mine"] == f"rank-{rank}"


def scenario_pickle_opt_in(comm, work: Path, rank: int, size: int) -> None:
    """Objects JSON cannot hold need allow_pickle=True on save, and again on load."""
    td = _td(rank)
    td.set_non_tensor("obj", (1, 2, rank))  # a tuple would come back a list from JSON
    _expect_error(tddist.InvalidDataError, lambda: tddist.save(td, work / "pickled", comm=comm), "allow_pickle=True")
    assert not (work / "pickled").exists()
    tddist.save(td, work / "pickled", comm=comm, allow_pickle=True)
    _expect_error(tddist.InvalidArgumentError, lambda: tddist.load(work / "pickled", shard=None), "allow_pickle=True")
    back = tddist.load(work / "pickled", comm=comm, shard="saved", allow_pickle=True)
    assert back["obj"] == (1, 2, rank)


def scenario_share_non_tensor(comm, work: Path, rank: int, size: int) -> None:
    """share_non_tensor=True returns non-tensor values in shared memory, as tensordict does."""
    td = _td(rank)
    td.set_non_tensor("count", 7)
    out = tddist.save(td, work / "shared", comm=comm, share_non_tensor=True)
    leaf = out.get("count")
    assert type(leaf._non_tensordict["data"]).__name__ in ("Synchronized", "SynchronizedBase") or hasattr(
        leaf._non_tensordict["data"], "value"
    ), type(leaf._non_tensordict["data"])
    assert out["count"] == 7


def scenario_robust_key(comm, work: Path, rank: int, size: int) -> None:
    """robust_key=False keeps plain names verbatim and refuses unsafe ones; True encodes anything."""
    plain = TensorDict({"plain_key": torch.ones(2)}, [2])
    tddist.save(plain, work / "verbatim", comm=comm, robust_key=False, layout="memmap")
    assert (work / "verbatim" / fmt.rank_dir(rank) / "plain_key.memmap").exists()
    unsafe = TensorDict({"a/b": torch.ones(2), "..": torch.zeros(2)}, [2])
    _expect_error(
        tddist.InvalidDataError, lambda: tddist.save(unsafe, work / "unsafe", comm=comm, robust_key=False), "robust_key"
    )
    assert not (work / "unsafe").exists()
    tddist.save(unsafe, work / "unsafe", comm=comm)
    back = tddist.load(work / "unsafe", comm=comm, shard="saved")
    assert set(back.keys()) == {"a/b", ".."}


def scenario_not_atomic(comm, work: Path, rank: int, size: int) -> None:
    """atomic=False writes in place; an interrupted save leaves a target that readers refuse, and saving again works."""
    target = work / "inplace"
    tddist.save(_td(rank), target, comm=comm, atomic=False)
    assert torch.equal(tddist.load(target, comm=comm, shard="saved")["x"], _td(rank)["x"])
    assert leftovers(target) == [], leftovers(target)
    with _faults.inject("write", size - 1, "raise"):
        _expect_error(tddist.errors.InjectedFault, lambda: tddist.save(_td(rank, 1.0), target, comm=comm, atomic=False))
    _expect_error(tddist.CheckpointNotFoundError, lambda: tddist.load(target, shard=None), "no manifest")
    tddist.save(_td(rank, 2.0), target, comm=comm, atomic=False)
    assert torch.equal(tddist.load(target, comm=comm, shard="saved")["x"], _td(rank, 2.0)["x"])


def scenario_prefix_none_and_threads(comm, work: Path, rank: int, size: int) -> None:
    """prefix=None is refused with an explanation; num_threads changes nothing in the result."""
    _expect_error(tddist.InvalidArgumentError, lambda: tddist.save(_td(rank), None, comm=comm), "prefix=None")
    big = TensorDict(x=torch.randn(3000 + rank, 300), batch_size=[3000 + rank])
    a = tddist.save(big, work / "t1", comm=comm, num_threads=1)
    b = tddist.save(big, work / "t4", comm=comm, num_threads=4)
    assert torch.equal(a["x"], big["x"]) and torch.equal(b["x"], big["x"])
    ma, mb = tddist.read_manifest(work / "t1"), tddist.read_manifest(work / "t4")
    assert [c.checksum for c in ma.leaves[("x",)].chunks] == [c.checksum for c in mb.leaves[("x",)].chunks]


def scenario_archive_matches_directory(comm, work: Path, rank: int, size: int) -> None:
    """One archive written by all ranks holds exactly what the directory holds, on any world size."""
    td = _td(rank)
    td.set_non_tensor("mine", f"rank-{rank}")
    tddist.save(td, work / "dir", comm=comm)
    out = tddist.save(td, work / "all.tdz", comm=comm, num_threads=2)
    assert torch.equal(out["x"], td["x"]) and out["mine"] == f"rank-{rank}"
    tddist.save(td, work / "packed.tdz", comm=comm, compression="deflate", num_threads=2)
    md, ma = tddist.read_manifest(work / "dir"), tddist.read_manifest(work / "all.tdz")
    assert ma.layout == "archive"
    assert [[c.checksum for c in leaf.chunks] for leaf in md.leaves.values()] == [
        [c.checksum for c in leaf.chunks] for leaf in ma.leaves.values()
    ]
    full = tddist.load(work / "dir", shard=None)
    for path in ("all.tdz", "packed.tdz"):
        assert torch.equal(tddist.load(work / path, shard=None, verify=True)["x"], full["x"])
        assert torch.equal(tddist.load(work / path, comm=comm)["x"], tddist.load(work / "dir", comm=comm)["x"])


SCENARIOS = [
    scenario_copy_existing,
    scenario_non_tensor,
    scenario_pickle_opt_in,
    scenario_share_non_tensor,
    scenario_robust_key,
    scenario_not_atomic,
    scenario_prefix_none_and_threads,
    scenario_archive_matches_directory,
]
