"""Shared test helpers, for test modules that prefer ``from tests.conftest import ...``.

The definitions live in ``tests/helpers.py`` (one each), so that the rank
programs started by torchrun, mpiexec or the "spawn" launcher, which pytest
does not load, import the very same code.
"""

from __future__ import annotations

from tests.helpers import assert_td_equal, leftovers

__all__ = ["assert_td_equal", "leftovers"]
