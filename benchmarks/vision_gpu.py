"""The camera train workflow with its learner on CUDA, beside the same workflow on the CPU (issue 47's GPU check).

    python -m benchmarks.vision_gpu              # on a machine with an NVIDIA GPU: vision_gpu.json + .png
    python -m benchmarks.vision_gpu --cpu-smoke  # no GPU: the same steps at tiny sizes, learner on the CPU

The workload is ``benchmarks/vision_train.py``'s (its ``camera_settings`` and ``camera_training_set``:
pick-place expert demos + fleet-like episodes, both cameras, ``policy.kind: vision`` at its
defaults), trained by the product's ``make_trainer`` with params.yaml's ``device`` set to ``cuda``
(the learner's weights and batches on the GPU; sampling, augmentation and validation rollouts stay
on the host's cores). Rows, each ``--iterations`` measured iterations after one warm-up:

* ``cuda: sequential``, ``cuda: auto: <plan>``: the learner on the GPU, under the sequential plan and
  under what ``scheduler.plan: auto`` picks on this machine;
* ``cpu reference: sequential``: the same iterations with the learner on the CPU.

Reports training frames/s per row, the stage split, the GPU over CPU ratio, and how far the CUDA
weights are from the CPU weights after the same iterations (not bit-identical: different kernels;
and nothing forces deterministic CUDA kernels, so the gap between the two CUDA rows, the same
iterations under two plans, is reported too). Also run by ``benchmarks/gpu_check.sh``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from benchmarks.vision_train import SIZES, Size, camera_settings, camera_training_set, stage_split
from components.config import load_settings

RESULTS = Path(__file__).resolve().parent / "results"
NAME = "vision_gpu"
REFERENCE = "cpu reference: sequential"  # the learner on the CPU, the 2-core figures' path


def log(message: str) -> None:
    print(f"[{NAME}] {message}", flush=True)


def timed_run(trainer: Any, plan: Any, iterations: int) -> dict:
    """``iterations`` + 1 iterations of ``plan`` (the first dropped: start-up), frames/s and final weights."""
    size = trainer.spec.batch_size * trainer.spec.steps_per_iteration
    res = trainer.runtime.run(plan, iterations + 1)
    steady = list(res.iteration_s)[1:]
    median = statistics.median(steady)
    return {"plan": plan.name, "median_iteration_s": median, "frames_per_s": size / median,
            "stage_split_ms": stage_split(res), "weights": res.final["params"]}


def weight_gap(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    """Largest absolute difference between two state dicts' floating tensors."""
    return max(float((a[k].float().cpu() - b[k].float().cpu()).abs().max()) for k in a if a[k].is_floating_point())


def measure(size: Size, device: str, iterations: int) -> dict:
    from components.training.trainer import make_trainer

    with tempfile.TemporaryDirectory() as tmp:
        settings = camera_settings(load_settings(), size, Path(tmp))
        data, workload = camera_training_set(settings, size)
        log(f"camera training set: {workload}; learner on {device}")
        rows = {}
        accel = make_trainer(settings.model_copy(update={"device": device}), data, log=log)
        auto = accel.choose("auto")
        for label, plan in (("sequential", accel.runtime.sequential()), (f"auto: {auto.plan.name}", auto.plan)):
            rows[f"{device}: {label}"] = timed_run(accel, plan, iterations)
        host = make_trainer(settings.model_copy(update={"device": "cpu"}), data, log=log)
        rows[REFERENCE] = timed_run(host, host.runtime.sequential(), iterations)
    reference = rows[REFERENCE]
    fastest = min((r for k, r in rows.items() if k != REFERENCE), key=lambda r: r["median_iteration_s"])
    gaps = {k: weight_gap(r["weights"], reference["weights"]) for k, r in rows.items() if k != REFERENCE}
    return {
        "benchmark": NAME, "device": device,
        "gpu": torch.cuda.get_device_name(0) if device == "cuda" else None,
        "workload": {**workload, "camera": f"{size.camera}x{size.camera}", "batch_size": settings.train.batch_size,
                     "steps_per_iteration": size.steps_per_iteration, "iterations": iterations},
        "auto_plan": {"name": auto.plan.name, "source": auto.source},
        "rows": {k: {x: v for x, v in r.items() if x != "weights"} for k, r in rows.items()},
        "accelerator_over_cpu": reference["median_iteration_s"] / fastest["median_iteration_s"],
        "max_weight_gap_vs_cpu": gaps,
        # the same iterations under two plans on the accelerator: 0 when its kernels are deterministic
        "max_weight_gap_between_accelerator_rows": weight_gap(*(r["weights"] for k, r in rows.items() if k != REFERENCE)),
    }


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = result["rows"]
    fig, ax = plt.subplots(figsize=(7, 3.2))
    ax.barh(list(rows), [r["frames_per_s"] for r in rows.values()], color="tab:blue")
    ax.set_xlabel("training frames/s (camera workflow)")
    ax.set_title(f"learner on {result['gpu'] or result['device']} vs the CPU: "
                 f"{result['accelerator_over_cpu']:.2f}x", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--cpu-smoke", action="store_true", help="no GPU: tiny sizes, the 'accelerator' rows on the CPU")
    ap.add_argument("--iterations", type=int, default=None, help="measured iterations per row (default 6; smoke 2)")
    ap.add_argument("--out", type=Path, default=RESULTS)
    args = ap.parse_args(argv)
    if not args.cpu_smoke and not torch.cuda.is_available():
        raise SystemExit(f"{NAME}: no CUDA GPU is visible to torch; run with --cpu-smoke, or on a GPU machine")
    size = SIZES["tiny" if args.cpu_smoke else "quick"]
    iterations = args.iterations or (2 if args.cpu_smoke else 6)
    started = time.time()
    result = measure(size, "cpu" if args.cpu_smoke else "cuda", iterations)
    result["seconds"] = time.time() - started
    name = f"{NAME}_smoke" if args.cpu_smoke else NAME
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"{name}.json").write_text(json.dumps(result, indent=2, default=str) + "\n")
    plot(result, args.out / f"{name}.png")
    for k, r in result["rows"].items():
        log(f"{k:<40} {r['frames_per_s']:9.1f} frames/s  {r['median_iteration_s'] * 1e3:8.1f} ms/iteration")
    log(f"fastest accelerator row over the CPU learner: {result['accelerator_over_cpu']:.2f}x; "
        f"wrote {args.out / name}.json in {result['seconds']:.0f} s")
    return result


if __name__ == "__main__":
    main()
