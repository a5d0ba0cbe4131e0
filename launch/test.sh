#!/usr/bin/env bash
# Set up .venv with the test extras, then lint (ruff), type checks (mypy) and the whole test suite.
set -euo pipefail
cd "$(dirname "$0")/.."
bash launch/setup.sh test
# Real components the tests use, from Debian's packages: a single-node SLURM (tests/test_slurm.py starts and stops the
# daemons), unzip (an independent check of archives), xfsprogs (power cuts on a loop-mounted XFS). Missing ones are
# installed as root; when that fails the run fails here, instead of the tests skipping later.
need=()
command -v slurmctld >/dev/null || need+=(slurm-wlm munge)
command -v unzip >/dev/null || need+=(unzip)
command -v mkfs.xfs >/dev/null || need+=(xfsprogs)
if [ "${#need[@]}" -gt 0 ]; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
    apt-get update -q
    DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends "${need[@]}"
  else
    echo "launch/test.sh: missing ${need[*]} and cannot install them (needs root and apt-get); the tests that use them will fail" >&2
  fi
fi
# Lint and type gate: any finding fails the run (configuration in pyproject.toml).
.venv/bin/ruff check tddist tests benchmarks launch
.venv/bin/ruff format --check tddist tests benchmarks launch
.venv/bin/mypy
NO_MKDOCS_2_WARNING=1 .venv/bin/mkdocs build --strict --quiet --site-dir "$(mktemp -d)"  # the docs site (docs/, mkdocs.yml): a broken link or a missing docstring fails
exec .venv/bin/python -m pytest -q -ra "$@" tests
