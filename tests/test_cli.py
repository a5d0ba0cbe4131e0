"""The ``tddist`` command, run as a real subprocess on real checkpoints.

Checkpoints are saved with ``tddist.save`` (in-process, or on thread ranks
with ``tddist.run_threads``); leftovers of interrupted saves come from real
saves killed with SIGKILL in a child process (``TDDIST_FAULT``). Each test
runs the installed command (or ``python -m tddist.cli``) and checks its
output, its ``--json`` document, its exit status and what it did on disk.
"""

from __future__ import annotations

import argparse
import fcntl
import json
import os
import pty
import re
import shutil
import struct
import subprocess
import sys
import termios
import textwrap
from dataclasses import FrozenInstanceError
from pathlib import Path

import pytest
import torch
from tensordict import TensorDict

import tddist
from tddist import format as fmt
from tddist.jobs import inventory
from tddist.jobs.retention import clean_root, delete_checkpoint, retired, step_name
from tddist.manifest.locate import Locator
from tddist.tools.verify import verify

REPO = Path(__file__).resolve().parent.parent
_SCRIPT = Path(sys.executable).with_name("tddist")
CMD = [str(_SCRIPT)] if _SCRIPT.exists() else [sys.executable, "-m", "tddist.cli"]


def cli(*args, cwd=None, check_rc=None) -> subprocess.CompletedProcess:
    r = subprocess.run([*CMD, *map(str, args)], capture_output=True, text=True, timeout=180, cwd=cwd)
    if check_rc is not None:
        assert r.returncode == check_rc, f"exit {r.returncode}\nstdout:\n{r.stdout}\nstderr:\n{r.stderr}"
    return r


def cli_json(*args, rc=0) -> dict:
    r = cli(*args, "--json", check_rc=rc)
    doc = json.loads(r.stdout)
    return doc


def save_step(root: Path, step: int, scale: float = 1.0, **kwargs) -> Path:
    path = root / step_name(step, archive=bool(kwargs.get("archive")))
    td = TensorDict(
        batch=TensorDict(obs=torch.arange(24.0).view(8, 3) * scale, batch_size=[8]),
        model={"w": torch.eye(3) * scale},
        batch_size=[],
    )
    td.set_non_tensor("note", "a long note " * 20)
    tddist.save(td, path, metadata={"step": step}, **kwargs)
    return path


def killed_save(target: Path | str, point: str = "validate", atomic: bool = True) -> None:
    """A real save of ``target`` in a child process, killed with SIGKILL at commit step ``point``."""
    code = textwrap.dedent(
        f"""
        import torch, tddist
        tddist.save({{"x": torch.ones(1000, 64)}}, {str(target)!r}, atomic={atomic})
        """
    )
    env = dict(os.environ, TDDIST_FAULT=f"{point}:0:kill")
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, timeout=120)
    assert r.returncode == -9, r.stderr.decode()[-2000:]


def three_ranks(path: Path, **kwargs) -> None:
    def rank_fn(c):
        td = TensorDict(x=torch.arange(12.0).view(4, 3) + c.rank, y=torch.arange(4) * c.rank, batch_size=[4])
        td.set_non_tensor("who", f"rank{c.rank}")
        td.set_non_tensor("lr", 0.5)
        return tddist.save(td, path, comm=c, **kwargs)

    results = tddist.run_threads(3, rank_fn, timeout=60)
    assert not any(isinstance(r, BaseException) for r in results), results


def flip_byte(path: Path, offset: int = 0) -> None:
    raw = bytearray(path.read_bytes())
    raw[offset] ^= 0xFF
    path.write_bytes(bytes(raw))


def chunk_span(ckpt: Path, key: tuple[str, ...], rank: int):
    """Where the bytes of ``rank``'s chunk of leaf ``key`` are (``locate.Location``), for either packing."""
    m = tddist.read_manifest(ckpt)
    leaf = m.leaves[key]
    return Locator(m).locate(leaf, leaf.chunk_of_rank(rank))


def flip_chunk_byte(ckpt: Path, key: tuple[str, ...], rank: int, at: int = 0) -> None:
    """Flip one byte of a stored chunk, wherever its packing put it."""
    loc = chunk_span(ckpt, key, rank)
    assert at < loc.nbytes
    flip_byte(ckpt / loc.relpath, loc.offset + at)


# --- startup: the light commands never import torch ---------------------------------------


@pytest.mark.parametrize(
    "args",
    [
        ["ls", "{root}"],
        ["latest", "{root}"],
        ["info", "{ckpt}"],
        ["info", "{ckpt}", "--leaves"],
        ["info", "{memmap}", "--leaves", "--json"],
        ["info", "{archive}"],
        ["--version"],
        ["--help"],
        ["ls", "--help"],
    ],
    ids=lambda a: " ".join(a).replace("{", "").replace("}", ""),
)
def test_light_commands_do_not_import_torch(tmp_path, args):
    ckpt = save_step(tmp_path, 5)  # the default packing: one data file per rank
    memmap = save_step(tmp_path, 6, layout="memmap")
    archive = save_step(tmp_path, 7, archive=True)
    argv = [a.format(root=tmp_path, ckpt=ckpt, memmap=memmap, archive=archive) for a in args]
    r = subprocess.run(
        [sys.executable, "-X", "importtime", "-m", "tddist.cli", *argv], capture_output=True, text=True, timeout=120
    )
    assert r.returncode == 0, r.stderr[-3000:]
    imported = {line.rsplit("|", 1)[-1].strip() for line in r.stderr.splitlines() if line.startswith("import time:")}
    heavy = sorted(m for m in imported if m.split(".")[0] == "torch")  # numpy is fine: the manifest index is numpy
    assert not heavy, f"tddist {' '.join(argv)} imported {heavy[:10]}"
    assert "tddist.cli" in imported


#: All that ``tddist --version`` and ``tddist --help`` may import of tddist: no command's module, so neither
#: numpy nor the manifest code (benchmarks/cli_startup.py measures the startup).
STARTUP_MODULES = {"tddist", "tddist._version", "tddist.errors", "tddist.cli", "tddist.cli.__main__"}


@pytest.mark.parametrize("args, rc", [(["--version"], 0), (["--help"], 0), (["frobnicate"], 2)])
def test_version_and_help_import_no_command_module(args, rc):
    r = subprocess.run(
        [sys.executable, "-X", "importtime", "-m", "tddist.cli", *args], capture_output=True, text=True, timeout=120
    )
    assert r.returncode == rc, r.stderr[-3000:]
    imported = {line.rsplit("|", 1)[-1].strip() for line in r.stderr.splitlines() if line.startswith("import time:")}
    ours = {m for m in imported if m.split(".")[0] == "tddist"}
    assert ours - STARTUP_MODULES == set(), f"tddist {' '.join(args)} imported {sorted(ours - STARTUP_MODULES)}"
    heavy = sorted(m for m in imported if m.split(".")[0] in ("numpy", "torch", "xxhash", "tensordict"))
    assert not heavy, f"tddist {' '.join(args)} imported {heavy[:10]}"


def test_the_command_list_needs_no_command_module():
    """``tddist --help`` built without the commands' modules is the same as with all of them: the one-line help
    of ``COMMANDS`` is what each module registers, in the same order."""
    from tddist.cli import COMMANDS, parser

    full, light = parser(), parser(commands=())
    assert light.format_help() == full.format_help()
    sub = next(a for a in full._actions if isinstance(a, argparse._SubParsersAction))
    assert list(sub.choices) == list(COMMANDS)
    assert {c.dest: c.help for c in sub._choices_actions} == {name: h for name, (_m, h) in COMMANDS.items()}


# --- ls, latest, gc on a manager root with killed saves ----------------------------------------


def test_ls_flags_killed_saves_and_gc_removes_them(tmp_path):
    root = tmp_path / "run"
    for step in (100, 200, 300):
        save_step(root, step)
    for _ in range(4):  # four killed saves of the same step: four hidden staging directories
        killed_save(root / step_name(400))
    killed_save(root / step_name(500), atomic=False)  # a partial save in place

    doc = cli_json("ls", root)
    assert doc["schema"] == "tddist.ls/1" and doc["root"] == str(root)
    kinds = [(e["kind"], e["step"]) for e in doc["entries"]]
    assert kinds == [("checkpoint", 100), ("checkpoint", 200), ("checkpoint", 300)] + [("staging", 400)] * 4 + [
        ("partial", 500)
    ]
    for e in doc["entries"]:
        assert e["bytes"] > 0 and e["age_seconds"] >= 0
        if e["committed"]:
            assert e["world_size"] == 1 and e["layout"] == "directory" and e["fix"] is None
        else:
            assert e["fix"] == f"tddist gc {root}" and e["problem"]
    staging = [e for e in doc["entries"] if e["kind"] == "staging"]
    assert all(e["target"] == str(root / step_name(400)) and e["bytes"] >= 256_000 for e in staging)

    text = cli("ls", root, check_rc=0).stdout
    assert "3 committed checkpoint(s)" in text and "leftover (staging)" in text and "partial" in text
    assert f"when no save is running: tddist gc {root}" in text

    assert cli("latest", root, check_rc=0).stdout == f"{root / step_name(300)}\n"

    before = sorted(os.listdir(root))
    plan = cli_json("gc", root, "--keep-last", "2", "--dry-run")
    assert sorted(os.listdir(root)) == before, "--dry-run changed something"
    planned = {(a["action"], os.path.basename(a["path"])) for a in plan["actions"]}
    assert planned == {("remove", e["name"]) for e in doc["entries"] if not e["committed"]} | {
        ("delete", step_name(100))
    }
    assert plan["dry_run"] and plan["freed_bytes"] == sum(a["bytes"] for a in plan["actions"])

    done = cli_json("gc", root, "--keep-last", "2")
    assert {(a["action"], a["path"]) for a in done["actions"]} == {(a["action"], a["path"]) for a in plan["actions"]}
    assert sorted(os.listdir(root)) == [step_name(200), step_name(300)]
    assert cli("gc", root, check_rc=0).stdout.strip() == f"{root}: nothing to do"


def _messy_root(root: Path) -> None:
    """Every state the manager's clean-up and retention distinguish."""
    for step in (1, 2, 3, 4):
        save_step(root, step)
    save_step(root, 6, archive=True)
    killed_save(root / step_name(7))  # staging leftover of an uncommitted step
    killed_save(root / step_name(2))  # staging leftover beside a committed one
    killed_save(root / step_name(8), atomic=False)  # torn step directory
    # a replace without RENAME_EXCHANGE cut between its renames: the committed checkpoint sits at a backup name
    os.rename(root / step_name(3), root / f".{step_name(3)}.tddist-backup-{'1' * 32}")
    # an interrupted retention deletion
    shutil.copytree(root / step_name(1), root / f".{step_name(5)}.tddist-trash-{'2' * 32}")
    # foreign files under a step name, a damaged newest checkpoint, and unrelated entries
    (root / step_name(9)).mkdir()
    (root / step_name(9) / "notes.txt").write_text("mine")
    save_step(root, 10)
    (root / step_name(10) / fmt.MANIFEST_NAME).write_text("{not json")
    (root / "README").write_text("unrelated")


def test_gc_applies_the_managers_rules(tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    _messy_root(a)
    shutil.copytree(a, b, symlinks=True)
    # b: what CheckpointManager does (clean-up at start, retention after a save)
    clean_root(str(b))
    newest = inventory.newest(b)
    for _step, p in retired(str(b), 4, newest.step):
        delete_checkpoint(p)
    # a: the command, offline
    doc = cli_json("gc", a, "--keep-last", "4")
    assert sorted(os.listdir(a)) == sorted(os.listdir(b))
    assert (a / step_name(3) / fmt.MANIFEST_NAME).is_file(), "the backup was not moved back"
    assert (a / step_name(9) / "notes.txt").read_text() == "mine"
    actions = {(x["action"], os.path.basename(x["path"])) for x in doc["actions"]}
    assert ("restore", f".{step_name(3)}.tddist-backup-{'1' * 32}") in actions
    assert ("keep", step_name(9)) in actions and ("remove", step_name(8)) in actions
    # the damaged step 10 is counted as committed but never chosen; the newest valid one (6) is kept
    assert cli("latest", a, check_rc=0).stdout.strip() == str(a / step_name(6, archive=True))


def test_latest_and_ls_edge_cases(tmp_path):
    r = cli("latest", tmp_path, check_rc=1)
    assert r.stdout == "" and "no committed checkpoint" in r.stderr
    assert cli_json("latest", tmp_path, rc=1)["path"] is None
    r = cli("latest", tmp_path / "missing", check_rc=1)
    assert "does not exist" in r.stderr
    assert cli("ls", tmp_path, check_rc=0).stdout.strip() == f"{tmp_path}: no checkpoints"
    # a directory without step names: the one committed last
    first = save_step(tmp_path, 1).rename(tmp_path / "first")
    os.utime(first, (1, 1))
    second = save_step(tmp_path, 2).rename(tmp_path / "second")
    doc = cli_json("latest", tmp_path)
    assert doc["path"] == str(second) and doc["world_size"] == 1
    # a shell script takes the path from stdout
    out = subprocess.run(
        ["bash", "-c", f'ckpt=$({" ".join(CMD)} latest {tmp_path}) && {" ".join(CMD)} info "$ckpt" --json'],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0 and json.loads(out.stdout)["metadata"] == {"step": 2}
    # ls of one checkpoint lists it, with the leftovers beside it
    killed_save(second)
    doc = cli_json("ls", second)
    assert [e["kind"] for e in doc["entries"]] == ["checkpoint", "staging"]
    assert doc["entries"][1]["fix"] == f"tddist recover {second}"


# --- ls, latest, gc on object storage (the real S3 server of tests/conftest.py) -----------------------


def test_ls_latest_gc_on_an_s3_root(s3, tmp_path, monkeypatch):
    """The three commands on s3://bucket/prefix, with what killed saves left there: the same JSON schemas,
    leftovers inside each checkpoint's entry, and gc doing what --dry-run said."""
    client, where = s3
    bucket, prefix = where.split("/", 1)
    monkeypatch.chdir(tmp_path)
    root = f"s3://{where}/run"
    td = TensorDict(obs=torch.arange(24.0).view(8, 3), batch_size=[8])
    for step in (100, 200, 300):
        tddist.save(td, f"{root}/{step_name(step)}", metadata={"step": step})
    tddist.save(td, f"{root}/{step_name(250, archive=True)}", metadata={"step": 250})
    killed_save(f"{root}/{step_name(400)}")  # never committed: a prefix of one generation
    killed_save(f"{root}/{step_name(300)}")  # a replace killed: a generation beside the committed one
    upload = client.create_multipart_upload(Bucket=bucket, Key=f"{prefix}/run/{step_name(500, archive=True)}")

    doc = cli_json("ls", root)
    assert doc["schema"] == "tddist.ls/1" and doc["root"] == root
    kinds = [(e["kind"], e["step"], e["layout"]) for e in doc["entries"]]
    assert kinds == [
        ("checkpoint", 100, "directory"), ("checkpoint", 200, "directory"), ("checkpoint", 250, "archive"),
        ("checkpoint", 300, "directory"), ("staging", 300, "directory"), ("partial", 400, "directory"),
        ("staging", 500, "archive"),
    ], kinds  # fmt: skip
    for e in doc["entries"]:
        assert e["path"].startswith(root + "/") and e["bytes"] >= 0 and e["age_seconds"] >= 0
        if e["committed"]:
            assert e["world_size"] == 1 and e["fix"] is None and e["bytes"] > 0 and e["created"]
        else:
            assert e["fix"] == f"tddist gc {root}" and e["problem"]
    stray = doc["entries"][4]
    assert stray["target"] == f"{root}/{step_name(300)}" and "/tddist-gen-" in stray["path"]
    assert stray["bytes"] >= 4000 and stray["name"].startswith("tddist-gen-")
    assert doc["entries"][6]["path"].endswith(f"?uploadId={upload['UploadId']}")
    text = cli("ls", root, check_rc=0).stdout
    assert "4 committed checkpoint(s)" in text and "leftover (staging)" in text and f"tddist gc {root}" in text
    alone = cli_json("ls", f"{root}/{step_name(300)}")  # one checkpoint, with what is left inside it
    assert [e["kind"] for e in alone["entries"]] == ["checkpoint", "staging"]

    assert cli("latest", root, check_rc=0).stdout == f"{root}/{step_name(300)}\n"
    latest = cli_json("latest", root)
    assert (latest["path"], latest["step"], latest["world_size"]) == (f"{root}/{step_name(300)}", 300, 1)

    before = sorted(client.list_objects_v2(Bucket=bucket, Prefix=prefix).get("Contents", []), key=str)
    plan = cli_json("gc", root, "--keep-last", "2", "--dry-run")
    assert sorted(client.list_objects_v2(Bucket=bucket, Prefix=prefix).get("Contents", []), key=str) == before
    planned = {(a["action"], a["path"].removeprefix(root + "/").split("/")[0].split("?")[0]) for a in plan["actions"]}
    assert planned == {
        ("remove", step_name(300)), ("remove", step_name(400)), ("remove", step_name(500, archive=True)),
        ("delete", step_name(100)), ("delete", step_name(200)),
    }, planned  # fmt: skip
    assert plan["freed_bytes"] == sum(a["bytes"] for a in plan["actions"]) > 0
    done = cli_json("gc", root, "--keep-last", "2")
    assert {(a["action"], a["path"]) for a in done["actions"]} == {(a["action"], a["path"]) for a in plan["actions"]}
    after = cli_json("ls", root)
    assert [(e["kind"], e["step"]) for e in after["entries"]] == [("checkpoint", 250), ("checkpoint", 300)]
    assert client.list_multipart_uploads(Bucket=bucket, Prefix=prefix + "/").get("Uploads", []) == []
    assert tddist.load(f"{root}/{step_name(300)}", shard=None, verify=True)["obs"].equal(td["obs"])
    assert cli("gc", root, check_rc=0).stdout.strip() == f"{root}: nothing to do"
    for argv in (["ls", root], ["latest", root], ["gc", root, "--dry-run"]):  # light on S3 too
        r = subprocess.run([sys.executable, "-X", "importtime", "-m", "tddist.cli", *argv], capture_output=True,
                           text=True, timeout=120)  # fmt: skip
        assert r.returncode == 0, r.stderr[-3000:]
        imported = {line.rsplit("|", 1)[-1].strip() for line in r.stderr.splitlines() if "import time:" in line}
        assert not [m for m in imported if m.split(".")[0] == "torch"], f"tddist {argv[0]} on S3 imported torch"

    empty = f"s3://{where}/nothing-here"
    assert cli("ls", empty, check_rc=0).stdout.strip() == f"{empty}: no checkpoints"
    assert cli_json("latest", empty, rc=1)["path"] is None
    r = cli("latest", "s3://no-such-bucket-tddist/run", check_rc=1)
    assert r.stdout == "" and "does not exist" in r.stderr
    assert not list(tmp_path.rglob("s3:*")), "a local directory named like the S3 root appeared"


# --- info ----------------------------------------------------------------------------------------


def test_info_summary_values_and_leaves(tmp_path):
    ckpt = tmp_path / "ck"
    three_ranks(ckpt, metadata={"step": 7, "run": "demo"})
    text = cli("info", ckpt, check_rc=0).stdout
    assert text.startswith(f"{ckpt}: tddist checkpoint, directory, format version 4 (packed: one data file per rank)")
    assert "world size 3 (ranks that saved it)" in text and "2 tensor(s) (2 sharded)" in text
    assert '"step": 7' in text
    assert 'who = per rank: rank 0: "rank0", rank 1: "rank1", rank 2: "rank2"' in text
    assert "lr = 0.5" in text
    assert "boxes" not in text
    leaves = cli("info", ckpt, "--leaves", check_rc=0).stdout
    assert re.search(r"^x\s+float32\s+\[12, 3\]\s+sharded on dim 0\s+3\s+144 B$", leaves, re.M), leaves
    assert re.search(r"^who\s+per-rank\s+per rank:", leaves, re.M), leaves

    doc = cli_json("info", ckpt)
    assert doc["schema"] == "tddist.info/1" and doc["world_size"] == 3 and doc["layout"] == "directory"
    assert doc["format_version"] == 4 and doc["packing"] == "packed"
    assert doc["bytes"] == 12 * 3 * 4 + 12 * 8
    x = next(leaf for leaf in doc["leaves"] if leaf["key"] == ["x"])
    assert x == {
        "key": ["x"],
        "dtype": "float32",
        "shape": [12, 3],
        "placement": {"type": "shard", "dim": 0},
        "chunks": 3,
        "bytes": 144,
    }
    objs = {tuple(o["key"]): o for o in doc["objects"]}
    assert objs[("who",)]["values"] == ["rank0", "rank1", "rank2"] and objs[("lr",)]["values"] == [0.5]
    assert doc["leftovers"] == []


def test_info_ls_and_diff_on_every_packing(tmp_path):
    root = tmp_path / "run"
    packed = save_step(root, 1)
    memmap = save_step(root, 2, layout="memmap")
    archive = save_step(root, 3, archive=True)
    v1 = root / step_name(4)
    shutil.copytree(REPO / "tests" / "golden" / "v1" / "three_ranks", v1)
    shown = {
        packed: "directory, format version 4 (packed: one data file per rank)",
        memmap: "directory, format version 4 (memmap: one file per leaf)",
        archive: "archive, format version 4 (memmap: one file per leaf, as archive entries)",
        v1: "directory, format version 1 (memmap: one file per leaf)",
    }
    for path, first in shown.items():
        assert cli("info", path, check_rc=0).stdout.startswith(f"{path}: tddist checkpoint, {first}\n")
    docs = {path: cli_json("info", path) for path in shown}
    assert [(d["format_version"], d["layout"], d["packing"]) for d in docs.values()] == [
        (4, "directory", "packed"),
        (4, "directory", "memmap"),
        (4, "archive", "memmap"),
        (1, "directory", "memmap"),
    ]
    assert docs[packed]["leaves"] == docs[memmap]["leaves"] == docs[archive]["leaves"]
    assert sum(leaf["chunks"] for leaf in docs[v1]["leaves"]) == verify(v1).chunks

    # ls: the space each takes on disk (allocated blocks), whatever its files
    entries = {e["name"]: e for e in cli_json("ls", root)["entries"]}
    assert [e["kind"] for e in entries.values()] == ["checkpoint"] * 4
    for path in shown:
        files = [path] if path.is_file() else [Path(d, n) for d, _s, names in os.walk(path) for n in names]
        apparent = sum(os.path.getsize(f) for f in files)
        assert entries[path.name]["bytes"] >= apparent, (path, entries[path.name]["bytes"], apparent)
    data = packed / fmt.rank_data_name(0)
    assert entries[packed.name]["bytes"] >= os.stat(data).st_blocks * 512 > 0
    assert entries[packed.name]["world_size"] == 1 and entries[v1.name]["world_size"] == 3

    # diff: the same data stored by either packing has the same chunks, so checksums tell (no data read)
    for other, step in ((memmap, 2), (archive, 3)):
        doc = cli_json("diff", packed, other, "--checksums-only", rc=1)  # only the metadata's step differs
        assert doc["changed"] == [] and doc["not_compared"] == [] and doc["same"] == 3
        assert doc["metadata"] == [{"key": "step", "a": "1", "b": str(step)}]


def test_info_truncates_values_and_names_leftovers(tmp_path):
    ckpt = save_step(tmp_path, 3)
    killed_save(ckpt)
    text = cli("info", ckpt, check_rc=0).stdout
    note = next(line for line in text.splitlines() if line.strip().startswith("note = "))
    assert note.endswith("...") and len(note) < 90, note
    assert "1 leftover(s) of interrupted saves beside it" in text and f"tddist recover {ckpt}" in text
    doc = cli_json("info", ckpt)
    assert doc["leftovers"][0]["kind"] == "staging" and doc["leftovers"][0]["bytes"] > 0
    assert [o["values"] for o in doc["objects"]] == [["a long note " * 20]]


def test_info_on_a_root_points_to_ls(tmp_path):
    for step in (1, 2):
        save_step(tmp_path, step)
    r = cli("info", tmp_path, check_rc=1)
    assert "is not a checkpoint but a directory of 2 checkpoint(s)" in r.stderr
    assert f"tddist ls {tmp_path}" in r.stderr and str(tmp_path / step_name(2)) in r.stderr
    doc = json.loads(cli("info", tmp_path, "--json", check_rc=1).stdout)
    assert doc["schema"] == "tddist.error/1" and doc["error"] == "CheckpointNotFoundError"


# --- verify --------------------------------------------------------------------------------------


def test_verify_lists_every_bad_chunk_of_a_packed_checkpoint(tmp_path):
    ckpt = tmp_path / "ck"
    three_ranks(ckpt)  # the default packing: rank-NNNNN.data, every chunk of a rank at an aligned offset
    assert tddist.read_manifest(ckpt).packing == "packed"
    assert sorted(os.listdir(ckpt)) == sorted([fmt.INDEX_NAME, fmt.MANIFEST_NAME, *map(fmt.rank_data_name, range(3))])
    assert cli("verify", ckpt, check_rc=0).stdout.startswith(f"{ckpt}: OK (sizes and checksums of 6 chunk(s)")
    assert cli("verify", ckpt, "--quick", check_rc=0).stdout.startswith(f"{ckpt}: OK (sizes and structure of 6")
    x0, y0 = chunk_span(ckpt, ("x",), 0), chunk_span(ckpt, ("y",), 0)
    assert x0.relpath == y0.relpath == fmt.rank_data_name(0) and x0.offset == 0 and y0.offset == 64
    flip_chunk_byte(ckpt, ("x",), 0, 5)  # flipped bits in two leaves' spans of one data file:
    flip_chunk_byte(ckpt, ("y",), 0, y0.nbytes - 1)  # only the checksums see them
    (ckpt / fmt.rank_data_name(1)).unlink()  # a missing data file
    with open(ckpt / fmt.rank_data_name(2), "r+b") as f:  # a truncated one
        f.truncate(70)

    report = verify(ckpt)
    assert [(p.kind, p.key, p.rank, p.file, p.offset) for p in report.problems] == [
        ("missing", None, 1, fmt.rank_data_name(1), None),
        ("size", None, 2, fmt.rank_data_name(2), None),
        ("checksum", ("x",), 0, fmt.rank_data_name(0), 0),
        ("checksum", ("y",), 0, fmt.rank_data_name(0), 64),
    ]
    assert not report.ok and report.chunks == 6 and report.mode == "full" and report.packing == "packed"
    assert "has 70 bytes, its chunks need exactly 128" in report.problems[1].message
    assert "it holds 2 chunk(s) (leaves ['x'], ['y'])" in report.problems[0].message
    assert f"'{fmt.rank_data_name(0)}', offset 64, 32 bytes" in report.problems[3].message
    quick = verify(ckpt, quick=True)
    assert [(p.kind, p.rank) for p in quick.problems] == [("missing", 1), ("size", 2)]

    r = cli("verify", ckpt, check_rc=1)
    assert "4 problem(s) in 6 chunk(s)" in r.stdout
    assert f"missing: {fmt.rank_data_name(1)} (rank 1): data file" in r.stdout
    assert f"size: {fmt.rank_data_name(2)} (rank 2): data file" in r.stdout
    assert "checksum: x (rank 0): " in r.stdout and "checksum: y (rank 0): " in r.stdout
    assert "1 problem(s) found" not in r.stderr and "4 problem(s) found; the first: data file" in r.stderr
    doc = json.loads(cli("verify", ckpt, "--json", check_rc=1).stdout)
    assert doc["packing"] == "packed" and doc["mode"] == "full" and not doc["ok"]
    assert [(p["kind"], p["key"], p["rank"], p["file"], p["offset"]) for p in doc["problems"]] == [
        ("missing", None, 1, fmt.rank_data_name(1), None),
        ("size", None, 2, fmt.rank_data_name(2), None),
        ("checksum", ["x"], 0, fmt.rank_data_name(0), 0),
        ("checksum", ["y"], 0, fmt.rank_data_name(0), 64),
    ]

    # a data file replaced by a symbolic link (to a file of the right size) is refused
    target = tmp_path / "elsewhere.data"
    shutil.copyfile(ckpt / fmt.rank_data_name(0), target)
    (ckpt / fmt.rank_data_name(0)).unlink()
    (ckpt / fmt.rank_data_name(0)).symlink_to(target)
    assert [(p.kind, p.rank) for p in verify(ckpt, quick=True).problems][0] == ("not-a-file", 0)


def test_data_file_sizes_are_the_locators():
    """verify --quick computes every rank's data-file size at once; Locator gives it one rank at a time."""
    import numpy as np

    from tddist.manifest.chunks import BoxChunks, ReplicaChunks, ShardChunks
    from tddist.manifest.model import Leaf, Manifest
    from tddist.tools.verify import data_file_sizes

    def same(m: Manifest) -> None:
        loc = Locator(m)
        assert data_file_sizes(m).tolist() == [loc.packed(r)[1] for r in range(m.world_size)]

    for path in sorted((REPO / "tests" / "golden").glob("v*/*")):
        if path.is_file() or (path / "tddist.json").exists():  # not the objects of v4/s3_incremental
            same(tddist.read_manifest(path))
    u8 = np.zeros(4, dtype=np.uint64)
    leaves = [
        Leaf(("s",), "float32", (9, 5), tddist.Shard(0), ShardChunks((9, 5), 0, 4, np.array([4, 0, 2, 3]), u8)),
        Leaf(("c",), "int16", (3, 7), tddist.Shard(1), ShardChunks((3, 7), 1, 2, np.array([1, 1, 5, 0]), u8)),
        Leaf(("r",), "float64", (3,), tddist.Replicate(), ReplicaChunks((3,), 8, 1, 0)),
        Leaf(
            ("d",),
            "bfloat16",
            (4, 40),
            tddist.Replicate(),  # the placement is not used here: the table's columns are
            BoxChunks(2, np.array([3, 0]), np.array([[0, 0], [2, 0]]), np.array([[2, 40], [2, 40]]), u8[:2]),
        ),
    ]
    same(Manifest(world_size=4, nodes={(): ()}, leaves={leaf.key: leaf for leaf in leaves}, packing="packed"))


def test_verify_lists_every_bad_chunk_of_a_memmap_checkpoint(tmp_path):
    ckpt = tmp_path / "ck"
    three_ranks(ckpt, layout="memmap")  # one file per leaf and rank, in rank directories
    assert tddist.read_manifest(ckpt).packing == "memmap"
    assert cli("verify", ckpt, check_rc=0).stdout.startswith(f"{ckpt}: OK (sizes and checksums of 6 chunk(s)")
    assert chunk_span(ckpt, ("x",), 0).relpath == os.path.join(fmt.rank_dir(0), "x.memmap")
    flip_chunk_byte(ckpt, ("x",), 0, 5)  # a flipped bit: only the checksum sees it
    (ckpt / fmt.rank_dir(1) / "y.memmap").unlink()  # a missing file
    with open(ckpt / fmt.rank_dir(2) / "x.memmap", "r+b") as f:  # a truncated file
        f.truncate(10)

    report = verify(ckpt)
    assert [(p.kind, p.key, p.rank, p.offset) for p in report.problems] == [
        ("checksum", ("x",), 0, None),
        ("size", ("x",), 2, None),
        ("missing", ("y",), 1, None),
    ]
    assert not report.ok and report.chunks == 6 and report.mode == "full" and report.packing == "memmap"
    with pytest.raises(FrozenInstanceError):
        report.ok = True  # type: ignore[misc]
    quick = verify(ckpt, quick=True)
    assert [p.kind for p in quick.problems] == ["size", "missing"]

    r = cli("verify", ckpt, check_rc=1)
    assert "3 problem(s) in 6 chunk(s)" in r.stdout
    assert "checksum: x (rank 0)" in r.stdout and "size: x (rank 2)" in r.stdout and "missing: y (rank 1)" in r.stdout
    doc = json.loads(cli("verify", ckpt, "--quick", "--json", check_rc=1).stdout)
    assert doc["mode"] == "quick" and not doc["ok"] and doc["packing"] == "memmap"
    assert [(p["kind"], p["key"], p["rank"], p["file"], p["offset"]) for p in doc["problems"]] == [
        ("size", ["x"], 2, os.path.join(fmt.rank_dir(2), "x.memmap"), None),
        ("missing", ["y"], 1, os.path.join(fmt.rank_dir(1), "y.memmap"), None),
    ]


def test_verify_reads_version_1(tmp_path):
    golden = REPO / "tests" / "golden" / "v1" / "three_ranks"
    ckpt = tmp_path / "v1"
    shutil.copytree(golden, ckpt)
    m = tddist.read_manifest(ckpt)
    assert m.version == 1 and m.packing == "memmap"
    assert verify(ckpt).ok and verify(ckpt, quick=True).ok
    key, leaf = next(
        (k, leaf) for k, leaf in m.leaves.items() if leaf.chunk_of_rank(2) and leaf.chunk_of_rank(2).nbytes
    )
    flip_chunk_byte(ckpt, key, 2)
    doc = json.loads(cli("verify", ckpt, "--json", check_rc=1).stdout)
    assert [(p["kind"], p["key"], p["rank"], p["offset"]) for p in doc["problems"]] == [
        ("checksum", list(key), 2, None)
    ]
    assert doc["problems"][0]["file"] == chunk_span(ckpt, key, 2).relpath


def test_verify_archive(tmp_path):
    three_ranks(tmp_path / "d")
    tddist.pack(tmp_path / "d", tmp_path / "a.tdz")
    assert verify(tmp_path / "a.tdz").ok
    files = zipfile_offsets(tmp_path / "a.tdz")
    for name in ("rank-00000/x.memmap", "rank-00002/y.memmap"):
        flip_byte(tmp_path / "a.tdz", files[name])
    doc = json.loads(cli("verify", tmp_path / "a.tdz", "--json", "--threads", "3", check_rc=1).stdout)
    assert doc["layout"] == "archive"
    assert [(p["kind"], p["file"]) for p in doc["problems"]] == [
        ("checksum", "rank-00000/x.memmap"),
        ("checksum", "rank-00002/y.memmap"),
    ]
    assert cli("verify", tmp_path / "a.tdz", "--quick", check_rc=0).stdout.startswith(f"{tmp_path / 'a.tdz'}: OK")


def zipfile_offsets(path: Path) -> dict[str, int]:
    """Offset of each archive entry's data."""
    import zipfile

    out = {}
    with zipfile.ZipFile(path) as zf, open(path, "rb") as f:
        for zi in zf.infolist():
            f.seek(zi.header_offset + 26)
            n, m = int.from_bytes(f.read(2), "little"), int.from_bytes(f.read(2), "little")
            out[zi.filename] = zi.header_offset + 30 + n + m
    return out


# --- diff ----------------------------------------------------------------------------------------


def test_diff(tmp_path):
    three_ranks(tmp_path / "three")
    tddist.pack(tmp_path / "three", tmp_path / "three.tdz")
    full = tddist.load(tmp_path / "three", shard=None)

    def two_ranks(c, name="two", **kwargs):
        rows = slice(c.rank * 6, (c.rank + 1) * 6)
        td = TensorDict(x=full["x"][rows].clone(), y=full["y"][rows].clone(), batch_size=[6])
        td.set_non_tensor("who", ["rank0", "rank1", "rank2"][c.rank])
        td.set_non_tensor("lr", 0.5)
        return tddist.save(td, tmp_path / name, comm=c, **kwargs)

    assert not any(isinstance(r, BaseException) for r in tddist.run_threads(2, two_ranks, timeout=60))
    memmap = tddist.run_threads(2, lambda c: two_ranks(c, "two-memmap", layout="memmap"), timeout=60)
    assert not any(isinstance(r, BaseException) for r in memmap)

    doc = cli_json("diff", tmp_path / "three", tmp_path / "three.tdz")  # same chunks: checksums only
    assert doc["identical"] and doc["same"] == 4 and doc["layout"] == ["directory", "archive"]

    doc = cli_json("diff", tmp_path / "three", tmp_path / "two", rc=1)  # other world size: the data
    changed = {tuple(d["key"]): d for d in doc["changed"]}
    assert set(changed) == {("who",)}, changed  # per rank values: 3 ranks vs 2
    assert doc["same"] == 3 and doc["world_size"] == [3, 2]
    doc = cli_json("diff", tmp_path / "three", tmp_path / "two", "--checksums-only", rc=1)
    assert sorted(doc["not_compared"]) == [["x"], ["y"]]
    # the bytes compared across packings: spans of the data files against files of their own
    doc = cli_json("diff", tmp_path / "three", tmp_path / "two-memmap", rc=1)
    assert [d["key"] for d in doc["changed"]] == [["who"]] and doc["same"] == 3
    assert cli_json("diff", tmp_path / "two", tmp_path / "two-memmap")["identical"]
    flip_chunk_byte(tmp_path / "two-memmap", ("x",), 1, 4)
    doc = cli_json("diff", tmp_path / "three", tmp_path / "two-memmap", rc=1)
    assert {tuple(d["key"]): (d["content"], d["compared_by"]) for d in doc["changed"]} == {
        ("who",): (None, None),
        ("x",): ("different", "data"),
    }

    # change one value, one dtype, one key, the metadata
    def changed_ranks(c):
        td = TensorDict(x=torch.arange(12.0).view(4, 3) + c.rank, y=(torch.arange(4) * c.rank).int(), batch_size=[4])
        if c.rank == 1:
            td["x"][0, 0] = -1
        td.set_non_tensor("who", f"rank{c.rank}")
        td.set_non_tensor("lr", 0.25)
        td["z"] = torch.zeros(4)
        return tddist.save(td, tmp_path / "changed", comm=c, metadata={"note": "b"})

    assert not any(isinstance(r, BaseException) for r in tddist.run_threads(3, changed_ranks, timeout=60))
    r = cli("diff", tmp_path / "three", tmp_path / "changed", check_rc=1)
    assert "only in B: z" in r.stdout
    assert "changed: x: content differs (by checksum)" in r.stdout
    assert "changed: y: dtype int64 -> int32" in r.stdout
    assert "changed: lr: value 0.5 -> 0.25" in r.stdout
    assert 'metadata: note: (absent) -> "b"' in r.stdout


# --- pack / unpack -------------------------------------------------------------------------------


def test_pack_and_unpack_refuse_to_overwrite_without_force(tmp_path):
    three_ranks(tmp_path / "d")
    save_step(tmp_path, 1)
    other = tmp_path / step_name(1)
    cli("pack", tmp_path / "d", tmp_path / "a.tdz", check_rc=0)
    before = (tmp_path / "a.tdz").read_bytes()
    tddist.pack(other, tmp_path / "b.tdz")
    r = cli("pack", other, tmp_path / "a.tdz", check_rc=1)
    assert "exists; pass --force to replace it" in r.stderr
    assert (tmp_path / "a.tdz").read_bytes() == before
    doc = cli_json("pack", other, tmp_path / "a.tdz", "--force", "--compression", "deflate")
    assert doc["schema"] == "tddist.pack/1" and doc["bytes"] == 24 * 4 + 9 * 4
    assert tddist.read_manifest(tmp_path / "a.tdz").metadata == {"step": 1}

    cli("unpack", tmp_path / "b.tdz", tmp_path / "u", check_rc=0)
    r = cli("unpack", tmp_path / "a.tdz", tmp_path / "d", check_rc=1)
    assert "--force" in r.stderr and tddist.read_manifest(tmp_path / "d").world_size == 3
    cli("unpack", tmp_path / "a.tdz", tmp_path / "d", "--force", check_rc=0)
    assert tddist.read_manifest(tmp_path / "d").world_size == 1
    assert cli_json("diff", tmp_path / "d", other)["identical"]
    assert not [n for n in os.listdir(tmp_path) if ".tddist-" in n]


def test_pack_and_unpack_refuse_the_wrong_kind_of_source_or_target(tmp_path):
    """``pack`` takes a directory and writes a file, ``unpack`` the reverse: each refuses the other's arguments
    before reading anything, says what it expects and which command fits, and leaves every path as it was."""
    save_step(tmp_path, 1)
    d = tmp_path / step_name(1)
    tddist.pack(d, tmp_path / "a.tdz")
    (tmp_path / "notes.txt").write_text("keep me")
    (tmp_path / "out").mkdir()
    before = sorted(os.listdir(tmp_path))
    cases = [
        (("pack", tmp_path / "a.tdz", tmp_path / "b.tdz"), "is a file, not a checkpoint directory", "tddist unpack"),
        (("unpack", d, tmp_path / "u"), "is a directory, not a .tdz archive", f"tddist pack {d} {d}.tdz"),
        (("pack", d, tmp_path / "out"), "'tddist pack' writes one archive file", f"{tmp_path / 'out'}.tdz"),
        (("pack", d, tmp_path / "out", "--force"), "'tddist pack' writes one archive file", "tddist unpack"),
        (("unpack", tmp_path / "a.tdz", tmp_path / "notes.txt", "--force"), "writes a directory", "tddist pack"),
        (("unpack", tmp_path / "a.tdz", tmp_path / "u.tdz"), "ends in .tdz", f"such as '{tmp_path / 'u'}'"),
    ]
    for args, what, fix in cases:
        r = cli(*args, check_rc=1)
        assert r.stderr.startswith(f"tddist {args[0]}: ") and what in r.stderr and fix in r.stderr, (args, r.stderr)
        assert "Traceback" not in r.stderr and r.stdout == ""
        doc = cli_json(*args, rc=1)
        assert doc["schema"] == "tddist.error/1" and what in doc["message"]
    assert sorted(os.listdir(tmp_path)) == before and (tmp_path / "notes.txt").read_text() == "keep me"
    assert os.listdir(tmp_path / "out") == []


# --- exit statuses, pipes, progress --------------------------------------------------------------


def test_usage_errors_exit_2_and_problems_exit_1(tmp_path):
    for args in (
        ["frobnicate"],
        ["ls"],
        ["gc", tmp_path, "--keep-last", "0"],
        ["verify", tmp_path, "--threads", "x"],
        [],
    ):
        r = cli(*args)
        assert r.returncode == 2 and "usage: tddist" in r.stderr, (args, r)
    r = cli("info", tmp_path / "missing", check_rc=1)
    assert r.stderr.startswith("tddist info: ") and "does not exist" in r.stderr and "Traceback" not in r.stderr
    doc = json.loads(cli("verify", tmp_path / "missing", "--json", check_rc=1).stdout)
    assert doc == {
        "schema": "tddist.error/1",
        "command": "verify",
        "error": "CheckpointNotFoundError",
        "message": doc["message"],
    }
    assert cli("--version", check_rc=0).stdout.strip() == f"tddist {tddist.__version__}"
    helps = cli("--help", check_rc=0).stdout
    for command in ("ls", "latest", "info", "diff", "verify", "gc", "recover", "pack", "unpack"):
        assert re.search(rf"^    {command}\s+\S", helps, re.M), command
    assert "exit status" in helps
    verify_help = cli("verify", "--help", check_rc=0).stdout
    assert "--threads N" in verify_help and "threads that read and hash" in verify_help
    assert "PATH" in verify_help and "a checkpoint directory or .tdz archive" in verify_help


def test_closed_pipe_ends_quietly(tmp_path):
    td = TensorDict({f"leaf{i:05d}": torch.zeros(1) for i in range(3000)}, batch_size=[])
    tddist.save(td, tmp_path / "many")
    p = subprocess.Popen(
        [*CMD, "info", str(tmp_path / "many"), "--leaves"], stdout=subprocess.PIPE, stderr=subprocess.PIPE
    )
    first = p.stdout.readline()
    p.stdout.close()  # like `| head -1`
    err = p.stderr.read().decode()
    rc = p.wait(timeout=120)
    assert first.startswith(str(tmp_path / "many").encode())
    assert err == "" and rc == 141, (rc, err)
    r = subprocess.run(
        [
            "bash",
            "-c",
            f"{' '.join(CMD)} info {tmp_path / 'many'} --leaves | head -n 3; {' '.join(CMD)} ls {tmp_path} --json | head -c 1",
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 0 and r.stderr == "" and len(r.stdout.splitlines()) == 4


def _with_tty_stderr(args) -> tuple[int, str]:
    """Run the command with stderr on a pseudo-terminal; returns (exit status, what the terminal got)."""
    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 40, 120, 0, 0))  # 40 rows, 120 columns
    p = subprocess.Popen([*CMD, *map(str, args)], stdout=subprocess.DEVNULL, stderr=slave)
    os.close(slave)
    chunks = []
    while True:
        try:
            data = os.read(master, 65536)
        except OSError:  # EIO: the child closed the terminal
            break
        if not data:
            break
        chunks.append(data)
    os.close(master)
    return p.wait(timeout=120), b"".join(chunks).decode(errors="replace")


def test_progress_bar_only_on_a_terminal(tmp_path):
    tddist.save({"w": torch.zeros(4 << 20)}, tmp_path / "big")  # 16 MiB
    rc, shown = _with_tty_stderr(["verify", tmp_path / "big"])
    assert rc == 0 and "verify:" in shown and "%|" in shown, shown
    rc, shown = _with_tty_stderr(["pack", tmp_path / "big", tmp_path / "big.tdz"])
    assert rc == 0 and "pack:" in shown, shown
    r = cli("verify", tmp_path / "big", check_rc=0)  # stderr is a pipe: no bar
    assert r.stderr == ""


# --- the --json schemas are the documented ones --------------------------------------------------


def documented_members() -> dict[str, set[str]]:
    """Members of each ``--json`` document as docs/cli.md lists them (``#### `tddist.NAME/1` `` tables)."""
    text = (REPO / "docs" / "cli.md").read_text()
    out: dict[str, set[str]] = {}
    for m in re.finditer(r"^#### `(tddist\.[a-z]+/1)`\n(.*?)(?=^#|\Z)", text, re.M | re.S):
        out[m.group(1)] = set(re.findall(r"^\| `([a-z_.\[\]]+)` \|", m.group(2), re.M))
    return out


def _members(doc, prefix="") -> set[str]:
    out = set()
    for k, v in doc.items():
        out.add(prefix + k)
        if isinstance(v, list) and v and isinstance(v[0], dict) and k not in ("metadata",):
            for item in v:
                out |= _members(item, f"{prefix}{k}[].")
    return out


def test_json_documents_match_docs(tmp_path):
    docs = documented_members()
    root = tmp_path / "run"
    for step in (1, 2):
        save_step(root, step)
    killed_save(root / step_name(3))
    ckpt = root / step_name(2)
    three_ranks(tmp_path / "three")
    emitted = {
        "ls": cli_json("ls", root),
        "latest": cli_json("latest", root),
        "info": cli_json("info", tmp_path / "three"),
        "diff": cli_json("diff", root / step_name(1), ckpt, rc=1),
        "verify": cli_json("verify", ckpt),
        "gc": cli_json("gc", root, "--dry-run", "--keep-last", "1"),
        "recover": cli_json("recover", root / step_name(3)),
        "pack": cli_json("pack", ckpt, tmp_path / "p.tdz"),
        "unpack": cli_json("unpack", tmp_path / "p.tdz", tmp_path / "u"),
        "error": json.loads(cli("info", tmp_path / "nope", "--json", check_rc=1).stdout),
    }
    flip_chunk_byte(ckpt, ("batch", "obs"), 0)
    emitted["verify"] = cli_json("verify", ckpt, rc=1)
    assert emitted["verify"]["problems"][0]["offset"] == 0
    (ckpt / fmt.rank_data_name(0)).unlink()
    emitted["verify-file"] = cli_json("verify", ckpt, rc=1)
    memmap = tmp_path / "memmap"
    save_step(tmp_path, 4, layout="memmap").rename(memmap)
    flip_chunk_byte(memmap, ("batch", "obs"), 0)
    emitted["verify-memmap"] = cli_json("verify", memmap, rc=1)
    killed_save(ckpt)
    emitted["info-leftovers"] = cli_json("info", ckpt)
    for name, doc in emitted.items():
        schema = doc["schema"]
        assert schema in docs, f"{schema} is not documented in docs/cli.md"
        got = _members(doc)
        assert got <= docs[schema], f"{schema}: undocumented members {sorted(got - docs[schema])}"
        top = {m for m in docs[schema] if "." not in m}
        assert top <= set(doc), f"{schema}: documented but missing {sorted(top - set(doc))}"
