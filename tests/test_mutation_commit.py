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
from tddist import _fs, manifest_io
from tddist import format as fmt
from tddist.errors import CheckpointNotFoundError, ManifestError, TddistError
from tddist.pinned import PinnedCheckpoint

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


# --- manifest_io ----------------------------------------------------------------------------


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
        manifest_io._archive_manifest(pin)
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
    with pytest.raises(TddistError) as e:
        tddist.read_manifest(path)
    assert repr(str(path)) in str(e.value), e.value


def test_a_manifest_entry_of_exactly_the_limit_is_read(tmp_path):
    """_read_entry's bound is inclusive: an entry of ``limit`` bytes is read, one of ``limit + 1`` refused."""
    z = tmp_path / "a.zip"
    with zipfile.ZipFile(z, "w") as zf:
        zf.writestr(fmt.MANIFEST_NAME, b"0123456789")
    with zipfile.ZipFile(z) as zf:
        zi = zf.getinfo(fmt.MANIFEST_NAME)
        assert manifest_io._read_entry(zf, zi, 10, str(z)) == b"0123456789"
        with pytest.raises(ManifestError, match="declares 10 bytes; refusing it"):
            manifest_io._read_entry(zf, zi, 9, str(z))


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
