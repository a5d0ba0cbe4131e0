"""Merging rank fragments into a manifest, and validating untrusted manifest JSON."""

from __future__ import annotations

import copy

import pytest
import torch

from tddist import Manifest, ManifestError, Replicate, Shard, ShardingError
from tddist import format as fmt
from tddist.manifest import merge_fragments, parse_manifest, to_json
from tddist.types import Fragment, FragmentLeaf, StoredBytes

CS = "0123456789abcdef"  # a well-formed checksum
CS2 = "fedcba9876543210"


def frag(rank, rows, leaves, nodes=None):
    """A literal fragment as a layout's write returns it: root node with ``rows`` batch rows."""
    nodes = nodes if nodes is not None else [[[], [rows]]]
    return Fragment(rank, tuple((tuple(k), tuple(b)) for k, b in nodes), tuple(leaves))


def leaf_entry(key, shape, dtype, placement, nbytes, checksum, replica=None):
    stored = StoredBytes(nbytes, checksum) if checksum is not None else None
    return FragmentLeaf(key, fmt.dtype_name(dtype), tuple(shape), placement, stored, replica_checksum=replica)


def sharded(key, shape, dtype=torch.float32, dim=0):
    n = torch.empty((), dtype=dtype).element_size()
    for s in shape:
        n *= s
    return leaf_entry(key, shape, dtype, Shard(dim), n, CS)


def replicated(key, shape, dtype=torch.float32, written=True, replica=None):
    n = torch.empty((), dtype=dtype).element_size()
    for s in shape:
        n *= s
    return leaf_entry(key, shape, dtype, Replicate(), n if written else None, CS if written else None, replica)


def merge(fragments, **kw):
    return merge_fragments(fragments, metadata=kw.get("metadata"), robust_key=True, version="test")


def three_rank_fragments(rows=(3, 0, 2)):
    """Three ranks: a sharded ("x") and a replicated ("w", written by rank 0) leaf."""
    return [
        frag(
            r,
            n,
            [
                sharded(("x",), [n, 4]),
                replicated(("w",), [5], torch.int64, written=(r == 0)),
            ],
        )
        for r, n in enumerate(rows)
    ]


# --- merge_fragments: the good case ---------------------------------------------------


def test_merge_computes_global_shapes_and_offsets_in_rank_order():
    """Global dim-0 size is the sum of the ranks' rows; chunk offsets follow rank order,
    zero-row ranks included; replicated leaves keep one chunk, rank 0's."""
    m = merge(three_rank_fragments((3, 0, 2)), metadata={"step": 1})
    assert m.world_size == 3
    assert m.nodes == {(): (5,)}
    x = m.leaves[("x",)]
    assert x.shape == (5, 4) and x.dtype == torch.float32 and x.placement == Shard(0)
    assert [c.rank for c in x.chunks] == [0, 1, 2]
    assert [c.box for c in x.chunks] == [((0, 0), (3, 4)), ((3, 0), (0, 4)), ((3, 0), (2, 4))]
    assert [c.nbytes for c in x.chunks] == [48, 0, 32]
    w = m.leaves[("w",)]
    assert w.shape == (5,) and w.placement == Replicate() and w.dtype == torch.int64
    assert [(c.rank, c.box, c.nbytes) for c in w.chunks] == [(0, ((0,), (5,)), 40)]
    assert m.metadata == {"step": 1}


def test_merge_shard_along_dim1_and_nested_nodes():
    """A leaf sharded along dim 1 gets its global size from dim 1; nested nodes' batch
    sizes are summed along dim 0 only."""
    fr = []
    for r, (rows, cols) in enumerate([(1, 2), (2, 0), (0, 3)]):
        nodes = [[[], []], [["sub"], [rows, 6]]]
        leaves = [sharded(("sub", "a"), [rows, 6]), sharded(("c",), [4, cols], torch.int8, dim=1)]
        fr.append(frag(r, None, leaves, nodes=nodes))
    m = merge(fr)
    assert m.nodes == {(): (), ("sub",): (3, 6)}
    c = m.leaves[("c",)]
    assert c.shape == (4, 5) and c.placement == Shard(1)
    assert [ch.box for ch in c.chunks] == [((0, 0), (4, 2)), ((0, 2), (4, 0)), ((0, 2), (4, 3))]
    assert m.leaves[("sub", "a")].shape == (3, 6)


def test_merge_accepts_equal_replicas():
    """check_replicas: a replica digest equal to the writer's checksum is fine."""
    fr = [frag(0, 1, [replicated(("w",), [2])]), frag(1, 1, [replicated(("w",), [2], written=False, replica=CS)])]
    assert merge(fr).leaves[("w",)].chunks[0].rank == 0


# --- merge_fragments: every mismatch is a ShardingError -------------------------------------


def test_merge_rejects_mismatched_dtypes():
    """Ranks saving the same leaf with different dtypes cannot be merged."""
    fr = [frag(0, 2, [sharded(("x",), [2, 4])]), frag(1, 2, [sharded(("x",), [2, 4], torch.float64)])]
    with pytest.raises(ShardingError, match="dtype"):
        merge(fr)


def test_merge_rejects_mismatched_placements():
    """One rank sharding and another replicating the same leaf is refused."""
    fr = [frag(0, 2, [sharded(("x",), [2])]), frag(1, 2, [replicated(("x",), [2])])]
    with pytest.raises(ShardingError, match="placement"):
        merge(fr)


@pytest.mark.parametrize(
    "other",
    [
        [sharded(("x",), [2, 4]), sharded(("y",), [2])],  # extra key
        [sharded(("y",), [2, 4])],  # other key
        [],  # no keys
    ],
)
def test_merge_rejects_different_key_sets(other):
    """Every rank must pass the same structure."""
    fr = [frag(0, 2, [sharded(("x",), [2, 4])]), frag(1, 2, other)]
    with pytest.raises(ShardingError, match="different keys"):
        merge(fr)


def test_merge_rejects_same_keys_in_another_order():
    """Leaf order is part of the structure (chunks are matched by position)."""
    a, b = sharded(("a",), [1]), sharded(("b",), [1])
    with pytest.raises(ShardingError):
        merge([frag(0, 1, [a, b]), frag(1, 1, [b, a])])


def test_merge_rejects_different_nodes():
    """A sub-TensorDict present on one rank only is a structure mismatch."""
    fr = [frag(0, 1, [], nodes=[[[], [1]], [["s"], [1]]]), frag(1, 1, [], nodes=[[[], [1]]])]
    with pytest.raises(ShardingError):
        merge(fr)


@pytest.mark.parametrize("shape1", [[2, 5], [2, 4, 1], [2]])
def test_merge_rejects_different_dims_beyond_shard_dim(shape1):
    """Only the shard dim may differ between ranks."""
    fr = [frag(0, 2, [sharded(("x",), [2, 4])]), frag(1, 2, [sharded(("x",), shape1)])]
    with pytest.raises(ShardingError):
        merge(fr)


def test_merge_rejects_shard_dim_beyond_rank():
    """Sharding along dim 1 of a 1-D tensor is refused."""
    fr = [frag(0, 2, [sharded(("x",), [2], dim=1)]), frag(1, 2, [sharded(("x",), [2], dim=1)])]
    with pytest.raises(ShardingError):
        merge(fr)


def test_merge_rejects_node_batch_differing_beyond_dim0():
    """A node's batch may differ across ranks only in dim 0."""
    fr = [frag(0, None, [], nodes=[[[], [2, 3]]]), frag(1, None, [], nodes=[[[], [2, 4]]])]
    with pytest.raises(ShardingError, match="batch"):
        merge(fr)


@pytest.mark.parametrize("shape1", [[6], [5, 1], []])
def test_merge_rejects_replicated_leaves_with_different_shapes(shape1):
    """A replicated leaf must have the same shape everywhere."""
    fr = [frag(0, 1, [replicated(("w",), [5])]), frag(1, 1, [replicated(("w",), shape1, written=False)])]
    with pytest.raises(ShardingError, match="replicated"):
        merge(fr)


def test_merge_rejects_differing_replicas():
    """With check_replicas, a rank whose replica digest differs from rank 0's copy is named."""
    fr = [
        frag(0, 1, [replicated(("w",), [2])]),
        frag(1, 1, [replicated(("w",), [2], written=False, replica=CS)]),
        frag(2, 1, [replicated(("w",), [2], written=False, replica=CS2)]),
    ]
    with pytest.raises(ShardingError, match=r"rank\(s\) \[2\]"):
        merge(fr)


# --- to_json / parse_manifest ------------------------------------------------------------


def good_json() -> dict:
    """A valid manifest as plain JSON (via the on-disk encoder)."""
    fr = []
    for r, rows in enumerate((3, 0, 2)):
        nodes = [[[], [rows]], [["sub"], [rows, 2]]]
        leaves = [
            sharded(("x",), [rows, 4]),
            sharded(("sub", "y"), [rows, 2], torch.int16),
            replicated(("w",), [5], torch.int64, written=(r == 0)),
            replicated(("s",), [], torch.bool, written=(r == 0)),
        ]
        fr.append(frag(r, None, leaves, nodes=nodes))
    m = merge(fr, metadata={"step": 7, "tags": ["a", "b"], "nested": {"lr": 0.5}})
    return fmt.loads(fmt.dumps(to_json(m)))


def test_to_json_parse_round_trip():
    """What to_json writes, parse_manifest reads back into an equal Manifest."""
    fr = three_rank_fragments((1, 4, 0))
    m = merge(fr, metadata={"k": [1, 2, {"z": None}]})
    back = parse_manifest(fmt.loads(fmt.dumps(to_json(m))))
    assert isinstance(back, Manifest)
    assert back == m
    big = parse_manifest(good_json())
    assert set(big.leaves) == {("x",), ("sub", "y"), ("w",), ("s",)}
    assert big.nodes == {(): (5,), ("sub",): (5, 2)}
    assert big.leaves[("s",)].shape == () and big.leaves[("s",)].chunks[0].nbytes == 1
    assert parse_manifest(fmt.loads(fmt.dumps(to_json(big)))) == big


def leaf(obj, key):
    return next(e for e in obj["leaves"] if e["key"] == list(key))


def _set(path, value):
    """A tampering that sets a top-level field."""

    def f(obj):
        obj[path[0]] = value

    return f


def _leaf_set(key, field, value):
    def f(obj):
        leaf(obj, key)[field] = value

    return f


def _chunk_set(key, index, pos, value):
    def f(obj):
        leaf(obj, key)["chunks"][index][pos] = value

    return f


def _chunks(key, chunks):
    return _leaf_set(key, "chunks", chunks)


def _del_node(key):
    def f(obj):
        obj["nodes"] = [n for n in obj["nodes"] if n["key"] != key]

    return f


#: name -> (change to a valid manifest, text the error must contain)
TAMPERINGS = {
    "unrelated object": (lambda obj: obj.clear() or obj.update({"x": 1}), "format"),
    "wrong format name": (_set(["format"], "tddist2"), "format 'tddist2'"),
    "missing format": (lambda obj: obj.pop("format"), "format None"),
    "version as string": (_set(["version"], "1"), "integer 'version'"),
    "version as float": (_set(["version"], 1.0), "integer 'version'"),
    "version as bool": (_set(["version"], True), "integer 'version'"),
    "version missing": (lambda obj: obj.pop("version"), "integer 'version'"),
    "version zero": (_set(["version"], 0), "invalid version"),
    "world_size zero": (_set(["world_size"], 0), "world_size"),
    "world_size string": (_set(["world_size"], "3"), "world_size"),
    "unknown layout": (_set(["layout"], "tarball"), "layout"),
    "other checksum algorithm": (
        _set(["checksum"], {"algorithm": "md5", "block_size": fmt.CHECKSUM_BLOCK}),
        "checksum settings",
    ),
    "other checksum block": (
        _set(["checksum"], {"algorithm": fmt.CHECKSUM_ALGORITHM, "block_size": 4096}),
        "checksum settings",
    ),
    "metadata not object": (_set(["metadata"], [1, 2]), "metadata"),
    "robust_key not bool": (_set(["robust_key"], "yes"), "robust_key"),
    "nodes not a list": (_set(["nodes"], {}), "'nodes'"),
    "leaves missing": (lambda obj: obj.pop("leaves"), "'leaves'"),
    "chunk nbytes too large": (_chunk_set(("x",), 0, 3, 3 * 4 * 4 + 4), "declares 52 bytes"),
    "chunk nbytes zero": (_chunk_set(("x",), 2, 3, 0), "declares 0 bytes"),
    "chunk nbytes as string": (_chunk_set(("x",), 0, 3, "48"), "declares '48' bytes"),
    "replicated nbytes wrong": (_chunk_set(("w",), 0, 1, 41), "declares 41 bytes"),
    "absurd shape": (_leaf_set(("x",), "shape", [2**40, 2**40]), "absurd"),
    "absurd batch size": (lambda obj: obj["nodes"][0].update(batch_size=[2**40, 2**40]), "absurd"),
    "too many dims": (_leaf_set(("w",), "shape", [1] * 65), "invalid leaf"),
    "negative size in shape": (_leaf_set(("w",), "shape", [-5]), "invalid leaf"),
    "float in shape": (_leaf_set(("w",), "shape", [5.0]), "invalid leaf"),
    "negative chunk length": (_chunks(("x",), [[0, 0, 3, 48, CS], [1, 3, -1, 0, CS], [2, 2, 3, 48, CS]]), "negative"),
    "negative chunk offset": (_chunks(("x",), [[0, -1, 1, 16, CS], [1, 0, 3, 48, CS], [2, 3, 2, 32, CS]]), "negative"),
    "chunk rank == world size": (_chunk_set(("x",), 2, 0, 3), "invalid rank 3"),
    "chunk rank negative": (_chunk_set(("x",), 1, 0, -1), "invalid rank -1"),
    "replicated chunk rank outside": (_chunk_set(("w",), 0, 0, 7), "invalid rank 7"),
    "chunk rank not int": (_chunk_set(("x",), 0, 0, "0"), "invalid rank"),
    "duplicated rank": (_chunk_set(("x",), 1, 0, 0), "rank twice"),
    "overlapping chunks": (_chunks(("x",), [[0, 0, 3, 48, CS], [1, 2, 0, 0, CS], [2, 2, 3, 48, CS]]), "overlap"),
    "gapped chunks": (_chunks(("x",), [[0, 0, 2, 32, CS], [1, 2, 0, 0, CS], [2, 3, 2, 32, CS]]), "gap"),
    "chunk beyond shape": (_chunks(("x",), [[0, 0, 3, 48, CS], [1, 3, 0, 0, CS], [2, 3, 3, 48, CS]]), "outside"),
    "missing chunks": (_chunks(("x",), [[0, 0, 3, 48, CS]]), "gap"),
    "no chunks at all": (_chunks(("x",), []), "gap"),
    "malformed chunk": (_chunks(("x",), [[0, 0, 5, 80]]), "malformed chunk"),
    "replicated with two chunks": (_chunks(("w",), [[0, 40, CS], [1, 40, CS]]), "exactly one chunk"),
    "replicated with no chunk": (_chunks(("w",), []), "exactly one chunk"),
    "unknown dtype": (_leaf_set(("x",), "dtype", "float128"), "unknown dtype"),
    "dtype with torch prefix": (_leaf_set(("x",), "dtype", "torch.float32"), "unknown dtype"),
    "dtype not a string": (_leaf_set(("x",), "dtype", ["float32"]), "unknown dtype"),
    "dtype missing": (lambda obj: leaf(obj, ("x",)).pop("dtype"), "unknown dtype"),
    "unknown placement": (_leaf_set(("x",), "placement", {"type": "stripe", "dim": 0}), "unknown placement"),
    "placement not an object": (_leaf_set(("x",), "placement", "shard"), "placement"),
    "shard dim out of range": (_leaf_set(("x",), "placement", {"type": "shard", "dim": 2}), "invalid dim"),
    "shard dim not int": (_leaf_set(("x",), "placement", {"type": "shard", "dim": "0"}), "invalid dim"),
    "checksum uppercase": (_chunk_set(("x",), 0, 4, CS.upper()), "malformed checksum"),
    "checksum too short": (_chunk_set(("x",), 0, 4, CS[:15]), "malformed checksum"),
    "checksum not hex": (_chunk_set(("x",), 0, 4, "0123456789abcdeg"), "malformed checksum"),
    "checksum int": (_chunk_set(("w",), 0, 2, 12345), "malformed checksum"),
    "checksum None": (_chunk_set(("x",), 1, 4, None), "malformed checksum"),
    "leaf whose parent node is missing": (_del_node(["sub"]), "parent node"),
    "leaf key empty": (_leaf_set(("w",), "key", []), "invalid key"),
    "leaf key not strings": (_leaf_set(("w",), "key", [1]), "invalid key"),
    "leaf listed twice": (lambda obj: obj["leaves"].append(copy.deepcopy(obj["leaves"][0])), "twice"),
    "node listed twice": (lambda obj: obj["nodes"].append(copy.deepcopy(obj["nodes"][0])), "twice"),
    "leaf also a node": (
        lambda obj: obj["nodes"].append({"key": ["w"], "batch_size": []}),
        "both as a node and as a leaf",
    ),
}


@pytest.mark.parametrize("name", list(TAMPERINGS))
def test_parse_manifest_rejects_tampering(name):
    """Each single tampering of a valid manifest is a ManifestError naming what is wrong,
    never a crash or a silently accepted manifest."""
    obj = good_json()
    parse_manifest(copy.deepcopy(obj))  # the untampered one is valid
    tamper, why = TAMPERINGS[name]
    tamper(obj)
    with pytest.raises(ManifestError) as info:
        parse_manifest(obj, where="manifest under test")
    assert why in str(info.value)
    assert "tampered" in str(info.value)


@pytest.mark.parametrize("bad", [None, [], "tddist", 3])
def test_parse_manifest_rejects_non_objects(bad):
    """A manifest that is not a JSON object is a ManifestError."""
    with pytest.raises(ManifestError):
        parse_manifest(bad)


def test_newer_version_says_upgrade():
    """A manifest from a newer format tells the user to upgrade tddist, naming both versions."""
    obj = good_json()
    obj["version"] = fmt.FORMAT_VERSION + 1
    with pytest.raises(ManifestError, match="upgrade") as info:
        parse_manifest(obj)
    assert str(fmt.FORMAT_VERSION + 1) in str(info.value)


def test_parse_manifest_error_names_the_place():
    """The error message starts with the ``where`` text so the user knows which file is bad."""
    obj = good_json()
    obj["format"] = "x"
    with pytest.raises(ManifestError, match="^/some/ckpt/tddist.json has format"):
        parse_manifest(obj, where="/some/ckpt/tddist.json")


@pytest.mark.parametrize(
    "tamper",
    [
        "leaf",
        "node",
    ],
)
def test_parse_manifest_rejects_huge_dimension_of_empty_tensor(tamper):
    """A dimension larger than any tensor can have is absurd even when another dimension is 0."""
    obj = good_json()
    if tamper == "leaf":
        e = leaf(obj, ("x",))
        e["shape"] = [2**80, 0]
        e["chunks"] = [[0, 0, 2**80, 0, CS], [1, 2**80, 0, 0, CS], [2, 2**80, 0, 0, CS]]
    else:
        obj["nodes"][0]["batch_size"] = [2**80, 0]
    with pytest.raises(ManifestError):
        parse_manifest(obj)


@pytest.mark.parametrize("where, bad", [("leaf", "nul\0"), ("leaf", "a/b"), ("node", "..")])
def test_parse_manifest_rejects_unusable_verbatim_keys(where, bad):
    """With robust_key=False, a key that cannot be used verbatim in a path is a damaged manifest."""
    obj = good_json()
    obj["robust_key"] = False
    if where == "leaf":
        leaf(obj, ("w",))["key"] = [bad]
    else:
        obj["nodes"].append({"key": [bad], "batch_size": []})
        leaf(obj, ("w",))["key"] = [bad, "w"]
    parse_manifest(dict(obj, robust_key=True))  # the same keys are fine when escaped
    with pytest.raises(ManifestError):
        parse_manifest(obj)
