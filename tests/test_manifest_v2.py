"""Version 2's files from hostile hands: tddist.json and tddist.idx (manifest_v2.py, manifest_io.py), and the
packed data files they describe (locate.py, the directory reader).

Every hostile checkpoint here is a real one, saved by ``tddist.save``, then tampered with: the JSON is edited,
the index is decoded with this file's own reading of docs/format.md (section 5.4), edited, encoded again, and
its size and checksum in the JSON recomputed, unless the test is about them. A control test shows that a
rewrite that changes nothing of substance still loads, so each refusal comes from the one thing a test breaks.
Every refusal must come from the manifest, before any data file is opened or any tensor allocated.

The round trips check that ``manifest_v2.encode(parse_manifest(...))`` gives back the files as written, and that
a version-1 manifest re-encoded as version 2 describes the same data.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import shutil
import zipfile
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch
import xxhash
from tensordict import NonTensorStack, TensorDict

import tddist
import tddist.loading.read
from tddist import CorruptCheckpointError, ManifestError
from tddist import format as fmt
from tddist.manifest.checksum import seal
from tddist.manifest.model import LargestMagnitude
from tddist.manifest.parse import parse_manifest
from tddist.manifest.v2 import encode
from tddist.tools.verify import verify as verify_checkpoint
from tests.helpers import assert_td_equal

GOLDEN = Path(__file__).resolve().parent / "golden"
_spec = importlib.util.spec_from_file_location("tddist_golden_recipe_v2", GOLDEN / "make_golden.py")
recipe = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(recipe)


# --- the index, read and written from the specification -----------------------------------------------------


def _batched_nodes(obj: dict) -> list[tuple]:
    return [tuple(n["key"]) for n in obj["nodes"] if n["batch_size"]]


def _chunk_count(leaf: dict, world: int) -> int:
    kind = leaf["placement"]["type"]
    return world if kind == "shard" else 1 if kind == "replicate" else leaf["chunks"]


def decode_index(obj: dict, data: bytes) -> dict:
    """The sections of ``data`` (docs/format.md): node rows, own rows, checksums, boxes, non-finite chunks and the
    ranks' largest magnitudes (version 4); each by key, in order."""
    world = obj["world_size"]
    pos = 0

    def take(dtype: str, n: int) -> list[int]:
        nonlocal pos
        out = np.frombuffer(data, dtype=dtype, count=n, offset=pos).tolist()
        pos += 8 * n
        return out

    sections: dict = {
        "node_rows": {k: take("<i8", world) for k in _batched_nodes(obj)},
        "own_rows": {
            tuple(e["key"]): take("<i8", world)
            for e in obj["leaves"]
            if e["placement"]["type"] == "shard" and e["rows"] == "own"
        },
        "checksums": {tuple(e["key"]): take("<u8", _chunk_count(e, world)) for e in obj["leaves"]},
        "boxes": {},
    }
    for e in obj["leaves"]:
        if e["placement"]["type"] == "boxes":
            n, d = e["chunks"], len(e["shape"])
            ranks, offsets, sizes = take("<i8", n), take("<i8", n * d), take("<i8", n * d)
            sections["boxes"][tuple(e["key"])] = (ranks, offsets, sizes)
    sections["non_finite"] = {}
    for e in obj["leaves"]:
        if obj["version"] >= 4 and e.get("non_finite_chunks"):
            k = e["non_finite_chunks"]
            sections["non_finite"][tuple(e["key"])] = (take("<i8", k), take("<u8", k), take("<u8", k))
    if obj["version"] >= 4 and obj.get("rank_magnitudes"):
        sections["magnitudes"] = (take("<f8", world), take("<i8", world))
    assert pos == len(data), "the index has bytes its JSON does not account for"
    return sections


def encode_index(sections: dict) -> bytes:
    """Inverse of ``decode_index``: the sections in their order, little-endian 8-byte integers."""
    parts = [np.asarray(v, dtype="<i8").tobytes() for v in sections["node_rows"].values()]
    parts += [np.asarray(v, dtype="<i8").tobytes() for v in sections["own_rows"].values()]
    parts += [np.asarray(v, dtype="<u8").tobytes() for v in sections["checksums"].values()]
    for ranks, offsets, sizes in sections["boxes"].values():
        parts += [np.asarray(a, dtype="<i8").tobytes() for a in (ranks, offsets, sizes)]
    for chunks, nan, inf in sections.get("non_finite", {}).values():
        parts += [np.asarray(chunks, dtype="<i8").tobytes()]
        parts += [np.asarray(nan, dtype="<u8").tobytes(), np.asarray(inf, dtype="<u8").tobytes()]
    if "magnitudes" in sections:
        values, leaves = sections["magnitudes"]
        parts += [np.asarray(values, dtype="<f8").tobytes(), np.asarray(leaves, dtype="<i8").tobytes()]
    return b"".join(parts)


# --- reading and tampering with a directory checkpoint -------------------------------------------------------


def read(path: Path) -> tuple[dict, bytes]:
    return json.loads((path / "tddist.json").read_bytes()), (path / "tddist.idx").read_bytes()


def write(path: Path, obj: dict, index: bytes, *, fix_index: bool = True) -> None:
    """Write ``obj`` and ``index``; with ``fix_index`` the JSON's index size and checksum are those of ``index``."""
    if fix_index:
        obj["index"] = {"size": len(index), "checksum": xxhash.xxh3_64_hexdigest(index)}
    (path / "tddist.json").write_bytes(sealed(obj))
    (path / "tddist.idx").write_bytes(index)


def sealed(obj: dict) -> bytes:
    """``obj`` as a version-3 writer writes it: its own checksum first (a rewritten manifest gets a new one)."""
    body = {k: v for k, v in obj.items() if k != "manifest_checksum"}
    return seal(fmt.dumps(body)) if obj.get("version", 0) >= 3 else fmt.dumps(body)


def leaf(obj: dict, *key: str) -> dict:
    return next(e for e in obj["leaves"] if tuple(e["key"]) == key)


def node(obj: dict, *key: str) -> dict:
    return next(n for n in obj["nodes"] if tuple(n["key"]) == key)


def refused(path: Path, match: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """``read_manifest`` and ``load`` both refuse ``path`` with a ManifestError matching ``match``, and
    ``load`` refuses before it opens a data file or maps a tensor."""
    with pytest.raises(ManifestError, match=match):
        tddist.read_manifest(path)

    def no_data(*args, **kwargs):
        raise AssertionError("data was opened before the manifest was validated")

    with monkeypatch.context() as mp:
        mp.setattr(tddist.loading.read, "ChunkSource", no_data)
        mp.setattr(tddist.loading.read, "local_files", no_data)
        mp.setattr(torch, "from_file", no_data)
        with pytest.raises(ManifestError, match=match):
            tddist.load(path, shard=None)


@pytest.fixture
def multi(tmp_path) -> Path:
    """Three ranks (rows 3, 0, 2; a leaf sharded along dim 1 with 1, 3, 2 columns; replicated leaves)."""
    path = tmp_path / "multi"
    recipe.write_multi(path)
    return path


@pytest.fixture
def two(tmp_path) -> Path:
    """Two ranks, two rows each: batch/x (4, 3) sharded along dim 0 (the node's rows), w (6,) replicated."""

    def rank_main(comm):
        r = comm.rank
        x = torch.arange(6, dtype=torch.float32).reshape(2, 3) + 6 * r
        td = TensorDict({"batch": TensorDict({"x": x}, [2]), "w": torch.arange(6.0)}, [])
        tddist.save(td, tmp_path / "two", comm=comm)
        return "ok"

    assert tddist.run_threads(2, rank_main) == ["ok", "ok"]
    return tmp_path / "two"


TWO_X = torch.arange(12, dtype=torch.float32).reshape(4, 3)


def test_index_decoder_reads_what_tddist_writes(multi):
    """This file's reading of the index agrees with the writer: the sections the saved ranks imply."""
    obj, index = read(multi)
    s = decode_index(obj, index)
    assert s["node_rows"] == {("data",): [3, 0, 2], ("data", "sub"): [3, 0, 2]}
    assert s["own_rows"] == {("shared", "cols"): [1, 3, 2]}
    assert [len(v) for v in s["checksums"].values()] == [3, 3, 3, 1, 3, 1]
    m = tddist.read_manifest(multi)
    for key, sums in s["checksums"].items():
        assert [f"{v:016x}" for v in sums] == [c.checksum for c in m.leaves[key].chunks], key
    assert encode_index(s) == index


def _as_boxes(path: Path, ranks: list[int], offsets: list[tuple], sizes: list[tuple]) -> None:
    """Rewrite batch/x of the ``two`` checkpoint as a "boxes" leaf with these chunks (the index's box
    columns), the chunks' checksums taken from the ranks' shards in order."""
    obj, index = read(path)
    s = decode_index(obj, index)
    x = leaf(obj, "batch", "x")
    x["placement"], x["chunks"] = {"type": "boxes"}, len(ranks)
    del x["rows"]
    assert "non_finite_chunks" not in x  # clean: its counts (none) hold for any chunks
    s["checksums"][("batch", "x")] = (s["checksums"][("batch", "x")] * 2)[: len(ranks)]
    s["boxes"][("batch", "x")] = (ranks, [v for o in offsets for v in o], [v for z in sizes for v in z])
    write(path, obj, encode_index(s))


def test_rewritten_but_equivalent_manifest_still_loads(two):
    """Control: x rewritten as a "boxes" leaf with the same two chunks (ranks, offsets, sizes in the index),
    the index re-encoded and its size and checksum recomputed: the checkpoint loads the same data. The
    refusals below therefore come from what each test breaks, not from the rewriting."""
    _as_boxes(two, [0, 1], [(0, 0), (2, 0)], [(2, 3), (2, 3)])
    got = tddist.load(two, shard=None, verify=True)
    assert torch.equal(got["batch", "x"], TWO_X) and torch.equal(got["w"], torch.arange(6.0))
    assert tddist.read_manifest(two).leaves[("batch", "x")].placement == tddist.core.sharding.Boxes()


# --- rows ------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("rows", [[3, 1, 2], [3, 0, 1], [6, -1, 0], [-3, 6, 2]], ids=["more", "fewer", "neg", "neg2"])
def test_node_rows_that_do_not_sum_or_are_negative_are_refused(multi, rows, monkeypatch):
    obj, index = read(multi)
    s = decode_index(obj, index)
    s["node_rows"][("data",)] = rows
    write(multi, obj, encode_index(s))
    refused(multi, r"invalid rows for node \('data',\)", monkeypatch)


@pytest.mark.parametrize("rows", [[1, 3, 3], [1, 3, 1], [4, -1, 3]], ids=["more", "fewer", "negative"])
def test_own_rows_that_do_not_sum_or_are_negative_are_refused(multi, rows, monkeypatch):
    """A leaf sharded along dim 1 has its own lengths: they must be non-negative and sum to shape[1]."""
    obj, index = read(multi)
    s = decode_index(obj, index)
    s["own_rows"][("shared", "cols")] = rows
    write(multi, obj, encode_index(s))
    refused(multi, r"leaf \('shared', 'cols'\) has rows that are negative or do not sum to 6", monkeypatch)


def test_shape_that_disagrees_with_the_node_rows_is_refused(multi, monkeypatch):
    """A leaf taking its rows from the node must have shape[0] equal to their sum."""
    obj, index = read(multi)
    leaf(obj, "data", "x")["shape"] = [6, 4]
    write(multi, obj, index)
    refused(multi, r"leaf \('data', 'x'\) has rows that are negative or do not sum to 6", monkeypatch)


def test_rows_node_under_a_node_without_rows_is_refused(tmp_path, monkeypatch):
    """A leaf sharded along dim 0 under the unbatched root has its own rows; claiming the node's is refused."""
    path = tmp_path / "ckpt"
    tddist.save({"w": torch.arange(4.0)}, path, placements={"w": tddist.Shard(0)}, comm=tddist.LocalComm())
    obj, index = read(path)
    assert leaf(obj, "w")["rows"] == "own"
    s = decode_index(obj, index)
    leaf(obj, "w")["rows"] = "node"
    del s["own_rows"][("w",)]
    write(path, obj, encode_index(s))
    refused(path, r"leaf \('w',\) takes its rows from a node without rows", monkeypatch)


def test_rows_node_on_a_dim_other_than_0_is_refused(multi, monkeypatch):
    """A node's rows are along dim 0: a leaf sharded along dim 1 cannot take them."""
    obj, index = read(multi)
    leaf(obj, "data", "x")["placement"] = {"type": "shard", "dim": 1}  # still "rows": "node"
    write(multi, obj, index)
    refused(multi, r"leaf \('data', 'x'\) takes its rows from a node", monkeypatch)


@pytest.mark.parametrize("rows", ["all", None, ["own"]], ids=["word", "missing", "list"])
def test_unknown_rows_member_is_refused(multi, rows, monkeypatch):
    obj, index = read(multi)
    if rows is None:
        del leaf(obj, "data", "x")["rows"]
    else:
        leaf(obj, "data", "x")["rows"] = rows
    write(multi, obj, index)
    refused(multi, r"leaf \('data', 'x'\) has invalid rows " + re.escape(repr(rows)), monkeypatch)


def test_own_rows_that_contradict_the_node_rows_are_refused(multi, monkeypatch):
    """Under a batched node, a leaf sharded along dim 0 holds the node's rows on every rank (a TensorDict's
    leaves share its batch dims): own rows that differ from the node's, even with the same sum and data
    files of the same sizes, are refused."""
    obj, index = read(multi)
    s = decode_index(obj, index)
    leaf(obj, "data", "x")["rows"] = "own"
    s["own_rows"] = {("data", "x"): [3, 0, 2], **s["own_rows"]}  # the node's own rows: accepted
    write(multi, obj, encode_index(s))
    assert tddist.read_manifest(multi).leaves[("data", "x")].shape[0] == 5
    s["own_rows"][("data", "x")] = [2, 0, 3]
    write(multi, obj, encode_index(s))
    refused(
        multi,
        r"leaf \('data', 'x'\) has rows per rank that differ from those of its node \('data',\)",
        monkeypatch,
    )


def test_a_per_rank_leaf_of_one_dimension(tmp_path):
    """A per-rank scalar is a leaf of shape [world]: one dimension is enough."""
    path = tmp_path / "ck"
    results = tddist.run_threads(
        2,
        lambda c: tddist.save({"s": torch.tensor(float(c.rank))}, path, comm=c, placements={"s": tddist.PerRank()}),
        timeout=60,
    )
    assert not any(isinstance(r, BaseException) for r in results), results
    assert tddist.read_manifest(path).leaves[("s",)].shape == (2,)


# --- the index: size, checksum, sections -------------------------------------------------------------------


def test_truncated_index_is_refused(multi, monkeypatch):
    obj, index = read(multi)
    write(multi, obj, index[:-8], fix_index=False)
    refused(multi, rf"tddist.idx' has {len(index) - 8} bytes, its manifest implies {len(index)}", monkeypatch)


def test_extended_index_is_refused(multi, monkeypatch):
    obj, index = read(multi)
    write(multi, obj, index + bytes(8), fix_index=False)
    refused(multi, rf"tddist.idx' has {len(index) + 8} bytes, its manifest implies {len(index)}", monkeypatch)


@pytest.mark.parametrize("delta", [-8, 8, 1], ids=["smaller", "larger", "odd"])
def test_declared_index_size_that_the_structure_does_not_need_is_refused(multi, delta, monkeypatch):
    """The JSON's index size must be the one its structure implies, even when it matches the file."""
    obj, index = read(multi)
    index = index[: len(index) + delta] if delta < 0 else index + bytes(delta)
    write(multi, obj, index)  # size and checksum those of the (wrong) file
    refused(multi, rf"declares an index of {len(index)} bytes, its structure needs {len(index) - delta}", monkeypatch)


@pytest.mark.parametrize("where", [0, 8 * 6, -1], ids=["node-rows", "own-rows", "checksums"])
def test_index_that_fails_its_checksum_is_refused(multi, where, monkeypatch):
    obj, index = read(multi)
    damaged = bytearray(index)
    damaged[where] ^= 0x01
    write(multi, obj, bytes(damaged), fix_index=False)
    refused(multi, "has an index that fails its checksum", monkeypatch)


@pytest.mark.parametrize("bad", ["", "A4396F73CF83E17F", 12, None], ids=["empty", "upper", "int", "null"])
def test_malformed_index_checksum_is_refused(multi, bad, monkeypatch):
    obj, index = read(multi)
    obj["index"]["checksum"] = bad
    write(multi, obj, index, fix_index=False)
    refused(multi, "has an index that fails its checksum", monkeypatch)


@pytest.mark.parametrize("index_member", [None, {}, {"size": "184"}, {"size": True}, [184]], ids=str)
def test_missing_or_malformed_index_member_is_refused(multi, index_member, monkeypatch):
    obj, index = read(multi)
    if index_member is None:
        del obj["index"]
    else:
        obj["index"] = index_member
    write(multi, obj, index, fix_index=False)
    refused(multi, "has no index size", monkeypatch)


@pytest.mark.parametrize("change", [-1, 1], ids=["one-short", "one-extra"])
def test_checksum_section_of_the_wrong_length_is_refused(two, change, monkeypatch):
    """The index is consistent with itself (size and checksum recomputed) but holds one checksum fewer or
    more than the leaves have chunks."""
    obj, index = read(two)
    s = decode_index(obj, index)
    sums = s["checksums"][("batch", "x")]
    s["checksums"][("batch", "x")] = sums[:-1] if change < 0 else [*sums, sums[-1]]
    write(two, obj, encode_index(s))
    refused(
        two, rf"declares an index of {len(index) + 8 * change} bytes, its structure needs {len(index)}", monkeypatch
    )


def test_world_size_that_does_not_fit_the_index_is_refused(two, monkeypatch):
    """Every per-rank section has world_size entries: a changed world_size changes the index's size."""
    obj, index = read(two)
    obj["world_size"] = 3
    write(two, obj, index, fix_index=False)
    refused(two, rf"declares an index of {len(index)} bytes, its structure needs", monkeypatch)


def test_missing_index_is_refused(multi, monkeypatch):
    (multi / "tddist.idx").unlink()
    refused(multi, r"has no index \(tddist.idx\)", monkeypatch)


def test_index_that_is_a_directory_is_refused(multi):
    """An index that cannot be read as a file is refused with a tddist error, not taken as absent."""
    (multi / "tddist.idx").unlink()
    (multi / "tddist.idx").mkdir()
    with pytest.raises(tddist.TddistError):
        tddist.read_manifest(multi)


def test_swapped_index_is_refused(tmp_path, monkeypatch):
    """The index of another checkpoint of the same structure and size fails the checksum in the JSON."""
    a, b = tmp_path / "a", tmp_path / "b"
    tddist.save({"x": torch.zeros(3)}, a, comm=tddist.LocalComm())
    tddist.save({"x": torch.ones(3)}, b, comm=tddist.LocalComm())
    shutil.copy(b / "tddist.idx", a / "tddist.idx")
    refused(a, "has an index that fails its checksum", monkeypatch)


# --- replicated and boxes leaves ----------------------------------------------------------------------------


@pytest.mark.parametrize("writer", [3, -1, "0", True, None, 0.0], ids=repr)
def test_replicated_leaf_with_an_invalid_writer_is_refused(multi, writer, monkeypatch):
    obj, index = read(multi)
    if writer is None:
        del leaf(obj, "shared", "w")["writer"]
    else:
        leaf(obj, "shared", "w")["writer"] = writer
    write(multi, obj, index)
    refused(multi, r"leaf \('shared', 'w'\) has an invalid writer", monkeypatch)


def test_replicated_leaf_naming_another_valid_writer_fails_on_its_data_file(multi):
    """A writer in range that did not write the leaf moves the derived offsets in the data files of both
    ranks (rank 0's file has 64 bytes more than it should, rank 1's 64 fewer): their sizes no longer fit,
    and load refuses them instead of reading other bytes. (The writer gave ``shared/w``, the larger
    replicated leaf, to rank 0 and ``step`` to rank 1.)"""
    obj, index = read(multi)
    leaf(obj, "shared", "w")["writer"] = 1
    write(multi, obj, index)
    assert tddist.read_manifest(multi).leaves[("shared", "w")].chunks[0].rank == 1
    with pytest.raises(
        CorruptCheckpointError, match=r"rank-0000[01]\.data.* has (384|128) bytes, the manifest says (320|192)"
    ):
        tddist.load(multi, shard=None)


@pytest.mark.parametrize("ranks", [[0, 0], [0, 2], [-1, 0], [1, 7]], ids=["repeated", "world", "negative", "far"])
def test_boxes_with_invalid_ranks_are_refused(two, ranks, monkeypatch):
    _as_boxes(two, ranks, [(0, 0), (2, 0)], [(2, 3), (2, 3)])
    refused(two, r"leaf \('batch', 'x'\) lists an invalid or repeated rank", monkeypatch)


@pytest.mark.parametrize(
    "offsets, sizes",
    [
        ([(0, 0), (1, 0)], [(2, 3), (3, 3)]),  # overlap
        ([(0, 0), (3, 0)], [(2, 3), (1, 3)]),  # a gap: row 2 is missing
        ([(0, 0), (2, 0)], [(2, 3), (3, 3)]),  # past the end of dim 0
        ([(0, 0), (2, 1)], [(2, 3), (2, 3)]),  # past the end of dim 1
        ([(0, 0), (2, 0)], [(2, 2), (2, 3)]),  # a column missing
    ],
    ids=["overlap", "gap", "past-dim0", "past-dim1", "missing-column"],
)
def test_boxes_that_do_not_tile_the_shape_are_refused(two, offsets, sizes, monkeypatch):
    _as_boxes(two, [0, 1], offsets, sizes)
    refused(two, r"leaf \('batch', 'x'\) chunks do not tile shape \[4, 3\]", monkeypatch)


def test_boxes_with_a_negative_box_are_refused(two, monkeypatch):
    _as_boxes(two, [0, 1], [(0, 0), (-2, 0)], [(2, 3), (2, 3)])
    refused(two, r"leaf \('batch', 'x'\) has a negative chunk box", monkeypatch)


@pytest.mark.parametrize("chunks", [3, -1, "2", None], ids=repr)
def test_boxes_with_an_invalid_chunk_count_are_refused(two, chunks, monkeypatch):
    """More chunks than ranks, a negative or non-integer count."""
    obj, index = read(two)
    x = leaf(obj, "batch", "x")
    x["placement"], x["chunks"] = {"type": "boxes"}, chunks
    if chunks is None:
        del x["chunks"]
    write(two, obj, index)
    refused(two, r"leaf \('batch', 'x'\) has an invalid chunk count", monkeypatch)


def test_boxes_leaf_of_zero_chunks_loads_as_an_empty_tensor(tmp_path):
    """A leaf with no elements may be stored as a "boxes" leaf of no chunks (nothing to tile, no checksums,
    no box columns, no bytes in any data file): it loads, verified, as an empty tensor of its shape and dtype."""

    def rank_main(comm):
        td = TensorDict({"e": torch.empty(0, 3, dtype=torch.float64), "w": torch.arange(6.0)}, [])
        tddist.save(td, tmp_path / "z", comm=comm)
        return "ok"

    assert tddist.run_threads(2, rank_main) == ["ok", "ok"]
    path = tmp_path / "z"
    obj, index = read(path)
    s = decode_index(obj, index)
    e = leaf(obj, "e")
    e["placement"], e["chunks"] = {"type": "boxes"}, 0
    e.pop("writer", None)
    s["checksums"][("e",)] = []
    s["boxes"][("e",)] = ([], [], [])
    assert "non_finite_chunks" not in e  # no chunks, no counts
    write(path, obj, encode_index(s))
    got = tddist.load(path, shard=None, verify=True)
    assert got["e"].shape == (0, 3) and got["e"].dtype == torch.float64
    assert torch.equal(got["w"], torch.arange(6.0))
    assert tddist.read_manifest(path).leaves[("e",)].placement == tddist.core.sharding.Boxes()
    assert verify_checkpoint(path).ok


# --- packing, layout, version ---------------------------------------------------------------------------------


@pytest.mark.parametrize("packing", ["zip", "", None, "PACKED", ["packed"]], ids=repr)
def test_unknown_packing_is_refused(multi, packing, monkeypatch):
    obj, index = read(multi)
    if packing is None:
        del obj["packing"]
    else:
        obj["packing"] = packing
    write(multi, obj, index)
    refused(multi, "has unknown packing", monkeypatch)


def test_node_rows_in_the_json_are_refused(multi, monkeypatch):
    """Version 2 keeps node rows in the index; rows in the JSON (version 1's place) would be a second,
    possibly contradicting, source."""
    obj, index = read(multi)
    node(obj, "data")["rows"] = [3, 0, 2]
    write(multi, obj, index)
    refused(multi, "lists node rows in the JSON; version 2 keeps them in the index", monkeypatch)


@pytest.mark.parametrize("version", [5, 99])
def test_newer_version_is_refused_as_newer(multi, version, monkeypatch):
    obj, index = read(multi)
    obj["version"] = version
    write(multi, obj, index)
    refused(multi, rf"has format version {version}, newer than this tddist reads \(4\); upgrade tddist", monkeypatch)


def test_version_1_manifest_beside_packed_data_is_refused(multi, monkeypatch):
    """A version-2 manifest relabelled as version 1 is read as version 1, which lists every chunk."""
    obj, index = read(multi)
    obj["version"] = 1
    write(multi, obj, index)
    refused(multi, "has no list 'chunks'", monkeypatch)


def _rewrite_archive(path: Path, change) -> None:
    """Rewrite the archive's entries through ``change(name, data)`` (None drops the entry)."""
    with zipfile.ZipFile(path) as zf:
        entries = [(zi.filename, zf.read(zi)) for zi in zf.infolist()]
    with zipfile.ZipFile(path, "w") as out:
        for name, data in entries:
            new = change(name, data)
            if new is not None:
                out.writestr(name, new)


@pytest.fixture
def archive(tmp_path) -> Path:
    path = tmp_path / "a.tdz"
    tddist.save(TensorDict({"x": torch.arange(4.0)}, [4]), path, comm=tddist.LocalComm())
    return path


def test_archive_says_memmap(archive):
    m = tddist.read_manifest(archive)
    assert (m.layout, m.packing, m.version) == ("archive", "memmap", 4)


def test_archive_whose_packing_is_packed_is_refused(archive, monkeypatch):
    def change(name, data):
        if name != "tddist.json":
            return data
        obj = json.loads(data)
        obj["packing"] = "packed"
        return sealed(obj)

    _rewrite_archive(archive, change)
    refused(archive, "is an archive, whose packing must be 'memmap'", monkeypatch)


def test_extracted_archive_whose_packing_is_packed_is_refused(archive, tmp_path, monkeypatch):
    """A directory may hold an extracted archive ("layout": "archive"); its packing must still be memmap."""
    out = tmp_path / "extracted"
    with zipfile.ZipFile(archive) as zf:
        zf.extractall(out)
    assert torch.equal(tddist.load(out, shard=None, verify=True)["x"], torch.arange(4.0))
    obj, index = read(out)
    obj["packing"] = "packed"
    write(out, obj, index)
    refused(out, "is an archive, whose packing must be 'memmap'", monkeypatch)


def test_archive_without_its_index_is_refused(archive, monkeypatch):
    _rewrite_archive(archive, lambda name, data: None if name == "tddist.idx" else data)
    refused(archive, r"has no index \(tddist.idx\)", monkeypatch)


def test_archive_with_a_damaged_index_is_refused(archive, monkeypatch):
    _rewrite_archive(archive, lambda name, data: data[:-8] if name == "tddist.idx" else data)
    refused(archive, r"entry 'tddist.idx' declares 24 bytes \(24 stored\), its manifest implies 32", monkeypatch)


# --- packed data files ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("change", [-1, -64, 1, 64], ids=["1-short", "64-short", "1-long", "64-long"])
def test_packed_data_file_of_the_wrong_size_is_refused_on_load(multi, change):
    """Rank 0's data file is 384 bytes (chunks at 64-byte offsets); shorter or longer is refused when a
    chunk of it is read, with or without verification, before anything is mapped."""
    data = multi / "rank-00000.data"
    assert data.stat().st_size == 384
    with open(data, "r+b") as f:
        f.truncate(384 + change)
    assert tddist.read_manifest(multi).packing == "packed"  # the manifest is fine
    for verify in (False, True):
        with pytest.raises(
            CorruptCheckpointError, match=rf"rank-00000\.data.* has {384 + change} bytes, the manifest says 384"
        ):
            tddist.load(multi, shard=None, verify=verify)


def test_packed_data_file_without_its_last_padding(multi):
    """Rank 1 stored its 3 x 3 int16 columns (18 bytes) and the replicated ``step`` (8 bytes), each at a
    64-byte aligned offset: 128 bytes. Without the last chunk's padding the file is refused."""
    assert (multi / "rank-00001.data").stat().st_size == 128
    assert tddist.read_manifest(multi).leaves[("step",)].chunks[0].rank == 1
    with open(multi / "rank-00001.data", "r+b") as f:
        f.truncate(72)
    with pytest.raises(CorruptCheckpointError, match=r"rank-00001\.data.* has 72 bytes, the manifest says 128"):
        tddist.load(multi, shard=None)


def test_missing_packed_data_file_is_refused_on_load(multi):
    (multi / "rank-00002.data").unlink()
    with pytest.raises(CorruptCheckpointError, match=r"rank-00002\.data.* is missing"):
        tddist.load(multi, shard=None)


def test_damaged_packed_chunk_fails_verification(multi):
    """A flipped byte inside a chunk (not in its padding) fails that chunk's checksum."""
    data = bytearray((multi / "rank-00002.data").read_bytes())
    data[0] ^= 0xFF
    (multi / "rank-00002.data").write_bytes(bytes(data))
    with pytest.raises(CorruptCheckpointError, match="checksum mismatch"):
        tddist.load(multi, shard=None, verify=True)


# --- round trips ------------------------------------------------------------------------------------------------


def _manifest_files(path: Path) -> tuple[bytes, bytes]:
    if path.is_file():
        with zipfile.ZipFile(path) as zf:
            return zf.read("tddist.json"), zf.read("tddist.idx")
    return (path / "tddist.json").read_bytes(), (path / "tddist.idx").read_bytes()


def _round_trip(path: Path) -> None:
    """The manifest parsed and encoded again: the same bytes (a version-2 or 3 manifest comes back as version 4:
    the same members, with the version and the manifest's own checksum; its leaves were not counted, so no
    leaf gains ``finite_stats`` and the index is the same)."""
    raw, index = _manifest_files(path)
    m = parse_manifest(json.loads(raw), index=index)
    files = encode(m)
    if m.version == fmt.FORMAT_VERSION:
        assert files.manifest == raw
    else:
        again = json.loads(files.manifest)
        assert again.pop("manifest_checksum") and again.pop("version") == fmt.FORMAT_VERSION
        assert files.manifest == sealed({**json.loads(raw), "version": fmt.FORMAT_VERSION})
    assert files.index == index


@pytest.mark.parametrize(
    ("version", "name"),
    [(v, n) for v in (2, 3, 4) for n in sorted(recipe.BUILDERS) if (GOLDEN / f"v{v}" / n).exists()],
)
def test_encode_parse_reproduces_the_golden_files(name, version):
    """sharded (dim 0 and dim 1, node and own rows), replicated, DTensor boxes, non-tensor values, memmap
    packing, an archive, references (version 4): the parsed manifest encodes back to the same bytes (each
    golden checkpoint of each version; a case new in a later version has none in the older ones)."""
    _round_trip(GOLDEN / f"v{version}" / name)


def test_encode_parse_reproduces_fresh_files(tmp_path):
    """A fresh save without boxes: uneven rows with empty ranks, a dim-1 shard, replicas, a nested node,
    and non-tensor values of every placement, pickled ones included."""

    def rank_main(comm):
        r = comm.rank
        n = (0, 3, 1, 0)[r]
        td = TensorDict(
            {"obs": torch.full((n, 2), float(r)), "inner": TensorDict({"m": torch.ones(n, 1, 2)}, [n, 1])}, [n]
        )
        td["tag"] = NonTensorStack.from_list([f"r{r}-{i}" for i in range(n)]) if n else NonTensorStack()
        outer = TensorDict({"batch": td, "cols": torch.ones(2, r + 1), "b": torch.tensor(True)}, [])
        outer.set_non_tensor("same", {"a": [1, 2]})
        outer.set_non_tensor("differs", r)
        outer.set_non_tensor("pickled", (1, r))
        tddist.save(outer, tmp_path / "fresh", comm=comm, placements={"cols": tddist.Shard(1)}, allow_pickle=True)
        return "ok"

    assert tddist.run_threads(4, rank_main) == ["ok"] * 4
    obj, _index = read(tmp_path / "fresh")
    assert {o["placement"] for o in obj["objects"]} >= {"replicate", "per_rank"}
    _round_trip(tmp_path / "fresh")


# --- version 1 manifests re-encoded as version 2 ------------------------------------------------------------------


@pytest.mark.parametrize(
    "name",
    [
        recipe.SINGLE,
        recipe.MULTI,
        recipe.EXTENDED,
        recipe.DTENSOR,
    ],
)
def test_v1_manifest_reencoded_as_v2_loads_the_same_data(name, tmp_path):
    """A version-1 directory checkpoint with its manifest replaced by the version-2 encoding of what was
    parsed (packing "memmap": the rank directories are version 1's) loads the same data, whole and on the
    ranks that saved it."""
    v1 = GOLDEN / "v1" / name
    path = tmp_path / name
    shutil.copytree(v1, path)
    m = tddist.read_manifest(v1)
    assert m.version == 1 and m.packing == "memmap"
    files = encode(replace(m, version=2))
    (path / "tddist.json").write_bytes(files.manifest)
    (path / "tddist.idx").write_bytes(files.index)
    m2 = tddist.read_manifest(path)
    assert m2.version == 4 and m2.packing == "memmap" and m2.nodes == m.nodes and m2.objects == m.objects
    for key, lf in m.leaves.items():
        assert m2.leaves[key].chunks == lf.chunks, key
    assert_td_equal(tddist.load(path, shard=None, verify=True), tddist.load(v1, shard=None, verify=True))
    world = m.world_size
    if world > 1:
        old = tddist.run_threads(world, lambda c: tddist.load(v1, comm=c, shard="saved"))
        new = tddist.run_threads(world, lambda c: tddist.load(path, comm=c, shard="saved"))
        for a, b in zip(old, new):
            assert_td_equal(b, a)
    assert sorted(os.listdir(path)) == sorted([*os.listdir(v1), "tddist.idx"])


@pytest.mark.parametrize(
    "name",
    [
        recipe.SINGLE,
        recipe.MULTI,
        recipe.EXTENDED,
        recipe.DTENSOR,
    ],
)
def test_v1_checkpoint_packs_into_a_v2_archive(name, tmp_path):
    """tddist.pack writes the version-2 encoding of a version-1 manifest (convert.py calls encode), so the
    same rows bug shows there: packing a version-1 checkpoint must give an archive with the same data."""
    v1 = GOLDEN / "v1" / name
    tddist.pack(v1, tmp_path / "a.tdz")
    assert tddist.read_manifest(tmp_path / "a.tdz").version == 4
    assert_td_equal(tddist.load(tmp_path / "a.tdz", shard=None, verify=True), tddist.load(v1, shard=None))


def test_packed_checkpoint_packs_into_an_archive_of_tensordict_rank_directories(tmp_path):
    """An archive is always a memmap tree: after pack (from the default packing) and unpack, each rank directory
    opens with TensorDict.load_memmap, as those of a save with layout="memmap" do."""
    src = GOLDEN / "v2" / recipe.MULTI
    tddist.pack(src, tmp_path / "a.tdz")
    tddist.unpack(tmp_path / "a.tdz", tmp_path / "d")
    assert tddist.read_manifest(tmp_path / "d").packing == "memmap"
    assert_td_equal(tddist.load(tmp_path / "d", shard=None, verify=True), recipe.multi_rank_global())
    td = TensorDict.load_memmap(tmp_path / "d" / "rank-00002")
    assert torch.equal(td["data", "x"], recipe.multi_rank_shard(2)["data", "x"])


def test_a_manifest_larger_than_readers_accept_is_never_written(tmp_path, monkeypatch):
    """The writer refuses what the readers would refuse (the bound shrunk to 4 KiB here, so the manifest need not
    be 256 MiB): the save fails on every rank with the sizes named, and the previous checkpoint stays."""
    import tddist.manifest.v2 as manifest_v2

    target = tmp_path / "ckpt"
    tddist.save({"w": torch.arange(4.0)}, target)
    monkeypatch.setattr(manifest_v2, "MAX_MANIFEST_BYTES", 4096)

    def save_rank(comm):
        with pytest.raises(tddist.InvalidDataError, match=r"would have \d+ bytes, more than the 4096 bytes .*metadata"):
            tddist.save({"w": torch.arange(4.0) + 1}, target, comm=comm, metadata={"notes": "x" * 8192})

    tddist.run_threads(2, save_rank)
    assert torch.equal(tddist.load(target, shard=None)["w"], torch.arange(4.0))


@pytest.mark.parametrize("name", ["three_ranks", "dtensor", "extended", "per_rank", "single_rank"])
def test_every_rank_placed_at_once_matches_each_rank_placed_alone(name):
    """``PackedChunks`` (every rank's chunks sorted and placed at once, chunks of no bytes left out) gives each
    rank the offsets and data file size that ``packed_offsets`` gives that rank's column of chunk sizes alone,
    the derivation of docs/format.md section 2.3 that writers follow."""
    from tddist.manifest.locate import PackedChunks, packed_offsets

    m = tddist.read_manifest(GOLDEN / "v3" / name)
    placed, keys = PackedChunks.of(m), list(m.leaves)
    for rank in range(m.world_size):
        nbytes = np.array([leaf.table.nbytes_of_rank(rank) for leaf in m.leaves.values()], np.int64)
        offsets, size = packed_offsets(nbytes)
        alone = {k: o for k, o, n in zip(keys, offsets.tolist(), nbytes.tolist()) if n}
        assert placed.of_rank(rank, keys) == (alone, int(size)), (name, rank)
        rows = placed.rows_of(rank)
        for li, i in zip(placed.leaves[rows].tolist(), placed.chunks[rows].tolist()):  # each chunk's own position
            assert m.leaves[keys[li]].table.chunk(i).rank == rank


# --- whole reads: every chunk planned in columns (manifest.whole, loading.whole) -----------------------------------

WHOLE_ROWS, WHOLE_COLS = [3, 0, 2, 4, 1], [2, 3, 0, 5, 3]  # uneven, with empty ranks


def _whole_state() -> dict:
    g = torch.Generator().manual_seed(7)
    n, c = sum(WHOLE_ROWS), sum(WHOLE_COLS)
    return {
        "a": torch.randn(n, 7, generator=g),  # dim 0 (the batch node's rows)
        "b": torch.randint(0, 100, (n,), generator=g),
        "c": torch.randn(4, c, 3, generator=g),  # dim 1
        "r": torch.randn(6, 5, generator=g),  # replicated
        "s": torch.tensor(3.5, dtype=torch.float64),  # replicated scalar
        "e": torch.zeros(0, 4),  # sharded, every chunk empty
        "h": torch.randn(2, 3, generator=g).to(torch.bfloat16),
    }


def _whole_local(rank: int) -> dict:
    full = _whole_state()
    lo, n = sum(WHOLE_ROWS[:rank]), WHOLE_ROWS[rank]
    clo, cn = sum(WHOLE_COLS[:rank]), WHOLE_COLS[rank]
    batch = TensorDict({"a": full["a"][lo : lo + n], "b": full["b"][lo : lo + n]}, [n])
    local = {k: full[k] for k in ("r", "s", "e", "h")}
    return {"batch": batch, "c": full["c"][:, clo : clo + cn].contiguous(), **local}


@pytest.mark.parametrize("kind", ["packed", "memmap", "archive", "archive-zstd"])
def test_whole_load_is_bit_for_bit(tmp_path, kind):
    """A checkpoint of 5 ranks (uneven rows and columns, empty ranks, replicated leaves, a leaf whose chunks are
    all empty) loads whole in one process equal to what was saved, bit for bit, in every container, with and
    without verification, on one thread or several."""
    target = tmp_path / ("ckpt.tdz" if kind.startswith("archive") else "ckpt")
    kw = {"packed": {}, "memmap": {"layout": "memmap"}, "archive": {}, "archive-zstd": {"compression": "zstd"}}[kind]
    places = {"c": tddist.Shard(1), "e": tddist.Shard(0)}
    saved = tddist.run_threads(5, lambda c: tddist.save(_whole_local(c.rank), target, comm=c, placements=places, **kw))
    assert not any(isinstance(r, BaseException) for r in saved), saved
    want = _whole_state()
    for verify in (False, True):
        for num_threads in (1, 3):
            got = tddist.load(target, shard=None, verify=verify, num_threads=num_threads)
            for key in ("c", "r", "s", "e", "h"):
                assert got[key].dtype == want[key].dtype and torch.equal(got[key], want[key]), (key, verify)
            assert torch.equal(got["batch", "a"], want["a"]) and torch.equal(got["batch", "b"], want["b"])
            assert got["batch"].batch_size == torch.Size([sum(WHOLE_ROWS)])


def _grid_checkpoint(path: Path) -> torch.Tensor:
    """A (4, 6) leaf ``g`` stored as a 2 x 2 grid of DTensor-like boxes by ranks 3, 0, 2, 1 (each its block in C
    order, saved as a leaf of 2 x 3 blocks, then the manifest rewritten as boxes); returns the global tensor."""
    g = torch.arange(24, dtype=torch.float32).reshape(4, 6)
    corners = {3: (0, 0), 0: (0, 3), 2: (2, 0), 1: (2, 3)}
    block = {r: g[a : a + 2, b : b + 3].contiguous() for r, (a, b) in corners.items()}
    assert not any(
        isinstance(x, BaseException)
        for x in tddist.run_threads(
            4,
            lambda c: tddist.save(
                {"g": block[c.rank], "w": torch.ones(3)}, path, comm=c, placements={"g": tddist.Shard(0)}
            ),
        )
    )
    obj, index = read(path)
    s = decode_index(obj, index)
    e = leaf(obj, "g")
    e["placement"], e["chunks"], e["shape"] = {"type": "boxes"}, 4, [4, 6]
    e.pop("rows", None)
    ranks = [3, 0, 2, 1]
    s["own_rows"].pop(("g",), None)
    s["checksums"][("g",)] = [s["checksums"][("g",)][r] for r in ranks]
    s["boxes"][("g",)] = (ranks, [v for r in ranks for v in corners[r]], [2, 3] * 4)
    write(path, obj, encode_index(s))
    return g


def test_whole_load_of_a_grid_of_boxes(tmp_path):
    """DTensor-like boxes (a 2 x 2 grid, stored by ranks out of order) load whole, each box copied into its
    strided place, verified or not; a flipped byte in one box is found."""
    g = _grid_checkpoint(tmp_path / "grid")
    assert tddist.read_manifest(tmp_path / "grid").leaves[("g",)].placement == tddist.core.sharding.Boxes()
    for verify in (False, True):
        got = tddist.load(tmp_path / "grid", shard=None, verify=verify, num_threads=2)
        assert torch.equal(got["g"], g) and torch.equal(got["w"], torch.ones(3))
    m = tddist.read_manifest(tmp_path / "grid")
    from tddist.manifest.locate import Locator

    loc = Locator(m).locate(m.leaves[("g",)], m.leaves[("g",)].chunk_of_rank(2))
    _flip(tmp_path / "grid" / loc.relpath, loc.offset + 5)
    with pytest.raises(CorruptCheckpointError, match=r"leaf \('g',\), rank 2\)"):
        tddist.load(tmp_path / "grid", shard=None, verify=True)


def _flip(path: Path, at: int) -> None:
    raw = bytearray(path.read_bytes())
    raw[at] ^= 0x40
    path.write_bytes(bytes(raw))


@pytest.mark.parametrize("layout", ["packed", "memmap"])
def test_whole_load_finds_a_flipped_byte_in_any_rank(tmp_path, layout):
    """A byte flipped in the middle rank's chunk of the leaf sharded along dim 1 fails a verified whole load,
    naming the leaf and the rank; the load without verification returns the flipped value (it is what is stored)."""
    from tddist.manifest.locate import Locator

    target = tmp_path / "ckpt"
    places = {"c": tddist.Shard(1), "e": tddist.Shard(0)}
    tddist.run_threads(5, lambda c: tddist.save(_whole_local(c.rank), target, comm=c, placements=places, layout=layout))
    m = tddist.read_manifest(target)
    lf = m.leaves[("c",)]
    loc = Locator(m).locate(lf, lf.chunk_of_rank(3))
    _flip(target / loc.relpath, loc.offset + 4)
    with pytest.raises(CorruptCheckpointError, match=r"leaf \('c',\), rank 3\)"):
        tddist.load(target, shard=None, verify=True)
    assert not torch.equal(tddist.load(target, shard=None)["c"], _whole_state()["c"])


# --- version 4: the sparse counts of non-finite values and the ranks' largest magnitudes ----------------------


@pytest.fixture
def diverged(tmp_path) -> Path:
    """Two ranks: batch/x (4, 3) sharded, rank 1's chunk holding a NaN and an Inf; w (6,) replicated, clean."""

    def rank_main(comm):
        r = comm.rank
        x = torch.arange(6, dtype=torch.float32).reshape(2, 3) + 6 * r
        if r == 1:
            x[0, 0], x[1, 2] = float("nan"), float("-inf")
        td = TensorDict({"batch": TensorDict({"x": x}, [2]), "w": torch.arange(6.0) - 20}, [])
        tddist.save(td, tmp_path / "d", comm=comm)
        return "ok"

    assert tddist.run_threads(2, rank_main) == ["ok", "ok"]
    return tmp_path / "d"


def test_non_finite_chunks_and_magnitudes_as_specified(diverged):
    """Only rank 1's chunk of batch/x is listed (section 5); each rank's largest finite magnitude and its leaf
    (section 6): rank 0's 5.0 in batch/x, rank 1's 10.0, or 20.0 in w on w's writer; the manifest encodes back the same."""
    obj, index = read(diverged)
    s = decode_index(obj, index)
    assert leaf(obj, "batch", "x")["non_finite_chunks"] == 1 and "non_finite_chunks" not in leaf(obj, "w")
    assert s["non_finite"] == {("batch", "x"): ([1], [1], [1])}
    writer = leaf(obj, "w")["writer"]
    x_top = [5.0, 10.0]  # rank 1: 6..11 without its NaN (6) and Inf (11)
    assert s["magnitudes"] == (
        [20.0 if r == writer else x_top[r] for r in range(2)],
        [1 if r == writer else 0 for r in range(2)],
    )
    m = tddist.read_manifest(diverged)
    assert [(b.key, b.nan, b.inf, b.ranks) for b in m.non_finite()] == [(("batch", "x"), 1, 1, (1,))]
    assert m.largest_magnitude() == LargestMagnitude(20.0, ("w",), writer)
    _round_trip(diverged)


def _tamper_section5(i: int, value: int):
    def change(obj, s):
        chunks, nan, inf = (list(a) for a in s["non_finite"][("batch", "x")])
        (chunks, nan, inf)[i][0] = value
        s["non_finite"][("batch", "x")] = (chunks, nan, inf)

    return change


def _tamper_section6(i: int, value):
    def change(obj, s):
        values, leaves = (list(a) for a in s["magnitudes"])
        (values, leaves)[i][0] = value
        s["magnitudes"] = (values, leaves)

    return change


def _more_chunks(obj, s):
    leaf(obj, "batch", "x")["non_finite_chunks"] = 3  # of 2 chunks
    s["non_finite"][("batch", "x")] = ([0, 1, 2], [1, 1, 1], [0, 0, 0])


def _uncounted_but_listed(obj, s):
    del leaf(obj, "batch", "x")["finite_stats"]


@pytest.mark.parametrize(
    "change, match",
    [
        (_tamper_section5(0, 2), "invalid counts of non-finite values"),  # chunk 2 of 2
        (_tamper_section5(0, -1), "invalid counts of non-finite values"),
        (_tamper_section5(1, 6), "invalid counts of non-finite values"),  # 6 NaN + 1 Inf in 6 values
        (_tamper_section5(1, 0), None),  # control: 0 NaN + 1 Inf still counts one
        (lambda obj, s: s.update(non_finite={("batch", "x"): ([1], [0], [0])}), "invalid counts of non-finite"),
        (_more_chunks, "invalid non_finite_chunks 3"),
        (_uncounted_but_listed, "invalid finite_stats"),
        (_tamper_section6(0, -1.0), "invalid largest magnitudes"),
        (_tamper_section6(0, float("nan")), "invalid largest magnitudes"),
        (_tamper_section6(0, float("inf")), "invalid largest magnitudes"),
        (_tamper_section6(1, -1), "invalid largest magnitudes"),  # -1 with a nonzero magnitude
        (_tamper_section6(1, 2), "invalid largest magnitudes"),  # no third leaf
        (lambda obj, s: obj.update(rank_magnitudes="yes"), "invalid rank_magnitudes"),
        (lambda obj, s: obj.update(rank_magnitudes=False), "its structure needs"),  # section 6 left over
    ],
)
def test_tampered_counts_are_refused(diverged, monkeypatch, change, match):
    """Sections 5 and 6 are checked (docs/format.md section 5.7, rule 13) with the index re-encoded and its size
    and checksum recomputed, so each refusal comes from the tampered numbers."""
    obj, index = read(diverged)
    s = decode_index(obj, index)
    change(obj, s)
    write(diverged, obj, encode_index(s))
    if match is None:
        assert [b.nan for b in tddist.read_manifest(diverged).non_finite()] == [0]
    else:
        refused(diverged, match, monkeypatch)
