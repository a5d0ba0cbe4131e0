"""Merging the ranks' votes into a manifest (merge.py, structure.py), and validating untrusted
version-1 manifest JSON (manifest_v1.py). Version 2's files are tested in test_manifest_v2.py."""

from __future__ import annotations

import copy
import pickle

import pytest
import torch
from tensordict import TensorDict

from tddist import Manifest, ManifestError, Replicate, Shard, ShardingError
from tddist import format as fmt
from tddist.checksum import checksum_bytes, tensor_bytes
from tddist.core.sharding import Boxes
from tddist.core.structure import describe_difference
from tddist.core.types import DTensorBox, LocalShard, SaveItem, SaveOptions, StoredBytes
from tddist.manifest.merge import MergeCache, merge_fragments
from tddist.manifest.parse import parse_manifest
from tddist.manifest.v2 import encode
from tddist.saving.prepare import prepare_shard
from tddist.storage.base import WriterBase
from tddist.storage.writer import stored_bytes

CS = "0123456789abcdef"  # a well-formed checksum


def shard_of(rank: int, data, placements=None, world: int = 3) -> LocalShard:
    """This rank's prepared shard, as save prepares it."""
    out = prepare_shard(
        data, rank, world, None, placements=placements, robust_key=True, allow_pickle=False, copy_existing=False
    )
    assert isinstance(out, LocalShard), out
    return out


def vote(rank: int, shard: LocalShard, check_replicas: bool = False, cache: MergeCache | None = None):
    """(plan, fragment) of a rank that stored its shard, computed by the layouts' own code."""
    options = SaveOptions("/t", "directory", {}, True, 0, check_replicas, True, False, False)
    w = WriterBase(options, rank, shard, cache)
    plan = w.make_plan()
    stored = {i.key: stored_bytes(tensor_bytes(i.tensor), fmt.dtype_name(i.tensor.dtype))
              for i in shard.items if i.writes}  # fmt: skip
    return plan, w.fragment(stored)


def merge(shards, cache=None, check_replicas=False, metadata=None, senders=None):
    """Rank 0's merge of the ranks' votes; with ``cache`` (rank 0's), the save then commits.

    ``senders``: each rank's own MergeCache (what it sent last), as each rank process keeps one.
    """
    senders = senders or [None] * len(shards)
    votes = [vote(r, s, check_replicas, senders[r]) for r, s in enumerate(shards)]
    reference = votes[0][0].structure
    m = merge_fragments(
        [f for _p, f in votes], reference, metadata=metadata or {}, robust_key=True, version="test",
        container="directory", packing="packed", cache=cache,
    )  # fmt: skip
    if cache is not None:
        cache.committed(reference.digest, b"")
    for (_p, f), sender in zip(votes, senders):
        if sender is not None:
            sender.committed(f.digest, f.boxes if f.boxes is not None else sender.sent_boxes)
    return m


def three_ranks(rows=(3, 0, 2)):
    """Three ranks: a sharded ("x") and a replicated ("w") leaf."""
    return [
        shard_of(r, {"b": TensorDict(x=torch.full((n, 4), float(r)), batch_size=[n]), "w": torch.arange(5)})
        for r, n in enumerate(rows)
    ]


OPTIONS = SaveOptions("/t", "directory", {}, True, 0, False, True, False, False)


# --- merge: the good cases ---------------------------------------------------------------------


def test_merge_computes_global_shapes_and_offsets_in_rank_order():
    """Global dim-0 size is the sum of the ranks' rows; chunks follow rank order, zero-row ranks
    included; replicated leaves keep one chunk, rank 0's."""
    m = merge(three_ranks((3, 0, 2)), metadata={"step": 1})
    assert m.world_size == 3 and m.version == 4 and m.packing == "packed"
    assert m.nodes == {(): (), ("b",): (5,)} and m.node_rows == {("b",): [3, 0, 2]}
    x = m.leaves[("b", "x")]
    assert x.shape == (5, 4) and x.dtype == torch.float32 and x.placement == Shard(0)
    assert [c.rank for c in x.chunks] == [0, 1, 2]
    assert [c.box for c in x.chunks] == [((0, 0), (3, 4)), ((3, 0), (0, 4)), ((3, 0), (2, 4))]
    assert [c.nbytes for c in x.chunks] == [48, 0, 32]
    w = m.leaves[("w",)]
    assert w.shape == (5,) and w.placement == Replicate() and w.dtype == torch.int64
    assert [(c.rank, c.box, c.nbytes) for c in w.chunks] == [(0, ((0,), (5,)), 40)]
    assert m.metadata == {"step": 1}
    assert x.chunks[2].checksum == checksum_bytes(tensor_bytes(torch.full((2, 4), 2.0)))


def test_merge_shard_along_dim1_and_nested_nodes():
    """A leaf sharded along dim 1 gets its global size from dim 1; nested batch sizes sum along dim 0."""
    shards = [
        shard_of(
            r,
            {
                "sub": TensorDict(a=torch.zeros(rows, 6), batch_size=[rows, 6]),
                "c": torch.ones(4, cols, dtype=torch.int8),
            },
            placements={"c": Shard(1)},
        )
        for r, (rows, cols) in enumerate([(1, 2), (2, 0), (0, 3)])
    ]
    m = merge(shards)
    assert m.nodes[("sub",)] == (3, 6)
    c = m.leaves[("c",)]
    assert c.shape == (4, 5) and c.placement == Shard(1)
    assert [ch.box for ch in c.chunks] == [((0, 0), (4, 2)), ((0, 2), (4, 0)), ((0, 2), (4, 3))]
    assert m.leaves[("sub", "a")].shape == (3, 6)


def test_replicas_are_compared_with_check_replicas():
    """check_replicas: equal replicas pass; a differing one is named, with the copy that would be written.

    Without it, replicas of at most 64 KiB are still compared (a differing one suggests PerRank()); larger
    ones are not."""
    same = [shard_of(r, {"w": torch.arange(3)}) for r in range(3)]
    assert merge(same, check_replicas=True).leaves[("w",)].chunks[0].rank == 0
    differ = [shard_of(r, {"w": torch.arange(3) + (r == 2)}) for r in range(3)]
    with pytest.raises(ShardingError, match=r"rank\(s\) \[2\]"):
        merge(differ, check_replicas=True)
    with pytest.raises(ShardingError, match=r"tddist\.PerRank\(\)"):  # small replicas are compared by default
        merge(differ)
    big = 64 * 1024 // 8 + 1  # int64 elements: just over the bytes compared by default
    differ = [shard_of(r, {"w": torch.arange(big) + (r == 2)}) for r in range(3)]
    assert merge(differ).leaves[("w",)].chunks[0].rank == 0  # a large replica is not compared unless asked


def test_replicated_leaves_are_shared_out_between_the_ranks_by_size():
    """Each rank writes the replicated leaves it was given (largest first, each to the rank with the fewest
    bytes so far), the manifest names that rank as the writer, and a replica that differs from the writer's
    copy is named against that rank."""

    def state(r: int, bump: int = -1) -> dict:
        sizes = {"a": 100, "b": 400, "c": 300, "d": 200, "e": 50}
        return {k: torch.arange(n, dtype=torch.int8) + (r == bump) for k, n in sizes.items()}

    shards = [shard_of(r, state(r)) for r in range(3)]
    written = [sorted(k[0] for k in s.written()) for s in shards]
    assert written == [["b"], ["c", "e"], ["a", "d"]]  # 400 | 300, 50 | 200, 100
    m = merge(shards, check_replicas=True)
    assert {k[0]: leaf.chunks[0].rank for k, leaf in m.leaves.items()} == {"a": 2, "b": 0, "c": 1, "d": 2, "e": 1}
    with pytest.raises(
        ShardingError, match=r"leaf 'a' differs between ranks: rank\(s\) \[0\] .* than rank 2, whose copy"
    ):
        merge([shard_of(r, state(r, bump=0)) for r in range(3)], check_replicas=True)


def _box_shard(box, writes=True, gshape=(4, 2)) -> LocalShard:
    item = SaveItem(("d",), torch.zeros(box[1]), Boxes(), writes, DTensorBox(box, gshape))
    return LocalShard({(): ()}, (item,), {})


def test_dtensor_boxes_must_tile_and_take_the_cached_path():
    """Boxes that tile merge (full path); the same boxes again are left out (cached path); new boxes
    take the full path again; a gap is refused."""
    cache, senders = MergeCache(), [MergeCache(), MergeCache()]
    halves = [_box_shard(((0, 0), (2, 2))), _box_shard(((2, 0), (2, 2)))]
    m = merge(halves, cache=cache, senders=senders)
    assert [c.box for c in m.leaves[("d",)].chunks] == [((0, 0), (2, 2)), ((2, 0), (2, 2))]
    assert (cache.full_merges, cache.cached_merges) == (1, 0)
    assert all(vote(r, s, cache=senders[r])[1].boxes is None for r, s in enumerate(halves))  # unchanged: left out
    m2 = merge(halves, cache=cache, senders=senders)
    assert (cache.full_merges, cache.cached_merges) == (1, 1)
    assert [c.box for c in m2.leaves[("d",)].chunks] == [c.box for c in m.leaves[("d",)].chunks]
    moved = [_box_shard(((0, 0), (3, 2))), _box_shard(((3, 0), (1, 2)))]  # same structure, new boxes
    m3 = merge(moved, cache=cache, senders=senders)
    assert (cache.full_merges, cache.cached_merges) == (2, 1)
    assert [c.box for c in m3.leaves[("d",)].chunks] == [((0, 0), (3, 2)), ((3, 0), (1, 2))]
    gap = [_box_shard(((0, 0), (1, 2))), _box_shard(((2, 0), (2, 2)))]
    with pytest.raises(ShardingError, match="do not tile"):
        merge(gap, cache=MergeCache())


def test_counts_of_a_dtensor_name_the_chunk_of_the_rank_that_stored_it():
    """Rank 1 holds a replica of rank 0's box and stores nothing; rank 2's box (chunk 1, not 2) holds an Inf
    and a NaN: the merge lists chunk 1 only, and each rank's largest finite magnitude (rank 1's: none)."""

    def box(b, writes, fill):
        t = torch.full(b[1], fill)
        if fill == 3.0:
            t[0, 0], t[1, 1] = float("inf"), float("nan")
        item = SaveItem(("d",), t, Boxes(), writes, DTensorBox(b, (4, 2)))
        return LocalShard({(): ()}, (item,), {})

    m = merge([box(((0, 0), (2, 2)), True, -2.0), box(((0, 0), (2, 2)), False, -2.0), box(((2, 0), (2, 2)), True, 3.0)])
    d = m.leaves[("d",)]
    assert d.table.columns().ranks.tolist() == [0, 2]
    assert (d.stats.chunks.tolist(), d.stats.nan.tolist(), d.stats.inf.tolist()) == ([1], [1], [1])
    assert [(b.key, b.nan, b.inf, b.ranks) for b in m.non_finite()] == [(("d",), 1, 1, (2,))]
    assert m.largest.values.tolist() == [2.0, 0.0, 3.0] and m.largest.leaves.tolist() == [0, -1, 0]


def test_a_leaf_some_rank_did_not_count_is_uncounted_not_finite():
    """A vote that stored a floating leaf without counts (no tddist writer does) makes the merged leaf
    uncounted (``stats`` None: of unknown finiteness), never finite."""
    shards = three_ranks()
    votes = [vote(r, s) for r, s in enumerate(shards)]
    plain = WriterBase(SaveOptions("/t", "directory", {}, True, 0, False, True, False, False), 1, shards[1])
    plain.make_plan()
    stored = {
        i.key: StoredBytes(i.tensor.numel() * 4, checksum_bytes(tensor_bytes(i.tensor)))
        for i in shards[1].items
        if i.writes
    }
    frags = [votes[0][1], plain.fragment(stored), votes[2][1]]
    assert frags[1].uncounted and not frags[0].uncounted
    m = merge_fragments(
        frags, votes[0][0].structure, metadata={}, robust_key=True, version="test", container="directory",
        packing="packed",
    )  # fmt: skip
    assert m.leaves[("b", "x")].stats is None and m.uncounted() == [("b", "x")]
    assert not m.non_finite()


def test_a_failed_save_does_not_feed_the_next_merge():
    """What rank 0 merged for a save that never committed is not reused by the next save."""
    cache = MergeCache()
    halves = [_box_shard(((0, 0), (2, 2))), _box_shard(((2, 0), (2, 2)))]
    votes = [vote(r, s) for r, s in enumerate(halves)]
    merge_fragments([f for _p, f in votes], votes[0][0].structure, metadata={}, robust_key=True, version="t",
                    container="directory", packing="packed", cache=cache)  # fmt: skip
    assert cache.pending is not None and cache.world == 0  # merged, not committed
    merge(halves, cache=cache)
    assert (cache.full_merges, cache.cached_merges) == (2, 0)


def test_cached_path_switches_back_on_any_change():
    """Keys, shapes or world size that change take the full path again; other rows do not."""
    cache = MergeCache()
    merge(three_ranks(), cache=cache)
    merge(three_ranks(), cache=cache)
    assert (cache.full_merges, cache.cached_merges) == (1, 1)
    merge(three_ranks((1, 1, 1)), cache=cache)  # other rows, same structure
    assert cache.cached_merges == 2
    merge([shard_of(r, {"b": TensorDict(x=torch.zeros(2, 5), batch_size=[2])}) for r in range(3)], cache=cache)
    assert cache.full_merges == 2
    merge(three_ranks()[:2], cache=cache)  # another world size
    assert cache.full_merges == 3


def test_fragment_is_16_bytes_per_leaf():
    """A rank's vote carries 16 bytes per sharded leaf (its rows and checksum) plus a constant: the counts of a
    clean floating state add nothing per leaf (NaN and Inf counts only for the chunks that hold any, one
    largest finite magnitude per rank)."""
    n = 1000
    shard = shard_of(1, TensorDict({f"leaf{i:04d}": torch.zeros(8, 4) for i in range(n)}, [8]))
    plan, frag = vote(1, shard)
    size = len(pickle.dumps(frag, protocol=pickle.HIGHEST_PROTOCOL))
    assert size <= 16 * n + 1024, size
    assert frag.non_finite == frag.uncounted == b"" and (frag.largest, frag.largest_leaf) == (0.0, -1)
    assert plan.structure is None  # only rank 0's plan carries its structure


# --- structures that differ between ranks -------------------------------------------------------


def _difference(data0, data1, placements0=None, placements1=None) -> str:
    s0 = vote(0, shard_of(0, data0, placements0))[0].structure
    w1 = WriterBase(OPTIONS, 1, shard_of(1, data1, placements1))
    w1.make_plan()
    assert w1.structure.digest != s0.digest
    return str(describe_difference(w1.structure, 1, s0))


@pytest.mark.parametrize(
    "other, why",
    [
        ({"x": torch.zeros(2, 4), "y": torch.zeros(2)}, "different keys"),
        ({"y": torch.zeros(2, 4)}, "different keys"),
        ({"x": torch.zeros(2, 4, dtype=torch.float64)}, "different dtype"),
        ({"x": torch.zeros(2, 5)}, "differ in other dims"),
        ({"x": torch.zeros(2, 4, 1)}, "same number of dims"),
    ],
)
def test_structure_differences_are_named(other, why):
    """A rank whose structure differs from rank 0's says what differs, naming the key and both ranks."""
    text = _difference(TensorDict(x=torch.zeros(2, 4), batch_size=[2]), TensorDict(other, batch_size=[2]))
    assert why in text and "rank 1" in text, text


def test_replicated_shape_placement_and_batch_differences_are_named():
    assert "replicated leaf 'w' has different shapes" in _difference({"w": torch.zeros(5)}, {"w": torch.zeros(6)})
    td = TensorDict(x=torch.zeros(2, 4), batch_size=[2])
    assert "different placement" in _difference(td, td, None, {"x": Replicate()})
    wide = _difference(
        TensorDict(x=torch.zeros(2, 3), batch_size=[2, 3]), TensorDict(x=torch.zeros(2, 4), batch_size=[2, 4])
    )
    assert "beyond dim 0" in wide


# --- version 1 manifests (read forever) ----------------------------------------------------------


def good_json() -> dict:
    """A valid version-1 manifest: three ranks with rows 3, 0, 2, a nested node, replicated leaves."""
    return {
        "format": "tddist",
        "version": 1,
        "tddist_version": "0.1.0",
        "created": "2026-01-01T00:00:00+00:00",
        "world_size": 3,
        "layout": "directory",
        "robust_key": True,
        "checksum": {"algorithm": fmt.CHECKSUM_ALGORITHM, "block_size": fmt.CHECKSUM_BLOCK},
        "metadata": {"step": 7, "tags": ["a", "b"], "nested": {"lr": 0.5}},
        "nodes": [
            {"key": [], "batch_size": [5], "rows": [3, 0, 2]},
            {"key": ["sub"], "batch_size": [5, 2], "rows": [3, 0, 2]},
        ],
        "leaves": [
            {"key": ["x"], "dtype": "float32", "shape": [5, 4], "placement": {"type": "shard", "dim": 0},
             "chunks": [[0, 0, 3, 48, CS], [1, 3, 0, 0, CS], [2, 3, 2, 32, CS]]},
            {"key": ["sub", "y"], "dtype": "int16", "shape": [5, 2], "placement": {"type": "shard", "dim": 0},
             "chunks": [[0, 0, 3, 12, CS], [1, 3, 0, 0, CS], [2, 3, 2, 8, CS]]},
            {"key": ["w"], "dtype": "int64", "shape": [5], "placement": {"type": "replicate"}, "chunks": [[0, 40, CS]]},
            {"key": ["s"], "dtype": "bool", "shape": [], "placement": {"type": "replicate"}, "chunks": [[0, 1, CS]]},
        ],
        "objects": [],
    }  # fmt: skip


def test_v1_parses_and_reencodes_as_v2():
    """A version-1 manifest parses into the same model a version-2 one gives, and re-encodes as version 2."""
    m = parse_manifest(good_json())
    assert isinstance(m, Manifest) and m.version == 1 and m.packing == "memmap"
    assert set(m.leaves) == {("x",), ("sub", "y"), ("w",), ("s",)}
    assert m.nodes == {(): (5,), ("sub",): (5, 2)}
    assert m.leaves[("s",)].shape == () and m.leaves[("s",)].chunks[0].nbytes == 1
    assert [c.box for c in m.leaves[("x",)].chunks] == [((0, 0), (3, 4)), ((3, 0), (0, 4)), ((3, 0), (2, 4))]
    files = encode(m)
    again = parse_manifest(fmt.loads(files.manifest), index=files.index)
    assert again.version == 4 and set(again.leaves) == set(m.leaves)
    for k in m.leaves:
        assert again.leaves[k].chunks == m.leaves[k].chunks


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
    "chunks out of rank order": (
        _chunks(("x",), [[0, 2, 3, 48, CS], [1, 5, 0, 0, CS], [2, 0, 2, 32, CS]]),
        "not in rank order",
    ),
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
