"""The layout cache of ``prepare_shard`` (tddist/prepare.py): a save of the same structure reuses what the
last one derived (key checks, placements, writers, DTensor boxes), and any change of the structure, or of
what a layout depends on, derives it again. Values are checked at every save.
"""

from __future__ import annotations

import pytest
import torch
from tensordict import TensorDict

import tddist
from tddist import InvalidDataError, PerRank, Replicate, Shard
from tddist.comm.base import LocalComm
from tddist.core.types import LocalShard
from tddist.saving import background
from tddist.saving.prepare import PlacementCache, prepare_shard


def _prepare(data, cache: PlacementCache, *, rank: int = 0, world: int = 2, placements=None, allow_pickle=False):
    return prepare_shard(
        data, rank, world, None, placements=placements, robust_key=True, allow_pickle=allow_pickle,
        copy_existing=False, placement_cache=cache,
    )  # fmt: skip


def _state(n: int = 4, rows: int = 6) -> TensorDict:
    return TensorDict(
        {"model": {f"w{i}": torch.randn(rows, 3) for i in range(n)}, "step": torch.tensor(7), "note": "x"}, []
    )


def _layout_of(shard: LocalShard | Exception) -> list:
    assert isinstance(shard, LocalShard), shard
    return [(i.key, i.placement, i.writes, i.dtensor) for i in shard.items]


def test_the_same_structure_reuses_the_layout_and_gives_the_same_shard():
    cache = PlacementCache()
    fresh = _layout_of(_prepare(_state(), PlacementCache()))
    assert _layout_of(_prepare(_state(), cache)) == fresh and cache.hits == 0
    for expected_hits in (1, 2):  # new tensors, new values, the same structure
        assert _layout_of(_prepare(_state(), cache)) == fresh
        assert cache.hits == expected_hits


@pytest.mark.parametrize(
    "change",
    [
        lambda td: td.set(("model", "w9"), torch.zeros(6, 3)),  # a new leaf
        lambda td: td.set(("model", "w0"), torch.zeros(7, 3)),  # a new shape: another replica writer
        lambda td: td.set(("model", "w0"), torch.zeros(6, 3, dtype=torch.float64)),
        lambda td: td.set("note", torch.zeros(1)),  # a non-tensor value becomes a tensor
    ],
    ids=["key", "shape", "dtype", "kind"],
)
def test_a_changed_structure_derives_its_layout_again(change):
    cache = PlacementCache()
    _prepare(_state(), cache)
    changed = _state()
    change(changed)
    assert _layout_of(_prepare(changed, cache)) == _layout_of(_prepare(changed, PlacementCache()))
    assert cache.hits == 0


def test_placements_rank_and_world_are_part_of_the_signature():
    cache = PlacementCache()
    td = TensorDict({"a": torch.zeros(4, 2), "b": torch.zeros(4, 2)}, [])
    base = _layout_of(_prepare(td, cache))
    assert {p for _k, p, _w, _d in base} == {Replicate()}
    sharded = _layout_of(_prepare(td, cache, placements={"a": Shard(0)}))
    assert sharded[0][1] == Shard(0) and cache.hits == 0
    own = _layout_of(_prepare(td, cache, placements={"a": PerRank()}))
    assert own[0][1] == PerRank() and cache.hits == 0
    writers = {r: [w for _k, _p, w, _d in _layout_of(_prepare(td, cache, rank=r))] for r in (0, 1)}
    assert writers[0] != writers[1] and sorted(writers[0] + writers[1]) == [False, False, True, True]
    assert [w for *_x, w, _d in _layout_of(_prepare(td, cache, world=1))] == [True, True]
    assert _layout_of(_prepare(td, cache)) == base and cache.hits == 2  # rank 0 of 2, placements=None: kept


def test_values_are_still_checked_when_the_layout_is_reused(tmp_path):
    """A reused layout skips only what the structure decides: a leaf now memory-mapped from a file and a
    non-tensor value that needs pickle are refused as on the first save."""
    cache = PlacementCache()
    td = TensorDict({"w": torch.zeros(16), "meta": {"k": "text"}}, [])
    assert isinstance(_prepare(td, cache), LocalShard)
    path = tmp_path / "mapped.bin"
    path.write_bytes(bytes(64))
    mapped = TensorDict({"w": torch.from_file(str(path), shared=False, size=16), "meta": {"k": "text"}}, [])
    err = _prepare(mapped, cache)
    assert cache.hits == 1 and isinstance(err, InvalidDataError) and "memory-mapped" in str(err)
    unpicklable = TensorDict({"w": torch.zeros(16), "meta": {"k": object()}}, [])
    err = _prepare(unpicklable, cache)
    assert cache.hits == 2 and isinstance(err, InvalidDataError), err


def test_unhashable_placements_are_never_cached():
    """``placements=`` that cannot be compared (here a placement class without a hash) derive every time."""

    class Shard:  # named as torch's, so tddist takes it for torch.distributed.tensor.Shard
        __hash__ = None  # type: ignore[assignment]

        def __init__(self, dim: int) -> None:
            self.dim = dim

    cache = PlacementCache()
    td = TensorDict({"a": torch.zeros(4)}, [])
    for _ in range(2):
        assert _layout_of(_prepare(td, cache, placements={"a": Shard(0)}))[0][1] == tddist.Shard(0)
    assert cache.hits == 0


def test_saves_whose_structure_changes_on_one_channel_load_back_exactly(tmp_path):
    """End to end on one communicator: saves alternate between structures (the cache keeps several) and
    change one; every checkpoint loads back with its own keys, shapes and values."""
    comm = LocalComm()
    states = [
        TensorDict({"a": torch.arange(6.0), "b": {"c": torch.ones(2, 2)}}, []),
        TensorDict({"opt": torch.arange(3, dtype=torch.int64)}, []),
        TensorDict({"a": torch.arange(8.0), "b": {"c": torch.ones(2, 2)}}, []),  # a's shape changed
    ]
    for round_ in range(2):
        for i, td in enumerate(states):
            td = td.apply(lambda t: t + round_)
            target = tmp_path / f"ck-{round_}-{i}"
            fut = tddist.save(td, target, comm=comm, return_early=bool(i % 2))
            if i % 2:
                fut.result()
            loaded = tddist.load(target, comm=comm)
            assert set(loaded.keys(include_nested=True, leaves_only=True)) == set(
                td.keys(include_nested=True, leaves_only=True)
            )
            for k, v in td.items(include_nested=True, leaves_only=True):
                assert torch.equal(loaded[k], v), (round_, i, k)
    assert background.channel(comm).placements.hits >= 3
