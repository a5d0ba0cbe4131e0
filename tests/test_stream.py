"""The arena streams of asynchronous saves (tddist/stream.py), in one process, on real files.

A pipelined ``return_early`` save copies the whole state into the arena on two threads (the caller from the
first slot on, a helper thread from the last one back) while an early writer writes the slots the caller has
copied, at the disk's pace, and the writer the rest once every byte is copied; a
budgeted one copies slot by slot while the writer writes and frees them. Both must lay every byte at its
packed offset with the checksums of a plain save, and neither thread may wait forever for the other.
"""

from __future__ import annotations

import errno
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
import torch

from tddist import format as fmt
from tddist.checksum import checksum_bytes
from tddist.manifest.locate import packed_offsets
from tddist.saving import slots as slots_mod
from tddist.saving import stream as stream_mod
from tddist.saving.arena import Arena
from tddist.saving.slots import fill_slots, whole_state_budget
from tddist.saving.stream import Stream

#: Leaf sizes in bytes: empty, tiny, unaligned, one that spans several slots and checksum blocks.
SIZES = [0, 1, 63, 64, 65, 1000, 4096, 10_000, 7, 3 * 4096 + 5]


@pytest.fixture
def small_blocks(monkeypatch):
    """Checksum blocks of 1 KiB, so that leaves cross block boundaries at test sizes."""
    monkeypatch.setattr(fmt, "CHECKSUM_BLOCK", 1024)


def _items(sizes: list[int], seed: int = 0) -> list[tuple[tuple[str, ...], torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [((f"l{i}",), torch.randint(0, 256, (n,), dtype=torch.uint8, generator=g)) for i, n in enumerate(sizes)]


def _packed_file(items) -> bytes:
    """The rank's packed data file, built from the specification: each leaf at its aligned offset, zeros between."""
    sizes = np.array([t.numel() for _k, t in items], dtype=np.int64)
    offsets, end = packed_offsets(sizes)
    out = bytearray(int(end))
    for (_k, t), o in zip(items, offsets.tolist()):
        out[o : o + t.numel()] = t.numpy().tobytes()
    return bytes(out)


@pytest.mark.parametrize("slot_bytes", [64, 128, 1024, 4096, 1 << 20])
def test_the_plan_lays_every_byte_at_its_packed_offset_once(small_blocks, slot_bytes):
    """Slots hold increasing, disjoint file ranges of at most a slot each; every piece sits at its leaf's packed
    offset, inside one checksum block of its leaf; together the pieces cover every leaf byte exactly once."""
    offsets, _end = packed_offsets(np.array(SIZES, dtype=np.int64))
    offsets_l = [int(o) for o in offsets.tolist()]
    plan = fill_slots(SIZES, offsets_l, slot_bytes)
    covered = [np.zeros(n, dtype=np.int64) for n in SIZES]
    last_end = 0
    for entry in plan:
        assert entry.slot == -1
        assert entry.file_start >= last_end and 0 < entry.nbytes <= slot_bytes
        last_end = entry.file_start + entry.nbytes
        fill = 0
        for idx, at, lo, k in entry.pieces:
            assert lo >= fill and k > 0
            assert entry.file_start + lo == offsets_l[idx] + at  # the piece's place in the file
            assert at // 1024 == (at + k - 1) // 1024  # inside one checksum block
            covered[idx][at : at + k] += 1
            fill = lo + k
        assert fill == entry.nbytes
    assert all((c == 1).all() for c in covered)


@pytest.mark.parametrize(
    ("split", "write_threads"), [("both", 1), ("both", 3), ("caller alone", 2), ("writer alone", 1)]
)
def test_a_whole_stream_is_copied_by_either_thread_and_written_as_packed(tmp_path, small_blocks, split, write_threads):
    """The caller and the writer copy from both ends (or one of them copies everything); the data file is the
    packed layout byte for byte and each leaf's checksum is that of its bytes; nothing changes the sources."""
    items = _items(SIZES)
    before = [t.clone() for _k, t in items]
    arena = Arena(whole_state_budget(items, 128), slot=128)
    stream = Stream(arena, items, rank=0)
    assert stream.whole and len(stream.fills) > 4
    if split == "writer alone":
        stream.help()
        stream.produce()
    elif split == "caller alone":
        stream.produce()
        stream.help()
    else:
        helper = threading.Thread(target=stream.help)
        helper.start()
        stream.produce()
        helper.join(10)
    stored = stream.consume(str(tmp_path / "rank-00000.data"), write_threads)
    assert (tmp_path / "rank-00000.data").read_bytes() == _packed_file(items)
    for (key, t), b in zip(items, before):
        assert stored[key].nbytes == t.numel()
        assert stored[key].checksum == checksum_bytes(t.numpy().tobytes()), key
        assert torch.equal(t, b)


def test_the_helper_copies_from_the_back_while_the_caller_is_slow(tmp_path, small_blocks):
    """With the caller slowed down, the helper copies slots from the back, so the caller copies fewer."""
    items = _items([4096] * 16)
    stream = Stream(Arena(whole_state_budget(items, 1024), slot=1024), items, rank=0)
    copied_by: dict[int, str] = {}
    fill = stream._fill_shared
    caller_started = threading.Event()

    def recording_fill(i: int) -> None:
        copied_by[i] = threading.current_thread().name
        if threading.current_thread() is threading.main_thread():
            caller_started.set()
            time.sleep(0.01)  # a slow caller: the helper takes the other end meanwhile
        else:  # the helper took its first slot (from the back) but copies only once the caller has begun:
            caller_started.wait(10)  # started first, it could copy every slot before the caller takes one
        fill(i)

    stream._fill_shared = recording_fill  # type: ignore[method-assign]
    helper = threading.Thread(target=stream.help, name="helper")
    helper.start()
    stream.produce()
    helper.join(10)
    names = [copied_by[i] for i in range(len(stream.fills))]
    assert set(names) == {"MainThread", "helper"}, names
    first_helped = names.index("helper")
    assert names[:first_helped] == ["MainThread"] * first_helped and set(names[first_helped:]) == {"helper"}
    stream.consume(str(tmp_path / "d"))
    assert (tmp_path / "d").read_bytes() == _packed_file(items)


def _start(fn) -> tuple[threading.Thread, list[BaseException]]:
    """Run ``fn`` on a new thread; the list receives what it raised, if anything."""
    raised: list[BaseException] = []

    def run() -> None:
        try:
            fn()
        except BaseException as e:
            raised.append(e)

    t = threading.Thread(target=run)
    t.start()
    return t, raised


def _waits_until(wait, release, why: str) -> None:
    """``wait``, run on a thread, still waits 0.3 s later and returns once ``release`` has run."""
    t = threading.Thread(target=wait)
    t.start()
    t.join(0.3)
    assert t.is_alive(), why
    release()
    t.join(10)
    assert not t.is_alive()


def test_a_cancelled_save_wakes_a_caller_waiting_for_the_writers_slot(small_blocks):
    """The writer took the last slot and then failed (cancel): the caller, done with the others, returns."""
    items = _items([4096] * 4)
    stream = Stream(Arena(whole_state_budget(items, 1024), slot=1024), items, rank=0)
    assert stream._take_assigned(front=False) == len(stream.fills) - 1  # the writer's, never copied
    _waits_until(stream.produce, stream.cancel, "the caller waits for the writer's slot")


def test_the_writer_starts_only_once_the_caller_is_done_with_the_stream(tmp_path, small_blocks):
    """Every byte is copied (by the helper alone) before the caller even starts: the writer still waits until
    the caller's ``produce`` has returned, so it never takes the interpreter from a caller returning from
    ``save``; then it writes the packed file."""
    items = _items([4096] * 4)
    stream = Stream(Arena(whole_state_budget(items, 1024), slot=1024), items, rank=0)
    stream.help()
    assert stream._copied.is_set()
    _waits_until(stream.wait_copied, stream.produce, "the writer went ahead while the caller was still inside save")
    stream.consume(str(tmp_path / "d"))
    assert (tmp_path / "d").read_bytes() == _packed_file(items)


def _failing_copies_of(monkeypatch, leaf: torch.Tensor) -> None:
    """Every copy out of ``leaf``'s bytes raises (an injected failure of the copy itself)."""
    lo, hi = leaf.data_ptr(), leaf.data_ptr() + leaf.numel() * leaf.element_size()
    copy = stream_mod.copy_bytes

    def failing(destination: int, source: int, nbytes: int) -> None:
        if lo <= source < hi:
            raise RuntimeError("injected copy failure")
        copy(destination, source, nbytes)

    monkeypatch.setattr(stream_mod, "copy_bytes", failing)


def test_an_error_in_the_helper_wakes_the_caller_and_fails_the_writer(tmp_path, small_blocks, monkeypatch):
    """The helper's copy fails: the helper raises, the caller waiting for the helper's slot returns instead of
    waiting forever, and the writer starts and raises the helper's error."""
    items = _items([4096] * 8)
    stream = Stream(Arena(whole_state_budget(items, 1024), slot=1024), items, rank=0)
    _failing_copies_of(monkeypatch, items[-1][1])  # the helper starts from the back: its first copy fails
    h, helper_error = _start(stream.help)
    h.join(10)
    caller = threading.Thread(target=stream.produce)
    caller.start()
    caller.join(10)
    assert not h.is_alive() and not caller.is_alive()
    assert len(helper_error) == 1 and isinstance(helper_error[0], RuntimeError), helper_error
    stream.wait_copied()  # returns: the save failed
    with pytest.raises(RuntimeError) as raised:
        stream.consume(str(tmp_path / "d"))
    assert raised.value is helper_error[0]


def test_an_error_while_copying_reaches_the_writer_instead_of_a_wait(tmp_path, small_blocks, monkeypatch):
    """A copy that fails on the caller's thread raises there, and the writer raises the same error (this
    rank's failed vote) instead of waiting for bytes that never come."""
    items = _items([4096] * 4)
    stream = Stream(Arena(whole_state_budget(items, 1024), slot=1024), items, rank=0)
    _failing_copies_of(monkeypatch, items[1][1])
    with pytest.raises(RuntimeError):
        stream.produce()
    t, outcome = _start(lambda: stream.consume(str(tmp_path / "d")))
    t.join(10)
    assert not t.is_alive() and len(outcome) == 1 and isinstance(outcome[0], RuntimeError), outcome


@pytest.mark.parametrize("write_threads", [1, 2])
def test_a_bounded_stream_reuses_its_slots_while_the_writer_writes(tmp_path, small_blocks, write_threads):
    """Two slots for a state of many: the caller waits for freed slots, the writer frees each once written
    (by one write thread or several); the file is the packed layout and the checksums those of the bytes."""
    items = _items(SIZES, seed=1)
    stream = Stream(Arena(256, slot=128), items, rank=0)
    assert not stream.whole and stream.arena.nslots == 2 < len(stream.fills)
    stored: dict = {}
    writer = threading.Thread(target=lambda: stored.update(stream.consume(str(tmp_path / "d"), write_threads)))
    writer.start()
    stream.produce()
    writer.join(10)
    assert (tmp_path / "d").read_bytes() == _packed_file(items)
    assert all(stored[k].checksum == checksum_bytes(t.numpy().tobytes()) for k, t in items)


def _with_early_writer(stream: Stream) -> ThreadPoolExecutor:
    """Give ``stream`` an early writer thread, as ``Channel.write_early`` does (shut the pool down after)."""
    pool = ThreadPoolExecutor(1, thread_name_prefix="early")
    stream.early_writes = pool.submit
    return pool


def _slow_caller(stream: Stream, seconds: float) -> None:
    """The caller's (and the helper's) copies of ``stream`` each take ``seconds`` longer."""
    fill = stream._fill_shared

    def slow_fill(i: int) -> None:
        fill(i)
        time.sleep(seconds)

    stream._fill_shared = slow_fill  # type: ignore[method-assign]


def _save_with_early_writer(stream: Stream, path, items, slow: float, write_threads: int, helped: bool) -> None:
    """Save ``stream`` of ``items`` to ``path`` with an early writer, the caller's copies ``slow`` seconds longer
    (and the helper copying from the back if ``helped``); the file must be the packed layout and each leaf's
    checksum that of its bytes, with no thread left behind."""
    pool = _with_early_writer(stream)
    _slow_caller(stream, slow)
    stored: dict = {}
    writer = threading.Thread(target=lambda: stored.update(stream.consume(str(path), write_threads)))
    writer.start()
    helper = threading.Thread(target=stream.help if helped else lambda: None)
    helper.start()
    stream.produce()
    helper.join(10)
    writer.join(10)
    pool.shutdown()
    assert not writer.is_alive() and not helper.is_alive()
    assert path.read_bytes() == _packed_file(items)
    assert all(stored[k].checksum == checksum_bytes(t.numpy().tobytes()) for k, t in items)


def test_the_early_writer_writes_the_copied_slots_in_file_order_at_the_disks_pace(tmp_path, small_blocks, monkeypatch):
    """While a slow caller copies, the early writer hashes and writes the slots it copied, in file order, on its
    own thread; before each it waits for the write-back of the slot ``EARLY_IN_FLIGHT`` before (the throttle).
    The writer writes the rest; the file and the checksums are those of a plain save."""
    events: list[tuple] = []
    write, wait = stream_mod.write_and_start_writeback, stream_mod.wait_for_writeback

    def recording_write(fd, view, at, step):
        events.append(("write", at, threading.current_thread().name, stream._copied.is_set()))
        write(fd, view, at, step)

    def recording_wait(fd, at, nbytes):
        events.append(("wait", at, nbytes))
        wait(fd, at, nbytes)

    monkeypatch.setattr(stream_mod, "write_and_start_writeback", recording_write)
    monkeypatch.setattr(stream_mod, "wait_for_writeback", recording_wait)
    items = _items([4096] * 16)
    stream = Stream(Arena(whole_state_budget(items, 1024), slot=1024), items, rank=0)
    _save_with_early_writer(stream, tmp_path / "d", items, 0.02, write_threads=2, helped=False)
    writes = [e for e in events if e[0] == "write"]
    assert sorted(e[1] for e in writes) == [f.file_start for f in stream.fills]  # each slot once
    early = [e for e in writes if e[2].startswith("early")]
    assert len(early) >= 8, events  # 16 slots copied 20 ms apart: the early writer keeps up with the copy
    assert [e[1] for e in early] == [f.file_start for f in stream.fills[: len(early)]]  # in file order
    assert writes[: len(early)] == early and not any(e[3] for e in early[:-1])  # first, before the copy ended
    k = stream_mod.EARLY_IN_FLIGHT
    for j, e in enumerate(early):
        before = events[events.index(e) - 1]
        if j >= k:
            f = stream.fills[j - k]
            assert before == ("wait", f.file_start, f.nbytes), (j, before)
        else:
            assert before[0] != "wait", (j, before)


def test_the_early_writer_leaves_the_slots_the_helper_copied_from_the_back_for_later(tmp_path, small_blocks):
    """The helper copies from the back while the slow caller copies from the front: the early writer still
    writes in file order, so the slots copied out of order wait until the front reaches them; the file is
    the packed layout."""
    items = _items([4096] * 16)
    stream = Stream(Arena(whole_state_budget(items, 1024), slot=1024), items, rank=0)
    _save_with_early_writer(stream, tmp_path / "d", items, 0.01, write_threads=1, helped=True)


@pytest.mark.parametrize(
    ("budgeted", "write_threads", "early"),
    [(False, 1, False), (False, 2, False), (True, 1, False), (True, 2, False), (False, 2, True)],
)
def test_a_failed_write_raises_in_the_writer_and_stops_the_caller(
    tmp_path, small_blocks, monkeypatch, budgeted, write_threads, early
):
    """The disk refuses the third slot's write (EIO, injected at the write call): the writer raises that error
    and the caller, even one waiting for a slot only a write would free (two slots), returns; none hangs. With
    an early writer (and a slow caller) the failing write is one made while the caller copies."""
    calls = {"n": 0}
    real = stream_mod.write_and_start_writeback

    def failing_write(fd, view, at, step):
        calls["n"] += 1
        if calls["n"] == 3:
            raise OSError(errno.EIO, "Input/output error (injected)")
        real(fd, view, at, step)

    monkeypatch.setattr(stream_mod, "write_and_start_writeback", failing_write)
    items = _items([4096] * 8)
    arena = Arena(256, slot=128) if budgeted else Arena(whole_state_budget(items, 1024), slot=1024)
    stream = Stream(arena, items, rank=0)
    assert stream.whole is not budgeted
    pool = _with_early_writer(stream) if early else None
    if early:
        _slow_caller(stream, 0.05)
    t, outcome = _start(lambda: stream.consume(str(tmp_path / "d"), write_threads))
    caller = threading.Thread(target=stream.produce)
    caller.start()
    caller.join(10)
    t.join(10)
    assert not caller.is_alive() and not t.is_alive()
    assert len(outcome) == 1 and isinstance(outcome[0], OSError) and outcome[0].errno == errno.EIO, outcome
    if pool is not None:
        pool.shutdown()
        assert stream._left > 0  # the copy stopped at the failure instead of going on to the end


def _save_whole(arena: Arena, items, path) -> Stream:
    """One whole-mode stream of ``items`` through ``arena``, copied by both threads and written to ``path``."""
    stream = Stream(arena, items, rank=0)
    assert stream.whole
    helper = threading.Thread(target=stream.help)
    helper.start()
    stream.produce()
    helper.join(10)
    stream.consume(str(path))
    return stream


def test_saves_of_the_same_sizes_reuse_the_slot_assignment_and_the_padding_stays_zero(tmp_path, small_blocks):
    """A second whole stream of the same sizes (new values) takes the same plan and zeroed gaps, whose
    padding it does not rewrite; a bounded stream through the same arena in between fills every slot with
    its own bytes, and the whole stream after it still writes zeros between the leaves."""
    items = _items(SIZES)
    arena = Arena(whole_state_budget(items, 128), slot=128)
    first = _save_whole(arena, items, tmp_path / "a")
    assert (tmp_path / "a").read_bytes() == _packed_file(items)

    again = _items(SIZES, seed=1)
    second = _save_whole(arena, again, tmp_path / "b")
    assert second.fills is first.fills and arena._zeroed_for is first.fills
    assert (tmp_path / "b").read_bytes() == _packed_file(again)

    larger = [((f"x{i}",), torch.full((3000,), 0xAB, dtype=torch.uint8)) for i in range(len(SIZES) * 2)]
    bounded = Stream(arena, larger, rank=0)
    assert not bounded.whole
    t, outcome = _start(lambda: bounded.consume(str(tmp_path / "bounded")))
    bounded.produce()
    t.join(10)
    assert not t.is_alive() and not outcome, outcome
    assert (arena.memory == 0xAB).sum() > 0  # the slots now hold the bounded save's bytes, gaps included

    third = _items(SIZES, seed=2)
    _save_whole(arena, third, tmp_path / "c")
    assert (tmp_path / "c").read_bytes() == _packed_file(third)


def test_a_slot_assignment_is_made_for_the_format_constants_in_force(monkeypatch):
    """The cached plan of some sizes is not reused under another checksum block (pieces never cross one)."""
    sizes = (5000, 3000)
    default = slots_mod.assign_slots(sizes, 4096)
    monkeypatch.setattr(fmt, "CHECKSUM_BLOCK", 1024)
    small = slots_mod.assign_slots(sizes, 4096)
    assert small is not default
    assert all(at // 1024 == (at + k - 1) // 1024 for e in small.fills for _i, at, _lo, k in e.pieces)
    assert slots_mod.assign_slots(sizes, 4096) is small
