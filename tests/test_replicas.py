"""The replicated node-local tier (``replicas=1``): replication to another node, restore from peers, resharding.

In-process tests run thread ranks that say which node they are on
(``node=``), each node with its own local directory. The multi-node test
runs torchrun agents, each one a node on 127.0.0.1 with its own local
directory; a node is lost for real (its agent and workers SIGKILLed, its
directory deleted) and the job restarts on the survivor, alone or with a
fresh empty node. Throughout, the shared root's data files are hidden, so a
restore that read a byte of them would fail: the restores from the nodes
read 0 bytes from it.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from tensordict import TensorDict

import tddist
from tddist.comm.base import LocalComm
from tddist.comm.node import node_name
from tddist.jobs import box_reshard, direct, local_shards, peer_choice, peer_restore, receiving, transfer
from tddist.jobs.copies import CopyRecord, PartId, digest_files, read_record
from tddist.jobs.keeping import write_in_place
from tddist.jobs.local_tier import LocalTier
from tddist.jobs.manager import CheckpointManager
from tddist.jobs.nodes import replica_peers
from tddist.jobs.retention import step_name
from tddist.storage.memory import MemoryStore
from tests import launch_util
from tests.helpers import assert_td_equal
from tests.manager_rank import local_state, train

SCRIPT = Path(__file__).resolve().parent / "replica_rank.py"


def test_replica_peers_pair_every_rank_with_another_node() -> None:
    assert replica_peers(["a", "a", "b", "b"]) == {0: 2, 1: 3, 2: 0, 3: 1}
    assert replica_peers(["a", "b", "c"]) == {0: 1, 1: 2, 2: 0}
    assert replica_peers(["a", "a", "a", "b"]) == {0: 3, 1: 3, 2: 3, 3: 0}  # uneven nodes: all on the other one
    assert replica_peers(["a", "a"]) == {}  # one node: no replica would survive it
    assert node_name({"TDDIST_NODE": "x", "GROUP_RANK": "1", "LOCAL_WORLD_SIZE": "2"}) == "x"
    assert node_name({"GROUP_RANK": "1", "LOCAL_WORLD_SIZE": "2", "SLURM_NODEID": "7"}) == "torchrun-node-1"
    assert node_name({"SLURM_NODEID": "7"}) == "slurm-node-7"


def test_replicas_need_the_local_tier(tmp_path: Path) -> None:
    with pytest.raises(tddist.InvalidArgumentError, match="local_dir"):
        CheckpointManager(tmp_path, replicas=1, preempt_signal=None)
    with pytest.raises(tddist.InvalidArgumentError, match="replicas must be 0 or 1"):
        CheckpointManager(tmp_path, local_dir=tmp_path / "l", replicas=2, preempt_signal=None)


def _shard_boxes(key: tuple[str, ...], shape: tuple[int, ...], dim: int, parts: int) -> list[local_shards.LeafBox]:
    """Each rank's box of a DTensor ``Shard(dim)`` over ``parts`` ranks (torch.chunk's split: the last may be short
    or empty)."""
    out, at, step = [], 0, -(-shape[dim] // parts)
    for _ in range(parts):
        n = max(0, min(step, shape[dim] - at))
        offsets = tuple(at if d == dim else 0 for d in range(len(shape)))
        sizes = tuple(n if d == dim else s for d, s in enumerate(shape))
        out.append(local_shards.LeafBox(key, offsets, sizes, shape))
        at += n
    return out


def test_dtensor_boxes_choose_the_parts_and_fill_any_shard_from_their_intersections() -> None:
    full = {"w": torch.arange(9 * 5.0).view(9, 5), "v": torch.arange(3 * 7.0).view(3, 7), "b": torch.arange(6.0)}
    dims = {"w": 0, "v": 1}
    saved = [[*(_shard_boxes((k,), tuple(full[k].shape), d, 4)[r] for k, d in dims.items()),
              local_shards.LeafBox(("b",), (0,), (6,), (6,))] for r in range(4)]  # fmt: skip
    assert local_shards.decode(local_shards.encode(tuple(saved[3]))) == tuple(saved[3])  # JSON in a part's metadata
    assert local_shards.decode(None) is None and local_shards.decode([{"key": ["w"], "offsets": [-1]}]) is None
    parts = {r: {b.key: full[b.key[0]][box_reshard._slices(b.box, ((0,) * len(b.shape), b.shape))] for b in boxes}
             for r, boxes in enumerate(saved)}  # fmt: skip
    assert parts[3][("w",)].shape == (0, 5) and parts[3][("v",)].shape == (3, 1)  # uneven: short and empty shards
    sources = [tuple(b) for b in saved]
    for rank in range(2):  # onto 2 ranks: w 5 + 4 rows, v 4 + 3 columns, b whole (any one part holds it)
        targets = (*(_shard_boxes((k,), tuple(full[k].shape), d, 2)[rank] for k, d in dims.items()), saved[0][2])
        want = box_reshard.overlapping(sources, targets, rank, set())
        assert want == [{0, 1}, {1, 2, 3}][rank], want  # w's rows and v's columns of this rank; not part 3's empty w
        leaves = {t.key: torch.full(t.sizes, -1.0) for t in targets}
        box_reshard.fill(leaves, targets, dict(enumerate(sources)), lambda k, key: parts[k][key], f"rank {rank}")
        for t in targets:
            assert torch.equal(leaves[t.key], full[t.key[0]][box_reshard._slices(t.box, ((0,) * 2, t.shape))])
    only_b = (saved[0][2],)
    assert box_reshard.overlapping(sources, only_b, 1, set()) == {1}  # a replicated box: this rank's part
    assert box_reshard.overlapping(sources, only_b, 1, {3}) == set()  # or one it reads anyway
    target = _shard_boxes(("w",), (9, 5), 0, 2)[1]
    leaves = {("w",): torch.zeros(target.sizes)}
    with pytest.raises(tddist.IncompatibleCheckpointError, match="hold 5 of the 20 elements .* DTensor w"):
        box_reshard.fill(
            leaves, (target,), {1: sources[1], 3: sources[3]}, lambda k, key: parts[k][key], "rank 1"
        )  # no part 2


def test_parts_without_recorded_dtensor_boxes_reshard_plain_states_only(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    tier = LocalTier(str(tmp_path), 0, 2)
    for r in range(2):  # parts as a tddist that recorded no boxes saved them
        tddist.save(local_state(r, 2, 1), str(tmp_path / step_name(1) / f"rank-{r}-of-2"), metadata={"step": 1})
    copies = peer_choice.inventory(tier, "n")
    assert [c.boxes for c in copies] == [None, None]
    choice, _passed = peer_choice.choose(copies, set(), None, 1)
    assert choice is not None and choice.world == 2
    assert peer_restore._reshardable(LocalComm(), choice, {0: ()})  # a plain state reshards as before
    dtensor = local_shards.LeafBox(("fsdp", "w"), (0, 0), (9, 5), (9, 5))
    with caplog.at_level(logging.WARNING):
        assert not peer_restore._reshardable(LocalComm(), choice, {0: (dtensor,)})
    assert "did not record where the DTensor shards of its node-local parts lie" in caplog.text
    assert "restoring from the shared root" in caplog.text
    tier.save(local_state(0, 2, 2), 2, {"step": 2}, {})  # the local tier records the boxes (none: no DTensor)
    assert [c.boxes for c in peer_choice.inventory(tier, "n") if c.part.step == 2] == [()]
    assert tier.read(2, ()).metadata == {"step": 2}  # a promotion gives the shared checkpoint the user's metadata


def hide_data(root: Path, hidden: bool) -> None:
    """Rename the shared root's data files away (``hidden``) or back: a restore that reads one fails."""
    for p in root.rglob("*.data" if hidden else "*.data.hidden"):
        p.rename(p.with_name(p.name + ".hidden") if hidden else p.with_name(p.name.removesuffix(".hidden")))


def flip_byte(path: Path, at: int | None = None) -> None:
    """Corrupt one byte of ``path`` (the middle one by default)."""
    raw = bytearray(path.read_bytes())
    raw[len(raw) // 2 if at is None else at] ^= 0xFF
    path.write_bytes(bytes(raw))


def test_a_copy_received_into_memory_loads_like_its_files_and_a_flipped_bit_never_arrives(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("TDDIST_REPLICA_CHUNK_BYTES", "100")  # rounds of chunks that straddle the files
    part = tmp_path / "part"
    tddist.save(local_state(0, 1, 3), str(part))
    files = digest_files(str(part))  # as the holder's record says
    shipment = transfer.Shipment(0, 1, PartId(3, 0, 1), files)

    def send(comm) -> object:
        got = transfer.ship_to_memory(comm, [shipment], lambda s: str(part), transfer.chunk_bytes())
        bad = got.wait()
        return bad, {n: bytes(t.numpy()) for n, t in got.files.get(shipment, {}).items() if not bad}

    out = tddist.run_threads(2, send)
    assert out[0] == ((), {})
    bad, received = out[1]  # type: ignore[misc]
    assert bad == () and received == {f.name: (part / f.name).read_bytes() for f in files}
    tensors = {n: torch.frombuffer(bytearray(b), dtype=torch.uint8) for n, b in received.items()}
    from_memory = tddist.load(MemoryStore("a peer", tensors), shard=None, verify=True)
    assert_td_equal(from_memory, tddist.load(str(part), shard=None))
    for f in files:  # one bit of any file (data, manifest, index): the shipment arrives bad, its bytes are dropped
        original = (part / f.name).read_bytes()
        flip_byte(part / f.name, at=len(original) - 1)
        assert tddist.run_threads(2, send)[1] == ((shipment,), {}), f.name
        (part / f.name).write_bytes(original)


def test_leaves_received_straight_into_the_state_are_checked_loaded_and_kept_only_while_unchanged(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    part = tmp_path / "part"
    saved = local_state(0, 1, 3)
    tddist.save(saved, str(part))
    files = peer_restore._small_first(digest_files(str(part)))
    shipment = transfer.Shipment(0, 1, PartId(3, 0, 1), files, direct.leaf_spans(str(part)))
    state = saved.apply(torch.zeros_like)
    state["frozen"] = torch.zeros(128)[::2]  # not contiguous: loaded from the bytes received apart
    assert direct.places(shipment, direct.targets(state, {})) == {}  # leaves under MIN_BYTES: received apart
    monkeypatch.setattr(direct, "MIN_BYTES", 1)
    assert direct.targets(state, {"keys": ["rows"]}) == {}  # a load with options is left to the load
    placed = direct.places(shipment, direct.targets(state, {}))
    assert {s.key for s in shipment.spans} == {("rows", "w"), ("frozen",), ("count",)}  # each stored whole
    data = tddist.format.rank_data_name(0)

    def receive(flip: int | None = None) -> tuple[receiving.MemorySink, list[transfer.Shipment]]:
        """Every piece as ``Streaming`` posts it (100-byte chunks), ``flip``: one bit of the data file changed."""
        sink = receiving.MemorySink([shipment], {shipment: placed})
        for f in files:
            raw = bytearray((part / f.name).read_bytes())
            if flip is not None and f.name == data:
                raw[flip] ^= 1
            for a, b in direct.cuts(f, shipment.spans, 100):
                sink.buffer(b - a).copy_(torch.frombuffer(raw[a:b], dtype=torch.uint8))
                sink.arrived(b - a)
        return sink, sink.finish()

    sink, bad = receive()
    assert bad == []
    assert torch.equal(state["rows", "w"], saved["rows", "w"]) and torch.equal(state["count"], saved["count"])
    assert not state["frozen"].any()  # the others wait for the load
    state.apply_(torch.zeros_like)
    sink, bad = receive(flip=(part / data).stat().st_size // 2)
    assert bad == [shipment]  # a bit flipped in bytes received in the state is found as any other
    sink, bad = receive()
    store = MemoryStore("a peer", sink.files[shipment], direct=placed)
    keys = direct.received_keys(store.open().manifest, shipment.spans, placed)
    assert sorted(keys) == [("count",), ("rows", "w")]
    report = tddist.load(store, shard=None, into=state, exclude=keys)  # as peer_restore loads a part received so
    assert report.loaded == [("frozen",)] and report.skipped.keys() == set(keys)
    assert_td_equal(state, saved)
    with pytest.raises(tddist.CorruptCheckpointError, match="does not place there"):  # an announced layout that lies
        direct.received_keys(store.open().manifest, shipment.spans[::-1][:1] * 2, {data: placed[data][:1]})

    tier = LocalTier(str(tmp_path / "local"), 0, 1)  # the own copy is written from the state, and hashed again
    record = CopyRecord(shipment.part, tuple(sorted(files, key=lambda f: f.name)), 0, "node-a")
    kept = write_in_place(tier, record, sink.files[shipment], str(tmp_path / "local" / ".in" / "3" / "x"), placed)
    assert kept == tier.part(3) and digest_files(kept) == record.files
    train(state)  # the state changed before its copy was written: nothing is kept
    shutil.rmtree(kept)
    assert (
        write_in_place(tier, record, sink.files[shipment], str(tmp_path / "local" / ".in" / "3" / "x"), placed) is None
    )
    assert not os.path.exists(tier.part(3)) and not (tmp_path / "local" / ".in").exists()


def test_restore_from_peers_after_a_lost_node_same_and_fewer_ranks_and_bad_copies(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("TDDIST_REPLICA_CHUNK_BYTES", "100")  # many rounds of chunks
    root, a, b, c = tmp_path / "shared", tmp_path / "a", tmp_path / "b", tmp_path / "c"

    def run(size: int, dirs: list[Path], body: Callable[[CheckpointManager, TensorDict], object]) -> list[object]:
        def rank(comm):
            node = comm.rank * len(dirs) // size  # ranks split evenly over the nodes, in order
            with CheckpointManager(
                root, every=1, keep_last=2, comm=comm, local_dir=dirs[node], preempt_signal=None, replicas=1,
                node=f"node-{dirs[node].name}",
            ) as mgr:  # fmt: skip
                return body(mgr, local_state(comm.rank, comm.size, 0))

        out = tddist.run_threads(size, rank)
        assert not any(isinstance(r, BaseException) for r in out), out
        return out

    def train_to_3(mgr: CheckpointManager, state: TensorDict) -> object:
        for s in range(mgr.restore(state), 3):
            train(state)
            mgr.step(s + 1, state)
        return None

    def restore(mgr: CheckpointManager, state: TensorDict) -> object:
        got = mgr.restore(state)
        assert_td_equal(state, local_state(mgr.comm.rank, mgr.comm.size, 3), f"rank {mgr.comm.rank}")
        return int(got), got.tier

    run(4, [a, b], train_to_3)
    for r, (mine, theirs) in enumerate([(a, b), (a, b), (b, a), (b, a)]):
        record = read_record(str(mine / step_name(3) / f"rank-{r}-of-4"))
        assert record is not None and record.peer_node == f"node-{theirs.name}", record
        assert read_record(str(theirs / "replicas" / step_name(3) / f"rank-{r}-of-4")) is not None
    assert sorted(p.name for p in (a / "replicas").iterdir()) == [step_name(2), step_name(3)]  # two slots
    hide_data(root, hidden=True)
    flip_byte(a / step_name(3) / "rank-0-of-4" / "rank-00000.data")  # rank 0's own copy is bad: its replica on b
    with caplog.at_level(logging.WARNING):
        assert run(4, [a, b], restore) == [(3, "peers")] * 4
    assert "the copy of rank-0-of-4 at" in caplog.text and "is bad" in caplog.text
    shutil.rmtree(b)  # node b is lost
    assert run(2, [a], restore) == [(3, "local")] * 2  # 4 parts resharded onto 2 ranks, all on node a
    assert run(4, [a, c], restore) == [(3, "peers")] * 4  # a fresh node c: its parts come from a's replicas
    kept = sorted(p.name for p in (c / step_name(3)).iterdir())  # written after the restore, with their records
    assert kept == ["rank-2-of-4", "rank-2-of-4.copy.json", "rank-3-of-4", "rank-3-of-4.copy.json"], kept
    for r in (2, 3):  # the bytes received, which matched the replica's record; the record names that replica
        record = read_record(str(c / step_name(3) / f"rank-{r}-of-4"))
        assert record is not None and record.peer_node == "node-a", record
        assert record.files == read_record(str(a / "replicas" / step_name(3) / f"rank-{r}-of-4")).files  # type: ignore[union-attr]
    assert not list(c.glob(".fetched-*/*"))  # nothing left staged
    flip_byte(a / "replicas" / step_name(3) / "rank-2-of-4" / "rank-00000.data")
    shutil.rmtree(c)  # the only good copy of part 2 is lost: the shared root is used
    hide_data(root, hidden=False)
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        assert run(2, [a], restore) == [(3, "shared")] * 2
    assert "no surviving copy of the parts of ranks [2]" in caplog.text
    assert "restoring from the shared root" in caplog.text
    # Without the shared root, a restore whose received part 2 fails its checksum after the ranks filled the
    # state from the others raises on every rank, rather than start from step 0 with that state.
    shutil.rmtree(root)
    failed = tddist.run_threads(4, lambda comm: _restore_on(comm, root, [a, c]))
    assert all(isinstance(e, tddist.CorruptCheckpointError) for e in failed), failed
    assert all("failed their checksums after the state was filled" in str(e) for e in failed), failed


def _restore_on(comm, root: Path, dirs: list[Path]) -> object:
    """Restore on a rank of ``comm`` whose nodes are ``dirs`` (ranks split evenly over them, in order)."""
    node = comm.rank * len(dirs) // comm.size
    with CheckpointManager(
        root, comm=comm, local_dir=dirs[node], preempt_signal=None, replicas=1, node=f"node-{dirs[node].name}"
    ) as mgr:
        return mgr.restore(local_state(comm.rank, comm.size, 0))


# --- nodes as torchrun agents on 127.0.0.1 ------------------------------------------------------


class Node:
    """One torchrun agent playing a node: ``nproc`` workers, its own local directory, killed as a process group."""

    def __init__(
        self, work: Path, tag: str, rank: int, nnodes: int, port: int, local: Path, role: str, step: int, nproc: int
    ) -> None:
        self.log = work / f"agent-{tag}-{rank}.log"
        env = launch_util._env({
            "TDDIST_REPORT_DIR": str(work / f"reports-{tag}"), "REPLICA_LOCAL": str(local),
            "TDDIST_REPLICA_CHUNK_BYTES": "256", "TDDIST_TIMEOUT": "60",
        })  # fmt: skip
        (work / f"reports-{tag}").mkdir(exist_ok=True)
        cmd = [
            sys.executable, "-m", "torch.distributed.run", f"--nnodes={nnodes}", f"--node-rank={rank}",
            f"--nproc-per-node={nproc}", "--rdzv-backend=static", f"--rdzv-endpoint=127.0.0.1:{port}", "--max-restarts=0",
            str(SCRIPT), str(work), role, str(step),
        ]  # fmt: skip
        with open(self.log, "w") as out:
            self.proc = subprocess.Popen(
                cmd, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True, cwd=launch_util.REPO
            )

    def kill(self) -> None:
        """SIGKILL the agent and its workers (the node dies); torchrun may start its workers in their own sessions.

        An agent that already ended (and stopped its workers) is left alone: its pid may be another process's now.
        """
        if self.proc.poll() is not None:
            return
        for pid in [self.proc.pid, *descendants(self.proc.pid)]:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        self.proc.wait(30)


def descendants(pid: int) -> list[int]:
    """The processes below ``pid`` (children, their children, ...), from /proc."""
    parent = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            parent[int(entry.name)] = int(fields[1])
    found, todo = [], [pid]
    while todo:
        p = todo.pop()
        kids = [c for c, pp in parent.items() if pp == p]
        found += kids
        todo += kids
    return found


#: Every agent a test started, killed at its end whatever happened.
STARTED: list[Node] = []


def start(work: Path, tag: str, role: str, step: int, locals_: list[Path], nprocs: tuple[int, ...] = ()) -> list[Node]:
    """A job of one agent per local directory (``tag`` names its reports and logs), ``nprocs`` workers each (2)."""
    port = launch_util.free_port()
    sizes = nprocs or (2,) * len(locals_)
    nodes = [Node(work, tag, k, len(locals_), port, d, role, step, sizes[k]) for k, d in enumerate(locals_)]
    STARTED.extend(nodes)
    return nodes


@pytest.fixture
def agents():
    """Kills every agent (and its workers) the test started, once it ends."""
    yield
    while STARTED:
        STARTED.pop().kill()


def reports(work: Path, tag: str, n: int, nodes: list[Node], timeout: float = 120) -> dict[int, dict]:
    """Wait for ``n`` ranks' reports; fail with the agents' logs if one ends badly or time runs out."""
    deadline = time.monotonic() + timeout
    d = work / f"reports-{tag}"
    while time.monotonic() < deadline:
        got = {int(p.stem[4:]): json.loads(p.read_text()) for p in d.glob("rank*.json")}
        if len(got) == n or any(r.get("status") != "ok" for r in got.values()):
            break
        time.sleep(0.2)
    logs = "\n".join(node.log.read_text()[-3000:] for node in nodes)
    assert len(got) == n and all(r["status"] == "ok" for r in got.values()), f"{got}\n{logs}"
    return got


@pytest.mark.slow
@pytest.mark.multirank
def test_a_node_killed_for_real_restart_on_survivor_and_fresh_node(tmp_path: Path, agents: None) -> None:
    l0, l1 = tmp_path / "node0", tmp_path / "node1"
    nodes = start(tmp_path, "train", "train", 4, [l0, l1])
    try:
        reports(tmp_path, "train", 4, nodes)
    finally:
        nodes[1].kill()  # node 1 dies with its workers and its disk
        nodes[0].kill()  # and the job with it
    shutil.rmtree(l1)
    hide_data(tmp_path / "shared", hidden=True)

    # The state holds DTensors (tests/replica_rank.py): resharded from the parts' recorded boxes.
    alone = start(tmp_path, "alone", "restore", 4, [l0])  # the survivor alone: 2 ranks instead of 4
    got = reports(tmp_path, "alone", 2, alone)
    for n in alone:
        assert n.proc.wait(60) == 0, n.log.read_text()[-3000:]
    assert {(r["step"], r["tier"]) for r in got.values()} == {(4, "local")}
    three = start(tmp_path, "three", "restore", 4, [l0, l1], (2, 1))  # + a fresh one-rank node: parts sent to it
    got = reports(tmp_path, "three", 3, three)
    for n in three:
        assert n.proc.wait(60) == 0, n.log.read_text()[-3000:]
    assert {(r["step"], r["tier"]) for r in got.values()} == {(4, "peers")}
    shutil.rmtree(l1, ignore_errors=True)

    pair = start(tmp_path, "pair", "restore-then-crash", 4, [l0, l1])  # survivor + a fresh empty node
    try:
        got = reports(tmp_path, "pair", 4, pair)
        assert {(r["step"], r["tier"]) for r in got.values()} == {(4, "peers")}
        assert pair[0].proc.wait(120) != 0  # rank 1 was SIGKILLed while receiving step 5's replica
    finally:
        pair[1].kill()
        pair[0].kill()
    cut = l0 / "replicas" / step_name(5)
    assert [p.name for p in cut.iterdir() if p.name.startswith("rank-3-of-4")] != []  # it had begun
    assert read_record(str(cut / "rank-3-of-4")) is None  # no record: never taken as complete
    assert not (tmp_path / "shared" / step_name(5)).exists()
    shutil.rmtree(l1)

    flip_byte(l0 / "replicas" / step_name(4) / "rank-2-of-4" / "rank-00000.data")
    hide_data(tmp_path / "shared", hidden=False)
    last = start(tmp_path, "last", "restore", 4, [l0])
    got = reports(tmp_path, "last", 2, last)
    for n in last:
        assert n.proc.wait(60) == 0
    assert {(r["step"], r["tier"]) for r in got.values()} == {(4, "shared")}
    text = last[0].log.read_text()
    assert "no surviving copy of the parts of ranks" in text and "is bad" in text, text[-3000:]


def test_one_node_keeps_no_replica_and_an_unrecorded_bad_copy_is_never_loaded(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    root, local = tmp_path / "shared", tmp_path / "local"

    def body(comm):
        kw = dict(every=2, keep_last=2, comm=comm, local_dir=local, preempt_signal=None, replicas=1, node="only")
        with CheckpointManager(root, **kw) as mgr:
            state = local_state(comm.rank, comm.size, 0)
            for s in range(mgr.restore(state), 4):
                train(state)
                mgr.step(s + 1, state)
        comm.barrier()
        if comm.rank == 1:  # no replica, so no record: the copy is checked against its manifest when loaded
            flip_byte(local / step_name(4) / "rank-1-of-2" / "rank-00000.data", at=0)  # in a tensor's bytes
        comm.barrier()
        with CheckpointManager(root, **kw) as mgr:
            state = local_state(comm.rank, comm.size, 0)
            got = mgr.restore(state)
            assert_td_equal(state, local_state(comm.rank, comm.size, 4), f"rank {comm.rank}")
            return int(got), got.tier

    with caplog.at_level(logging.WARNING):
        assert tddist.run_threads(2, body) == [(4, "shared")] * 2
    assert "every rank runs on node 'only': no replica is kept" in caplog.text
    assert not (local / "replicas").exists()
    assert read_record(str(local / step_name(4) / "rank-0-of-2")) is None
