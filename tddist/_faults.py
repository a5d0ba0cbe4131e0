"""Fault injection at named points of the commit, for the test suite.

Set ``TDDIST_FAULT=<point>:<rank>:<action>[,...]`` (action: ``raise``,
``kill`` for SIGKILL, ``hang``, ``delay`` for one second) or use ``inject()`` in-process. The points are
listed in ``commit.py``'s docstring. With nothing set this is one dict lookup.
"""

from __future__ import annotations

import contextlib
import os
import signal
import time
from collections.abc import Iterator

from .errors import InjectedFault

ENV = "TDDIST_FAULT"
_injected: dict[tuple[str, int], str] = {}


def _from_env() -> dict[tuple[str, int], str]:
    spec = os.environ.get(ENV, "")
    out = {}
    for item in filter(None, spec.split(",")):
        point, rank, action = item.split(":")
        out[(point, int(rank))] = action
    return out


def fault_point(point: str, rank: int) -> None:
    """Fail here if a fault was injected for (point, rank)."""
    action = _injected.get((point, rank))
    if action is None and ENV in os.environ:
        action = _from_env().get((point, rank))
    if action is None:
        return
    if action == "raise":
        raise InjectedFault(f"rank {rank}: injected failure at commit step {point!r}")
    if action == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    if action == "hang":
        while True:
            time.sleep(3600)
    if action == "delay":
        time.sleep(1.0)
        return
    raise ValueError(f"unknown fault action {action!r}")


@contextlib.contextmanager
def inject(point: str, rank: int, action: str = "raise") -> Iterator[None]:
    """In-process fault injection (thread communicator tests)."""
    _injected[(point, rank)] = action
    try:
        yield
    finally:
        _injected.pop((point, rank), None)
