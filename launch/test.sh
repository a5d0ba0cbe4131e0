#!/usr/bin/env bash
# Set up .venv with the test extras and run the whole test suite.
set -euo pipefail
cd "$(dirname "$0")/.."
bash launch/setup.sh test
exec .venv/bin/python -m pytest -q -ra "$@" tests
