"""Archive mode (one .tdz zip for the whole checkpoint) in one process and on thread ranks:
round trips, compression, interoperability with zip tools and tensordict, zip64, and
hostile archives."""

from __future__ import annotations

import os
import stat
import struct
import subprocess
import zipfile
from pathlib import Path

import pytest
import torch
from tensordict import TensorDict

import tddist
from tddist import format as fmt
from tddist.saving.memmaps import mapped_file
from tddist.storage.archive import ArchiveWriter
from tests.helpers import assert_td_equal, leftovers, require


def shard(rank: int) -> TensorDict:
    n = [3, 0, 5][rank % 3]
    start = [0, 3, 3][rank % 3]
    idx = torch.arange(start, start + n)
    return TensorDict(
        x=(idx[:, None] * 7 + torch.arange(5)).float(),
        nested=TensorDict(b=(idx % 2 == 1), h=idx.to(torch.bfloat16), batch_size=[n]),
        batch_size=[n],
    )


def save_on_threads(path: Path, size: int = 3, **kwargs) -> None:
    results = tddist.run_threads(size, lambda c: tddist.save(shard(c.rank), path, comm=c, **kwargs), timeout=60)
    errors = [r for r in results if isinstance(r, BaseException)]
    if errors:
        raise errors[0]


@pytest.fixture()
def pair(tmp_path):
    """The same three-rank data saved as a directory and as an archive."""
    save_on_threads(tmp_path / "dir")
    save_on_threads(tmp_path / "one.tdz", num_threads=2)
    return tmp_path / "dir", tmp_path / "one.tdz"


def test_archive_equals_directory_bit_for_bit(pair):
    """Same leaves, same checksums, same values; every world size loads the same rows."""
    d, a = pair
    md, ma = tddist.read_manifest(d), tddist.read_manifest(a)
    assert ma.layout == "archive" and md.layout == "directory"
    assert {k: [c.checksum for c in v.chunks] for k, v in md.leaves.items()} == {
        k: [c.checksum for c in v.chunks] for k, v in ma.leaves.items()
    }
    full_d = tddist.load(d, shard=None, verify=True)
    full_a = tddist.load(a, shard=None, verify=True)
    assert_td_equal(full_a, full_d, "archive vs directory")
    for size in (1, 2, 4):
        got = tddist.run_threads(size, lambda c: tddist.load(a, comm=c), timeout=60)
        assert_td_equal(torch.cat(got), full_d, f"the even shares of {size} ranks")


def test_zip_tools_and_tensordict_accept_it(pair, tmp_path):
    """unzip -t and zipfile.testzip pass; each extracted rank subtree opens with TensorDict.load_memmap."""
    _, a = pair
    assert zipfile.ZipFile(a).testzip() is None
    require("unzip", "Info-ZIP's unzip -t must accept the archive")
    subprocess.run(["unzip", "-tq", str(a)], check=True, capture_output=True)
    with zipfile.ZipFile(a) as zf:
        zf.extractall(tmp_path / "x")
        names = zf.namelist()
    assert fmt.MANIFEST_NAME in names
    for rank in range(3):
        td = TensorDict.load_memmap(tmp_path / "x" / fmt.rank_dir(rank))
        assert_td_equal(td, shard(rank), f"extracted {fmt.rank_dir(rank)}")


def test_stored_payloads_are_aligned_and_loaded_without_copy(pair):
    _, a = pair
    with zipfile.ZipFile(a) as zf, open(a, "rb") as f:
        for zi in zf.infolist():
            f.seek(zi.header_offset)
            name_len, extra_len = struct.unpack("<2H", f.read(30)[26:30])
            if zi.filename.endswith(fmt.LEAF_SUFFIX):
                assert (zi.header_offset + 30 + name_len + extra_len) % 64 == 0, zi.filename
    part = tddist.load(a, shard=(0, 3))  # rows inside rank 0's chunk
    assert mapped_file(part["x"]) == str(a), "a stored leaf should be a view of the mapped archive"


@pytest.mark.parametrize(
    "compression", ["deflate", "bzip2", "lzma", "zstd", ("deflate", 1), zipfile.ZIP_DEFLATED, "zstd:7"]
)
def test_each_compression_round_trips(tmp_path, compression):
    path = tmp_path / "c.tdz"
    save_on_threads(path, compression=compression, num_threads=2)
    full = tddist.load(path, shard=None, verify=True)
    assert_td_equal(full, torch.cat([shard(r) for r in range(3)]))
    if compression in ("deflate", "bzip2", "lzma", zipfile.ZIP_DEFLATED):
        assert zipfile.ZipFile(path).testzip() is None


def test_large_deflate_entry_is_compressed_in_parallel_blocks(tmp_path):
    """An entry larger than one 32 MiB block: separately deflated blocks still form one valid stream."""
    x = (torch.arange(10 * 2**20) % 1000).to(torch.int32)  # 40 MiB, two blocks
    tddist.save(TensorDict(x=x, batch_size=[x.shape[0]]), tmp_path / "big.tdz", compression="deflate", num_threads=2)
    assert zipfile.ZipFile(tmp_path / "big.tdz").testzip() is None
    assert torch.equal(tddist.load(tmp_path / "big.tdz", shard=None, verify=True)["x"], x)


def test_zip64_offsets_beyond_4gib(tmp_path, monkeypatch):
    """Regions placed past 4 GiB (a sparse hole, through the test hook) need zip64 offsets."""
    monkeypatch.setattr(ArchiveWriter, "first_region_offset", 5 * 2**30)
    path = tmp_path / "z64.tdz"
    save_on_threads(path, size=2)
    assert os.path.getsize(path) > 5 * 2**30 and os.stat(path).st_blocks * 512 < 2**20  # sparse
    with zipfile.ZipFile(path) as zf:
        assert min(zi.header_offset for zi in zf.infolist()) >= 5 * 2**30
        assert zf.testzip() is None
    assert_td_equal(tddist.load(path, shard=None, verify=True), torch.cat([shard(0), shard(1)]))


def test_more_than_65535_entries(tmp_path):
    """The central directory needs a zip64 end record past 65535 entries (one meta.json per empty node)."""
    data = {f"n{i}": {} for i in range(65600)}
    data["x"] = torch.arange(3)
    tddist.save(data, tmp_path / "many.tdz")
    with zipfile.ZipFile(tmp_path / "many.tdz") as zf:
        assert len(zf.infolist()) > 65535
        assert zf.testzip() is None
    back = tddist.load(tmp_path / "many.tdz", shard=None, keys=["x"])
    assert torch.equal(back["x"], torch.arange(3))


def test_archive_replaces_archive_and_refuses_foreign_files(tmp_path):
    path = tmp_path / "r.tdz"
    tddist.save({"a": torch.ones(2)}, path)
    tddist.save({"b": torch.zeros(3)}, path)
    assert set(tddist.load(path, shard=None).keys()) == {"b"}
    assert leftovers(path, strict=True) == []
    foreign = tmp_path / "foreign.tdz"
    foreign.write_bytes(b"not mine")
    with pytest.raises(tddist.TargetError, match="not a tddist archive"):
        tddist.save({"a": torch.ones(2)}, foreign)
    assert foreign.read_bytes() == b"not mine"
    (tmp_path / "d.tdz").mkdir()
    with pytest.raises(tddist.TargetError, match="is a directory"):
        tddist.save({"a": torch.ones(2)}, tmp_path / "d.tdz")
    with pytest.raises(tddist.InvalidArgumentError, match="atomic=False"):
        tddist.save({"a": torch.ones(2)}, tmp_path / "n.tdz", atomic=False)
    with pytest.raises(tddist.InvalidArgumentError, match="needs an archive"):
        tddist.save({"a": torch.ones(2)}, tmp_path / "plain", compression="deflate")
    with pytest.raises(tddist.InvalidArgumentError, match="not supported"):
        tddist.save({"a": torch.ones(2)}, tmp_path / "x.tdz", compression="rar")


# --- hostile archives ------------------------------------------------------------------


def _rewrite(src: Path, dst: Path, rename=None, extra=None, mutate=None) -> None:
    """Copy an archive entry by entry with zipfile, optionally renaming, adding or changing entries."""
    with zipfile.ZipFile(src) as zin, zipfile.ZipFile(dst, "w") as zout:
        for zi in zin.infolist():
            data = zin.read(zi.filename)
            name = (rename or {}).get(zi.filename, zi.filename)
            info = zipfile.ZipInfo(name, date_time=zi.date_time)
            info.external_attr = zi.external_attr
            if mutate:
                info, data = mutate(info, data)
            zout.writestr(info, data)
        for info, data in extra or []:
            zout.writestr(info, data)


def test_truncated_archive_is_refused(pair, tmp_path):
    _, a = pair
    bad = tmp_path / "trunc.tdz"
    bad.write_bytes(a.read_bytes()[: os.path.getsize(a) // 2])
    with pytest.raises(tddist.TddistError):
        tddist.load(bad, shard=None)


def test_bad_offsets_are_refused(pair, tmp_path):
    """A central directory whose local-header offset points elsewhere is refused."""
    _, a = pair
    raw = bytearray(a.read_bytes())
    with zipfile.ZipFile(a) as zf:
        cd = zf.start_dir
    pos = raw.index(b"PK\x01\x02", cd)
    struct.pack_into("<I", raw, pos + 42, 7)  # header offset of the first entry
    bad = tmp_path / "off.tdz"
    bad.write_bytes(bytes(raw))
    with pytest.raises(tddist.CorruptCheckpointError, match="local header"):
        tddist.load(bad, shard=None)


def test_zip_bomb_is_refused(tmp_path):
    """An entry that inflates past its declared size is an error, not a memory blow-up."""
    path = tmp_path / "ok.tdz"
    tddist.save(TensorDict(x=torch.zeros(1000), batch_size=[1000]), path, compression="deflate")
    name = "rank-00000/x.memmap"
    raw = bytearray(path.read_bytes())
    with zipfile.ZipFile(path) as zf:
        zi = zf.getinfo(name)
        cd = zf.start_dir
    pos = raw.index(b"PK\x01\x02" + raw[cd + 4 : cd + 4], cd)
    # find the central record of that entry and shrink its declared size
    while raw[pos + 46 : pos + 46 + len(name)] != name.encode():
        pos = raw.index(b"PK\x01\x02", pos + 4)
    struct.pack_into("<I", raw, pos + 24, 100)
    bomb = tmp_path / "bomb.tdz"
    bomb.write_bytes(bytes(raw))
    with pytest.raises(tddist.CorruptCheckpointError):
        tddist.load(bomb, shard=None)
    assert zi.file_size == 4000


@pytest.mark.parametrize("evil", ["../escape.memmap", "/abs.memmap", "rank-00000/../../x"])
def test_entry_names_escaping_the_root_are_refused(pair, tmp_path, evil):
    _, a = pair
    bad = tmp_path / "evil.tdz"
    _rewrite(a, bad, extra=[(zipfile.ZipInfo(evil), b"x")])
    with pytest.raises(tddist.CorruptCheckpointError, match="escapes"):
        tddist.load(bad, shard=None)


def test_symlink_and_duplicate_entries_are_refused(pair, tmp_path):
    _, a = pair
    link = zipfile.ZipInfo("rank-00000/link")
    link.external_attr = (stat.S_IFLNK | 0o777) << 16
    bad = tmp_path / "link.tdz"
    _rewrite(a, bad, extra=[(link, b"/etc/passwd")])
    with pytest.raises(tddist.CorruptCheckpointError, match="symbolic-link"):
        tddist.load(bad, shard=None)
    dup = tmp_path / "dup.tdz"
    with pytest.warns(UserWarning):
        _rewrite(a, dup, extra=[(zipfile.ZipInfo("rank-00000/meta.json"), b"{}")])
    with pytest.raises(tddist.CorruptCheckpointError, match="twice"):
        tddist.load(dup, shard=None)


def test_sizes_disagreeing_with_the_manifest_are_refused(pair, tmp_path):
    _, a = pair

    def shrink(info, data):
        return (info, data[:-4]) if info.filename == "rank-00002/x.memmap" else (info, data)

    bad = tmp_path / "size.tdz"
    _rewrite(a, bad, mutate=shrink)
    with pytest.raises(tddist.CorruptCheckpointError, match="manifest says"):
        tddist.load(bad, shard=None)
