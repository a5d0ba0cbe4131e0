"""The manifest's own checksum (format version 3), which also names the checkpoint's generation.

``tddist.json`` begins with ``{"manifest_checksum":"<16 hex digits>",``: the
xxh3-64 of the manifest as it would be without that member (``{`` followed
by the rest of the file). A reader checks it before it parses anything, so
an edited dtype or shape is refused instead of reinterpreting the data. Two
loads that see the same checksum see the same checkpoint; ranks compare it to
agree on the generation they read. Versions 1 and 2 carry no checksum; their
generation is the hash of the manifest's bytes.
"""

from __future__ import annotations

import re

import xxhash

from ..errors import ManifestError

PREFIX = b'{"manifest_checksum":"'
_SEALED = re.compile(rb'\{"manifest_checksum":"([0-9a-f]{16})",')


def seal(body: bytes) -> bytes:
    """The manifest ``body`` (compact JSON of an object with at least one member) with its checksum first."""
    assert body.startswith(b"{") and not body.startswith(b"{}")
    return PREFIX + xxhash.xxh3_64_hexdigest(body).encode() + b'",' + body[1:]


def generation(raw: bytes, where: str) -> tuple[str, bool]:
    """The generation of the manifest ``raw`` and whether it carries a checksum (checked).

    Raises:
        ManifestError: the manifest carries a checksum and its bytes do not match it.
    """
    if not raw.startswith(PREFIX):
        return xxhash.xxh3_64_hexdigest(raw), False
    m = _SEALED.match(raw)
    if m is None:
        raise ManifestError(f"{where} has a malformed manifest_checksum; the manifest is damaged")
    expected = m.group(1).decode()
    found = xxhash.xxh3_64_hexdigest(b"{" + raw[m.end() :])
    if found != expected:
        raise ManifestError(
            f"{where} fails its own checksum (expected {expected}, found {found}): the manifest was edited or "
            f"damaged after it was written, so its shapes and dtypes cannot be trusted; restore the checkpoint from "
            f"a copy, or load an older one"
        )
    return expected, True
