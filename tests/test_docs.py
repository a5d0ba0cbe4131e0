"""Every code example in README.md and docs/*.md runs, so the documentation cannot drift from the code.

Every fenced block is found. ``python`` and ``bash`` blocks are run; every
other fence must name its language (``text``, ``json``, ...), so that no
example escapes by having none. An HTML comment on the line before a fence
changes how it runs:

- ``<!-- docs-test: continue -->``: after the previous runnable block of the
  page, in the same directory (and, for python, the same namespace);
- ``<!-- docs-test: torchrun N -->``: on N ranks of one torchrun job
  (``tests/docs_rank.py``), with the other blocks of that size;
- ``<!-- docs-test: skip: REASON -->``: not run, for the REASON given.

Each example runs in a fresh temporary directory, which holds links to the
repository's ``launch/``, ``slurm/`` and ``benchmarks/``. Python examples are
run in this process with a fresh namespace; bash examples by ``bash -euo
pipefail`` with the virtual environment's ``bin`` first on ``PATH``.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from tests.launch_util import run_job

REPO = Path(__file__).resolve().parent.parent
DOCS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
RUN = {"python": "python", "py": "python", "bash": "bash", "sh": "bash"}
SHOWN = {"text", "json", "yaml", "toml", "console"}
FENCE = re.compile(r"^(?P<indent> *)(?P<fence>```+|~~~+)(?P<info>.*)$")
MARKER = re.compile(r"^\s*<!--\s*docs-test:\s*(?P<what>.*?)\s*-->\s*$")
LINKED = ("launch", "slurm", "benchmarks")


@dataclass
class Block:
    path: Path
    line: int  # of the opening fence, 1-based
    lang: str
    body: str
    marker: str | None

    @property
    def where(self) -> str:
        return f"{self.path.relative_to(REPO)}:{self.line}"

    @property
    def skip_reason(self) -> str | None:
        if self.marker and self.marker.startswith("skip:"):
            return self.marker[len("skip:") :].strip()
        return None

    @property
    def nproc(self) -> int | None:
        m = re.fullmatch(r"torchrun (\d+)", self.marker or "")
        return int(m.group(1)) if m else None


@dataclass
class Chain:
    blocks: list[Block] = field(default_factory=list)

    @property
    def id(self) -> str:
        return self.blocks[0].where


def parse(path: Path) -> list[Block]:
    lines = path.read_text().splitlines()
    out, i = [], 0
    while i < len(lines):
        m = FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        indent, fence, info = m.group("indent"), m.group("fence"), m.group("info").strip()
        prev = next((lines[j] for j in range(i - 1, -1, -1) if lines[j].strip()), "")
        mk = MARKER.match(prev)
        body, j = [], i + 1
        while j < len(lines) and not (
            lines[j].startswith(indent + fence[0] * 3) and lines[j].strip() == fence[0] * len(lines[j].strip())
        ):
            body.append(lines[j][len(indent) :] if lines[j].startswith(indent) else lines[j])
            j += 1
        assert j < len(lines), f"{path.relative_to(REPO)}:{i + 1}: unclosed fence"
        lang = info.split()[0].lower() if info else ""
        out.append(Block(path, i + 1, lang, "\n".join(body) + "\n", mk.group("what") if mk else None))
        i = j + 1
    return out


ALL = [b for p in DOCS for b in parse(p)]


def chains() -> list[Chain]:
    out: list[Chain] = []
    last: dict[Path, Chain] = {}
    for b in ALL:
        if b.lang not in RUN or b.skip_reason is not None or b.nproc is not None:
            continue
        if b.marker == "continue":
            last[b.path].blocks.append(b)
            continue
        c = Chain([b])
        out.append(c)
        last[b.path] = c
    return out


def test_every_fence_names_its_language_and_markers_are_valid():
    assert len(ALL) > 30, "the parser found too few code blocks"
    seen_runnable: set[Path] = set()
    for b in ALL:
        assert b.lang in RUN or b.lang in SHOWN, (
            f"{b.where}: fence language {b.lang!r}; name one of {sorted(RUN) + sorted(SHOWN)}"
        )
        if b.marker is None:
            pass
        elif b.skip_reason is not None:
            assert len(b.skip_reason.split()) >= 4, f"{b.where}: a skipped block needs a reason, got {b.skip_reason!r}"
        elif b.nproc is not None:
            assert b.lang == "python" and 2 <= b.nproc <= 4, f"{b.where}: torchrun blocks are python, 2 to 4 ranks"
        elif b.marker == "continue":
            assert b.path in seen_runnable, f"{b.where}: 'continue' without a runnable block before it"
        else:
            raise AssertionError(f"{b.where}: unknown docs-test marker {b.marker!r}")
        if b.lang in RUN and b.skip_reason is None and b.nproc is None:
            seen_runnable.add(b.path)
    skipped = [b for b in ALL if b.skip_reason is not None]
    assert len(skipped) <= 6, f"too many skipped examples: {[b.where for b in skipped]}"


def prepare(workdir: Path) -> None:
    for name in LINKED:
        (workdir / name).symlink_to(REPO / name)


def env() -> dict:
    e = dict(os.environ)
    e["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), e.get("PATH", "")])
    e["PYTHONPATH"] = os.pathsep.join([str(REPO), e.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    e.setdefault("OMP_NUM_THREADS", "1")
    e.setdefault("TDDIST_TIMEOUT", "120")
    return e


def run_python(block: Block, namespace: dict) -> None:
    code = compile(block.body, block.where, "exec")
    exec(code, namespace)


def run_bash(block: Block, cwd: Path) -> None:
    r = subprocess.run(
        ["bash", "-euo", "pipefail", "-c", block.body], cwd=cwd, env=env(), capture_output=True, text=True, timeout=600
    )
    assert r.returncode == 0, (
        f"{block.where}: exit status {r.returncode}\nstdout:\n{r.stdout[-4000:]}\nstderr:\n{r.stderr[-4000:]}"
    )


@pytest.mark.parametrize("chain", chains(), ids=lambda c: c.id)
def test_example(chain: Chain, tmp_path, monkeypatch, request):
    if any("s3://" in b.body for b in chain.blocks):  # examples on object storage get the test S3 server
        for name, value in request.getfixturevalue("s3_env").items():
            monkeypatch.setenv(name, value)
    prepare(tmp_path)
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(REPO))
    namespace: dict = {"__name__": "__docs_example__"}
    for block in chain.blocks:
        if RUN[block.lang] == "python":
            run_python(block, namespace)
        else:
            run_bash(block, tmp_path)


def _torchrun_sizes() -> list[int]:
    return sorted({b.nproc for b in ALL if b.nproc is not None})


@pytest.mark.multirank
@pytest.mark.parametrize("nproc", _torchrun_sizes())
def test_torchrun_examples(nproc: int, tmp_path):
    blocks = [b for b in ALL if b.nproc == nproc]
    plan = []
    for i, b in enumerate(blocks):
        d = tmp_path / f"example{i}"
        d.mkdir()
        prepare(d)
        plan.append({"where": b.where, "code": b.body, "dir": str(d)})
    (tmp_path / "plan.json").write_text(json.dumps(plan))
    job = run_job(
        "torchrun",
        nproc,
        REPO / "tests" / "docs_rank.py",
        [str(tmp_path / "plan.json")],
        tmp_path / "reports",
        timeout=300 * len(blocks),
        env={"TDDIST_TIMEOUT": "120"},
    )
    job.assert_ok(nproc)
    for rank, report in job.reports.items():
        assert report["done"] == [b.where for b in blocks], (rank, report)
