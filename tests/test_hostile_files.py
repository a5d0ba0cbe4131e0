"""Hostile files where a manifest or an archive entry should be: refused with a tddist error, quickly.

A FIFO never blocks a reader, a device never feeds one forever, a directory is not a manifest, JSON
nested too deep is not a crash, a compressed manifest entry is not inflated, and a damaged compressed
leaf is a CorruptCheckpointError whatever the codec.
"""

from __future__ import annotations

import os
import zipfile

import pytest
import torch
from tensordict import TensorDict

import tddist
from tddist import CorruptCheckpointError, ManifestError


def _saved(path, **kw):
    tddist.save(TensorDict(x=torch.arange(4096.0).reshape(1024, 4), batch_size=[1024]), path, **kw)
    return path


@pytest.mark.parametrize("kind", ["fifo", "dev-zero", "directory", "symlink"])
@pytest.mark.parametrize("name", ["tddist.json", "tddist.idx"])
def test_manifest_and_index_must_be_regular_files(tmp_path, kind, name):
    """Each is refused before it is read: no hang on a FIFO, no endless read of /dev/zero."""
    target = _saved(tmp_path / "ckpt")
    path = target / name
    content = path.read_bytes()
    path.unlink()
    if kind == "fifo":
        os.mkfifo(path)
    elif kind == "dev-zero":
        os.symlink("/dev/zero", path)
    elif kind == "directory":
        path.mkdir()
    else:
        (tmp_path / "elsewhere").write_bytes(content)
        os.symlink(tmp_path / "elsewhere", path)
    with pytest.raises(ManifestError, match="symbolic link|not a regular file"):
        tddist.read_manifest(target)
    with pytest.raises(ManifestError):
        tddist.load(target, shard=None)


def test_deeply_nested_json_is_a_manifest_error(tmp_path):
    target = _saved(tmp_path / "ckpt")
    (target / "tddist.json").write_text("[" * 100000 + "]" * 100000)
    with pytest.raises(ManifestError, match="nested too deeply|not valid JSON"):
        tddist.read_manifest(target)


def test_compressed_manifest_entry_is_refused_without_inflating(tmp_path):
    """The format stores the manifest uncompressed: a deflated one (possibly a bomb) is never inflated."""
    src = _saved(tmp_path / "a.tdz")
    bad = tmp_path / "b.tdz"
    with zipfile.ZipFile(src) as zin, zipfile.ZipFile(bad, "w") as zout:
        for zi in zin.infolist():
            method = zipfile.ZIP_DEFLATED if zi.filename == "tddist.json" else zipfile.ZIP_STORED
            zout.writestr(zi.filename, zin.read(zi), compress_type=method)
    with pytest.raises(ManifestError, match="compressed"):
        tddist.read_manifest(bad)


@pytest.mark.parametrize("codec", ["deflate", "bzip2", "lzma", "zstd"])
def test_damaged_compressed_leaf_is_a_corrupt_checkpoint(tmp_path, codec):
    """Garbage in the middle of a compressed entry is a CorruptCheckpointError on load, never a codec's own error."""
    path = _saved(tmp_path / "c.tdz", compression=codec)
    with zipfile.ZipFile(path) as zf:
        zi = zf.getinfo("rank-00000/x.memmap")
        header_end = zi.header_offset + 30 + len(zi.filename) + len(zi.extra)
    raw = bytearray(path.read_bytes())
    mid = header_end + zi.compress_size // 2
    raw[mid : mid + 16] = b"\xa5" * 16
    path.write_bytes(bytes(raw))
    with pytest.raises(CorruptCheckpointError):
        tddist.load(path, shard=None)


def test_unpack_writes_only_the_entries_of_the_checkpoint(tmp_path):
    """Foreign entries of an archive (a stray meta.json, one inside a leaf's path) are never written."""
    src = _saved(tmp_path / "a.tdz", layout=None)
    bad = tmp_path / "b.tdz"
    with zipfile.ZipFile(src) as zin, zipfile.ZipFile(bad, "w") as zout:
        extra = {"junk/meta.json": b"{}", "rank-00000/x.memmap/meta.json": b"{}"}
        for name, data in extra.items():
            zout.writestr(name, data)
        for zi in zin.infolist():  # tddist.idx and tddist.json stay last, as the format has them
            zout.writestr(zi, zin.read(zi))
    tddist.unpack(bad, tmp_path / "out")
    written = sorted(
        os.path.relpath(os.path.join(d, f), tmp_path / "out") for d, _s, fs in os.walk(tmp_path / "out") for f in fs
    )
    assert written == ["rank-00000/meta.json", "rank-00000/x.memmap", "tddist.idx", "tddist.json"], written
    assert torch.equal(
        tddist.load(tmp_path / "out", shard=None, verify=True)["x"], torch.arange(4096.0).reshape(1024, 4)
    )


def test_archive_needing_an_unknown_zip_version_is_a_corrupt_checkpoint(tmp_path):
    """A central directory asking for a zip version Python's zipfile does not implement (6.4) is refused as a
    damaged archive, not a raw NotImplementedError, by load, read_manifest and verify."""
    target = tmp_path / "a.tdz"
    tddist.save({"w": torch.arange(10.0)}, str(target))
    raw = bytearray(target.read_bytes())
    at = raw.index(b"PK\x01\x02")  # the first central directory header
    raw[at + 6 : at + 8] = (64).to_bytes(2, "little")  # "version needed to extract": 6.4
    target.write_bytes(bytes(raw))
    for read in (tddist.load, tddist.read_manifest):
        with pytest.raises(tddist.TddistError, match="not a readable zip archive|damaged"):
            read(str(target))
