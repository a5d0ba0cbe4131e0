"""tddist.convert between tddist, DCP, torch.save and safetensors, on real multi-rank checkpoints.

Every comparison is bit for bit (``torch.equal`` on same-dtype tensors).
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import os
import pickle
import subprocess
import sys
from collections import OrderedDict
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file
from tensordict import TensorDict

import tddist
from tddist.cli import main as cli_main
from tests.helpers import assert_td_equal, leftovers
from tests.launch_util import REPO, run_job

SCRIPT = REPO / "tests" / "convert_rank.py"


def _flat(obj, prefix: str = "") -> dict:
    """A nested state as DCP's default planner names it: dicts by key, lists holding dicts by index."""
    out = {}
    items = obj.items() if isinstance(obj, dict) else enumerate(obj)
    for k, v in items:
        name = f"{prefix}{k}"
        if isinstance(v, dict) or (isinstance(v, list) and any(isinstance(x, dict) for x in v)):
            out.update(_flat(v, name + "."))
        else:
            out[name] = list(v) if isinstance(v, tuple) else v
    return out


def _equal_tensors(got: dict, expected: dict, what: str) -> None:
    exp = {k: v for k, v in expected.items() if isinstance(v, torch.Tensor)}
    assert sorted(got) == sorted(exp), what
    for k, v in exp.items():
        assert got[k].dtype == v.dtype and torch.equal(got[k], v), f"{what}: {k}"


@pytest.mark.multirank
def test_fsdp_and_dcp_checkpoints_convert_bit_exact(tmp_path):
    """FSDP2 + AdamW on 2 ranks, saved by tddist and by dcp.save: to safetensors, to tddist, to DCP for 3 ranks,
    and nested into a CheckpointManager's root that 3 ranks resume."""
    run_job("spawn", 2, SCRIPT, [str(tmp_path), "save"], tmp_path / "rep-save", timeout=240).assert_ok(2)
    ref = torch.load(tmp_path / "ref.pt", weights_only=True)
    expected = _flat(ref)
    assert any(k.startswith("optim.state.") for k in expected) and "optim.param_groups.0.lr" in expected

    # tddist (2 ranks, sharded DTensors) -> Hugging Face sharded safetensors directory
    hf = tddist.convert(tmp_path / "fsdp", tmp_path / "hf", "safetensors", max_shard_size="300B")
    index = json.loads((Path(hf) / "model.safetensors.index.json").read_text())
    files = sorted(set(index["weight_map"].values()))
    assert len(files) > 1 and files[0] == f"model-00001-of-{len(files):05d}.safetensors"
    loaded = {}
    for f in files:
        loaded.update(load_file(Path(hf) / f))
    _equal_tensors(loaded, expected, "tddist -> safetensors")
    assert index["metadata"]["total_size"] == sum(t.nbytes for t in loaded.values())
    values = json.loads(index["metadata"]["tddist.values"])
    assert values["optim.param_groups"][0]["betas"] == [0.8, 0.95]

    # dcp.save (2 ranks) -> tddist: flat DCP names, non-tensor values as JSON
    tddist.convert(tmp_path / "dcp", tmp_path / "from-dcp")
    td = tddist.load(tmp_path / "from-dcp", shard=None)
    got = {k: td[k] for k in td.keys(True, True)}  # flat names: one-part keys
    _equal_tensors({k: v for k, v in got.items() if isinstance(v, torch.Tensor)}, expected, "dcp -> tddist")
    assert td["optim.param_groups.0.lr"] == 0.01 and td["optim.param_groups.0.betas"] == [0.8, 0.95]
    assert tddist.read_manifest(tmp_path / "from-dcp").objects  # stored as JSON values, no pickle

    # tddist -> DCP, loaded by dcp.load on 3 ranks into FSDP2 + AdamW (checked in the rank program)
    tddist.convert(tmp_path / "fsdp", tmp_path / "export-dcp", "dcp")
    run_job("spawn", 3, SCRIPT, [str(tmp_path), "load"], tmp_path / "rep-load", timeout=240).assert_ok(3)
    # dcp.save (2 ranks) -> a CheckpointManager's root, nested: resumed on 3 ranks (checked in the rank program)
    tddist.convert(tmp_path / "dcp", tmp_path / "root" / "step-000000002", nested=True)
    run_job("spawn", 3, SCRIPT, [str(tmp_path), "resume"], tmp_path / "rep-resume", timeout=240).assert_ok(3)
    # ... and back: the marked export gives tddist's nested keys again
    tddist.convert(tmp_path / "export-dcp", tmp_path / "back")
    assert_td_equal(
        tddist.load(tmp_path / "back", shard=None), tddist.load(tmp_path / "fsdp", shard=None), "dcp export -> tddist"
    )
    assert leftovers(tmp_path / "*") == []


def _state() -> TensorDict:
    g = torch.Generator().manual_seed(1)
    return TensorDict(
        model=TensorDict(
            {"layers.0.w": torch.randn(5, 3, generator=g), "emb": torch.randn(7, 2, generator=g).to(torch.bfloat16)}
        ),
        step=torch.tensor(12, dtype=torch.int64),
        mask=torch.tensor([True, False, True]),
        extra=TensorDict(x=torch.arange(6).view(3, 2), batch_size=[3]),
    )


def _two_ranks(path) -> TensorDict:
    def rank_fn(c):
        state = _state()
        state["extra"] = state["extra"][c.rank : c.rank + 2]  # rows 0-1 and 1-2: sharded along dim 0
        state.set_non_tensor(("hp", "lr"), 0.25)
        return tddist.save(state, path, comm=c)

    results = tddist.run_threads(2, rank_fn, timeout=60)
    assert not any(isinstance(r, BaseException) for r in results), results
    return tddist.load(path, shard=None)


def test_torch_file_round_trips(tmp_path):
    full = _two_ranks(tmp_path / "ck")
    tddist.convert(tmp_path / "ck", tmp_path / "a.pt")
    flat = torch.load(tmp_path / "a.pt", weights_only=True)
    assert isinstance(flat, OrderedDict) and "model.layers.0.w" in flat and flat["hp.lr"] == 0.25
    assert torch.equal(flat["extra.x"], full["extra", "x"])  # the two ranks' rows, consolidated
    tddist.convert(tmp_path / "a.pt", tmp_path / "back")
    assert_td_equal(tddist.load(tmp_path / "back", shard=None), full, "tddist -> torch -> tddist", batch_sizes=False)

    # a torch.save file of someone else's nested dict: names joined with ".", kept flat
    torch.save({"model": {"w": torch.ones(2)}, "epoch": 3}, tmp_path / "user.pth")
    tddist.convert(tmp_path / "user.pth", tmp_path / "user")
    td = tddist.load(tmp_path / "user", shard=None)
    assert sorted(td.keys()) == ["epoch", "model.w"] and td["epoch"] == 3

    # a tddist value that is a dict stays one value through a flat format
    cfg = TensorDict(w=torch.ones(1))
    cfg.set_non_tensor("cfg", {"lr": 0.1, "betas": [0.9, 0.99]})
    tddist.save(cfg, tmp_path / "cfg")
    assert list(tddist.read_manifest(tmp_path / "cfg").objects) == [("cfg",)]
    for flat in ("cfg.pt", "cfg.safetensors"):
        tddist.convert(tmp_path / "cfg", tmp_path / flat)
        tddist.convert(tmp_path / flat, tmp_path / f"{flat}.back", "tddist")
        assert_td_equal(tddist.load(tmp_path / f"{flat}.back", shard=None), tddist.load(tmp_path / "cfg", shard=None))


def test_directory_and_archive_convert_both_ways(tmp_path):
    full = _two_ranks(tmp_path / "ck")
    tddist.convert(tmp_path / "ck", tmp_path / "a.tdz", compression="deflate")
    assert tddist.read_manifest(tmp_path / "a.tdz").world_size == 2  # pack keeps the ranks' shards
    tddist.convert(tmp_path / "a.tdz", tmp_path / "d")
    tddist.convert(tmp_path / "ck", tmp_path / "one.tdz", consolidate=True)
    assert tddist.read_manifest(tmp_path / "one.tdz").world_size == 1
    for p in ("a.tdz", "d", "one.tdz"):
        back = tddist.load(tmp_path / p, shard=None, verify=True)
        assert_td_equal(back, full, p, batch_sizes=p != "one.tdz")
    with pytest.raises(tddist.InvalidArgumentError, match="consolidate=False"):
        tddist.convert(tmp_path / "ck", tmp_path / "x.pt", consolidate=False)
    assert leftovers(tmp_path / "*") == []


def test_prefix_and_dtype(tmp_path, capsys):
    full = _two_ranks(tmp_path / "ck")
    tddist.convert(tmp_path / "ck", tmp_path / "m.safetensors", prefix="model/", dtype="float16")
    got = load_file(tmp_path / "m.safetensors")
    assert sorted(got) == ["emb", "layers.0.w"]
    assert got["layers.0.w"].dtype == torch.float16 and got["emb"].dtype == torch.float16
    assert torch.equal(got["layers.0.w"], full["model", "layers.0.w"].to(torch.float16))
    with safe_open(tmp_path / "m.safetensors", "pt") as f:
        assert f.metadata()["tddist.export"] == "1"
    # the command: floating leaves cast, others kept; a flat prefix ending inside a name
    argv = ["convert", str(tmp_path / "ck"), str(tmp_path / "all.pt"), "--dtype", "bfloat16", "--json"]
    assert cli_main(argv) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["schema"] == "tddist.convert/1" and doc["from"] == "tddist" and doc["to"] == "torch"
    flat = torch.load(tmp_path / "all.pt", weights_only=True)
    assert flat["step"].dtype == torch.int64 and flat["mask"].dtype == torch.bool
    assert flat["model.layers.0.w"].dtype == torch.bfloat16
    torch.save({"model.layers.0.w": torch.ones(2), "model.emb": torch.zeros(1)}, tmp_path / "user.pt")
    argv = ["convert", str(tmp_path / "user.pt"), str(tmp_path / "l.safetensors"), "--prefix", "model.layers."]
    assert cli_main(argv) == 0
    assert sorted(load_file(tmp_path / "l.safetensors")) == ["0.w"]
    with pytest.raises(tddist.InvalidArgumentError, match="nothing under the prefix"):
        tddist.convert(tmp_path / "ck", tmp_path / "none.pt", prefix="nope/")


def test_a_failed_conversion_leaves_nothing(tmp_path):
    tddist.save({"w": torch.ones(3), "z": torch.zeros(2, dtype=torch.complex64)}, tmp_path / "ck")
    for dst in ("c.safetensors", "hfdir"):
        with pytest.raises(tddist.InvalidDataError, match="safetensors cannot store"):
            tddist.convert(tmp_path / "ck", tmp_path / dst, "safetensors")
        assert not (tmp_path / dst).exists()
    (tmp_path / "taken.pt").write_bytes(b"mine")
    with pytest.raises(tddist.TargetError, match="exists"):
        tddist.convert(tmp_path / "ck", tmp_path / "taken.pt")
    with pytest.raises(tddist.TargetError, match="not a torch checkpoint"):
        tddist.convert(tmp_path / "ck", tmp_path / "taken.pt", overwrite=True)
    assert (tmp_path / "taken.pt").read_bytes() == b"mine"
    tddist.convert(tmp_path / "ck", tmp_path / "w.pt")
    tddist.convert(tmp_path / "ck", tmp_path / "w.pt", dtype="float64", overwrite=True)  # same format: replaced
    assert torch.load(tmp_path / "w.pt", weights_only=True)["w"].dtype == torch.float64
    assert leftovers(tmp_path / "*") == []


def test_pickles_need_allow_pickle(tmp_path):
    torch.save({"w": torch.ones(2), "when": datetime.date(2024, 1, 2)}, tmp_path / "p.pt")
    with pytest.raises(tddist.InvalidArgumentError, match="allow_pickle"):
        tddist.convert(tmp_path / "p.pt", tmp_path / "out")
    assert not (tmp_path / "out").exists()
    tddist.convert(tmp_path / "p.pt", tmp_path / "out", allow_pickle=True)
    with pytest.raises(tddist.InvalidArgumentError, match="pickle"):
        tddist.load(tmp_path / "out", shard=None)
    assert tddist.load(tmp_path / "out", shard=None, allow_pickle=True)["when"] == datetime.date(2024, 1, 2)


def test_bad_sources_name_the_problem(tmp_path):
    with pytest.raises(tddist.CheckpointNotFoundError):
        tddist.convert(tmp_path / "missing.pt", tmp_path / "out")
    (tmp_path / "notes.txt").write_text("hello")
    with pytest.raises(tddist.InvalidArgumentError, match="cannot tell the format"):
        tddist.convert(tmp_path / "notes.txt", tmp_path / "out")
    (tmp_path / "empty").mkdir()
    with pytest.raises(tddist.InvalidArgumentError, match="without tddist.json"):
        tddist.convert(tmp_path / "empty", tmp_path / "out")
    (tmp_path / "bad.safetensors").write_bytes(b"\x00" * 16)
    with pytest.raises(tddist.InvalidDataError, match="not a readable safetensors file"):
        tddist.convert(tmp_path / "bad.safetensors", tmp_path / "out")
    (tmp_path / "hf").mkdir()
    (tmp_path / "hf" / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"w": "../x.safetensors"}}))
    with pytest.raises(tddist.InvalidDataError, match="not a .safetensors file beside it"):
        tddist.convert(tmp_path / "hf", tmp_path / "out")
    torch.save([torch.ones(2)], tmp_path / "list.pt")
    with pytest.raises(tddist.InvalidDataError, match="not a dict of tensors"):
        tddist.convert(tmp_path / "list.pt", tmp_path / "out")
    with pytest.raises(tddist.InvalidArgumentError, match="floating-point"):
        tddist.convert(tmp_path / "list.pt", tmp_path / "out", dtype="int8")
    assert not (tmp_path / "out").exists()


_PEAK = r"""
import sys, tddist, tddist.api, tddist.interop.convert, tddist.interop.hf, tddist.interop.native


def status(field):
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith(field))


for dst in sys.argv[2:]:
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # the peak (VmHWM) starts again from the current RSS
    before = status("VmRSS:")
    tddist.convert(sys.argv[1], dst, "safetensors", max_shard_size="64MiB")
    print(status("VmHWM:") - before)
"""

LEAF = 64 << 20


def test_peak_memory_stays_near_one_leaf(tmp_path):
    """8 leaves of 64 MiB to one safetensors file: the peak RSS grows by under 3 leaves (about one, measured).

    A sharded directory is written by the same per-file writer, one file at a time.
    """
    tddist.save({f"l{i}": torch.full((LEAF // 4,), float(i)) for i in range(8)}, tmp_path / "ck")
    dsts = [str(tmp_path / "one.safetensors")]
    out = subprocess.run(
        [sys.executable, "-c", _PEAK, str(tmp_path / "ck"), *dsts], capture_output=True, text=True, cwd=REPO,
        timeout=300, env={**os.environ, "PYTHONPATH": str(REPO)},
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    peaks = dict(zip(["one file"], map(int, out.stdout.split())))
    print({k: f"+{v / 2**20:.0f} MiB" for k, v in peaks.items()})
    assert len(peaks) == 1 and all(0 < p < 3 * LEAF for p in peaks.values()), peaks
    with safe_open(tmp_path / "one.safetensors", "pt") as f:
        assert torch.equal(f.get_tensor("l3"), torch.full((LEAF // 4,), 3.0))


_ANON_PEAK = r"""
import sys, threading, time, tddist, tddist.api, tddist.interop.convert, tddist.interop.dcp, tddist.interop.native
import tddist.interop.torch_file


def anon():
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("RssAnon:"))


peak, running = [0], [True]


def sample():
    while running[0]:
        peak[0] = max(peak[0], anon())
        time.sleep(0.001)


threading.Thread(target=sample, daemon=True).start()
for job in sys.argv[1:]:
    src, dst, to, dtype = job.split("=>")
    before = peak[0] = anon()
    tddist.convert(src, dst, to or None, dtype=dtype or None)
    time.sleep(0.01)
    print(peak[0] - before)
running[0] = False
"""


def test_whole_dict_targets_hold_about_one_leaf_in_memory(tmp_path):
    """8 leaves of 32 MiB read into memory (from DCP, or cast) into targets that take every leaf at once
    (torch.save, DCP, tddist, .tdz): anonymous memory grows by a few leaves at most, not by all 8.

    Each leaf read into memory is spilled to a file beside the destination and handed on as a map of it (page
    cache, which the kernel reclaims), so the leaves do not pile up; the spill files are unlinked at once, so
    none is left beside the destination. DCP's own reader holds two more copies of the leaf it loads (the bytes
    read and the tensor decoded from them) before copying it out: under 3 leaves from DCP (2 measured), under 2 from a cast (1).
    """
    import torch.distributed.checkpoint as dcp
    from safetensors.torch import save_file

    n = 8 * (1 << 20)  # 32 MiB of float32
    leaf = 4 * n
    state = {f"l{i}": torch.full((n,), float(i)) for i in range(8)}
    dcp.save(state, checkpoint_id=str(tmp_path / "dcp"), no_dist=True)
    save_file(state, str(tmp_path / "src.safetensors"))
    out = tmp_path / "out"
    out.mkdir()
    jobs = [  # source, destination, cast, the bound on the growth of anonymous memory
        (tmp_path / "dcp", out / "a.pt", "", 3 * leaf),
        (tmp_path / "dcp", out / "b.dcp", "", 3 * leaf),  # to="dcp" by its suffix below
        (tmp_path / "dcp", out / "c", "", 3 * leaf),
        (tmp_path / "src.safetensors", out / "d.tdz", "float64", 2 * 2 * leaf),  # a float64 leaf is 2 float32 ones
        (tmp_path / "src.safetensors", out / "e.pt", "float64", 2 * 2 * leaf),
    ]
    res = subprocess.run(
        [sys.executable, "-c", _ANON_PEAK, *(f"{a}=>{b}=>{'dcp' if b.suffix == '.dcp' else ''}=>{c}" for a, b, c, _ in jobs)], capture_output=True,
        text=True, cwd=REPO, timeout=300, env={**os.environ, "PYTHONPATH": str(REPO)},
    )  # fmt: skip
    assert res.returncode == 0, res.stderr[-3000:]
    peaks = dict(zip([b.name for _a, b, _c, _m in jobs], map(int, res.stdout.split())))
    print({k: f"+{v / 2**20:.0f} MiB" for k, v in peaks.items()})
    assert len(peaks) == len(jobs), res.stdout
    for _a, b, _c, bound in jobs:
        assert peaks[b.name] < bound, (b.name, peaks)
    assert sorted(p.name for p in out.iterdir()) == ["a.pt", "b.dcp", "c", "d.tdz", "e.pt"]  # no spill file left
    for name, dtype in (("a.pt", torch.float32), ("e.pt", torch.float64)):
        loaded = torch.load(out / name, weights_only=True)
        assert all(torch.equal(loaded[k], v.to(dtype)) for k, v in state.items())
    for ck, dtype in ((out / "c", torch.float32), (out / "d.tdz", torch.float64)):
        td = tddist.load(ck, verify=True)
        assert all(torch.equal(td[k], v.to(dtype)) for k, v in state.items())
    back = {k: torch.empty_like(v) for k, v in state.items()}
    dcp.load(back, checkpoint_id=str(out / "b.dcp"), no_dist=True)
    assert all(torch.equal(back[k], v) for k, v in state.items())


def test_public_functions_are_not_shadowed_by_their_modules():
    """Importing the modules that define them must not turn tddist.convert/pack/unpack into modules."""
    import tddist.cli.convert
    import tddist.cli.pack
    import tddist.interop.convert
    import tddist.tools.pack

    assert all(callable(getattr(tddist, name)) for name in ("convert", "pack", "unpack"))


def test_command_shows_a_bar_on_a_terminal_and_documents_its_json(tmp_path, capsys):
    from tests.test_cli import _with_tty_stderr, documented_members

    tddist.save({"w": torch.zeros(1 << 18)}, tmp_path / "big")  # 1 MiB
    rc, shown = _with_tty_stderr(["convert", tmp_path / "big", tmp_path / "big.safetensors"])
    assert rc == 0 and "convert:" in shown and "%|" in shown, shown
    assert cli_main(["convert", str(tmp_path / "big.safetensors"), str(tmp_path / "b.pt"), "--json"]) == 0
    out = capsys.readouterr()
    doc = json.loads(out.out)
    assert out.err == "" and set(doc) == documented_members()["tddist.convert/1"]
    assert doc["from"] == "safetensors" and doc["bytes"] == os.path.getsize(tmp_path / "b.pt")
    assert cli_main(["convert", str(tmp_path / "big"), str(tmp_path / "b.pt")]) == 1  # exists, no --force
    assert "--force" in capsys.readouterr().err


# --- hostile and foreign sources: each ends in a TddistError, quickly (the timeouts catch a hang) ----------------


def _dcp(path: Path, state: dict | None = None) -> Path:
    import torch.distributed.checkpoint as dcp

    dcp.save(state or {"w": torch.arange(4.0), "step": 3}, checkpoint_id=str(path), no_dist=True)
    return path


class _RunsCode:
    """Unpickling it creates the directory ``marker``: what a hostile pickle can do, made visible."""

    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self):
        return (os.mkdir, (self.marker,))


@pytest.mark.timeout(120)
def test_dcp_metadata_runs_no_code_and_needs_trust_pickle_beyond_dcps_own(tmp_path):
    src = _dcp(tmp_path / "dcp")
    real = (src / ".metadata").read_bytes()
    marker = tmp_path / "ran"
    (src / ".metadata").write_bytes(pickle.dumps(_RunsCode(str(marker))))
    with pytest.raises(tddist.InvalidArgumentError, match=r"names posix\.mkdir.*can run any code.*trust_pickle=True"):
        tddist.convert(src, tmp_path / "out")
    assert not marker.exists() and not (tmp_path / "out").exists()

    # DCP's own metadata needs no opt-in (the other tests); an object beyond it, here a date that a custom planner
    # kept in planner_data, is refused unless trust_pickle
    md = pickle.loads(real)
    md = dataclasses.replace(md, planner_data={**md.planner_data, "saved_on": datetime.date(2024, 1, 2)})
    (src / ".metadata").write_bytes(pickle.dumps(md))
    with pytest.raises(tddist.InvalidArgumentError, match=r"names datetime\.date.*trust_pickle=True"):
        tddist.convert(src, tmp_path / "out")
    tddist.convert(src, tmp_path / "out", trust_pickle=True)
    td = tddist.load(tmp_path / "out", shard=None)
    assert td["w"].tolist() == [0.0, 1.0, 2.0, 3.0] and td["step"] == 3


@pytest.mark.timeout(120)
def test_a_dcp_entry_weights_only_refuses_is_a_tddist_error(tmp_path):
    """DCP raises CheckpointException, a BaseException, from inside dcp.load: it must not escape as such."""
    src = _dcp(tmp_path / "dcp", {"w": torch.ones(2), "when": datetime.date(2024, 1, 2)})
    with pytest.raises(tddist.InvalidArgumentError, match=r"DCP entry 'when' .*allow_pickle=True"):
        tddist.convert(src, tmp_path / "out")
    assert not (tmp_path / "out").exists()
    tddist.convert(src, tmp_path / "out", allow_pickle=True)
    assert tddist.load(tmp_path / "out", shard=None, allow_pickle=True)["when"] == datetime.date(2024, 1, 2)
    data = next(src.glob("*.distcp"))
    data.write_bytes(data.read_bytes()[:10])  # truncated
    with pytest.raises(tddist.InvalidDataError, match=r"cannot read the DCP entry 'w' .*damaged or incomplete"):
        tddist.convert(src, tmp_path / "out2")
    assert not (tmp_path / "out2").exists()


@pytest.mark.timeout(120)
def test_dcp_data_files_must_be_regular_files_inside_the_checkpoint(tmp_path):
    src = _dcp(tmp_path / "dcp")
    (data,) = src.glob("*.distcp")
    md = pickle.loads((src / ".metadata").read_bytes())
    outside = tmp_path / "outside.distcp"
    os.rename(data, outside)
    # metadata naming a file beside the checkpoint
    storage = {k: dataclasses.replace(v, relative_path="../outside.distcp") for k, v in md.storage_data.items()}
    (src / ".metadata").write_bytes(pickle.dumps(dataclasses.replace(md, storage_data=storage)))
    with pytest.raises(tddist.InvalidDataError, match="'../outside.distcp' .* is not a plain file name"):
        tddist.convert(src, tmp_path / "out")
    # a symbolic link out of the checkpoint
    (src / ".metadata").write_bytes(pickle.dumps(md))
    os.symlink(outside, data)
    with pytest.raises(tddist.InvalidDataError, match="symbolic link .* outside"):
        tddist.convert(src, tmp_path / "out")
    # a FIFO, which would block DCP's read forever
    data.unlink()
    os.mkfifo(data)
    error, message = _convert_in_child(src, tmp_path / "out")
    assert error == "InvalidDataError" and "not a regular file" in message, message
    assert not (tmp_path / "out").exists()


def _raw_safetensors(path: Path, header: dict, data: bytes) -> Path:
    """A safetensors file as written by hand: ``<u64 header length><JSON header><data>``."""
    head = json.dumps(header).encode()
    head += b" " * (-len(head) % 8)
    path.write_bytes(len(head).to_bytes(8, "little") + head + data)
    return path


_CHILD = r"""
import json, sys, tddist
try:
    tddist.convert(sys.argv[1], sys.argv[2])
except tddist.TddistError as e:
    print(json.dumps([type(e).__name__, str(e)]))
else:
    print(json.dumps([None, "converted"]))
"""


def _convert_in_child(src: Path, dst: Path, timeout: float = 60) -> tuple[str | None, str]:
    """``tddist.convert(src, dst)`` in a child process, killed (and the test failed) after ``timeout`` seconds.

    A FIFO blocks an open inside native code (the safetensors library retries
    an interrupted open), where no timeout of this process can reach it.
    Returns the TddistError's class name and message (None, "converted" if it succeeded).
    """
    out = subprocess.run(
        [sys.executable, "-c", _CHILD, str(src), str(dst)], capture_output=True, text=True, cwd=REPO,
        timeout=timeout, env={**os.environ, "PYTHONPATH": str(REPO)},
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    error, message = json.loads(out.stdout.splitlines()[-1])
    return error, message


_SHARD = "model-00001-of-00001.safetensors"
_DEEP = "[" * 100_000 + "]" * 100_000  # JSON nested 100,000 deep


def _hf_dir(tmp_path: Path, index: str) -> Path:
    """A Hugging Face sharded directory holding only its index (the shards are up to the test)."""
    hf = tmp_path / "hf"
    hf.mkdir()
    (hf / "model.safetensors.index.json").write_text(index)
    return hf


@pytest.mark.timeout(120)
def test_json_nested_too_deep_is_refused(tmp_path):
    from safetensors.torch import save_file

    hf = _hf_dir(tmp_path, json.dumps({"weight_map": {"w": _SHARD}, "metadata": "X"}).replace('"X"', _DEEP))
    save_file({"w": torch.ones(2)}, str(hf / _SHARD))
    with pytest.raises(tddist.InvalidDataError, match="deeper than 64 levels"):
        tddist.convert(hf, tmp_path / "out")
    # a marked export's values
    save_file({"w": torch.ones(2)}, str(tmp_path / "deep.safetensors"), {"tddist.export": "1", "tddist.values": _DEEP})
    with pytest.raises(tddist.InvalidDataError, match="deeper than 64 levels"):
        tddist.convert(tmp_path / "deep.safetensors", tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_a_fifo_named_as_a_shard_is_refused_without_blocking(tmp_path):
    hf = _hf_dir(tmp_path, json.dumps({"weight_map": {"w": _SHARD}}))
    os.mkfifo(hf / _SHARD)  # opening it for reading would wait for a writer forever
    error, message = _convert_in_child(hf, tmp_path / "out")
    assert error == "InvalidDataError" and "is not a regular file" in message, message
    assert not (tmp_path / "out").exists()


@pytest.mark.timeout(120)
def test_a_shard_linked_from_outside_the_directory_is_refused(tmp_path):
    from safetensors.torch import save_file

    hf = _hf_dir(tmp_path, json.dumps({"weight_map": {"w": _SHARD}}))
    save_file({"w": torch.ones(2)}, str(tmp_path / "elsewhere.safetensors"))
    os.symlink(tmp_path / "elsewhere.safetensors", hf / _SHARD)
    with pytest.raises(tddist.InvalidDataError, match="symbolic link .* outside .* copy the file into it"):
        tddist.convert(hf, tmp_path / "out")
    # the same for a save_pretrained directory's model.safetensors
    (hf / _SHARD).unlink()
    (hf / "model.safetensors.index.json").unlink()
    os.symlink(tmp_path / "elsewhere.safetensors", hf / "model.safetensors")
    with pytest.raises(tddist.InvalidDataError, match="symbolic link .* outside"):
        tddist.convert(hf, tmp_path / "out")
    assert not (tmp_path / "out").exists()
    # a link that stays inside the directory is followed
    (hf / "model.safetensors").unlink()
    os.rename(tmp_path / "elsewhere.safetensors", hf / "weights.bin")
    os.symlink("weights.bin", hf / "model.safetensors")
    tddist.convert(hf, tmp_path / "out.pt")
    assert torch.load(tmp_path / "out.pt", weights_only=True)["w"].tolist() == [1.0, 1.0]


@pytest.mark.timeout(120)
def test_safetensors_tensors_must_not_share_bytes_or_leave_the_data(tmp_path):
    def f32(start: int, end: int) -> dict:
        return {"dtype": "F32", "shape": [(end - start) // 4], "data_offsets": [start, end]}

    _raw_safetensors(tmp_path / "shared.safetensors", {"a": f32(0, 8), "b": f32(4, 12)}, bytes(12))
    with pytest.raises(tddist.InvalidDataError, match="tensors 'a' and 'b' share bytes"):
        tddist.convert(tmp_path / "shared.safetensors", tmp_path / "out")
    _raw_safetensors(tmp_path / "same.safetensors", {"a": f32(0, 8), "b": f32(0, 8)}, bytes(8))
    with pytest.raises(tddist.InvalidDataError, match="share bytes"):
        tddist.convert(tmp_path / "same.safetensors", tmp_path / "out")
    _raw_safetensors(tmp_path / "past.safetensors", {"a": f32(0, 8), "b": f32(8, 16)}, bytes(8))
    with pytest.raises(tddist.InvalidDataError, match=r"'b' has the data_offsets \[8, 16\], outside the 8 bytes"):
        tddist.convert(tmp_path / "past.safetensors", tmp_path / "out")
    assert not (tmp_path / "out").exists()
    empty = {"dtype": "F32", "shape": [0], "data_offsets": [8, 8]}  # holds no bytes: shares none
    ok = _raw_safetensors(tmp_path / "ok.safetensors", {"a": f32(0, 8), "e": empty, "b": f32(8, 12)}, bytes(12))
    tddist.convert(ok, tmp_path / "ok.pt")
    assert {k: v.shape for k, v in torch.load(tmp_path / "ok.pt", weights_only=True).items()} == {
        "a": (2,), "e": (0,), "b": (1,),
    }  # fmt: skip


def test_a_save_pretrained_directory_converts(tmp_path):
    """What Hugging Face's save_pretrained writes for a small model: model.safetensors beside config.json."""
    from safetensors.torch import save_file

    model = tmp_path / "model"
    model.mkdir()
    weights = {"tok.weight": torch.randn(5, 3), "out.bias": torch.zeros(3)}
    save_file(weights, str(model / "model.safetensors"), metadata={"format": "pt"})
    (model / "config.json").write_text(json.dumps({"model_type": "toy"}))
    assert tddist.interop.convert.detect_format(model) == "safetensors"
    tddist.convert(model, tmp_path / "w.pt")
    _equal_tensors(torch.load(tmp_path / "w.pt", weights_only=True), weights, "save_pretrained -> torch")
    # replacing it would delete config.json: refused even with overwrite
    with pytest.raises(tddist.TargetError, match="config.json"):
        tddist.convert(tmp_path / "w.pt", model, "safetensors", overwrite=True)
    assert (model / "config.json").exists() and load_file(model / "model.safetensors").keys() == weights.keys()


def _toy_run() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """A model with an embedding and a head, after one AdamW step."""
    torch.manual_seed(0)
    model = torch.nn.ModuleDict({"tok": torch.nn.Embedding(10, 4), "out": torch.nn.Linear(4, 3)})
    optim = torch.optim.AdamW(model.parameters(), lr=0.01, betas=(0.8, 0.95))
    model["out"](model["tok"](torch.arange(5))).square().sum().backward()
    optim.step()
    return model, optim


def test_nested_keeps_the_nesting_of_torch_save_files(tmp_path):
    from safetensors.torch import save_file

    model, optim = _toy_run()
    torch.save({"model": model.state_dict(), "optimizer": optim.state_dict(), "epoch": 3}, tmp_path / "run.pt")
    tddist.convert(tmp_path / "run.pt", tmp_path / "flat")
    assert ("model.tok.weight",) in tddist.read_manifest(tmp_path / "flat").leaves  # one flat name per leaf
    tddist.convert(tmp_path / "run.pt", tmp_path / "nested", nested=True)
    m = tddist.read_manifest(tmp_path / "nested")
    assert set(m.leaves) == {
        ("model", "tok.weight"), ("model", "out.weight"), ("model", "out.bias"),
        *(("optimizer", "state", str(i), name) for i in range(3) for name in ("step", "exp_avg", "exp_avg_sq")),
    }  # fmt: skip
    assert set(m.objects) == {("optimizer", "param_groups"), ("epoch",)}
    td = tddist.load(tmp_path / "nested", shard=None)
    assert torch.equal(td["model", "tok.weight"], model.state_dict()["tok.weight"]) and td["epoch"] == 3
    assert td["optimizer", "param_groups"][0]["betas"] == [0.8, 0.95]
    assert torch.equal(td["optimizer", "state", "1", "exp_avg"], optim.state_dict()["state"][1]["exp_avg"])
    # names that collide once joined with "." are refused flat, and kept apart nested
    torch.save({"a": {"b": torch.ones(1)}, "a.b": torch.zeros(1)}, tmp_path / "clash.pt")
    with pytest.raises(tddist.InvalidDataError, match="both named 'a.b'.*nested=True"):
        tddist.convert(tmp_path / "clash.pt", tmp_path / "clash")
    tddist.convert(tmp_path / "clash.pt", tmp_path / "clash", nested=True)
    assert set(tddist.read_manifest(tmp_path / "clash").leaves) == {("a", "b"), ("a.b",)}
    save_file({"w": torch.ones(1)}, str(tmp_path / "one.safetensors"))
    with pytest.raises(tddist.InvalidArgumentError, match="flat names only"):
        tddist.convert(tmp_path / "one.safetensors", tmp_path / "x", nested=True)


def test_a_dcp_run_resumes_in_the_checkpoint_manager_after_a_nested_conversion(tmp_path):
    """DCP keys ("app.model.tok.weight") become nested keys, so CheckpointManager.restore takes the result as is."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model, optim = _toy_run()
    m, o = get_state_dict(model, optim)
    dcp.save({"app": {"model": m, "optim": o}, "step": 7}, checkpoint_id=str(tmp_path / "dcp"), no_dist=True)
    tddist.convert(tmp_path / "dcp", tmp_path / "root" / "step-000000007", nested=True, prefix="app/")
    fresh, fresh_optim = _fresh()
    with tddist.CheckpointManager(tmp_path / "root") as mgr:
        restored = mgr.restore((fresh, fresh_optim), required=True)
    assert restored == 7 and not restored.report.skipped
    for k, v in model.state_dict().items():
        assert torch.equal(fresh.state_dict()[k], v), k
    want, got = optim.state_dict(), fresh_optim.state_dict()
    assert got["param_groups"] == want["param_groups"]  # betas a tuple again, lr 0.01
    for i, entries in want["state"].items():
        assert all(torch.equal(got["state"][i][n], t) for n, t in entries.items()), i
    # without nested, the flat names do not fit the model's state
    tddist.convert(tmp_path / "dcp", tmp_path / "flat-root" / "step-000000007", prefix="app.")
    with tddist.CheckpointManager(tmp_path / "flat-root") as mgr, pytest.raises(tddist.IncompatibleCheckpointError):
        mgr.restore(_fresh())


def _fresh() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """The toy model and optimizer before training, with other weights."""
    torch.manual_seed(1)
    model = torch.nn.ModuleDict({"tok": torch.nn.Embedding(10, 4), "out": torch.nn.Linear(4, 3)})
    return model, torch.optim.AdamW(model.parameters(), lr=0.5)


def test_a_mistyped_destination_suffix_is_refused(tmp_path):
    tddist.save({"w": torch.ones(2)}, tmp_path / "ck")
    for name, hint in (
        ("x.safetensor", r"did you mean \.safetensors\?"),
        ("x.dcp", r"to='dcp' writes that format"),
        ("x.bin", r"names no format;"),
    ):
        with pytest.raises(tddist.InvalidArgumentError, match=rf"{hint}.*to=.*tddist, tdz, dcp, torch, safetensors"):
            tddist.convert(tmp_path / "ck", tmp_path / name)
        assert not (tmp_path / name).exists()
    tddist.convert(tmp_path / "ck", tmp_path / "x.bin", to="tddist")  # the format named: a tddist directory
    assert tddist.load(tmp_path / "x.bin", shard=None)["w"].tolist() == [1.0, 1.0]


@pytest.mark.parametrize(
    "name,to",
    [("a.safetensors", None), ("hf", "safetensors"), ("a.pt", None), ("d", "dcp"), ("t", None), ("a.tdz", None)],
)
def test_progress_counts_bytes_leaf_by_leaf_for_every_destination(tmp_path, name, to):
    """``progress(done, total)`` after each leaf, in bytes, up to the total, whatever the destination; the library
    prints nothing."""
    cols = [2048, 6144, 8]  # float32 leaves of 2 ranks x 64 rows: 1 MiB, 3 MiB, 4 KiB

    def shard(rank: int) -> TensorDict:
        return TensorDict({f"l{i}": torch.full((64, n), float(rank)) for i, n in enumerate(cols)}, batch_size=[64])

    results = tddist.run_threads(2, lambda c: tddist.save(shard(c.rank), tmp_path / "src", comm=c), timeout=60)
    assert not [r for r in results if isinstance(r, BaseException)], results
    sizes = [2 * 64 * n * 4 for n in cols]
    calls: list[tuple[int, int]] = []
    tddist.convert(tmp_path / "src", tmp_path / name, to, consolidate=True, progress=lambda d, t: calls.append((d, t)))
    total = sum(sizes)
    assert [t for _d, t in calls] == [total] * len(sizes), calls
    assert sorted(d for d, _t in calls) == [d for d, _t in calls] and calls[-1][0] == total, calls
