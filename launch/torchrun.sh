#!/usr/bin/env bash
# launch/train.py on one node: NPROC ranks under `torchrun --standalone` (gloo, CPU).
# Usage: NPROC=4 bash launch/torchrun.sh --ckpt ckpt/train --steps 200 [train.py options]
# The preemption signal (SIGUSR1) sent to torchrun is forwarded to every rank (--signals-to-handle);
# torchrun waits TORCH_ELASTIC_SHUTDOWN_TIMEOUT seconds (default 30) for the ranks to save and exit.
# torchrun exits 1 whenever a rank exits non-zero, so its status does not tell preemption from failure.
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
python="${PYTHON:-$here/../.venv/bin/python}"
[ -x "$python" ] || python=python3
exec "$python" -m torch.distributed.run --standalone --nproc-per-node="${NPROC:-2}" \
    --signals-to-handle=SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1 "$here/train.py" "$@"
