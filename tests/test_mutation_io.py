"""Fast in-process tests of the reader and the writer: byte ranges, threaded reads, durable writes, on real files.

Written against the mutants that survived ``scripts/mutation.sh``: each test
asserts a behaviour on real files (thread ranks, one process).
"""

from __future__ import annotations
