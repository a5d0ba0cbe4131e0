"""Fuzzing the readers: every hostile checkpoint ends in success or a TddistError, within a time and memory bound.

Seeds are real checkpoints: the golden ones of every format version (directories, packed and memmap, DTensor
boxes, archives) and small archives compressed with each codec. Hypothesis mutates them: byte flips, truncation
and appended bytes in the manifest, the index and the data; JSON values replaced (shapes, dtypes, counts,
ranks, checksums, placements, nesting), with the index's size and checksum (and the manifest's own checksum)
recomputed when the mutation should reach deeper checks; index slots replaced; archive structure edited (the
central directory, local headers and end record: methods, sizes, offsets, names). Manifests are also generated
from scratch. Each example runs ``read_manifest``, ``tddist.tools.verify``, ``tddist.load(..., verify=True)`` and
the ``tddist verify`` / ``tddist info`` commands in a forked child under an address-space limit and an alarm:
success (then every loaded leaf has its manifest shape and dtype, its checksums verified by the load) or a
TddistError is fine; any other exception, a crash, a hang or a memory blow-up fails the example.

In CI each test runs a fixed, derandomized set of examples (about a minute in all on 2 cores);
``TDDIST_FUZZ_EXAMPLES=N`` runs N random examples per test, ``scripts/fuzz.py`` a longer campaign. Regression
tests for the bugs fuzzing found, and the memory bound of decompression, follow the fuzz tests.
"""

from __future__ import annotations

import io
import json
import os
import resource
import shutil
import signal
import struct
import sys
import traceback
import zipfile
from collections.abc import Callable
from contextlib import redirect_stderr, redirect_stdout
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import xxhash
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tensordict import TensorDict

import tddist
from tddist import CorruptCheckpointError, TddistError
from tddist import format as fmt

GOLDEN = Path(__file__).resolve().parent / "golden"
EXAMPLES = int(os.environ.get("TDDIST_FUZZ_EXAMPLES", "0"))
#: Seconds and bytes (beyond what the child already maps) one example may take.
DEADLINE_S = int(os.environ.get("TDDIST_FUZZ_DEADLINE", "30"))
MEMORY = 1 << 30
STATS = os.environ.get("TDDIST_FUZZ_STATS")


def fuzz_settings(ci_examples: int) -> Callable[[Any], Any]:
    """CI: ``ci_examples`` derandomized examples; ``TDDIST_FUZZ_EXAMPLES=N``: N random ones."""
    return settings(
        max_examples=EXAMPLES or ci_examples,
        derandomize=not EXAMPLES,
        deadline=None,
        database=None,
        suppress_health_check=list(HealthCheck),
    )


# --- the guard: one example in a forked child ---------------------------------------------------------------


def _vm_size() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmSize:"):
                return int(line.split()[1]) * 1024
    return 0


def guarded(fn: Callable[[], str]) -> tuple[str, str]:
    """Run ``fn`` in a forked child with an address-space limit and an alarm.

    Returns (outcome, detail): "ok" (fn's detail), "tddist" (a TddistError: class and message), "other" (any
    other exception: its traceback), "killed" (a signal: SIGALRM is the deadline), or "exit" (anything else).
    """
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: never returns into pytest
        code = 0
        try:
            os.close(r)
            torch.set_num_threads(1)
            limit = _vm_size() + MEMORY
            resource.setrlimit(resource.RLIMIT_AS, (limit, resource.getrlimit(resource.RLIMIT_AS)[1]))
            signal.signal(signal.SIGALRM, signal.SIG_DFL)
            signal.alarm(DEADLINE_S)
            sink = io.StringIO()
            try:
                with redirect_stdout(sink), redirect_stderr(sink):
                    text = "ok\0" + fn()
            except TddistError as e:
                text = f"tddist\0{type(e).__name__}: {e}"
            except BaseException:
                text = "other\0" + traceback.format_exc()
            signal.alarm(0)
            data = text.encode("utf-8", "replace")
            while data:
                data = data[os.write(w, data[: 1 << 16]) :]
        except BaseException:
            code = 3
        finally:
            os._exit(code)
    os.close(w)
    chunks = []
    with os.fdopen(r, "rb") as f:
        while True:
            b = f.read(1 << 16)
            if not b:
                break
            chunks.append(b)
    _, status = os.waitpid(pid, 0)
    if os.WIFSIGNALED(status):
        sig = os.WTERMSIG(status)
        return "killed", "deadline passed (hang?)" if sig == signal.SIGALRM else f"signal {sig}"
    text = b"".join(chunks).decode("utf-8", "replace")
    if "\0" not in text:
        return "exit", f"status {status}: {text[-2000:]}"
    outcome, detail = text.split("\0", 1)
    return outcome, detail


def _record(test: str, outcome: str, detail: str) -> None:
    if STATS:
        with open(STATS, "a") as f:
            short = detail[:300] if outcome == "ok" else detail[-300:]  # a traceback's end names the exception
            f.write(json.dumps({"test": test, "outcome": outcome, "detail": short}) + "\n")


def check_target(path: Path, test: str) -> None:
    """Every reader on ``path`` ends in success or a TddistError (all in one guarded child)."""

    def run_all() -> str:
        ends = []
        for name, fn in READERS.items():
            try:
                ends.append(f"{name}: {fn(str(path))}")
            except TddistError as e:
                ends.append(f"{name}: {type(e).__name__}")
        return "; ".join(ends)

    outcome, detail = guarded(run_all)
    _record(test, outcome, detail)
    assert outcome == "ok", f"on {path}: {outcome}\n{detail}"


def _read_manifest(path: str) -> str:
    m = tddist.read_manifest(path)
    return f"{len(m.leaves)} leaves"


def _verify(path: str) -> str:
    from tddist.tools.verify import verify

    report = verify(path, num_threads=2)
    return f"{len(report.problems)} problems"


def _load(path: str) -> str:
    m = tddist.read_manifest(path)
    td = tddist.load(path, shard=None, verify=True, num_threads=2, allow_pickle=True)  # seeds hold no code
    for key, leaf in m.leaves.items():  # what loaded is what the manifest describes (checksums: verify=True)
        t = td.get(key)
        assert tuple(t.shape) == leaf.shape and t.dtype == leaf.dtype, (key, t.shape, leaf.shape, t.dtype)
    return f"{len(m.leaves)} leaves loaded"


def _cli(path: str) -> str:
    from tddist.cli import main

    codes = [main(["verify", "--json", path]), main(["info", path])]
    assert all(type(c) is int for c in codes), codes
    return f"exit {codes}"


READERS: dict[str, Callable[[str], str]] = {"read_manifest": _read_manifest, "verify": _verify, "load": _load}


# --- seeds --------------------------------------------------------------------------------------------------

CODECS = ["deflate", "bzip2", "lzma", "zstd"]


@pytest.fixture(scope="module")
def seeds(tmp_path_factory) -> dict[str, Path]:
    """Real checkpoints: every golden one, and a small archive per codec."""
    root = tmp_path_factory.mktemp("seeds")
    out: dict[str, Path] = {}
    for version in sorted(p.name for p in GOLDEN.iterdir() if p.is_dir()):
        for entry in sorted((GOLDEN / version).iterdir()):
            if entry.is_file() or (entry / fmt.MANIFEST_NAME).exists():  # not the objects of s3_incremental
                out[f"{version}/{entry.name}"] = entry
    data = TensorDict(
        x=torch.arange(600.0).reshape(150, 4),
        y=TensorDict(z=torch.arange(150, dtype=torch.int64) % 7, batch_size=[150]),
        batch_size=[150],
    )
    td = TensorDict(data=data, w=torch.ones(33, dtype=torch.bfloat16), batch_size=[])
    for codec in CODECS:
        path = root / f"{codec}.tdz"
        tddist.save(td, path, compression=codec)
        out[f"codec/{codec}.tdz"] = path
    return out


def _copy(src: Path, dst: Path) -> Path:
    if src.is_dir():
        shutil.copytree(src, dst)
    else:
        shutil.copyfile(src, dst)
    return dst


# --- mutations ----------------------------------------------------------------------------------------------

INTS = [-(2**63), -(2**31), -1, 0, 1, 2, 3, 4, 7, 8, 63, 64, 255, 4096, 2**31, 2**32, 2**53 + 1, 2**56, 2**63 - 1]
JSON_VALUES = [
    *INTS,
    2**64,
    10**30,
    -0.5,
    1.5,
    1e308,
    "",
    "x",
    "float32",
    "int64",
    "bool",
    "complex64",
    "shard",
    "boxes",
    "replicate",
    "per_rank",
    "own",
    "node",
    "packed",
    "memmap",
    "archive",
    "directory",
    "..",
    "a/b",
    "0" * 16,
    "f" * 16,
    None,
    True,
    False,
    [],
    {},
    [0],
    [-1],
    [2**40, 2**40],
    {"type": "shard", "dim": 0},
    {"type": "boxes"},
    {"json": [1, 2]},
    {"json": None},
    {"pickle": "AAAA"},
    {"pickle": "gARLAS4="},
    [{"json": 1}],
    [[{"json": 1}], [{"json": [1, 2]}]],
]


def _json_paths(obj: Any, prefix: tuple = ()) -> list[tuple]:
    """Every location in ``obj`` (dict keys and list indices), containers included, down to depth 64."""
    out = [prefix]
    if len(prefix) >= 64:
        return out
    if isinstance(obj, dict):
        for k, v in obj.items():
            out += _json_paths(v, (*prefix, k))
    elif isinstance(obj, list):
        for i, v in enumerate(obj):
            out += _json_paths(v, (*prefix, i))
    return out


def _nested(depth: int) -> Any:
    v: Any = 0
    for _ in range(depth):
        v = [v]
    return v


def mutate_json(obj: dict, data: st.DataObject) -> None:
    """Replace, delete, duplicate or nest one value of the manifest."""
    paths = [p for p in _json_paths(obj) if p]
    path = data.draw(st.sampled_from(paths), label="json path")
    parent = obj
    for k in path[:-1]:
        parent = parent[k]
    key = path[-1]
    op = data.draw(st.sampled_from(["replace", "replace", "replace", "delete", "dup", "nest", "bump"]), label="op")
    if op == "replace":
        parent[key] = data.draw(st.sampled_from(JSON_VALUES), label="value")
    elif op == "delete":
        del parent[key]
    elif op == "dup" and isinstance(parent, list):
        parent.insert(key, parent[key])
    elif op == "nest":
        parent[key] = _nested(data.draw(st.integers(1, 400), label="depth"))
    elif op == "bump" and type(parent[key]) is int:
        parent[key] += data.draw(st.sampled_from([-2, -1, 1, 2, 64]), label="delta")
    else:
        parent[key] = data.draw(st.sampled_from(JSON_VALUES), label="value")


def mutate_index(index: bytes, data: st.DataObject) -> bytes:
    """Replace an 8-byte slot, or cut or extend the index."""
    op = data.draw(st.sampled_from(["slot", "slot", "slot", "cut", "extend"]), label="index op")
    if op == "slot" and len(index) >= 8:
        i = data.draw(st.integers(0, len(index) // 8 - 1), label="slot")
        old = struct.unpack_from("<q", index, 8 * i)[0]
        new = data.draw(st.sampled_from([*INTS, old - 1, old + 1, -old]), label="slot value")
        new = max(-(2**63), min(2**63 - 1, new))
        return index[: 8 * i] + struct.pack("<q", new) + index[8 * i + 8 :]
    if op == "cut" and index:
        return index[: data.draw(st.integers(0, len(index) - 1), label="cut")]
    return index + struct.pack("<q", data.draw(st.sampled_from(INTS), label="extra"))


def mutate_bytes(raw: bytes, data: st.DataObject) -> bytes:
    """Flip bytes, truncate or append."""
    op = data.draw(st.sampled_from(["flip", "flip", "truncate", "append", "splice"]), label="bytes op")
    if not raw or op == "append":
        return raw + data.draw(st.binary(min_size=1, max_size=64), label="appended")
    if op == "truncate":
        return raw[: data.draw(st.integers(0, len(raw) - 1), label="truncate at")]
    buf = bytearray(raw)
    if op == "splice":
        i = data.draw(st.integers(0, len(raw) - 1), label="splice at")
        piece = data.draw(st.binary(min_size=1, max_size=16), label="splice")
        buf[i : i + len(piece)] = piece
        return bytes(buf)
    for _ in range(data.draw(st.integers(1, 4), label="flips")):
        i = data.draw(st.integers(0, len(raw) - 1), label="flip at")
        buf[i] ^= 1 << data.draw(st.integers(0, 7), label="bit")
    return bytes(buf)


def seal_like(original: bytes, body: bytes) -> bytes:
    """``body`` with the manifest's own checksum (docs/format.md, version 3) if ``original`` carried one."""
    prefix = b'{"manifest_checksum":"'
    if not original.startswith(prefix) or not body.startswith(b"{") or body.startswith(b"{}"):
        return body
    return prefix + xxhash.xxh3_64_hexdigest(body).encode() + b'",' + body[1:]


def rewrite_manifest(raw: bytes, index: bytes | None, data: st.DataObject) -> tuple[bytes, bytes | None]:
    """A JSON-level and/or index-level mutation of a manifest; the index's size and checksum and the manifest's
    own checksum are recomputed unless the draw says not to (then those checks are what is exercised)."""
    obj = json.loads(raw)
    obj.pop("manifest_checksum", None)
    what = data.draw(st.sampled_from(["json", "index", "both"] if index is not None else ["json"]), label="what")
    if what in ("json", "both"):
        for _ in range(data.draw(st.integers(1, 3), label="json mutations")):
            mutate_json(obj, data)
    if index is not None and what in ("index", "both"):
        index = mutate_index(index, data)
    if index is not None and isinstance(obj.get("index"), dict) and data.draw(st.booleans(), label="fix index"):
        obj["index"] = {"size": len(index), "checksum": xxhash.xxh3_64_hexdigest(index)}
    limit = sys.getrecursionlimit()
    sys.setrecursionlimit(max(limit, 20000))  # two nestings of 400 stay encodable
    try:
        body = json.dumps(obj, separators=(",", ":")).encode()
    finally:
        sys.setrecursionlimit(limit)
    return (seal_like(raw, body) if data.draw(st.booleans(), label="reseal") else body), index


# --- (a) manifests and indexes ------------------------------------------------------------------------------


def _dir_seeds(seeds: dict[str, Path]) -> list[str]:
    return sorted(k for k, p in seeds.items() if p.is_dir())


@fuzz_settings(80)
@given(data=st.data())
def test_fuzz_directory_manifests(seeds, tmp_path_factory, data):
    """Mutated tddist.json / tddist.idx / data files of real directory checkpoints."""
    name = data.draw(st.sampled_from(_dir_seeds(seeds)), label="seed")
    path = _copy(seeds[name], tmp_path_factory.mktemp("fuzz") / "ckpt")
    manifest, index_path = path / fmt.MANIFEST_NAME, path / fmt.INDEX_NAME
    raw = manifest.read_bytes()
    index = index_path.read_bytes() if index_path.exists() else None
    target = data.draw(st.sampled_from(["rewrite", "rewrite", "manifest bytes", "index bytes", "data"]), label="on")
    if target == "rewrite":
        raw, index = rewrite_manifest(raw, index, data)
        manifest.write_bytes(raw)
        if index is not None:
            index_path.write_bytes(index)
    elif target == "manifest bytes" or (target == "index bytes" and index is None):
        manifest.write_bytes(mutate_bytes(raw, data))
    elif target == "index bytes":
        assert index is not None
        index_path.write_bytes(mutate_bytes(index, data))
    else:
        files = sorted(p for p in path.rglob("*") if p.is_file() and p.name not in (fmt.MANIFEST_NAME, fmt.INDEX_NAME))
        victim = data.draw(st.sampled_from(files), label="data file")
        victim.write_bytes(mutate_bytes(victim.read_bytes(), data))
    check_target(path, "directory")


# --- (b) archives ---------------------------------------------------------------------------------------------

#: (offset in the record, struct format) of the fields worth breaking.
CD_FIELDS = {
    "method": (10, "<H"),
    "crc": (16, "<I"),
    "csize": (20, "<I"),
    "size": (24, "<I"),
    "name_len": (28, "<H"),
    "extra_len": (30, "<H"),
    "comment_len": (32, "<H"),
    "attr": (38, "<I"),
    "offset": (42, "<I"),
}
LOCAL_FIELDS = {
    "flags": (6, "<H"),
    "method": (8, "<H"),
    "crc": (14, "<I"),
    "csize": (18, "<I"),
    "size": (22, "<I"),
    "name_len": (26, "<H"),
    "extra_len": (28, "<H"),
}
EOCD_FIELDS = {
    "disk_entries": (8, "<H"),
    "entries": (10, "<H"),
    "cd_size": (12, "<I"),
    "cd_offset": (16, "<I"),
    "comment_len": (20, "<H"),
}
METHODS = [0, 1, 8, 9, 12, 14, 93, 95, 98, 99, 0xFFFF]


def _field_values(fmt_: str, old: int) -> st.SearchStrategy[int]:
    top = 2 ** (8 * struct.calcsize(fmt_)) - 1
    near = [max(0, min(top, old + d)) for d in (-64, -1, 1, 64)]
    return st.sampled_from([0, 1, top, top - 1, old * 2 % (top + 1), *near]) | st.integers(0, top)


def mutate_archive(raw: bytes, data: st.DataObject) -> bytes:
    """Edit the central directory, a local header, the end record or an entry name, or flip payload bytes."""
    buf = bytearray(raw)
    cds = [i for i in range(len(raw) - 46) if raw[i : i + 4] == b"PK\x01\x02"]
    locals_ = [i for i in range(len(raw) - 30) if raw[i : i + 4] == b"PK\x03\x04"]
    eocd = raw.rfind(b"PK\x05\x06")
    kinds = ["bytes"] + ["cd"] * 3 * bool(cds) + ["local"] * 2 * bool(locals_) + ["eocd"] * (eocd >= 0)
    kinds += ["name"] * bool(cds)
    kind = data.draw(st.sampled_from(kinds), label="archive part")
    if kind == "bytes":
        return mutate_bytes(raw, data)
    if kind == "name":
        at = data.draw(st.sampled_from(cds), label="record")
        n = struct.unpack_from("<H", raw, at + 28)[0]
        if n:
            i = data.draw(st.integers(0, n - 1), label="name byte")
            buf[at + 46 + i] = data.draw(st.sampled_from(list(b"/.\\\0\xffa-")), label="char")
        if data.draw(st.booleans(), label="method too"):
            struct.pack_into("<H", buf, at + 10, data.draw(st.sampled_from(METHODS), label="method"))
        return bytes(buf)
    at, fields = {
        "cd": (lambda: (data.draw(st.sampled_from(cds), label="record"), CD_FIELDS)),
        "local": (lambda: (data.draw(st.sampled_from(locals_), label="header"), LOCAL_FIELDS)),
        "eocd": (lambda: (eocd, EOCD_FIELDS)),
    }[kind]()
    field = data.draw(st.sampled_from(sorted(fields)), label="field")
    off, f = fields[field]
    if at + off + struct.calcsize(f) > len(buf):
        return bytes(buf)
    old = struct.unpack_from(f, buf, at + off)[0]
    value = data.draw(st.sampled_from(METHODS) if field == "method" else _field_values(f, old), label="value")
    struct.pack_into(f, buf, at + off, value)
    return bytes(buf)


def replace_entries(path: Path, files: dict[str, bytes]) -> None:
    """Replace archive entries (stored) in place: the old bytes stay, unlisted; new ones go before a new
    central directory. Lets a mutated manifest or index reach the archive reader."""
    with zipfile.ZipFile(path, "a") as zf:
        for name, content in files.items():
            old = zf.getinfo(name)
            zf.filelist.remove(old)
            del zf.NameToInfo[name]
            zf.writestr(zipfile.ZipInfo(name, date_time=(1980, 1, 1, 0, 0, 0)), content)


def _archive_seeds(seeds: dict[str, Path]) -> list[str]:
    return sorted(k for k, p in seeds.items() if p.is_file())


@fuzz_settings(80)
@given(data=st.data())
def test_fuzz_archives(seeds, tmp_path_factory, data):
    """Mutated .tdz files: structure, names, methods, sizes, payloads, and their manifests and indexes."""
    name = data.draw(st.sampled_from(_archive_seeds(seeds)), label="seed")
    path = _copy(seeds[name], tmp_path_factory.mktemp("fuzz") / "ckpt.tdz")
    if data.draw(st.integers(0, 3), label="manifest?") == 0:
        with zipfile.ZipFile(path) as zf:
            raw = zf.read(fmt.MANIFEST_NAME)
            index = zf.read(fmt.INDEX_NAME) if fmt.INDEX_NAME in zf.namelist() else None
        raw, index = rewrite_manifest(raw, index, data)
        replace_entries(path, {fmt.MANIFEST_NAME: raw, **({fmt.INDEX_NAME: index} if index is not None else {})})
    else:
        for _ in range(data.draw(st.integers(1, 2), label="archive mutations")):
            path.write_bytes(mutate_archive(path.read_bytes(), data))
    check_target(path, "archive")


# --- (c) the command line on mutated checkpoints ---------------------------------------------------------------


@fuzz_settings(30)
@given(data=st.data())
def test_fuzz_command_line(seeds, tmp_path_factory, data):
    """``tddist verify --json`` and ``tddist info`` on mutated checkpoints return an exit status."""
    name = data.draw(st.sampled_from(sorted(seeds)), label="seed")
    path = _copy(seeds[name], tmp_path_factory.mktemp("fuzz") / Path(name).name)
    if path.is_file():
        path.write_bytes(mutate_archive(path.read_bytes(), data))
    else:
        manifest = path / fmt.MANIFEST_NAME
        index_path = path / fmt.INDEX_NAME
        index = index_path.read_bytes() if index_path.exists() else None
        raw, index = rewrite_manifest(manifest.read_bytes(), index, data)
        manifest.write_bytes(raw)
        if index is not None:
            index_path.write_bytes(index)
    outcome, detail = guarded(lambda: _cli(str(path)))
    _record("cli", outcome, detail)
    assert outcome == "ok", f"tddist command on {path}: {outcome}\n{detail}"


# --- generated manifests --------------------------------------------------------------------------------------

DTYPES = ["float32", "float64", "int64", "uint8", "bool", "bfloat16", "float16", "int8", "complex64"]


@st.composite
def generated_checkpoints(draw) -> tuple[dict, bytes, dict[str, int]]:
    """A version-2 manifest built from scratch: nodes, leaves of every placement, an index of plausible or
    arbitrary values (its size and checksum right or wrong), and data files of derived or arbitrary sizes."""
    world = draw(st.integers(1, 4))
    batch = draw(st.sampled_from([[], [draw(st.integers(0, 9))]]))
    nodes = [{"key": [], "batch_size": batch}]
    leaves, sections = [], []
    rows = None
    if batch:
        cuts = sorted(draw(st.lists(st.integers(0, batch[0]), min_size=world - 1, max_size=world - 1)))
        rows = [b - a for a, b in zip([0, *cuts], [*cuts, batch[0]])]
        sections.append(np.asarray(rows, dtype="<i8"))
    sums, boxes = [], []
    for i in range(draw(st.integers(0, 4))):
        dtype = draw(st.sampled_from(DTYPES))
        ndim = draw(st.integers(0, 3))
        shape = [draw(st.integers(0, 6)) for _ in range(ndim)]
        kind = draw(st.sampled_from(["shard", "replicate", "boxes"]))
        entry: dict[str, Any] = {"key": [f"l{i}"], "dtype": dtype, "shape": shape}
        if kind == "shard" and ndim:
            own = not (batch and shape[0] == batch[0] and draw(st.booleans()))
            entry.update(placement={"type": "shard", "dim": 0}, rows="own" if own else "node")
            if own:
                cuts = sorted(draw(st.lists(st.integers(0, shape[0]), min_size=world - 1, max_size=world - 1)))
                sections.append(np.asarray([b - a for a, b in zip([0, *cuts], [*cuts, shape[0]])], dtype="<i8"))
            sums.append(np.asarray(draw(st.lists(st.integers(0, 2**64 - 1), min_size=world, max_size=world)), "<u8"))
        elif kind == "boxes":
            n = draw(st.integers(0, world))
            entry.update(placement={"type": "boxes"}, chunks=n)
            sums.append(np.asarray(draw(st.lists(st.integers(0, 2**64 - 1), min_size=n, max_size=n)), "<u8"))
            small = st.integers(-1, 7)
            boxes += [
                np.asarray(draw(st.permutations(range(world)))[:n], "<i8"),
                np.asarray(draw(st.lists(small, min_size=n * ndim, max_size=n * ndim)), "<i8"),
                np.asarray(draw(st.lists(small, min_size=n * ndim, max_size=n * ndim)), "<i8"),
            ]
        else:
            entry.update(placement={"type": "replicate"}, writer=draw(st.integers(0, world - 1)))
            sums.append(np.asarray([draw(st.integers(0, 2**64 - 1))], "<u8"))
        leaves.append(entry)
    index = b"".join(a.tobytes() for a in [*sections, *sums, *boxes])
    if draw(st.booleans()):
        index = draw(st.binary(max_size=64)) if draw(st.booleans()) else index[: draw(st.integers(0, len(index)))]
    obj = {
        "format": "tddist",
        "version": 2,
        "tddist_version": "0.1.0",
        "created": "2026-01-01T00:00:00+00:00",
        "world_size": world,
        "layout": "directory",
        "packing": draw(st.sampled_from(["packed", "memmap"])),
        "robust_key": True,
        "checksum": {"algorithm": fmt.CHECKSUM_ALGORITHM, "block_size": fmt.CHECKSUM_BLOCK},
        "index": {"size": len(index), "checksum": xxhash.xxh3_64_hexdigest(index)},
        "metadata": {},
        "nodes": nodes,
        "leaves": leaves,
        "objects": [],
    }
    files = {f"rank-{r:05d}.data": draw(st.integers(0, 512)) for r in range(world) if draw(st.booleans())}
    return obj, index, files


@fuzz_settings(60)
@given(case=generated_checkpoints())
def test_fuzz_generated_manifests(tmp_path_factory, case):
    """Manifests made from scratch, valid or not, with data files of arbitrary sizes."""
    obj, index, files = case
    path = tmp_path_factory.mktemp("gen") / "ckpt"
    path.mkdir()
    (path / fmt.MANIFEST_NAME).write_text(json.dumps(obj))
    (path / fmt.INDEX_NAME).write_bytes(index)
    for name, size in files.items():
        (path / name).write_bytes(bytes(range(256)) * (size // 256) + bytes(size % 256))
    check_target(path, "generated")


# --- the guard itself -----------------------------------------------------------------------------------------


def _raise_value_error() -> str:
    raise ValueError("not a tddist error")


def _allocate() -> str:
    return str(len(bytearray(2 * MEMORY)))


def _hang() -> str:
    signal.pause()
    return ""


@pytest.mark.parametrize(
    "fn, outcome",
    [
        (lambda: "fine", "ok"),
        (lambda: (_ for _ in ()).throw(CorruptCheckpointError("bad")), "tddist"),
        (_raise_value_error, "other"),
        (_allocate, "other"),  # MemoryError under the address-space limit
    ],
)
def test_guard_tells_outcomes_apart(fn, outcome):
    assert guarded(fn)[0] == outcome


def test_guard_stops_a_hang(monkeypatch):
    monkeypatch.setattr(sys.modules[__name__], "DEADLINE_S", 1)
    assert guarded(_hang) == ("killed", "deadline passed (hang?)")


# --- bounded memory: a compressed leaf is inflated into its tensor --------------------------------------------


def _peak_added_rss(path: str) -> str:
    def status(field: str) -> int:
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) * 1024 for line in f if line.startswith(field))

    tddist.read_manifest(path)
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # resets VmHWM to the current RSS
    base = status("VmRSS:")
    x = tddist.load(path, shard=None, verify=True)["x"]
    return f"{x.numel() * x.element_size()} {status('VmHWM:') - base}"


@pytest.mark.timeout(600)
@pytest.mark.parametrize("codec", ["deflate:1", "zstd:1"])
def test_loading_a_compressed_leaf_adds_little_more_than_the_leaf(tmp_path, codec):
    """Peak RSS added by loading one 64 MiB compressed leaf (measured in a child, VmHWM) stays below 1.5x it:
    the compressed bytes are read in blocks and inflated into the tensor, with no whole-entry copy."""
    n = 64 << 20
    x = torch.randint(0, 16, (n,), dtype=torch.uint8, generator=torch.Generator().manual_seed(0))
    path = tmp_path / "big.tdz"
    tddist.save(TensorDict(x=x, batch_size=[]), path, compression=codec)
    del x
    outcome, detail = guarded(lambda: _peak_added_rss(str(path)))
    assert outcome == "ok", detail
    size, peak = map(int, detail.split())
    assert size == n
    assert peak < 1.5 * n, f"loading a {n >> 20} MiB {codec} leaf added {peak / 2**20:.0f} MiB of RSS"


def test_declared_size_beyond_the_manifest_is_refused_before_inflating(tmp_path):
    """A compressed entry whose sizes say more than the manifest's nbytes is refused without allocating."""
    path = tmp_path / "a.tdz"
    tddist.save(TensorDict(x=torch.zeros(1000), batch_size=[]), path, compression="deflate")
    raw = bytearray(path.read_bytes())
    with zipfile.ZipFile(path) as zf:
        zi = zf.getinfo("rank-00000/x.memmap")
    cd = raw.find(b"PK\x01\x02" + raw[zi.header_offset + 4 : zi.header_offset + 6])  # the first record: x's
    while struct.unpack_from("<I", raw, cd + 42)[0] != zi.header_offset:
        cd = raw.find(b"PK\x01\x02", cd + 4)
    struct.pack_into("<I", raw, cd + 24, 2**31)  # uncompressed size in the central directory
    struct.pack_into("<I", raw, zi.header_offset + 22, 2**31)
    path.write_bytes(bytes(raw))
    with pytest.raises(CorruptCheckpointError, match="declares 2147483648 bytes, the manifest says 4000"):
        tddist.load(path, shard=None)


def test_deflate_bomb_is_refused_before_allocating(tmp_path):
    """A deflate entry that declares more than deflate can expand to (1032:1) is refused before its buffer."""
    from tddist.storage.zipcodec import check_compressed_entry

    with pytest.raises(CorruptCheckpointError, match="more than deflate can expand to"):
        check_compressed_entry(zipfile.ZIP_DEFLATED, 1000, 2000 * 1000, "test")
    check_compressed_entry(zipfile.ZIP_DEFLATED, 1000, 1000 * 1000, "test")
    with pytest.raises(CorruptCheckpointError, match="unknown compression method 99"):
        check_compressed_entry(99, 1000, 1000, "test")


@pytest.mark.parametrize("codec", CODECS)
def test_each_codec_round_trips_across_stream_blocks(tmp_path, codec, monkeypatch):
    """Decompression in blocks smaller than the entry (and than the codec's pieces) gives the bytes back."""
    from tddist.storage import zipcodec

    monkeypatch.setattr(zipcodec, "STREAM_BLOCK", 4099)
    x = torch.arange(50_000, dtype=torch.int32) % 1013
    path = tmp_path / "a.tdz"
    tddist.save(TensorDict(x=x, batch_size=[]), path, compression=codec)
    assert torch.equal(tddist.load(path, shard=None, verify=True)["x"], x)


def test_truncated_compressed_stream_is_a_corrupt_checkpoint(tmp_path):
    """A deflate entry whose stream ends early decompresses to fewer bytes than declared: refused."""
    path = tmp_path / "a.tdz"
    x = torch.randint(0, 8, (20000,), generator=torch.Generator().manual_seed(1))
    tddist.save(TensorDict(x=x, batch_size=[]), path, compression="deflate")
    with zipfile.ZipFile(path) as zf:
        zi = zf.getinfo("rank-00000/x.memmap")
    raw = bytearray(path.read_bytes())
    start = zi.header_offset + 30 + len(zi.filename) + len(zi.extra)
    raw[start + zi.compress_size // 2 : start + zi.compress_size] = bytes(zi.compress_size - zi.compress_size // 2)
    path.write_bytes(bytes(raw))
    with pytest.raises(CorruptCheckpointError):
        tddist.load(path, shard=None)


# --- regressions: what fuzzing found ----------------------------------------------------------------------------


def _edited_extended(tmp_path: Path, edit: Callable[[dict], None]) -> Path:
    """The golden version-2 ``extended`` checkpoint with its manifest JSON edited."""
    path = _copy(GOLDEN / "v2" / "extended", tmp_path / "ckpt")
    obj = json.loads((path / fmt.MANIFEST_NAME).read_bytes())
    edit(obj)
    (path / fmt.MANIFEST_NAME).write_text(json.dumps(obj))
    return path


def _objects(obj: dict) -> dict[str, dict]:
    return {o["key"][-1]: o for o in obj["objects"]}


def test_regression_stack_rows_tensordict_cannot_stack(tmp_path):
    """A stack row that is a list (tensordict stacks it as a nested stack, of another length) was a RuntimeError."""
    path = _edited_extended(tmp_path, lambda obj: _objects(obj)["labels"]["values"][0].__setitem__(0, {"json": [1, 2]}))
    with pytest.raises(tddist.ManifestError, match=r"non-tensor stack \['labels'\] has rows that cannot be stacked"):
        tddist.load(path, shard=None)


@pytest.mark.parametrize("encoded", ["AAAA", "not base64!", "Y25vX3N1Y2hfbW9kdWxlX3RkZGlzdAp4Ci4="])
def test_regression_value_that_does_not_unpickle(tmp_path, encoded):
    """With allow_pickle=True, a pickled value that is not base64, not a pickle, or names a missing global was a
    raw binascii.Error / UnpicklingError / AttributeError."""
    path = _edited_extended(tmp_path, lambda obj: _objects(obj)["config"]["values"].__setitem__(0, {"pickle": encoded}))
    with pytest.raises(tddist.ManifestError, match=r"cannot be unpickled"):
        tddist.load(path, shard=None, allow_pickle=True)


def test_regression_zip_version_beyond_zipfile(tmp_path):
    """A central directory asking for a zip version zipfile does not implement ("zip file version 6.4") was a raw
    NotImplementedError from ArchiveFiles."""
    from tddist.storage.archive import ArchiveFiles

    path = _copy(GOLDEN / "v2" / "extended.tdz", tmp_path / "a.tdz")
    raw = bytearray(path.read_bytes())
    cd = raw.find(b"PK\x01\x02")
    struct.pack_into("<H", raw, cd + 6, 64)  # version needed to extract: 6.4
    path.write_bytes(bytes(raw))
    with pytest.raises(CorruptCheckpointError, match="not a readable zip archive"):
        ArchiveFiles(str(path))
