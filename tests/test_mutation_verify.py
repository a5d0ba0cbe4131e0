"""Fast in-process tests of tddist.verify (the offline checker): each damage it must report, on real checkpoints.

Written against the mutants that survived ``scripts/mutation.sh``: each test
asserts a behaviour on real files (thread ranks, one process).
"""

from __future__ import annotations
