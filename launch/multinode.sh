#!/usr/bin/env bash
# launch/train.py over several nodes: run this once on every node (same arguments everywhere).
# Usage: NNODES=2 NPROC=4 RDZV_ENDPOINT=node0:29400 bash launch/multinode.sh --ckpt /shared/ckpt/train
#   NNODES         number of nodes (torchrun agents); "MIN:MAX" for an elastic range
#   NPROC          ranks per node
#   RDZV_ENDPOINT  host:port of the c10d rendezvous; the agent on that host serves it
#   RDZV_ID        job id shared by the agents of one job (default: tddist-train)
# The checkpoint root must be on storage that every node sees. Node ranks are given out by the
# rendezvous; a later launch may use another number of nodes or ranks and resumes where this one saved.
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
python="${PYTHON:-$here/../.venv/bin/python}"
[ -x "$python" ] || python=python3
exec "$python" -m torch.distributed.run --nnodes="${NNODES:-2}" --nproc-per-node="${NPROC:-2}" \
    --rdzv-backend=c10d --rdzv-endpoint="${RDZV_ENDPOINT:-127.0.0.1:29400}" --rdzv-id="${RDZV_ID:-tddist-train}" \
    --signals-to-handle=SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1 "$here/train.py" "$@"
