"""Entry point of tddist's writer process: ``python -m tddist.saving.writer_main FD SPEC`` (see ``writer_process``).

The process runs the save pipeline's ``commit`` for each request; the
trainer maps the result itself (``committing.open_committed``).
"""

import sys
from functools import partial

from .background import yield_cpu_to_training
from .committing import commit
from .writer_process import serve

if __name__ == "__main__":
    yield_cpu_to_training()  # the whole writer process: it writes, hashes and commits in the background
    serve(int(sys.argv[1]), sys.argv[2], partial(commit, read_back=False))  # the trainer maps, not this process
