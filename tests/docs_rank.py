"""One rank of the torchrun job that runs the documentation's multi-rank examples (tests/test_docs.py).

Usage (under torchrun): ``python tests/docs_rank.py PLAN.json``. The plan
lists the examples, each with its code and its own directory; every rank
runs them in order, each in a fresh namespace with that directory as the
working directory, and reports which ran (or the first failure) through
``tests.launch_util.write_report``.
"""

from __future__ import annotations

import json
import os
import sys
import traceback

from tests.launch_util import write_report


def main() -> None:
    rank = int(os.environ["RANK"])
    plan = json.loads(open(sys.argv[1]).read())
    done = []
    for example in plan:
        os.chdir(example["dir"])
        try:
            exec(compile(example["code"], example["where"], "exec"), {"__name__": "__docs_example__"})
        except BaseException:
            write_report(rank, "failed", done=done, where=example["where"], error=traceback.format_exc()[-4000:])
            raise
        done.append(example["where"])
    write_report(rank, "ok", done=done)


if __name__ == "__main__":
    main()
