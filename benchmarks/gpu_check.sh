#!/usr/bin/env bash
# GPU check for the embedded scheduler (issues #5, #19). Budget: <= 5 minutes on a machine with an
# NVIDIA GPU. Without one it says so and exits 0 (nothing to check).
#
#   bash benchmarks/gpu_check.sh               # from anywhere; runs from the repository root
#   bash benchmarks/gpu_check.sh --cameras     # only the camera steps (4, 5): ~5-8 minutes
#   bash benchmarks/gpu_check.sh --cpu-smoke   # no GPU needed: the same Python steps on the CPU at
#                                              # tiny sizes, so the script cannot rot (tests run it)
#
# 1. NVML + Hopper GPM telemetry probe (utilization, SM activity/occupancy samples);
# 2. MPS: starts a private control daemon if none runs, so CUDA_MPS_ACTIVE_THREAD_PERCENTAGE in a
#    process worker's launch environment caps its SMs (stopped again at the end);
# 3. the scheduler benchmark's table (sequential rows, coarse pipelining on threads and in processes,
#    planner, Rose's steps, Rose) with the PPO models on CUDA, one CUDA stream per worker, NVML
#    sampling in the activity trace, and the evaluator as an MPS client with a 30% SM quota;
# 4. the camera train workflow (issue #47) with its learner on CUDA, sequential and auto, beside the
#    CPU learner (benchmarks/vision_gpu.py -> vision_gpu.json);
# 5. one cell of the camera study on CUDA, at the quick plan's size (fleet_scaling --quick: bootstrap
#    + 2 fert rounds on 8 camera robots -> fleet_scaling_camera_gpu_quick.json). A smoke figure, not a
#    study figure; skipped by --cpu-smoke (hours of a CPU at 64x64).
# Exit 2 when the interpreter ($PYTHON, else .venv, else python3) cannot import the project: the
# message names the missing module and the fix.
# Results: benchmarks/results/scheduler_gpu.json (+ .png); --cpu-smoke writes to $GPU_CHECK_OUT
# (default: a temporary folder) so it never overwrites measured results.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
[ -x "$PY" ] || PY=python3
MODE=gpu
STEPS=all
if [ "${1:-}" = "--cpu-smoke" ]; then
  MODE=cpu-smoke
elif [ "${1:-}" = "--cameras" ]; then
  STEPS=cameras
elif [ -n "${1:-}" ]; then
  echo "gpu_check: unknown option $1 (use --cpu-smoke, --cameras or nothing)" >&2
  exit 2
fi

if [ "$MODE" = gpu ]; then
  if ! command -v nvidia-smi >/dev/null 2>&1 || ! nvidia-smi -L >/dev/null 2>&1; then
    echo "gpu_check: no NVIDIA GPU here (nvidia-smi missing or failing); nothing to check. GPU path NOT tested."
    echo "gpu_check: 'bash benchmarks/gpu_check.sh --cpu-smoke' runs the same Python steps on the CPU."
    exit 0
  fi
  nvidia-smi -L
fi

. benchmarks/require_project.sh
require_project gpu_check benchmarks.scheduler

OUT=${GPU_CHECK_OUT:-$(mktemp -d -t fleetloop-gpu-check-XXXXXX)}
if [ "$STEPS" = all ]; then
# 1. telemetry probe (on the CPU: NVML must fail cleanly, with its reason)
"$PY" - "$MODE" <<'PYEOF'
import sys
import time

import torch

from components.scheduler.profiler import GpuTelemetry

mode = sys.argv[1]
t = GpuTelemetry()
print("gpu_check: NVML available:", t.available, "GPM:", t.gpm, t.reason)
if mode == "gpu" and not torch.cuda.is_available():
    sys.exit("gpu_check: nvidia-smi sees a GPU but torch.cuda.is_available() is False; install a CUDA build of torch")
device = "cuda" if mode == "gpu" else "cpu"
x = torch.randn(8192 if mode == "gpu" else 256, 8192 if mode == "gpu" else 256, device=device)
for _ in range(3):
    y = x @ x
    if mode == "gpu":
        torch.cuda.synchronize()
    time.sleep(0.2 if mode == "gpu" else 0.01)
    print("gpu_check: sample:", t.sample())
t.close()
PYEOF

# 2. MPS daemon (GPU only)
STARTED_MPS=0
if [ "$MODE" = gpu ]; then
  if command -v nvidia-cuda-mps-control >/dev/null 2>&1; then
    if ! pgrep -x nvidia-cuda-mps-control >/dev/null 2>&1; then
      export CUDA_MPS_PIPE_DIRECTORY=${CUDA_MPS_PIPE_DIRECTORY:-/tmp/fleetloop-mps-pipe}
      export CUDA_MPS_LOG_DIRECTORY=${CUDA_MPS_LOG_DIRECTORY:-/tmp/fleetloop-mps-log}
      mkdir -p "$CUDA_MPS_PIPE_DIRECTORY" "$CUDA_MPS_LOG_DIRECTORY"
      nvidia-cuda-mps-control -d && STARTED_MPS=1 && echo "gpu_check: MPS control daemon started"
    else
      echo "gpu_check: MPS control daemon already running"
    fi
  else
    echo "gpu_check: nvidia-cuda-mps-control not found: MPS quotas are set but not enforced"
  fi
fi
cleanup() { if [ "$STARTED_MPS" = 1 ]; then echo quit | nvidia-cuda-mps-control || true; fi; }
trap cleanup EXIT

# 3. the benchmark
if [ "$MODE" = gpu ]; then
  timeout 240 "$PY" -m benchmarks.scheduler --quick --no-fert --device cuda --mps-eval 30 --name scheduler_gpu
  echo "gpu_check: done (benchmarks/results/scheduler_gpu.json)"
else
  timeout 300 "$PY" -m benchmarks.scheduler --tiny --device cpu --streams --mps-eval 30 --name scheduler_gpu_smoke \
    --out "$OUT"
  echo "gpu_check: CPU smoke done ($OUT/scheduler_gpu_smoke.json); the GPU path itself was NOT run"
fi
fi

# 4. the camera train workflow, learner on CUDA vs the CPU
if [ "$MODE" = gpu ]; then
  timeout 300 "$PY" -m benchmarks.vision_gpu
  echo "gpu_check: camera workflow done (benchmarks/results/vision_gpu.json)"
else
  timeout 200 "$PY" -m benchmarks.vision_gpu --cpu-smoke --out "$OUT"
  echo "gpu_check: camera workflow CPU smoke done ($OUT/vision_gpu_smoke.json)"
fi

# 5. one camera study cell on CUDA (GPU only)
if [ "$MODE" = gpu ]; then
  timeout 420 "$PY" -m benchmarks.fleet_scaling --quick --fleet-sizes 8 --methods fert --no-log-models \
    --sim-set 'cameras=["scene","gripper"]' --policy-set kind=vision --fert-set encoder=camera \
    --out fleet_scaling_camera_gpu_quick
  echo "gpu_check: camera study cell done (benchmarks/results/fleet_scaling_camera_gpu_quick.json)"
fi
