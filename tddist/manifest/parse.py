"""Reading a manifest of any format version from its JSON object and index bytes, validating everything.

Bytes read from a checkpoint are untrusted: ``parse_manifest`` validates the
header, the version's body (``v1`` or ``v2``), the objects and the keys
before anything is built from them. ``MAX_MANIFEST_BYTES`` and
``MAX_INDEX_BYTES`` bound what a store reads before parsing.
"""

from __future__ import annotations

from typing import Any

from . import v1 as manifest_v1
from . import v2 as manifest_v2
from .model import Manifest, Parser, check_keys, parse_header, parse_objects

#: The largest manifest and index tddist reads (a version-1 manifest of 4,096 ranks x 1,000 leaves
#: is about 150 MiB; version 2 keeps the JSON small and the index at 16 bytes per chunk).
MAX_MANIFEST_BYTES = 1 << 30
MAX_INDEX_BYTES = 16 << 30


def parse_manifest(obj: Any, where: str = "manifest", index: bytes | None = None) -> Manifest:
    """Build a Manifest from parsed JSON (and, from version 2 on, the index bytes), validating everything.

    Args:
        obj: The parsed ``tddist.json``.
        where: How to name the file in error messages.
        index: The bytes of ``tddist.idx`` (version 2).

    Returns:
        The validated manifest, whatever its version.

    Raises:
        ManifestError: anything malformed, inconsistent, or of a newer version.
    """
    p = Parser(where)
    m = parse_header(p, obj)
    if m.version == 1:
        manifest_v1.parse_body(p, obj, m)
    else:
        manifest_v2.parse_body(p, obj, m, index)
    parse_objects(p, obj, m)
    check_keys(p, m)
    return m
