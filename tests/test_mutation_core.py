"""Fast in-process tests of the commit, publish, recovery and file-system guarantees.

Written against the mutants that survived ``scripts/mutation.sh``: each test
asserts a behaviour on real files (thread ranks, one process), never a mock.
"""

from __future__ import annotations

import errno
import os
import stat
import zipfile
from pathlib import Path

import pytest
import torch
from tensordict import TensorDict

import tddist
from tddist import _fs
from tddist import format as fmt
from tddist._faults import inject, without_exchange
from tddist.errors import InjectedFault, InvalidArgumentError
from tddist.storage import recovery
from tddist.storage.publish import publish
from tests.helpers import leftovers

# --- _fs ------------------------------------------------------------------------------------


def test_exchange_swaps_two_entries(tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    a.mkdir()
    (a / "f").write_text("A")
    b.write_text("B")
    assert _fs.exchange(str(a), str(b)) is True
    assert a.read_text() == "B" and (b / "f").read_text() == "A"


def test_renameat2_errors_carry_errno_and_both_paths(tmp_path):
    with pytest.raises(FileNotFoundError) as e:
        _fs.exchange(str(tmp_path / "missing"), str(tmp_path / "also-missing"))
    assert e.value.errno == errno.ENOENT
    assert e.value.filename == str(tmp_path / "missing") and e.value.filename2 == str(tmp_path / "also-missing")


@pytest.mark.parametrize("kernel", [True, False], ids=["renameat2", "without-renameat2"])
def test_rename_noreplace(tmp_path, kernel, monkeypatch):
    if not kernel:
        monkeypatch.setattr(_fs, "_libc", False)  # as where the C library cannot be loaded
        assert _fs.exchange(str(tmp_path), str(tmp_path)) is False
    src, dst = tmp_path / "src", tmp_path / "dst"
    src.write_text("new")
    dst.write_text("old")
    with pytest.raises(FileExistsError) as e:
        _fs.rename_noreplace(str(src), str(dst))
    assert e.value.errno == errno.EEXIST
    assert src.read_text() == "new" and dst.read_text() == "old"
    dst.unlink()
    _fs.rename_noreplace(str(src), str(dst))
    assert dst.read_text() == "new" and not src.exists()
    # a dangling symbolic link is an existing entry, never replaced
    src.write_text("newer")
    os.symlink(tmp_path / "nowhere", dst.with_name("link"))
    with pytest.raises(FileExistsError):
        _fs.rename_noreplace(str(src), str(dst.with_name("link")))
    assert os.path.islink(dst.with_name("link"))


def test_kernel_version_comparison():
    major, minor = (int(x) for x in os.uname().release.split(".")[:2])
    assert _fs._kernel_at_least(major, minor)
    assert _fs._kernel_at_least(major, 0)
    assert _fs._kernel_at_least(0, 0)
    assert not _fs._kernel_at_least(major, minor + 1)
    assert not _fs._kernel_at_least(major + 1, 0)


def test_syncfs_and_fsync_walk(tmp_path):
    (tmp_path / "d" / "e").mkdir(parents=True)
    (tmp_path / "d" / "e" / "f").write_bytes(b"x")
    assert _fs.syncfs(str(tmp_path)) is _fs._kernel_at_least(5, 8)
    _fs.fsync_tree_dirs(str(tmp_path))
    _fs.fsync_path(str(tmp_path / "d" / "e" / "f"))
    with pytest.raises(FileNotFoundError):
        _fs.fsync_path(str(tmp_path / "missing"))
    with pytest.raises(FileNotFoundError):
        _fs.syncfs(str(tmp_path / "missing")) if _fs._kernel_at_least(5, 8) else _fs.fsync_path(str(tmp_path / "x"))


def test_makedirs_durable(tmp_path):
    deep = tmp_path / "a" / "b" / "c"
    _fs.makedirs_durable(str(deep))
    assert deep.is_dir()
    _fs.makedirs_durable(str(deep))  # existing: nothing to do
    _fs.makedirs_durable(str(tmp_path / "a" / "b2"))
    assert sorted(os.listdir(tmp_path / "a")) == ["b", "b2"]


def test_write_durable(tmp_path):
    p = tmp_path / "f"
    p.write_bytes(b"a much longer old content")
    data = bytes(range(256)) * 1000
    _fs.write_durable(str(p), memoryview(data))
    assert p.read_bytes() == data  # whole, and the old content truncated
    _fs.write_durable(str(p), b"short", sync=False)
    assert p.read_bytes() == b"short"
    mode = stat.S_IMODE(os.stat(p).st_mode)
    assert mode & 0o600 == 0o600 and not mode & 0o111


def test_remove_tree(tmp_path):
    tree = tmp_path / "t"
    (tree / "a" / "b").mkdir(parents=True)
    (tree / "a" / "b" / "f").write_text("x")
    (tree / "z").write_text("y")
    _fs.remove_tree(str(tree))
    assert not tree.exists()
    _fs.remove_tree(str(tree))  # already gone: nothing
    f = tmp_path / "file"
    f.write_text("x")
    _fs.remove_tree(str(f))
    assert not f.exists()
    # a symbolic link to a directory: the link goes, never what it points to
    keep = tmp_path / "keep"
    keep.mkdir()
    (keep / "data").write_text("precious")
    os.symlink(keep, tmp_path / "link")
    _fs.remove_tree(str(tmp_path / "link"))
    assert not os.path.lexists(tmp_path / "link") and (keep / "data").read_text() == "precious"
    empty = tmp_path / "empty"
    empty.mkdir()
    _fs.remove_tree(str(empty))
    assert not empty.exists()


def test_remove_tree_fault_strikes_after_the_first_entry(tmp_path):
    tree = tmp_path / "t"
    tree.mkdir()
    for name in ("b", "a", "c"):
        (tree / name).write_text(name)
    with inject("discard", 0), pytest.raises(InjectedFault):
        _fs.remove_tree(str(tree))
    assert sorted(os.listdir(tree)) == ["b", "c"]  # the first by name went first
    f = tmp_path / "f"
    f.write_text("x")
    with inject("discard", 0), pytest.raises(InjectedFault):
        _fs.remove_tree(str(f))
    assert f.exists()


def test_is_inside(tmp_path):
    root = tmp_path / "root"
    (root / "sub").mkdir(parents=True)
    (tmp_path / "root2").mkdir()
    real = os.path.realpath(root)
    assert _fs.is_inside(real, str(root))
    assert _fs.is_inside(real, str(root / "sub"))
    assert not _fs.is_inside(real, str(tmp_path / "root2"))  # a common prefix is not inside
    assert not _fs.is_inside(real, str(tmp_path))
    os.symlink(tmp_path / "root2", root / "escape")
    assert not _fs.is_inside(real, str(root / "escape"))


# --- publish --------------------------------------------------------------------------------


def staged(tmp_path: Path, target: Path, text: str) -> str:
    s = Path(fmt.staging_path(str(target)))
    s.mkdir()
    (s / "content").write_text(text)
    return str(s)


@pytest.mark.parametrize("exchange", [True, False], ids=["exchange", "backup"])
def test_publish(tmp_path, exchange):
    target = tmp_path / "ckpt"
    publish(staged(tmp_path, target, "one"), str(target))
    assert (target / "content").read_text() == "one" and leftovers(target) == []
    if exchange:
        publish(staged(tmp_path, target, "two"), str(target))
    else:
        with without_exchange():
            publish(staged(tmp_path, target, "two"), str(target))
    assert (target / "content").read_text() == "two"
    assert leftovers(target, strict=True) == []


def test_publish_keeps_the_old_checkpoint_if_removing_it_fails(tmp_path):
    target = tmp_path / "ckpt"
    publish(staged(tmp_path, target, "one"), str(target))
    with inject("replace", 0), pytest.raises(InjectedFault):
        publish(staged(tmp_path, target, "two"), str(target))
    assert (target / "content").read_text() == "two"  # committed before the fault
    (old,) = leftovers(target)
    assert (tmp_path / old / "content").read_text() == "one"
    assert tddist.recover(target) == [f"removed {tmp_path / old}"]


# --- recovery -------------------------------------------------------------------------------


def test_is_committed_and_is_tddist_archive(tmp_path):
    d = tmp_path / "d"
    d.mkdir()
    assert not recovery.is_committed(str(d))
    (d / fmt.MANIFEST_NAME).write_text("{}")
    assert recovery.is_committed(str(d))
    (tmp_path / "m").mkdir()
    (tmp_path / "m" / fmt.MANIFEST_NAME).mkdir()  # a directory named like the manifest is not one
    assert not recovery.is_committed(str(tmp_path / "m"))
    assert not recovery.is_committed(str(tmp_path / "missing"))
    z = tmp_path / "a.tdz"
    with zipfile.ZipFile(z, "w") as zf:
        zf.writestr("other.json", "{}")
    assert not recovery.is_tddist_archive(str(z)) and not recovery.is_committed(str(z))
    with zipfile.ZipFile(z, "w") as zf:
        zf.writestr(fmt.MANIFEST_NAME, "{}")
    assert recovery.is_tddist_archive(str(z)) and recovery.is_committed(str(z))
    (tmp_path / "junk").write_bytes(b"not a zip")
    assert not recovery.is_tddist_archive(str(tmp_path / "junk"))
    assert not recovery.is_tddist_archive(str(tmp_path / "missing"))
    assert not recovery.is_tddist_archive(str(tmp_path))


def test_is_tddist_dir(tmp_path):
    d = tmp_path / "d"
    d.mkdir()
    assert recovery.is_tddist_dir(str(d))  # empty
    for name in (fmt.MANIFEST_NAME, fmt.INDEX_NAME, fmt.rank_dir(0), fmt.rank_data_name(3)):
        (d / name).write_text("")
    assert recovery.is_tddist_dir(str(d))
    (d / "notes.txt").write_text("")
    assert not recovery.is_tddist_dir(str(d))
    with pytest.raises(OSError):
        recovery.is_tddist_dir(str(tmp_path / "missing"))


def test_recover_removes_staging_and_trash_and_needless_backups(tmp_path):
    target = tmp_path / "ckpt"
    tddist.save({"x": torch.arange(3)}, target)
    made = []
    for make in (fmt.staging_path, fmt.trash_path, fmt.backup_path):
        p = Path(make(str(target)))
        p.mkdir()
        (p / "f").write_text("x")
        made.append(p)
    done = tddist.recover(target)
    assert sorted(done) == sorted(f"removed {p}" for p in made)
    assert leftovers(target) == [] and torch.equal(tddist.load(target)["x"], torch.arange(3))
    assert tddist.recover(target) == []


def test_recover_restores_a_backup_to_an_absent_target(tmp_path):
    target = tmp_path / "ckpt"
    tddist.save({"x": torch.arange(3)}, tmp_path / "old")
    backup = fmt.backup_path(str(target))
    os.rename(tmp_path / "old", backup)
    (Path(fmt.staging_path(str(target)))).mkdir()
    done = tddist.recover(target)
    assert f"restored {backup} to {target}" in done and len(done) == 2, done
    assert torch.equal(tddist.load(target)["x"], torch.arange(3)) and leftovers(target) == []


def test_recover_removes_an_uncommitted_backup(tmp_path):
    target = tmp_path / "ckpt"
    backup = Path(fmt.backup_path(str(target)))
    backup.mkdir()
    (backup / fmt.rank_data_name(0)).write_text("")  # torn: no manifest
    assert tddist.recover(target) == [f"removed {backup}"]
    assert not target.exists() and leftovers(target) == []


# --- commit ---------------------------------------------------------------------------------


@pytest.mark.parametrize("option", ["target", "atomic", "layout"])
def test_ranks_that_disagree_are_refused(tmp_path, option):
    """Rank 2 passes another target, atomicity or packing (``layout=``): every rank is refused, nothing is written.

    (Differing packings once committed a checkpoint without rank 2's data file.)
    """
    other = {"target": tmp_path / "other", "atomic": False, "layout": "memmap"}

    def save(c):
        kw = {"target": tmp_path / "ckpt", "atomic": True, "layout": "packed"}
        if c.rank == 2:
            kw[option] = other[option]
        target = kw.pop("target")
        return tddist.save(TensorDict(x=torch.full((2, 3), float(c.rank)), batch_size=[2]), target, comm=c, **kw)

    results = tddist.run_threads(3, save, timeout=60)
    assert all(isinstance(r, InvalidArgumentError) for r in results), results
    text = str(results[0])
    assert "rank 2" in text and "every rank must call save with the same path and options" in text, text
    assert not (tmp_path / "ckpt").exists() and not (tmp_path / "other").exists()
    assert leftovers(tmp_path / "ckpt") == [] and leftovers(tmp_path / "other") == []


def test_a_rank_with_other_keys_is_told_which(tmp_path):
    """Rank 1 saves an extra key: every rank is refused with rank 1's own account of the difference, naming the key
    (rank 0 hands the differing rank its structure with the staging area), and nothing is written."""

    def save(c):
        data = {"w": torch.zeros(4)} | ({"extra": torch.ones(2)} if c.rank == 1 else {})
        return tddist.save(data, tmp_path / "ckpt", comm=c)

    results = tddist.run_threads(2, save, timeout=60)
    assert all(isinstance(r, tddist.ShardingError) for r in results), results
    text = str(results[0])
    assert "rank 0 and rank 1 save different keys" in text and "only on rank 1: [\"'extra'\"]" in text, text
    assert not (tmp_path / "ckpt").exists() and leftovers(tmp_path / "ckpt") == []


def test_a_target_that_cannot_be_prepared_is_named(tmp_path):
    """The staging area cannot be created (the parent is a file): a TargetError naming the target, on every rank."""
    (tmp_path / "file").write_text("x")
    target = tmp_path / "file" / "ckpt"
    results = tddist.run_threads(2, lambda c: tddist.save({"w": torch.zeros(2)}, target, comm=c), timeout=60)
    assert all(isinstance(r, tddist.TargetError) for r in results), results
    assert str(target) in str(results[1]), results[1]


@pytest.mark.parametrize(
    "point, rank",
    [("begin", 0), ("begin", 1), ("prepare", 0), ("write", 0), ("write", 1), ("vote", 0), ("vote", 1),
     ("validate", 0), ("manifest", 0), ("publish", 0)],
)  # fmt: skip
def test_each_fault_point_strikes_the_rank_it_names(tmp_path, point, rank):
    """A fault injected at a commit step on one rank fails the save there (the name and the rank of every
    ``fault_point`` call of the commit are what the crash and fault tests aim at); before the commit point the old
    checkpoint stays; after it the new one is there (``publish``; ``vote`` on rank 1 strikes once its vote reached
    rank 0, which commits)."""
    target = tmp_path / "ckpt"
    tddist.save({"x": torch.zeros(3)}, target)
    with inject(point, rank):  # where the other rank waits for the struck one, it waits out this timeout
        results = tddist.run_threads(2, lambda c: tddist.save({"x": torch.ones(3)}, target, comm=c), timeout=5)
    assert isinstance(results[rank], InjectedFault), results
    assert f"commit step {point!r}" in str(results[rank]), results[rank]
    assert all(isinstance(r, tddist.TddistError) for r in results), results
    want = torch.ones(3) if (point, rank) in (("publish", 0), ("vote", 1)) else torch.zeros(3)
    assert torch.equal(tddist.load(target, verify=True)["x"], want)


@pytest.mark.parametrize("atomic", [True, False], ids=["atomic", "non-atomic"])
def test_an_aborted_save_leaves_the_old_checkpoint_or_a_refused_target(tmp_path, atomic):
    """A failure after every rank wrote: atomic, the old checkpoint stays and the staging area goes;
    non-atomic, the target has no manifest, so readers refuse it instead of misreading it."""
    target = tmp_path / "ckpt"
    tddist.save({"x": torch.zeros(3)}, target)
    with inject("validate", 0):
        results = tddist.run_threads(
            2, lambda c: tddist.save({"x": torch.ones(3)}, target, comm=c, atomic=atomic), timeout=60
        )
    assert all(isinstance(r, InjectedFault) for r in results), results
    assert leftovers(target) == []
    if atomic:
        assert torch.equal(tddist.load(target, verify=True)["x"], torch.zeros(3))
    else:
        assert not (target / fmt.MANIFEST_NAME).exists()
        with pytest.raises(tddist.CheckpointNotFoundError):
            tddist.load(target)


def test_recover_restores_one_committed_backup_and_removes_the_rest(tmp_path):
    """Two committed backups of an absent target: one is restored, the other removed, whatever their order."""
    target = tmp_path / "ckpt"
    backups = []
    for value in (1, 2):
        tddist.save({"x": torch.full((2,), float(value))}, tmp_path / "b")
        backups.append(Path(fmt.backup_path(str(target))))
        os.rename(tmp_path / "b", backups[-1])
    Path(fmt.trash_path(str(target))).mkdir()
    done = tddist.recover(target)
    assert len(done) == 3 and sum(line.startswith("restored ") for line in done) == 1, done
    restored = next(b for b in backups if f"restored {b} to {target}" in done)
    other = next(b for b in backups if b != restored)
    assert f"removed {other}" in done
    assert leftovers(target) == []
    assert tddist.load(target)["x"][0].item() == (1.0 if restored == backups[0] else 2.0)


def memmap_checkpoint(tmp_path: Path) -> Path:
    ckpt = tmp_path / "m"
    results = tddist.run_threads(
        3,
        lambda c: tddist.save(
            TensorDict(x=torch.full((2, 3), float(c.rank)), batch_size=[2]), ckpt, comm=c, layout="memmap"
        ),  # fmt: skip
        timeout=60,
    )
    assert not any(isinstance(r, BaseException) for r in results), results
    return ckpt


def chunk_file(ckpt: Path, rank: int) -> Path:
    from tddist.manifest.locate import Locator

    m = tddist.read_manifest(ckpt)
    leaf = m.leaves[("x",)]
    return ckpt / Locator(m).locate(leaf, leaf.chunk_of_rank(rank)).relpath


def test_verify_memmap_reports_each_damaged_file(tmp_path):
    """Layout "memmap": a missing rank directory, a missing, resized or symlinked chunk file, each reported."""
    import shutil

    from tddist.tools.verify import MISSING, NOT_A_FILE, SIZE, STRUCTURE, verify

    ckpt = memmap_checkpoint(tmp_path)
    assert verify(ckpt).ok and verify(ckpt, quick=True).ok
    shutil.rmtree(ckpt / fmt.rank_dir(2))
    f1 = chunk_file(ckpt, 1)
    f1.write_bytes(f1.read_bytes() + b"x")
    for quick in (False, True):
        got = [(p.kind, p.key, p.rank) for p in verify(ckpt, quick=quick).problems]
        assert got == [(STRUCTURE, None, 2), (SIZE, ("x",), 1), (MISSING, ("x",), 2)], got
    f0 = chunk_file(ckpt, 0)
    f0.unlink()
    os.symlink(f1, f0)
    got = [(p.kind, p.rank, p.file) for p in verify(ckpt).problems]
    assert got[1] == (NOT_A_FILE, 0, str(f0.relative_to(ckpt))), got
    assert "restore it from a copy" in verify(ckpt).problems[0].message


# --- reader ---------------------------------------------------------------------------------


@pytest.mark.parametrize("num_threads", [0, 3])
@pytest.mark.parametrize("layout", ["packed", "memmap", "archive"])
def test_reads_across_chunks_with_and_without_threads(tmp_path, layout, num_threads):
    """Three ranks save rows of a leaf; loads that cross their chunks (whole, and a middle slice on 2 ranks) are
    exact, verified or not, with the copy done serially or by a pool (one piece, several pieces, an empty box)."""
    full = torch.arange(9 * 4, dtype=torch.float32).reshape(9, 4)
    target = tmp_path / ("ckpt.tdz" if layout == "archive" else "ckpt")
    kw = {} if layout == "archive" else {"layout": layout}

    def save(c):
        rows = full[c.rank * 3 : (c.rank + 1) * 3]
        return tddist.save(TensorDict(x=rows, e=torch.zeros(3, 0), batch_size=[3]), target, comm=c, **kw)

    assert not any(isinstance(r, Exception) for r in tddist.run_threads(3, save, timeout=60))
    for verify in (False, True):
        whole = tddist.load(target, shard=None, num_threads=num_threads, verify=verify)
        assert torch.equal(whole["x"], full) and whole["e"].shape == (9, 0)
        parts = tddist.run_threads(
            2, lambda c: tddist.load(target, comm=c, num_threads=num_threads, verify=verify)["x"].clone(), timeout=60
        )
        assert torch.equal(torch.cat(parts), full), parts
        one = tddist.load(target, shard=None, keys=["x"], num_threads=num_threads, verify=verify)
        assert torch.equal(one["x"][3:6], full[3:6])
