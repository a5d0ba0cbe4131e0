"""save's tensordict-style parameters on several in-process thread ranks.

The same scenarios also run inside the real torchrun and mpiexec jobs of
tests/test_async.py.
"""

from __future__ import annotations

import pytest

import tddist
from tests.param_scenarios import SCENARIOS


@pytest.mark.parametrize("scenario", SCENARIOS, ids=lambda f: f.__name__.removeprefix("scenario_"))
@pytest.mark.parametrize("size", [1, 3])
def test_parameter_scenario_thread_ranks(tmp_path, scenario, size) -> None:
    results = tddist.run_threads(size, lambda comm: scenario(comm, tmp_path, comm.rank, size), timeout=60)
    errors = [r for r in results if isinstance(r, BaseException)]
    if errors:
        raise errors[0]
