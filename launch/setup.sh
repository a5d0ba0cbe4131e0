#!/usr/bin/env bash
# Create .venv in the repository and install tddist into it.
# Usage: launch/setup.sh [extras]   (default extras: mpi; the test suite uses "test")
# torch is pinned and installed first: an unpinned torch would pull a multi-GB CUDA build.
set -euo pipefail
cd "$(dirname "$0")/.."
extras="${1:-mpi}"
python="${PYTHON:-python3}"
[ -x .venv/bin/python ] || "$python" -m venv .venv
.venv/bin/python -m pip install --disable-pip-version-check -q "torch==2.13.0"
.venv/bin/python -m pip install --disable-pip-version-check -q -e ".[${extras}]"
