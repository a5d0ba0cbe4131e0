"""Asynchronous saves in one process (no torch.distributed, no MPI): nothing grows from save to save."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
import weakref

import pytest
import torch
from tensordict import TensorDict

import tddist
from tddist.comm.resolve import resolve
from tddist.saving import background
from tddist.saving.arena import MIN_BUDGET
from tests.helpers import assert_td_equal, leftovers, require

CODE = r"""
import os, sys, threading
import torch
from tensordict import TensorDict
import tddist
from tddist.saving import background
from tddist.comm.resolve import resolve

def rss_mib():
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024

root = sys.argv[1]
td = TensorDict({f"w{i}": torch.randn(1024, 1024) for i in range(16)}, [])  # 64 MiB
samples = []
for step in range(20):
    td["w0"].add_(1)  # the training loop goes on changing the state
    fut = tddist.save(td, os.path.join(root, "ckpt"), return_early=True, num_threads=2)
    fut.result()
    ch = background.channel(resolve())
    samples.append((
        ch.buffers.allocations, ch.arena_allocations, threading.active_count(), rss_mib(), len(background._channels)
    ))
print(repr(samples))
# The commit's worker yields the CPU to training; the copy helper and the early writer, which run only while
# the caller copies, do not.
nice = {t.name.split("-rank")[0]: os.getpriority(os.PRIO_PROCESS, t.native_id) for t in threading.enumerate()}
print(repr(nice))
assert torch.equal(tddist.load(os.path.join(root, "ckpt"), shard=None, verify=True)["w0"], td["w0"])
"""


def test_twenty_return_early_saves_keep_memory_threads_and_buffers_flat(tmp_path):
    """One channel for the process: the arena the state is copied into while it is written is allocated by
    the first save only (no per-leaf snapshot buffers beside it), and the thread count and RSS stay flat after
    it (each save replaces the previous checkpoint). The copy helper and the early writer (64 MiB is the
    smallest state written while it is copied) keep the caller's CPU priority and the commit's worker runs
    ``BACKGROUND_NICENESS`` lower."""
    env = dict(os.environ, OMP_NUM_THREADS="1", LOCAL_WORLD_SIZE="1")  # one rank: a core for the early writer
    out = subprocess.run(
        [sys.executable, "-c", CODE, str(tmp_path)], capture_output=True, text=True, timeout=300, env=env
    )
    assert out.returncode == 0, out.stderr[-3000:]
    samples = eval(out.stdout.strip().splitlines()[-2])
    nice = eval(out.stdout.strip().splitlines()[-1])
    assert nice["tddist-copy"] == nice["MainThread"] == nice["tddist-early-write"], nice
    assert nice["tddist-save"] == min(19, nice["MainThread"] + background.BACKGROUND_NICENESS), nice
    buffers = [s[0] for s in samples]
    arenas = [s[1] for s in samples]
    threads = [s[2] for s in samples]
    rss = [s[3] for s in samples]
    channels = [s[4] for s in samples]
    assert buffers == [0] * 20, buffers  # a packed directory is copied into the arena while it is written
    assert arenas == [1] * 20, arenas  # one arena, reused by every later save
    assert channels == [1] * 20, channels
    assert max(threads[1:]) <= threads[1], threads
    assert max(rss[2:]) - rss[1] < 96, rss  # flat within less than two snapshots' worth of noise


def _mixed(seed: int) -> TensorDict:
    """Small, large and empty leaves, several dtypes and a non-contiguous one, in one TensorDict."""
    g = torch.Generator().manual_seed(seed)
    return TensorDict(
        {
            "a": torch.randn(3, 1000, generator=g),
            "b": torch.randn(1_250_001, generator=g),  # 5 MB, not a multiple of the slot size
            "c": torch.arange(10, dtype=torch.int8) + seed,
            "d": torch.randn(400_000, generator=g).double(),
            "e": torch.empty(0),
            "t": torch.randn(512, 700, generator=g).t(),  # non-contiguous
            "f": torch.randint(0, 2, (300_000,), generator=g).bool(),
        },
        [],
    )


@pytest.mark.parametrize("budget", [MIN_BUDGET, 3 * MIN_BUDGET, 64 * MIN_BUDGET])
def test_budgeted_save_holds_the_state_as_of_the_call(tmp_path, budget):
    """Streamed through a budget smaller than the state (or snapshotted whole when it fits), the
    checkpoint holds the values at the call although every leaf changes as soon as save returns."""
    td = _mixed(0)
    for step in range(2):
        expected = td.clone()
        fut = tddist.save(td, tmp_path / "ckpt", return_early=True, snapshot_budget=budget)
        for v in td.values():
            v.copy_(torch.zeros_like(v) if v.dtype == torch.bool else v + 1)
        out = fut.result(60)
        assert_td_equal(out, expected, f"what save returned (step {step})")
        assert_td_equal(tddist.load(tmp_path / "ckpt", shard=None, verify=True), expected, f"step {step}")
    ch = background.channel(resolve())
    if budget < 20 * 1024 * 1024:  # streamed: only the arena is held, never whole-state buffers
        assert ch.arena is not None and ch.arena.nslots * ch.arena.slot_bytes <= budget
        assert ch.buffers.nbytes() == 0
    else:
        assert ch.arena is None and ch.buffers.nbytes() > 0


def test_budgeted_save_on_thread_ranks(tmp_path):
    """Each rank streams its own rows (ranks decide alone whether to stream); the global rows are every rank's."""

    def rank_fn(comm):
        td = TensorDict(w=torch.arange(6000 * 100, dtype=torch.float32).view(6000, 100) + comm.rank, batch_size=[6000])
        budget = MIN_BUDGET if comm.rank else 16 * MIN_BUDGET  # rank 1 streams, rank 0 snapshots whole
        fut = tddist.save(td, tmp_path / "t", comm=comm, return_early=True, snapshot_budget=budget)
        td["w"].zero_()
        fut.result(60)
        return True

    assert tddist.run_threads(2, rank_fn, timeout=60) == [True, True]
    full = tddist.load(tmp_path / "t", shard=None, verify=True)
    rows = torch.arange(6000 * 100, dtype=torch.float32).view(6000, 100)
    assert torch.equal(full["w"], torch.cat([rows, rows + 1]))


def test_budgeted_save_that_fails_before_writing_returns_and_raises(tmp_path):
    """A commit that fails before the first slot is written (the target is a file) wakes the caller
    waiting for a slot: save returns, its future raises, and nothing is left beside the target."""
    target = tmp_path / "file"
    target.write_bytes(b"not a checkpoint")
    td = TensorDict(w=torch.randn(4 * 1024 * 1024), batch_size=[])  # 16 MiB through 1 MiB
    fut = tddist.save(td, target, return_early=True, snapshot_budget=MIN_BUDGET)
    err = fut.exception(60)
    assert isinstance(err, tddist.errors.TargetError), repr(err)
    assert target.read_bytes() == b"not a checkpoint"
    assert leftovers(target) == []
    # the channel is usable again
    tddist.save(td, tmp_path / "ok", return_early=True, snapshot_budget=MIN_BUDGET).result(60)
    assert torch.equal(tddist.load(tmp_path / "ok", shard=None, verify=True)["w"], td["w"])


@pytest.mark.parametrize(
    "kwargs,words",
    [
        ({"snapshot_budget": MIN_BUDGET}, "return_early=True"),
        ({"return_early": True, "snapshot_budget": 1000}, "at least"),
        ({"return_early": True, "snapshot_budget": MIN_BUDGET, "archive": True}, "packed directory"),
        ({"return_early": True, "snapshot_budget": MIN_BUDGET, "layout": "memmap"}, "packed directory"),
        ({"return_early": True, "snapshot_budget": MIN_BUDGET, "check_replicas": True}, "check_replicas"),
    ],
)
def test_budget_arguments_refused(tmp_path, kwargs, words):
    with pytest.raises(tddist.errors.InvalidArgumentError, match=words):
        tddist.save(TensorDict(w=torch.zeros(4), batch_size=[]), tmp_path / "x", **kwargs)


RSS_CODE = r"""
import gc, os, sys
import torch
from tensordict import TensorDict
import tddist

def status(field):
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024

root, budget = sys.argv[1], int(sys.argv[2]) or None
td = TensorDict({f"w{i}": torch.randn(1024 * 1024) for i in range(12)}, [])  # 48 MiB
small = TensorDict(w=torch.randn(1024), batch_size=[])
tddist.save(small, os.path.join(root, "warm"), return_early=True).result()  # threads, channel, imports
gc.collect()
with open("/proc/self/clear_refs", "w") as f:
    f.write("5")  # VmHWM := VmRSS
before = status("VmRSS")
for step in range(2):
    fut = tddist.save(td, os.path.join(root, "ckpt"), return_early=True, snapshot_budget=budget)
    td["w0"].add_(1)
    fut.result()
    del fut
print(status("VmHWM") - before)
"""


def _peak_added(tmp_path, budget: int) -> int:
    env = dict(os.environ, OMP_NUM_THREADS="1")
    out = subprocess.run(
        [sys.executable, "-c", RSS_CODE, str(tmp_path), str(budget)],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    return int(out.stdout.strip().splitlines()[-1])


def test_snapshot_budget_bounds_peak_rss(tmp_path):
    """48 MiB saved twice with an 8 MiB budget: the peak RSS added (VmHWM after resetting it) stays under
    the budget plus 6 MiB; without a budget the whole-state snapshot shows (the measurement can see it)."""
    require(
        "/proc/self/clear_refs", "resets the peak RSS (Linux)", available=os.access("/proc/self/clear_refs", os.W_OK)
    )
    mib = 1024 * 1024
    budgeted = _peak_added(tmp_path / "b", 8 * mib)
    assert budgeted < 8 * mib + 6 * mib, f"{budgeted / mib:.1f} MiB added with an 8 MiB budget"
    whole = _peak_added(tmp_path / "w", 0)
    assert whole > 45 * mib, f"{whole / mib:.1f} MiB added by whole-state snapshots"


def test_cuda_snapshot_is_pinned_on_a_side_stream_and_ordered_before_later_updates(tmp_path):
    """A CUDA leaf is copied into a pinned buffer on a side stream; an in-place update queued on the
    current stream right after save returns does not reach the checkpoint (the stream waits on the copy)."""
    require("cuda", "snapshots of CUDA tensors", available=torch.cuda.is_available())  # may skip in CI: hardware
    torch.cuda.synchronize()
    w = torch.randn(4096, 4096, device="cuda")  # 64 MiB: the copy takes long enough to race with the update
    expected = w.cpu()
    td = TensorDict(w=w, batch_size=[])
    fut = tddist.save(td, tmp_path / "c", return_early=True)
    w.mul_(0).add_(7)  # queued on the current stream while the copy may still run
    out = fut.result(60)
    assert torch.equal(out["w"], expected)
    ch = background.channel(resolve())
    buf = ch.buffers._buffers[("w",)]
    assert buf.is_pinned()
    assert torch.equal(tddist.load(tmp_path / "c", shard=None, verify=True)["w"], expected)
    # the budgeted path copies CUDA leaves too
    fut = tddist.save(td, tmp_path / "b", return_early=True, snapshot_budget=4 * MIN_BUDGET)
    w.add_(1)
    fut.result(60)
    assert (tddist.load(tmp_path / "b", shard=None, verify=True)["w"] == 7).all()


def test_background_saves_run_below_the_trainings_cpu_priority(tmp_path):
    """The worker thread of return_early saves (and the threads it starts) runs at a higher nice value than the
    training thread, whose own priority is untouched; the writer process is checked below."""
    mine = os.getpriority(os.PRIO_PROCESS, 0)
    fut = tddist.save({"w": torch.zeros(1000)}, tmp_path / "ckpt", return_early=True)
    fut.result()
    worker = background.channel(resolve())._worker
    assert worker is not None and worker.thread.native_id is not None
    assert os.getpriority(os.PRIO_PROCESS, worker.thread.native_id) == min(19, mine + background.BACKGROUND_NICENESS)
    assert os.getpriority(os.PRIO_PROCESS, 0) == mine


def test_process_writer_in_one_process(tmp_path):
    """async_writer='process' on one process: the writer process commits; the values at the call are saved,
    the arena is reused by the next save, and its shared file is gone once the writer mapped it."""
    before = set(os.listdir("/dev/shm")) if os.path.isdir("/dev/shm") else set()
    td = _mixed(1)
    ch = background.channel(resolve())
    for step in range(2):
        expected = td.clone()
        fut = tddist.save(td, tmp_path / "p", return_early=True, async_writer="process")
        for v in td.values():
            v.copy_(torch.zeros_like(v) if v.dtype == torch.bool else v + 1)
        assert_td_equal(fut.result(120), expected, f"what save returned (step {step})")
        assert_td_equal(tddist.load(tmp_path / "p", shard=None, verify=True), expected, f"step {step}")
        writer = ch._process
        assert writer is not None and writer.alive() and writer.process.pid != os.getpid()
        if step == 0:
            first = (writer, writer.path)
    assert (writer, writer.path) == first  # one writer, one arena
    mine = os.getpriority(os.PRIO_PROCESS, 0)
    assert os.getpriority(os.PRIO_PROCESS, writer.process.pid) == min(19, mine + background.BACKGROUND_NICENESS)
    if os.path.isdir("/dev/shm"):
        assert not [n for n in set(os.listdir("/dev/shm")) - before if n.startswith("tddist-writer")]


def test_the_saved_tensordict_is_held_only_by_the_caller(tmp_path):
    """Once the caller drops the future and what it returned, no map of the checkpoint's files is left in the
    process (the worker and the channel keep neither): the maps go when the caller lets go of them, not in
    the middle of a later save, where unmapping them cost that save about 20 ms for 64 MiB."""
    td = _mixed(5)
    fut = tddist.save(td, tmp_path / "held", return_early=True)
    out = fut.result(120)
    assert_td_equal(out, td, "what save returned")
    data_files = {os.path.realpath(p) for p in (tmp_path / "held").rglob("*") if p.is_file()}

    def mapped() -> set[str]:
        with open("/proc/self/maps") as f:
            return {line.split(None, 5)[5].strip() for line in f if len(line.split(None, 5)) == 6} & data_files

    assert mapped(), "the saved TensorDict maps the checkpoint's data file (the check can see a map)"
    del fut, out
    import gc

    gc.collect()
    assert not mapped(), f"still mapped after the caller dropped the result: {sorted(mapped())}"


def test_a_future_returns_once_its_worker_holds_nothing_of_the_save(monkeypatch):
    """The worker still runs for a moment after it resolves a save's future (the rest of its job); ``result()``
    waits for that, so the value the caller gets is held by nobody else once the caller drops it. Here the
    worker lingers 0.2 s after each job: the value must still die with the caller's last reference."""
    run_job = background._run_job

    def slow_to_return(job):
        run_job(job)
        time.sleep(0.2)  # like a worker descheduled right after it resolved the future

    monkeypatch.setattr(background, "_run_job", slow_to_return)

    class Saved:  # stands for the TensorDict a save returns (which maps the checkpoint's files)
        pass

    worker = background.Worker("test-linger", background=False)
    try:
        for _ in range(3):
            fut, _done = worker.submit(Saved)
            value = weakref.ref(fut.result(10))
            del fut
            assert value() is None, "the worker still held the save's value after result() returned"
        failed, _done = worker.submit(lambda: 1 / 0)
        assert isinstance(failed.exception(10), ZeroDivisionError)
    finally:
        worker.stop()


def test_saves_that_alternate_between_states_reuse_one_arena(tmp_path):
    """Two states of 8 and 12 MiB saved in turn on one communicator, and a state with nothing to copy between
    them: the arena is allocated for the first state and grown once for the larger one, then kept (it holds
    either state, and is less than twice the smaller one's); every checkpoint holds its own state."""
    ch = background.channel(resolve())
    ch.arena = None  # earlier tests in this process may have left one that fits
    small = TensorDict({f"s{i}": torch.randn(2**18) for i in range(8)}, [])  # 8 MiB
    large = TensorDict({f"l{i}": torch.randn(2**18) for i in range(12)}, [])  # 12 MiB
    nothing = TensorDict({"e": torch.empty(0), "n": torch.empty(0, 3)}, [])
    before = ch.arena_allocations
    grown = []
    for i, state in enumerate([small, large, nothing, small, large, nothing, small]):
        tddist.save(state, tmp_path / f"c{i}", return_early=True).result()
        grown.append(ch.arena_allocations - before)
        assert_td_equal(tddist.load(tmp_path / f"c{i}", shard=None, verify=True), state)
        state.apply_(lambda t: t.add_(1))  # the next save of it must see the change
    assert grown == [1, 2, 2, 2, 2, 2, 2], grown


def test_a_pipelined_save_leaves_the_callers_tensors_resizable_and_reads_no_maps(tmp_path, monkeypatch):
    """The shared copy reads the leaves by address: it does not export them to numpy, which would mark their
    storages not resizable for good (a later ``resize_`` of a training buffer would fail) and send every later
    save's map check to ``/proc/self/maps``. Three saves read the maps file never; the checkpoints hold the
    state as of each call."""
    from tddist.saving import memmaps as _memmaps

    reads = []
    real = _memmaps.file_mappings
    monkeypatch.setattr(_memmaps, "file_mappings", lambda: reads.append(1) or real())
    td = TensorDict({"w": torch.randn(2**18), "b": torch.arange(1000.0), "n": torch.ones(3, 5, dtype=torch.int8)}, [])
    for i in range(3):
        tddist.save(td, tmp_path / f"c{i}", return_early=True).result()
        assert_td_equal(tddist.load(tmp_path / f"c{i}", shard=None, verify=True), td)
        td.apply_(lambda t: t.add_(1))
    assert reads == []
    assert all(t.untyped_storage().resizable() for t in td.values())
    td["b"].resize_(2000)  # a training buffer grown in place


def test_a_return_early_save_resolves_before_the_checkpoint_it_replaced_is_removed(tmp_path, monkeypatch):
    """The future resolves at the commit: the removal of the replaced checkpoint follows on the worker, the
    next save on the channel waits for it, and a synchronous save removes it before returning."""
    import threading

    from tddist.storage import base

    gate, removed = threading.Event(), []
    real = base.discard

    def held_discard(path: str, readers: bool = False) -> None:
        assert gate.wait(60), "the test never opened the gate"
        real(path, readers)
        removed.append(path)

    target = tmp_path / "ckpt"
    state = lambda v: TensorDict({"w": torch.full((1024,), float(v)), "b": torch.arange(7) + v}, [])
    tddist.save(state(1), target)
    monkeypatch.setattr(base, "discard", held_discard)
    tddist.save(state(2), target, return_early=True).result(timeout=60)  # resolved while the removal waits
    assert_td_equal(tddist.load(target, verify=True), state(2))
    assert len(leftovers(target)) == 1 and not removed  # the old copy, at its staging name
    later = tddist.save(state(3), target, return_early=True)
    time.sleep(0.3)
    assert not later.done() and not removed, "the next save committed before the previous removal"
    gate.set()
    later.result(timeout=60)
    deadline = time.monotonic() + 60
    while len(removed) < 2 and time.monotonic() < deadline:  # the worker removes both old copies in turn
        time.sleep(0.01)
    assert len(removed) == 2 and leftovers(target) == []
    tddist.save(state(4), target)  # synchronous: removes what it replaced before returning
    assert leftovers(target) == [] and len(removed) == 3
    assert_td_equal(tddist.load(target, verify=True), state(4))


@pytest.mark.parametrize("ranks_on_node", [1, 64])
def test_a_large_return_early_save_is_written_while_it_is_copied(tmp_path, monkeypatch, ranks_on_node):
    """A state of ``EARLY_WRITE_MIN`` bytes whose copies are slowed down: with a core per rank beside its
    caller (one rank on this node), the early writer thread writes slots of the data file before ``save``
    returns; with as many ranks as torchrun says (64 on this node) it writes none, the worker writes all
    after the copy. Either way the checkpoint holds the state as of the call (the training changes it right
    after), checksums verified."""
    from tddist.saving import early as early_mod
    from tddist.saving import stream as stream_mod

    if len(os.sched_getaffinity(0)) < 2:
        pytest.skip("a spare core per rank needs 2 cores here")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", str(ranks_on_node))

    copy, write = stream_mod.copy_bytes, stream_mod.write_and_start_writeback
    writers: list[str] = []

    def slow_copy(destination: int, source: int, nbytes: int) -> None:
        copy(destination, source, nbytes)
        time.sleep(0.005)

    def recording_write(fd, view, at, step):
        writers.append(threading.current_thread().name)
        write(fd, view, at, step)

    monkeypatch.setattr(stream_mod, "copy_bytes", slow_copy)
    monkeypatch.setattr(stream_mod, "write_and_start_writeback", recording_write)
    n = early_mod.EARLY_WRITE_MIN // 4 // 16
    td = TensorDict({f"w{i}": torch.randn(n) for i in range(16)}, [])
    expected = td.clone()
    fut = tddist.save(td, tmp_path / "ckpt", return_early=True)
    written_before_return = list(writers)
    td.apply_(lambda t: t.add_(1))  # the training goes on
    fut.result()
    early = [w for w in written_before_return if w.startswith("tddist-early-write-rank0")]
    assert bool(early) is (ranks_on_node == 1), written_before_return
    assert ranks_on_node == 1 or not any(w.startswith("tddist-early-write") for w in writers), writers
    assert_td_equal(tddist.load(tmp_path / "ckpt", shard=None, verify=True), expected)


def test_the_ranks_on_this_node_are_read_from_the_launcher():
    """torchrun's, Open MPI's, Hydra's and srun's counts of the ranks on this node, in that order; 1 where none
    is set or a value is not a positive number."""
    from tddist.comm.node import ranks_on_this_node

    assert ranks_on_this_node({}) == 1
    assert ranks_on_this_node({"LOCAL_WORLD_SIZE": "4", "OMPI_COMM_WORLD_LOCAL_SIZE": "8"}) == 4
    assert ranks_on_this_node({"OMPI_COMM_WORLD_LOCAL_SIZE": "8"}) == 8
    assert ranks_on_this_node({"MPI_LOCALNRANKS": "3"}) == 3
    assert ranks_on_this_node({"SLURM_NTASKS_PER_NODE": "2"}) == 2
    assert ranks_on_this_node({"LOCAL_WORLD_SIZE": "0", "SLURM_NTASKS_PER_NODE": "x", "MPI_LOCALNRANKS": "5"}) == 5


KILLED_WHILE_WRITING_EARLY = r"""
import os, sys, threading, time
import torch
from tensordict import TensorDict
import tddist
from tddist.saving import early, stream

target = sys.argv[1]
n = early.EARLY_WRITE_MIN // 4 // 16
tddist.save(TensorDict({f"w{i}": torch.full((n,), 1.0) for i in range(16)}, []), target)  # the old checkpoint
copy, write = stream.copy_bytes, stream.write_and_start_writeback

def slow_copy(destination, source, nbytes):
    copy(destination, source, nbytes)
    time.sleep(0.01)

def announced_write(fd, view, at, step):
    write(fd, view, at, step)
    if threading.current_thread().name.startswith("tddist-early-write"):
        print("early write", flush=True)
        time.sleep(0.05)

stream.copy_bytes, stream.write_and_start_writeback = slow_copy, announced_write
tddist.save(TensorDict({f"w{i}": torch.full((n,), 2.0) for i in range(16)}, []), target, return_early=True)
print("returned", flush=True)
time.sleep(60)
"""


def test_a_kill_during_early_writes_leaves_the_old_checkpoint_and_recover_clears_the_staging(tmp_path):
    """A process replacing a checkpoint with a large ``return_early`` save is SIGKILLed while its early writer
    is writing the new data file (before ``save`` returned): the target still loads, verified, as the old
    checkpoint; ``recover`` removes the staging directory the save left, and nothing else is beside it."""
    if len(os.sched_getaffinity(0)) < 2:
        pytest.skip("the early writer needs a spare core per rank, 2 cores here")
    target = tmp_path / "ckpt"
    env = dict(os.environ, OMP_NUM_THREADS="1", LOCAL_WORLD_SIZE="1")
    proc = subprocess.Popen(
        [sys.executable, "-c", KILLED_WHILE_WRITING_EARLY, str(target)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
    )  # fmt: skip
    try:
        assert proc.stdout is not None
        first = proc.stdout.readline()  # blocks until the first early write (or the end of the child)
        proc.kill()
        proc.wait(30)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert first == "early write\n", (first, proc.stderr.read()[-3000:] if proc.stderr else "")
    assert proc.returncode == -9
    assert leftovers(target)  # the staging directory of the killed save
    old = tddist.load(target, shard=None, verify=True)
    assert all(bool((t == 1.0).all()) for t in old.values())
    tddist.recover(target)
    assert leftovers(target) == []
    assert_td_equal(tddist.load(target, shard=None, verify=True), old)
