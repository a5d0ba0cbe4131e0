"""Incremental checkpoints: a chunk equal to the base's is referenced, not written (docs/format.md 5.10).

Real saves on real files, ranks as threads (``tddist.run_threads``): what an
incremental save writes (holes where its chunks are referenced), what its
manifest records (holders, never a chain), loads of every kind through the
references, and the bases that hold no references (written in full).
"""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
import torch
from tensordict import TensorDict

import tddist
from tddist import format as fmt
from tddist.errors import CorruptCheckpointError, ManifestError
from tddist.manifest.parse import parse_manifest
from tddist.tools.verify import verify


def shard(rank: int, step: int) -> TensorDict:
    """A LoRA-like shard: a large frozen base (sharded rows and a replicated matrix), small adapters that change
    with ``step``."""
    g = torch.Generator().manual_seed(rank)
    return TensorDict(
        {
            "base": TensorDict({"w": torch.randn(64, 256, generator=g)}, [64]),
            "frozen": torch.arange(4096, dtype=torch.float32).reshape(64, 64),
            "adapter": torch.full((8, 8), float(step)),
            "step": torch.tensor(step),
        },
        [],
    )


def save_all(path: str, step: int, size: int = 2, **kwargs: object) -> list[object]:
    results = tddist.run_threads(size, lambda c: tddist.save(shard(c.rank, step), path, comm=c, **kwargs), timeout=60)
    for r in results:
        if isinstance(r, BaseException):
            raise r
    return results


def load_all(path: str, size: int, **kwargs: object) -> list[TensorDict]:
    results = tddist.run_threads(size, lambda c: tddist.load(path, comm=c, **kwargs), timeout=60)
    for r in results:
        if isinstance(r, BaseException):
            raise r
    return results


def expected(step: int, size: int = 2) -> TensorDict:
    """The global state the ``size`` ranks saved at ``step``."""
    parts = [shard(r, step) for r in range(size)]
    out = parts[0].clone()
    out["base"] = torch.cat([p["base"] for p in parts])
    return out


def allocated(path: str) -> int:
    """Bytes of disk a checkpoint's data files take (holes take none)."""
    return sum(os.stat(os.path.join(path, n)).st_blocks * 512 for n in os.listdir(path) if n.endswith(".data"))


def test_unchanged_chunks_are_referenced_and_loads_follow_them(tmp_path):
    s1, s2, s3 = (str(tmp_path / f"step{i}") for i in (1, 2, 3))
    save_all(s1, 1)
    save_all(s2, 2, base=s1)
    m2 = tddist.read_manifest(s2)
    assert m2.holders == (tddist.read_manifest(s1).holders or ()) + m2.holders  # the base: no holders of its own
    assert [h.name for h in m2.referenced()] == ["step1"]
    held = {k: leaf.refs.holders.tolist() for k, leaf in m2.leaves.items()}
    assert held[("base", "w")] == [1, 1] and held[("frozen",)] == [1]
    assert held[("adapter",)] == [0] and held[("step",)] == [0]
    assert allocated(s2) < allocated(s1) // 10
    for size in (2, 3, 1):  # the saving world size, and resharded
        for got in load_all(s2, size, shard=None):
            assert (got == expected(2)).all()
    got = tddist.load(s2, verify=True)
    assert (got == expected(2)).all()
    # the next save references the holder of each chunk, never the checkpoint that references it
    save_all(s3, 3, base=s2)
    m3 = tddist.read_manifest(s3)
    names = [h.name for h in m3.referenced()]
    assert names == ["step1"]
    assert m3.leaves[("frozen",)].refs.holders.tolist() == [1]
    assert (tddist.load(s3, verify=True) == expected(3)).all()


def test_a_save_without_a_base_records_nothing_more(tmp_path):
    path = str(tmp_path / "full")
    save_all(path, 1)
    with open(os.path.join(path, fmt.MANIFEST_NAME), "rb") as f:
        obj = json.loads(f.read())
    assert "holders" not in obj
    m = tddist.read_manifest(path)
    assert m.holders is None and all(leaf.refs is None for leaf in m.leaves.values())


@pytest.mark.parametrize("why", ["elsewhere", "changed", "itself", "missing"])
def test_bases_that_hold_no_references_are_written_in_full(tmp_path, why):
    (tmp_path / "a").mkdir()
    base = str(tmp_path / ("a/base" if why == "elsewhere" else "base"))
    if why != "missing":
        save_all(base, 1)
    target = base if why == "itself" else str(tmp_path / "new")
    if why == "changed":  # another layout of every rank's data file: one more leaf first

        def changed(c):
            return tddist.save(TensorDict({"a": torch.ones(3), **shard(c.rank, 2)}, []), target, comm=c, base=base)

        assert not any(isinstance(r, BaseException) for r in tddist.run_threads(2, changed, timeout=60))
        m = tddist.read_manifest(target)
        assert all(not leaf.refs.holders.any() for leaf in m.leaves.values())
        return
    save_all(target, 2, base=base)
    m = tddist.read_manifest(target)
    assert m.referenced() == ()
    assert (tddist.load(target, verify=True) == expected(2)).all()


def test_another_world_size_references_what_keeps_its_place(tmp_path):
    """3 ranks over a base of 2: a rank whose data file keeps its layout references its equal chunks."""
    s1, s2 = str(tmp_path / "s1"), str(tmp_path / "s2")
    save_all(s1, 1)
    save_all(s2, 2, size=3, base=s1)
    assert (tddist.load(s2, verify=True) == expected(2, 3)).all()


def test_a_replaced_or_removed_holder_is_damage(tmp_path):
    s1, s2 = str(tmp_path / "s1"), str(tmp_path / "s2")
    save_all(s1, 1)
    save_all(s2, 2, base=s1)
    save_all(s1, 5)  # another checkpoint at the holder's name: another generation
    with pytest.raises(CorruptCheckpointError, match="replaced"):
        tddist.load(s2)
    tddist.run_threads(1, lambda c: None)
    import shutil

    shutil.rmtree(s1)
    with pytest.raises(CorruptCheckpointError, match="cannot be read"):
        tddist.load(s2)


def test_the_parser_refuses_bad_holders(tmp_path):
    s1, s2 = str(tmp_path / "s1"), str(tmp_path / "s2")
    save_all(s1, 1)
    save_all(s2, 2, base=s1)
    with open(os.path.join(s2, fmt.MANIFEST_NAME), "rb") as f:
        obj = json.loads(f.read())
    with open(os.path.join(s2, fmt.INDEX_NAME), "rb") as f:
        index = f.read()
    parse_manifest(obj, index=index)
    for bad in ([{"name": "../x", "generation": "0" * 16}], [{"name": "s1", "generation": "zz"}], "s1"):
        with pytest.raises(ManifestError):
            parse_manifest({**obj, "holders": bad}, index=index)
    # a holder number beyond the table
    raw = bytearray(index)
    at = len(index) - 8 * 3 * sum(len(leaf.table) for leaf in tddist.read_manifest(s2).leaves.values())
    raw[at : at + 8] = np.array([7], "<i8").tobytes()
    obj2 = {**obj, "index": {"size": len(raw), "checksum": __import__("xxhash").xxh3_64_hexdigest(bytes(raw))}}
    with pytest.raises(ManifestError, match="holder"):
        parse_manifest(obj2, index=bytes(raw))


@pytest.mark.parametrize("damage", ["deleted", "replaced", "corrupted", "truncated"])
def test_verify_finds_every_deleted_or_replaced_holder(tmp_path, damage):
    """Every way of losing a holder is a problem of the checkpoint that references it (and only then)."""
    s1, s2, s3 = (str(tmp_path / f"s{i}") for i in (1, 2, 3))
    save_all(s1, 1)
    save_all(s2, 2, base=s1)
    save_all(s3, 3, base=s2)
    assert verify(s3).ok and verify(s2).ok
    data = os.path.join(s1, fmt.rank_data_name(0))
    if damage == "deleted":
        import shutil

        shutil.rmtree(s1)
    elif damage == "replaced":
        save_all(s1, 4)  # another checkpoint at its name (another generation)
    elif damage == "corrupted":
        with open(data, "r+b") as f:
            f.seek(100)
            f.write(b"\xff" * 8)
    else:
        os.truncate(data, 64)
    for path in (s2, s3):
        report = verify(path)
        assert not report.ok, (damage, path)
        kinds = {p.kind for p in report.problems}
        assert kinds <= {"holder", "checksum", "unreadable"}, kinds
        if damage in ("deleted", "replaced"):
            assert [p.file for p in report.problems] == ["s1"]
            assert not verify(path, quick=True).ok


# --- nothing referenced is ever removed -------------------------------------------------------


def lora(step: int) -> TensorDict:
    """One process's LoRA-like state: the frozen base never changes, the adapter does."""
    return TensorDict({"frozen": torch.arange(65536, dtype=torch.float32), "adapter": torch.full((16,), float(step))})


def test_manager_incremental_retention_keeps_what_kept_checkpoints_reference(tmp_path):
    from tddist import CheckpointManager

    root = str(tmp_path / "root")
    mgr = CheckpointManager(root, keep_last=1, incremental=True)
    for step in range(1, 5):
        mgr.save(step, lora(step))
    mgr.wait()
    names = sorted(n for n in os.listdir(root) if n.startswith("step"))
    # the newest, and the first (it holds the frozen base the newest references); the others are gone
    assert names == ["step-000000001", "step-000000004"], names
    newest = os.path.join(root, "step-000000004")
    assert [h.name for h in tddist.read_manifest(newest).referenced()] == ["step-000000001"]
    assert verify(newest).ok
    assert (tddist.load(newest)["adapter"] == 4).all()
    state = lora(0)
    assert mgr.restore(state) == 4
    assert (state["adapter"] == 4).all() and (state["frozen"] == lora(0)["frozen"]).all()
    mgr.close()


def test_gc_keeps_referenced_checkpoints_and_pins_hold_off_deletion(tmp_path):
    from tddist.errors import CheckpointPinnedError
    from tddist.jobs.cleanup import gc, plan_gc
    from tddist.jobs.retention import delete_checkpoint
    from tddist.storage.pins import PIN_LEASE, pin
    from tddist.storage.recovery import recover

    root = tmp_path / "root"
    root.mkdir()
    paths = [str(root / f"step-{s:09d}") for s in (1, 2, 3)]
    tddist.save(lora(1), paths[0])
    tddist.save(lora(2), paths[1])  # full: references nothing
    tddist.save(lora(3), paths[2], base=paths[0])
    plan = {os.path.basename(a.path): a.action for a in plan_gc(str(root), keep_last=1)}
    assert plan == {"step-000000001": "keep", "step-000000002": "delete"}
    gc(str(root), keep_last=1)
    assert sorted(os.listdir(root)) == ["step-000000001", "step-000000003"]
    # a pinned checkpoint is not deleted; an expired pin no longer holds it, and recover removes it
    held = pin(paths[0])
    with pytest.raises(CheckpointPinnedError):
        delete_checkpoint(paths[0])
    assert os.path.isdir(paths[0])
    os.utime(held, (0, 0))
    assert recover(paths[0]) == [f"removed expired pin {held}"]
    assert not os.path.exists(held) and PIN_LEASE > 0
    with pytest.raises(CheckpointPinnedError, match="referenced"):  # step 3 references it: never deleted
        delete_checkpoint(paths[0])
    import shutil

    shutil.rmtree(paths[0])  # lost outside tddist
    assert not verify(paths[2]).ok
    # a root's clean-up (the manager's at start, under the root's lock: no save runs) removes every pin
    from tddist.jobs.retention import clean_root

    held = pin(paths[2])
    assert any("pin" in line for line in clean_root(str(root))) and not os.path.exists(held)


def test_pack_convert_and_materialize_write_self_contained_copies(tmp_path):
    """Each copy holds every byte itself: it loads and verifies after the holder is gone."""
    import shutil
    import subprocess
    import sys

    s1, s2 = str(tmp_path / "s1"), str(tmp_path / "s2")
    save_all(s1, 1)
    save_all(s2, 2, base=s1)
    whole = str(tmp_path / "whole")
    packed = str(tmp_path / "s2.tdz")
    pt = str(tmp_path / "s2.pt")
    env = {**os.environ, "PYTHONPATH": os.getcwd()}
    for args in (["materialize", s2, whole], ["pack", s2, packed], ["convert", s2, pt]):
        done = subprocess.run([sys.executable, "-m", "tddist.cli", *args], env=env, capture_output=True, text=True)
        assert done.returncode == 0, done.stderr
    shutil.rmtree(s1)
    for copy in (whole, packed):
        assert tddist.read_manifest(copy).holders is None
        assert verify(copy).ok
        assert (tddist.load(copy) == expected(2)).all()
    saved = torch.load(pt)
    assert torch.equal(saved["frozen"], expected(2)["frozen"])


def test_with_trust_versions_a_save_hashes_again_what_changed_since_it_last_hashed_it(tmp_path):
    """trust_versions=True: unchanged leaves (same memory, same version counter) are not hashed again; a leaf
    changed in place, or replaced by another tensor, is, and is written."""
    from tddist.storage import incremental

    state = lora(1)
    s1, s2, s3, s4 = (str(tmp_path / f"s{i}") for i in range(1, 5))
    tddist.save(state, s1)
    tddist.save(state, s2, base=s1, trust_versions=True)  # hashes everything once: identities recorded
    seen = {k[1]: v for k, v in incremental._SEEN.items() if k[0] == 0}
    assert set(seen) >= {("frozen",), ("adapter",)}
    state["adapter"].add_(1)  # in place: its version counter moves
    tddist.save(state, s3, base=s2, trust_versions=True)
    m3 = tddist.read_manifest(s3)
    assert m3.leaves[("adapter",)].refs.holders.tolist() == [0]
    assert m3.leaves[("frozen",)].refs.holders.tolist() == [1] and m3.referenced()[0].name == "s1"
    state["frozen"] = state["frozen"].clone()
    state["frozen"][0] = -1.0  # another tensor, other bytes
    tddist.save(state, s4, base=s3, trust_versions=True)
    m4 = tddist.read_manifest(s4)
    assert m4.leaves[("frozen",)].refs.holders.tolist() == [0]
    for path, want in ((s3, 2.0), (s4, 2.0)):
        got = tddist.load(path, verify=True)
        assert (got["adapter"] == want).all()
    assert tddist.load(s4)["frozen"][0] == -1.0 and tddist.load(s3)["frozen"][0] == 0.0
    assert verify(s4).ok and verify(s3).ok
    # only the last save's chunks are remembered: a leaf no longer saved is not kept alive
    del state["adapter"]
    tddist.save(state, str(tmp_path / "s5"), base=s4, trust_versions=True)
    assert ("adapter",) not in {k[1] for k in incremental._SEEN if k[0] == 0}


def test_by_default_a_change_the_version_counter_misses_is_still_written(tmp_path):
    """Without trust_versions every chunk is hashed: leaves changed through ``.data`` and through NumPy (the
    version counter does not move) are written, never referenced as the base's stale bytes; with it, the
    documented limit: such a change is missed."""
    state = lora(1)
    s1, s2, s3, s4 = (str(tmp_path / f"s{i}") for i in range(1, 5))
    tddist.save(state, s1)
    tddist.save(state, s2, base=s1)
    version = state["adapter"]._version
    state["adapter"].data.add_(1)  # a write the version counter does not see
    state["frozen"].numpy()[0] = -5.0  # nor this one
    assert state["adapter"]._version == version
    tddist.save(state, s3, base=s2)
    m3 = tddist.read_manifest(s3)
    assert m3.leaves[("adapter",)].refs.holders.tolist() == [0]
    got = tddist.load(s3, verify=True)
    assert torch.equal(got["adapter"], state["adapter"]) and torch.equal(got["frozen"], state["frozen"])
    tddist.save(state, s4, base=s3, trust_versions=True)  # hashes everything once, remembered
    state["adapter"].data.add_(1)
    tddist.save(state, str(tmp_path / "s5"), base=s4, trust_versions=True)
    stale = tddist.load(str(tmp_path / "s5"))
    assert not torch.equal(stale["adapter"], state["adapter"]), "trust_versions saw a change it cannot see"


@pytest.mark.parametrize("kwargs", [{"trust_versions": True}, {"trust_versions": 1, "base": "b"}])
def test_trust_versions_needs_a_base_and_a_bool(tmp_path, kwargs):
    with pytest.raises(tddist.InvalidArgumentError, match="trust_versions"):
        tddist.save({"x": torch.ones(2)}, str(tmp_path / "c"), **kwargs)


def test_return_early_saves_are_incremental_too(tmp_path):
    """An asynchronous save snapshots the whole state first, then compares it with the base (its snapshot
    buffers are hashed every time: they are reused without a new version)."""
    s1, s2, s3 = (str(tmp_path / f"s{i}") for i in range(1, 4))
    state = lora(1)
    tddist.save(state, s1)
    tddist.save(state, s2, base=s1, return_early=True).result()
    state["adapter"].add_(1)
    tddist.save(state, s3, base=s2, return_early=True).result()
    m3 = tddist.read_manifest(s3)
    assert [h.name for h in m3.referenced()] == ["s1"]
    assert m3.leaves[("adapter",)].refs.holders.tolist() == [0]
    assert (tddist.load(s3, verify=True)["adapter"] == 2).all()


def test_an_archive_base_holds_references_read_through_its_entries(tmp_path):
    """A .tdz beside the target is a base like a directory: its equal chunks (compared byte by byte: an archive
    records no identities) are referenced and read from its zip entries, by every reader; the next save
    against the incremental directory references the archive, the holder, directly."""
    base, s2, s3 = str(tmp_path / "s1.tdz"), str(tmp_path / "s2"), str(tmp_path / "s3")
    save_all(base, 1, compression="deflate")
    save_all(s2, 2, base=base)
    save_all(s3, 3, base=s2)
    for path, step in ((s2, 2), (s3, 3)):
        m = tddist.read_manifest(path)
        assert [h.name for h in m.referenced()] == ["s1.tdz"]
        assert m.leaves[("frozen",)].refs.holders.tolist() == [1]
        assert m.leaves[("base", "w")].refs.holders.tolist() == [1, 1]
        assert allocated(path) < 64 * 1024
        for size in (1, 2, 3):
            for got in load_all(path, size, shard=None, verify=True):
                assert (got == expected(step)).all()
        assert verify(path).ok
    whole = str(tmp_path / "whole")
    from tddist.tools.pack import materialize

    materialize(s3, whole)
    os.remove(base)
    assert not verify(s3).ok
    assert (tddist.load(whole, verify=True) == expected(3)).all()


def test_info_and_verify_commands_report_the_references(tmp_path):
    """``tddist info --json`` lists the holders with the bytes each holds; ``tddist verify --json`` names a lost
    holder as a ``holder`` problem (exit status 1)."""
    import subprocess
    import sys

    s1, s2 = str(tmp_path / "s1"), str(tmp_path / "s2")
    save_all(s1, 1)
    save_all(s2, 2, base=s1)
    env = {**os.environ, "PYTHONPATH": os.getcwd()}

    def cli(*args: str) -> tuple[int, dict]:
        done = subprocess.run([sys.executable, "-m", "tddist.cli", *args], env=env, capture_output=True, text=True)
        return done.returncode, json.loads(done.stdout)

    rc, info = cli("info", "--json", s2)
    m = tddist.read_manifest(s2)
    own = sum(int(leaf.table.columns().nbytes.sum()) for leaf in m.leaves.values()) - info["references"][0]["bytes"]
    assert rc == 0 and [r["name"] for r in info["references"]] == ["s1"] and own == 8 * 8 * 4 + 8
    rc, full = cli("info", "--json", s1)
    assert full["references"] is None
    import shutil

    shutil.rmtree(s1)
    rc, report = cli("verify", "--json", s2)
    assert rc == 1 and [(p["kind"], p["file"]) for p in report["problems"]] == [("holder", "s1")]


@pytest.mark.parametrize("num_threads", [1, 4])
def test_referenced_chunks_inherit_their_counts_and_the_largest_magnitude_stays_exact(tmp_path, num_threads):
    """A chunk found equal to its base's by identity alone takes the base's checksum and counts; the rank's
    largest magnitude and the non-finite leaves are those of a full save of the same state, also when the
    base's largest leaf changes (then the referenced chunks are counted again)."""
    g = torch.Generator().manual_seed(7)
    bad = torch.randn(4096, generator=g) * 0.1
    bad[[3, 70]], bad[9] = float("nan"), float("inf")
    td = TensorDict(
        {
            "big": torch.randn(8192, generator=g) * 10,  # the largest magnitude, frozen at first
            "bad": bad,  # frozen, with a NaN and an Inf
            "mid": torch.randn(8192, generator=g),
            "ints": torch.arange(100),
            "adapter": torch.zeros(256),
        },
        [],
    )
    td["big"][5] = 100.0

    def save_pair(step: int, base: str | None) -> tuple[object, object]:
        td["adapter"].fill_(float(step))
        inc, full = str(tmp_path / f"inc{step}"), str(tmp_path / f"full{step}")
        kw = {} if base is None else {"base": base}
        tddist.save(td, inc, num_threads=num_threads, **kw)
        tddist.save(td, full, num_threads=num_threads)
        mi, mf = tddist.read_manifest(inc), tddist.read_manifest(full)
        assert mi.largest_magnitude() == mf.largest_magnitude()
        assert mi.non_finite() == mf.non_finite()
        for key, leaf in mf.leaves.items():
            assert mi.leaves[key].table.chunk(0).checksum == leaf.table.chunk(0).checksum
        got = tddist.load(inc, verify=True)
        for key in td.keys():  # bit for bit (NaN != NaN)
            assert torch.equal(got[key].view(torch.uint8), td[key].view(torch.uint8))
        return mi, mf

    save_pair(0, None)
    save_pair(1, str(tmp_path / "inc0"))  # a base without identities: bytes compared
    m2, _ = save_pair(2, str(tmp_path / "inc1"))  # identities: the referenced chunks hashed once
    assert m2.leaves[("big",)].refs.holders.tolist() == [1] and m2.leaves[("bad",)].refs.holders.tolist() == [1]
    assert m2.largest_magnitude().key == ("big",) and m2.largest_magnitude().value == 100.0
    td["big"].mul_(0.001)  # the base's largest leaf changes: "mid", referenced, holds the rank's largest now
    m3, _ = save_pair(3, str(tmp_path / "inc2"))
    assert m3.leaves[("mid",)].refs.holders.tolist() == [1] and m3.leaves[("big",)].refs.holders.tolist() == [0]
    assert m3.largest_magnitude().key == ("mid",)
    td["mid"].mul_(0.5)  # the largest is now in a chunk written here, above the bound: nothing counted again
    td["big"].mul_(1e6)
    m4, _ = save_pair(4, str(tmp_path / "inc3"))
    assert m4.largest_magnitude().key == ("big",)
    assert [leaf.key for leaf in m4.non_finite()] == [("bad",)]


@pytest.mark.parametrize("clean", ["recover", "gc"])
def test_a_deletion_killed_between_its_renames_leaves_a_referenced_holder_to_restore(tmp_path, clean):
    """A deletion decided before a save committed a reference (here: called directly), killed once it renamed
    the holder to its trash name: ``recover`` and ``tddist gc`` move it back (removing it would leave the
    committed checkpoint's references dangling), and the referencing checkpoint verifies and loads."""
    from tddist.jobs.cleanup import gc, plan_gc
    from tddist.storage.recovery import recover
    from tddist.storage.roots import remove_checkpoint

    root = tmp_path / "root"
    root.mkdir()
    holder, incremental = str(root / "step-000000001"), str(root / "step-000000002")
    tddist.save(lora(1), holder)
    tddist.save(lora(2), incremental, base=holder)
    pid = os.fork()
    if pid == 0:  # the clean-up's process, SIGKILLed at the fault point
        os.environ["TDDIST_FAULT"] = "trash:0:kill"
        try:
            remove_checkpoint(holder)
        finally:
            os._exit(3)
    _pid, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == -9
    assert not os.path.exists(holder) and [k for k, _p in fmt.side_entries(holder)] == ["trash"]
    assert not verify(incremental).ok  # dangling until the clean-up puts the holder back
    if clean == "recover":
        assert recover(holder)[0].startswith("restored")
    else:
        assert [(a.action, a.target) for a in plan_gc(str(root))] == [("restore", holder)]
        assert [a.action for a in gc(str(root), keep_last=1)] == ["restore", "keep"]
    assert sorted(os.listdir(root)) == ["step-000000001", "step-000000002"]
    assert verify(incremental).ok
    assert (tddist.load(incremental, verify=True) == lora(2)).all()
