"""MkDocs hook: the reference of the ``tddist`` command, generated from its argparse parser.

``<!-- tddist-cli-reference -->`` in a page is replaced by one section per
command: its description, usage and a table of its arguments, all taken
from ``tddist.cli.parser()``, so the page cannot drift from the command.
"""

from __future__ import annotations

import argparse
import os

MARKER = "<!-- tddist-cli-reference -->"


def _cell(text: str) -> str:
    return " ".join(text.split()).replace("|", "\\|")


def _description(text: str) -> str:
    """argparse's raw description as markdown: indented paragraphs become code blocks."""
    out = []
    for para in text.strip("\n").split("\n\n"):
        lines = para.splitlines()
        if lines and all(line.startswith("  ") for line in lines):
            body = "\n".join(line[2:] for line in lines)
            out.append(f"```text\n{body}\n```")
        else:
            out.append(" ".join(line.strip() for line in lines))
    return "\n\n".join(out)


def _arguments(p: argparse.ArgumentParser) -> str:
    rows = ["| argument | meaning |", "|---|---|"]
    for a in p._actions:
        if isinstance(a, (argparse._HelpAction, argparse._SubParsersAction)):
            continue
        if a.option_strings:
            name = ", ".join(a.option_strings)
            if a.nargs != 0:
                name += f" {a.metavar or a.dest.upper()}"
        else:
            name = a.metavar or a.dest
        rows.append(f"| `{name}` | {_cell(a.help or '')} |")
    return "\n".join(rows)


def reference() -> str:
    from tddist.cli import parser

    os.environ["COLUMNS"] = "100"  # usage lines wrapped the same on every machine
    p = parser()
    sub = next(a for a in p._actions if isinstance(a, argparse._SubParsersAction))
    parts = ["### tddist", "", "```text", p.format_usage().strip(), "```", "", _arguments(p), ""]
    helps = {c.dest: c.help for c in sub._choices_actions}
    for name, sp in sub.choices.items():
        parts += [f"### tddist {name}", "", f"*{_cell(helps.get(name, ''))}*", ""]
        parts += [_description(sp.description or ""), ""]
        parts += ["```text", sp.format_usage().strip(), "```", "", _arguments(sp), ""]
    return "\n".join(parts)


def on_page_markdown(markdown: str, page, config, files) -> str:
    if MARKER in markdown:
        markdown = markdown.replace(MARKER, reference())
    return markdown
