"""The package's structure: no import cycles between tddist's modules.

Every module of ``tddist/`` is parsed with ``ast`` (nothing is imported), and
every import statement anywhere in it counts: at module level, inside
functions and methods (deferred imports), in ``try`` blocks. Only imports
under ``if TYPE_CHECKING:`` are left out, since they never run. Dynamic
imports (``importlib.import_module``) are not seen.

What an import statement depends on:

- ``import tddist.a.b`` and ``from tddist.a import b`` / ``from .a import b``:
  the module ``tddist.a.b`` if ``b`` is a submodule, else ``tddist.a``; plus
  the packages on the way (``tddist.a``), except the importer's own enclosing
  packages, which are always initialised before it runs.
- ``from . import x``: the submodule ``x``, if there is one.
- ``import tddist``, ``from tddist import save``, ``from . import __version__``
  (a name that is not a submodule): the package itself, ``tddist/__init__.py``.

A cycle is printed with the file, line and function of every import on it.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
PACKAGE = "tddist"
MAX_CYCLES_PER_GROUP = 50


@dataclass(frozen=True)
class Import:
    """One dependency of ``source`` on ``target``, made by the import statement at ``path:line``."""

    source: str
    target: str
    path: str
    line: int
    where: str  # "module level" or "in <function>"

    def __str__(self) -> str:
        return f"{self.source} -> {self.target}  ({self.path}:{self.line}, {self.where})"


def find_modules(package_dir: Path, package: str) -> dict[str, Path]:
    """Every module of the package by dotted name (packages by their ``__init__.py``)."""
    out = {}
    for path in sorted(package_dir.rglob("*.py")):
        parts = path.relative_to(package_dir).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join((package, *parts))] = path
    return out


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


class _Imports(ast.NodeVisitor):
    """Collects (node, enclosing function) for every import statement that can run."""

    def __init__(self) -> None:
        self.found: list[tuple[ast.Import | ast.ImportFrom, str]] = []
        self.functions: list[str] = []

    def _scope(self, node) -> None:
        self.functions.append(node.name)
        self.generic_visit(node)
        self.functions.pop()

    visit_FunctionDef = visit_AsyncFunctionDef = visit_ClassDef = _scope

    def visit_If(self, node: ast.If) -> None:
        if _is_type_checking(node.test):  # never runs: only the else branch counts
            for stmt in node.orelse:
                self.visit(stmt)
            return
        self.generic_visit(node)

    def _import(self, node) -> None:
        where = f"in {'.'.join(self.functions)}" if self.functions else "module level"
        self.found.append((node, where))

    visit_Import = visit_ImportFrom = _import


def _ancestors(name: str) -> list[str]:
    """``a.b.c`` -> ``["a", "a.b"]``."""
    parts = name.split(".")
    return [".".join(parts[:i]) for i in range(1, len(parts))]


def _resolve_from(node: ast.ImportFrom, module: str, is_package: bool) -> str:
    """The absolute module name that ``from <...> import`` names."""
    if node.level == 0:
        return node.module or ""
    package = module if is_package else module.rpartition(".")[0]
    parts = package.split(".")
    if node.level - 1 > len(parts) - 1:
        raise ValueError(f"{module}: relative import beyond the top-level package (level {node.level})")
    base = ".".join(parts[: len(parts) - (node.level - 1)])
    return f"{base}.{node.module}" if node.module else base


def import_graph(package_dir: Path, package: str = PACKAGE) -> tuple[dict[str, Path], list[Import]]:
    """The package's modules, and every dependency between them that an import statement makes."""
    modules = find_modules(package_dir, package)
    edges: list[Import] = []

    def within(name: str) -> bool:
        return name == package or name.startswith(package + ".")

    def existing(name: str) -> str | None:
        """``name`` or its nearest enclosing module that exists (``tddist.x.y`` for a name ``y`` in ``x``)."""
        while name and name not in modules:
            name = name.rpartition(".")[0]
        return name or None

    for module, path in modules.items():
        is_package = path.name == "__init__.py"
        own_packages = set(_ancestors(module)) | ({module} if is_package else set())
        collector = _Imports()
        collector.visit(ast.parse(path.read_text(), filename=str(path)))
        rel = path.relative_to(package_dir.parent).as_posix()
        for node, where in collector.found:
            targets: list[str] = []  # every module the statement runs, packages on the way included
            named: set[str] = set()  # the modules it takes a name from (or binds) themselves
            if isinstance(node, ast.Import):
                for alias in node.names:
                    if within(alias.name):
                        targets += [*_ancestors(alias.name), alias.name]
                        named.add(existing(alias.name) or "")
            else:
                base = _resolve_from(node, module, is_package)
                if not within(base):
                    continue
                targets += [*_ancestors(base), base]
                for alias in node.names:
                    sub = f"{base}.{alias.name}"
                    if sub in modules:  # from . import x: the submodule x
                        targets.append(sub)
                    else:  # a name defined in base itself (from . import __version__)
                        named.add(existing(base) or "")
            seen = set()
            for t in targets:
                t = existing(t)
                if t is None or t in seen or t == module:
                    continue
                seen.add(t)
                # the importer's enclosing packages are initialised before it runs: importing them is no
                # dependency, unless the statement takes a name from the package itself
                if t in own_packages and t not in named:
                    continue
                edges.append(Import(module, t, rel, node.lineno, where))
    return modules, edges


def strongly_connected(nodes: list[str], succ: dict[str, list[str]]) -> list[list[str]]:
    """Tarjan's strongly connected components (iterative), each sorted, in discovery order."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    out: list[list[str]] = []
    counter = 0
    for start in nodes:
        if start in index:
            continue
        work = [(start, iter(succ.get(start, [])))]
        index[start] = low[start] = counter
        counter += 1
        stack.append(start)
        on_stack.add(start)
        while work:
            node, it = work[-1]
            for nxt in it:
                if nxt not in index:
                    index[nxt] = low[nxt] = counter
                    counter += 1
                    stack.append(nxt)
                    on_stack.add(nxt)
                    work.append((nxt, iter(succ.get(nxt, []))))
                    break
                if nxt in on_stack:
                    low[node] = min(low[node], index[nxt])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    group = []
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        group.append(member)
                        if member == node:
                            break
                    out.append(sorted(group))
    return out


def elementary_cycles(group: list[str], succ: dict[str, list[str]], limit: int) -> Iterator[list[str]]:
    """The simple cycles inside one strongly connected group, each starting at its smallest module."""
    members = set(group)
    count = 0
    for start in sorted(group):
        allowed = {m for m in members if m >= start}
        path = [start]
        on_path = {start}
        work = [iter(sorted(n for n in succ.get(start, []) if n in allowed))]
        while work:
            for nxt in work[-1]:
                if nxt == start:
                    yield [*path, start]
                    count += 1
                    if count >= limit:
                        return
                elif nxt not in on_path:
                    path.append(nxt)
                    on_path.add(nxt)
                    work.append(iter(sorted(n for n in succ.get(nxt, []) if n in allowed)))
                    break
            else:
                work.pop()
                on_path.discard(path.pop())


def import_cycles(modules: dict[str, Path], edges: list[Import]) -> list[tuple[list[str], list[list[str]]]]:
    """Each group of modules that import each other, with the simple cycles in it."""
    succ: dict[str, list[str]] = {m: [] for m in modules}
    for e in edges:
        if e.target not in succ[e.source]:
            succ[e.source].append(e.target)
    out = []
    for group in strongly_connected(sorted(modules), succ):
        if len(group) > 1 or group[0] in succ[group[0]]:
            out.append((group, list(elementary_cycles(group, succ, MAX_CYCLES_PER_GROUP))))
    return sorted(out)


def describe_cycles(cycles, edges: list[Import]) -> str:
    by_pair: dict[tuple[str, str], list[Import]] = {}
    for e in edges:
        by_pair.setdefault((e.source, e.target), []).append(e)
    lines = []
    for group, simple in cycles:
        lines.append(f"modules importing each other: {', '.join(group)}")
        for cycle in simple:
            lines.append("  cycle: " + " -> ".join(cycle))
            for a, b in zip(cycle, cycle[1:]):
                for e in by_pair[(a, b)]:
                    lines.append(f"    {e}")
        if len(simple) >= MAX_CYCLES_PER_GROUP:
            lines.append(f"  ... (only the first {MAX_CYCLES_PER_GROUP} cycles shown)")
    return "\n".join(lines)


# --- the tests --------------------------------------------------------------------------------


def test_no_import_cycles() -> None:
    """No module of tddist depends on itself through its imports (deferred ones included)."""
    modules, edges = import_graph(REPO / PACKAGE)
    assert PACKAGE in modules and f"{PACKAGE}.errors" in modules, sorted(modules)
    assert edges, "no imports found: the walker is broken"
    cycles = import_cycles(modules, edges)
    text = describe_cycles(cycles, edges)
    print(text or "no import cycles")
    assert not cycles, f"{len(cycles)} group(s) of modules import each other:\n{text}"


def _write(root: Path, files: dict[str, str]) -> Path:
    for rel, text in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return root / "pkg"


def test_walker_sees_every_kind_of_import(tmp_path: Path) -> None:
    """The walker on a package written for it: every import form resolves to the right module."""
    pkg = _write(
        tmp_path,
        {
            "pkg/__init__.py": "from ._version import __version__\nfrom typing import TYPE_CHECKING\n"
            "if TYPE_CHECKING:\n    from .api import save\nelse:\n    from . import light\n",
            "pkg/_version.py": "__version__ = '1'\n",
            "pkg/light.py": "import os\n",
            "pkg/api.py": "import json\nfrom .errors import E\nfrom . import fmt, __version__\n"
            "def save():\n    from .comm import resolve\n    import pkg.sub.deep\n",
            "pkg/errors.py": "class E(Exception): pass\n",
            "pkg/fmt.py": "import pkg\n",
            "pkg/comm.py": "try:\n    from pkg.sub import deep as d\nexcept ImportError:\n    d = None\n",
            "pkg/sub/__init__.py": "from .. import errors\n",
            "pkg/sub/deep.py": "from ..errors import E\nfrom . import helper\nfrom .helper import x\n"
            "class C:\n    def m(self):\n        from .. import comm\n",
            "pkg/sub/helper.py": "x = 1\n",
            "pkg/sub/standalone.py": "from pkg import fmt\nfrom pkg.sub import helper\n",
        },
    )
    modules, edges = import_graph(pkg, "pkg")
    assert set(modules) == {
        "pkg",
        "pkg._version",
        "pkg.light",
        "pkg.api",
        "pkg.errors",
        "pkg.fmt",
        "pkg.comm",
        "pkg.sub",
        "pkg.sub.deep",
        "pkg.sub.helper",
        "pkg.sub.standalone",
    }
    got = {(e.source, e.target, e.line, e.where) for e in edges}
    assert got == {
        ("pkg", "pkg._version", 1, "module level"),
        ("pkg", "pkg.light", 6, "module level"),  # the else branch of TYPE_CHECKING runs; pkg.api does not count
        ("pkg.api", "pkg.errors", 2, "module level"),
        ("pkg.api", "pkg.fmt", 3, "module level"),  # from . import fmt: the submodule
        ("pkg.api", "pkg", 3, "module level"),  # from . import __version__: the package's __init__
        ("pkg.api", "pkg.comm", 5, "in save"),
        ("pkg.api", "pkg.sub", 6, "in save"),  # import pkg.sub.deep runs pkg/sub/__init__.py too
        ("pkg.api", "pkg.sub.deep", 6, "in save"),
        ("pkg.fmt", "pkg", 1, "module level"),  # import pkg
        ("pkg.comm", "pkg.sub", 2, "module level"),  # in a try block; from pkg.sub import deep runs pkg.sub
        ("pkg.comm", "pkg.sub.deep", 2, "module level"),
        ("pkg.sub", "pkg.errors", 1, "module level"),  # from .. import errors
        ("pkg.sub.deep", "pkg.errors", 1, "module level"),
        ("pkg.sub.deep", "pkg.sub.helper", 2, "module level"),
        ("pkg.sub.deep", "pkg.sub.helper", 3, "module level"),
        ("pkg.sub.deep", "pkg.comm", 6, "in C.m"),
        ("pkg.sub.standalone", "pkg.fmt", 1, "module level"),
        ("pkg.sub.standalone", "pkg.sub.helper", 2, "module level"),  # pkg.sub is its own package: no edge
    }, sorted(got)
    cycles = import_cycles(modules, edges)
    # pkg.comm -> pkg.sub.deep -> pkg.comm (deferred, inside a method), and nothing else
    assert [(group, simple) for group, simple in cycles] == [
        (["pkg.comm", "pkg.sub.deep"], [["pkg.comm", "pkg.sub.deep", "pkg.comm"]])
    ], cycles
    text = describe_cycles(cycles, edges)
    assert "pkg/sub/deep.py:6, in C.m" in text and "pkg/comm.py:2, module level" in text, text


def test_cycles_through_the_package_init(tmp_path: Path) -> None:
    """A submodule that takes a name from the package while __init__ imports that submodule is a cycle, and
    so is one of three modules through a deferred import; a module importing itself is no dependency."""
    pkg = _write(
        tmp_path,
        {
            "pkg/__init__.py": "from .a import f\n",
            "pkg/a.py": "from . import __version__\n",
            "pkg/b.py": "from .c import g\n",
            "pkg/c.py": "def g():\n    from .d import h\n",
            "pkg/d.py": "import pkg.b\n",
            "pkg/e.py": "from pkg import e\n",
        },
    )
    modules, edges = import_graph(pkg, "pkg")
    cycles = import_cycles(modules, edges)
    assert [group for group, _ in cycles] == [["pkg", "pkg.a"], ["pkg.b", "pkg.c", "pkg.d"]], cycles
    assert cycles[1][1] == [["pkg.b", "pkg.c", "pkg.d", "pkg.b"]]
    selfish = _write(tmp_path / "s", {"pkg/__init__.py": "", "pkg/x.py": "def f():\n    import pkg.x\n"})
    m2, e2 = import_graph(selfish, "pkg")
    assert e2 == [] and import_cycles(m2, e2) == []  # a module importing itself is no dependency
