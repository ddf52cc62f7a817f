"""benchmarks/gpu_check.sh: clean exit without a GPU, and its Python steps kept alive on the CPU."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "benchmarks" / "gpu_check.sh"


def _env(**extra: str) -> dict[str, str]:
    return {**os.environ, "PYTHON": sys.executable, **extra}


def test_gpu_check_without_a_gpu_exits_zero_and_says_so(tmp_path):
    fake = tmp_path / "bin"
    fake.mkdir()
    (fake / "nvidia-smi").write_text("#!/bin/sh\nexit 9\n")  # a driver that fails, as on a CPU-only host
    (fake / "nvidia-smi").chmod(0o755)
    r = subprocess.run(["bash", str(SCRIPT)], capture_output=True, text=True, timeout=60,
                       env=_env(PATH=f"{fake}:{os.environ['PATH']}"))
    assert r.returncode == 0, r.stderr
    assert "no NVIDIA GPU here" in r.stdout and "GPU path NOT tested" in r.stdout


def _bare_python(bin_dir: Path) -> Path:
    """An interpreter without site-packages: like a GPU image's python3 that lacks the project's deps."""
    bare = bin_dir / "bare-python"
    bare.write_text(f"#!/bin/sh\nexec {sys.executable} -I -S \"$@\"\n")
    bare.chmod(0o755)
    return bare


@pytest.mark.parametrize("script", ["gpu_check.sh", "gpu_shuffle_check.sh"])
def test_gpu_checks_name_a_python_that_cannot_import_the_project_and_the_fix(tmp_path, script):
    fake = tmp_path / "bin"
    fake.mkdir()
    (fake / "nvidia-smi").write_text("#!/bin/sh\necho 'GPU 0: a GPU (UUID: fake)'\n")  # a GPU is "there"
    (fake / "nvidia-smi").chmod(0o755)
    bare = _bare_python(fake)
    if script == "gpu_shuffle_check.sh":  # it asks torch for the GPU count first: say one, then import
        (fake / "count").write_text(f"#!/bin/sh\ncase \"$2\" in import\\ torch*) echo 1;; *) exec {bare} \"$@\";; esac\n")
        (fake / "count").chmod(0o755)
        bare = fake / "count"
    r = subprocess.run(["bash", str(ROOT / "benchmarks" / script)], capture_output=True, text=True, timeout=60,
                       env={**_env(PATH=f"{fake}:{os.environ['PATH']}"), "PYTHON": str(bare)})
    assert r.returncode == 2, (r.stdout, r.stderr)
    assert f"{bare} cannot import" in r.stderr and "ModuleNotFoundError" in r.stderr
    assert "make setup" in r.stderr and "pip install -e ." in r.stderr


@pytest.mark.slow
def test_gpu_check_cpu_smoke_runs_its_python_steps(tmp_path):
    r = subprocess.run(["bash", str(SCRIPT), "--cpu-smoke"], capture_output=True, text=True, timeout=420,
                       env=_env(GPU_CHECK_OUT=str(tmp_path)))
    assert r.returncode == 0, (r.stdout[-3000:], r.stderr[-3000:])
    assert "gpu_check: NVML available:" in r.stdout and "the GPU path itself was NOT run" in r.stdout
    result = json.loads((tmp_path / "scheduler_gpu_smoke.json").read_text())
    assert result["config"]["tiny"] and result["config"]["mps_eval_percent"] == 30
    # the evaluator ran as an MPS-client process worker (quota in its launch environment) and
    # every plan, that one included, gave the reference's weights
    assert "eval-mps" in result["rose"]["plan"] and "MPS SM %: evaluator=30" in result["rose"]["plan"]
    assert result["bit_identical_across_plans"] is True
    assert (tmp_path / "scheduler_gpu_smoke.png").exists()
    bound = result["work_bound"]  # the ceiling of any speed-up claim, from the reference's measured CPU work
    assert 0 < bound["floor_ms"] <= result["iteration_ms"]["sequential"]
    assert set(bound["max_speedup"]) == {k for k in result["iteration_ms"] if k.startswith("sequential")}
    # step 4: the camera train workflow through the product's trainer, learner on the device it names
    # (here the CPU): each row's weights equal the CPU reference's after the same iterations
    camera = json.loads((tmp_path / "vision_gpu_smoke.json").read_text())
    assert camera["device"] == "cpu" and set(camera["max_weight_gap_vs_cpu"].values()) == {0.0}
    assert camera["max_weight_gap_between_accelerator_rows"] == 0.0
    assert all(row["frames_per_s"] > 0 for row in camera["rows"].values())
    assert "camera workflow CPU smoke done" in r.stdout


def test_work_bound_is_the_reference_cpu_work_spread_over_every_core():
    from benchmarks.scheduler import work_bound

    b = work_bound(0.5, 1.2, 2, {"sequential": 0.5, "sequential(t=2)": 0.39})
    assert b["cpu_work_ms"] == pytest.approx(600.0) and b["floor_ms"] == pytest.approx(300.0)
    assert b["max_speedup"] == pytest.approx({"sequential": 0.5 / 0.3, "sequential(t=2)": 0.39 / 0.3})


def _timed(durations_ms: dict[str, float], iterations: int = 4):
    """A run's timeline as the benchmark reads it: one span per op per iteration (iteration 0 is warm-up)."""
    from types import SimpleNamespace

    from components.scheduler.profiler import Span

    spans, t = [], 0.0
    for it in range(iterations):
        for op, ms in durations_ms.items():
            spans.append(Span(op, op, op, "w0", it, t, t + ms / 1e3, 1))
            t += ms / 1e3
    return SimpleNamespace(timeline=SimpleNamespace(spans=spans))


def test_span_bound_is_the_learner_chain_at_the_fastest_a_bit_identical_plan_ran_it():
    """sample -> learn (params@i -> params@i+1) with validation beside it: the critical path grows by
    one learn per iteration, at the fastest learn of a bit-identical row (here a process split); the
    learner's numerics depend on its threads, so the faster multi-thread learn of a row that is not
    bit-identical does not lower the bound, while a thread-invariant learn's would."""
    from benchmarks.scheduler import span_bound
    from components.scheduler.workflow import Component, OpSpec, StateSpec, Workflow

    def workflow(learn_invariant: bool) -> Workflow:
        body = (OpSpec("sample", "sampler", None, writes=("batch@iteration",)),
                OpSpec("learn", "learner", None, reads=("batch@iteration", "params@iteration"),
                       writes=("params@iteration+1",), quota_invariant=learn_invariant),
                OpSpec("validate", "validator", None, reads=("params@iteration",), writes=("valm@iteration",), side=True))
        return Workflow("train", tuple(Component(c, None) for c in ("sampler", "learner", "validator")),
                        tuple(StateSpec(n) for n in ("batch", "params", "valm")), {}, body)

    rows = {"sequential": (_timed({"sample": 2.0, "learn": 11.0, "validate": 5.0}), True),
            "process split": (_timed({"sample": 2.5, "learn": 10.0, "validate": 4.0}), True),
            "library threads": (_timed({"sample": 1.0, "learn": 6.0, "validate": 5.0}), False)}
    bound = span_bound(workflow(False), rows, best_baseline_s=0.0105, work_floor_s=0.0085)
    assert bound["span_ms"] == pytest.approx(10.0) and bound["floor_ms"] == pytest.approx(10.0)
    assert bound["op_ms"] == pytest.approx({"learn": 10.0, "sample": 1.0, "validate": 4.0})
    assert bound["op_fastest_in"] == {"learn": "process split", "sample": "library threads", "validate": "process split"}
    assert bound["max_speedup_vs_best_baseline"] == pytest.approx(1.05)
    assert bound["1.15x_over_best_baseline_reachable"] is False
    loose = span_bound(workflow(True), rows, best_baseline_s=0.0105, work_floor_s=0.0085)
    assert loose["span_ms"] == pytest.approx(6.0) and loose["floor_ms"] == pytest.approx(8.5)  # the work floor binds
    assert loose["1.15x_over_best_baseline_reachable"] is True
