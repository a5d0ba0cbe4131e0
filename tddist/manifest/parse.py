"""Reading a manifest of any format version from its JSON object and its index, validating everything.

Bytes read from a checkpoint are untrusted: ``parse_manifest`` validates the
header, the version's body (``v1`` or ``v2``), the objects and the keys
before anything is built from them. The index is not handed over as bytes
but as an ``IndexSource``: the parser works out from the JSON how many bytes
the index must have, and only then does the store read it, exactly that
many, after checking the size of the file (or object, or archive entry).

The bounds on what a store reads (``MAX_MANIFEST_BYTES``, and why it is
what it is; ``MAX_INDEX_BYTES``; ``MAX_WORLD_SIZE``; all in ``model``) are checked
before anything is read or allocated. The collector is paused while a
manifest's many small objects are built (``paused_gc``).
"""

from __future__ import annotations

import gc
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from . import v1 as manifest_v1
from . import v2 as manifest_v2
from .model import (
    MAX_INDEX_BYTES,
    MAX_MANIFEST_BYTES,
    MAX_WORLD_SIZE,
    IndexBytes,
    IndexSource,
    Manifest,
    Parser,
    check_keys,
    check_manifest_size,
    check_total_bytes,
    parse_header,
    parse_objects,
)

__all__ = [
    "MAX_INDEX_BYTES",
    "MAX_MANIFEST_BYTES",
    "MAX_WORLD_SIZE",
    "IndexBytes",
    "IndexSource",
    "check_manifest_size",
    "parse_manifest",
    "paused_gc",
]


def parse_manifest(obj: Any, where: str = "manifest", index: bytes | IndexSource | None = None) -> Manifest:
    """Build a Manifest from parsed JSON (and, from version 2 on, its index), validating everything.

    Args:
        obj: The parsed ``tddist.json``.
        where: How to name the file in error messages.
        index: The index (version 2 on): its bytes (None if absent), or where
            to read it from once the JSON says its size (``IndexSource``).

    Returns:
        The validated manifest, whatever its version.

    Raises:
        ManifestError: anything malformed, inconsistent, too large, or of a newer version.
    """
    source = IndexBytes(index) if index is None or isinstance(index, bytes) else index
    with paused_gc():
        p = Parser(where)
        m = parse_header(p, obj)
        if m.version == 1:
            manifest_v1.parse_body(p, obj, m)
        else:
            manifest_v2.parse_body(p, obj, m, source)
        parse_objects(p, obj, m)
        check_keys(p, m)
        check_total_bytes(p, m)
    return m


@contextmanager
def paused_gc() -> Iterator[None]:
    """Pause the cyclic garbage collector while a manifest's many small objects are built.

    They form no cycles, but each of the collector's full passes walks every
    object alive (torch's included): at 100,000 leaves the collector takes
    more time than the parse itself, and more per leaf the more leaves there
    are. Reference counting still frees everything; the collector runs again
    afterwards, if it was enabled.
    """
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()
