"""Collective save/load scenarios, run by every rank of a job.

Each scenario ``fn(comm, workdir, rank, size)`` builds this rank's data
deterministically from ``(rank, size)``, saves it collectively into a fresh
subdirectory of ``workdir`` (the same path on every rank), loads it back three
ways and checks the result. ``comm`` is passed to tddist as ``comm=``; ``None``
lets tddist detect the communicator (torchrun, mpiexec).

The ranks agree on the outcome of their checks (``checked_together``) before
any of them moves on, so a failed check on one rank never leaves the ranks in
different collectives, and no rank starts the next save to a directory
another rank is still checking.

As a rank program: ``python tests/scenarios.py <workdir>`` (under torchrun or
mpiexec) runs every scenario in sequence and writes this rank's report.
"""

from __future__ import annotations

import math
import os
import sys
import time
import traceback
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

if __name__ == "__main__":  # run as a script: make ``tests.launch_util`` importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch
from tensordict import TensorDict, TensorDictBase

import tddist
from tddist.comm.base import LocalComm
from tddist.comm.resolve import resolve
from tddist.comm.threads import ThreadComm
from tddist.core.sharding import replica_writers
from tests.helpers import assert_td_equal, leftovers

Key = tuple
SKIPPED = "skipped"

# --- helpers -------------------------------------------------------------------------


def _key(k) -> Key:
    return (k,) if isinstance(k, str) else tuple(k)


def tree_leaves(data, prefix: Key = ()) -> dict[Key, torch.Tensor]:
    """Every tensor of a TensorDict or nested dict, by tuple key, in insertion order."""
    out = {}
    for name, value in data.items():
        key = prefix + (name,)
        if isinstance(value, (TensorDictBase, Mapping)):
            out.update(tree_leaves(value, key))
        else:
            out[key] = value
    return out


def tree_nodes(data, prefix: Key = ()) -> dict[Key, tuple[int, ...]]:
    """The batch size of every (sub-)TensorDict (a plain dict counts as batch size ())."""
    out = {prefix: tuple(data.batch_size) if isinstance(data, TensorDictBase) else ()}
    for name, value in data.items():
        if isinstance(value, (TensorDictBase, Mapping)):
            out.update(tree_nodes(value, prefix + (name,)))
    return out


def leaf_dims(data, placements: Mapping | None = None) -> dict[Key, int | None]:
    """Each leaf's expected sharded dim (None: replicated): the override, else 0 under batch dims."""
    nodes = tree_nodes(data)
    over = {_key(k): v for k, v in (placements or {}).items()}
    out = {}
    for key in tree_leaves(data):
        p = over.get(key)
        if p is None:
            out[key] = 0 if nodes[key[:-1]] else None
        else:
            out[key] = p.dim if isinstance(p, tddist.Shard) else None
    return out


def global_leaves(locals_: list, dims: dict[Key, int | None]) -> dict[Key, torch.Tensor]:
    """The expected global tensors: every rank's pieces concatenated in rank order; replicas whole."""
    per_rank = [tree_leaves(d) for d in locals_]
    out = {}
    for key, dim in dims.items():
        out[key] = per_rank[0][key] if dim is None else torch.cat([p[key] for p in per_rank], dim=dim)
    return out


def global_nodes(locals_: list) -> dict[Key, tuple[int, ...]]:
    per_rank = [tree_nodes(d) for d in locals_]
    out = {}
    for key, batch in per_rank[0].items():
        out[key] = (sum(p[key][0] for p in per_rank), *batch[1:]) if batch else ()
    return out


def even_part(t: torch.Tensor, dim: int | None, rank: int, size: int) -> torch.Tensor:
    return t if dim is None else torch.tensor_split(t, size, dim=dim)[rank]


def even_rows(n: int, rank: int, size: int) -> int:
    return torch.tensor_split(torch.arange(n), size)[rank].numel()


def as_td(leaves: dict[Key, torch.Tensor], nodes: dict[Key, tuple[int, ...]], batch: bool = True) -> TensorDict:
    """The TensorDict with these (sub-)TensorDicts and leaves; every batch size () unless ``batch``."""
    out = TensorDict({}, batch_size=nodes[()] if batch else [])
    for key in sorted(nodes, key=len):  # parents first
        if key:
            out.set(key, TensorDict({}, batch_size=nodes[key] if batch else []))
    for key, t in leaves.items():
        out.set(key, t)
    return out


_PEERS: dict[int, Any] = {}


def peers(comm) -> Any:
    """A tddist communicator over the same ranks as ``comm`` (None: the detected one), for test checks."""
    if isinstance(comm, (LocalComm, ThreadComm)):
        return comm
    if id(comm) not in _PEERS:
        _PEERS[id(comm)] = resolve(comm)
    return _PEERS[id(comm)]


def assert_only_tddist_files(target: Path, size: int) -> None:
    """The checkpoint holds only its manifest, its index and one data file per rank, every file really inside it."""
    top = sorted(os.listdir(target))
    assert top == sorted(["tddist.json", "tddist.idx", *(f"rank-{r:05d}.data" for r in range(size))]), top
    real = os.path.realpath(target)
    for dirpath, _dirs, files in os.walk(target):
        for f in files:
            assert os.path.realpath(os.path.join(dirpath, f)).startswith(real + os.sep), (dirpath, f)


def checked_together(comm, rank: int, check: Callable[[], None]) -> None:
    """Run this rank's checks, then agree on the outcome: every rank raises if any rank's checks failed.

    Keeps the ranks in step: no rank goes on to the next collective (or the
    next save to the same target) before every rank has finished checking.
    """
    try:
        check()
        error = None
    except Exception as e:
        error = e
    everyone = peers(comm).allgather(None if error is None else f"{type(error).__name__}: {error}"[:3000])
    if error is not None:
        raise error
    failed = {r: m for r, m in enumerate(everyone) if m is not None}
    if failed:
        raise AssertionError(f"rank {rank}: checks failed on other ranks: {failed}")


def roundtrip(
    comm,
    target: Path,
    make: Callable[[int, int], Any],
    rank: int,
    size: int,
    *,
    placements: Mapping | None = None,
    check_batch: bool = True,
    **save_kw,
):
    """Save ``make(rank, size)`` collectively to ``target``, load it back three ways, check everything.

    Returns (local data, what save returned, saved, even, full) for extra checks.
    """
    local = make(rank, size)
    returned = tddist.save(local, target, comm=comm, placements=placements, **save_kw)
    saved = tddist.load(target, shard="saved", comm=comm)
    even = tddist.load(target, shard="even", comm=comm)
    out = {}

    def check() -> None:  # local only: no collective in here
        full = out["full"] = tddist.load(target, shard=None, verify=True)
        manifest = tddist.read_manifest(target)
        locals_ = [make(r, size) for r in range(size)]
        dims = leaf_dims(local, placements)
        glob = global_leaves(locals_, dims)
        nodes = tree_nodes(local)
        gnodes = global_nodes(locals_)
        enodes = {k: ((even_rows(b[0], rank, size), *b[1:]) if b else ()) for k, b in gnodes.items()}
        mine = as_td(tree_leaves(local), nodes, check_batch)
        evens = as_td({k: even_part(g, dims[k], rank, size) for k, g in glob.items()}, enodes, check_batch)
        expect = [
            (returned, mine, "save() return value"),
            (saved, mine, "load(shard='saved')"),
            (even, evens, "load(shard='even')"),
            (full, as_td(glob, gnodes, check_batch), "load(shard=None)"),
        ]
        for got, want, what in expect:
            assert_td_equal(got, want, f"rank {rank}: {what}", batch_sizes=check_batch)
        assert manifest.world_size == size, manifest.world_size
        for key, dim in dims.items():
            placement = manifest.leaves[key].placement
            assert placement == (tddist.Replicate() if dim is None else tddist.Shard(dim)), (key, placement)
        assert_only_tddist_files(target, size)
        assert leftovers(target, strict=True) == [], leftovers(target, strict=True)
        # loaded tensors are mapped copy-on-write: writing into them leaves the checkpoint as it was
        for t in tree_leaves(saved).values():
            t.copy_(torch.ones_like(t).logical_not().to(t.dtype))
        assert_td_equal(
            tddist.load(target, shard=None, verify=True),
            as_td(glob, gnodes, check_batch),
            f"rank {rank}: reload after writing into a loaded shard",
            batch_sizes=check_batch,
        )

    checked_together(comm, rank, check)
    return local, returned, saved, even, out["full"]


def _arange(n: int, *shape: int, dtype=torch.float32, start: int = 0) -> torch.Tensor:
    """``n`` rows of consecutive values from ``start``, of shape ``(n, *shape)``."""
    return (torch.arange(n * math.prod(shape)) + start).to(dtype).reshape(n, *shape)


def _raise_collectively(comm, fn: Callable[[], Any]) -> tuple[BaseException | None, list]:
    """Run ``fn`` (a save expected to fail), then allgather what each rank raised."""
    try:
        fn()
        error = None
    except Exception as e:  # checked below, on every rank
        error = e
    seen = (type(error).__name__, str(error), sorted(getattr(error, "failures", {}).items())) if error else None
    return error, peers(comm).allgather(seen)


def _assert_same_sharding_error(error, everyone: list, rank: int, size: int) -> None:
    assert isinstance(error, tddist.ShardingError), f"rank {rank} raised {error!r}, expected ShardingError"
    assert all(s is not None for s in everyone), f"some ranks did not raise: {everyone}"
    assert all(s == everyone[0] for s in everyone), f"ranks raised different errors: {everyone}"
    assert everyone[0][0] == "ShardingError", everyone[0]


# --- scenarios -----------------------------------------------------------------------


def nested_keys(comm, workdir: Path, rank: int, size: int) -> None:
    """Two levels of sub-TensorDicts with batch dims."""

    def make(r, s):
        n = r + 2
        return TensorDict(
            obs=_arange(n, 3, start=100 * r),
            player=TensorDict(
                pos=_arange(n, 2, 2, start=1000 * r),
                inner=TensorDict(
                    id=torch.full((n, 4), r, dtype=torch.int64),
                    flag=(torch.arange(n * 4) % (r + 2) == 0).reshape(n, 4),
                    batch_size=[n, 4],
                ),
                batch_size=[n],
            ),
            batch_size=[n],
        )

    roundtrip(comm, workdir / "nested_keys" / "ckpt", make, rank, size)


def dtypes(comm, workdir: Path, rank: int, size: int) -> None:
    """Every common dtype, sharded and replicated, with values that use the dtype's range."""

    def make(r, s):
        n = 2 * r + 1
        base = torch.arange(n * 3).reshape(n, 3) + 7 * r
        cols = {
            "bf16": (base.to(torch.float32) / 3 - 2).to(torch.bfloat16),
            "f16": (base.to(torch.float32) / 7 - 1).to(torch.float16),
            "f32": base.to(torch.float32) / 11 - 0.5,
            "f64": base.to(torch.float64) / 13 + 1e-300,
            "i8": (base % 256 - 128).to(torch.int8),
            "i32": (base * -70001).to(torch.int32),
            "i64": base.to(torch.int64) * (1 << 40) - (1 << 62),
            "u8": (base * 37 % 256).to(torch.uint8),
            "b": base % 3 == 0,
        }
        rep = torch.arange(4)
        rep = {
            "bf16": rep.to(torch.bfloat16) / 3,
            "i8": rep.to(torch.int8) - 3,
            "b": rep > 1,
            "u8": rep.to(torch.uint8) + 250,
        }
        return TensorDict(rows=TensorDict(cols, batch_size=[n]), rep=TensorDict(rep, batch_size=[]), batch_size=[])

    roundtrip(comm, workdir / "dtypes" / "ckpt", make, rank, size)


def non_contiguous(comm, workdir: Path, rank: int, size: int) -> None:
    """Transposed views, step slices, expanded and offset views are saved by value."""

    def make(r, s):
        n = r + 3
        wide = _arange(4 * n, 6, start=50 * r)
        t = _arange(5, n, start=-10 * r).t()  # (n, 5) transposed view
        step = wide[::4]  # (n, 6) every 4th row
        cols = wide[:n, ::2]  # (n, 3) every other column
        expanded = torch.arange(n).unsqueeze(1).expand(n, 4)  # stride 0
        offset = wide[1 : n + 1, 2:5]
        for v in (t, step, cols, expanded, offset):
            assert not v.is_contiguous()
        return TensorDict(t=t, step=step, cols=cols, expanded=expanded, offset=offset, batch_size=[n])

    roundtrip(comm, workdir / "non_contiguous" / "ckpt", make, rank, size)


def uneven_with_empty_rank(comm, workdir: Path, rank: int, size: int) -> None:
    """Uneven rows; rank 1 (or the only rank) has zero rows; a node with fewer global rows than ranks."""

    def make(r, s):
        n = 0 if r == min(1, s - 1) else 3 * r + 1
        few = 1 if r == s - 1 else 0  # one global row: "even" gives it to rank 0, nothing to the others
        return TensorDict(
            rows=TensorDict(
                x=_arange(n, 2, start=10 * r),
                y=torch.arange(n, dtype=torch.int32) - r,
                zero_width=torch.zeros(n, 0, dtype=torch.float64),
                sub=TensorDict(z=torch.ones(n, 2, 3, dtype=torch.float16) * r, batch_size=[n, 2]),
                batch_size=[n],
            ),
            few=TensorDict(v=torch.full((few, 2), 5.0 + r), batch_size=[few]),
            batch_size=[],
        )

    roundtrip(comm, workdir / "uneven_with_empty_rank" / "ckpt", make, rank, size)


def empty_tensordict(comm, workdir: Path, rank: int, size: int) -> None:
    """A TensorDict without leaves (batch size [] so that nothing is sharded)."""

    def make(r, s):
        return TensorDict({}, batch_size=[])

    roundtrip(comm, workdir / "empty_tensordict" / "ckpt", make, rank, size)


def empty_tensordict_with_rows(comm, workdir: Path, rank: int, size: int) -> None:
    """A TensorDict without leaves whose batch dim differs per rank: the saved batch size comes back."""

    def make(r, s):
        return TensorDict({}, batch_size=[r + 1])

    roundtrip(comm, workdir / "empty_tensordict_with_rows" / "ckpt", make, rank, size)


ESCAPED = ["a/b", "..", ".", "sp ace", "ünï", "nul\x00x", "%2E", "pct%", '<>:|?*\\"', "tab\tnl\n"]


def escaped_keys(comm, workdir: Path, rank: int, size: int) -> None:
    """Keys that are unsafe or special as file names, as leaves and as sub-TensorDicts."""

    def make(r, s):
        n = r + 1
        leaves = {k: torch.full((n, 2), i + 10 * r, dtype=torch.int16) for i, k in enumerate(ESCAPED) if k != ".."}

        def sub(j):
            return TensorDict(
                {k: torch.full((n,), -i - r - j, dtype=torch.float32) for i, k in enumerate(ESCAPED)}, batch_size=[n]
            )

        # ".." is a sub-TensorDict (a directory), "a/b " another one
        return TensorDict({**leaves, "..": sub(100), "a/b ": sub(200)}, batch_size=[n])

    roundtrip(comm, workdir / "escaped_keys" / "ckpt", make, rank, size)


def replicated_no_batch(comm, workdir: Path, rank: int, size: int) -> None:
    """batch_size [] holding only replicated leaves (scalars too), with check_replicas=True."""

    def make(r, s):
        return TensorDict(
            step=torch.tensor(1234, dtype=torch.int64),
            lr=torch.tensor(3e-4, dtype=torch.float64),
            w=torch.linspace(-1, 1, 12).reshape(3, 4),
            mask=torch.tensor([True, False, True]),
            opt=TensorDict(m=torch.arange(5, dtype=torch.bfloat16), empty=torch.zeros(0, 3), batch_size=[]),
            batch_size=[],
        )

    roundtrip(comm, workdir / "replicated_no_batch" / "ckpt", make, rank, size, check_replicas=True)
    m = tddist.read_manifest(workdir / "replicated_no_batch" / "ckpt")
    # Each leaf is written once, by the rank it is given to (the largest first, to the rank given the fewest
    # bytes so far): w (48 bytes) to rank 0, opt/m (10) to rank 1, step and lr (8) to ranks 2 and 3 (or back to
    # the lightest rank of fewer), and so on; so every rank of at most 4 writes some of a replicated state.
    sizes = {key: leaf.chunks[0].nbytes for key, leaf in m.leaves.items()}
    writers = {key: [c.rank for c in leaf.chunks] for key, leaf in m.leaves.items()}
    assert writers == {key: [w] for key, w in replica_writers(sizes, size).items()}, writers
    assert writers[("w",)] == [0] and {w for [w] in writers.values()} == set(range(min(size, 4))), writers


def differing_replicas_fail(comm, workdir: Path, rank: int, size: int) -> None:
    """Replicas that differ on some ranks: every rank raises the same ShardingError, nothing is created."""
    target = workdir / "differing_replicas_fail" / "ckpt"
    bad = list(range(1, size, 2))  # odd ranks hold other values

    def make(r):
        w = torch.arange(6, dtype=torch.float32) + (0.5 if r in bad else 0)
        return TensorDict(w=w, same=torch.ones(2), batch_size=[])

    error, everyone = _raise_collectively(comm, lambda: tddist.save(make(rank), target, comm=comm, check_replicas=True))
    exists = target.exists()
    if not bad:  # a single rank has nothing to disagree with
        assert error is None, error
        assert exists
        return
    _assert_same_sharding_error(error, everyone, rank, size)
    assert "'w'" in str(error) and f"{bad[:16]}" in str(error), str(error)
    assert not exists, "a failed save created the target"
    assert leftovers(target, strict=True) == [], leftovers(target, strict=True)


def placements_override(comm, workdir: Path, rank: int, size: int) -> None:
    """Shard(1) on one leaf and Replicate() on another, both under batch dims, next to a default Shard(0) leaf."""

    def make(r, s):
        n = 2  # same number of rows on every rank: the replicated and Shard(1) leaves need equal dim 0
        return TensorDict(
            x=_arange(n, 3, start=10 * r),
            w=_arange(n, r + 1, dtype=torch.float64, start=-100 * r),  # Shard(1): uneven along dim 1
            rep=torch.arange(n * 4, dtype=torch.int64).reshape(n, 4),  # Replicate(): identical everywhere
            batch_size=[n],
        )

    placements = {"w": tddist.Shard(1), "rep": tddist.Replicate()}
    roundtrip(
        comm,
        workdir / "placements_override" / "ckpt",
        make,
        rank,
        size,
        placements=placements,
        check_batch=False,
        check_replicas=True,
    )


def node_sharded_on_other_dim(comm, workdir: Path, rank: int, size: int) -> None:
    """A sub-TensorDict with batch dims whose only leaf is sharded along dim 2 (placements=Shard(2))."""

    def make(r, s):
        n = 2
        return TensorDict(
            x=_arange(n, 3, start=10 * r),
            sub=TensorDict(v=torch.full((n, 3, r + 2), float(r)), batch_size=[n, 3]),
            batch_size=[n],
        )

    roundtrip(
        comm,
        workdir / "node_sharded_on_other_dim" / "ckpt",
        make,
        rank,
        size,
        placements={("sub", "v"): tddist.Shard(2)},
        check_batch=False,
    )


def structure_mismatch_fails(comm, workdir: Path, rank: int, size: int) -> None:
    """The last rank has an extra key: every rank raises the same ShardingError naming the ranks."""
    target = workdir / "structure_mismatch_fails" / "ckpt"
    last = size - 1
    td = TensorDict(x=torch.zeros(2, 3) + rank, batch_size=[2])
    if rank == last and size > 1:
        td["extra"] = torch.ones(2)
    error, everyone = _raise_collectively(comm, lambda: tddist.save(td, target, comm=comm))
    exists = target.exists()
    if size == 1:
        assert error is None and exists, error
        return
    _assert_same_sharding_error(error, everyone, rank, size)
    msg = str(error)
    assert "rank 0" in msg and f"rank {last}" in msg and "'extra'" in msg, msg
    assert not exists, "a failed save created the target"
    assert leftovers(target, strict=True) == [], leftovers(target, strict=True)


def overwrite_twice(comm, workdir: Path, rank: int, size: int) -> None:
    """Three saves to one target: the last wins, nothing is left beside it, earlier results stay readable."""
    target = workdir / "overwrite_twice" / "ckpt"

    def v1(r, s):
        return TensorDict(x=torch.full((r + 1, 2), 1.0 + r), old=torch.zeros(r + 1), batch_size=[r + 1])

    def v2(r, s):
        return TensorDict(x=torch.full((2, 5), 2.0 + r), batch_size=[2])

    def v3(r, s):
        return TensorDict(
            y=torch.arange(3 * r, 4 * r + 1),
            z=TensorDict(q=torch.ones(r + 1, 1, dtype=torch.bool), batch_size=[r + 1]),
            batch_size=[r + 1],
        )

    # each roundtrip checks, before any rank goes on, that nothing but the target is left in its parent
    _, first, *_ = roundtrip(comm, target, v1, rank, size)
    roundtrip(comm, target, v2, rank, size)
    roundtrip(comm, target, v3, rank, size)
    assert sorted(os.listdir(target.parent)) == ["ckpt"]
    # what the first save returned is mapped from files since replaced: it must still hold v1
    assert_td_equal(first, v1(rank, size), f"rank {rank}: first save() result after two overwrites")
    assert sorted(k for k in tddist.read_manifest(target).leaves) == [("y",), ("z", "q")]


def plain_nested_dict(comm, workdir: Path, rank: int, size: int) -> None:
    """A plain nested dict of tensors: replicated by default, sharded where placements= says so."""

    def make(r, s):
        return {
            "step": torch.tensor(7),
            "model": {"w": torch.arange(6.0).reshape(2, 3), "b": torch.zeros(3, dtype=torch.float16)},
            "buffer": {"rows": torch.arange(2 * (r + 1), dtype=torch.int32).reshape(r + 1, 2) + 100 * r},
        }

    placements = {("buffer", "rows"): tddist.Shard(0)}
    _, returned, saved, even, full = roundtrip(
        comm, workdir / "plain_nested_dict" / "ckpt", make, rank, size, placements=placements, check_batch=False
    )
    for td in (returned, saved, even, full):
        assert all(b == () for b in tree_nodes(td).values()), tree_nodes(td)


def with_metadata(comm, workdir: Path, rank: int, size: int) -> None:
    """metadata= is stored in the manifest as given."""
    target = workdir / "with_metadata" / "ckpt"
    meta = {"step": 100, "name": "run-ünï", "nested": {"lr": 0.25, "tags": ["a", "b"], "none": None}, "ok": True}

    def make(r, s):
        return TensorDict(x=torch.arange(r + 1), batch_size=[r + 1])

    roundtrip(comm, target, make, rank, size, metadata=meta)
    m = tddist.read_manifest(target)
    assert m.metadata == meta, m.metadata


#: Scenarios that fail because of a known library bug, with the reason; the tests expect them to fail
#: (strictly: once the bug is fixed, remove its entry).
KNOWN_BUGS: dict[str, str] = {}

SCENARIOS: list[Callable] = [
    nested_keys,
    dtypes,
    non_contiguous,
    uneven_with_empty_rank,
    empty_tensordict,
    empty_tensordict_with_rows,
    escaped_keys,
    replicated_no_batch,
    differing_replicas_fail,
    placements_override,
    node_sharded_on_other_dim,
    structure_mismatch_fails,
    overwrite_twice,
    plain_nested_dict,
    with_metadata,
]

# --- scenarios that need a real launch -------------------------------------------------


def _explicit(comm_obj, workdir: Path, name: str, rank: int, size: int) -> None:
    def make(r, s):
        return TensorDict(
            rows=TensorDict(x=_arange(r + 2, 3, start=r), batch_size=[r + 2]), rep=torch.arange(4), batch_size=[]
        )

    roundtrip(comm_obj, workdir / name / "ckpt", make, rank, size, check_replicas=True)


def explicit_mpi4py_comm(comm, workdir: Path, rank: int, size: int):
    """comm=MPI.COMM_WORLD (an mpi4py communicator), only in an MPI launch."""
    if comm is not None or type(peers(None)).__name__ != "MPIComm":
        return SKIPPED
    from mpi4py import MPI

    _explicit(MPI.COMM_WORLD, workdir, "explicit_mpi4py_comm", rank, size)


def explicit_torch_group(comm, workdir: Path, rank: int, size: int):
    """comm=dist.group.WORLD (a torch ProcessGroup), only when torch.distributed is initialised."""
    import torch.distributed as dist

    if comm is not None or not (dist.is_available() and dist.is_initialized()):
        return SKIPPED
    _explicit(dist.group.WORLD, workdir, "explicit_torch_group", rank, size)


LAUNCH_SCENARIOS: list[Callable] = [explicit_mpi4py_comm, explicit_torch_group]


# --- rank program ----------------------------------------------------------------------


def _launch_rank_size() -> tuple[int, int]:
    """This process's rank and the world size, as the launcher set them (torchrun, or MPICH's hydra)."""
    for rank_var, size_var in (("RANK", "WORLD_SIZE"), ("PMI_RANK", "PMI_SIZE")):
        if rank_var in os.environ and size_var in os.environ:
            return int(os.environ[rank_var]), int(os.environ[size_var])
    return 0, 1


def _backends() -> dict[str, bool]:
    import torch.distributed as dist

    return {
        "torch_initialised": dist.is_available() and dist.is_initialized(),
        "mpi_imported": "mpi4py.MPI" in sys.modules,
    }


def main(workdir: Path) -> int:
    """Run every scenario with comm=None, so that the first save detects (and sets up) the communicator."""
    from tests.launch_util import write_report

    rank, size = _launch_rank_size()
    before = _backends()  # nothing is set up yet: the first tddist.save does it
    results: dict[str, str] = {}
    failures: dict[str, str] = {}
    seconds: dict[str, float] = {}
    for fn in SCENARIOS + LAUNCH_SCENARIOS:
        start = time.monotonic()
        try:
            outcome = fn(None, workdir, rank, size)
            results[fn.__name__] = SKIPPED if outcome == SKIPPED else "ok"
        except Exception:
            results[fn.__name__] = "failed"
            failures[fn.__name__] = traceback.format_exc()
        peers(None).barrier()  # the next scenario starts together on every rank
        seconds[fn.__name__] = round(time.monotonic() - start, 3)
    detected = resolve(None)  # what save/load with comm=None used
    everyone = detected.allgather(results)
    unexpected = sorted(set(failures) - set(KNOWN_BUGS))
    write_report(
        rank,
        "failed" if unexpected else "ok",
        comm=type(detected).__name__,
        detected_rank=detected.rank,
        detected_size=detected.size,
        before=before,
        after=_backends(),
        scenarios=results,
        failures=failures,
        seconds=seconds,
        agree=all(r == everyone[0] for r in everyone),
    )
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
    return 1 if unexpected else 0


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit(f"usage: {sys.argv[0]} WORKDIR")
    sys.exit(main(Path(sys.argv[1])))
