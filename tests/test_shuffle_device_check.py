"""components/shuffle/device_check.py under torchrun (gloo on the CPU): the entry benchmarks/gpu_shuffle_check.sh
runs with NCCL on a GPU machine, kept alive here at one rank (a single-GPU machine) and at two."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from components.shuffle.device_check import timing_placement

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("ranks", [1, 2])
def test_device_check_is_exact_and_times_top_8_at_any_world_size(ranks):
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    r = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={ranks}",
         "-m", "components.shuffle.device_check", "--backend", "gloo", "--time-tokens", "256", "--time-pairs", "2",
         "--plans", "auto", "permute", "--profile"],
        check=False, cwd=ROOT, env=env, capture_output=True, text=True, timeout=240)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert f"backend=gloo world={ranks} device=cpu: exactness OK" in r.stdout
    for timed in ("top-1 auto x", "top-1 permute x", "top-8 auto x", "top-8 permute x"):
        assert timed in r.stdout
    for profiled in ("--- megatron, top-8", "--- fused(auto), top-8", "--- fused(permute), top-8"):
        assert profiled in r.stdout


def test_timing_placement_holds_top_k_experts_on_one_rank():
    assert timing_placement(1, 8).num_experts == 8
    assert timing_placement(2, 8).num_experts == 8
    assert timing_placement(4, 1).num_experts == 16
