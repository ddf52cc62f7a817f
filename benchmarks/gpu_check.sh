#!/usr/bin/env bash
# GPU check for the embedded scheduler (issue #5). Written for a machine with an NVIDIA GPU; on a
# CPU-only machine it says so and exits 0. Budget: <= 8 minutes.
#
#   bash benchmarks/gpu_check.sh            # from the repository root
#
# 1. NVML + Hopper GPM telemetry probe (utilization, SM activity/occupancy samples);
# 2. MPS: starts a private control daemon if none runs, so CUDA_MPS_ACTIVE_THREAD_PERCENTAGE in a
#    process worker's launch environment caps its SMs (stopped again at the end);
# 3. the same scheduler benchmark with the PPO models on CUDA, one CUDA stream per worker, NVML
#    sampling in the activity trace, and the evaluator as an MPS client with a 30% SM quota.
# Results: benchmarks/results/scheduler_gpu.json (+ .png).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
[ -x "$PY" ] || PY=python3
if ! command -v nvidia-smi >/dev/null 2>&1 || ! nvidia-smi -L >/dev/null 2>&1; then
  echo "gpu_check: no NVIDIA GPU here (nvidia-smi missing or failing); nothing to check."
  exit 0
fi
nvidia-smi -L
"$PY" - <<'PYEOF'
import time
from components.scheduler.profiler import GpuTelemetry
t = GpuTelemetry()
print("NVML available:", t.available, "GPM:", t.gpm, t.reason)
import torch
x = torch.randn(8192, 8192, device="cuda")
for _ in range(3):
    y = x @ x
    torch.cuda.synchronize()
    time.sleep(0.2)
    print("sample:", t.sample())
t.close()
PYEOF

STARTED_MPS=0
if command -v nvidia-cuda-mps-control >/dev/null 2>&1; then
  if ! pgrep -x nvidia-cuda-mps-control >/dev/null 2>&1; then
    export CUDA_MPS_PIPE_DIRECTORY=${CUDA_MPS_PIPE_DIRECTORY:-/tmp/fleetloop-mps-pipe}
    export CUDA_MPS_LOG_DIRECTORY=${CUDA_MPS_LOG_DIRECTORY:-/tmp/fleetloop-mps-log}
    mkdir -p "$CUDA_MPS_PIPE_DIRECTORY" "$CUDA_MPS_LOG_DIRECTORY"
    nvidia-cuda-mps-control -d && STARTED_MPS=1 && echo "MPS control daemon started"
  else
    echo "MPS control daemon already running"
  fi
else
  echo "nvidia-cuda-mps-control not found: MPS quotas are set but not enforced"
fi
cleanup() { if [ "$STARTED_MPS" = 1 ]; then echo quit | nvidia-cuda-mps-control || true; fi; }
trap cleanup EXIT

timeout 420 "$PY" -m benchmarks.scheduler --quick --device cuda --mps-eval 30 --name scheduler_gpu
echo "gpu_check: done (benchmarks/results/scheduler_gpu.json)"
