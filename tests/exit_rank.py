"""One rank of a job that saves, loads and exits, for the clean-exit tests (tests/test_exit.py).

Modes: "user-destroy" (the job initialises gloo and destroys its groups
before exit), "user-keep" (it initialises gloo and never destroys it),
"tddist-init" (tddist initialises torch.distributed from torchrun's
environment), "async" (as tddist-init, with a return_early save that replaces the
checkpoint still in flight at exit). Ranks leave a little apart, as real jobs do: a process group
still alive at interpreter teardown then aborts the process (SIGABRT).
"""

from __future__ import annotations

import os
import random
import sys
import time

import torch
import torch.distributed as dist
from tensordict import TensorDict

import tddist
from tests.launch_util import write_report

mode, root = sys.argv[1], sys.argv[2]
rank = int(os.environ["RANK"])
if mode.startswith("user"):
    dist.init_process_group("gloo")
td = TensorDict({"a": torch.arange(64.0).reshape(16, 4) + rank}, batch_size=[16])
tddist.save(td, os.path.join(root, "ckpt"))
back = tddist.load(os.path.join(root, "ckpt"))
assert torch.equal(back["a"], td["a"])
if mode == "async":
    # Finished at exit, before teardown, with the removal of the checkpoint it replaces (the worker's last job).
    tddist.save(td * 2, os.path.join(root, "ckpt"), return_early=True)
if mode == "user-destroy":
    dist.destroy_process_group()
write_report(rank, "ok")
time.sleep(random.random() * 0.3)  # ranks exit a little apart
