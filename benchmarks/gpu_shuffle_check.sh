#!/usr/bin/env bash
# NCCL check of the FUSCO shuffle (<= 5 min): exactness vs the dense reference + a small ABAB
# timing (components/shuffle/device_check.py), one rank per visible GPU (at most 4).
# Exits 0 with a message when no GPU is visible; 1 when a result is not bit-exact; 2 when the
# interpreter ($PYTHON, else .venv, else python) cannot import the project (the message names the fix).
#   bash benchmarks/gpu_shuffle_check.sh
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
[ -x "$PY" ] || PY=python
gpus=$("$PY" -c "import torch; print(torch.cuda.device_count() if torch.cuda.is_available() else 0)")
if [ "$gpus" = "0" ]; then
  echo "gpu_shuffle_check: no CUDA GPU visible, nothing to check here (the NCCL path stays untested)"
  exit 0
fi
. benchmarks/require_project.sh
require_project gpu_shuffle_check components.shuffle.device_check
nproc=$(( gpus < 4 ? gpus : 4 ))
echo "gpu_shuffle_check: $gpus GPU(s) visible, running $nproc NCCL rank(s)"
timeout 300 "$PY" -m torch.distributed.run --standalone --nproc-per-node="$nproc" \
  -m components.shuffle.device_check --backend nccl
