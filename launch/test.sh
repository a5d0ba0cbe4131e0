#!/usr/bin/env bash
# Set up .venv with the test extras, then lint (ruff), type checks (mypy) and the whole test suite.
set -euo pipefail
cd "$(dirname "$0")/.."
bash launch/setup.sh test
# A real single-node SLURM for tests/test_slurm.py (Debian packages; the tests start and stop the daemons).
if ! command -v slurmctld >/dev/null && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
  apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends slurm-wlm munge || true
fi
# Lint and type gate: any finding fails the run (configuration in pyproject.toml).
.venv/bin/ruff check tddist tests benchmarks launch
.venv/bin/ruff format --check tddist tests benchmarks launch
.venv/bin/mypy
NO_MKDOCS_2_WARNING=1 .venv/bin/mkdocs build --strict --quiet --site-dir "$(mktemp -d)"  # the docs site (docs/, mkdocs.yml): a broken link or a missing docstring fails
exec .venv/bin/python -m pytest -q -ra "$@" tests
