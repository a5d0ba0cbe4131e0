"""The fresh processes in which the documentation's examples run (tests/test_docs.py).

Every example runs as a reader would run it alone: in new processes (one, or
one per rank for a ``torchrun N`` block, with the environment variables
torchrun gives its ranks) whose working directory is a new directory.

The processes are forked from a multiprocessing forkserver that has imported
torch, tensordict and tddist once. A process forked from it starts with what
those imports leave and nothing else: no process group, random seed,
environment variable, working directory or module state of another example,
and without paying for the imports again (seconds of CPU per process on a
small machine). The server itself runs no example, so it has no threads when
it forks.

A process writes its outcome to a JSON file and its output (Python's, that of
the programs it starts, and the C++ libraries') to a log file, both of which
the test reads back.

``modules_outside`` and ``block_imports`` check what an example needs
installed: the first lists the installed modules that a set of requirements
(say, the package's dependencies and one extra) would not install, the
second makes them look absent in a process.
"""

from __future__ import annotations

import importlib.metadata
import json
import multiprocessing
import multiprocessing.connection
import os
import signal
import subprocess
import sys
import time
import traceback
from dataclasses import dataclass
from pathlib import Path

#: What the forkserver imports once, before it forks any example's process.
PRELOAD = ["torch", "tensordict", "tddist.api", "tests.docs_rank"]

#: How long the other ranks of a multi-rank example may run on after one of them failed (they are
#: usually blocked in a collective that the failed rank never joins) before they are killed.
GRACE_S = 10.0


@dataclass(frozen=True)
class Step:
    """One code block: where it is in the docs, its language ("python" or "bash") and its code."""

    where: str
    lang: str
    code: str


@dataclass(frozen=True)
class ProcessSpec:
    """What one fresh process runs, where, and where it reports."""

    steps: tuple[Step, ...]
    workdir: str
    env: dict[str, str]
    result: str  # the JSON outcome
    log: str  # stdout and stderr
    blocked: tuple[str, ...] = ()  # top-level modules its python steps may not import (not installed by a setup)


@dataclass(frozen=True)
class Outcome:
    """How one process ended: its exit code, the steps it finished, the first failure and its output."""

    rank: int
    exitcode: int | None
    done: tuple[str, ...]
    failed_at: str | None
    error: str
    log_tail: str

    @property
    def ok(self) -> bool:
        return self.exitcode == 0 and self.failed_at is None

    def describe(self) -> str:
        ended = (
            f"killed by signal {-self.exitcode}"
            if self.exitcode and self.exitcode < 0
            else f"exit code {self.exitcode}"
        )
        head = f"rank {self.rank}: {ended}"
        if self.failed_at:
            head += f", failed at {self.failed_at}"
        return f"{head}\n{self.error}\n--- output ---\n{self.log_tail}"


def torchrun_env(rank: int, nproc: int, port: int) -> dict[str, str]:
    """The environment variables torchrun (``--standalone``, one node) gives rank ``rank`` of ``nproc``."""
    return {
        "RANK": str(rank),
        "LOCAL_RANK": str(rank),
        "GROUP_RANK": "0",
        "ROLE_RANK": str(rank),
        "WORLD_SIZE": str(nproc),
        "LOCAL_WORLD_SIZE": str(nproc),
        "ROLE_WORLD_SIZE": str(nproc),
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(port),
        "TORCHELASTIC_RESTART_COUNT": "0",
        "TORCHELASTIC_MAX_RESTARTS": "0",
        "OMP_NUM_THREADS": "1",
    }


def run_example(
    steps: tuple[Step, ...],
    envs: list[dict[str, str]],
    workdir: Path,
    outdir: Path,
    timeout: float,
    blocked: tuple[str, ...] = (),
) -> list[Outcome]:
    """Run ``steps`` in one fresh process per environment of ``envs`` (one per rank), all in ``workdir``.

    Waits until every process has ended, or kills them all after ``timeout``
    seconds, or the others ``GRACE_S`` seconds after one failed. The python
    steps cannot import the top-level modules ``blocked``. Returns one
    ``Outcome`` per rank.
    """
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD)
    specs = [
        ProcessSpec(steps, str(workdir), env, str(outdir / f"rank{r}.json"), str(outdir / f"rank{r}.log"), blocked)
        for r, env in enumerate(envs)
    ]
    procs = [
        ctx.Process(target=run_process, args=(spec,), name=f"docs-example-rank{r}") for r, spec in enumerate(specs)
    ]
    for p in procs:
        p.start()
    try:
        _wait(procs, timeout)
    finally:
        for p in procs:
            _kill(p)
            p.join()
    return [_outcome(r, p, spec) for r, (p, spec) in enumerate(zip(procs, specs))]


def stop_forkserver() -> None:
    """Stop the forkserver (it holds torch's memory); the next example starts a new one.

    multiprocessing has no public call for this; ``_stop`` is what CPython's
    own tests use, and without it the server only ends with this process.
    """
    from multiprocessing import forkserver

    stop = getattr(forkserver._forkserver, "_stop", None)
    if stop is not None:
        stop()


def _wait(procs: list, timeout: float) -> None:
    """Until all processes ended, the deadline passed, or ``GRACE_S`` after the first failure."""
    deadline = time.monotonic() + timeout
    while any(p.is_alive() for p in procs):
        if any(p.exitcode not in (None, 0) for p in procs):
            deadline = min(deadline, time.monotonic() + GRACE_S)
        left = deadline - time.monotonic()
        if left <= 0:
            return
        multiprocessing.connection.wait([p.sentinel for p in procs if p.is_alive()], timeout=min(left, 1.0))


def _kill(p) -> None:
    """Kill a process that is still running, with everything it started (its own session)."""
    if p.exitcode is not None:
        return
    try:
        os.killpg(p.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        p.kill()


def _outcome(rank: int, p, spec: ProcessSpec) -> Outcome:
    try:
        report = json.loads(Path(spec.result).read_text())
    except (OSError, ValueError):
        report = {"failed_at": "(no report: the process died or was killed)", "error": ""}
    try:
        log = Path(spec.log).read_text(errors="replace")[-6000:]
    except OSError:
        log = ""
    return Outcome(rank, p.exitcode, tuple(report.get("done", ())), report.get("failed_at"), report["error"], log)


# --- in the example's process ------------------------------------------------------------------------------


def run_process(spec: ProcessSpec) -> None:
    """The fresh process: run every step in one namespace, in ``spec.workdir``, and write the outcome.

    Python steps run with ``exec`` in a namespace named ``__main__``, as a
    script would; bash steps with ``bash -euo pipefail``. The process leads a
    session of its own, so that a timeout kills what its steps started too.
    """
    os.setsid()
    _redirect_output(spec.log)
    os.environ.clear()
    os.environ.update(spec.env)
    os.chdir(spec.workdir)
    sys.argv = [spec.steps[0].where]
    block_imports(spec.blocked)
    namespace: dict = {"__name__": "__main__"}
    done: list[str] = []
    for step in spec.steps:
        try:
            if step.lang == "python":
                exec(compile(step.code, step.where, "exec"), namespace)
            else:
                _bash(step)
        except BaseException:
            _report(spec.result, done=done, failed_at=step.where, error=traceback.format_exc()[-6000:])
            raise SystemExit(1) from None  # the traceback is in the report
        done.append(step.where)
    _report(spec.result, done=done, failed_at=None, error="")


class _Hiding:
    """A meta path finder that finds nothing of the top-level modules ``names`` and delegates all else to ``finder``.

    Every finder on ``sys.meta_path`` is wrapped in one, so that those modules
    look as if they were not installed both to ``import`` (ModuleNotFoundError)
    and to ``importlib.util.find_spec`` (None), which libraries use to probe
    for optional packages.
    """

    def __init__(self, finder, names: frozenset[str]) -> None:
        self.finder, self.names = finder, names

    def find_spec(self, fullname, path=None, target=None):
        find = getattr(self.finder, "find_spec", None)
        if fullname.partition(".")[0] in self.names or find is None:
            return None
        return find(fullname, path, target)

    def __getattr__(self, name):
        return getattr(self.finder, name)


def block_imports(names: tuple[str, ...] | list[str]) -> None:
    """From now on, the top-level modules ``names`` (and their submodules) look as if they were not installed.

    Those imported already (by the forkserver's preload) are forgotten, so
    that the next import of them fails too.
    """
    if not names:
        return
    hidden = frozenset(names)
    for name in [m for m in sys.modules if m.partition(".")[0] in hidden]:
        del sys.modules[name]
    sys.meta_path[:] = [_Hiding(f, hidden) for f in sys.meta_path]


def modules_outside(requirements: list[str], keep: tuple[str, ...] = ()) -> tuple[str, ...]:
    """The installed top-level modules that ``requirements`` (PEP 508 strings) would not install.

    Follows every requirement's own requirements (with the extras asked
    for) through the installed distributions' metadata; ``keep`` names
    modules never to count (the project's own, which is not installed from
    a requirement here).
    """
    from packaging.utils import canonicalize_name

    allowed = _closure(requirements) | {"pip", "setuptools", "wheel"}
    return tuple(
        sorted(
            module
            for module, dists in importlib.metadata.packages_distributions().items()
            if module not in keep and not any(canonicalize_name(d) in allowed for d in dists)
        )
    )


def _closure(requirements: list[str]) -> set[str]:
    """The canonical names of the distributions ``requirements`` install, their requirements included."""
    from packaging.requirements import Requirement
    from packaging.utils import canonicalize_name

    seen: set[tuple[str, frozenset[str]]] = set()
    todo = [Requirement(r) for r in requirements]
    while todo:
        req = todo.pop()
        key = (canonicalize_name(req.name), frozenset(req.extras))
        if key in seen or (req.marker is not None and not req.marker.evaluate({"extra": ""})):
            continue
        seen.add(key)
        try:
            needs = importlib.metadata.requires(req.name) or []
        except importlib.metadata.PackageNotFoundError:
            continue
        for text in needs:
            sub = Requirement(text)
            if sub.marker is None or any(sub.marker.evaluate({"extra": e}) for e in req.extras | {""}):
                sub.marker = None
                todo.append(sub)
    return {name for name, _extras in seen}


def _redirect_output(log: str) -> None:
    """Point file descriptors 1 and 2 (so Python's streams and every child's) at ``log``."""
    fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    for stream in (sys.stdout, sys.stderr):
        stream.reconfigure(line_buffering=True)


def _bash(step: Step) -> None:
    r = subprocess.run(["bash", "-euo", "pipefail", "-c", step.code], stdin=subprocess.DEVNULL)
    if r.returncode != 0:
        raise AssertionError(f"{step.where}: bash exited with status {r.returncode} (its output is below)")


def _report(path: str, **fields) -> None:
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        json.dump(fields, f)
    os.replace(tmp, path)
