"""Save and load in one process (default communicator): errors, damage, recovery, targets."""

from __future__ import annotations

import json
import os
import uuid

import pytest
import torch
from tensordict import TensorDict

import tddist
from tddist import (
    CheckpointNotFoundError,
    CorruptCheckpointError,
    InvalidArgumentError,
    InvalidDataError,
    ManifestError,
    TargetError,
)
from tests.helpers import assert_td_equal


def sample_td() -> TensorDict:
    """A small nested TensorDict: batched leaves, a batched sub-TensorDict, replicated leaves."""
    data = TensorDict(
        {
            "obs": torch.arange(24, dtype=torch.float32).reshape(6, 4),
            "act": torch.arange(6, dtype=torch.int64) * 3,
            "sub": TensorDict({"c": torch.linspace(0, 1, 12).reshape(6, 2), "d": torch.ones(6, dtype=torch.bool)}, [6]),
        },
        [6],
    )
    return TensorDict({"data": data, "step": torch.tensor(7), "table": torch.arange(10, dtype=torch.int16)}, [])


def leaf_file(target, *key) -> str:
    return os.path.join(target, "rank-00000", *key[:-1], key[-1] + ".memmap")


def snapshot(root) -> dict:
    """Every entry under ``root`` with its content (files), target (links) or 'dir'."""
    out = {}
    root = os.fspath(root)
    for dirpath, dirs, files in os.walk(root):
        for name in dirs + files:
            p = os.path.join(dirpath, name)
            rel = os.path.relpath(p, root)
            if os.path.islink(p):
                out[rel] = "link->" + os.readlink(p)
            elif os.path.isdir(p):
                out[rel] = "dir"
            else:
                with open(p, "rb") as f:
                    out[rel] = f.read()
    return out


@pytest.fixture
def ckpt(tmp_path):
    """A committed checkpoint of sample_td() at <tmp>/ckpt, one file per leaf (layout "memmap")."""
    target = tmp_path / "ckpt"
    tddist.save(sample_td(), target, layout="memmap")
    return target


@pytest.fixture
def packed(tmp_path):
    """A committed checkpoint of sample_td() at <tmp>/packed in the default layout: one data file per rank."""
    target = tmp_path / "packed"
    tddist.save(sample_td(), target)
    return target


def chunk_span(target, *key) -> tuple[str, int, int]:
    """(data file, offset, size) of rank 0's chunk of leaf ``key`` in a packed checkpoint."""
    from tddist.manifest.locate import Locator

    manifest = tddist.read_manifest(target)
    leaf = manifest.leaves[key]
    loc = Locator(manifest).locate(leaf, leaf.chunk_of_rank(0))
    return os.path.join(target, loc.relpath), loc.offset, loc.nbytes


# --- saving and loading ---------------------------------------------------------------


def test_save_returns_the_saved_data(tmp_path):
    """save returns this rank's shard as saved, equal to the input, and leaves nothing but the target."""
    td = sample_td()
    out = tddist.save(td, tmp_path / "ckpt")
    assert_td_equal(out, td)
    assert os.listdir(tmp_path) == ["ckpt"]
    assert sorted(os.listdir(tmp_path / "ckpt")) == ["rank-00000.data", "tddist.idx", "tddist.json"]
    assert_td_equal(tddist.load(tmp_path / "ckpt", shard=None), td)
    assert_td_equal(tddist.load(str(tmp_path / "ckpt"), shard="saved"), td)


def test_load_keys_reads_only_named_leaves(ckpt):
    """load(keys=...) touches only the requested leaves: deleting other leaves' files
    does not affect it, while requesting a deleted one fails."""
    os.unlink(leaf_file(ckpt, "data", "obs"))
    os.unlink(leaf_file(ckpt, "data", "sub", "d"))
    td = sample_td()
    got = tddist.load(ckpt, keys=[("data", "act"), ("data", "sub", "c")], verify=True)
    assert sorted(got.keys(include_nested=True, leaves_only=True), key=str) == [("data", "act"), ("data", "sub", "c")]
    assert torch.equal(got["data", "act"], td["data", "act"])
    assert torch.equal(got["data", "sub", "c"], td["data", "sub", "c"])
    assert got["data"].batch_size == torch.Size([6])
    step = tddist.load(ckpt, keys="step", shard=None)
    assert list(step.keys()) == ["step"] and step["step"].item() == 7
    with pytest.raises(CorruptCheckpointError, match="missing"):
        tddist.load(ckpt, keys="data")
    with pytest.raises(CorruptCheckpointError):
        tddist.load(ckpt, keys=[("data", "sub")], shard=None)


def test_load_unknown_key_is_invalid_argument(ckpt):
    """Asking for a key the checkpoint lacks names the problem instead of returning less."""
    with pytest.raises(InvalidArgumentError, match="not in the checkpoint"):
        tddist.load(ckpt, keys=["nope"])


def _flip_byte(path, offset):
    with open(path, "r+b") as f:
        f.seek(offset)
        b = f.read(1)
        f.seek(offset)
        f.write(bytes([b[0] ^ 0xFF]))


def test_verify_detects_flipped_byte(ckpt):
    """A flipped byte fails the checksum with verify=True; verify=False still loads the
    (damaged) value, and other leaves verify fine."""
    path = leaf_file(ckpt, "data", "obs")
    _flip_byte(path, 17)
    with pytest.raises(CorruptCheckpointError, match="checksum"):
        tddist.load(ckpt, verify=True)
    with pytest.raises(CorruptCheckpointError, match="checksum"):
        tddist.load(ckpt, keys=("data", "obs"), shard=None, verify=True)
    damaged = tddist.load(ckpt, verify=False)
    expect = sample_td()["data", "obs"]
    diff = (damaged["data", "obs"] != expect).flatten().nonzero().flatten().tolist()
    assert diff == [17 // 4]
    ok = tddist.load(ckpt, keys=[("data", "act"), "table"], verify=True)
    assert torch.equal(ok["table"], sample_td()["table"])


@pytest.mark.parametrize("change", ["truncate", "extend", "empty"])
def test_wrong_file_size_is_detected_without_verify(ckpt, change):
    """A data file whose size differs from the manifest's is refused even without verify."""
    path = leaf_file(ckpt, "data", "sub", "c")
    size = os.path.getsize(path)
    with open(path, "r+b") as f:
        if change == "truncate":
            f.truncate(size - 1)
        elif change == "extend":
            f.seek(0, 2)
            f.write(b"\0")
        else:
            f.truncate(0)
    with pytest.raises(CorruptCheckpointError, match="bytes"):
        tddist.load(ckpt, verify=False)
    with pytest.raises(CorruptCheckpointError):
        tddist.load(ckpt, shard=None, keys=("data", "sub", "c"))


def test_missing_manifest_is_not_found(ckpt, tmp_path):
    """No manifest (removed, never written, or no directory at all) is CheckpointNotFoundError."""
    os.unlink(ckpt / "tddist.json")
    for path in (ckpt, tmp_path / "never-saved"):
        with pytest.raises(CheckpointNotFoundError):
            tddist.load(path)
        with pytest.raises(CheckpointNotFoundError):
            tddist.read_manifest(path)
    (tmp_path / "a-file").write_bytes(b"x")
    with pytest.raises(CheckpointNotFoundError):
        tddist.load(tmp_path / "a-file")
    assert issubclass(CheckpointNotFoundError, FileNotFoundError)


def test_missing_manifest_hints_at_recover(tmp_path):
    """When leftovers of a save lie beside a missing checkpoint, the error points to recover()."""
    (tmp_path / f".ckpt.tddist-staging-{uuid.uuid4().hex}").mkdir()
    with pytest.raises(CheckpointNotFoundError, match="recover"):
        tddist.load(tmp_path / "ckpt")


@pytest.mark.parametrize("content", [b"{not json", b"", b"\xff\xfe", b'{"format": "tddist", "version": 1', b"[]"])
def test_invalid_manifest_json_is_manifest_error(ckpt, content):
    """A manifest that is not valid JSON (or not an object) is ManifestError, on load and read_manifest."""
    (ckpt / "tddist.json").write_bytes(content)
    with pytest.raises(ManifestError):
        tddist.load(ckpt)
    with pytest.raises(ManifestError):
        tddist.read_manifest(ckpt)


# --- targets ------------------------------------------------------------------------------


def test_target_that_is_a_file_is_refused_and_kept(tmp_path):
    """Saving onto an existing file is a TargetError and the file is left as it was."""
    target = tmp_path / "precious.bin"
    target.write_bytes(b"do not delete me")
    with pytest.raises(TargetError):
        tddist.save(sample_td(), target)
    assert target.read_bytes() == b"do not delete me"
    assert os.listdir(tmp_path) == ["precious.bin"]


def test_foreign_directory_is_refused_and_kept(tmp_path):
    """Saving onto a non-empty directory that is not a checkpoint is a TargetError; its
    content (even one that looks half like a checkpoint) is untouched."""
    target = tmp_path / "mydata"
    (target / "rank-00000").mkdir(parents=True)
    (target / "rank-00000" / "x.memmap").write_bytes(b"123")
    (target / "notes.txt").write_text("mine")
    before = snapshot(target)
    with pytest.raises(TargetError, match="not a tddist checkpoint"):
        tddist.save(sample_td(), target)
    assert snapshot(target) == before
    assert os.listdir(tmp_path) == ["mydata"]


def test_symlink_target_is_refused(tmp_path, ckpt):
    """A symbolic link at the target is refused; neither the link nor what it points to changes."""
    link = tmp_path / "link"
    os.symlink(ckpt, link)
    before = snapshot(ckpt)
    with pytest.raises(TargetError, match="symbolic link"):
        tddist.save(TensorDict({"z": torch.ones(1)}, []), link)
    assert os.readlink(link) == str(ckpt)
    assert snapshot(ckpt) == before


def test_empty_directory_is_a_valid_target(tmp_path):
    """An existing empty directory may be saved into."""
    (tmp_path / "ckpt").mkdir()
    tddist.save(sample_td(), tmp_path / "ckpt")
    assert_td_equal(tddist.load(tmp_path / "ckpt", shard=None), sample_td())


def test_overwrite_replaces_checkpoint_completely(ckpt, tmp_path):
    """Saving over a checkpoint replaces it: keys only in the old one are gone, files
    included, and nothing is left beside it."""
    new = TensorDict({"data": TensorDict({"obs": -torch.ones(2, 4)}, [2]), "fresh": torch.tensor([1.5])}, [])
    tddist.save(new, ckpt, metadata={"gen": 2})
    back = tddist.load(ckpt, shard=None)
    assert_td_equal(back, new)
    files = snapshot(ckpt)
    assert not any("act" in p or "sub" in p or "table" in p or "step" in p for p in files)
    assert os.listdir(tmp_path) == ["ckpt"]
    m = tddist.read_manifest(ckpt)
    assert set(m.leaves) == {("data", "obs"), ("fresh",)} and m.metadata == {"gen": 2}


def test_failed_save_keeps_previous_checkpoint(ckpt, tmp_path):
    """A save that fails (here: a reserved key) leaves the previous checkpoint intact and no leftovers."""
    before = snapshot(ckpt)
    with pytest.raises(InvalidDataError):
        tddist.save(TensorDict({"shape": torch.ones(3)}, []), ckpt)
    assert snapshot(ckpt) == before
    assert os.listdir(tmp_path) == ["ckpt"]
    assert_td_equal(tddist.load(ckpt, shard=None, verify=True), sample_td())


def test_no_staging_leftovers_after_saves(tmp_path):
    """Repeated saves (create, replace, replace) leave only the target in the parent."""
    for i in range(3):
        tddist.save(TensorDict({"x": torch.full((4,), i)}, [4]), tmp_path / "ckpt")
        assert os.listdir(tmp_path) == ["ckpt"]
        assert tddist.load(tmp_path / "ckpt")["x"].tolist() == [i] * 4
    assert tddist.recover(tmp_path / "ckpt") == []


# --- recover ----------------------------------------------------------------------------------


def _side(tmp_path, name, kind):
    return tmp_path / f".{name}.tddist-{kind}-{uuid.uuid4().hex}"


def test_recover_removes_leftovers_only(ckpt, tmp_path):
    """recover removes staging and trash leftovers (and a stale backup) of this target, and
    leaves the committed checkpoint and every unrelated entry alone."""
    staging = _side(tmp_path, "ckpt", "staging")
    (staging / "rank-00000").mkdir(parents=True)
    (staging / "rank-00000" / "x.memmap").write_bytes(b"partial")
    staging_file = _side(tmp_path, "ckpt", "staging")
    staging_file.write_bytes(b"")
    trash = _side(tmp_path, "ckpt", "trash")
    (trash / "rank-00003").mkdir(parents=True)
    backup = _side(tmp_path, "ckpt", "backup")
    tddist.save(TensorDict({"old": torch.ones(1)}, []), backup)
    leftovers = {staging.name, staging_file.name, trash.name, backup.name}

    hexid = uuid.uuid4().hex
    unrelated = [
        f".other.tddist-staging-{hexid}",
        f".ckpt2.tddist-trash-{hexid}",
        f".ckpt.tddist-staging-{hexid[:31]}",
        f".ckpt.tddist-staging-{hexid.upper()}",
        f".ckpt.tddist-other-{hexid}",
        f"ckpt.tddist-staging-{hexid}",
        "ckpt2",
        "notes.txt",
    ]
    for name in unrelated:
        (tmp_path / name).mkdir() if not name.endswith(".txt") else (tmp_path / name).write_text("keep")
        if name != "notes.txt":
            (tmp_path / name / "keep").write_text("keep")
    before_target = snapshot(ckpt)
    before_unrelated = {
        n: snapshot(tmp_path / n) if (tmp_path / n).is_dir() else (tmp_path / n).read_text() for n in unrelated
    }

    done = tddist.recover(ckpt)
    assert len(done) == len(leftovers)
    assert all(any(name in line for line in done) for name in leftovers)
    assert sorted(os.listdir(tmp_path)) == sorted(["ckpt", *unrelated])
    assert snapshot(ckpt) == before_target
    after = {n: snapshot(tmp_path / n) if (tmp_path / n).is_dir() else (tmp_path / n).read_text() for n in unrelated}
    assert after == before_unrelated
    assert_td_equal(tddist.load(ckpt, shard=None, verify=True), sample_td())
    assert tddist.recover(ckpt) == []


def test_recover_restores_backup_when_target_missing(tmp_path):
    """A backup of a replaced checkpoint is moved back when the target is gone (crash in the
    middle of a replace); staging leftovers are still removed."""
    backup = _side(tmp_path, "ckpt", "backup")
    tddist.save(sample_td(), backup, metadata={"which": "backup"})
    staging = _side(tmp_path, "ckpt", "staging")
    staging.mkdir()
    done = tddist.recover(tmp_path / "ckpt")
    assert any("restored" in line for line in done)
    assert sorted(os.listdir(tmp_path)) == ["ckpt"]
    assert_td_equal(tddist.load(tmp_path / "ckpt", shard=None, verify=True), sample_td())
    assert tddist.read_manifest(tmp_path / "ckpt").metadata == {"which": "backup"}


def test_recover_restores_backup_over_torn_target(tmp_path):
    """A target that lost its manifest (a torn checkpoint) is replaced by a valid backup."""
    backup = _side(tmp_path, "ckpt", "backup")
    tddist.save(sample_td(), backup)
    (tmp_path / "ckpt" / "rank-00000").mkdir(parents=True)
    done = tddist.recover(tmp_path / "ckpt")
    assert any("restored" in line for line in done)
    assert sorted(os.listdir(tmp_path)) == ["ckpt"]
    assert_td_equal(tddist.load(tmp_path / "ckpt", shard=None, verify=True), sample_td())


@pytest.mark.parametrize("occupant", ["foreign-dir", "file"])
def test_recover_keeps_only_committed_copy_when_target_is_occupied(tmp_path, occupant):
    """If the target is occupied by something that is not a checkpoint, a backup holding the only
    committed checkpoint is neither restored over it nor deleted."""
    backup = _side(tmp_path, "ckpt", "backup")
    tddist.save(sample_td(), backup)
    if occupant == "file":
        (tmp_path / "ckpt").write_text("mine")
    else:
        (tmp_path / "ckpt").mkdir()
        (tmp_path / "ckpt" / "notes.txt").write_text("mine")
    before = snapshot(tmp_path / "ckpt") if occupant != "file" else "mine"
    tddist.recover(tmp_path / "ckpt")
    after = snapshot(tmp_path / "ckpt") if occupant != "file" else (tmp_path / "ckpt").read_text()
    assert after == before
    assert_td_equal(tddist.load(backup, shard=None, verify=True), sample_td())


def test_recover_never_deletes_through_a_symlink(tmp_path, ckpt):
    """A leftover name that is a symlink is unlinked, never followed: what it points to survives."""
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "data").write_text("keep")
    link = _side(tmp_path, "ckpt", "staging")
    os.symlink(outside, link)
    tddist.recover(ckpt)
    assert not os.path.lexists(link)
    assert (outside / "data").read_text() == "keep"


# --- loading defences ---------------------------------------------------------------------------


def test_packed_flipped_byte_is_found_in_its_leaf_only(packed):
    """A flipped byte inside one leaf's span of the packed data file fails that leaf's checksum only."""
    path, offset, size = chunk_span(packed, "data", "obs")
    assert size == 24 * 4 and offset % 64 == 0
    _flip_byte(path, offset + 17)
    with pytest.raises(CorruptCheckpointError, match="checksum"):
        tddist.load(packed, keys=("data", "obs"), shard=None, verify=True)
    damaged = tddist.load(packed, shard=None)["data", "obs"]
    assert (damaged != sample_td()["data", "obs"]).flatten().nonzero().flatten().tolist() == [17 // 4]
    ok = tddist.load(packed, keys=[("data", "act"), ("data", "sub"), "table", "step"], shard=None, verify=True)
    assert torch.equal(ok["table"], sample_td()["table"])


@pytest.mark.parametrize("change", ["truncate", "extend"])
def test_packed_data_file_of_the_wrong_size_is_refused(packed, change):
    """A packed data file shorter or longer than its chunks need is refused, even without verify."""
    path = os.path.join(packed, "rank-00000.data")
    size = os.path.getsize(path)
    with open(path, "r+b") as f:
        f.truncate(size - 1 if change == "truncate" else size + 64)
    with pytest.raises(CorruptCheckpointError, match="bytes"):
        tddist.load(packed, shard=None)


def test_packed_data_file_symlinked_outside_is_refused(packed, tmp_path):
    """A rank's data file replaced by a symlink (even to an identical file) is refused."""
    path = os.path.join(packed, "rank-00000.data")
    outside = tmp_path / "copy.data"
    os.rename(path, outside)
    os.symlink(outside, path)
    with pytest.raises(CorruptCheckpointError, match="not a regular file"):
        tddist.load(packed, shard=None)


def test_symlinked_rank_directory_is_refused(ckpt, tmp_path):
    """A rank directory replaced by a symlink pointing outside the checkpoint is refused on load."""
    outside = tmp_path / "elsewhere"
    os.rename(ckpt / "rank-00000", outside)
    os.symlink(outside, ckpt / "rank-00000")
    for verify in (False, True):
        with pytest.raises(CorruptCheckpointError, match="outside"):
            tddist.load(ckpt, verify=verify)
        with pytest.raises(CorruptCheckpointError, match="outside"):
            tddist.load(ckpt, shard=None, keys="table", verify=verify)


def test_symlinked_leaf_file_is_refused(ckpt, tmp_path):
    """A single data file replaced by a symlink to an outside file of the right size is refused."""
    path = leaf_file(ckpt, "table")
    outside = tmp_path / "table.bin"
    os.rename(path, outside)
    os.symlink(outside, path)
    with pytest.raises(CorruptCheckpointError, match="outside"):
        tddist.load(ckpt, shard=None)


@pytest.mark.parametrize(
    "key, nodes",
    [
        (["..", "..", "secret"], [[], [".."], ["..", ".."]]),
        (["../../secret"], [[]]),
        (["/abs/secret"], [[]]),
        pytest.param(["sec\0ret"], [[]], id="nul"),
    ],
    ids=["dotdot-nodes", "slashes", "absolute", "nul"],
)
def test_tampered_verbatim_keys_cannot_escape(tmp_path, key, nodes):
    """A manifest tampered to robust_key=False with path-like keys never makes load read a
    file outside the checkpoint: it is a tddist error (ManifestError or CorruptCheckpointError)."""
    target = tmp_path / "ckpt"
    tddist.save(TensorDict({"x": torch.arange(2)}, []), target)
    (tmp_path / "secret.memmap").write_bytes(b"\x07" * 16)
    m = json.loads((target / "tddist.json").read_text())
    m["robust_key"] = False
    m["nodes"] = [{"key": k, "batch_size": []} for k in nodes]
    m["leaves"][0]["key"] = key
    (target / "tddist.json").write_text(json.dumps(m))
    for verify in (False, True):
        with pytest.raises((ManifestError, CorruptCheckpointError)):
            tddist.load(target, shard=None, verify=verify)


def test_saved_shard_needs_same_world_size(tmp_path):
    """shard='saved' on a different world size is refused (InvalidArgumentError), in both directions."""
    two = tmp_path / "two"

    def save2(comm):
        return tddist.save(TensorDict({"x": torch.arange(comm.rank + 1)}, [comm.rank + 1]), two, comm=comm)

    assert not any(isinstance(r, BaseException) for r in tddist.run_threads(2, save2))
    with pytest.raises(InvalidArgumentError, match="shard='even'"):
        tddist.load(two, shard="saved")
    assert tddist.load(two)["x"].tolist() == [0, 0, 1]  # 'even' works on any world size

    one = tmp_path / "one"
    tddist.save(TensorDict({"x": torch.arange(3)}, [3]), one)
    results = tddist.run_threads(2, lambda comm: tddist.load(one, comm=comm, shard="saved"))
    assert all(isinstance(r, InvalidArgumentError) for r in results), results


def test_saved_rows_of_batched_node_without_sharded_leaf(tmp_path):
    """shard='saved' gives each rank the batch rows it saved, also for a batched sub-TensorDict
    that holds no tensor (rows 2, 0, 1 on three thread ranks)."""
    rows = (2, 0, 1)
    target = tmp_path / "ckpt"

    def save(comm):
        td = TensorDict({"e": TensorDict({}, [rows[comm.rank]]), "x": torch.arange(3)}, [])
        tddist.save(td, target, comm=comm)
        return tddist.load(target, comm=comm, shard="saved")["e"].batch_size

    results = tddist.run_threads(3, save)
    assert results == [torch.Size([n]) for n in rows]


def test_bad_arguments_are_refused(ckpt, tmp_path):
    """Invalid or unsupported option values are InvalidArgumentError before anything is written."""
    td = TensorDict({"x": torch.ones(2)}, [2])
    with pytest.raises(InvalidArgumentError):
        tddist.load(ckpt, shard="rows")
    with pytest.raises(InvalidArgumentError):
        tddist.load(ckpt, num_threads=1.5)
    with pytest.raises(InvalidArgumentError):
        tddist.save(td, tmp_path / "new", compression="zstd")
    with pytest.raises(InvalidArgumentError):
        tddist.save(td, tmp_path / "new", num_threads=-1)
    with pytest.raises(InvalidArgumentError):
        tddist.save(td, None)
    assert not (tmp_path / "new").exists()


# --- metadata --------------------------------------------------------------------------------


def test_metadata_round_trips(tmp_path):
    """JSON metadata (nested, unicode, numbers, null) comes back equal through read_manifest."""
    md = {"step": 1200, "lr": 3e-4, "name": "run ✓", "tags": ["a", "b"], "cfg": {"x": None, "y": [1, 2.5, True]}}
    tddist.save(sample_td(), tmp_path / "ckpt", metadata=md)
    m = tddist.read_manifest(tmp_path / "ckpt")
    assert m.metadata == md
    assert m.world_size == 1
    assert json.loads((tmp_path / "ckpt" / "tddist.json").read_text("utf-8"))["metadata"] == md


@pytest.mark.parametrize(
    "md",
    [
        {"t": torch.ones(1)},
        {"nan": float("nan")},
        {"inf": float("inf")},
        {"o": object()},
        {"s": {1, 2}},
        "not a dict",
        5,
    ],
    ids=["tensor", "nan", "inf", "object", "set", "string", "int"],
)
def test_non_json_metadata_is_refused(tmp_path, md):
    """Metadata that cannot be stored as JSON is InvalidArgumentError and nothing is written."""
    with pytest.raises(InvalidArgumentError, match="metadata"):
        tddist.save(sample_td(), tmp_path / "ckpt", metadata=md)
    assert os.listdir(tmp_path) == []


@pytest.mark.parametrize("md", [{1: "a"}, {1: "a", "1": "b"}, {"n": {None: 0}}], ids=["int", "clash", "nested-none"])
def test_metadata_with_non_string_keys_is_refused_or_kept(tmp_path, md):
    """Metadata either comes back exactly as given or is refused; never silently altered."""
    try:
        tddist.save(sample_td(), tmp_path / "ckpt", metadata=md)
    except InvalidArgumentError:
        return
    assert tddist.read_manifest(tmp_path / "ckpt").metadata == md


# --- copy-on-write mapping ----------------------------------------------------------------------


def test_packed_tensors_are_copy_on_write(packed):
    """Views of a packed data file are copy-on-write too: in-place changes never reach the file."""
    before = snapshot(packed)
    loaded = tddist.load(packed, shard=None)
    loaded["data", "obs"].mul_(-1)
    loaded["table"][0] = 999
    assert snapshot(packed) == before
    assert_td_equal(tddist.load(packed, shard=None, verify=True), sample_td())


def test_returned_tensors_are_copy_on_write(ckpt):
    """Modifying loaded (and saved-returned) tensors in place never writes into the checkpoint."""
    before = snapshot(ckpt)
    loaded = tddist.load(ckpt, shard=None)
    loaded["data", "obs"].mul_(-1)
    loaded["table"][0] = 999
    loaded["data", "sub", "d"].fill_(False)
    assert loaded["table"][0].item() == 999
    again = tddist.load(ckpt, shard=None, verify=True)
    assert_td_equal(again, sample_td())

    returned = tddist.save(sample_td(), ckpt, layout="memmap")
    after_save = snapshot(ckpt)
    returned["data", "act"].add_(100)
    returned["step"].fill_(-1)
    assert snapshot(ckpt) == after_save
    assert_td_equal(tddist.load(ckpt, shard=None, verify=True), sample_td())
    assert {k for k in before if k.endswith(".memmap")} == {k for k in after_save if k.endswith(".memmap")}


def _mapped_by(kind: str, path) -> torch.Tensor:
    """A float32 tensor of 256 values whose memory maps ``path``, made the way ``kind`` names."""
    import mmap

    import numpy as np
    from tensordict import MemoryMappedTensor

    path.write_bytes(bytes(1024))
    if kind == "from_file":
        return torch.from_file(str(path), shared=True, size=256)
    if kind == "numpy.memmap":
        return torch.from_numpy(np.memmap(path, dtype=np.float32, mode="r+"))
    if kind == "frombuffer":
        with open(path, "r+b") as f:
            return torch.frombuffer(mmap.mmap(f.fileno(), 1024), dtype=torch.float32)
    return MemoryMappedTensor.from_filename(str(path), dtype=torch.float32, shape=torch.Size([256]))


@pytest.mark.parametrize("kind", ["from_file", "numpy.memmap", "frombuffer", "MemoryMappedTensor"])
def test_every_way_of_mapping_a_file_is_refused(tmp_path, kind):
    """The check that skips reading /proc/self/maps for torch's own allocations still sees every mapped leaf:
    torch.from_file, a numpy.memmap, torch.frombuffer over an mmap and a MemoryMappedTensor, also as a view."""
    from tddist.saving.memmaps import allocated_by_torch

    mapped = _mapped_by(kind, tmp_path / "leaf.bin")
    assert not allocated_by_torch(mapped) and not allocated_by_torch(mapped[8:])
    assert allocated_by_torch(torch.zeros(256)) and allocated_by_torch(torch.zeros(2**21)[8:])
    for i, leaf in enumerate((mapped, mapped[8:].reshape(8, 31))):
        data = TensorDict({"plain": torch.zeros(3), "mapped": leaf}, [])
        with pytest.raises(
            InvalidDataError, match=r"leaf \['mapped'\] is memory-mapped from .*leaf.bin.*copy_existing"
        ):
            tddist.save(data, tmp_path / f"ck{i}", return_early=True).result()
        assert not (tmp_path / f"ck{i}").exists()
        out = tddist.save(data, tmp_path / f"ck{i}", copy_existing=True)
        assert torch.equal(out["mapped"], leaf)


def test_proc_maps_is_read_once_for_leaves_exported_to_numpy(tmp_path, monkeypatch):
    """``t.numpy()`` makes a storage torch allocated not resizable for good, so the quick check cannot vouch
    for it: the first save reads /proc/self/maps, finds it unmapped and remembers it; later saves of the
    same leaves read nothing. A mapped leaf saved next is still refused; a storage that moved is checked
    again, and one that died is forgotten."""
    import gc

    import numpy as np

    import tddist.saving.memmaps as memmaps

    reads = []
    real = memmaps.file_mappings
    monkeypatch.setattr(memmaps, "file_mappings", lambda: reads.append(1) or real())
    exported = torch.arange(2.0**20)
    exported.numpy()
    wrapped = torch.from_numpy(np.arange(1000.0))  # numpy's memory, no file
    data = TensorDict({"exported": exported, "wrapped": wrapped, "plain": torch.zeros(3)}, [])
    assert not memmaps.allocated_by_torch(exported)
    for i in range(3):
        if i == 1:
            tddist.save(data, tmp_path / f"ok{i}", return_early=True).result()
        else:
            tddist.save(data, tmp_path / f"ok{i}")
        assert len(reads) == 1, f"save {i} read /proc/self/maps again"
    assert_td_equal(tddist.load(tmp_path / "ok2", shard=None, verify=True), data)

    mapped = _mapped_by("from_file", tmp_path / "leaf.bin")
    with pytest.raises(InvalidDataError, match=r"leaf \['mapped'\] is memory-mapped from .*leaf.bin"):
        tddist.save(TensorDict({"exported": exported, "mapped": mapped}, []), tmp_path / "refused")
    assert len(reads) == 2 and not (tmp_path / "refused").exists()

    # what is remembered is a storage at one address and size, while it lives
    grown = torch.zeros(4)
    memmaps._unmapped.remember([grown])
    assert memmaps._unmapped.known(grown)
    grown.untyped_storage().resize_(2**22)
    assert not memmaps._unmapped.known(grown)  # moved: checked again
    dying = {t.untyped_storage()._cdata for t in data.values()}
    assert dying <= set(memmaps._unmapped._seen)
    del data, exported, wrapped
    gc.collect()
    memmaps._unmapped.remember([])
    assert not dying & set(memmaps._unmapped._seen)  # the dead storages are forgotten
