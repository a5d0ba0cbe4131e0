"""Output helpers of the ``tddist`` command: sizes, ages, keys, JSON, progress bars.

Nothing here imports torch; tqdm is imported only when a bar is shown.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import threading
from collections.abc import Callable, Iterable, Iterator
from typing import Any

#: Version of every ``--json`` document; bumped only when a member changes meaning or goes away.
SCHEMA_VERSION = 1


def emit_json(command: str, doc: dict) -> None:
    """Print one ``--json`` document: ``{"schema": "tddist.<command>/1", ...}``."""
    out = {"schema": f"tddist.{command}/{SCHEMA_VERSION}", **doc}
    sys.stdout.write(json.dumps(out, indent=2, ensure_ascii=False, default=str) + "\n")


def human_bytes(n: int | float) -> str:
    """``1536`` -> ``1.5 KiB``."""
    n = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{int(n)} B" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError


def human_age(seconds: float) -> str:
    """``4000`` -> ``1.1 h``."""
    if seconds < 60:
        return f"{seconds:.0f} s"
    if seconds < 3600:
        return f"{seconds / 60:.0f} min"
    if seconds < 86400 * 2:
        return f"{seconds / 3600:.1f} h"
    return f"{seconds / 86400:.1f} d"


def key_text(key: tuple[str, ...] | list[str]) -> str:
    """A key as users write it: ``model/w``, or a JSON list when a component is empty or holds ``/``."""
    if key and all(k and "/" not in k for k in key):
        return "/".join(key)
    return json.dumps(list(key), ensure_ascii=False)


def non_finite_json(leaf: Any) -> dict:
    """A leaf with NaN or infinite values (``manifest.model.NonFiniteLeaf``) as a ``--json`` member."""
    return {
        "key": list(leaf.key),
        "nan": leaf.nan,
        "inf": leaf.inf,
        "ranks": list(leaf.ranks),
    }


def non_finite_lines(leaves: Iterable[Any]) -> list[str]:
    """Lines naming each leaf with NaN or infinite values (a finding about the data, not damage)."""
    return [f"  non-finite: {key_text(b.key)}: {b.nan} NaN, {b.inf} Inf (ranks {list(b.ranks)[:8]})" for b in leaves]


def largest_json(largest: Any) -> dict | None:
    """The checkpoint's largest finite magnitude (``manifest.model.LargestMagnitude`` or None) as a ``--json``
    member."""
    if largest is None:
        return None
    return {"value": largest.value, "key": list(largest.key), "rank": largest.rank}


def value_text(enc: object, limit: int = 60) -> str:
    """One stored non-tensor value, for reading: JSON text cut at ``limit`` characters."""
    if isinstance(enc, dict) and "json" in enc:
        text = json.dumps(enc["json"], ensure_ascii=False)
    elif isinstance(enc, dict) and isinstance(enc.get("pickle"), str):
        return f"<pickled object, {len(enc['pickle']) * 3 // 4} bytes; load with allow_pickle=True>"
    else:
        text = "<malformed>"
    return text if len(text) <= limit else text[: limit - 3] + "..."


def shown_path(path: str, root_arg: str) -> str:
    """``path`` (absolute, under ``root_arg``) as the user named its root; a URL (``s3://...``) as it is."""
    if "://" in path:
        return path
    absroot = os.path.abspath(root_arg)
    rel = os.path.relpath(path, absroot)
    return root_arg if rel == "." else os.path.join(root_arg, rel)


def entry_name(path: str) -> str:
    """The last component of a path or URL (``s3://b/run/step-000000100/`` -> ``step-000000100``)."""
    return path.rstrip("/").rsplit("/", 1)[-1]


def table(rows: list[list[str]], header: list[str]) -> str:
    """Left-aligned columns separated by two spaces (the last column unpadded)."""
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    lines = []
    for r in [header, *rows]:
        cells = [c.ljust(w) for c, w in zip(r[:-1], widths[:-1])] + [r[-1]]
        lines.append("  ".join(cells).rstrip())
    return "\n".join(lines)


def progress_enabled() -> bool:
    """Bars are drawn only on a terminal (stderr), never into a pipe or a file."""
    try:
        return sys.stderr.isatty()
    except (AttributeError, ValueError):
        return False


@contextlib.contextmanager
def progress(total: int, desc: str) -> Iterator[Callable[[int], None]]:
    """A byte-counting tqdm bar on stderr when it is a terminal; yields ``update(nbytes)``."""
    if not progress_enabled() or total <= 0:
        yield lambda n: None
        return
    from tqdm import tqdm  # type: ignore[import-untyped]

    lock = threading.Lock()
    try:
        columns, rows = os.get_terminal_size(sys.stderr.fileno())
    except (OSError, ValueError):
        columns, rows = 0, 0
    with tqdm(
        total=total,
        desc=desc,
        unit="B",
        unit_scale=True,
        unit_divisor=1024,
        file=sys.stderr,
        leave=False,
        ncols=columns or 80,  # a terminal that reports no size (a bare pty) still gets a bar
        nrows=rows or 24,
    ) as bar:

        def update(n: int) -> None:
            with lock:
                bar.update(n)

        yield update


@contextlib.contextmanager
def written_bytes_progress(total: int, desc: str) -> Iterator[None]:
    """A bar driven by the bytes this process writes (``/proc/self/io`` ``wchar``), polled by a thread.

    For operations of the library that report no progress of their own
    (``pack``, ``unpack``).
    """
    if not progress_enabled() or total <= 0 or _wchar() is None:
        yield
        return
    stop = threading.Event()
    start = _wchar() or 0
    with progress(total, desc) as update:
        shown = 0

        def poll() -> None:
            nonlocal shown
            while not stop.wait(0.2):
                now = min(total, (_wchar() or start) - start)
                if now > shown:
                    update(now - shown)
                    shown = now

        t = threading.Thread(target=poll, daemon=True, name="tddist-progress")
        t.start()
        try:
            yield
        finally:
            stop.set()
            t.join()
            if shown < total:
                update(total - shown)


def _wchar() -> int | None:
    try:
        with open("/proc/self/io") as f:
            for line in f:
                if line.startswith("wchar:"):
                    return int(line.split()[1])
    except OSError:
        return None
    return None


def positive_int(text: str) -> int:
    """An argparse type: a positive integer (``--threads``, ``--keep-last``)."""
    try:
        n = int(text)
    except ValueError:
        n = 0
    if n < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return n
