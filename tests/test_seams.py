"""The seams between modules: the commit knows only the ShardWriter protocol, and calls it in the
documented order on every rank.

A third layout (``RecordingWriter``, in memory) runs through the real ``two_phase_commit`` on
thread ranks: the commit needs nothing from it beyond the protocol, and the order in which each
rank calls it is the one the protocol's docstring gives.
"""

from __future__ import annotations

import ast
import inspect
import threading

import pytest

import tddist
from tddist.comm.threads import run_threads
from tddist.core.types import Fragment, ManifestFiles, SavePlan, Staging, Structure
from tddist.saving import commit
from tddist.storage.archive import ArchiveWriter
from tddist.storage.base import ShardWriter
from tddist.storage.directory import DirectoryWriter


class RecordingWriter:
    """An in-memory layout that records every protocol call, per rank."""

    def __init__(self, target: str, rank: int, log: list, fail_at: str | None = None):
        self.target, self.rank, self.log, self.fail_at = target, rank, log, fail_at
        self.lock = threading.Lock()

    def _record(self, step: str) -> None:
        with self.lock:
            self.log.append((self.rank, step))
        if step == self.fail_at:
            raise tddist.TargetError(f"rank {self.rank}: {step} failed on purpose")

    structure = Structure((), (), (), "digest")

    def plan(self) -> SavePlan:
        self._record("plan")
        return SavePlan(self.target, "directory", True, region_bytes=10 * (self.rank + 1), digest="digest")

    def open(self, plans: list[SavePlan]) -> Staging:
        self._record("open")
        return Staging("mem://staging", tuple(range(len(plans))), sum(p.region_bytes for p in plans))

    def write(self, staging: Staging) -> Fragment:
        self._record("write")
        assert staging.region_start(self.rank) == self.rank
        return Fragment(self.rank, "digest", b"", b"", b"")

    def finalize(self, staging: Staging, manifest: bytes, fragments: list[Fragment]) -> None:
        self._record("finalize")
        assert manifest.manifest == b"manifest of 3" and [f.rank for f in fragments] == [0, 1, 2]

    def publish(self, staging: Staging) -> None:
        self._record("publish")

    def retirement(self):
        self._record("retirement")
        return lambda: self._record("retired")

    def abort(self, staging: Staging) -> None:
        self._record("abort")

    stages_alone = False

    def stage(self, path: str) -> str | None:
        self._record("stage")
        with self.lock:
            self.log.append((self.rank, f"path {path}"))
        return None

    def check_staged(self, created: str | None) -> None:
        self._record("check_staged")


class StagingAloneWriter(RecordingWriter):
    """A layout whose ranks can create the staging area themselves (like an atomic directory save)."""

    stages_alone = True

    def write(self, staging: Staging) -> Fragment:
        self._record("write")
        return Fragment(self.rank, "digest", b"", b"", b"")


def run_commit(size: int, fail: tuple[int, str] | None = None, retire=None) -> tuple[list, list]:
    log: list = []

    def rank_fn(comm):
        writer = RecordingWriter("/t", comm.rank, log, fail[1] if fail and fail[0] == comm.rank else None)
        commit.two_phase_commit(
            comm, writer, lambda fragments, _s: ManifestFiles(f"manifest of {len(fragments)}".encode(), b""), retire
        )
        return "committed"

    return run_threads(size, rank_fn, timeout=30), log


def steps(log: list, rank: int) -> list[str]:
    return [step for r, step in log if r == rank]


def test_layouts_implement_the_protocol():
    """Both layouts have every method of ShardWriter, with the protocol's parameters."""
    for layout in (DirectoryWriter, ArchiveWriter):
        for name, member in inspect.getmembers(ShardWriter, inspect.isfunction):
            if name.startswith("_"):
                continue
            ours = getattr(layout, name, None)
            assert ours is not None, f"{layout.__name__} lacks {name}"
            assert list(inspect.signature(ours).parameters) == list(inspect.signature(member).parameters), name


def test_call_order_on_every_rank():
    """Rank 0: plan, open, write, finalize, publish, then the removal of what it replaced; the others: plan,
    write. Every rank returns."""
    results, log = run_commit(3)
    assert results == ["committed"] * 3
    assert steps(log, 0) == ["plan", "open", "write", "finalize", "publish", "retirement", "retired"]
    assert steps(log, 1) == steps(log, 2) == ["plan", "write"]
    first_write = min(i for i, (_r, s) in enumerate(log) if s == "write")
    assert all(s == "plan" for _r, s in log[: log.index((0, "open"))]), "open must wait for every plan"
    assert log.index((0, "open")) < first_write, "no rank writes before rank 0 opened the staging area"


def run_saves(size: int, targets, fail: tuple[int, str] | None = None) -> tuple[list, list]:
    """One save per entry of ``targets`` (a function of the rank) on the same thread ranks, with a writer that
    stages alone; each rank's results (a label or the error), and the log."""
    log: list = []

    def rank_fn(comm):
        out = []
        for save, target in enumerate(targets):
            failing = fail is not None and fail[0] == comm.rank and save == 1
            writer = StagingAloneWriter(target(comm.rank), comm.rank, log, fail[1] if failing else None)
            with writer.lock:
                log.append((comm.rank, f"save {save}"))
            try:
                commit.two_phase_commit(comm, writer, lambda fragments, _s: ManifestFiles(b"manifest of 3", b""))
                out.append("committed")
            except tddist.TddistError as e:
                out.append(e)
        return out

    return run_threads(size, rank_fn, timeout=30), log


def test_later_saves_take_one_round():
    """The first save on a communicator runs the first round (rank 0 opens the staging area and draws the seed of
    the names); later ones of a writer that stages alone skip it: every rank plans, stages at the same derived
    path and writes, rank 0 checks what it staged, finalizes and publishes. Every staging path is new."""
    results, log = run_saves(3, [lambda r: "/t"] * 3)
    assert results == [["committed"] * 3] * 3
    for rank in range(3):
        mine = [s for r, s in log if r == rank and not s.startswith("path ")]
        first, later = mine[1 : mine.index("save 1")], mine[mine.index("save 1") + 1 : mine.index("save 2")]
        published = ["finalize", "publish", "retirement", "retired"]
        assert first == (["plan", "open", "write", *published] if rank == 0 else ["plan", "write"]), (rank, first)
        want = ["plan", "stage", "write"] + (["check_staged", *published] if rank == 0 else [])
        assert later == want, (rank, later)
    paths = {r: [s for rr, s in log if rr == r and s.startswith("path ")] for r in range(3)}
    assert paths[0] == paths[1] == paths[2] and len(set(paths[0])) == 2, paths


@pytest.mark.parametrize("rank, step", [(1, "stage"), (2, "write"), (0, "check_staged"), (0, "finalize")])
def test_a_failure_of_the_one_round_path_is_the_same_error_everywhere(rank, step):
    """A failure in a one-round save is raised on every rank, rank 0 aborts, and the next save runs the first
    round again on every rank (the names are forgotten alike)."""
    results, log = run_saves(3, [lambda r: "/t"] * 3, fail=(rank, step))
    for r in range(3):
        assert results[r][0] == "committed" and results[r][2] == "committed"
        assert isinstance(results[r][1], tddist.TargetError) and f"{step} failed on purpose" in str(results[r][1])
    rank0 = [s for r, s in log if r == 0 and not s.startswith("path ")]
    assert "abort" in rank0[rank0.index("save 1") : rank0.index("save 2")]
    assert "open" in rank0[rank0.index("save 2") :], "after a failure the next save opens through rank 0 again"


def test_ranks_must_agree_on_the_target_in_one_round():
    """A one-round save whose ranks name different targets is refused on every rank; each rank whose staging
    area rank 0 did not remove removes its own."""
    results, log = run_saves(3, [lambda r: "/t", lambda r: f"/t{r % 2}"])
    for r in range(3):
        assert isinstance(results[r][1], tddist.InvalidArgumentError), results[r][1]
        assert "disagree on the save's target" in str(results[r][1])
    aborted = {r for r, s in log[[i for i, e in enumerate(log) if e[1] == "save 1"][0] :] if s == "abort"}
    assert aborted == {0, 1, 2}, aborted


def test_the_removal_of_the_replaced_checkpoint_can_be_handed_on():
    """With ``retire`` (a return_early save's worker), rank 0 hands the removal on instead of running it."""
    handed: list = []
    results, log = run_commit(3, retire=handed.append)
    assert results == ["committed"] * 3 and len(handed) == 1
    assert steps(log, 0) == ["plan", "open", "write", "finalize", "publish", "retirement"]
    handed[0]()
    assert steps(log, 0)[-1] == "retired"


@pytest.mark.parametrize("rank, step", [(1, "plan"), (0, "open"), (2, "write"), (0, "finalize"), (0, "publish")])
def test_a_failure_is_the_same_error_everywhere(rank, step):
    """A failure at any step is raised on every rank with its class and rank; rank 0 aborts what it staged."""
    results, log = run_commit(3, fail=(rank, step))
    for r, res in enumerate(results):
        assert isinstance(res, tddist.TargetError), f"rank {r}: {res!r}"
        assert res.failures.keys() == {rank} and f"{step} failed on purpose" in str(res)
    staged = step not in ("plan", "open")
    assert ("abort" in steps(log, 0)) == staged, steps(log, 0)
    if step == "plan":
        assert not any(s == "open" for _r, s in log), "nothing is staged when a rank cannot plan"


def test_ranks_must_agree_on_the_target():
    """A rank saving to another path is refused on every rank before anything is staged."""
    log: list = []

    def rank_fn(comm):
        writer = RecordingWriter(f"/t{comm.rank % 2}", comm.rank, log)
        commit.two_phase_commit(comm, writer, lambda fragments, _s: ManifestFiles(b"", b""))

    results = run_threads(3, rank_fn, timeout=30)
    for res in results:
        assert isinstance(res, tddist.InvalidArgumentError) and "disagree on the save's target" in str(res), res
    assert not any(s == "open" for _r, s in log)


def test_commit_has_no_layout_branch():
    """two_phase_commit is short and names no layout: layouts differ only behind ShardWriter."""
    source = inspect.getsource(commit.two_phase_commit)
    assert len(source.splitlines()) < 40, "two_phase_commit should stay a short list of named steps"
    tree = ast.parse(inspect.getsource(commit))
    imported = {node.module for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)}
    assert not any(
        m and m.startswith(("storage.archive", "storage.directory", "..storage.archive")) for m in imported
    ), imported
    names = {n.id for n in ast.walk(tree) if isinstance(n, ast.Name)} | {
        n.attr for n in ast.walk(tree) if isinstance(n, ast.Attribute)
    }
    strings = [n.value for n in ast.walk(tree) if isinstance(n, ast.Constant) and isinstance(n.value, str)]
    code_strings = [s for s in strings if s in ("archive", "directory")]
    assert not ({"archive", "ArchiveWriter", "DirectoryWriter"} & names) and not code_strings
