"""Every code example in README.md and docs/*.md runs, so the documentation cannot drift from the code.

Every fenced block is found. ``python`` and ``bash`` blocks are run; every
other fence must name its language (``text``, ``json``, ...), so that no
example escapes by having none. An HTML comment on the line before a fence
changes how it runs:

- ``<!-- docs-test: continue -->``: after the previous runnable block of the
  page, in the same process and directory (and, for python, the same
  namespace);
- ``<!-- docs-test: torchrun N -->``: on N ranks, as under ``torchrun
  --nproc-per-node=N``;
- ``<!-- docs-test: skip: REASON -->``: not run, for the REASON given.

Every example runs alone, as a reader would run it: in fresh processes (one,
or one per rank) and a fresh directory, which holds links to the
repository's ``launch/``, ``slurm/`` and ``benchmarks/``
(``tests/docs_rank.py`` says how the processes are made). Nothing an example
leaves behind (files, a process group, a random seed, environment variables)
reaches another one, so an example cannot pass only because another ran
before it. An example that names an ``s3://`` prefix gets the session's S3
server, with no bucket but the tests' own. Python blocks are run with
``exec`` in a namespace named ``__main__``; bash blocks by ``bash -euo
pipefail`` with the virtual environment's ``bin`` first on ``PATH``.

The python blocks of the pages a new user runs first (``MAIN_JOB_PAGES``)
can import only what ``launch/demo.sh`` installs, so they cannot need a
package that only an extra brings.
"""

from __future__ import annotations

import functools
import os
import re
import subprocess
import sys
import textwrap
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from tests import docs_rank
from tests.launch_util import free_port

REPO = Path(__file__).resolve().parent.parent
DOCS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
RUN = {"python": "python", "py": "python", "bash": "bash", "sh": "bash"}
SHOWN = {"text", "json", "yaml", "toml", "console"}
FENCE = re.compile(r"^(?P<indent> *)(?P<fence>```+|~~~+)(?P<info>.*)$")
MARKER = re.compile(r"^\s*<!--\s*docs-test:\s*(?P<what>.*?)\s*-->\s*$")
LINKED = ("launch", "slurm", "benchmarks")
TIMEOUT_S = 600  # per example
#: The pages a new user runs first, right after ``launch/demo.sh``: their python examples may import only what
#: that script's setup installs (the package's dependencies and the extras it names).
MAIN_JOB_PAGES = (REPO / "README.md", REPO / "docs" / "index.md", REPO / "docs" / "getting-started.md")


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
    workdir.mkdir()
    for name in LINKED:
        (workdir / name).symlink_to(REPO / name)


def env() -> dict:
    e = dict(os.environ)
    e["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), e.get("PATH", "")])
    e["PYTHONPATH"] = os.pathsep.join([str(REPO), e.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    e.setdefault("OMP_NUM_THREADS", "1")
    e.setdefault("TDDIST_TIMEOUT", "120")
    return e


def _pyproject() -> dict:
    try:
        import tomllib
    except ModuleNotFoundError:  # Python 3.10
        tomllib = pytest.importorskip("tomli", reason="reading pyproject.toml needs tomli on Python 3.10")
    return tomllib.loads((REPO / "pyproject.toml").read_text())


def main_job_requirements() -> list[str]:
    """What ``launch/demo.sh`` installs: the dependencies in pyproject.toml and the extras it passes to setup.sh."""
    project = _pyproject()["project"]
    m = re.search(r"launch/setup\.sh +([\w,-]+)", (REPO / "launch" / "demo.sh").read_text())
    assert m, "launch/demo.sh no longer runs 'launch/setup.sh EXTRAS'; update main_job_requirements"
    extras = m.group(1).split(",")
    return [*project["dependencies"], *(r for e in extras for r in project["optional-dependencies"][e])]


@functools.cache
def not_installed_by_main_job() -> tuple[str, ...]:
    return docs_rank.modules_outside(main_job_requirements(), keep=("tddist", "tests"))


@pytest.fixture(scope="module", autouse=True)
def _forkserver():
    """The examples' forkserver (tests/docs_rank.py) lives as long as this module's tests."""
    yield
    docs_rank.stop_forkserver()


def examples() -> list:
    """Every example, as a pytest parameter: each chain of single-process blocks, and each multi-rank block."""
    out = [pytest.param(c.blocks, 1, id=c.id) for c in chains()]
    for b in ALL:
        if b.nproc is not None and b.skip_reason is None:
            out.append(pytest.param([b], b.nproc, id=f"{b.where}[{b.nproc} ranks]", marks=pytest.mark.multirank))
    return out


def run(blocks: list[Block], nproc: int, tmp_path: Path, extra_env: dict) -> list[docs_rank.Outcome]:
    """Run the example in fresh processes (one per rank) and the fresh directory ``tmp_path/work``."""
    workdir, outdir = tmp_path / "work", tmp_path / "out"
    prepare(workdir)
    outdir.mkdir()
    base = {**env(), **extra_env}
    port = free_port() if nproc > 1 else 0
    envs = [dict(base, **docs_rank.torchrun_env(r, nproc, port)) if nproc > 1 else base for r in range(nproc)]
    steps = tuple(docs_rank.Step(b.where, RUN[b.lang], b.body) for b in blocks)
    blocked = not_installed_by_main_job() if blocks[0].path in MAIN_JOB_PAGES else ()
    return docs_rank.run_example(steps, envs, workdir, outdir, timeout=TIMEOUT_S, blocked=blocked)


def fresh_object_store(s3_env: dict) -> None:
    """Delete every bucket of the session's S3 server but the tests' own, with all it holds.

    So an example on ``s3://`` starts with the buckets it creates itself, as
    on a new account, whatever another example left there.
    """
    import boto3

    from tests.conftest import S3_BUCKET

    s3 = boto3.client(
        "s3",
        endpoint_url=s3_env["AWS_ENDPOINT_URL"],
        aws_access_key_id=s3_env["AWS_ACCESS_KEY_ID"],
        aws_secret_access_key=s3_env["AWS_SECRET_ACCESS_KEY"],
        region_name=s3_env["AWS_DEFAULT_REGION"],
    )
    for bucket in [b["Name"] for b in s3.list_buckets()["Buckets"] if b["Name"] != S3_BUCKET]:
        for upload in s3.list_multipart_uploads(Bucket=bucket).get("Uploads", []):
            s3.abort_multipart_upload(Bucket=bucket, Key=upload["Key"], UploadId=upload["UploadId"])
        for page in s3.get_paginator("list_objects_v2").paginate(Bucket=bucket):
            keys = [{"Key": o["Key"]} for o in page.get("Contents", [])]
            if keys:
                s3.delete_objects(Bucket=bucket, Delete={"Objects": keys})
        s3.delete_bucket(Bucket=bucket)


def example_env(blocks: list[Block], request) -> dict:
    """The test S3 server's environment, emptied of other examples' buckets, for an example that uses s3://."""
    if not any("s3://" in b.body for b in blocks):
        return {}
    s3_env = request.getfixturevalue("s3_env")
    fresh_object_store(s3_env)
    return s3_env


@pytest.mark.parametrize("blocks, nproc", examples())
def test_example(blocks: list[Block], nproc: int, tmp_path, request):
    outcomes = run(blocks, nproc, tmp_path, example_env(blocks, request))
    bad = [o for o in outcomes if not o.ok]
    note = (
        "(on this page, python can import only what launch/demo.sh installs)\n"
        if blocks[0].path in MAIN_JOB_PAGES
        else ""
    )
    assert not bad, note + "\n\n".join(o.describe() for o in bad[:2])
    assert all(o.done == tuple(b.where for b in blocks) for o in outcomes), outcomes


def synthetic(page: str, *codes: str) -> list[Block]:
    return [Block(REPO / page, i + 1, "python", textwrap.dedent(code), None) for i, code in enumerate(codes)]


@pytest.mark.multirank
def test_an_example_sees_nothing_another_left(tmp_path, request):
    """What one example leaves (a file, a process group, an environment variable, module state, a bucket) is
    not there for the next, on one rank or many; blocks of one chain share their process and namespace."""
    leave = """
        import os, torch, torch.distributed as dist
        if "RANK" in os.environ:
            dist.init_process_group("gloo")
        torch.manual_seed(7)
        os.environ["LEFT_BY_AN_EXAMPLE"] = "1"
        open(f"left-{os.environ.get('RANK', '0')}", "w").close()
        if os.environ.get("RANK", "0") == "0":
            import boto3
            s3 = boto3.client("s3")
            s3.create_bucket(Bucket="docs-left-behind")
            s3.put_object(Bucket="docs-left-behind", Key="ckpt/x", Body=b"x")  # s3://docs-left-behind/ckpt
        """
    check = """
        import os, sys, torch, torch.distributed as dist
        assert not dist.is_initialized() and "LEFT_BY_AN_EXAMPLE" not in os.environ
        assert sorted(os.listdir()) == ["benchmarks", "launch", "slurm"], os.listdir()
        assert torch.initial_seed() != 7
        import boto3
        buckets = [b["Name"] for b in boto3.client("s3").list_buckets()["Buckets"]]
        assert "docs-left-behind" not in buckets  # s3://docs-left-behind
        """
    for nproc in (1, 2):
        for i, blocks in enumerate(
            (synthetic("docs/a.md", leave, "assert torch.initial_seed() == 7"), synthetic("docs/b.md", check))
        ):
            (tmp_path / f"{nproc}-{i}").mkdir()
            outcomes = run(blocks, nproc, tmp_path / f"{nproc}-{i}", example_env(blocks, request))
            assert all(o.ok for o in outcomes), "\n\n".join(o.describe() for o in outcomes if not o.ok)


def test_api_reference_signatures_are_formatted_with_the_docs_extra(tmp_path):
    """The API reference built with only the ``docs`` extra installed shows each long signature one parameter a
    line, no wider than mkdocs.yml's ``line_length`` (mkdocstrings formats signatures only when ruff or black is
    importable, and otherwise prints one long line)."""
    import html

    import yaml

    plugins = yaml.safe_load((REPO / "mkdocs.yml").read_text())["plugins"]
    mkdocstrings = next(p["mkdocstrings"] for p in plugins if isinstance(p, dict) and "mkdocstrings" in p)
    options = mkdocstrings["handlers"]["python"]["options"]
    assert options["separate_signature"] and options["show_signature_annotations"]
    width = options["line_length"]
    project = _pyproject()["project"]
    blocked = docs_rank.modules_outside(
        [*project["dependencies"], *project["optional-dependencies"]["docs"]], ("tddist", "tests")
    )
    build = (
        "import sys; from tests.docs_rank import block_imports; block_imports(sys.argv[1].split(',')); "
        "from mkdocs.__main__ import cli; cli(['build', '--strict', '--quiet', '--site-dir', sys.argv[2]])"
    )
    site = tmp_path / "site"
    r = subprocess.run(
        [sys.executable, "-c", build, ",".join(blocked), str(site)],
        cwd=REPO,
        env={**env(), "NO_MKDOCS_2_WARNING": "1"},
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert r.returncode == 0, r.stderr[-4000:]
    page = (site / "api" / "index.html").read_text()
    signatures = [
        html.unescape(re.sub(r"<[^>]+>", "", s))
        for s in re.findall(r'<div class="doc-signature highlight"><pre>(.*?)</pre>', page, re.S)
    ]
    save = next(s for s in signatures if s.startswith("save("))
    assert save.splitlines()[:3] == ["save(", "    data: Any,", "    prefix: str | PathLike,"], save[:300]
    too_wide = [line for s in signatures for line in s.splitlines() if len(line) > width]
    assert not too_wide, f"signature lines wider than line_length={width}: {too_wide[:5]}"
