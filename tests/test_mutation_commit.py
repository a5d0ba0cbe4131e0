"""Fast in-process tests of the commit, publish, recovery, manifest and file-system primitives.

Written against the mutants that survived ``scripts/mutation.sh``: each test
asserts a behaviour on real files (thread ranks, one process).

The kernel and C-library decisions of ``_fs`` (is ``syncfs`` there, is the
kernel new enough to report writeback errors through it, what a failing call
raises) cannot be changed for a test on a real machine, so those tests replace
``os.uname`` or the loaded C library with a small stand-in that still receives
a real descriptor of the real path.
"""

from __future__ import annotations

import ctypes
import errno
import json
import os
import struct
import zipfile
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

import tddist
from tddist import _fs
from tddist import format as fmt
from tddist.errors import CheckpointNotFoundError, ManifestError
from tddist.manifest.parse import parse_manifest
from tddist.storage import pinned
from tddist.storage.backends import open_checkpoint
from tddist.storage.pinned import PinnedCheckpoint

# --- _fs: the kernel and C-library decisions ------------------------------------------------


def kernel(monkeypatch: pytest.MonkeyPatch, release: str) -> None:
    """Make ``os.uname().release`` read ``release`` (only the release is consulted)."""
    monkeypatch.setattr(os, "uname", lambda: SimpleNamespace(release=release))


@pytest.mark.parametrize(
    "release, at_least, not_at_least",
    [
        ("6.18.44-fc-v657", [(6, 18), (5, 8), (6, 0)], [(6, 19), (7, 0)]),
        ("5.10-rc1", [(5, 10), (5, 8)], [(5, 11), (6, 0)]),
        ("5.8.0-49-generic", [(5, 8), (4, 20)], [(5, 9), (6, 1)]),
        ("5.7", [(5, 7)], [(5, 8)]),
    ],
)
def test_kernel_at_least_parses_real_release_strings(monkeypatch, release, at_least, not_at_least):
    kernel(monkeypatch, release)
    for want in at_least:
        assert _fs._kernel_at_least(*want), (release, want)
    for want in not_at_least:
        assert not _fs._kernel_at_least(*want), (release, want)


@pytest.mark.parametrize("release", ["garbage", "6", "", "x.y", "6.rc"])
def test_kernel_at_least_is_false_for_a_release_it_cannot_parse(monkeypatch, release):
    kernel(monkeypatch, release)
    assert _fs._kernel_at_least(0, 0) is False


class FakeLibc:
    """A C library whose ``syncfs`` records the inode of the descriptor it gets, and fails with ``errno_``."""

    def __init__(self, errno_: int = 0):
        self.errno_, self.inodes = errno_, []

    def syncfs(self, fd: int) -> int:
        self.inodes.append(os.fstat(fd).st_ino)
        if self.errno_:
            ctypes.set_errno(self.errno_)
            return -1
        return 0


def test_syncfs_flushes_the_file_system_of_the_path(tmp_path, monkeypatch):
    """On a kernel that reports writeback errors (5.8 and later) the C library's syncfs gets a descriptor of the
    path, and syncfs says it flushed; the descriptor is closed again."""
    libc = FakeLibc()
    monkeypatch.setattr(_fs, "_libc", libc)
    (tmp_path / "f").write_text("x")
    for release in ("5.8.0-49-generic", "5.10-rc1", "6.18.44-fc-v657"):
        kernel(monkeypatch, release)
        before = len(os.listdir("/proc/self/fd"))
        assert _fs.syncfs(str(tmp_path / "f")) is True, release
        assert len(os.listdir("/proc/self/fd")) == before
    assert libc.inodes == [os.stat(tmp_path / "f").st_ino] * 3


@pytest.mark.parametrize("release", ["5.7.19", "4.18.0-553.el8_10.x86_64", "5.4", "nonsense"])
def test_syncfs_is_not_used_on_a_kernel_before_5_8(tmp_path, monkeypatch, release):
    """Before 5.8 syncfs does not report writeback errors: not called, so the caller fsyncs file by file."""
    libc = FakeLibc()
    monkeypatch.setattr(_fs, "_libc", libc)
    kernel(monkeypatch, release)
    assert _fs.syncfs(str(tmp_path)) is False
    assert libc.inodes == []


@pytest.mark.parametrize("release", ["5.8.0-49-generic", "6.18.44-fc-v657"])
def test_syncfs_is_false_without_syncfs_in_the_c_library(tmp_path, monkeypatch, release):
    kernel(monkeypatch, release)
    monkeypatch.setattr(_fs, "_libc", SimpleNamespace())  # a C library without syncfs
    assert _fs.syncfs(str(tmp_path)) is False
    monkeypatch.setattr(_fs, "_libc", False)  # a C library that cannot be loaded
    assert _fs.syncfs(str(tmp_path)) is False


@pytest.mark.parametrize("err", [errno.EIO, errno.ENOSPC])
def test_a_failing_syncfs_raises_with_its_errno_and_the_path(tmp_path, monkeypatch, err):
    """A writeback error reported by syncfs is an OSError carrying the errno, its text and the path."""
    kernel(monkeypatch, "6.18.44-fc-v657")
    libc = FakeLibc(err)
    monkeypatch.setattr(_fs, "_libc", libc)
    before = len(os.listdir("/proc/self/fd"))
    with pytest.raises(OSError) as e:
        _fs.syncfs(str(tmp_path))
    assert e.value.errno == err and e.value.strerror == os.strerror(err) and e.value.filename == str(tmp_path)
    assert str(e.value) == f"[Errno {err}] {os.strerror(err)}: {str(tmp_path)!r}"
    assert libc.inodes == [os.stat(tmp_path).st_ino]
    assert len(os.listdir("/proc/self/fd")) == before  # the descriptor is closed on failure too


def test_syncfs_of_the_real_c_library(tmp_path):
    """The real C library and kernel: syncfs is used exactly where the kernel is 5.8 or later."""
    (tmp_path / "f").write_bytes(b"x")
    major, minor = (int(x.split("-")[0]) for x in os.uname().release.split(".")[:2])
    assert _fs.syncfs(str(tmp_path / "f")) is ((major, minor) >= (5, 8))


# --- reading the manifest ----------------------------------------------------------------------------


def test_a_missing_checkpoint_is_named_without_a_hint_when_nothing_is_beside_it(tmp_path):
    target = tmp_path / "ckpt"
    with pytest.raises(CheckpointNotFoundError) as e:
        tddist.read_manifest(target)
    assert str(e.value) == f"checkpoint {str(target)!r} does not exist"
    Path(fmt.staging_path(str(target))).mkdir()  # a leftover of an interrupted save: the message says so
    with pytest.raises(CheckpointNotFoundError) as e:
        tddist.read_manifest(target)
    assert str(e.value) == (
        f"checkpoint {str(target)!r} does not exist; leftovers of an interrupted save exist beside it (1), "
        f"run tddist.recover({str(target)!r})"
    )
    target.mkdir()
    with pytest.raises(CheckpointNotFoundError) as e:
        tddist.read_manifest(target)
    assert str(e.value).startswith(f"checkpoint {str(target)!r} has no manifest (it is not a committed")


def test_an_unreadable_archive_is_a_storage_error_naming_it(tmp_path):
    """The first read of an archive fails (here: the pinned descriptor is a directory, EISDIR): a StorageError
    that names the path and the errno, never 'not a zip file'."""
    d = tmp_path / "d"
    d.mkdir()
    with PinnedCheckpoint(str(d)) as pin, pytest.raises(tddist.StorageError) as e:
        pinned._archive_manifest(pin)
    assert f"reading {str(d)!r} failed: {os.strerror(errno.EISDIR)} (errno {errno.EISDIR})" in str(e.value)


def test_a_damaged_archive_offset_names_the_archive(tmp_path):
    """An archive whose end record points its central directory past the end: the error names the archive."""
    path = tmp_path / "a.tdz"
    tddist.save({"x": torch.arange(4)}, path, archive=True)
    data = bytearray(path.read_bytes())
    end = data.rfind(b"PK\x05\x06")
    (offset,) = struct.unpack_from("<I", data, end + 16)
    struct.pack_into("<I", data, end + 16, offset + len(data))
    path.write_bytes(bytes(data))
    with pytest.raises(tddist.CorruptCheckpointError) as e:  # damaged data, not a failing storage
        tddist.read_manifest(path)
    assert repr(str(path)) in str(e.value) and "the checkpoint is damaged" in str(e.value), e.value


def test_a_manifest_entry_of_exactly_the_limit_is_read(tmp_path):
    """The manifest's bound is inclusive (``check_manifest_size``); a stored entry is read at exactly the size
    asked for, and one declaring another size is refused."""
    from tddist.manifest.model import MAX_MANIFEST_BYTES, check_manifest_size

    check_manifest_size(MAX_MANIFEST_BYTES, "m")
    with pytest.raises(ManifestError, match=rf"m has {MAX_MANIFEST_BYTES + 1} bytes, more than the"):
        check_manifest_size(MAX_MANIFEST_BYTES + 1, "m")
    z = tmp_path / "a.zip"
    with zipfile.ZipFile(z, "w") as zf:
        zf.writestr(fmt.MANIFEST_NAME, b"0123456789")
    with zipfile.ZipFile(z) as zf:
        zi = zf.getinfo(fmt.MANIFEST_NAME)
    raw = z.read_bytes()

    def read_at(offset: int, n: int) -> bytes:
        return raw[offset : offset + n]

    assert pinned.read_stored_entry(read_at, zi, 10, str(z)) == b"0123456789"
    with pytest.raises(ManifestError, match="declares 10 bytes .10 stored., its manifest implies 9"):
        pinned.read_stored_entry(read_at, zi, 9, str(z))


# --- manifest_v2: declared per-rank values --------------------------------------------------


def test_declared_per_rank_values_keep_their_declaration(tmp_path):
    """Non-tensor values saved under ``PerRank()`` are recorded as declared (``"declared": true``), even where the
    ranks' values agree; values that merely differ between ranks are per-rank but not declared."""
    target = tmp_path / "ckpt"

    def save(c):
        state = {"sampler": {"epoch": 1, "position": 7 * c.rank}, "free": {"host": f"node-{c.rank}", "n": 3}}
        return tddist.save(state, target, comm=c, placements={"sampler": tddist.PerRank()})

    results = tddist.run_threads(2, save, timeout=60)
    assert not any(isinstance(r, BaseException) for r in results), results
    objects = {tuple(o["key"]): o for o in json.loads((target / fmt.MANIFEST_NAME).read_text())["objects"]}
    assert objects[("sampler", "epoch")]["declared"] is True and objects[("sampler", "position")]["declared"] is True
    assert objects[("free", "host")]["placement"] == "per_rank" and "declared" not in objects[("free", "host")]
    m = tddist.read_manifest(target)
    assert m.objects[("sampler", "epoch")].declared is True
    assert m.objects[("sampler", "epoch")].placement == "per_rank"
    assert m.objects[("free", "host")].declared is False


# --- _fs: renameat2, the C library, writes and fsyncs ----------------------------------------


@pytest.fixture
def fsynced(monkeypatch) -> list[int]:
    """The inodes fsynced from now on (each fsync still happens)."""
    inodes: list[int] = []
    real = os.fsync

    def spy(fd: int) -> None:
        inodes.append(os.fstat(fd).st_ino)
        real(fd)

    monkeypatch.setattr(os, "fsync", spy)
    return inodes


def ino(path) -> int:
    return os.stat(path).st_ino


def open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def test_pwrite_all_writes_every_step_at_its_offset(tmp_path):
    p = tmp_path / "f"
    p.write_bytes(b"-" * 20)
    fd = os.open(p, os.O_RDWR)
    try:
        _fs.pwrite_all(fd, memoryview(b"abcdefghij"), 4, step=3)
        _fs.pwrite_all(fd, memoryview(b"XY"), 0)
        _fs.pwrite_all(fd, memoryview(b""), 19, step=1)
    finally:
        os.close(fd)
    assert p.read_bytes() == b"XY--abcdefghij------"


def test_the_c_library_is_loaded_once_and_cached(monkeypatch):
    monkeypatch.setattr(_fs, "_libc", None)
    libc = _fs._load_libc()
    assert libc is not None and hasattr(libc, "renameat2") and _fs._libc is libc
    assert _fs._load_libc() is libc


def test_a_c_library_that_cannot_be_loaded_is_tried_once(tmp_path, monkeypatch):
    """Where the C library cannot be loaded: no renameat2, no syncfs, a plain check-then-rename, and the loader is
    not tried again."""
    tries = []

    def cannot_load(*args, **kwargs):
        tries.append(args)
        raise OSError("no C library here")

    monkeypatch.setattr(_fs, "_libc", None)
    monkeypatch.setattr(ctypes, "CDLL", cannot_load)
    assert _fs._load_libc() is None and _fs._libc is False
    assert _fs._load_libc() is None and len(tries) == 1
    (tmp_path / "a").write_text("a")
    (tmp_path / "b").write_text("b")
    assert _fs.exchange(str(tmp_path / "a"), str(tmp_path / "b")) is False
    assert _fs.syncfs(str(tmp_path)) is False
    assert (tmp_path / "a").read_text() == "a" and len(tries) == 1
    with pytest.raises(FileExistsError) as e:
        _fs.rename_noreplace(str(tmp_path / "a"), str(tmp_path / "b"))
    assert e.value.errno == errno.EEXIST and e.value.strerror == "target exists"
    assert e.value.filename == str(tmp_path / "b")
    _fs.rename_noreplace(str(tmp_path / "a"), str(tmp_path / "c"))
    assert (tmp_path / "c").read_text() == "a" and not (tmp_path / "a").exists()


def test_renameat2_with_flags_the_kernel_refuses_is_unsupported(tmp_path):
    """EINVAL (here: two flags that exclude each other) means 'unsupported here': False, nothing moved."""
    (tmp_path / "a").write_text("a")
    (tmp_path / "b").write_text("b")
    both = _fs.RENAME_NOREPLACE | _fs.RENAME_EXCHANGE
    assert _fs.renameat2(str(tmp_path / "a"), str(tmp_path / "b"), both) is False
    assert (tmp_path / "a").read_text() == "a" and (tmp_path / "b").read_text() == "b"


def test_renameat2_on_relative_paths(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    Path("a").write_text("a")
    Path("b").write_text("b")
    assert _fs.exchange("a", "b") is True
    assert Path("a").read_text() == "b" and Path("b").read_text() == "a"
    _fs.rename_noreplace("a", "c")
    assert Path("c").read_text() == "b" and not Path("a").exists()


def fake_rename_libc(errno_: int) -> SimpleNamespace:
    """A C library whose renameat2 fails with ``errno_``; ``.calls`` records its arguments."""
    calls: list[tuple] = []

    def renameat2(*args) -> int:
        calls.append(args)
        ctypes.set_errno(errno_)
        return -1

    return SimpleNamespace(renameat2=renameat2, calls=calls)


@pytest.mark.parametrize("err", [errno.ENOSYS, errno.ENOTSUP, errno.EINVAL])
def test_renameat2_unsupported_by_the_kernel_or_file_system(tmp_path, monkeypatch, err):
    """ENOSYS (old kernel), ENOTSUP/EINVAL (file system): False, and rename_noreplace falls back to a check and a
    rename."""
    libc = fake_rename_libc(err)
    monkeypatch.setattr(_fs, "_libc", libc)
    a, b = str(tmp_path / "a"), str(tmp_path / "b")
    Path(a).write_text("a")
    assert _fs.exchange(a, b) is False
    assert libc.calls == [(_fs._AT_FDCWD, os.fsencode(a), _fs._AT_FDCWD, os.fsencode(b), _fs.RENAME_EXCHANGE)]
    _fs.rename_noreplace(a, b)
    assert Path(b).read_text() == "a" and not Path(a).exists()
    assert libc.calls[-1][-1] == _fs.RENAME_NOREPLACE


def test_renameat2_failing_otherwise_raises_with_both_paths(tmp_path, monkeypatch):
    monkeypatch.setattr(_fs, "_libc", fake_rename_libc(errno.EXDEV))
    a, b = str(tmp_path / "a"), str(tmp_path / "b")
    with pytest.raises(OSError) as e:
        _fs.rename_noreplace(a, b)
    assert (e.value.errno, e.value.strerror, e.value.filename, e.value.filename2) == (
        errno.EXDEV,
        os.strerror(errno.EXDEV),
        a,
        b,
    )


def test_fsync_path_and_write_durable_fsync_what_they_name(tmp_path, fsynced):
    (tmp_path / "d").mkdir()
    before = open_fds()
    _fs.fsync_path(str(tmp_path / "d"))
    assert fsynced == [ino(tmp_path / "d")] and open_fds() == before
    fsynced.clear()
    _fs.write_durable(str(tmp_path / "f"), b"data")
    assert fsynced == [ino(tmp_path / "f")] and open_fds() == before
    _fs.write_durable(str(tmp_path / "g"), b"data", sync=False)
    assert fsynced == [ino(tmp_path / "f")] and (tmp_path / "g").read_bytes() == b"data"


def test_fsync_tree_dirs_fsyncs_every_directory(tmp_path, fsynced):
    (tmp_path / "t" / "a" / "b").mkdir(parents=True)
    (tmp_path / "t" / "c").mkdir()
    (tmp_path / "t" / "a" / "f").write_text("x")
    _fs.fsync_tree_dirs(str(tmp_path / "t"))
    dirs = [tmp_path / "t", tmp_path / "t" / "a", tmp_path / "t" / "a" / "b", tmp_path / "t" / "c"]
    assert sorted(fsynced) == sorted(ino(d) for d in dirs)


def test_makedirs_durable_fsyncs_the_parent_of_every_directory_it_creates(tmp_path, fsynced):
    (tmp_path / "a").mkdir()
    _fs.makedirs_durable(str(tmp_path / "a" / "b" / "c"))
    assert (tmp_path / "a" / "b" / "c").is_dir()
    assert fsynced == [ino(tmp_path / "a"), ino(tmp_path / "a" / "b")]
    fsynced.clear()
    _fs.makedirs_durable(str(tmp_path / "a" / "b"))
    assert fsynced == []


# --- publish: every fault point of the three ways to publish ----------------------------------


def staged_checkpoint(target: Path, text: str) -> str:
    """A staging entry beside ``target`` that ``recover`` takes for a committed checkpoint holding ``text``."""
    s = Path(fmt.staging_path(str(target)))
    s.mkdir()
    (s / fmt.MANIFEST_NAME).write_text(text)
    return str(s)


def content(path: Path) -> str:
    return (path / fmt.MANIFEST_NAME).read_text()


def side_kinds(target: Path) -> list[tuple[str, str]]:
    """(kind, content) of every leftover beside ``target``."""
    return [(kind, content(Path(p))) for kind, p in fmt.side_entries(str(target))]


def test_publish_onto_an_absent_target_is_durable_at_renamed(tmp_path, fsynced):
    from tddist._faults import inject
    from tddist.errors import InjectedFault
    from tddist.storage.publish import publish

    target = tmp_path / "ckpt"
    with inject("renamed", 0), pytest.raises(InjectedFault, match="'renamed'"):
        publish(staged_checkpoint(target, "one"), str(target))
    assert content(target) == "one" and side_kinds(target) == [] and fsynced == []
    target2 = tmp_path / "ckpt2"
    publish(staged_checkpoint(target2, "one"), str(target2))
    assert content(target2) == "one" and fsynced == [ino(tmp_path)]


def test_publish_by_exchange_struck_at_renamed(tmp_path):
    """The exchange is the commit: struck right after it, the new checkpoint is in place and the old one waits at
    the staging name (never at a backup name), for recover to remove."""
    from tddist._faults import inject
    from tddist.errors import InjectedFault
    from tddist.storage.publish import publish

    target = tmp_path / "ckpt"
    publish(staged_checkpoint(target, "one"), str(target))
    with inject("renamed", 0), pytest.raises(InjectedFault, match="'renamed'"):
        publish(staged_checkpoint(target, "two"), str(target))
    assert content(target) == "two" and side_kinds(target) == [("staging", "one")]
    assert len(tddist.recover(target)) == 1 and side_kinds(target) == [] and content(target) == "two"


@pytest.mark.parametrize("point", ["renamed", "replace"])
def test_publish_through_a_backup_struck_after_the_commit(tmp_path, point):
    """Without RENAME_EXCHANGE, struck after the second rename: the new checkpoint is in place, the old one at the
    backup name; recover removes it (the target is committed), it never restores it."""
    from tddist._faults import inject, without_exchange
    from tddist.errors import InjectedFault
    from tddist.storage.publish import publish

    target = tmp_path / "ckpt"
    publish(staged_checkpoint(target, "one"), str(target))
    with without_exchange(), inject(point, 0), pytest.raises(InjectedFault, match=f"'{point}'"):
        publish(staged_checkpoint(target, "two"), str(target))
    assert content(target) == "two" and side_kinds(target) == [("backup", "one")]
    (done,) = tddist.recover(target)
    assert done.startswith("removed ") and side_kinds(target) == [] and content(target) == "two"


def test_publish_through_a_backup_struck_between_the_renames(tmp_path, fsynced):
    """Struck at ``backup``: the target is absent, the old checkpoint at the backup name (its rename fsynced);
    recover puts it back."""
    from tddist._faults import inject, without_exchange
    from tddist.errors import InjectedFault
    from tddist.storage.publish import publish

    target = tmp_path / "ckpt"
    publish(staged_checkpoint(target, "one"), str(target))
    fsynced.clear()
    with without_exchange(), inject("backup", 0), pytest.raises(InjectedFault, match="'backup'"):
        publish(staged_checkpoint(target, "two"), str(target))
    assert not target.exists() and fsynced == [ino(tmp_path)]
    assert sorted(side_kinds(target)) == [("backup", "one"), ("staging", "two")]
    done = tddist.recover(target)
    assert len(done) == 2 and done[0].startswith("restored "), done
    assert content(target) == "one" and side_kinds(target) == []


# --- recovery -------------------------------------------------------------------------------


def test_recover_removes_a_committed_backup_beside_a_committed_target(tmp_path, fsynced):
    target = tmp_path / "ckpt"
    tddist.save({"x": torch.arange(3)}, target)
    tddist.save({"x": torch.arange(5)}, tmp_path / "old")
    backup = fmt.backup_path(str(target))
    os.rename(tmp_path / "old", backup)
    fsynced.clear()
    assert tddist.recover(target) == [f"removed {backup}"]
    assert not os.path.exists(backup) and torch.equal(tddist.load(target)["x"], torch.arange(3))
    assert fsynced == []


def test_recover_restoring_a_backup_fsyncs_the_parent(tmp_path, fsynced):
    target = tmp_path / "ckpt"
    tddist.save({"x": torch.arange(3)}, tmp_path / "old")
    backup = fmt.backup_path(str(target))
    os.rename(tmp_path / "old", backup)
    fsynced.clear()
    assert tddist.recover(target) == [f"restored {backup} to {target}"]
    assert fsynced == [ino(tmp_path)]


@pytest.mark.parametrize("occupant", ["file", "foreign-dir"])
def test_recover_keeps_the_backup_and_goes_on_with_the_rest(tmp_path, occupant):
    """A committed backup beside a target occupied by a foreign file or directory: kept, and the other leftovers
    after it are still removed."""
    target = tmp_path / "ckpt"
    tddist.save({"x": torch.arange(3)}, tmp_path / "old")
    backup = fmt.backup_path(str(target))
    os.rename(tmp_path / "old", backup)
    if occupant == "file":
        target.write_text("mine")
    else:
        target.mkdir()
        (target / "notes.txt").write_text("mine")
    trash, staging = Path(fmt.trash_path(str(target))), Path(fmt.staging_path(str(target)))
    trash.mkdir()
    staging.mkdir()
    done = tddist.recover(target)
    assert len(done) == 3 and done[0].startswith(f"kept {backup}: it holds the only committed checkpoint"), done
    assert sorted(done[1:]) == sorted([f"removed {trash}", f"removed {staging}"])
    assert not trash.exists() and not staging.exists()
    assert (target.read_text() if occupant == "file" else (target / "notes.txt").read_text()) == "mine"
    assert torch.equal(tddist.load(backup)["x"], torch.arange(3))


# --- commit ---------------------------------------------------------------------------------


def test_a_rank_lost_after_the_commit_is_told_apart_from_one_lost_before(tmp_path):
    """Rank 1 fails once its vote reached rank 0: rank 0 commits, cannot announce, and says it committed. Rank 1
    failing before the first round: rank 0's error says nothing of a commit, and nothing is written."""
    from tddist._faults import inject
    from tddist.errors import CommError, InjectedFault

    target = tmp_path / "ckpt"
    with inject("vote", 1):
        r0, r1 = tddist.run_threads(2, lambda c: tddist.save({"x": torch.ones(3)}, target, comm=c), timeout=1)
    assert isinstance(r0, CommError) and isinstance(r1, InjectedFault), (r0, r1)
    assert f"rank 0 had already committed {str(target)!r}: it holds the new checkpoint" in str(r0), r0
    assert isinstance(r0.__cause__, CommError)
    assert torch.equal(tddist.load(target)["x"], torch.ones(3))
    other = tmp_path / "other"
    with inject("begin", 1):
        r0, r1 = tddist.run_threads(2, lambda c: tddist.save({"x": torch.ones(3)}, other, comm=c), timeout=1)
    assert isinstance(r0, CommError) and isinstance(r1, InjectedFault), (r0, r1)
    assert "already committed" not in str(r0) and not other.exists()


def test_a_save_struck_at_prepare_removes_its_staging_area(tmp_path):
    from tddist._faults import inject
    from tddist.errors import InjectedFault

    target = tmp_path / "ckpt"
    with inject("prepare", 0):
        results = tddist.run_threads(2, lambda c: tddist.save({"x": torch.ones(3)}, target, comm=c), timeout=60)
    assert isinstance(results[0], InjectedFault), results
    assert not target.exists() and fmt.side_entries(str(target)) == []


# --- reading the manifest through the pinned directory ---------------------------


def test_a_manifest_or_index_that_is_not_a_file_is_named(tmp_path):
    target = tmp_path / "ckpt"
    tddist.save({"x": torch.arange(3)}, target)
    os.unlink(target / fmt.INDEX_NAME)
    (target / fmt.INDEX_NAME).mkdir()
    with pytest.raises(ManifestError) as e:
        tddist.read_manifest(target)
    assert str(e.value).startswith(f"index {str(target / fmt.INDEX_NAME)!r} is not a regular file"), e.value
    os.unlink(target / fmt.MANIFEST_NAME)
    (target / fmt.MANIFEST_NAME).mkdir()
    with pytest.raises(ManifestError) as e:
        tddist.read_manifest(target)
    assert str(e.value).startswith(f"manifest {str(target / fmt.MANIFEST_NAME)!r} is not a regular file"), e.value


def replace_dir(target: Path, tmp_path: Path) -> None:
    """Commit another directory at ``target`` (the pinned one moves away, as an overwrite's exchange does)."""
    os.rename(target, tmp_path / "moved")
    target.mkdir()


@pytest.mark.parametrize("name", [fmt.MANIFEST_NAME, fmt.INDEX_NAME])
def test_a_file_gone_from_a_replaced_checkpoint_is_a_change_not_damage(tmp_path, name):
    from tddist.errors import CheckpointChangedError

    target = tmp_path / "ckpt"
    tddist.save({"x": torch.arange(3)}, target)
    what = "the manifest" if name == fmt.MANIFEST_NAME else "the index"
    with PinnedCheckpoint(str(target)) as pin:
        os.unlink(target / name)
        replace_dir(target, tmp_path)
        with pytest.raises(CheckpointChangedError) as e:  # the index: read once the manifest says its size
            pinned._directory_manifest(pin).index.read_index(0)
    assert f"was replaced while it was being read ({what} of the old one is gone)" in str(e.value), e.value


def test_a_pinned_checkpoint_reads_its_own_generation_after_a_replace(tmp_path):
    target = tmp_path / "ckpt"
    tddist.save({"x": torch.arange(3)}, target)
    raw, index = (target / fmt.MANIFEST_NAME).read_bytes(), (target / fmt.INDEX_NAME).read_bytes()
    with PinnedCheckpoint(str(target)) as pin:
        replace_dir(target, tmp_path)
        found = pinned._directory_manifest(pin)
        assert (found.raw, found.index.read_index(len(index)), found.where) == (
            raw,
            index,
            f"manifest {str(target / fmt.MANIFEST_NAME)!r}",
        )


def test_a_missing_index_of_a_checkpoint_in_place_is_left_to_the_parser(tmp_path):
    target = tmp_path / "ckpt"
    tddist.save({"x": torch.arange(3)}, target)
    os.unlink(target / fmt.INDEX_NAME)
    with PinnedCheckpoint(str(target)) as pin:
        found = pinned._directory_manifest(pin)
        assert found.index.read_index(8) is None and found.raw == (target / fmt.MANIFEST_NAME).read_bytes()
    with pytest.raises(ManifestError, match=rf"has no index \({fmt.INDEX_NAME}\)"):
        tddist.read_manifest(target)


def test_generation_is_the_manifest_checksum_or_the_hash_of_an_unsealed_manifest(tmp_path):
    import xxhash

    target = tmp_path / "ckpt"
    tddist.save({"x": torch.arange(3)}, target)
    raw = (target / fmt.MANIFEST_NAME).read_bytes()
    obj = json.loads(raw)
    with open_checkpoint(str(target)) as opened:
        assert opened.generation == obj["manifest_checksum"] and opened.manifest.version == 4
        assert opened.path == str(target)
    del obj["manifest_checksum"]
    unsealed = fmt.dumps(obj)
    (target / fmt.MANIFEST_NAME).write_bytes(unsealed)
    with pytest.raises(ManifestError, match="format version 4.* lacks its manifest_checksum"):
        tddist.read_manifest(target)
    obj["version"] = 2  # without what version 2 lacks: the ranks' largest magnitudes (the index's last 16 bytes)
    del obj["rank_magnitudes"]
    index = (target / fmt.INDEX_NAME).read_bytes()[:-16]
    (target / fmt.INDEX_NAME).write_bytes(index)
    obj["index"] = {"size": len(index), "checksum": xxhash.xxh3_64_hexdigest(index)}
    (target / fmt.MANIFEST_NAME).write_bytes(fmt.dumps(obj))
    with open_checkpoint(str(target)) as opened:
        assert opened.generation == xxhash.xxh3_64_hexdigest(fmt.dumps(obj)) and opened.manifest.version == 2


def test_parse_manifest_names_the_manifest_by_default():
    with pytest.raises(ManifestError) as e:
        parse_manifest({"format": "other"})
    assert str(e.value).startswith("manifest has format 'other', expected "), e.value


# --- manifest: the parts of the validation every version shares ------------------------------

WHERE = "m.json"
DAMAGED = "; the checkpoint is damaged or was tampered with (restore it from a copy)"


def refused_as(why: str):
    """pytest.raises for the ManifestError of ``Parser(WHERE)`` failing with exactly ``why``."""
    import re

    return pytest.raises(ManifestError, match="^" + re.escape(f"{WHERE} {why}{DAMAGED}") + "$")


def header(**changes) -> dict:
    obj = {
        "format": fmt.FORMAT_NAME,
        "version": 3,
        "world_size": 2,
        "layout": "directory",
        "checksum": {"algorithm": fmt.CHECKSUM_ALGORITHM, "block_size": fmt.CHECKSUM_BLOCK},
    }
    obj.update(changes)
    return {k: v for k, v in obj.items() if v is not None}


def test_parse_header_reads_every_member_and_its_defaults():
    from tddist.manifest.model import Parser, parse_header

    m = parse_header(Parser(WHERE), header())
    assert (m.version, m.world_size, m.layout, m.robust_key, m.metadata, m.created, m.tddist_version) == (
        3,
        2,
        "directory",
        True,
        {},
        "",
        "",
    )
    full = header(
        version=1, world_size=1, layout="archive", robust_key=False, metadata={"a": 1}, created="c", tddist_version="v"
    )
    m = parse_header(Parser(WHERE), full)
    assert (m.version, m.world_size, m.layout, m.robust_key, m.metadata, m.created, m.tddist_version) == (
        1,
        1,
        "archive",
        False,
        {"a": 1},
        "c",
        "v",
    )
    assert (m.nodes, m.leaves) == ({}, {})


@pytest.mark.parametrize(
    "changes, why",
    [
        ({"format": "tddist2"}, "has format 'tddist2', expected 'tddist'"),
        ({"version": "3"}, "has no integer 'version'"),
        ({"version": 0}, "has invalid version 0"),
        ({"world_size": 0}, "has invalid world_size 0"),
        ({"world_size": True}, "has invalid world_size True"),
        ({"layout": "tar"}, "has unknown layout 'tar'"),
        ({"robust_key": 1}, "has a non-boolean 'robust_key'"),
        ({"metadata": []}, "has non-object 'metadata'"),
    ],
)
def test_parse_header_refusals(changes, why):
    from tddist.manifest.model import Parser, parse_header

    with refused_as(why):
        parse_header(Parser(WHERE), header(**changes))


@pytest.mark.parametrize("obj", [[1], "tddist", None, 3])
def test_parse_header_refuses_what_is_not_an_object(obj):
    from tddist.manifest.model import Parser, parse_header

    with refused_as("is not a JSON object"):
        parse_header(Parser(WHERE), obj)


def test_parse_header_refuses_a_newer_version_only():
    from tddist.manifest.model import READS_UP_TO, Parser, parse_header

    assert parse_header(Parser(WHERE), header(version=READS_UP_TO)).version == READS_UP_TO
    with pytest.raises(ManifestError) as e:
        parse_header(Parser(WHERE), header(version=READS_UP_TO + 1))
    assert str(e.value) == (
        f"{WHERE} has format version {READS_UP_TO + 1}, newer than this tddist reads ({READS_UP_TO}); "
        f"upgrade tddist to load it"
    )


def test_parser_shape_bounds():
    from tddist.manifest.model import MAX_ELEMENTS, Parser

    p = Parser(WHERE)
    assert p.shape([], "s") == () and p.shape([0, 3], "s") == (0, 3)
    assert p.shape([1] * 64, "s") == (1,) * 64
    assert p.shape([MAX_ELEMENTS - 1], "s") == (MAX_ELEMENTS - 1,)
    assert p.shape([2**28, 2**28 - 1], "s") == (2**28, 2**28 - 1)
    for bad in ([1] * 65, [MAX_ELEMENTS], [-1], [True], [2.0], "ab", None):
        with refused_as(f"has invalid s {bad!r}"):
            p.shape(bad, "s")
    with refused_as(f"has absurd s {[2**28, 2**28]!r}"):
        p.shape([2**28, 2**28], "s")


def test_parser_key_and_list_of():
    from tddist.manifest.model import Parser

    p = Parser(WHERE)
    assert p.key([], allow_empty=True) == () and p.key(["a", "b"], allow_empty=False) == ("a", "b")
    assert p.key(["a"], allow_empty=True) == ("a",)
    for bad, allow in (([], False), (None, True), (["a", 1], True), ("a", False), ([None], True)):
        with refused_as(f"has an invalid key {bad!r}"):
            p.key(bad, allow_empty=allow)
    assert p.list_of({"nodes": [1]}, "nodes") == [1]
    with refused_as("has no list 'nodes'"):
        p.list_of({"nodes": {}}, "nodes")


def empty_manifest(world: int = 2):
    from tddist.manifest.model import Manifest

    return Manifest(world_size=world, nodes={}, leaves={})


def test_parse_nodes_with_version_1_rows():
    from tddist.manifest.model import Parser, parse_nodes

    m = empty_manifest()
    obj = {
        "nodes": [
            {"key": [], "batch_size": [3], "rows": [3, 0]},
            {"key": ["a"], "batch_size": []},
            {"key": ["a", "b"], "batch_size": [2, 5], "rows": [1, 1]},
        ]
    }
    parse_nodes(Parser(WHERE), obj, m)
    assert m.nodes == {(): (3,), ("a",): (), ("a", "b"): (2, 5)}
    assert m.node_rows == {(): [3, 0], ("a", "b"): [1, 1]}


@pytest.mark.parametrize(
    "nodes, why",
    [
        ([1], "has a node that is not an object"),
        ([{"key": [], "batch_size": []}, {"key": [], "batch_size": []}], "lists node () twice"),
        ([{"key": [], "batch_size": []}, {"key": ["a", "b"], "batch_size": []}],
         "has node ('a', 'b') whose parent node is not listed (before it)"),
        ([{"key": [], "batch_size": [3], "rows": [3]}], "has invalid rows [3] for node ()"),
        ([{"key": [], "batch_size": [3], "rows": [4, -1]}], "has invalid rows [4, -1] for node ()"),
        ([{"key": [], "batch_size": [3], "rows": [True, 2]}], "has invalid rows [True, 2] for node ()"),
        ([{"key": [], "batch_size": [3], "rows": [1, 1]}], "has invalid rows [1, 1] for node ()"),
        ([{"key": [], "batch_size": [], "rows": [0, 0]}], "has invalid rows [0, 0] for node ()"),
        ([{"key": [], "batch_size": [3], "rows": "3,0"}], "has invalid rows '3,0' for node ()"),
    ],
)  # fmt: skip
def test_parse_nodes_refusals(nodes, why):
    from tddist.manifest.model import Parser, parse_nodes

    with refused_as(why):
        parse_nodes(Parser(WHERE), {"nodes": nodes}, empty_manifest())


def objects_manifest():
    m = empty_manifest()
    m.nodes = {(): (), ("n",): ()}
    m.leaves = {("t",): None}  # only the key matters to parse_objects
    return m


def test_parse_objects_of_every_placement():
    from tddist.manifest.model import ObjectLeaf, Parser, parse_objects

    m = objects_manifest()
    objs = [
        {"key": ["r"], "placement": "replicate", "values": [5]},
        {"key": ["n", "p"], "placement": "per_rank", "values": [1, 2], "declared": True},
        {"key": ["q"], "placement": "per_rank", "values": [1, 2], "declared": False},
        {"key": ["s"], "placement": "shard", "values": [[1], []]},
    ]
    parse_objects(Parser(WHERE), {"objects": objs}, m)
    assert m.objects == {
        ("r",): ObjectLeaf(("r",), "replicate", [5], False),
        ("n", "p"): ObjectLeaf(("n", "p"), "per_rank", [1, 2], True),
        ("q",): ObjectLeaf(("q",), "per_rank", [1, 2], False),
        ("s",): ObjectLeaf(("s",), "shard", [[1], []], False),
    }
    m = objects_manifest()
    parse_objects(Parser(WHERE), {}, m)  # no member: no objects
    assert m.objects == {}


@pytest.mark.parametrize(
    "objects, why",
    [
        ({}, "has a non-list 'objects'"),
        ([1], "has a non-tensor entry that is not an object"),
        ([{"key": [], "placement": "replicate", "values": [1]}], "has an invalid key []"),
        ([{"key": ["a"], "placement": "replicate", "values": [1]}] * 2, "lists ('a',) twice"),
        ([{"key": ["t"], "placement": "replicate", "values": [1]}], "lists ('t',) twice"),
        ([{"key": ["n"], "placement": "replicate", "values": [1]}], "lists ('n',) twice"),
        ([{"key": ["m", "a"], "placement": "replicate", "values": [1]}],
         "has non-tensor entry ('m', 'a') whose parent node is not listed"),
        ([{"key": ["a"], "placement": "stack", "values": [1, 2]}], "has non-tensor entry ('a',) with unknown placement 'stack'"),
        ([{"key": ["a"], "placement": "replicate", "values": [1, 2]}], "has non-tensor entry ('a',) with the wrong number of values"),
        ([{"key": ["a"], "placement": "per_rank", "values": [1]}], "has non-tensor entry ('a',) with the wrong number of values"),
        ([{"key": ["a"], "placement": "shard", "values": [[1], [2], [3]]}], "has non-tensor entry ('a',) with the wrong number of values"),
        ([{"key": ["a"], "placement": "per_rank", "values": "ab"}], "has non-tensor entry ('a',) with the wrong number of values"),
        ([{"key": ["a"], "placement": "shard", "values": [[1], 2]}], "has non-tensor stack ('a',) with non-list values"),
        ([{"key": ["a"], "placement": "replicate", "values": [1], "declared": True}],
         "has non-tensor entry ('a',) with an invalid 'declared' True (only true on a per_rank entry)"),
        ([{"key": ["a"], "placement": "per_rank", "values": [1, 2], "declared": 1}],
         "has non-tensor entry ('a',) with an invalid 'declared' 1 (only true on a per_rank entry)"),
        ([{"key": ["a"], "placement": "per_rank", "values": [1, 2], "declared": None}],
         "has non-tensor entry ('a',) with an invalid 'declared' None (only true on a per_rank entry)"),
    ],
)  # fmt: skip
def test_parse_objects_refusals(objects, why):
    from tddist.manifest.model import Parser, parse_objects

    with refused_as(why):
        parse_objects(Parser(WHERE), {"objects": objects}, objects_manifest())


def test_verbatim_keys_of_non_tensor_values_must_be_file_names():
    from tddist.manifest.model import Parser, check_keys, parse_objects

    m = objects_manifest()
    parse_objects(Parser(WHERE), {"objects": [{"key": ["n", "a/b"], "placement": "replicate", "values": [1]}]}, m)
    m.leaves = {}
    check_keys(Parser(WHERE), m)  # robust keys: any key
    m.robust_key = False
    with pytest.raises(ManifestError, match=r"has key \['n', 'a/b'\], unusable as a file name with robust_key=false"):
        check_keys(Parser(WHERE), m)
    del m.objects[("n", "a/b")]
    check_keys(Parser(WHERE), m)


def test_rows_of_falls_back_to_a_leaf_sharded_along_dim_0(tmp_path):
    """A node without recorded rows (a version-1 manifest) takes them from a leaf under it sharded along dim 0,
    never from one sharded along another dim."""
    target = tmp_path / "ckpt"

    def save(c):
        state = {"a": torch.zeros(2, 3 - c.rank), "b": torch.zeros(c.rank + 1), "w": torch.ones(2)}
        return tddist.save(state, target, comm=c, placements={"a": tddist.Shard(1), "b": tddist.Shard(0)})

    assert not any(isinstance(r, BaseException) for r in tddist.run_threads(2, save, timeout=60))
    m = tddist.read_manifest(target)
    assert list(m.leaves)[:2] == [("a",), ("b",)] and m.rows_of(()) == [1, 2]
    m.node_rows[()] = [2, 1]
    assert m.rows_of(()) == [2, 1]
    assert m.rows_of(("other",)) is None
    m.leaves.pop(("b",))
    assert m.rows_of(("x",)) is None and m.node_rows.pop(()) and m.rows_of(()) is None


# --- manifest_v2: the version-2 body -----------------------------------------------------------


@pytest.fixture
def v2_files(tmp_path) -> tuple[dict, bytes]:
    """The parsed JSON and the index of a two-rank checkpoint: a batched node (rows 1, 2), a replicated leaf, a
    per-rank leaf."""
    target = tmp_path / "ckpt"

    def save(c):
        from tensordict import TensorDict

        td = TensorDict(
            batch=TensorDict(x=torch.zeros(c.rank + 1, 3), batch_size=[c.rank + 1]),
            w=torch.ones(2),
            g=torch.full((4,), float(c.rank)),
            batch_size=[],
        )
        return tddist.save(td, target, comm=c, placements={"g": tddist.PerRank()})

    assert not any(isinstance(r, BaseException) for r in tddist.run_threads(2, save, timeout=60))
    return json.loads((target / fmt.MANIFEST_NAME).read_bytes()), (target / fmt.INDEX_NAME).read_bytes()


def v2_leaf(obj: dict, *key: str) -> dict:
    return next(e for e in obj["leaves"] if tuple(e["key"]) == key)


def test_v2_body_parses_and_keeps_its_structure_digest(v2_files):
    obj, index = v2_files
    m = parse_manifest(obj, where=WHERE, index=index)
    assert m.structure_digest == obj["structure_digest"] and len(m.structure_digest) <= 64
    assert m.packing == obj["packing"] and m.node_rows == {("batch",): [1, 2]}
    assert isinstance(m.leaves[("g",)].placement, tddist.PerRank) and m.leaves[("g",)].shape == (2, 4)
    obj["structure_digest"] = "f" * 64
    assert parse_manifest(obj, where=WHERE, index=index).structure_digest == "f" * 64


@pytest.mark.parametrize(
    "tamper, why",
    [
        (lambda o: o.update(structure_digest=5), "has an invalid structure_digest"),
        (lambda o: o.update(structure_digest="f" * 65), "has an invalid structure_digest"),
        (lambda o: o.update(nodes=[], leaves=[]), "has no root node (key [])"),
        (lambda o: o.update(leaves=[1]), "has a leaf that is not an object"),
        (lambda o: v2_leaf(o, "w").update(dtype="float128"), "leaf ('w',) has unknown dtype 'float128'"),
        (lambda o: v2_leaf(o, "w").update(placement={"type": "stripe"}),
         "leaf ('w',) has unknown placement {'type': 'stripe'}"),
        (lambda o: v2_leaf(o, "w").update(placement="replicate"), "leaf ('w',) has unknown placement 'replicate'"),
        (lambda o: v2_leaf(o, "batch", "x").update(placement={"type": "shard", "dim": 2}),
         "leaf ('batch', 'x') is sharded on invalid dim 2"),
        (lambda o: v2_leaf(o, "batch", "x").update(placement={"type": "shard", "dim": -1}),
         "leaf ('batch', 'x') is sharded on invalid dim -1"),
        (lambda o: v2_leaf(o, "batch", "x").update(placement={"type": "shard", "dim": True}),
         "leaf ('batch', 'x') is sharded on invalid dim True"),
        (lambda o: v2_leaf(o, "g").update(shape=[3, 4]),
         "per-rank leaf ('g',) has shape [3, 4], which does not start with 2 ranks"),
        (lambda o: v2_leaf(o, "g").update(shape=[]), "per-rank leaf ('g',) has shape [], which does not start with 2 ranks"),
    ],
)  # fmt: skip
def test_v2_body_refusals(v2_files, tamper, why):
    obj, index = v2_files
    tamper(obj)
    with refused_as(why):
        parse_manifest(obj, where=WHERE, index=index)


def test_a_version_1_manifest_without_rows_cannot_be_written_as_version_2():
    from tddist.manifest.v2 import encode

    cs = "0123456789abcdef"
    obj = header(
        version=1,
        nodes=[{"key": [], "batch_size": [4]}],
        leaves=[{"key": ["w"], "dtype": "int64", "shape": [5], "placement": {"type": "replicate"}, "chunks": [[0, 40, cs]]}],
    )  # fmt: skip
    m = parse_manifest(obj, where=WHERE)
    assert m.rows_of(()) is None
    with pytest.raises(ManifestError, match=r"node \[\] has batch dims but the checkpoint does not record its rows"):
        encode(m)


# --- commit: the plans, and the announcement ---------------------------------------------------


@pytest.mark.parametrize(
    "option, value, said",
    [
        ("layout", "memmap", "packing: rank 0 has 'packed', rank 1 has 'memmap'"),
        ("atomic", False, "atomic: rank 0 has True, rank 1 has False"),
        ("archive", True, "layout: rank 0 has 'directory', rank 1 has 'archive'"),
    ],
)
def test_rank_1_disagreeing_is_compared_with_rank_0(tmp_path, option, value, said):
    """The refusal names the option and both ranks' values, rank 0's first."""
    from tddist.errors import InvalidArgumentError

    target = tmp_path / "ckpt"

    def save(c):
        kw = {option: value} if c.rank == 1 else {}
        return tddist.save({"x": torch.ones(2)}, target, comm=c, **kw)

    results = tddist.run_threads(2, save, timeout=60)
    assert all(isinstance(r, InvalidArgumentError) for r in results), results
    assert f"the ranks disagree on the save's {said}; every rank must call save" in str(results[0]), results[0]
    assert not target.exists() and fmt.side_entries(str(target)) == []


@pytest.mark.parametrize("rank", [0, 1])
def test_a_rank_struck_at_announce_fails_after_the_commit(tmp_path, rank):
    """``announce`` strikes once the decision arrived: that rank fails, the other returns, the new checkpoint is
    committed."""
    from tddist._faults import inject
    from tddist.errors import InjectedFault

    target = tmp_path / "ckpt"
    tddist.save({"x": torch.zeros(3)}, target)
    with inject("announce", rank):
        results = tddist.run_threads(2, lambda c: tddist.save({"x": torch.ones(3)}, target, comm=c), timeout=60)
    assert isinstance(results[rank], InjectedFault) and "'announce'" in str(results[rank]), results
    assert not isinstance(results[1 - rank], BaseException), results
    assert torch.equal(tddist.load(target, verify=True)["x"], torch.ones(3)) and fmt.side_entries(str(target)) == []


# --- what publish and recover log: the paths they act on (the wording is not pinned) ------------


def logged(caplog: pytest.LogCaptureFixture, level: int) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno == level]


def test_a_removal_that_fails_is_logged_with_its_path_and_does_not_raise(tmp_path, caplog):
    import logging

    from tddist.storage.publish import discard

    (tmp_path / "file").write_text("x")
    bad = tmp_path / "file" / "old"  # a path under a regular file: unlink fails with ENOTDIR
    with caplog.at_level(logging.INFO, logger="tddist"):
        discard(str(bad))
    (message,) = logged(caplog, logging.WARNING)
    with pytest.raises(NotADirectoryError) as e:
        os.unlink(bad)
    assert str(e.value) in message, message  # the error, and the path besides the error's own text
    assert str(bad) in message.replace(str(e.value), ""), message
    assert (tmp_path / "file").read_text() == "x"


def test_replacing_through_a_backup_is_logged_with_the_target(tmp_path, caplog):
    import logging

    from tddist._faults import without_exchange
    from tddist.storage.publish import publish

    target = tmp_path / "ckpt"
    publish(staged_checkpoint(target, "one"), str(target))
    with caplog.at_level(logging.INFO, logger="tddist"), without_exchange():
        publish(staged_checkpoint(target, "two"), str(target))
    assert any(str(target) in m for m in logged(caplog, logging.INFO)), caplog.records
    assert content(target) == "two" and side_kinds(target) == []


def test_recover_logs_what_it_removes_and_keeps(tmp_path, caplog):
    import logging

    target = tmp_path / "ckpt"
    tddist.save({"x": torch.arange(3)}, tmp_path / "old")
    backup = fmt.backup_path(str(target))
    os.rename(tmp_path / "old", backup)
    target.write_text("mine")
    trash = fmt.trash_path(str(target))
    os.mkdir(trash)
    with caplog.at_level(logging.INFO, logger="tddist"):
        tddist.recover(target)
    (warning,) = logged(caplog, logging.WARNING)
    assert backup in warning and str(target) in warning, warning
    assert any(trash in m for m in logged(caplog, logging.INFO)), caplog.records


# --- manifest_io: every refusal of a read names the manifest ---------------------------------


@pytest.mark.parametrize(
    "damage, why",
    [
        (lambda raw: raw[1:], "is not valid JSON"),
        (lambda raw: b"[" * 100_000 + b"]" * 100_000, "is JSON nested too deeply to be a tddist manifest"),
        (lambda raw: raw.replace(b'"world_size":1', b'"world_size":2'), "fails its own checksum"),
        (lambda raw: raw.replace(b'"format":"tddist"', b'"format":"other"').replace(b"manifest_checksum", b"x"),
         "has format 'other'"),
    ],
)  # fmt: skip
def test_a_refused_manifest_is_named_by_its_path(tmp_path, damage, why):
    target = tmp_path / "ckpt"
    tddist.save({"x": torch.arange(3)}, target)
    path = target / fmt.MANIFEST_NAME
    raw = path.read_bytes()
    assert b'"world_size":1' in raw and b'"format":"tddist"' in raw
    path.write_bytes(damage(raw))
    with pytest.raises(ManifestError) as e:
        tddist.read_manifest(target)
    assert str(e.value).startswith(f"manifest {str(path)!r} {why}"), e.value


def test_an_archive_whose_manifest_declares_a_directory_is_refused(tmp_path):
    """The layout in an archive's manifest must be "archive" (an extracted archive, a directory, may say so)."""
    from tddist.manifest.checksum import seal

    src, path = tmp_path / "a.tdz", tmp_path / "b.tdz"
    tddist.save({"x": torch.arange(3)}, src, archive=True)
    with zipfile.ZipFile(src) as zin, zipfile.ZipFile(path, "w") as zout:
        for zi in zin.infolist():
            data = zin.read(zi)
            if zi.filename == fmt.MANIFEST_NAME:
                obj = json.loads(data)
                assert obj["layout"] == "archive"
                del obj["manifest_checksum"]
                obj["layout"] = "directory"
                data = seal(fmt.dumps(obj))
            zout.writestr(zi.filename, data, compress_type=zipfile.ZIP_STORED)
    with pytest.raises(ManifestError) as e:
        tddist.read_manifest(path)
    assert str(e.value).startswith(f"manifest of archive {str(path)!r} declares layout 'directory', but the checkpoint")
    with zipfile.ZipFile(src) as zf:  # extracted: a directory holding the archive's tree, which says "archive"
        zf.extractall(tmp_path / "d")
    assert tddist.read_manifest(tmp_path / "d").layout == "archive"


def test_a_file_that_is_no_tddist_archive_is_named(tmp_path):
    junk, other = tmp_path / "junk.tdz", tmp_path / "other.zip"
    junk.write_bytes(b"not a zip at all")
    with pytest.raises(CheckpointNotFoundError) as e:
        tddist.read_manifest(junk)
    assert str(e.value) == (
        f"{str(junk)!r} is a file but not a tddist archive; pass a checkpoint directory or a .tdz archive"
    )
    with zipfile.ZipFile(other, "w") as zf:
        zf.writestr("readme.txt", "hello")
    with pytest.raises(CheckpointNotFoundError) as e:
        tddist.read_manifest(other)
    assert str(e.value) == f"archive {str(other)!r} has no {fmt.MANIFEST_NAME} entry; it is not a tddist checkpoint"


@pytest.mark.parametrize("name", [fmt.MANIFEST_NAME, fmt.INDEX_NAME])
def test_a_compressed_manifest_or_index_entry_names_the_archive(tmp_path, name):
    src, path = tmp_path / "a.tdz", tmp_path / "b.tdz"
    tddist.save({"x": torch.arange(3)}, src, archive=True)
    with zipfile.ZipFile(src) as zin, zipfile.ZipFile(path, "w") as zout:
        for zi in zin.infolist():
            method = zipfile.ZIP_DEFLATED if zi.filename == name else zipfile.ZIP_STORED
            zout.writestr(zi.filename, zin.read(zi), compress_type=method)
    with pytest.raises(ManifestError) as e:
        tddist.read_manifest(path)
    assert str(e.value).startswith(f"archive {str(path)!r}: entry {name!r} is compressed (method 8)"), e.value
