"""Hostile files where a manifest or an archive entry should be: refused with a tddist error, quickly.

A FIFO never blocks a reader, a device never feeds one forever, a directory is not a manifest, JSON
nested too deep is not a crash, a compressed manifest entry is not inflated, and a damaged compressed
leaf is a CorruptCheckpointError whatever the codec.

Sizes and counts a manifest declares are checked before anything is read or allocated: a (sparse) index of
2 GiB, a manifest of 900 MiB, world sizes of 2^20, 2^40 and 2^62 ranks, an index that matches a world of
2^24 ranks, rows whose int64 sum wraps, leaves whose sizes add up past int64. Each is read by every reader
(``read_manifest``, ``load``, ``verify``, ``tddist verify`` and ``tddist info``) in a forked child under an
address-space limit and an alarm, which reports the error it ended in and the memory it added at its peak.
"""

from __future__ import annotations

import io
import json
import os
import re
import resource
import signal
import struct
import traceback
import zipfile
from collections.abc import Callable
from contextlib import redirect_stderr, redirect_stdout
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
import torch
import xxhash
from tensordict import TensorDict

import tddist
from tddist import CorruptCheckpointError, ManifestError
from tddist import format as fmt
from tddist.manifest.checksum import seal


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


# --- declared sizes and counts: every reader, in a child under a memory limit -------------------------------------

#: What one reader may add to its process at its peak, and how long it may take before the alarm kills it (a
#: generous guard against a hang on a loaded machine; the refusals below take milliseconds).
PEAK_BYTES = 256 << 20
DEADLINE_S = 20
#: The address-space limit above what the child maps when it starts: a reader that allocates past it fails.
ADDRESS_SPACE = 1 << 30


@dataclass(frozen=True)
class Ending:
    """How one reader ended in the child: ``kind`` "tddist" (a TddistError), "ok", "other" (any other
    exception), "killed" (the alarm, or a signal); ``detail`` the error's class and message (or traceback);
    ``peak`` the bytes of memory it added at its peak."""

    kind: str
    detail: str
    peak: int


def _status(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise AssertionError(f"no {field} in /proc/self/status")


def _run_child(fn: Callable[[], str], w: int) -> None:
    """The child's side of ``bounded``: limits, the peak reset, ``fn``, the report on ``w``."""
    torch.set_num_threads(1)
    resource.setrlimit(resource.RLIMIT_AS, (_status("VmSize") + ADDRESS_SPACE, resource.RLIM_INFINITY))
    with open("/proc/self/clear_refs", "w") as f:  # VmHWM := VmRSS (Linux >= 4.0)
        f.write("5")
    before = _status("VmRSS")
    signal.signal(signal.SIGALRM, signal.SIG_DFL)
    signal.alarm(DEADLINE_S)
    try:
        with redirect_stdout(io.StringIO()), redirect_stderr(io.StringIO()):
            kind, detail = "ok", fn()
    except tddist.TddistError as e:
        kind, detail = "tddist", f"{type(e).__name__}: {e}"
    except BaseException:
        kind, detail = "other", traceback.format_exc()[-3000:]
    signal.alarm(0)
    report = json.dumps({"kind": kind, "detail": detail, "peak": _status("VmHWM") - before}).encode()
    while report:
        report = report[os.write(w, report) :]


def bounded(fn: Callable[[], str]) -> Ending:
    """Run ``fn`` in a forked child under ``ADDRESS_SPACE`` and ``DEADLINE_S``; how it ended and its peak."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child never returns into pytest
        code = 0
        try:
            os.close(r)
            _run_child(fn, w)
        except BaseException:
            code = 3
        finally:
            os._exit(code)
    os.close(w)
    with os.fdopen(r, "rb") as f:
        raw = f.read()
    _, status = os.waitpid(pid, 0)
    if os.WIFSIGNALED(status):
        return Ending("killed", f"signal {os.WTERMSIG(status)} (SIGALRM: the deadline passed)", -1)
    if not raw:
        return Ending("other", f"the child exited with status {status} without a report", -1)
    return Ending(**json.loads(raw))


def _cli(command: str) -> Callable[[str], str]:
    def run(path: str) -> str:
        from tddist.cli import main

        out = io.StringIO()
        with redirect_stdout(out):
            code = main([command, "--json", path])
        doc = json.loads(out.getvalue() or "{}")
        if doc.get("schema") == "tddist.error/1":  # the command caught a TddistError: raise it again, by name
            raise getattr(tddist, doc["error"], tddist.TddistError)(doc["message"])
        return f"exit {code}: {out.getvalue()[:200]}"

    return run


def _verify(path: str) -> str:
    from tddist.tools.verify import verify

    return f"{len(verify(path).problems)} problems"


#: The readers that check every rank's files.
VERIFIERS = ("verify", "tddist verify")
READERS: dict[str, Callable[[str], str]] = {
    "read_manifest": lambda path: f"{len(tddist.read_manifest(path).leaves)} leaves",
    "load": lambda path: f"{len(tddist.load(path, shard=None, verify=True).keys())} keys",
    "verify": _verify,
    "tddist verify": _cli("verify"),
    "tddist info": _cli("info"),
}


def assert_refused(path: Path, match: str, readers: tuple[str, ...] = tuple(READERS)) -> None:
    """``readers`` end in a ManifestError matching ``match``, the others in success; each adds less than
    ``PEAK_BYTES`` at its peak."""
    for name, read in READERS.items():
        ending = bounded(lambda: read(str(path)))
        if name in readers:
            assert ending.kind == "tddist" and ending.detail.startswith("ManifestError"), (name, ending)
            assert re.search(match, ending.detail), (name, ending.detail)
        else:
            assert ending.kind == "ok", (name, ending)
        assert ending.peak < PEAK_BYTES, f"{name} added {ending.peak >> 20} MiB at its peak"


def _manifest_object(path: Path) -> dict:
    obj = json.loads((path / fmt.MANIFEST_NAME).read_bytes())
    del obj["manifest_checksum"]
    return obj


def _write_manifest(path: Path, obj: dict, index: bytes | None = None) -> None:
    """``obj`` sealed as tddist.json; with ``index``, written as tddist.idx and declared (size, checksum)."""
    if index is not None:
        (path / fmt.INDEX_NAME).write_bytes(index)
        obj["index"] = {"size": len(index), "checksum": xxhash.xxh3_64_hexdigest(index)}
    (path / fmt.MANIFEST_NAME).write_bytes(seal(fmt.dumps(obj)))


def _sparse_archive(src: Path, dst: Path, name: str, hole: int) -> None:
    """``src`` rewritten with entry ``name`` last and ``hole`` more bytes (a sparse hole, zeros) after its data:
    its local and central sizes grow by ``hole``, as if it really held them."""
    with zipfile.ZipFile(src) as zin:
        infos = sorted(zin.infolist(), key=lambda zi: zi.filename == name)
        buf = io.BytesIO()
        with zipfile.ZipFile(buf, "w") as zout:
            for zi in infos:
                zout.writestr(zi.filename, zin.read(zi))
    raw = bytearray(buf.getvalue())
    end = len(raw) - 22  # the end record (no comment)
    cd_size, cd_offset = struct.unpack_from("<2L", raw, end + 12)
    with zipfile.ZipFile(io.BytesIO(bytes(raw))) as zf:
        local = zf.getinfo(name).header_offset
    struct.pack_into("<2L", raw, local + 18, *(v + hole for v in struct.unpack_from("<2L", raw, local + 18)))
    central = cd_offset
    while raw[central + 46 : central + 46 + len(name)] != name.encode():
        name_len, extra_len, comment_len = struct.unpack_from("<3H", raw, central + 28)
        central += 46 + name_len + extra_len + comment_len
    struct.pack_into("<2L", raw, central + 20, *(v + hole for v in struct.unpack_from("<2L", raw, central + 20)))
    struct.pack_into("<L", raw, end + 16, cd_offset + hole)
    with open(dst, "wb") as f:
        f.write(raw[:cd_offset])
        f.seek(hole, os.SEEK_CUR)
        f.write(raw[cd_offset:])


def test_sparse_index_of_2_gib_is_refused_before_it_is_read(tmp_path):
    """The manifest says how large the index is: a larger file is refused on its size, not read."""
    target = _saved(tmp_path / "ckpt")
    os.truncate(target / fmt.INDEX_NAME, 2 << 30)
    assert_refused(target, r"tddist.idx' has 2147483648 bytes, its manifest implies 32")


def test_index_entry_declaring_2_gib_is_refused_before_it_is_read(tmp_path):
    """In an archive, the entry's declared size is compared first (the archive really is 2 GiB, sparse)."""
    _saved(tmp_path / "a.tdz")
    _sparse_archive(tmp_path / "a.tdz", tmp_path / "b.tdz", fmt.INDEX_NAME, 2 << 30)
    assert os.path.getsize(tmp_path / "b.tdz") > 2 << 30
    assert_refused(tmp_path / "b.tdz", r"entry 'tddist.idx' declares 2147483680 bytes .*implies 32")


def test_manifest_of_900_mib_is_refused_before_it_is_read(tmp_path):
    target = _saved(tmp_path / "ckpt")
    os.truncate(target / fmt.MANIFEST_NAME, 900 << 20)
    assert_refused(target, r"has 943718400 bytes, more than the 268435456 bytes \(256 MiB\) tddist reads")


def test_manifest_entry_of_900_mib_is_refused_before_it_is_read(tmp_path):
    _saved(tmp_path / "a.tdz")
    _sparse_archive(tmp_path / "a.tdz", tmp_path / "b.tdz", fmt.MANIFEST_NAME, 900 << 20)
    assert_refused(tmp_path / "b.tdz", r"entry 'tddist.json' has 9\d+ bytes, more than the 268435456 bytes")


@pytest.mark.parametrize("world", [1 << 20, 1 << 40, 1 << 62], ids=["2^20", "2^40", "2^62"])
def test_world_size_beyond_what_the_checkpoint_holds_is_refused(tmp_path, world):
    """A sealed manifest of one replicated leaf (its index does not grow with the world) naming a huge world.
    Above 2^24 ranks every reader refuses the number itself. Below, a load reads rank 0's file alone and
    allocates nothing per rank (it returns the data), while verify, which checks every rank's data file, refuses
    a world larger than the directory's three entries instead of going through a million ranks (it looped over
    every rank, or allocated one number per rank, before)."""
    target = tmp_path / "ckpt"
    tddist.save({"w": torch.arange(4.0)}, target)
    obj = _manifest_object(target)
    obj["world_size"] = world
    # without the ranks' largest magnitudes (optional; one per rank), the index does not grow with the world
    assert obj.pop("rank_magnitudes") is True
    _write_manifest(target, obj, (target / fmt.INDEX_NAME).read_bytes()[:-16])
    if world <= 1 << 24:
        assert_refused(target, "declares 1048576 ranks, but the directory holds only 3 entries", VERIFIERS)
    else:
        assert_refused(target, f"has world_size {world}, more than the 16777216 ranks tddist reads")


def test_index_that_matches_a_world_beyond_the_limit_is_not_read(tmp_path):
    """JSON and index that agree (2^24 + 1 ranks, one batched node of no rows, one leaf: a 256 MiB index,
    sparse, its checksum right): the world size is refused before the index is read."""
    target = _saved(tmp_path / "ckpt")
    world = (1 << 24) + 1
    obj = _manifest_object(target)
    obj["world_size"], obj["nodes"][0]["batch_size"], obj["leaves"][0]["shape"] = world, [0], [0, 4]
    size = 8 * 2 * world
    h, zeros = xxhash.xxh3_64(), memoryview(bytes(1 << 24))
    for start in range(0, size, len(zeros)):
        h.update(zeros[: min(len(zeros), size - start)])
    obj["index"] = {"size": size, "checksum": h.hexdigest()}
    _write_manifest(target, obj)
    os.truncate(target / fmt.INDEX_NAME, size)
    assert_refused(target, "has world_size 16777217, more than the 16777216 ranks tddist reads")


def test_rows_whose_sum_wraps_int64_are_refused(tmp_path):
    """Four ranks' rows of a node summing to 2^64 + 4, which int64 wraps to the node's 4 rows."""
    target = tmp_path / "ckpt"
    tddist.run_threads(4, lambda comm: tddist.save(TensorDict(x=torch.ones(1, 2), batch_size=[1]), target, comm=comm))
    obj = _manifest_object(target)
    obj["nodes"][0]["batch_size"], obj["leaves"][0]["shape"] = [4], [4, 2]
    index = np.frombuffer((target / fmt.INDEX_NAME).read_bytes(), "<i8").copy()
    index[:4] = [1 << 62, 1 << 62, 1 << 62, (1 << 62) + 4]
    assert int(index[:4].sum()) == 4  # what numpy's int64 sum makes of them
    _write_manifest(target, obj, index.tobytes())
    assert_refused(target, r"has invalid rows for node \(\) that are negative or do not sum to 4")


def test_leaves_whose_sizes_add_up_past_int64_are_refused(tmp_path):
    """64 replicated leaves of 2^58 bytes each: offsets in rank 0's data file would wrap (its size to 0)."""
    target = tmp_path / "ckpt"
    tddist.save({f"w{i}": torch.ones(1, dtype=torch.float64) for i in range(64)}, target)
    obj = _manifest_object(target)
    for leaf in obj["leaves"]:
        leaf["shape"] = [1 << 55]
    _write_manifest(target, obj)
    assert_refused(target, r"declares 18446744073709551616 bytes of tensor data, more than the 4611686018427387904")


# --- the same on object storage ------------------------------------------------------------------------------


def _got_bytes(client) -> tuple[list[int], Callable[[], None]]:
    """The ``ContentLength`` of every GetObject answer from now on, and how to stop counting."""
    got: list[int] = []

    def count(parsed, **_kw):
        got.append(int(parsed.get("ContentLength", 0)))

    client.meta.events.register("after-call.s3.GetObject", count)
    return got, lambda: client.meta.events.unregister("after-call.s3.GetObject", count)


def test_s3_index_of_another_size_is_refused_with_one_ranged_get(s3):
    """An index object of 8 MiB where the manifest implies 32 bytes: one ranged GET of 32 bytes finds it out."""
    client, where = s3
    bucket, prefix = where.split("/")
    target = f"s3://{where}/ckpt"
    tddist.save(TensorDict(x=torch.arange(8.0).reshape(4, 2), batch_size=[4]), target)
    index_key = next(
        o["Key"] for o in client.list_objects_v2(Bucket=bucket, Prefix=prefix)["Contents"] if o["Key"].endswith("idx")
    )
    client.put_object(Bucket=bucket, Key=index_key, Body=bytes(8 << 20))
    got, stop = _got_bytes(client)
    try:
        with pytest.raises(ManifestError, match=r"tddist.idx has 8388608 bytes, its manifest implies 32"):
            tddist.read_manifest(target)
    finally:
        stop()
    assert max(got) < 1 << 20, got  # the manifest and 32 bytes of the index: never the 8 MiB


def test_s3_index_entry_of_another_size_is_refused_before_it_is_read(s3, tmp_path):
    """An archive object whose index entry declares 8 MiB more than the manifest implies: refused from the
    central directory, before its data is fetched."""
    client, where = s3
    bucket, prefix = where.split("/")
    _saved(tmp_path / "a.tdz")
    _sparse_archive(tmp_path / "a.tdz", tmp_path / "b.tdz", fmt.INDEX_NAME, 8 << 20)
    client.put_object(
        Bucket=bucket,
        Key=f"{prefix}/b.tdz",
        Body=(tmp_path / "b.tdz").read_bytes(),
        Metadata={"tddist-layout": "archive"},
    )
    got, stop = _got_bytes(client)
    try:
        with pytest.raises(ManifestError, match=r"entry 'tddist.idx' declares 8388640 bytes .*implies 32"):
            tddist.read_manifest(f"s3://{where}/b.tdz")
    finally:
        stop()
    assert sum(got) < 1 << 20, got


# --- an archive's entries, validated all at once --------------------------------------------------------------


def _central_record(raw: bytes, name: str) -> int:
    """Where the central-directory record of entry ``name`` starts in the archive ``raw``."""
    pos = raw.index(b"PK\x01\x02")
    while raw[pos + 46 : pos + 46 + len(name)] != name.encode():
        name_len, extra_len, comment_len = struct.unpack_from("<3H", raw, pos + 28)
        pos += 46 + name_len + extra_len + comment_len
    return pos


def _with_junk(src: Path, dst: Path, names: list[str]) -> None:
    """``src`` with one more small stored entry per name, before its own entries."""
    with zipfile.ZipFile(src) as zin, zipfile.ZipFile(dst, "w") as zout:
        for name in names:
            zout.writestr(name, b"junk")
        for zi in zin.infolist():
            zout.writestr(zi.filename, zin.read(zi))


@pytest.mark.parametrize("name", ["a//b", "./x", "x/.", "x/..", "a\\b", "/abs", "x/"])
def test_archive_entry_names_leaving_the_root_are_refused(tmp_path, name):
    _saved(tmp_path / "a.tdz")
    _with_junk(tmp_path / "a.tdz", tmp_path / "b.tdz", [name])
    with pytest.raises(CorruptCheckpointError, match="escapes its root"):
        tddist.load(tmp_path / "b.tdz", shard=None)


@pytest.mark.parametrize(
    "damage",
    ["header-past-the-end", "data-past-the-end", "overlap", "not-a-header"],
)
def test_archive_entries_out_of_place_are_refused(tmp_path, damage):
    """A junk entry's central record edited: its local header past the end of the file or not where it says, its
    data past the end, or its span overlapping another entry's."""
    _saved(tmp_path / "a.tdz")
    _with_junk(tmp_path / "a.tdz", tmp_path / "b.tdz", ["junk/a", "junk/b"])
    raw = bytearray((tmp_path / "b.tdz").read_bytes())
    pos = _central_record(raw, "junk/b")
    if damage == "header-past-the-end":
        struct.pack_into("<L", raw, pos + 42, len(raw) - 10)
    elif damage == "data-past-the-end":
        struct.pack_into("<2L", raw, pos + 20, len(raw), len(raw))  # stored: compressed and uncompressed sizes
    elif damage == "overlap":
        struct.pack_into("<L", raw, pos + 42, 0)  # junk/a's local header: the same span
    else:
        struct.pack_into("<L", raw, pos + 42, 1)
    (tmp_path / "b.tdz").write_bytes(bytes(raw))
    match = {
        "header-past-the-end": "entry 'junk/b' has a header past the end of the file",
        "data-past-the-end": "entry 'junk/b' extends past the end of the file",
        "overlap": "entries 'junk/a' and 'junk/b' overlap",
        "not-a-header": "entry 'junk/b' has a bad local header offset",
    }[damage]
    with pytest.raises(CorruptCheckpointError, match=match):
        tddist.load(tmp_path / "b.tdz", shard=None)


def test_archive_with_many_foreign_entries_loads(tmp_path):
    """Entries the manifest does not name are validated (names, places) and otherwise ignored."""
    _saved(tmp_path / "a.tdz")
    _with_junk(tmp_path / "a.tdz", tmp_path / "b.tdz", [f"junk/{i}" for i in range(2000)])
    loaded = tddist.load(tmp_path / "b.tdz", shard=None, verify=True)
    assert torch.equal(loaded["x"], torch.arange(4096.0).reshape(1024, 4))
