"""Checkpoints written by earlier tddists (tests/golden/v1, v2, v3, v4) must keep loading, bit for bit.

Every load test runs on the golden checkpoints of every format version (the
same recipes wrote them, so the same expected values apply); what a version
stores differently is checked by version-specific tests below.
"""

from __future__ import annotations

import importlib.util
import json
import math
import os
import shutil
import struct
import zipfile
from pathlib import Path

import pytest
import torch
import xxhash
from tensordict import TensorDict

import tddist
from tddist.core.sharding import even_split, replica_writers
from tests.helpers import assert_td_equal

GOLDEN = Path(__file__).resolve().parent / "golden"


def _load_recipe():
    spec = importlib.util.spec_from_file_location("tddist_golden_recipe", GOLDEN / "make_golden.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


recipe = _load_recipe()
V1 = GOLDEN / "v1"
V2 = GOLDEN / "v2"
V3 = GOLDEN / "v3"
V4 = GOLDEN / "v4"
VERSIONS = {1: V1, 2: V2, 3: V3, 4: V4}
#: every golden checkpoint of each version (version 1 had no memmap packing to cover)
#: the recipes before version 4 (the incremental checkpoints are new in it)
BEFORE_V4 = [n for n in recipe.BUILDERS if n not in (recipe.INCREMENTAL_BASE, recipe.INCREMENTAL)]
CONTENTS = {
    1: [recipe.SINGLE, recipe.MULTI, recipe.EXTENDED, recipe.EXTENDED_ARCHIVE, recipe.DTENSOR],
    2: BEFORE_V4,
    3: [*BEFORE_V4, "per_rank"],  # per_rank: written and tested by tests/test_per_rank_golden.py
    4: [*recipe.BUILDERS, recipe.S3_INCREMENTAL],  # s3_incremental: objects, tested against the S3 server
}
#: the checkpoints of the single-rank data (a): each version's, and version 2's memmap packing
SINGLES = [
    V1 / recipe.SINGLE,
    V2 / recipe.SINGLE,
    V2 / recipe.SINGLE_MEMMAP,
    V3 / recipe.SINGLE,
    V3 / recipe.SINGLE_MEMMAP,
    V4 / recipe.SINGLE,
    V4 / recipe.SINGLE_MEMMAP,
]
SINGLE_IDS = ["v1", "v2", "v2-memmap", "v3", "v3-memmap", "v4", "v4-memmap"]
#: the three-rank checkpoint (b) of each version
MULTIS = [V1 / recipe.MULTI, V2 / recipe.MULTI, V3 / recipe.MULTI, V4 / recipe.MULTI]
MULTI_IDS = ["v1", "v2", "v3", "v4"]
#: version 2's checkpoints and their packing
V2_PACKING = {
    recipe.SINGLE: "packed",
    recipe.MULTI: "packed",
    recipe.EXTENDED: "packed",
    recipe.DTENSOR: "packed",
    recipe.SINGLE_MEMMAP: "memmap",
    recipe.EXTENDED_ARCHIVE: "memmap",
}


def version_of(path: Path) -> int:
    return next(v for v, root in VERSIONS.items() if path.parent == root)


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


def _files(root: Path) -> dict[str, bytes]:
    """Every file of a checkpoint by relative path; an archive's entries by name."""
    if root.is_file():
        with zipfile.ZipFile(root) as zf:
            return {zi.filename: zf.read(zi) for zi in zf.infolist()}
    out = {}
    for dirpath, _dirs, names in os.walk(root):
        for n in names:
            p = os.path.join(dirpath, n)
            out[os.path.relpath(p, root)] = Path(p).read_bytes()
    return out


@pytest.mark.parametrize("version", sorted(VERSIONS))
def test_golden_files_are_present_and_small(version):
    """Every golden checkpoint of the version exists, is committed (manifest present) and all
    together stay well under 200 KB."""
    root = VERSIONS[version]
    assert sorted(p.name for p in root.iterdir()) == sorted(CONTENTS[version])
    total = 0
    for name in CONTENTS[version]:
        target = root / name
        if target.is_file():
            with zipfile.ZipFile(target) as zf:
                assert "tddist.json" in zf.namelist(), target
            total += target.stat().st_size
            continue
        inside = [target / n for n in (recipe.INCREMENTAL_BASE, recipe.INCREMENTAL)]  # objects, by key
        for t in inside if name == recipe.S3_INCREMENTAL else [target]:
            assert (t / "tddist.json").is_file(), t
        for dirpath, _dirs, files in os.walk(target):
            total += sum(os.path.getsize(os.path.join(dirpath, f)) for f in files)
    assert 0 < total < 200_000


# --- (a) one rank: many dtypes, escaped keys ------------------------------------------


@pytest.mark.parametrize("path", SINGLES, ids=SINGLE_IDS)
def test_single_rank_golden_loads_whole(path):
    """Checkpoint (a) loads whole, verified, equal to the recipe's values."""
    assert_td_equal(tddist.load(path, shard=None, verify=True), recipe.single_rank_td())


@pytest.mark.parametrize("path", SINGLES, ids=SINGLE_IDS)
def test_single_rank_golden_manifest(path):
    """The manifest of (a) keeps its version, metadata, key escaping and placements."""
    m = tddist.read_manifest(path)
    assert m.version == version_of(path) and m.world_size == 1 and m.robust_key is True
    assert m.metadata == recipe.SINGLE_METADATA
    assert m.nodes[("batch",)] == (4,) and m.nodes[("batch", "grid")] == (4, 2)
    if m.version >= 2:  # version 1 lists rows only for nodes without sharded tensors; readers derive them
        assert m.node_rows == {("batch",): [4], ("batch", ".."): [4], ("batch", "grid"): [4]}
    assert m.leaves[("batch", "..", "x y")].placement == tddist.Shard(0)
    assert m.leaves[("batch", "empty")].shape == (4, 0)
    assert m.leaves[("step",)].placement == tddist.Replicate() and m.leaves[("step",)].shape == ()
    assert [c.rank for c in m.leaves[("step",)].chunks] == [0]


@pytest.mark.parametrize("path", [V1 / recipe.SINGLE, V2 / recipe.SINGLE_MEMMAP], ids=["v1", "v2-memmap"])
def test_single_rank_golden_leaf_files_have_escaped_names(path):
    """Version 1 and version 2's memmap packing: one file per leaf, named by the escaped key;
    a zero-element leaf has no file."""
    rank = path / "rank-00000"
    assert (rank / "batch" / "%2E%2E" / "x%20y.memmap").is_file()
    assert (rank / "batch" / "a%2Fb.memmap").is_file()
    assert (rank / "batch" / "%.memmap").is_file() and (rank / "batch" / "%2E.memmap").is_file()
    assert (rank / "batch" / "tab%09here.memmap").is_file() and (rank / "batch" / "%2E%2E" / "%25.memmap").is_file()
    assert not (rank / "batch" / "empty.memmap").exists()
    assert (rank / "step.memmap").stat().st_size == 8


@pytest.mark.parametrize("path", SINGLES, ids=SINGLE_IDS)
def test_single_rank_golden_keys_subset(path):
    """A subset of keys from (a) loads alone, with its nested batch sizes."""
    got = tddist.load(path, shard=None, keys=[("batch", "grid"), "step"], verify=True)
    expected = recipe.single_rank_td()
    assert torch.equal(got["batch", "grid", "c"], expected["batch", "grid", "c"])
    assert torch.equal(got["batch", "grid", "z"], expected["batch", "grid", "z"])
    assert got["batch", "grid"].batch_size == torch.Size([4, 2])
    assert got["step"].item() == expected["step"].item()
    assert set(got["batch"].keys()) == {"grid"}


@pytest.mark.parametrize("world", [1, 2, 4])
@pytest.mark.parametrize("path", SINGLES, ids=SINGLE_IDS)
def test_single_rank_golden_even_on_thread_ranks(path, world):
    """(a) reshards on 1, 2 and 4 thread ranks: each gets its torch.tensor_split rows."""
    results = _ok(tddist.run_threads(world, lambda c: tddist.load(path, comm=c, shard="even", verify=True)))
    expected = recipe.single_rank_td()
    for rank, got in enumerate(results):
        a, b = even_split(4, world)[rank]
        assert_td_equal(
            got, TensorDict({"batch": expected["batch"][a:b], "step": expected["step"], "table": expected["table"]}, [])
        )


# --- (b) three ranks: uneven rows, a rank without rows, columns along dim 1 -----------


@pytest.mark.parametrize("path", MULTIS, ids=MULTI_IDS)
def test_multi_rank_golden_loads_whole(path):
    """Checkpoint (b) loads whole in one process, verified, equal to the recipe's global values."""
    assert_td_equal(tddist.load(path, shard=None, verify=True), recipe.multi_rank_global())


@pytest.mark.parametrize("path", MULTIS, ids=MULTI_IDS)
def test_multi_rank_golden_manifest(path):
    """The manifest of (b) keeps world size, metadata, offsets in rank order and placements."""
    m = tddist.read_manifest(path)
    assert m.version == version_of(path) and m.world_size == recipe.WORLD
    assert m.metadata == recipe.MULTI_METADATA
    if m.version >= 2:
        assert m.node_rows == {("data",): list(recipe.ROWS), ("data", "sub"): list(recipe.ROWS)}
    x = m.leaves[("data", "x")]
    assert x.placement == tddist.Shard(0) and x.shape == (5, 4)
    assert [c.box[0][0] for c in x.chunks] == [0, 3, 3] and [c.box[1][0] for c in x.chunks] == list(recipe.ROWS)
    assert [c.nbytes for c in x.chunks] == [48, 0, 32]
    cols = m.leaves[("shared", "cols")]
    assert cols.placement == tddist.Shard(1) and cols.shape == (3, 6)
    assert [c.box[1][1] for c in cols.chunks] == list(recipe.COLS)
    w = m.leaves[("shared", "w")]
    assert w.placement == tddist.Replicate() and [c.rank for c in w.chunks] == [0]


def test_multi_rank_golden_v1_leaf_files():
    """Version 1: one file per leaf and rank; replicas are written once, by rank 0."""
    assert (V1 / recipe.MULTI / "rank-00000" / "shared" / "w.memmap").is_file()
    assert not (V1 / recipe.MULTI / "rank-00001" / "shared" / "w.memmap").exists()
    assert not (V1 / recipe.MULTI / "rank-00001" / "data" / "x.memmap").exists()  # no rows, no file
    assert not (V1 / recipe.MULTI / "tddist.idx").exists()


@pytest.mark.parametrize("world", [1, 2, 4])
@pytest.mark.parametrize("path", MULTIS, ids=MULTI_IDS)
def test_multi_rank_golden_even_on_thread_ranks(path, world):
    """(b), saved by 3 ranks, loads with shard='even' on 1, 2 and 4 thread ranks, verified."""
    results = _ok(tddist.run_threads(world, lambda c: tddist.load(path, comm=c, shard="even", verify=True)))
    for rank, got in enumerate(results):
        assert_td_equal(got, expected_multi_even(world, rank))


@pytest.mark.parametrize("path", MULTIS, ids=MULTI_IDS)
def test_multi_rank_golden_saved_shards(path):
    """(b) loads with shard='saved' on its own world size: each rank gets exactly what it saved,
    the zero-row rank included."""
    results = _ok(tddist.run_threads(recipe.WORLD, lambda c: tddist.load(path, comm=c, shard="saved", verify=True)))
    for rank, got in enumerate(results):
        assert_td_equal(got, recipe.multi_rank_shard(rank))
    assert results[1]["data"].batch_size == torch.Size([0])


def test_multi_rank_golden_v1_rank_dirs_open_with_tensordict():
    """Each rank directory of version 1's (b) is a tensordict memmap holding what that rank wrote."""
    for rank in range(recipe.WORLD):
        td = TensorDict.load_memmap(V1 / recipe.MULTI / f"rank-{rank:05d}")
        mine = recipe.multi_rank_shard(rank)
        if rank != 0:  # only rank 0 writes the replicated leaves
            del mine["step"]
            del mine["shared", "w"]
        assert_td_equal(td, mine)


def test_single_rank_golden_v2_memmap_rank_dir_opens_with_tensordict():
    """Version 2 with packing "memmap": the rank directory is a tensordict memmap of what the rank wrote."""
    td = TensorDict.load_memmap(V2 / recipe.SINGLE_MEMMAP / "rank-00000")
    assert_td_equal(td, recipe.single_rank_td())


# --- version 2: the index, the packing, the data files ---------------------------------


@pytest.mark.parametrize("version", [2, 3])
@pytest.mark.parametrize("name", sorted(V2_PACKING))
def test_v2_golden_index_and_packing(name, version):
    """Every version-2 checkpoint has a tddist.idx whose size and xxh3 checksum the JSON gives,
    and the packing it was written with: "packed" (one data file per rank, no rank directory)
    by default, "memmap" (rank directories) for layout="memmap" and for the archive, whose
    index entry comes before the manifest entry."""
    path = VERSIONS[version] / name
    files = _files(path)
    manifest = json.loads(files["tddist.json"])
    assert manifest["version"] == version and manifest["packing"] == V2_PACKING[name]
    index = files["tddist.idx"]
    assert manifest["index"] == {"size": len(index), "checksum": xxhash.xxh3_64_hexdigest(index)}
    m = tddist.read_manifest(path)
    assert m.version == version and m.packing == V2_PACKING[name]
    data_files = sorted(f for f in files if f.endswith(".data"))
    rank_dirs = sorted({f.split("/")[0] for f in files if "/" in f})
    ranks = [f"rank-{r:05d}" for r in range(m.world_size)]
    if V2_PACKING[name] == "packed":
        assert data_files == [r + ".data" for r in ranks] and rank_dirs == []
        assert sorted(files) == sorted(["tddist.json", "tddist.idx", *data_files])
    else:
        assert data_files == [] and rank_dirs == ranks
    if path.is_file():
        with zipfile.ZipFile(path) as zf:
            names = [zi.filename for zi in sorted(zf.infolist(), key=lambda zi: zi.header_offset)]
        assert m.layout == "archive" and names[-2:] == ["tddist.idx", "tddist.json"]


def test_v2_golden_three_ranks_json_members():
    """(b) in version 2: leaves under a batched node take its rows ("rows": "node"), a leaf
    sharded along dim 1 has its own ("own"), replicated leaves name their writer; the JSON lists
    no chunk and no node rows (they are in the index)."""
    obj = json.loads((V2 / recipe.MULTI / "tddist.json").read_bytes())
    leaves = {tuple(e["key"]): e for e in obj["leaves"]}
    assert leaves[("data", "x")]["rows"] == "node" and leaves[("data", "sub", "z")]["rows"] == "node"
    assert leaves[("shared", "cols")]["rows"] == "own"
    assert leaves[("shared", "w")]["writer"] == 0 and leaves[("step",)]["writer"] == 0
    assert all("chunks" not in e for e in obj["leaves"]) and all("rows" not in n for n in obj["nodes"])
    # node rows (data, data/sub), cols' own columns, one checksum per chunk (3 + 3 + 3 + 1 + 3 + 1)
    assert obj["index"]["size"] == 8 * (3 * 2 + 3 + 14)


def _checksum(data: bytes) -> str:
    """docs/format.md's checksum, computed here without tddist."""
    block = 32 * 1024 * 1024
    digests = [xxhash.xxh3_64_intdigest(data[i : i + block]) for i in range(0, len(data), block)]
    return xxhash.xxh3_64_hexdigest(b"".join(d.to_bytes(8, "big") for d in digests))


@pytest.mark.parametrize("version", [2, 3])
@pytest.mark.parametrize("name", [n for n, p in V2_PACKING.items() if p == "packed"])
def test_v2_golden_packed_data_files(name, version):
    """Each rank's data file holds its chunks in leaf order, each at the next multiple of 64
    bytes, zero-padded, and ends at the last chunk's padded end: the offsets follow from the
    chunk sizes alone (computed here from the specification, not by tddist)."""
    _packed_chunks(VERSIONS[version] / name)


def _packed_chunks(path: Path) -> dict[tuple, bytes]:
    """Every chunk of the packed checkpoint at ``path`` by (leaf, box), read at the offsets docs/format.md
    derives from the chunk sizes, after checking each file's padding, size and the chunks' checksums."""
    m = tddist.read_manifest(path)
    out = {}
    for rank in range(m.world_size):
        data = (path / f"rank-{rank:05d}.data").read_bytes()
        offset = 0
        for leaf in m.leaves.values():
            chunk = leaf.chunk_of_rank(rank)
            if chunk is None or chunk.nbytes == 0:
                continue
            padded = -(-chunk.nbytes // 64) * 64
            assert _checksum(data[offset : offset + chunk.nbytes]) == chunk.checksum, (path.name, rank, leaf.key)
            assert data[offset + chunk.nbytes : offset + padded] == bytes(padded - chunk.nbytes)
            out[(leaf.key, chunk.box)] = data[offset : offset + chunk.nbytes]
            offset += padded
        assert len(data) == offset, (path.name, rank)
    return out


def test_recipe_still_writes_the_golden_files(tmp_path):
    """Writing the recipe today gives byte-identical data files and index, and the same manifest
    (all but creation time, writer version and the manifest's checksum, which covers them): the writer has
    not drifted from format version 4."""
    for name, write in recipe.BUILDERS.items():
        write(tmp_path / name)
        golden, fresh = V4 / name, tmp_path / name
        g, f = _files(golden), _files(fresh)
        assert sorted(g) == sorted(f), name
        mg, mf = json.loads(g["tddist.json"]), json.loads(f["tddist.json"])
        for field in ("created", "tddist_version", "manifest_checksum"):
            del mg[field], mf[field]
        for h in mg.get("holders", []) + mf.get("holders", []):  # the holder's generation covers its time
            del h["generation"]
        moved = _moved_replicas(mg, mf)
        assert mg == mf, name
        for rel in g:
            if rel == "tddist.json" or (moved and rel.endswith(".data")):
                continue
            assert g[rel] == f[rel], (name, rel)
        if moved:  # the same chunks, bit for bit, in the files of their new writers, laid out as specified
            assert _packed_chunks(fresh) == _packed_chunks(golden), name
        if golden.is_file():  # the archive's entries in the same order
            with zipfile.ZipFile(golden) as zg, zipfile.ZipFile(fresh) as zf:
                assert [zi.filename for zi in zg.infolist()] == [zi.filename for zi in zf.infolist()]


def _moved_replicas(golden: dict, fresh: dict) -> bool:
    """Whether ``fresh`` names other writers for replicated leaves than ``golden``, whose writer (tddist
    0.1.0) gave them all to rank 0. The writer now shares them out by size (``sharding.replica_writers``);
    ``fresh``'s writers must be those, and are set back to ``golden``'s so the rest can be compared."""
    world = fresh["world_size"]
    replicated = [e for e in fresh["leaves"] if e["placement"]["type"] == "replicate"]
    sizes = {tuple(e["key"]): math.prod(e["shape"]) * getattr(torch, e["dtype"]).itemsize for e in replicated}
    assert {tuple(e["key"]): e["writer"] for e in replicated} == replica_writers(sizes, world)
    before = {tuple(e["key"]): e["writer"] for e in golden["leaves"] if e["placement"]["type"] == "replicate"}
    if before == replica_writers(sizes, world):  # written by a tddist that already shared them out (version 4)
        return False
    assert set(before.values()) <= {0}
    for e in replicated:
        e["writer"] = before[tuple(e["key"])]
    return any(replica_writers(sizes, world).values())


@pytest.mark.parametrize("version", sorted(VERSIONS))
def test_loading_never_modifies_golden_files(version, tmp_path):
    """Loaded tensors are copy-on-write maps: modifying them leaves the golden files as they
    were; a copy of a golden checkpoint is an ordinary checkpoint that can be replaced."""
    root = VERSIONS[version]
    multi_path = root / recipe.MULTI
    singles = [p for p in SINGLES if p.parent == root]
    before = {p: p.read_bytes() for r in (multi_path, *singles) for p in r.rglob("*") if p.is_file()}
    multi = tddist.load(multi_path, shard=None)
    multi["data", "x"].add_(1)
    multi["shared", "w"].zero_()
    for path in singles:
        single = tddist.load(path, shard="saved")
        single["batch", "obs"].fill_(7)
        single["step"].fill_(0)
    assert {p: p.read_bytes() for r in (multi_path, *singles) for p in r.rglob("*") if p.is_file()} == before
    assert_td_equal(tddist.load(multi_path, shard=None, verify=True), recipe.multi_rank_global())
    for path in singles:
        assert_td_equal(tddist.load(path, shard=None, verify=True), recipe.single_rank_td())

    copy = tmp_path / "copy"
    shutil.copytree(multi_path, copy)
    assert_td_equal(tddist.load(copy, shard=None, verify=True), recipe.multi_rank_global())
    tddist.save(recipe.multi_rank_shard(0), copy)
    assert tddist.read_manifest(copy).world_size == 1
    assert_td_equal(tddist.load(copy, shard=None), recipe.multi_rank_shard(0))


# --- (c) non-tensor values, node rows, verbatim keys; (c') the same as an archive; (d) a DTensor ---

EXTENDED = [V / name for V in (V1, V2, V3, V4) for name in (recipe.EXTENDED, recipe.EXTENDED_ARCHIVE)]
EXTENDED_IDS = [f"v{v}-{kind}" for v in (1, 2, 3, 4) for kind in ("directory", "archive")]
DTENSORS = [V1 / recipe.DTENSOR, V2 / recipe.DTENSOR, V3 / recipe.DTENSOR, V4 / recipe.DTENSOR]


@pytest.mark.parametrize("path", EXTENDED, ids=EXTENDED_IDS)
def test_extended_golden_loads(path):
    shards = [recipe.extended_shard(r) for r in range(len(recipe.EXTENDED_ROWS))]
    full = tddist.load(path, shard=None, verify=True)
    assert torch.equal(full["v"], torch.cat([s["v"] for s in shards]))
    assert full["config"] == {"lr": 0.5, "betas": [0.9, 0.99], "name": "golden"}
    assert full["host"] == ["node-0", "node-1"]
    assert full.get("labels").tolist() == [f"row-{i}" for i in range(sum(recipe.EXTENDED_ROWS))]
    m = tddist.read_manifest(path)
    assert m.version == version_of(path)
    assert not m.robust_key and m.layout == ("archive" if path.suffix == ".tdz" else "directory")
    assert m.node_rows[("meta",)] == list(recipe.EXTENDED_ROWS)

    saved = _ok(tddist.run_threads(2, lambda c: tddist.load(path, comm=c, shard="saved"), timeout=60))
    for rank, got in enumerate(saved):
        assert torch.equal(got["v"], shards[rank]["v"]) and got["host"] == f"node-{rank}"
        assert got["labels"].tolist() == shards[rank]["labels"].tolist()
        assert got["meta"].batch_size == torch.Size([recipe.EXTENDED_ROWS[rank]])


@pytest.mark.parametrize("path", DTENSORS, ids=MULTI_IDS)
def test_dtensor_golden_loads_whole_and_into_plain_tensors(path):
    m = tddist.read_manifest(path)
    assert m.version == version_of(path) and m.leaves[("w",)].placement == tddist.core.sharding.Boxes()
    assert [(c.rank, c.box) for c in m.leaves[("w",)].chunks] == [(0, ((0, 0), (5, 3)))]
    assert torch.equal(tddist.load(path, shard=None, verify=True)["w"], recipe.dtensor_global())
    target = {"w": torch.zeros(5, 3)}
    assert tddist.load(path, into=target).ok
    assert torch.equal(target["w"], recipe.dtensor_global())


# --- version 3: the manifest's own checksum -----------------------------------------------------


@pytest.mark.parametrize("name", sorted(recipe.BUILDERS))
def test_v3_golden_manifest_checksum(name):
    """Version 3's (and 4's) tddist.json begins with its own checksum: xxh3-64 of the manifest without that
    member (computed here from the specification, not by tddist); versions 1 and 2 carry none."""
    for root in (V3, V4):
        if not (root / name).exists():  # a recipe new in version 4
            continue
        raw = _files(root / name)["tddist.json"]
        prefix = b'{"manifest_checksum":"'
        assert raw.startswith(prefix) and raw[len(prefix) + 16 : len(prefix) + 18] == b'",'
        digest = raw[len(prefix) : len(prefix) + 16].decode()
        assert xxhash.xxh3_64_hexdigest(b"{" + raw[len(prefix) + 18 :]) == digest
    for old in (V1, V2):
        if (old / name).exists():
            assert b"manifest_checksum" not in _files(old / name)["tddist.json"]


# --- version 4: counts of non-finite values, sparse, and each rank's largest finite magnitude --------------


def _expected_counts(t: torch.Tensor) -> tuple[int, int, float]:
    """NaN count, Inf count and largest finite magnitude of ``t``, by torch (complex: each component)."""
    v = torch.view_as_real(t) if t.is_complex() else t
    v = v.to(torch.float64)
    finite = v[torch.isfinite(v)]
    return int(torch.isnan(v).sum()), int(torch.isinf(v).sum()), float(finite.abs().max()) if finite.numel() else 0.0


def _sections_5_and_6(path: Path) -> tuple[set, dict, list[tuple[float, int]]]:
    """The counted leaves (``"finite_stats": true``), each leaf's non-finite chunks (chunk index, NaN, Inf) from
    the index's section 5, and each rank's (largest finite magnitude, leaf position) from its section 6, read as
    docs/format.md section 5.4 lays them out (not through tddist's parser)."""
    files = _files(path)
    obj = json.loads(files["tddist.json"])
    index = files["tddist.idx"]
    world = obj["world_size"]
    counted = {tuple(e["key"]) for e in obj["leaves"] if e.get("finite_stats")}
    sparse = [e for e in obj["leaves"] if e.get("non_finite_chunks")]
    assert obj["rank_magnitudes"] is True
    pos = len(index) - 8 * (sum(3 * e["non_finite_chunks"] for e in sparse) + 2 * world)
    chunks = {}
    for e in sparse:
        k = e["non_finite_chunks"]
        at, nan, inf = (struct.unpack_from(f"<{k}q", index, pos + 8 * k * j) for j in range(3))
        pos += 24 * k
        chunks[tuple(e["key"])] = list(zip(at, nan, inf))
    values = struct.unpack_from(f"<{world}d", index, pos)
    leaves = struct.unpack_from(f"<{world}q", index, pos + 8 * world)
    return counted, chunks, list(zip(values, leaves))


@pytest.mark.parametrize("name", [recipe.SINGLE, recipe.SINGLE_MEMMAP, recipe.EXTENDED_ARCHIVE])
def test_v4_golden_counts_non_finite_values(name):
    """Every floating leaf of a version-4 golden checkpoint is counted; only the chunks that hold NaN or Inf
    are listed, with the recipe's counts (checkpoint (a) holds one NaN and one -Inf in batch/obs), and the
    rank's largest finite magnitude is that of the recipe's values, in the leaf named; older versions count
    nothing."""
    path = V4 / name
    counted, chunks, ranks = _sections_5_and_6(path)
    whole = tddist.load(path, shard=None, verify=True)
    floating = {k for k, v in whole.items(True, True) if isinstance(v, torch.Tensor) and v.is_floating_point()}
    floating |= {k for k, v in whole.items(True, True) if isinstance(v, torch.Tensor) and v.is_complex()}
    assert {tuple(k) if isinstance(k, tuple) else (k,) for k in floating} == counted
    expected = {key: _expected_counts(whole[key]) for key in counted}
    assert {k: (sum(c[1] for c in v), sum(c[2] for c in v)) for k, v in chunks.items()} == {
        k: (nan, inf) for k, (nan, inf, _top) in expected.items() if nan or inf
    }
    value, at = max(ranks)  # the largest of the ranks' (each rank's own is checked on three_ranks below)
    obj = json.loads(_files(path)["tddist.json"])
    assert value == max(top for _n, _i, top in expected.values())
    assert expected[tuple(obj["leaves"][at]["key"])][2] == value
    m = tddist.read_manifest(path)
    if name != recipe.EXTENDED_ARCHIVE:
        assert [(b.key, b.nan, b.inf) for b in m.non_finite()] == [(("batch", "obs"), 1, 1)]
    assert not m.uncounted() and m.largest_magnitude().value == value
    assert all(leaf.stats is None for leaf in tddist.read_manifest(V3 / name).leaves.values())
    assert tddist.read_manifest(V3 / name).largest is None


def test_v4_golden_three_ranks_records_each_ranks_largest_magnitude():
    """Clean: no chunk listed; each rank's largest finite magnitude is the largest among the chunks it stored
    (rank 1's sharded chunks are empty; replicated leaves count on their writer only)."""
    m = tddist.read_manifest(V4 / recipe.MULTI)
    g = recipe.multi_rank_global()
    top = [0.0] * m.world_size
    for key, leaf in m.leaves.items():
        if leaf.stats is None:
            continue
        assert leaf.stats.finite
        for c in leaf.chunks:
            offsets, sizes = c.box
            piece = g[key][tuple(slice(o, o + z) for o, z in zip(offsets, sizes))]
            if piece.numel():
                top[c.rank] = max(top[c.rank], _expected_counts(piece)[2])
    assert m.largest.values.tolist() == pytest.approx(top)
    g_top = {key: _expected_counts(g[key])[2] for key in m.leaves if m.leaves[key].stats is not None}
    for rank, at in enumerate(m.largest.leaves.tolist()):
        assert (at == -1) == (top[rank] == 0.0), rank
        assert at == -1 or g_top[list(m.leaves)[at]] >= top[rank], rank  # a leaf that holds that magnitude
    assert not m.non_finite()


# --- (e) and (e'): an incremental checkpoint and the checkpoint that holds its unchanged chunks -------------


def expected_incremental(step: int) -> TensorDict:
    parts = [recipe.incremental_shard(r, step) for r in range(len(recipe.INCREMENTAL_ROWS))]
    out = parts[0].clone()
    out["frozen"] = torch.cat([p["frozen"] for p in parts])
    return out


def test_v4_golden_incremental_references_its_base_and_loads_through_it():
    """(e') holds only the adapter; its other chunks are (e)'s, named by (e)'s generation; loads whole, on the
    ranks that saved it and resharded, verified, read them from (e)."""
    base, inc = V4 / recipe.INCREMENTAL_BASE, V4 / recipe.INCREMENTAL
    mb, mi = tddist.read_manifest(base), tddist.read_manifest(inc)
    assert mb.holders is None
    assert [(h.name, h.generation) for h in mi.referenced()] == [
        (recipe.INCREMENTAL_BASE, json.loads((base / "tddist.json").read_text())["manifest_checksum"])
    ]
    held = {k: leaf.refs.holders.tolist() for k, leaf in mi.leaves.items()}
    assert held == {("frozen", "w"): [1, 1], ("embed",): [1], ("adapter",): [0]}
    assert_td_equal(tddist.load(inc, shard=None, verify=True), expected_incremental(2))
    assert_td_equal(tddist.load(base, shard=None, verify=True), expected_incremental(1))
    for world in (1, 2, 3):
        for got in _ok(tddist.run_threads(world, lambda c: tddist.load(inc, comm=c, shard=None, verify=True))):
            assert_td_equal(got, expected_incremental(2))


def upload_golden_objects(client, bucket: str, root: Path) -> str:
    """Upload the golden objects under ``root`` (files named by their keys) under ``bucket`` ("BUCKET/PREFIX");
    each manifest's metadata names the one generation beside it. Returns the prefix as an ``s3://`` URL."""
    name, prefix = bucket.split("/")
    for f in sorted(p for p in root.rglob("*") if p.is_file()):
        rel = f.relative_to(root).as_posix()
        extra = {}
        if f.name == "tddist.json":
            (gen,) = [d.name for d in f.parent.iterdir() if d.is_dir()]
            extra = {"Metadata": {"tddist-generation": gen}}
        client.put_object(Bucket=name, Key=f"{prefix}/{rel}", Body=f.read_bytes(), **extra)
    return f"s3://{bucket}"


def test_v4_golden_s3_incremental_loads_through_its_holder(s3):
    """(e) and (e') as saved to object storage (docs/format.md 13.3): (e')'s data objects keep only the chunks it
    holds (the adapter: 64 bytes on rank 0, none on rank 1, where section 2.3 gives 192 and 128), so its
    offsets are those of the kept chunks; loads whole, resharded and on the saving ranks, verified, read the
    other chunks from (e) at its offsets of section 2.3."""
    from tddist.tools.verify import verify

    client, bucket = s3
    root = V4 / recipe.S3_INCREMENTAL
    sizes = {p.name: p.stat().st_size for p in (root / recipe.INCREMENTAL).rglob("rank-*.data")}
    assert sizes == {"rank-00000.data": 64, "rank-00001.data": 0}
    url = upload_golden_objects(client, bucket, root)
    base, inc = f"{url}/{recipe.INCREMENTAL_BASE}", f"{url}/{recipe.INCREMENTAL}"
    mi = tddist.read_manifest(inc)
    assert [h.name for h in mi.referenced()] == [recipe.INCREMENTAL_BASE]
    assert {k: leaf.refs.holders.tolist() for k, leaf in mi.leaves.items()} == {
        ("frozen", "w"): [1, 1],
        ("embed",): [1],
        ("adapter",): [0],
    }
    assert_td_equal(tddist.load(inc, shard=None, verify=True), expected_incremental(2))
    assert_td_equal(tddist.load(base, shard=None, verify=True), expected_incremental(1))
    for world in (2, 3):
        for got in _ok(tddist.run_threads(world, lambda c: tddist.load(inc, comm=c, shard=None, verify=True))):
            assert_td_equal(got, expected_incremental(2))
    assert verify(inc).ok
