"""``comm.gloo.within_deadline``: a step that waits on peers (joining the job, creating tddist's group) ends
in a typed ``CommError`` within its timeout and a small constant, whatever torch does.

The multi-process cases (a peer stopped or killed while the job connects) are in tests/test_faults.py;
here the step itself is a real blocking call whose peer never answers (a socket nobody writes to), so the
deadline path runs on every machine in milliseconds.
"""

from __future__ import annotations

import socket
import threading
import time

import pytest

from tddist.comm import gloo
from tddist.errors import CommError, CommTimeoutError


@pytest.fixture
def short_grace(monkeypatch):
    monkeypatch.setattr(gloo, "DEADLINE_GRACE", 0.2)


def test_a_step_that_never_returns_raises_comm_timeout_error_at_the_deadline(short_grace):
    mine, peer = socket.socketpair()  # the peer never writes: recv blocks, as a wait on a stopped host does
    try:
        start = time.monotonic()
        with pytest.raises(CommTimeoutError) as e:
            gloo.within_deadline(3, "creating the tddist gloo group", 0.3, lambda: mine.recv(1))
        elapsed = time.monotonic() - start
    finally:
        peer.close()  # the abandoned thread's recv returns, and the thread ends
        mine.close()
    assert 0.5 <= elapsed < 2.0, elapsed
    assert str(e.value).startswith("rank 3: creating the tddist gloo group did not complete within 0.3s"), e.value
    assert "stopped or gone" in str(e.value) and "timeout=" in str(e.value)


def test_a_step_that_fails_raises_a_typed_comm_error_naming_the_cause(short_grace):
    class DistNetworkError(RuntimeError):  # what torch raises when the store's host is gone
        pass

    def refused() -> None:
        raise DistNetworkError("The client socket has failed to connect to any network address")

    with pytest.raises(CommError) as e:
        gloo.within_deadline(1, "joining the job", 30.0, refused)
    assert not isinstance(e.value, CommTimeoutError)
    assert "rank 1: joining the job failed" in str(e.value) and "DistNetworkError" in str(e.value)
    assert isinstance(e.value.__cause__, DistNetworkError)


def test_a_step_that_returns_in_time_gives_its_value_and_runs_on_its_own_thread(short_grace):
    seen = []
    assert gloo.within_deadline(0, "x", 5.0, lambda: seen.append(threading.current_thread().name) or 42) == 42
    assert seen == ["tddist-connect-rank0"]
