"""Fast in-process tests of the commit, recovery, reader, writer and manifest guarantees.

Written against the mutants that survived ``scripts/mutation.sh``: each test
asserts a behaviour on real files (thread ranks, one process), never a mock.
"""

from __future__ import annotations
