"""Checkpoints written by an earlier tddist (tests/golden/v1) must keep loading, bit for bit."""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import zipfile
from pathlib import Path

import pytest
import torch
from tensordict import TensorDict

import tddist
from tddist.sharding import even_split
from tests.helpers import assert_td_equal

GOLDEN = Path(__file__).resolve().parent / "golden"


def _load_recipe():
    spec = importlib.util.spec_from_file_location("tddist_golden_recipe", GOLDEN / "make_golden.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


recipe = _load_recipe()
V1 = GOLDEN / "v1"
SINGLE = V1 / recipe.SINGLE
MULTI = V1 / recipe.MULTI


def expected_multi_even(world: int, rank: int) -> TensorDict:
    """Rank ``rank`` of ``world``'s even share of checkpoint (b), computed from the recipe."""
    g = recipe.multi_rank_global()
    r0, r1 = even_split(sum(recipe.ROWS), world)[rank]
    c0, c1 = even_split(sum(recipe.COLS), world)[rank]
    return TensorDict(
        {
            "data": g["data"][r0:r1],
            "shared": TensorDict({"w": g["shared", "w"], "cols": g["shared", "cols"][:, c0:c1]}, []),
            "step": g["step"],
        },
        [],
    )


def _ok(results: list) -> list:
    errors = [r for r in results if isinstance(r, BaseException)]
    if errors:
        raise errors[0]
    return results


def test_golden_files_are_present_and_small():
    """Both golden checkpoints exist, are committed (manifest present) and stay well under 200 KB."""
    total = 0
    for target in (SINGLE, MULTI):
        assert (target / "tddist.json").is_file(), target
        for dirpath, _dirs, files in os.walk(target):
            total += sum(os.path.getsize(os.path.join(dirpath, f)) for f in files)
    assert 0 < total < 200_000


def test_single_rank_golden_loads_whole():
    """Checkpoint (a) loads whole, verified, equal to the recipe's values."""
    assert_td_equal(tddist.load(SINGLE, shard=None, verify=True), recipe.single_rank_td())


def test_single_rank_golden_manifest():
    """The manifest of (a) keeps its version, metadata, key escaping and placements."""
    m = tddist.read_manifest(SINGLE)
    assert m.version == 1 and m.world_size == 1 and m.robust_key is True
    assert m.metadata == recipe.SINGLE_METADATA
    assert m.nodes[("batch",)] == (4,) and m.nodes[("batch", "grid")] == (4, 2)
    assert m.leaves[("batch", "..", "x y")].placement == tddist.Shard(0)
    assert m.leaves[("step",)].placement == tddist.Replicate() and m.leaves[("step",)].shape == ()
    assert (SINGLE / "rank-00000" / "batch" / "%2E%2E" / "x%20y.memmap").is_file()
    assert (SINGLE / "rank-00000" / "batch" / "a%2Fb.memmap").is_file()


def test_single_rank_golden_keys_subset():
    """A subset of keys from (a) loads alone, with its nested batch sizes."""
    got = tddist.load(SINGLE, shard=None, keys=[("batch", "grid"), "step"], verify=True)
    expected = recipe.single_rank_td()
    assert torch.equal(got["batch", "grid", "c"], expected["batch", "grid", "c"])
    assert torch.equal(got["batch", "grid", "z"], expected["batch", "grid", "z"])
    assert got["batch", "grid"].batch_size == torch.Size([4, 2])
    assert got["step"].item() == expected["step"].item()
    assert set(got["batch"].keys()) == {"grid"}


@pytest.mark.parametrize("world", [1, 2, 4])
def test_single_rank_golden_even_on_thread_ranks(world):
    """(a) reshards on 1, 2 and 4 thread ranks: each gets its torch.tensor_split rows."""
    results = _ok(tddist.run_threads(world, lambda c: tddist.load(SINGLE, comm=c, shard="even", verify=True)))
    expected = recipe.single_rank_td()
    for rank, got in enumerate(results):
        a, b = even_split(4, world)[rank]
        assert_td_equal(
            got, TensorDict({"batch": expected["batch"][a:b], "step": expected["step"], "table": expected["table"]}, [])
        )


def test_multi_rank_golden_loads_whole():
    """Checkpoint (b) loads whole in one process, verified, equal to the recipe's global values."""
    assert_td_equal(tddist.load(MULTI, shard=None, verify=True), recipe.multi_rank_global())


def test_multi_rank_golden_manifest():
    """The manifest of (b) keeps world size, metadata, offsets in rank order and placements."""
    m = tddist.read_manifest(MULTI)
    assert m.version == 1 and m.world_size == recipe.WORLD
    assert m.metadata == recipe.MULTI_METADATA
    x = m.leaves[("data", "x")]
    assert x.placement == tddist.Shard(0) and x.shape == (5, 4)
    assert [c.box[0][0] for c in x.chunks] == [0, 3, 3] and [c.box[1][0] for c in x.chunks] == list(recipe.ROWS)
    cols = m.leaves[("shared", "cols")]
    assert cols.placement == tddist.Shard(1) and [c.box[1][1] for c in cols.chunks] == list(recipe.COLS)
    w = m.leaves[("shared", "w")]
    assert w.placement == tddist.Replicate() and [c.rank for c in w.chunks] == [0]
    assert not (MULTI / "rank-00001" / "shared" / "w.memmap").exists()  # replicas are written once


@pytest.mark.parametrize("world", [1, 2, 4])
def test_multi_rank_golden_even_on_thread_ranks(world):
    """(b), saved by 3 ranks, loads with shard='even' on 1, 2 and 4 thread ranks, verified."""
    results = _ok(tddist.run_threads(world, lambda c: tddist.load(MULTI, comm=c, shard="even", verify=True)))
    for rank, got in enumerate(results):
        assert_td_equal(got, expected_multi_even(world, rank))


def test_multi_rank_golden_saved_shards():
    """(b) loads with shard='saved' on its own world size: each rank gets exactly what it saved,
    the zero-row rank included."""
    results = _ok(tddist.run_threads(recipe.WORLD, lambda c: tddist.load(MULTI, comm=c, shard="saved", verify=True)))
    for rank, got in enumerate(results):
        assert_td_equal(got, recipe.multi_rank_shard(rank))
    assert results[1]["data"].batch_size == torch.Size([0])


def test_multi_rank_golden_rank_dirs_open_with_tensordict():
    """Each rank directory of (b) is a tensordict memmap holding what that rank wrote."""
    for rank in range(recipe.WORLD):
        td = TensorDict.load_memmap(MULTI / f"rank-{rank:05d}")
        mine = recipe.multi_rank_shard(rank)
        if rank != 0:  # only rank 0 writes the replicated leaves
            del mine["step"]
            del mine["shared", "w"]
        assert_td_equal(td, mine)


def test_recipe_still_writes_the_golden_files(tmp_path):
    """Writing the recipe today gives byte-identical data files and the same manifest fields
    (all but creation time and writer version): the writer has not drifted from format v1."""
    for name, write in recipe.BUILDERS.items():
        write(tmp_path / name)
        golden, fresh = V1 / name, tmp_path / name

        def files(root):
            if root.is_file():  # an archive: its entries
                with zipfile.ZipFile(root) as zf:
                    return {zi.filename: zf.read(zi) for zi in zf.infolist()}
            out = {}
            for dirpath, _dirs, names in os.walk(root):
                for n in names:
                    p = os.path.join(dirpath, n)
                    out[os.path.relpath(p, root)] = Path(p).read_bytes()
            return out

        g, f = files(golden), files(fresh)
        assert sorted(g) == sorted(f)
        for rel in g:
            if rel == "tddist.json":
                continue
            assert g[rel] == f[rel], rel
        mg, mf = json.loads(g["tddist.json"]), json.loads(f["tddist.json"])
        for field in set(mg) - {"created", "tddist_version"}:
            if field == "nodes":  # a writer may add fields to a node entry; these two must stay
                assert [(n["key"], n["batch_size"]) for n in mg[field]] == [
                    (n["key"], n["batch_size"]) for n in mf[field]
                ]
            else:
                assert mg[field] == mf[field], field


def test_loading_never_modifies_golden_files(tmp_path):
    """Loaded tensors are copy-on-write maps: modifying them leaves the golden files as they
    were; a copy of a golden checkpoint is an ordinary checkpoint that can be replaced."""
    before = {p: p.read_bytes() for root in (SINGLE, MULTI) for p in root.rglob("*") if p.is_file()}
    multi = tddist.load(MULTI, shard=None)
    multi["data", "x"].add_(1)
    multi["shared", "w"].zero_()
    single = tddist.load(SINGLE, shard="saved")
    single["batch", "obs"].fill_(7)
    single["step"].fill_(0)
    assert {p: p.read_bytes() for root in (SINGLE, MULTI) for p in root.rglob("*") if p.is_file()} == before
    assert_td_equal(tddist.load(MULTI, shard=None, verify=True), recipe.multi_rank_global())

    copy = tmp_path / "copy"
    shutil.copytree(MULTI, copy)
    assert_td_equal(tddist.load(copy, shard=None, verify=True), recipe.multi_rank_global())
    tddist.save(recipe.multi_rank_shard(0), copy)
    assert tddist.read_manifest(copy).world_size == 1
    assert_td_equal(tddist.load(copy, shard=None), recipe.multi_rank_shard(0))


# --- (c) non-tensor values, node rows, verbatim keys; (c') the same as an archive; (d) a DTensor ---

EXTENDED = V1 / recipe.EXTENDED
EXTENDED_ARCHIVE = V1 / recipe.EXTENDED_ARCHIVE
DTENSOR = V1 / recipe.DTENSOR


@pytest.mark.parametrize("path", [EXTENDED, EXTENDED_ARCHIVE], ids=["directory", "archive"])
def test_extended_golden_loads(path):
    shards = [recipe.extended_shard(r) for r in range(len(recipe.EXTENDED_ROWS))]
    full = tddist.load(path, shard=None, verify=True)
    assert torch.equal(full["v"], torch.cat([s["v"] for s in shards]))
    assert full["config"] == {"lr": 0.5, "betas": [0.9, 0.99], "name": "golden"}
    assert full["host"] == ["node-0", "node-1"]
    assert full.get("labels").tolist() == [f"row-{i}" for i in range(sum(recipe.EXTENDED_ROWS))]
    m = tddist.read_manifest(path)
    assert not m.robust_key and m.layout == ("archive" if path.suffix == ".tdz" else "directory")
    assert m.node_rows[("meta",)] == list(recipe.EXTENDED_ROWS)

    saved = _ok(tddist.run_threads(2, lambda c: tddist.load(path, comm=c, shard="saved"), timeout=60))
    for rank, got in enumerate(saved):
        assert torch.equal(got["v"], shards[rank]["v"]) and got["host"] == f"node-{rank}"
        assert got["meta"].batch_size == torch.Size([recipe.EXTENDED_ROWS[rank]])


def test_dtensor_golden_loads_whole_and_into_plain_tensors():
    assert tddist.read_manifest(DTENSOR).leaves[("w",)].placement == tddist.sharding.Boxes()
    assert torch.equal(tddist.load(DTENSOR, shard=None, verify=True)["w"], recipe.dtensor_global())
    target = {"w": torch.zeros(5, 3)}
    assert tddist.load(DTENSOR, into=target).ok
    assert torch.equal(target["w"], recipe.dtensor_global())
