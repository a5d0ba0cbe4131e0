"""One rank of a torchrun (gloo) job on object storage (tests/test_s3.py).

Usage: ``python tests/s3_rank.py MODE BUCKET`` with the S3 endpoint and
credentials in the environment. Modes:

- "roundtrip": save a sharded TensorDict to both layouts (``s3://BUCKET/job``
  and ``s3://BUCKET/job.tdz``), load each back with this rank's saved rows
  (checksums verified), bit for bit; report "ok".
- "crash" (``python tests/s3_rank.py crash BUCKET URL``): save to URL with
  ``TDDIST_FAULT`` set by the test (rank 0 killed after its write); the
  surviving rank reports the error it got.
"""

from __future__ import annotations

import os
import sys

import torch
from tensordict import TensorDict

import tddist
from tests.helpers import assert_td_equal
from tests.launch_util import write_report

mode, bucket = sys.argv[1], sys.argv[2]
rank = int(os.environ["RANK"])
n = 3 + rank
td = TensorDict(
    batch=TensorDict(x=torch.arange(n * 4, dtype=torch.float32).reshape(n, 4) + 100 * rank, batch_size=[n]),
    meta=TensorDict(step=torch.tensor(7)),
    batch_size=[],
)
if mode == "roundtrip":
    for url in (f"s3://{bucket}/job", f"s3://{bucket}/job.tdz"):
        tddist.save(td, url)
        back = tddist.load(url, shard="saved", verify=True)
        assert_td_equal(back, td, url)
    write_report(rank, "ok")
elif mode == "crash":
    try:
        tddist.save(td, sys.argv[3], timeout=20)
        write_report(rank, "saved")
    except tddist.TddistError as e:
        write_report(rank, "ok", error=type(e).__name__, message=str(e))
else:
    raise SystemExit(f"unknown mode {mode!r}")
