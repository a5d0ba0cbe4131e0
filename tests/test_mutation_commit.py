"""Fast in-process tests of the commit, publish, recovery, manifest and file-system primitives.

Written against the mutants that survived ``scripts/mutation.sh``: each test
asserts a behaviour on real files (thread ranks, one process).
"""

from __future__ import annotations
