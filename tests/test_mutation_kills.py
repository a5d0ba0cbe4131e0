"""Guarantees an audit found untested: each test fails when the guarantee is broken.

- ``verify=True`` and ``tddist verify`` check every chunk a read spans, and
  every block of a chunk, not only the first: a flipped byte in the last (or
  a middle) rank's chunk of a multi-rank leaf, or in the last block of a
  large chunk, is an error.
- A foreign directory whose only entries are hidden (a lone ``.git``, a
  ``.keep``) is foreign data: a save refuses it, and neither ``recover``, nor
  the manager's clean-up, nor ``tddist gc`` replaces or deletes it.

Everything runs in one process (ranks are threads), on real files, so the
mutation run (``scripts/mutation.sh``) can use these tests.
"""

from __future__ import annotations

import json
import os
import zipfile
from pathlib import Path

import pytest
import torch
from tensordict import TensorDict

import tddist
from tddist import cli
from tddist import format as fmt
from tddist.errors import CorruptCheckpointError, TargetError
from tddist.manifest.locate import Locator
from tddist.tools.verify import CHECKSUM, verify
from tests.helpers import assert_td_equal, flip, leftovers

RANKS = 4
KEY = ("w",)


def rank_data(rank: int) -> TensorDict:
    """Rank ``rank``'s rows: a leaf before ``w`` in the manifest, and ``w``: 3 rows of 16 float64 values."""
    return TensorDict(
        a=torch.full((3, 2), rank, dtype=torch.int32),
        w=torch.arange(48, dtype=torch.float64).view(3, 16) + 1000 * rank,
        batch_size=[3],
    )


def save_ranks(path: Path, **kwargs) -> None:
    results = tddist.run_threads(RANKS, lambda c: tddist.save(rank_data(c.rank), path, comm=c, **kwargs), timeout=60)
    bad = {r: x for r, x in enumerate(results) if isinstance(x, BaseException)}
    assert not bad, bad


def flip_chunk(ckpt: Path, rank: int, at: int) -> None:
    """Flip byte ``at`` of ``rank``'s chunk of leaf ``KEY``, where its packing or the archive put it."""
    m = tddist.read_manifest(ckpt)
    leaf = m.leaves[KEY]
    loc = Locator(m).locate(leaf, leaf.chunk_of_rank(rank))
    assert 0 <= at < loc.nbytes
    if ckpt.is_file():
        with zipfile.ZipFile(ckpt) as zf:
            zi = zf.getinfo(loc.relpath.replace(os.sep, "/"))
        assert zi.compress_type == zipfile.ZIP_STORED
        with open(ckpt, "rb") as f:  # the payload follows the local header and its name and extra fields
            f.seek(zi.header_offset + 26)
            name_len, extra_len = (int.from_bytes(f.read(2), "little") for _ in range(2))
        flip(ckpt, zi.header_offset + 30 + name_len + extra_len + at)
    else:
        flip(ckpt / loc.relpath, loc.offset + at)


LAYOUTS = {
    "packed": dict(layout="packed"),
    "memmap": dict(layout="memmap"),
    "archive": dict(archive=True),
}


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
@pytest.mark.parametrize("rank", [RANKS - 1, 2, 1], ids=["last-rank", "middle-rank-2", "middle-rank-1"])
@pytest.mark.parametrize("where", ["first-byte", "last-byte"])
def test_every_chunk_of_a_read_is_verified(tmp_path, layout, rank, where):
    """A damaged chunk anywhere in a multi-rank leaf fails load(verify=True) and verify, naming that rank."""
    ckpt = tmp_path / ("ckpt.tdz" if layout == "archive" else "ckpt")
    save_ranks(ckpt, **LAYOUTS[layout])
    whole = torch.cat([rank_data(r) for r in range(RANKS)])
    assert_td_equal(tddist.load(ckpt, shard=None, verify=True), whole, "before the damage")
    nbytes = rank_data(rank)["w"].numel() * 8
    flip_chunk(ckpt, rank, 0 if where == "first-byte" else nbytes - 1)

    with pytest.raises(CorruptCheckpointError, match=rf"rank {rank}"):
        tddist.load(ckpt, shard=None, verify=True)
    # the rows of the damaged rank alone, read by a rank of another job size, are refused too
    with pytest.raises(CorruptCheckpointError, match=rf"rank {rank}"):
        tddist.load(ckpt, shard=(3 * rank, 3 * rank + 3), verify=True)
    # the other ranks' rows still load and verify
    others = [r for r in range(RANKS) if r != rank]
    for r in others:
        got = tddist.load(ckpt, shard=(3 * r, 3 * r + 3), verify=True)
        assert_td_equal(got, rank_data(r), f"rows of undamaged rank {r}")

    report = verify(ckpt)
    assert not report.ok
    assert [(p.kind, p.key, p.rank) for p in report.problems] == [(CHECKSUM, KEY, rank)], report.problems
    assert verify(ckpt, quick=True).ok  # sizes are intact: only reading the bytes finds it


def test_cli_verify_reports_the_last_rank(tmp_path, capsys):
    """``tddist verify --json`` exits non-zero and names the damaged chunk of the last rank, and only it."""
    ckpt = tmp_path / "ckpt"
    save_ranks(ckpt)
    assert cli.main(["verify", str(ckpt), "--json"]) == 0
    capsys.readouterr()
    flip_chunk(ckpt, RANKS - 1, 5)
    code = cli.main(["verify", str(ckpt), "--json"])
    doc = json.loads(capsys.readouterr().out)
    assert code != 0 and doc["ok"] is False, doc
    assert [(p["kind"], p["key"], p["rank"]) for p in doc["problems"]] == [("checksum", list(KEY), RANKS - 1)], doc


def test_every_block_of_a_large_chunk_is_verified(tmp_path):
    """A chunk of more than one checksum block: a flipped byte in its last block is found."""
    n = (fmt.CHECKSUM_BLOCK + fmt.CHECKSUM_BLOCK // 2) // 4  # one and a half blocks of float32
    ckpt = tmp_path / "big"
    tddist.save(TensorDict(big=torch.ones(n), small=torch.zeros(3), batch_size=[]), ckpt)
    m = tddist.read_manifest(ckpt)
    leaf = m.leaves[("big",)]
    loc = Locator(m).locate(leaf, leaf.chunk_of_rank(0))
    assert loc.nbytes > fmt.CHECKSUM_BLOCK
    assert verify(ckpt, num_threads=1).ok and verify(ckpt, num_threads=2).ok
    assert torch.equal(tddist.load(ckpt, keys="big", verify=True, num_threads=2)["big"], torch.ones(n))
    flip(ckpt / loc.relpath, loc.offset + loc.nbytes - 1)
    with pytest.raises(CorruptCheckpointError, match="checksum mismatch"):
        tddist.load(ckpt, verify=True)
    assert [(p.kind, p.key) for p in verify(ckpt, num_threads=1).problems] == [(CHECKSUM, ("big",))]
    assert [(p.kind, p.key) for p in verify(ckpt, num_threads=2).problems] == [(CHECKSUM, ("big",))]
    small = tddist.load(ckpt, keys="small", verify=True)  # only the chunks read are checked
    assert torch.equal(small["small"], torch.zeros(3))


# --- foreign directories whose only entries are hidden ------------------------------------


HIDDEN = {
    "git": lambda d: (d / ".git").mkdir() or (d / ".git" / "HEAD").write_text("ref: refs/heads/main\n"),
    "keep": lambda d: (d / ".keep").write_text(""),
}


def foreign(path: Path, kind: str) -> dict[str, bytes]:
    """Make ``path`` a directory whose only entry is hidden; return its files and contents."""
    path.mkdir(parents=True)
    HIDDEN[kind](path)
    return snapshot(path)


def snapshot(path: Path) -> dict[str, bytes]:
    return {str(p.relative_to(path)): (p.read_bytes() if p.is_file() else b"<dir>") for p in sorted(path.rglob("*"))}


@pytest.mark.parametrize("kind", sorted(HIDDEN))
@pytest.mark.parametrize("atomic", [True, False], ids=["atomic", "non-atomic"])
def test_save_refuses_a_directory_of_hidden_entries(tmp_path, kind, atomic):
    target = tmp_path / "ckpt"
    before = foreign(target, kind)
    with pytest.raises(TargetError, match="not a tddist checkpoint.*never deletes foreign data"):
        tddist.save({"x": torch.ones(3)}, target, atomic=atomic)
    assert snapshot(target) == before
    assert leftovers(target) == []
    # on every rank of a job, too
    results = tddist.run_threads(
        2, lambda c: tddist.save({"x": torch.ones(3)}, target, comm=c, atomic=atomic), timeout=60
    )
    assert [type(r) for r in results] == [TargetError, TargetError], results
    assert snapshot(target) == before
    assert leftovers(target) == []


def test_an_empty_directory_is_a_valid_target(tmp_path):
    """The counterpart: an empty directory holds nothing foreign, and is replaced."""
    target = tmp_path / "ckpt"
    target.mkdir()
    tddist.save({"x": torch.ones(3)}, target)
    assert torch.equal(tddist.load(target)["x"], torch.ones(3))


@pytest.mark.parametrize("kind", sorted(HIDDEN))
def test_recover_keeps_a_backup_rather_than_delete_hidden_entries(tmp_path, kind):
    """A committed backup beside a target that holds only a hidden entry: recover keeps both."""
    target = tmp_path / "ckpt"
    old = tmp_path / "elsewhere"
    tddist.save({"x": torch.arange(4)}, old)
    before = foreign(target, kind)
    backup = Path(fmt.backup_path(str(target)))
    os.rename(old, backup)
    done = tddist.recover(target)
    assert len(done) == 1 and done[0].startswith(f"kept {backup}"), done
    assert snapshot(target) == before
    assert torch.equal(tddist.load(backup)["x"], torch.arange(4))


@pytest.mark.parametrize("kind", sorted(HIDDEN))
def test_recover_restores_over_a_torn_checkpoint_but_not_over_hidden_entries(tmp_path, kind):
    """Contrast: a torn tddist directory in the backup's way is removed and the backup restored."""
    target = tmp_path / "ckpt"
    tddist.save({"x": torch.arange(4)}, tmp_path / "old")
    tddist.save({"x": torch.arange(5)}, target)
    os.unlink(target / fmt.MANIFEST_NAME)  # torn: tddist's files without a manifest
    backup = Path(fmt.backup_path(str(target)))
    os.rename(tmp_path / "old", backup)
    assert tddist.recover(target) == [f"restored {backup} to {target}"]
    assert torch.equal(tddist.load(target)["x"], torch.arange(4))
    # the same state, but a hidden entry in the torn directory makes it foreign: kept
    tddist.save({"x": torch.arange(6)}, tmp_path / "old")
    os.rename(tmp_path / "old", backup)
    os.unlink(target / fmt.MANIFEST_NAME)
    HIDDEN[kind](target)
    before = snapshot(target)
    done = tddist.recover(target)
    assert len(done) == 1 and done[0].startswith(f"kept {backup}"), done
    assert snapshot(target) == before and backup.is_dir()


def step_root(tmp_path: Path, kind: str) -> tuple[Path, Path, dict[str, bytes]]:
    """A root with two committed steps and a step-named directory that holds only a hidden entry."""
    from tddist.jobs.retention import step_name

    root = tmp_path / "root"
    for step in (1, 2):
        tddist.save({"x": torch.full((2,), float(step))}, root / step_name(step))
    hidden = root / step_name(3)
    return root, hidden, foreign(hidden, kind)


def steps(root: Path) -> list[str]:
    """The step checkpoints under ``root`` (leaving out whatever else the manager keeps there)."""
    from tddist.jobs.retention import parse_step

    return sorted(n for n in os.listdir(root) if parse_step(n) is not None)


@pytest.mark.parametrize("kind", sorted(HIDDEN))
def test_clean_up_and_retention_keep_hidden_only_directories(tmp_path, kind):
    from tddist.jobs.retention import clean_root, step_name

    root, hidden, before = step_root(tmp_path, kind)
    assert clean_root(str(root)) == []
    assert snapshot(hidden) == before
    with tddist.CheckpointManager(root, keep_last=1) as manager:  # cleans the root up, then retires step 1 and 2
        manager.save(4, TensorDict(x=torch.full((2,), 4.0), batch_size=[]))
        manager.wait()
    assert snapshot(hidden) == before
    assert steps(root) == [step_name(3), step_name(4)]


@pytest.mark.parametrize("kind", sorted(HIDDEN))
def test_gc_keeps_hidden_only_directories(tmp_path, kind, capsys):
    from tddist.jobs import cleanup
    from tddist.jobs.retention import step_name

    root, hidden, before = step_root(tmp_path, kind)
    plan = cleanup.plan_gc(root, keep_last=1)
    touched = {a.path for a in plan if a.action != cleanup.KEEP}
    assert str(hidden) not in touched, plan
    assert [a.path for a in plan if a.action == cleanup.KEEP] == [str(hidden)], plan
    assert cli.main(["gc", str(root), "--keep-last", "1"]) == 0
    assert snapshot(hidden) == before
    assert steps(root) == [step_name(2), step_name(3)]
