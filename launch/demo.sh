#!/usr/bin/env bash
# The main job: set up .venv, then on CPU ranks over gloo
#  1. 4 ranks save a batch-sharded TensorDict and load it back (launch/demo.py);
#  2. 4 ranks train with tddist.CheckpointManager to step 100 (launch/train.py);
#  3. 3 ranks resume from the newest checkpoint (resharded) and train on to step 200.
set -euo pipefail
cd "$(dirname "$0")/.."
bash launch/setup.sh mpi
export OMP_NUM_THREADS=1
run() { .venv/bin/torchrun --standalone --nproc-per-node="$1" "${@:2}" 2> >(grep -v '^W[0-9]\|\*\*\*\*\|OMP_NUM_THREADS' >&2); }
echo "== 1. save and load a sharded TensorDict on 4 ranks"
run "${NPROC:-4}" launch/demo.py "$@"
rm -rf ckpt/train
echo "== 2. train on 4 ranks to step 100, checkpointing every 20 steps"
run 4 launch/train.py --ckpt ckpt/train --steps 100 --every 20
echo "== 3. resume on 3 ranks from the newest checkpoint and train on to step 200"
run 3 launch/train.py --ckpt ckpt/train --steps 200 --every 20
