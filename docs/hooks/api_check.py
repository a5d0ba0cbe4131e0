"""MkDocs hook: the API reference covers every public name, and every one has a docstring.

On the page that holds ``::: identifier`` directives (docs/api.md), it warns
(and ``mkdocs build --strict`` fails) when:

- a name in ``tddist.__all__`` is not documented there;
- a documented function or class has no docstring of its own (a dataclass's
  generated ``Name(field: type, ...)`` text does not count);
- a public method or property of a documented class has none.

"""

from __future__ import annotations

import importlib
import inspect
import logging
import re

log = logging.getLogger("mkdocs.plugins.tddist_api_check")

DIRECTIVE = re.compile(r"^::: ([\w.]+)", re.M)

#: Public names that are constants, documented in prose rather than by a directive.
CONSTANTS = frozenset({"__version__", "EXIT_PREEMPTED"})


def _resolve(identifier: str):
    module, _, name = identifier.rpartition(".")
    return getattr(importlib.import_module(module), name)


def _own_doc(obj) -> str:
    doc = obj.__doc__ if (inspect.isclass(obj) or inspect.isfunction(obj)) else inspect.getdoc(obj)
    doc = (doc or "").strip()
    if inspect.isclass(obj) and doc.startswith(f"{obj.__name__}("):
        return ""  # the text dataclasses generate when there is no docstring
    return doc


def missing_docstrings(identifiers: list[str]) -> list[str]:
    missing = []
    for ident in identifiers:
        obj = _resolve(ident)
        if inspect.ismodule(obj) or not (inspect.isclass(obj) or callable(obj)):
            continue
        if not _own_doc(obj):
            missing.append(ident)
        if inspect.isclass(obj):
            for name, member in vars(obj).items():
                if name.startswith("_"):
                    continue
                target = member.fget if isinstance(member, property) else member
                if isinstance(target, (staticmethod, classmethod)):
                    target = target.__func__
                if inspect.isfunction(target) and not (target.__doc__ or "").strip():
                    missing.append(f"{ident}.{name}")
    return missing


def on_page_markdown(markdown: str, page, config, files) -> str:
    identifiers = DIRECTIVE.findall(markdown)
    if not identifiers:
        return markdown
    import tddist

    documented = {i.removeprefix("tddist.") for i in identifiers if i.count(".") == 1}
    for name in sorted(set(tddist.__all__) - documented - CONSTANTS):
        log.warning(
            "%s: tddist.%s is public (tddist.__all__) but has no '::: tddist.%s' entry", page.file.src_uri, name, name
        )
    for name in sorted(CONSTANTS - {"__version__"}):
        if f"`{name}`" not in markdown:
            log.warning("%s: the constant tddist.%s is not described", page.file.src_uri, name)
    for ident in missing_docstrings(identifiers):
        log.warning(
            "%s: %s has no docstring; document it (the API reference is built from docstrings)",
            page.file.src_uri,
            ident,
        )
    return markdown
