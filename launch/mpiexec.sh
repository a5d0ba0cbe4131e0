#!/usr/bin/env bash
# launch/train.py on NPROC MPI ranks: `mpiexec -n NPROC python -m mpi4py train.py`.
# Usage: NPROC=4 bash launch/mpiexec.sh --ckpt ckpt/train --steps 200 [train.py options]
# `python -m mpi4py` turns an uncaught exception on any rank into MPI_Abort, so no rank hangs.
# MPICH's mpiexec forwards SIGUSR1 to every rank and returns their exit status (75 after preemption).
# MPIEXEC selects the launcher (default: the one installed beside PYTHON, which matches mpi4py's MPI).
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
python="${PYTHON:-$here/../.venv/bin/python}"
[ -x "$python" ] || python=python3
mpiexec="${MPIEXEC:-$(dirname "$python")/mpiexec}"
[ -x "$mpiexec" ] || mpiexec=mpiexec
exec "$mpiexec" -n "${NPROC:-2}" "$python" -m mpi4py "$here/train.py" "$@"
