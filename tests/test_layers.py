"""The package's wings and who may import whom (docs/design.md, "Wings").

Every module of ``tddist/`` is parsed with ``ast``; nothing of tddist is
imported, so these tests need no torch. Every import statement that
can run counts: at module level, inside functions and methods, in ``try``
blocks. Imports under ``if TYPE_CHECKING:`` never run and are left out.
Dynamic imports (``importlib.import_module``) are not seen.

What an import statement imports, by alias:

- ``import tddist.a.b``: the module ``tddist.a.b`` (a package means its
  ``__init__.py``);
- ``from tddist.a import b`` and ``from .a import b``: ``tddist.a.b`` if
  ``b`` is a submodule, else ``tddist.a`` (``b`` is a name defined there).

The layer rules look at these targets. The cycle test also counts the
packages an import runs on the way (``import tddist.a.b`` runs
``tddist/a/__init__.py``), except the importer's own enclosing packages,
which are initialised before it runs.

Each rule is one test; its failure message lists every violation as
``module -> imported module (file:line, where)``.
"""

from __future__ import annotations

import ast
import functools
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
PACKAGE = "tddist"

#: The flat modules every wing may import.
GROUND_FLOOR = frozenset({"errors", "format", "checksum", "_fs", "_faults", "_compat", "_version"})
#: The flat modules of the public entry points.
API = frozenset({"api", "arguments"})
#: The wings that sit below ``api`` (with the ground floor).
BELOW_API = frozenset({"core", "manifest", "comm", "storage", "saving", "loading", "tools", "ground"})
#: At most this many modules directly in ``tddist/`` (``__init__.py`` not counted).
MAX_FLAT_MODULES = 12
#: At most this many code lines per function: signature included; docstrings, blank and comment-only lines not.
MAX_FUNCTION_LINES = 60


@dataclass(frozen=True)
class Import:
    """``source`` imports ``target``, by the statement at ``path:line``."""

    source: str
    target: str
    path: str
    line: int
    where: str  # "module level" or "in <function>"

    def __str__(self) -> str:
        return f"{self.source} -> {self.target}  ({self.path}:{self.line}, {self.where})"


@dataclass(frozen=True)
class Module:
    name: str  # dotted: "tddist.storage.s3.url"; a package by its own name
    path: Path
    rel: str  # "tddist/storage/s3/url.py"
    tree: ast.Module
    source: str

    @property
    def is_package(self) -> bool:
        return self.path.name == "__init__.py"


def wing(name: str) -> str:
    """The wing of a module of tddist: its folder (``"storage"``), ``"api"``, ``"ground"``, ``"flat"`` (another
    module directly in ``tddist/``) or ``"package"`` (``tddist/__init__.py``, the public facade)."""
    parts = name.split(".")
    if len(parts) == 1:
        return "package"
    if parts[1] in API:
        return "api"
    if parts[1] in GROUND_FLOOR:
        return "ground"
    top = load_modules().get(".".join(parts[:2]))
    return parts[1] if len(parts) > 2 or (top and top.is_package) else "flat"


def load_modules(package_dir: Path = REPO / PACKAGE, package: str = PACKAGE) -> dict[str, Module]:
    """Every module of the package by dotted name, parsed (once)."""
    return _load_modules(Path(package_dir), package)


@functools.cache
def _load_modules(package_dir: Path, package: str) -> dict[str, Module]:
    out = {}
    for path in sorted(package_dir.rglob("*.py")):
        parts = path.relative_to(package_dir).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        name = ".".join((package, *parts))
        source = path.read_text()
        rel = path.relative_to(package_dir.parent).as_posix()
        out[name] = Module(name, path, rel, ast.parse(source, filename=rel), source)
    return out


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _import_statements(body: list[ast.stmt], scope: tuple[str, ...] = ()):
    """Every import statement that can run, with where it is ("module level" or "in f.g").

    Only statements are walked (an import is one): their bodies, branches and
    handlers. The body of ``if TYPE_CHECKING:`` never runs; its ``else`` does.
    """
    for stmt in body:
        if isinstance(stmt, (ast.Import, ast.ImportFrom)):
            yield stmt, f"in {'.'.join(scope)}" if scope else "module level"
        elif isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            yield from _import_statements(stmt.body, (*scope, stmt.name))
        elif isinstance(stmt, ast.If) and _is_type_checking(stmt.test):
            yield from _import_statements(stmt.orelse, scope)
        else:  # if, for, while, with, try, match: every branch
            for name in ("body", "orelse", "finalbody"):
                yield from _import_statements(getattr(stmt, name, []), scope)
            for branch in (*getattr(stmt, "handlers", ()), *getattr(stmt, "cases", ())):
                yield from _import_statements(branch.body, scope)


def resolve_from(node: ast.ImportFrom, module: str, is_package: bool) -> str:
    """The absolute name of the module that ``from <...> import`` names (relative imports resolved)."""
    if node.level == 0:
        return node.module or ""
    parts = (module if is_package else module.rpartition(".")[0]).split(".")
    if node.level > len(parts):
        raise ValueError(f"{module}: relative import beyond the top-level package (level {node.level})")
    base = ".".join(parts[: len(parts) - node.level + 1])
    return f"{base}.{node.module}" if node.module else base


def _ancestors(name: str) -> list[str]:
    """``a.b.c`` -> ``["a", "a.b"]``."""
    parts = name.split(".")
    return [".".join(parts[:i]) for i in range(1, len(parts))]


def _targets(node: ast.Import | ast.ImportFrom, mod: Module, modules: dict[str, Module], package: str) -> list[str]:
    """The modules of the package that one import statement imports, one per alias, in order."""

    def existing(name: str) -> str:  # the name, or its nearest enclosing module ("tddist.x" for a name in x)
        while name not in modules and "." in name:
            name = name.rpartition(".")[0]
        return name

    def within(name: str) -> bool:
        return name == package or name.startswith(package + ".")

    if isinstance(node, ast.Import):
        return [existing(a.name) for a in node.names if within(a.name)]
    base = resolve_from(node, mod.name, mod.is_package)
    if not within(base):
        return []
    return [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else existing(base) for a in node.names]


def imports(package_dir: Path = REPO / PACKAGE, package: str = PACKAGE) -> list[Import]:
    """Every import of one module of the package by another: one per alias, the module itself left out."""
    return list(_imports(Path(package_dir), package))


@functools.cache
def _imports(package_dir: Path, package: str) -> tuple[Import, ...]:
    modules = load_modules(package_dir, package)
    out: list[Import] = []
    for mod in modules.values():
        for node, where in _import_statements(mod.tree.body):
            for target in dict.fromkeys(_targets(node, mod, modules, package)):
                if target != mod.name:
                    out.append(Import(mod.name, target, mod.rel, node.lineno, where))
    return tuple(out)


def graph_edges(edges: list[Import]) -> dict[str, set[str]]:
    """Each module's successors: what it imports, and the packages those imports run on the way."""
    succ: dict[str, set[str]] = {}
    for e in edges:
        own = set(_ancestors(e.source))
        for t in (*_ancestors(e.target), e.target):
            if t != e.source and (t not in own or t == e.target):
                succ.setdefault(e.source, set()).add(t)
    return succ


def strongly_connected(nodes: list[str], succ: dict[str, set[str]]) -> list[list[str]]:
    """Tarjan's strongly connected components (iterative), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    out: list[list[str]] = []
    for start in nodes:
        if start in index:
            continue
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        work = [(start, iter(sorted(succ.get(start, ()))))]
        while work:
            node, it = work[-1]
            for nxt in it:
                if nxt not in index:
                    index[nxt] = low[nxt] = len(index)
                    stack.append(nxt)
                    on_stack.add(nxt)
                    work.append((nxt, iter(sorted(succ.get(nxt, ())))))
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


def _code_lines(mod: Module) -> set[int]:
    """The lines of a module that hold code: not blank, not only a comment, not part of a docstring."""
    lines = {
        i for i, text in enumerate(mod.source.splitlines(), 1) if text.strip() and not text.lstrip().startswith("#")
    }
    for node in ast.walk(mod.tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body:
            first = node.body[0]
            if (
                isinstance(first, ast.Expr)
                and isinstance(first.value, ast.Constant)
                and isinstance(first.value.value, str)
            ):
                lines.difference_update(range(first.lineno, (first.end_lineno or first.lineno) + 1))
    return lines


def long_functions(modules: dict[str, Module], limit: int = MAX_FUNCTION_LINES) -> list[str]:
    """Every function (nested ones too) with more than ``limit`` code lines, from its ``def`` line to its end."""
    out = []
    for mod in modules.values():
        code = _code_lines(mod)
        for node in ast.walk(mod.tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                n = len(code.intersection(range(node.lineno, (node.end_lineno or node.lineno) + 1)))
                if n > limit:
                    out.append(f"{mod.rel}:{node.lineno} {node.name}: {n} code lines")
    return out


def _violations(rule) -> list[str]:
    """The imports of tddist for which ``rule(source, target)`` is true, one line each."""
    return [str(e) for e in imports() if rule(e.source, e.target)]


def _report(what: str, found: list[str]) -> str:
    return f"{len(found)} violation(s): {what}\n" + "\n".join(f"  {v}" for v in found)


def _in_s3(name: str) -> bool:
    return name == f"{PACKAGE}.storage.s3" or name.startswith(f"{PACKAGE}.storage.s3.")


# --- the rules --------------------------------------------------------------------------------


def test_the_walker_sees_the_package() -> None:
    """The walker finds every wing and real imports, so that the rules below cannot pass by seeing nothing."""
    modules = load_modules()
    wings = {wing(m) for m in modules}
    assert {"core", "manifest", "comm", "storage", "saving", "loading", "tools", "jobs", "api"} <= wings, wings
    edges = imports()
    assert any(e.source == f"{PACKAGE}.api" for e in edges), "no imports found in tddist.api: the walker is broken"


def test_core_imports_only_errors_format_and_compat() -> None:
    allowed = {f"{PACKAGE}.errors", f"{PACKAGE}.format", f"{PACKAGE}._compat"}
    found = _violations(lambda s, t: wing(s) == "core" and wing(t) != "core" and t not in allowed)
    assert not found, _report("core/ imports nothing of tddist but errors, format and _compat", found)


def test_manifest_imports_only_core_and_the_ground_floor() -> None:
    found = _violations(lambda s, t: wing(s) == "manifest" and wing(t) not in {"manifest", "core", "ground"})
    assert not found, _report("manifest/ imports only core/ and the ground floor", found)


def test_comm_never_imports_storage_manifest_saving_or_loading() -> None:
    found = _violations(lambda s, t: wing(s) == "comm" and wing(t) in {"storage", "manifest", "saving", "loading"})
    assert not found, _report("comm/ never imports storage/, manifest/, saving/ or loading/", found)


def test_storage_never_imports_comm_saving_or_loading() -> None:
    found = _violations(lambda s, t: wing(s) == "storage" and wing(t) in {"comm", "saving", "loading"})
    assert not found, _report("storage/ never imports comm/, saving/ or loading/", found)


def test_loading_never_imports_saving() -> None:
    found = _violations(lambda s, t: wing(s) == "loading" and wing(t) == "saving")
    assert not found, _report("loading/ never imports saving/", found)


def test_only_backends_imports_s3() -> None:
    allowed = f"{PACKAGE}.storage.backends"
    found = _violations(lambda s, t: _in_s3(t) and not _in_s3(s) and s != allowed)
    assert not found, _report("only storage/backends.py (and storage/s3/ itself) imports storage/s3/", found)


def test_nothing_below_api_imports_api() -> None:
    found = _violations(lambda s, t: wing(s) in BELOW_API and wing(t) == "api")
    assert not found, _report(
        "nothing below api (core, manifest, comm, storage, saving, loading, tools, "
        "the ground floor) imports tddist.api or tddist.arguments",
        found,
    )


def test_jobs_and_tools_never_import_each_other() -> None:
    found = _violations(lambda s, t: {wing(s), wing(t)} == {"jobs", "tools"})
    assert not found, _report("jobs/ and tools/ never import each other", found)


def test_few_flat_modules() -> None:
    flat = sorted(m.rel for m in load_modules().values() if m.name.count(".") == 1 and not m.is_package)
    assert len(flat) <= MAX_FLAT_MODULES, (
        f"{len(flat)} modules directly in {PACKAGE}/ (at most {MAX_FLAT_MODULES}); move some into a wing:\n  "
        + "\n  ".join(flat)
    )


def test_no_import_cycles() -> None:
    modules = load_modules()
    edges = imports()
    succ = graph_edges(edges)
    groups = [g for g in strongly_connected(sorted(modules), succ) if len(g) > 1]
    lines = []
    for group in groups:
        members = set(group)
        lines.append(f"modules importing each other: {', '.join(group)}")
        lines += [f"    {e}" for e in edges if e.source in members and members & {e.target, *_ancestors(e.target)}]
    assert not groups, f"{len(groups)} group(s) of modules import each other:\n" + "\n".join(lines)


def test_no_long_functions() -> None:
    found = long_functions(load_modules())
    assert not found, _report(f"no function over {MAX_FUNCTION_LINES} code lines", found)


# --- the walker on packages written for it ----------------------------------------------------


def _write(root: Path, files: dict[str, str]) -> Path:
    for rel, text in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return root / "pkg"


def test_walker_resolves_every_kind_of_import(tmp_path: Path) -> None:
    pkg = _write(
        tmp_path,
        {
            "pkg/__init__.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .api import save\n"
            "else:\n    from . import errors\n",
            "pkg/api.py": "import json\nfrom .errors import E\nfrom . import errors, __version__\n"
            "def save():\n    from .store import s3\n    import pkg.store.base\n",
            "pkg/errors.py": "class E(Exception): pass\n",
            "pkg/store/__init__.py": "from .. import errors\n",
            "pkg/store/base.py": "from ..errors import E\nfrom . import s3\n",
            "pkg/store/s3/__init__.py": "try:\n    from ..base import x\nexcept ImportError:\n"
            "    from ...errors import E\n",
            "pkg/store/s3/url.py": "from ... import errors\nfrom .. import base\nclass C:\n    def m(self):\n"
            "        from pkg.store.s3 import url\n",
        },
    )
    got = {(e.source, e.target, e.line, e.where) for e in imports(pkg, "pkg")}
    assert got == {
        ("pkg", "pkg.errors", 5, "module level"),  # the else branch of TYPE_CHECKING runs; pkg.api does not count
        ("pkg.api", "pkg.errors", 2, "module level"),
        ("pkg.api", "pkg.errors", 3, "module level"),
        ("pkg.api", "pkg", 3, "module level"),  # from . import __version__: a name of the package's __init__
        ("pkg.api", "pkg.store.s3", 5, "in save"),
        ("pkg.api", "pkg.store.base", 6, "in save"),
        ("pkg.store", "pkg.errors", 1, "module level"),  # from .. import errors, in a package's __init__
        ("pkg.store.base", "pkg.errors", 1, "module level"),
        ("pkg.store.base", "pkg.store.s3", 2, "module level"),
        ("pkg.store.s3", "pkg.store.base", 2, "module level"),  # a name x of base, in a try block
        ("pkg.store.s3", "pkg.errors", 4, "module level"),  # the except branch counts too
        ("pkg.store.s3.url", "pkg.errors", 1, "module level"),
        ("pkg.store.s3.url", "pkg.store.base", 2, "module level"),
    }, sorted(got)  # the import of pkg.store.s3.url by itself is left out


def test_cycles_count_deferred_imports_and_packages_on_the_way(tmp_path: Path) -> None:
    pkg = _write(
        tmp_path,
        {
            "pkg/__init__.py": "",
            "pkg/a/__init__.py": "from ..b import g\n",
            "pkg/a/x.py": "",
            "pkg/b.py": "def g():\n    import pkg.a.x\n",  # runs pkg/a/__init__.py, which imports b
            "pkg/c.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from . import d\n",
            "pkg/d.py": "from . import c\n",
        },
    )
    modules = load_modules(pkg, "pkg")
    groups = [g for g in strongly_connected(sorted(modules), graph_edges(imports(pkg, "pkg"))) if len(g) > 1]
    assert groups == [["pkg.a", "pkg.b"]], groups


def test_function_length_counts_code_lines_only(tmp_path: Path) -> None:
    def body(n: int) -> str:
        return "\n".join(f"    x{i} = {i}  # a comment" for i in range(n))

    pkg = _write(
        tmp_path,
        {
            "pkg/__init__.py": "",
            "pkg/m.py": f'def f(\n    a,\n):\n    """Doc.\n\n    More.\n    """\n\n    # a comment\n{body(58)}\n'
            f'\n\n@decorated\ndef g():\n    """Doc."""\n{body(57)}\n    y = """\n"""\n',
        },
    )
    modules = load_modules(pkg, "pkg")  # f: 3 signature lines + 58; g: 1 + 57 + a string on 2 lines
    assert long_functions(modules, limit=61) == []
    assert long_functions(modules, limit=60) == ["pkg/m.py:1 f: 61 code lines"]
    assert long_functions(modules, limit=59) == ["pkg/m.py:1 f: 61 code lines", "pkg/m.py:71 g: 60 code lines"]
