"""pack/unpack between directory and archive checkpoints, and the ``tddist`` command."""

from __future__ import annotations

import dataclasses
import datetime
import os
import pickle
import re
import subprocess
import sys
import zipfile

import pytest
import torch
from tensordict import TensorDict

import tddist
from tddist import format as fmt
from tests.helpers import assert_td_equal, leftovers


def _three_ranks(path):
    def rank_fn(c):
        td = TensorDict(x=torch.arange(12.0).view(4, 3) + c.rank, batch_size=[4])
        td.set_non_tensor("who", f"r{c.rank}")
        return tddist.save(td, path, comm=c)

    assert not any(isinstance(r, BaseException) for r in tddist.run_threads(3, rank_fn, timeout=60))


@pytest.mark.parametrize("compression", [None, "deflate", "zstd"])
def test_pack_then_unpack_round_trips(tmp_path, compression):
    _three_ranks(tmp_path / "d")
    tddist.pack(tmp_path / "d", tmp_path / "a.tdz", compression=compression)
    tddist.unpack(tmp_path / "a.tdz", tmp_path / "d2")
    original = tddist.load(tmp_path / "d", shard=None)
    for path in (tmp_path / "a.tdz", tmp_path / "d2"):
        back = tddist.load(path, shard=None, verify=True)
        assert_td_equal(back, original, path.name)
        assert back["who"] == ["r0", "r1", "r2"]
    assert tddist.read_manifest(tmp_path / "a.tdz").layout == "archive"
    assert tddist.read_manifest(tmp_path / "d2").layout == "directory"
    if compression in (None, "deflate"):
        assert zipfile.ZipFile(tmp_path / "a.tdz").testzip() is None
    assert leftovers(tmp_path / "*") == []


def test_pack_refuses_corrupt_source_and_foreign_destination(tmp_path):
    _three_ranks(tmp_path / "d")
    leaf = tmp_path / "d" / fmt.rank_data_name(1)  # its first chunk, at offset 0, is leaf "x"
    raw = bytearray(leaf.read_bytes())
    raw[0] ^= 0xFF
    leaf.write_bytes(bytes(raw))
    with pytest.raises(tddist.CorruptCheckpointError, match="checksum"):
        tddist.pack(tmp_path / "d", tmp_path / "a.tdz")
    assert not (tmp_path / "a.tdz").exists() and leftovers(tmp_path / "a.tdz", strict=True) == ["d"]
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "keep.txt").write_text("mine")
    _three_ranks(tmp_path / "good")
    tddist.pack(tmp_path / "good", tmp_path / "g.tdz")
    with pytest.raises(tddist.TargetError):
        tddist.unpack(tmp_path / "g.tdz", tmp_path / "other")
    assert (tmp_path / "other" / "keep.txt").read_text() == "mine"


def _cli(*args):
    return subprocess.run(
        [sys.executable, "-m", "tddist.cli", *map(str, args)], capture_output=True, text=True, timeout=120
    )


def test_command_line(tmp_path):
    _three_ranks(tmp_path / "d")
    r = _cli("info", tmp_path / "d", "--leaves")
    assert r.returncode == 0 and "world size 3" in r.stdout and re.search(r"^x\s+float32\s+\[12, 3\]", r.stdout, re.M)
    assert _cli("pack", tmp_path / "d", tmp_path / "a.tdz", "--compression", "deflate").returncode == 0
    assert _cli("unpack", tmp_path / "a.tdz", tmp_path / "d2").returncode == 0
    assert _cli("verify", tmp_path / "d2").returncode == 0
    os.mkdir(tmp_path / f".d.tddist-staging-{'0' * 32}")
    r = _cli("recover", tmp_path / "d")
    assert r.returncode == 0 and "removed" in r.stdout
    leaf = tmp_path / "d2" / fmt.rank_dir(0) / "x.memmap"
    raw = bytearray(leaf.read_bytes())
    raw[-1] ^= 1
    leaf.write_bytes(bytes(raw))
    r = _cli("verify", tmp_path / "d2")
    assert r.returncode == 1 and "checksum mismatch" in r.stderr
    r = _cli("info", tmp_path / "missing")
    assert r.returncode == 1 and "does not exist" in r.stderr


def test_convert_command_options_and_other_formats_named_by_info_and_verify(tmp_path, capsys):
    import torch.distributed.checkpoint as dcp
    from safetensors.torch import save_file

    from tddist.cli import main

    src = tmp_path / "dcp"
    dcp.save({"model": {"w": torch.arange(3.0)}, "step": 2}, checkpoint_id=str(src), no_dist=True)
    (tmp_path / "hf").mkdir()
    save_file({"w": torch.ones(2)}, str(tmp_path / "hf" / "model.safetensors"))
    for command in ("info", "verify"):
        for path, what in ((src, "(DCP) directory"), (tmp_path / "hf", "Hugging Face safetensors directory")):
            assert main([command, str(path)]) == 1
            err = capsys.readouterr().err
            assert what in err and "not a tddist checkpoint" in err and f"'tddist convert {path} DST'" in err, err

    assert main(["convert", str(src), str(tmp_path / "nested"), "--nested"]) == 0  # DCP's nesting kept
    assert set(tddist.read_manifest(tmp_path / "nested").leaves) == {("model", "w")}
    assert main(["info", str(tmp_path / "nested")]) == 0

    md = pickle.loads((src / ".metadata").read_bytes())
    md = dataclasses.replace(md, planner_data={**md.planner_data, "saved_on": datetime.date(2024, 1, 2)})
    (src / ".metadata").write_bytes(pickle.dumps(md))
    capsys.readouterr()
    assert main(["convert", str(src), str(tmp_path / "out")]) == 1
    err = capsys.readouterr().err
    assert "datetime.date" in err and "can run any code" in err and "--trust-pickle" in err, err
    assert main(["convert", str(src), str(tmp_path / "out"), "--trust-pickle"]) == 0

    assert main(["convert", str(tmp_path / "out"), str(tmp_path / "m.safetensor")]) == 1
    err = capsys.readouterr().err
    assert "did you mean .safetensors?" in err and "--to" in err and not (tmp_path / "m.safetensor").exists(), err
