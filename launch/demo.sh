#!/usr/bin/env bash
# The main job: set up .venv, then save and load a batch-sharded TensorDict on 4 CPU ranks (gloo).
set -euo pipefail
cd "$(dirname "$0")/.."
bash launch/setup.sh mpi
exec .venv/bin/torchrun --standalone --nproc-per-node="${NPROC:-4}" launch/demo.py "$@"
