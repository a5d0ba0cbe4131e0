"""Communicator conformance: the checks every tddist communicator must pass.

Modelled on zarr-python's ``StoreTests``: ``CommunicatorTests`` is one base
class of test methods, and every implementation subclasses it
(``tests/test_comm_conformance.py``): ``LocalComm`` and ``ThreadComm`` run
the checks in this process, ``TorchComm`` and ``MPIComm`` in ONE real job each
(torchrun with gloo, mpiexec), in which every rank runs every check and writes
a report; each test method then asserts that its check passed on every rank
and that every rank exited 0.

A check is ``check(ctx)``, run by every rank of a communicator at the same
time. It asserts (an ``AssertionError`` fails it) or returns ``SKIPPED`` with
a reason. ``ctx.comm`` is a communicator of its own for this check (in a job,
a fresh ``dup()`` of the communicator under test), so a check that fails half
way through cannot leave the next one out of step; ``ctx.short()`` gives this
rank's communicator over the same ranks with the short timeout ``ctx.short_timeout``.

As a rank program (started by the tests):
``python tests/comm_conformance.py torch|mpi`` under torchrun or mpiexec runs
every check and writes this rank's report (``tests.launch_util.write_report``):
``checks`` maps each check to "ok", "skipped: <why>" or the traceback. The
program exits 0 when it ran to the end, whatever the checks' outcomes (the
tests look at those), and 3 when the program itself broke.
"""

from __future__ import annotations

import os
import random
import sys
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

if __name__ == "__main__":  # run as a script: make ``tests`` importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import pytest
import torch

from tddist.comm.base import Communicator
from tddist.comm.collective import agree, run_step
from tddist.comm.threads import ThreadComm
from tddist.errors import CollectiveError, CommTimeoutError, TargetError, TddistError

#: Timeout of the communicators under test (generous: the machine may be busy).
CHECK_TIMEOUT = 30.0
#: Timeout of the communicator on which one rank never joins (the check waits this long).
SHORT_TIMEOUT = 3.0
#: How much later than its timeout a waiting rank may raise (scheduling, a loaded machine).
TIMEOUT_SLACK = 10.0
OK = "ok"
SKIPPED = "skipped"
MIB = 2**20


@dataclass
class Ctx:
    comm: Any  # this rank's communicator for the check
    short: Callable[[], Any]  # this rank's communicator with the short timeout (collective the first time)
    rank: int  # the rank the launcher gave this process (or thread)
    size: int  # the number of ranks
    short_timeout: float = SHORT_TIMEOUT


def _same_everywhere(comm, value, what: str) -> None:
    """Every rank holds the same ``value`` (compared by pickled bytes)."""
    everyone = comm.allgather(value)
    assert all(v == everyone[0] for v in everyone), f"{what} differs between ranks: {everyone}"


def _after_others(comm, local: Callable[[], None]) -> list:
    """Run this rank's ``local`` assertions, then learn every rank's outcome (one allgather).

    Keeps the ranks in step: a failed assertion on one rank does not leave the
    others waiting in a collective it never joins.
    """
    try:
        local()
        mine = None
    except AssertionError as e:
        mine = f"rank {comm.rank}: {e}"
    everyone = comm.allgather(mine)
    failed = [m for m in everyone if m is not None]
    assert not failed, "\n".join(map(str, failed))
    return everyone


# --- the checks ----------------------------------------------------------------------------


def check_rank_and_size(ctx: Ctx) -> None:
    """rank and size are the launcher's; the communicator implements the Communicator protocol."""
    comm = ctx.comm
    assert isinstance(comm, Communicator), f"{type(comm).__name__} does not implement Communicator"
    assert (comm.rank, comm.size) == (ctx.rank, ctx.size), f"rank/size {comm.rank}/{comm.size} != {ctx.rank}/{ctx.size}"
    assert isinstance(comm.rank, int) and isinstance(comm.size, int)
    ranks, sizes = comm.allgather(comm.rank), comm.allgather(comm.size)
    assert ranks == list(range(ctx.size)), f"allgather of the ranks gave {ranks}"
    assert sizes == [ctx.size] * ctx.size, f"allgather of the sizes gave {sizes}"


def check_barrier(ctx: Ctx) -> None:
    """No rank leaves a barrier before the last one entered it; barriers in a row work."""
    comm = ctx.comm
    for round_ in range(3):
        time.sleep(0.15 * ((comm.rank + round_) % comm.size))  # a different rank arrives last each round
        entered = time.time()
        comm.barrier()
        left = time.time()
        times = comm.allgather((entered, left))
        last_in = max(e for e, _ in times)
        early = {r: round(last_in - out, 3) for r, (_, out) in enumerate(times) if out < last_in - 0.002}
        assert not early, f"round {round_}: ranks left the barrier before the last one entered (seconds early): {early}"


def _payload(rank: int, tag: str) -> dict:
    """A distinct, structured object per rank: nested containers, a tensor, None, floats."""
    return {
        "tag": tag,
        "rank": rank,
        "list": [rank, None, float(rank) / 3, "é" * (rank + 1)],
        "tuple": (rank, (rank, rank)),
        "tensor": torch.arange(rank + 2, dtype=torch.float64) * (rank + 1),
        "bytes": bytes(range(rank, rank + 7)),
    }


def _equal(a, b) -> bool:
    """Deep equality; tensors by dtype, shape and values."""
    if type(a) is not type(b):
        return False
    if isinstance(a, torch.Tensor):
        return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
    if isinstance(a, dict):
        return list(a) == list(b) and all(_equal(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_equal(x, y) for x, y in zip(a, b))
    return a == b


def check_broadcast_from_every_root(ctx: Ctx) -> None:
    """broadcast(obj, root) gives every rank the root's object, whatever the others passed."""
    comm = ctx.comm
    results = {}
    for root in range(comm.size):
        mine = _payload(comm.rank, f"broadcast-{root}") if comm.rank == root else ("decoy", comm.rank)
        results[root] = comm.broadcast(mine, root=root)
    none = comm.broadcast(None, root=comm.size - 1)

    def local():
        for root, got in results.items():
            want = _payload(root, f"broadcast-{root}")
            assert _equal(got, want), f"broadcast from root {root} gave {got!r}, expected {want!r}"
        assert none is None, f"broadcast of None gave {none!r}"

    _after_others(comm, local)


def check_gather_to_every_root(ctx: Ctx) -> None:
    """gather(obj, root) gives the root every rank's object in rank order, and None to the others."""
    comm = ctx.comm
    results = {root: comm.gather(_payload(comm.rank, f"gather-{root}"), root=root) for root in range(comm.size)}

    def local():
        for root, got in results.items():
            if comm.rank != root:
                assert got is None, f"gather to root {root}: rank {comm.rank} (not the root) got {got!r}"
                continue
            want = [_payload(r, f"gather-{root}") for r in range(comm.size)]
            assert isinstance(got, list) and len(got) == comm.size, f"gather to root {root} gave {got!r}"
            wrong = [r for r in range(comm.size) if not _equal(got[r], want[r])]
            assert not wrong, f"gather to root {root}: entries {wrong} are not those ranks' objects: {got!r}"

    _after_others(comm, local)


def check_allgather_in_rank_order(ctx: Ctx) -> None:
    """allgather(obj) gives every rank every rank's object in rank order (None and odd types too)."""
    comm = ctx.comm
    got = comm.allgather(_payload(comm.rank, "allgather"))
    odd = [None, {"nested": [{1, 2}, frozenset()]}, 1.5e300, b"", "x" * 3, (None,)]
    mixed = comm.allgather(odd[comm.rank % len(odd)])
    nones = comm.allgather(None)

    def local():
        want = [_payload(r, "allgather") for r in range(comm.size)]
        assert isinstance(got, list) and len(got) == comm.size, f"allgather gave {got!r}"
        wrong = [r for r in range(comm.size) if not _equal(got[r], want[r])]
        assert not wrong, f"allgather: entries {wrong} are not those ranks' objects"
        assert mixed == [odd[r % len(odd)] for r in range(comm.size)], mixed
        assert nones == [None] * comm.size, nones

    _after_others(comm, local)


def check_received_objects_are_copies(ctx: Ctx) -> None:
    """An object received from another rank is a copy: a receiver mutating it changes nothing on the
    sender, and the sender mutating its object after the call changes nothing on the receivers."""
    comm = ctx.comm
    rank, size = comm.rank, comm.size

    def fresh(r: int) -> dict:
        return {"from": r, "items": [r], "t": torch.full((3,), float(r))}

    def state(obj: dict) -> tuple:
        return obj["from"], obj["items"], obj["t"].tolist()

    def mutate(obj: dict, who: str) -> None:
        obj["items"].append(who)
        obj["t"].add_(100)

    problems = []
    for root in range(size):  # broadcast: the receivers mutate what they got, then the root its original
        original = fresh(rank)
        got = comm.broadcast(original if rank == root else None, root=root)
        if rank != root:
            mutate(got, f"receiver {rank}")
        comm.barrier()
        if rank == root:
            if state(original) != state(fresh(rank)):
                problems.append(f"broadcast from {root}: a receiver's mutation reached the root: {state(original)}")
            mutate(original, "root")
        comm.barrier()
        if rank != root and state(got) != (root, [root, f"receiver {rank}"], [root + 100.0] * 3):
            problems.append(f"broadcast from {root}: rank {rank}'s copy changed: {state(got)}")

    for root in range(size):  # gather: the root mutates what the others sent
        original = fresh(rank)
        got = comm.gather(original, root=root)
        if rank == root:
            for r in range(size):
                if r != rank:
                    mutate(got[r], "root")
        comm.barrier()
        if state(original) != state(fresh(rank)):
            problems.append(f"gather to {root}: the root's mutation reached rank {rank}: {state(original)}")

    original = fresh(rank)  # allgather: every rank mutates the others' objects, then its own original
    got = comm.allgather(original)
    for r in range(size):
        if r != rank:
            mutate(got[r], f"rank {rank}")
    comm.barrier()
    if state(original) != state(fresh(rank)):
        problems.append(f"allgather: another rank's mutation reached rank {rank}: {state(original)}")
    mutate(original, "sender")
    comm.barrier()
    for r in range(size):
        if r != rank and state(got[r]) != (r, [r, f"rank {rank}"], [r + 100.0] * 3):
            problems.append(f"allgather: rank {rank}'s copy of rank {r}'s object changed: {state(got[r])}")
    _after_others(comm, lambda: not problems or _fail("; ".join(problems)))


def _fail(msg: str):
    raise AssertionError(msg)


def _join(threads: list[threading.Thread], timeout: float) -> list[str]:
    """Wait for ``threads`` until one shared deadline; the names of those still running."""
    deadline = time.monotonic() + timeout
    for t in threads:
        t.join(max(0.0, deadline - time.monotonic()))
    return [t.name for t in threads if t.is_alive()]


def _blob(rank: int, nbytes: int) -> bytes:
    return random.Random(rank).randbytes(nbytes)


def check_large_objects(ctx: Ctx) -> None:
    """Objects of several MiB (bytes and a tensor) go through broadcast, gather and allgather intact."""
    comm = ctx.comm
    rank, size = comm.rank, comm.size
    n = 6 * MIB + rank * 4099  # different sizes, not a multiple of any chunk size
    mine = _blob(rank, n)
    root = size - 1
    bc = comm.broadcast(mine if rank == root else None, root=root)
    ga = comm.gather(mine, root=0)
    ag = comm.allgather(mine)
    t = torch.arange(MIB, dtype=torch.float32) + rank  # 4 MiB
    tb = comm.broadcast(t if rank == 0 else None, root=0)

    def local():
        sizes = [6 * MIB + r * 4099 for r in range(size)]
        assert bc == _blob(root, sizes[root]), f"broadcast of {sizes[root]} bytes from rank {root} arrived changed"
        if rank == 0:
            bad = [r for r in range(size) if ga[r] != _blob(r, sizes[r])]
            assert not bad, f"gather: the large objects of ranks {bad} arrived changed"
        else:
            assert ga is None
        bad = [r for r in range(size) if ag[r] != _blob(r, sizes[r])]
        assert not bad, f"allgather: the large objects of ranks {bad} arrived changed"
        assert tb.dtype == torch.float32 and torch.equal(tb, torch.arange(MIB, dtype=torch.float32)), "tensor"

    _after_others(comm, local)


def check_objects_of_mixed_sizes(ctx: Ctx) -> None:
    """In one collective, some ranks' objects are tiny and others' are just under, at and over 64 KiB (the
    size that gloo's one-operation collectives carry in place): every object arrives intact, in every
    collective, several times in a row (a rest left unread would garble the next one)."""
    comm = ctx.comm
    rank, size = comm.rank, comm.size
    sizes = [(10, 65_400, 65_536 - 8, 65_536, 200_000)[(r + shift) % 5] for shift in range(3) for r in range(size)]

    def blob(r: int, shift: int) -> bytes:
        return _blob(r + 100 * shift, sizes[shift * size + r])

    got = []
    for shift in range(3):
        mine = blob(rank, shift)
        root = shift % size
        got.append((comm.gather(mine, root=root), comm.allgather(mine), comm.broadcast(mine, root=root)))

    def local():
        for shift, (ga, ag, bc) in enumerate(got):
            root = shift % size
            want = [blob(r, shift) for r in range(size)]
            assert (ga == want) if rank == root else ga is None, f"gather to rank {root} (shift {shift})"
            assert ag == want, f"allgather (shift {shift})"
            assert bc == want[root], f"broadcast from rank {root} (shift {shift})"

    _after_others(comm, local)


def check_dup_never_mixes(ctx: Ctx) -> None:
    """dup() gives a communicator over the same ranks whose messages never mix with the parent's:
    operations interleaved on both in one thread, then run on both at the same time from two threads
    (as an asynchronous save does), each with its own values, all arrive where they belong."""
    comm = ctx.comm
    rank, size = comm.rank, comm.size
    d1 = comm.dup()
    d2 = d1.dup()  # a dup of a dup
    d3 = comm.dup()  # a second dup of the same parent
    comms = {"parent": comm, "d1": d1, "d2": d2, "d3": d3}
    seen: dict[str, list] = {name: [] for name in comms}  # every result, in order
    for name, c in comms.items():
        assert (c.rank, c.size) == (rank, size), f"{name}: rank/size {c.rank}/{c.size} != {rank}/{size}"
    assert len({id(c) for c in comms.values()}) == 4, "dup() returned an existing communicator"

    # interleaved in one thread, in the same order on every rank; the roots differ per communicator
    for i in range(4):
        for j, (name, c) in enumerate(comms.items()):
            root = (i + j) % size
            seen[name].append(c.broadcast((name, i, "bc") if rank == root else ("decoy", rank), root=root))
            seen[name].append(c.gather((name, i, rank), root=root))
        for name, c in reversed(comms.items()):
            seen[name].append(c.allgather((name, i, rank)))
    problems = []
    for j, name in enumerate(comms):
        want = []
        for i in range(4):
            root = (i + j) % size
            want.append((name, i, "bc"))
            want.append([(name, i, r) for r in range(size)] if rank == root else None)
            want.append([(name, i, r) for r in range(size)])
        if seen[name] != want:
            problems.append(f"{name} (interleaved): got {seen[name]}, expected {want}")

    # concurrently: each communicator driven by its own thread, at rank-dependent paces
    rounds = 12
    results: dict[str, Any] = {}

    def drive(name: str, c) -> None:
        pace = random.Random(f"{name}-{rank}")
        try:
            out = []
            for i in range(rounds):
                time.sleep(pace.random() * 0.004)
                root = i % size
                if i % 3 == 0:
                    out.append(c.allgather((name, i, rank)))
                elif i % 3 == 1:
                    out.append(c.broadcast((name, i) if rank == root else ("decoy", name, i), root=root))
                else:
                    out.append(c.gather((name, i, rank), root=root))
            results[name] = out
        except BaseException as e:  # reported below
            results[name] = e

    threads = [
        threading.Thread(target=drive, args=(n, c), name=f"conformance-{n}", daemon=True) for n, c in comms.items()
    ]
    for t in threads:
        t.start()
    hung = _join(threads, CHECK_TIMEOUT + TIMEOUT_SLACK)
    assert not hung, f"rank {rank}: threads still running {CHECK_TIMEOUT + TIMEOUT_SLACK:.0f}s later: {hung}"
    for name in comms:
        out = results[name]
        if isinstance(out, BaseException):
            problems.append(f"{name} (concurrent): raised {type(out).__name__}: {out}")
            continue
        want = []
        for i in range(rounds):
            root = i % size
            if i % 3 == 0:
                want.append([(name, i, r) for r in range(size)])
            elif i % 3 == 1:
                want.append((name, i))
            else:
                want.append([(name, i, r) for r in range(size)] if rank == root else None)
        if out != want:
            problems.append(f"{name} (concurrent): got {out}, expected {want}")
    _after_others(comm, lambda: not problems or _fail("\n".join(problems)))


def _failing_ranks(size: int) -> list[int]:
    return list(range(1, size)) if size > 1 else [0]


def _raised(fn: Callable[[], Any]) -> tuple[Any, BaseException | None]:
    try:
        return fn(), None
    except BaseException as e:  # checked by the caller
        return None, e


def _assert_agreed(comm, err: BaseException | None, cls: type, failing: list[int], texts: dict[int, str]) -> None:
    """``err`` is the agreed error: of class ``cls`` on every rank, naming exactly the failing ranks,
    with each one's message, the same text everywhere."""

    def local():
        assert err is not None, f"rank {comm.rank}: no error raised, although ranks {failing} failed"
        assert type(err) is cls, f"rank {comm.rank}: raised {type(err).__name__}: {err}, expected {cls.__name__}"
        assert isinstance(err, TddistError)
        msg = str(err)
        for r in range(comm.size):
            named = f"rank {r}:" in msg
            assert named == (r in failing), f"rank {r} {'not ' if r in failing else ''}named in: {msg}"
        for r, text in texts.items():
            assert text in msg, f"rank {r}'s message {text!r} missing from: {msg}"
        assert sorted(err.failures) == failing, f"failures {sorted(err.failures)} != {failing}"

    _after_others(comm, local)
    seen = (type(err).__name__, str(err), sorted(err.failures.items()))
    _same_everywhere(comm, seen, "the agreed error")


def check_agree_raises_everywhere(ctx: Ctx) -> None:
    """agree(): no failure returns on every rank; failures of one tddist class raise that class on every
    rank, naming every failing rank with its message; mixed or foreign classes raise CollectiveError."""
    comm = ctx.comm
    rank, size = comm.rank, comm.size
    assert agree(comm, "nothing failed", None) is None

    failing = _failing_ranks(size)
    texts = {r: f"target /ckpt-{r} is a regular file" for r in failing}
    local = TargetError(f"rank {rank}: {texts[rank]}") if rank in failing else None
    _, err = _raised(lambda: agree(comm, "conformance step", local))
    _assert_agreed(comm, err, TargetError, failing, texts)
    assert err.__cause__ is local or local is None, "the local error is not the cause"

    # rank 0 a tddist error, the others (or rank 0 alone) something else: CollectiveError
    mixed = list(range(size))
    texts = {r: f"disk {r} is full" for r in mixed}
    errors = {r: (TargetError(texts[r]) if r == 0 and size > 1 else OSError(28, texts[r])) for r in mixed}
    _, err = _raised(lambda: agree(comm, "conformance step", errors[rank]))
    _assert_agreed(comm, err, CollectiveError, mixed, texts)


def check_run_step_raises_everywhere(ctx: Ctx) -> None:
    """run_step(): returns fn's value on every rank when no rank fails; otherwise the same error on every
    rank, naming every failing rank (exceptions that are not tddist errors become CollectiveError)."""
    comm = ctx.comm
    rank, size = comm.rank, comm.size
    value, err = _raised(lambda: run_step(comm, "conformance step", lambda: {"rank": rank}))
    assert err is None and value == {"rank": rank}, (value, err)

    failing = _failing_ranks(size)
    texts = {r: f"key 'w' has shape ({r}, 2)" for r in failing}

    def fn():
        if rank in failing:
            raise TargetError(f"rank {rank}: {texts[rank]}")
        return "ok"

    value, err = _raised(lambda: run_step(comm, "conformance step", fn))
    _assert_agreed(comm, err, TargetError, failing, texts)

    def foreign():
        if rank in failing:
            raise ValueError(f"bad value on rank {rank}")
        return "ok"

    value, err = _raised(lambda: run_step(comm, "conformance step", foreign))
    _assert_agreed(comm, err, CollectiveError, failing, {r: f"ValueError: bad value on rank {r}" for r in failing})


def check_absent_rank_times_out(ctx: Ctx) -> str | None:
    """A rank that never joins a collective makes the others raise CommTimeoutError (a TddistError)
    within the timeout, instead of hanging: an allgather, a barrier, and a broadcast from the absent
    rank, each on its own communicator with the short timeout, all waiting at the same time."""
    if ctx.size == 1:  # no rank can be absent: each collective, on the short timeout too, returns its own value
        short = ctx.short()
        assert short.allgather(("absent check", 0)) == [("absent check", 0)]
        assert short.broadcast("from rank 0", root=0) == "from rank 0"
        short.barrier()
        return None
    comm = ctx.comm
    rank, size = comm.rank, comm.size
    absent = size - 1
    short = ctx.short()
    comms = {"allgather": short, "barrier": short.dup(), "broadcast from the absent rank": short.dup()}
    ops = {
        "allgather": lambda c: c.allgather(("absent check", rank)),
        "barrier": lambda c: c.barrier(),
        "broadcast from the absent rank": lambda c: c.broadcast(None, root=absent),
    }
    outcomes: dict[str, Any] = {}
    if rank != absent:

        def wait(name: str) -> None:
            start = time.monotonic()
            try:
                value = ops[name](comms[name])
                outcomes[name] = ("returned", value, time.monotonic() - start)
            except BaseException as e:  # checked below
                outcomes[name] = ("raised", e, time.monotonic() - start)

        threads = [threading.Thread(target=wait, args=(n,), name=f"conformance-absent-{n}", daemon=True) for n in ops]
        for t in threads:
            t.start()
        hung = _join(threads, ctx.short_timeout + TIMEOUT_SLACK + 5)

    def local():
        if rank == absent:
            return
        assert not hung, f"still waiting {ctx.short_timeout + TIMEOUT_SLACK + 5:.0f}s later: {hung}"
        for name, (how, value, elapsed) in outcomes.items():
            where = f"{name} without rank {absent}"
            assert how == "raised", f"{where} returned {value!r} after {elapsed:.1f}s instead of raising"
            assert isinstance(value, CommTimeoutError) and isinstance(value, TddistError), (
                f"{where} raised {type(value).__name__}: {value}, expected CommTimeoutError"
            )
            assert ctx.short_timeout * 0.5 <= elapsed <= ctx.short_timeout + TIMEOUT_SLACK, (
                f"{where} raised after {elapsed:.1f}s with a timeout of {ctx.short_timeout}s"
            )
            text = str(value)
            assert f"rank {rank}" in text and "within" in text, f"{where}: the message does not say so: {text}"

    # the absent rank waits here (on the communicator under test) while the others time out
    _after_others(comm, local)
    return None


#: Every check, in the order the jobs run them (the one that waits for a timeout last).
CHECKS: dict[str, Callable[[Ctx], Any]] = {
    "rank_and_size": check_rank_and_size,
    "barrier": check_barrier,
    "broadcast_from_every_root": check_broadcast_from_every_root,
    "gather_to_every_root": check_gather_to_every_root,
    "allgather_in_rank_order": check_allgather_in_rank_order,
    "received_objects_are_copies": check_received_objects_are_copies,
    "large_objects": check_large_objects,
    "objects_of_mixed_sizes": check_objects_of_mixed_sizes,
    "dup_never_mixes": check_dup_never_mixes,
    "agree_raises_everywhere": check_agree_raises_everywhere,
    "run_step_raises_everywhere": check_run_step_raises_everywhere,
    "absent_rank_times_out": check_absent_rank_times_out,
}


def run_check(name: str, ctx: Ctx) -> str:
    """Run one check on this rank: "ok", "skipped: <why>", or the failure with its traceback."""
    try:
        out = CHECKS[name](ctx)
    except BaseException:
        return f"failed on rank {ctx.rank}:\n{traceback.format_exc()}"
    return out if isinstance(out, str) and out.startswith(SKIPPED) else OK


def run_on_threads(name: str, size: int) -> dict[int, str]:
    """Run check ``name`` on ``size`` ThreadComm ranks of this process; each rank's outcome."""
    comms = ThreadComm.create(size, CHECK_TIMEOUT)
    shorts = ThreadComm.create(size, SHORT_TIMEOUT)
    outcomes: dict[int, str] = {}

    def body(r: int) -> None:
        outcomes[r] = run_check(name, Ctx(comms[r], lambda: shorts[r], r, size))

    threads = [threading.Thread(target=body, args=(r,), name=f"conformance-rank{r}", daemon=True) for r in range(size)]
    for t in threads:
        t.start()
    _join(threads, 2 * CHECK_TIMEOUT + TIMEOUT_SLACK)
    for r, t in enumerate(threads):
        if t.is_alive():
            outcomes[r] = f"failed on rank {r}: still running after {2 * CHECK_TIMEOUT + TIMEOUT_SLACK:.0f}s (hung)"
    return outcomes


# --- the base class of the tests -------------------------------------------------------------


class CheckFailed(AssertionError):
    """A conformance check failed on some rank (the run itself went fine)."""


class CommunicatorTests:
    """Test methods every communicator implementation must pass; subclass and implement ``outcomes``.

    ``outcomes(name)`` runs (or looks up) check ``name`` and returns every
    rank's outcome. ``known_failures`` maps a check to the reason it fails on
    this implementation: the test then fails if the check passes
    (remove the entry once the library is fixed) and is an expected failure
    (xfail) if the check fails.
    """

    size: int
    known_failures: dict[str, str] = {}

    def outcomes(self, name: str) -> dict[int, str]:
        raise NotImplementedError

    def assert_check(self, name: str) -> None:
        outcomes = self.outcomes(name)
        assert sorted(outcomes) == list(range(self.size)), f"{name}: outcomes from ranks {sorted(outcomes)}"
        skipped = {r: o for r, o in outcomes.items() if o.startswith(SKIPPED)}
        if skipped and len(skipped) == len(outcomes) and len(set(skipped.values())) == 1:
            pytest.skip(next(iter(skipped.values())).removeprefix(f"{SKIPPED}: "))
        failed = {r: o for r, o in sorted(outcomes.items()) if o != OK}
        reason = self.known_failures.get(name)
        if reason is not None:
            if failed:
                why = {o.rpartition("Error: ")[2].strip() for o in failed.values()}
                pytest.xfail(f"known failure: {reason}: {' | '.join(sorted(why))[:1500]}")
            pytest.fail(f"{name} now passes on {type(self).__name__}: remove it from known_failures ({reason})")
        if failed:
            raise CheckFailed(f"{name} failed on ranks {sorted(failed)}:\n" + "\n".join(failed.values())[-8000:])

    def test_every_check_has_a_test(self) -> None:
        tests = {n.removeprefix("test_") for n in dir(self) if n.startswith("test_")}
        assert set(CHECKS) <= tests, f"checks without a test method: {sorted(set(CHECKS) - tests)}"

    def test_rank_and_size(self) -> None:
        self.assert_check("rank_and_size")

    def test_barrier(self) -> None:
        self.assert_check("barrier")

    def test_broadcast_from_every_root(self) -> None:
        self.assert_check("broadcast_from_every_root")

    def test_gather_to_every_root(self) -> None:
        self.assert_check("gather_to_every_root")

    def test_allgather_in_rank_order(self) -> None:
        self.assert_check("allgather_in_rank_order")

    def test_received_objects_are_copies(self) -> None:
        self.assert_check("received_objects_are_copies")

    def test_large_objects(self) -> None:
        self.assert_check("large_objects")

    def test_objects_of_mixed_sizes(self) -> None:
        self.assert_check("objects_of_mixed_sizes")

    def test_dup_never_mixes(self) -> None:
        self.assert_check("dup_never_mixes")

    def test_agree_raises_everywhere(self) -> None:
        self.assert_check("agree_raises_everywhere")

    def test_run_step_raises_everywhere(self) -> None:
        self.assert_check("run_step_raises_everywhere")

    def test_absent_rank_times_out(self) -> None:
        self.assert_check("absent_rank_times_out")


# --- rank program --------------------------------------------------------------------------


def _launch_rank_size() -> tuple[int, int]:
    """This process's rank and the world size as the launcher set them (torchrun, MPICH's hydra, Open MPI)."""
    for rank_var, size_var in (
        ("RANK", "WORLD_SIZE"),
        ("PMI_RANK", "PMI_SIZE"),
        ("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE"),
    ):
        if rank_var in os.environ and size_var in os.environ:
            return int(os.environ[rank_var]), int(os.environ[size_var])
    raise RuntimeError("not started by torchrun or mpiexec")


def main(kind: str) -> int:
    from tests.launch_util import write_report

    rank, size = _launch_rank_size()
    started = time.monotonic()
    checks: dict[str, str] = {}
    seconds: dict[str, float] = {}
    try:
        if kind == "torch":
            import datetime

            import torch.distributed as dist

            from tddist.comm.gloo import torch_comm

            dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=120))
            under_test = torch_comm(None, CHECK_TIMEOUT)
            control = torch_comm(None, 120.0)  # keeps the ranks in step between checks

            def short():
                return torch_comm(None, SHORT_TIMEOUT)
        elif kind == "mpi":
            from tddist.comm.mpi import mpi_comm

            under_test = mpi_comm(None, CHECK_TIMEOUT)
            control = mpi_comm(None, 120.0)

            def short():
                return mpi_comm(None, SHORT_TIMEOUT)
        else:
            raise ValueError(kind)
        for name in CHECKS:
            start = time.monotonic()
            # the first check runs on the communicator itself, the others on fresh duplicates of it
            comm = under_test if name == "rank_and_size" else under_test.dup()
            checks[name] = run_check(name, Ctx(comm, short, rank, size))
            control.barrier()
            seconds[name] = round(time.monotonic() - start, 3)
    except BaseException:
        write_report(rank, "broken", checks=checks, seconds=seconds, error=traceback.format_exc())
        return 3
    write_report(
        rank,
        "ok",
        comm=type(under_test).__name__,
        checks=checks,
        seconds=seconds,
        total=round(time.monotonic() - started, 3),
    )
    if kind == "torch":
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    if len(sys.argv) != 2 or sys.argv[1] not in ("torch", "mpi"):
        sys.exit(f"usage: {sys.argv[0]} torch|mpi")
    sys.exit(main(sys.argv[1]))
