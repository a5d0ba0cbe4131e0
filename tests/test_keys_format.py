"""Keys that are hostile as file names, dtypes and tensor layouts, in a single process."""

from __future__ import annotations

import os

import pytest
import torch
from tensordict import TensorDict

import tddist
from tddist import InvalidDataError
from tddist import format as fmt
from tests.helpers import assert_td_equal

WEIRD_KEYS = [
    "a/b",
    "/",
    "/etc/passwd",
    "..",
    "../..",
    ".",
    "...",
    "",
    " ",
    "x y",
    "ünïcødé ✓ 中文",
    "nul\0byte",
    "\0",
    "%",
    "%2E%2E",
    "%25",
    "ctl\x01\x1b\x1f\x7f",
    "tab\there\nnewline\r",
    'quo"te<>:|?*\\',
    "meta",
    "rank-00000",
    "tddist.json",
]


def weird_td() -> TensorDict:
    """Every weird key as a top-level leaf, and again as leaves and sub-TensorDicts
    under nodes that are themselves named with weird keys."""
    n = 3
    top = {k: torch.arange(n * 2, dtype=torch.float32).reshape(n, 2) + i for i, k in enumerate(WEIRD_KEYS)}
    inner = {k: torch.full((n,), i, dtype=torch.int32) for i, k in enumerate(WEIRD_KEYS)}
    td = TensorDict(top, batch_size=[n])
    td["nested"] = TensorDict(
        {
            "..": TensorDict(inner, [n]),
            ".": TensorDict({"..": torch.arange(n)}, [n]),
            "": TensorDict({"": torch.ones(n, 1), "a/b": TensorDict({"/": torch.zeros(n)}, [n])}, [n]),
            "../../escape": TensorDict({"x\0": torch.ones(n, dtype=torch.bool)}, [n]),
        },
        [n],
    )
    return td


def _all_paths(root: str) -> list[str]:
    out = []
    for dirpath, dirs, files in os.walk(root):
        out.extend(os.path.join(dirpath, n) for n in dirs + files)
    return out


def test_weird_keys_round_trip_and_stay_inside(tmp_path):
    """Keys with '/', '..', '.', '', spaces, unicode, NUL, '%' and control characters,
    top-level and nested, are escaped into files that all lie inside the target, and
    load back unchanged."""
    td = weird_td()
    target = tmp_path / "ckpt"
    tddist.save(td, target, layout="memmap")
    assert sorted(os.listdir(tmp_path)) == ["ckpt"]  # nothing created beside the target
    real_root = os.path.realpath(target)
    paths = _all_paths(str(target))
    assert len(paths) > len(WEIRD_KEYS)
    for p in paths:
        assert not os.path.islink(p), p
        real = os.path.realpath(p)
        assert real.startswith(real_root + os.sep), p
    assert_td_equal(tddist.load(target, shard=None), td)
    assert_td_equal(tddist.load(target), td)


def test_weird_keys_round_trip_packed(tmp_path):
    """The same keys in the default layout (one data file per rank): no file is named after a key."""
    td = weird_td()
    target = tmp_path / "ckpt"
    tddist.save(td, target)
    assert sorted(os.listdir(target)) == ["rank-00000.data", "tddist.idx", "tddist.json"]
    assert_td_equal(tddist.load(target, shard=None, verify=True), td)


def test_weird_keys_file_names_are_escaped(tmp_path):
    """No file name contains a separator, a NUL or a control character, and no node is
    named '.' or '..' (the escaping is tensordict's, so rank dirs stay loadable)."""
    target = tmp_path / "ckpt"
    tddist.save(weird_td(), target, layout="memmap")
    for p in _all_paths(str(target)):
        name = os.path.basename(p)
        assert name not in ("", ".", "..")
        assert not any(ord(c) < 32 or c in "\\\x7f" for c in name), repr(name)
    top = set(os.listdir(target / fmt.rank_dir(0)))
    assert {"%2E%2E.memmap", "a%2Fb.memmap", "%.memmap", "%25.memmap", "%2E.memmap", "%00.memmap"} <= top
    nested = set(os.listdir(target / fmt.rank_dir(0) / "nested"))
    assert nested == {"%2E%2E", "%2E", "%", "..%2F..%2Fescape", "meta.json"}


def test_rank_directory_opens_with_tensordict(tmp_path):
    """Each rank directory is a plain tensordict memmap: TensorDict.load_memmap reads the
    same values, weird keys included."""
    td = weird_td()
    target = tmp_path / "ckpt"
    tddist.save(td, target, layout="memmap")
    rank_dirs = sorted(n for n in os.listdir(target) if n.startswith("rank-"))
    assert rank_dirs == ["rank-00000"]
    loaded = TensorDict.load_memmap(target / rank_dirs[0])
    assert_td_equal(loaded, td)


def test_robust_key_false_refuses_unsafe_keys(tmp_path):
    """With robust_key=False a key is a file name verbatim, so unsafe keys are refused
    (InvalidDataError) and nothing is created."""
    for i, key in enumerate(["a/b", "..", ".", "", "nul\0", "%", "ctl\x01", "tab\t", "k" * 300]):
        target = tmp_path / f"c{i}"
        with pytest.raises(InvalidDataError):
            tddist.save(TensorDict({key: torch.ones(2)}, [2]), target, robust_key=False, layout="memmap")
        with pytest.raises(InvalidDataError):
            tddist.save(
                TensorDict({"ok": TensorDict({key: torch.ones(2)}, [2])}, [2]),
                target,
                robust_key=False,
                layout="memmap",
            )
        with pytest.raises(InvalidDataError):  # as a node name
            tddist.save({key: {"ok": torch.ones(2)}}, target, robust_key=False, layout="memmap")
    assert os.listdir(tmp_path) == []


def test_robust_key_false_accepts_plain_keys(tmp_path):
    """Plain keys are written verbatim with robust_key=False and load back."""
    td = TensorDict({"obs": torch.arange(4.0), "sub-td": TensorDict({"a.b_c-1": torch.ones(4, 2)}, [4])}, [4])
    target = tmp_path / "ckpt"
    tddist.save(td, target, robust_key=False, layout="memmap")
    assert tddist.read_manifest(target).robust_key is False
    files = os.listdir(target / "rank-00000")
    assert "obs.memmap" in files and "sub-td" in files
    assert os.path.isfile(target / "rank-00000" / "sub-td" / "a.b_c-1.memmap")
    assert_td_equal(tddist.load(target, shard=None), td)
    assert_td_equal(TensorDict.load_memmap(target / "rank-00000"), td)


@pytest.mark.parametrize("name", sorted(fmt.TD_META_RESERVED))
@pytest.mark.parametrize("nested", [False, True])
def test_meta_field_names_are_refused(tmp_path, name, nested):
    """Keys named like fields of tensordict's meta.json ('shape', 'device', ...) would
    corrupt the rank directory's metadata, so save refuses them."""
    inner = {name: torch.ones(2)}
    data = {"sub": inner} if nested else inner
    with pytest.raises(InvalidDataError, match=repr(name)):
        tddist.save(data, tmp_path / "ckpt", layout="memmap")
    assert os.listdir(tmp_path) == []


@pytest.mark.parametrize(
    "data",
    [
        {"meta.json": {"a": torch.ones(2)}},
        {"x": torch.ones(2), "x.memmap": {"a": torch.ones(2)}},
    ],
    ids=["node-meta.json", "leaf-and-node-x.memmap"],
)
def test_file_name_collisions_are_refused_as_invalid_data(tmp_path, data):
    """Keys whose files would collide inside a rank directory are invalid data."""
    with pytest.raises(InvalidDataError):
        tddist.save(data, tmp_path / "ckpt", layout="memmap")


# --- dtypes and layouts ----------------------------------------------------------------

DTYPES = [
    torch.float64,
    torch.float32,
    torch.float16,
    torch.bfloat16,
    torch.int8,
    torch.int16,
    torch.int32,
    torch.int64,
    torch.uint8,
    torch.bool,
    torch.complex64,
    torch.complex128,
    torch.uint16,
    torch.uint32,
    torch.uint64,
    torch.float8_e4m3fn,
    torch.float8_e5m2,
]


def random_bits(shape, dtype, seed=0) -> torch.Tensor:
    """Arbitrary bit patterns (NaN payloads, -0.0, subnormals included) of ``dtype``."""
    g = torch.Generator().manual_seed(seed)
    if dtype == torch.bool:
        return torch.randint(0, 2, shape, generator=g).bool()
    size = torch.empty((), dtype=dtype).element_size()
    raw = torch.randint(0, 256, (*shape, size), dtype=torch.uint8, generator=g)
    return raw.view(dtype).reshape(shape)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_dtypes_round_trip_bit_exactly(tmp_path, dtype):
    """Every supported dtype comes back bit for bit, through tddist and through tensordict."""
    td = TensorDict({"v": random_bits((5, 3), dtype), "s": {"w": random_bits((4,), dtype, 1)}}, [])
    target = tmp_path / "ckpt"
    returned = tddist.save(td, target, layout="memmap")
    assert_td_equal(returned, td)
    assert_td_equal(tddist.load(target, shard=None), td)
    assert tddist.read_manifest(target).leaves[("v",)].dtype == dtype
    if dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
        return  # tensordict's memmap loader has no name for float8 dtypes
    assert_td_equal(TensorDict.load_memmap(target / "rank-00000"), td)


def test_non_contiguous_inputs_round_trip(tmp_path):
    """Transposed, step-sliced, offset, expanded and lazily conjugated/negated tensors are
    saved with their values, not their raw storage."""
    base = torch.arange(48, dtype=torch.float32).reshape(6, 8)
    c = torch.complex(torch.arange(6.0), torch.arange(6.0) + 0.5)
    td = TensorDict(
        {
            "t": torch.arange(36, dtype=torch.int32).reshape(6, 6).t(),  # transposed view
            "step": base[::1, ::2][:, :4],
            "rows": torch.arange(60).reshape(12, 5)[1::2],
            "offset": base[:, 3:5],
            "expand": torch.arange(3.0).expand(6, 3),
            "conj": c.conj(),
            "neg": torch._neg_view(torch.arange(6.0)),
        },
        [6],
    )
    assert not td["t"].is_contiguous() and not td["step"].is_contiguous() and not td["rows"].is_contiguous()
    assert td["conj"].is_conj() and td["neg"].is_neg()
    target = tmp_path / "ckpt"
    tddist.save(td, target, layout="memmap")
    back = tddist.load(target, shard=None)
    for k in td.keys():
        expect = td[k].resolve_conj().resolve_neg()
        assert torch.equal(back[k], expect), k
        assert not back[k].is_conj() and not back[k].is_neg()
    assert torch.equal(back["conj"], torch.complex(torch.arange(6.0), -(torch.arange(6.0) + 0.5)))
    assert torch.equal(back["neg"], -torch.arange(6.0))


def test_scalar_replicated_leaf_round_trips(tmp_path):
    """A 0-dim leaf (replicated, no batch dims) is saved as one element and loads as 0-dim."""
    td = TensorDict({"step": torch.tensor(12345, dtype=torch.int64), "lr": torch.tensor(0.125)}, [])
    td["data"] = TensorDict({"x": torch.arange(4)}, [4])
    target = tmp_path / "ckpt"
    tddist.save(td, target, layout="memmap")
    m = tddist.read_manifest(target)
    assert m.leaves[("step",)].shape == () and m.leaves[("step",)].placement == tddist.Replicate()
    assert os.path.getsize(target / "rank-00000" / "step.memmap") == 8
    for shard in (None, "even", "saved"):
        back = tddist.load(target, shard=shard)
        assert back["step"].shape == () and back["step"].item() == 12345
        assert back["lr"].item() == 0.125
        assert_td_equal(back, td)


@pytest.mark.parametrize(
    "batch",
    [[], [5], [2, 3]],
)
def test_empty_tensordict_round_trips(tmp_path, batch):
    """An empty TensorDict (with or without batch dims) saves and loads with its batch size."""
    td = TensorDict({}, batch_size=batch)
    target = tmp_path / "ckpt"
    out = tddist.save(td, target, layout="memmap")
    assert out.batch_size == td.batch_size and len(out.keys()) == 0
    back = tddist.load(target, shard=None)
    assert back.batch_size == td.batch_size and len(back.keys()) == 0
    assert tddist.read_manifest(target).leaves == {}


def test_zero_element_leaves_round_trip(tmp_path):
    """Leaves with no elements write no file (as tensordict) yet load with their shape."""
    td = TensorDict({"a": torch.ones(4, 0), "b": torch.ones(4, 0, 3, dtype=torch.int16)}, [4])
    td = TensorDict({"r": td, "e": torch.ones(0), "empty_rows": TensorDict({"c": torch.ones(0, 2)}, [0])}, [])
    target = tmp_path / "ckpt"
    tddist.save(td, target, layout="memmap")
    assert not any(p.endswith(".memmap") for p in _all_paths(str(target)))
    assert_td_equal(tddist.load(target, shard=None), td)
    assert_td_equal(TensorDict.load_memmap(target / "rank-00000"), td)
