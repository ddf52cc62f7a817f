"""What caps FERT on pack near 88-95 %: the fleet data it learns from, or the training it gets? On tuning robots only.

    python -m benchmarks.pack_fert_cap            # 4 seeds, ~12 min with 2 workers
    python -m benchmarks.pack_fert_cap --quick    # smoke run (1 seed, tiny budgets)

The pack study's FERT cell (``fleet_scaling.run_study_cell``: bootstrap, then 6 fleet rounds of 96 robots
with FERT, ~600 fine-tuning steps a round, each round gated on validation robots) ends at 87.7 % on
test robots, while BC on plentiful clean expert data reaches 98 % (``pack_ceiling``). This runs
that cell as the study does (``PLANS["pack"]``, 96 robots, scored on *tuning* robots), keeps its
product root, and retrains on exactly the data the cell stored, through the product's own
training-set builder (``steps.training_set``) and trainer (``make_trainer``):

| variant | start | training set | steps |
|---|---|---|---|
| ``champion`` | the cell's final policy, as the study reports it | | |
| ``fert_more`` | the champion | FERT's, as a next round would build it | ``--steps`` more |
| ``fert_scratch`` | a fresh policy | FERT's | ``--steps`` |
| ``filtered_bc_scratch`` | a fresh policy | every stored success (demos + fleet) | ``--steps`` |
| ``demos_scratch`` | a fresh policy | the expert demos alone | ``--steps`` |
| ``expert_ceiling`` | a fresh policy | ~30 scripted demos on each of 32 robots (``pack_ceiling``'s cell) | ``--steps`` |

If the variants with more training land where the champion is, the data caps FERT; if they rise
toward the clean-data ceiling (``expert_ceiling``, scored on the same robots and trials), the rounds'
training budget does. Each policy is scored thresholded
on ``--robots`` tuning robots (more than the study's 16: the first 16 are easier than a typical
population, ``pack_initial_variance``), the same trials for every variant of a seed. Nothing here
chooses a setting. Writes benchmarks/results/pack_fert_cap.json + .png.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import numpy as np
import torch

from benchmarks import fleet_scaling as fs
from benchmarks.pack_ceiling import run_cell
from benchmarks.pack_difficulty import commit
from components.config import Settings
from components.evaluation.populations import evaluate_tuning
from components.pipeline import steps
from components.pipeline.workspace import Workspace
from components.policy.actor import PolicyActor
from components.sim.factory import make_thresholded
from components.training.trainer import make_trainer

RESULTS = Path(__file__).resolve().parent / "results"
VARIANTS = ("champion", "fert_more", "fert_scratch", "filtered_bc_scratch", "demos_scratch", "expert_ceiling")
CEILING_DEMO_ROBOTS = 32  # pack_ceiling's plentiful-data cell (~34k frames of scripted demos)
RETRAIN = {"fert_more": ("fert", True), "fert_scratch": ("fert", False),
           "filtered_bc_scratch": ("filtered_bc", False), "demos_scratch": ("bc", False)}


@dataclass(frozen=True)
class Grid:
    seeds: int
    steps: int  # gradient steps of each retrain
    robots: int  # tuning robots each policy is scored on
    trials: int
    plan: fs.Plan


FULL = Grid(4, 4000, 64, 6, replace(fs.PLANS["pack"], seeds=4, first_seed=0, fleet_sizes=(96,), methods=("fert",),
                                   robots="tuning"))
QUICK = Grid(1, 30, 4, 2, replace(fs.QUICK["pack"], fleet_sizes=(8,), methods=("fert",), robots="tuning",
                                  rounds=1, validation_robots=2, validation_trials=2))


def retrain(cell: Settings, ws: Workspace, method: str, from_champion: bool, budget: int):
    """About ``budget`` gradient steps on the cell's stored data, the way a round trains (the product's
    training-set builder and trainer), from the champion or from a fresh policy."""
    settings = cell.model_copy(update={"train": cell.train.model_copy(update={"method": method})})
    built = steps.training_set(settings, ws)
    settings = settings.model_copy(update={"train": fs.finetune_config(settings, len(built.data.states), budget)})
    start = steps.starting_policy(settings, ws) if from_champion else None
    run = make_trainer(settings, built.data, start, None).run()
    return run.policy, {"frames": len(built.data.states), "steps": len(run.losses), "final_loss": float(run.losses[-1])}


def score(cell: Settings, policy, grid: Grid, seed: int) -> dict:
    report = evaluate_tuning(make_thresholded(cell.sim, PolicyActor(policy)), cell.fleet.tuning_ids(grid.robots),
                             cell.sim, cell.fleet, cell.evaluation, grid.trials, seed * fs.SEED_STRIDE + fs.EVAL_STREAM,
                             "cap")
    return {"rate": report.overall.rate, "successes": report.overall.successes, "trials": report.overall.trials,
            "failures_by_stage": dict(report.failures_by_stage),
            "successes_by_robot": {r: p.successes for r, p in report.by_robot.items()}}


def run_seed(seed: int, grid: Grid, scratch: str) -> dict:
    """The study's FERT cell for ``seed`` (root kept), then every variant scored on the same trials."""
    torch.set_num_threads(1)
    started = time.perf_counter()
    fleet = grid.plan.fleet_sizes[-1]
    settings = fs.plan_settings(grid.plan)
    row, _ = fs.run_study_cell(settings, grid.plan, "fert", fleet, seed, Path(scratch), keep_root=True)
    cell = fs.cell_settings(settings, grid.plan, "fert", fs.cell_root(Path(scratch), seed, "fert", fleet), seed)
    ws = Workspace(cell)
    variants = {"champion": {**score(cell, ws.registry.load("champion"), grid, seed),
                             "study_rounds_validation": [r["validation_kept"] for r in row.rounds]}}
    for name, (method, from_champion) in RETRAIN.items():
        policy, info = retrain(cell, ws, method, from_champion, grid.steps)
        variants[name] = {**score(cell, policy, grid, seed), **info}
        print(f"  seed {seed} {name}: {variants[name]['rate']:.1%} ({info['frames']} frames, {info['steps']} steps)",
              flush=True)
    ceiling = run_cell(seed, CEILING_DEMO_ROBOTS, grid.steps, grid.robots, grid.trials, scratch)
    variants["expert_ceiling"] = {k: ceiling[k] for k in ("rate", "successes", "trials", "failures_by_stage")} | {
        "frames": ceiling["demo_frames"], "steps": ceiling["train_steps"], "final_loss": ceiling["final_loss"]}
    print(f"  seed {seed} expert_ceiling: {ceiling['rate']:.1%}", flush=True)
    return {"seed": seed, "fleet": fleet, "variants": variants, "seconds": time.perf_counter() - started}


def summarize(cells: list[dict]) -> dict:
    """Per variant: pooled rate, per-seed rates, and the seed-level mean difference from the champion."""
    out = {}
    base = np.array([c["variants"]["champion"]["rate"] for c in cells])
    for name in VARIANTS:
        rates = np.array([c["variants"][name]["rate"] for c in cells])
        wins = sum(c["variants"][name]["successes"] for c in cells)
        trials = sum(c["variants"][name]["trials"] for c in cells)
        diff = 100 * (rates - base)
        out[name] = {"rate": wins / trials, "per_seed": rates.tolist(),
                     "minus_champion_points": {"mean": float(diff.mean()), "per_seed": diff.tolist()}}
    return out


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    table = result["table"]
    fig, ax = plt.subplots(figsize=(8.5, 4))
    for k, name in enumerate(VARIANTS):
        per_seed = [100 * r for r in table[name]["per_seed"]]
        ax.bar(k, 100 * table[name]["rate"], color={"champion": "tab:blue", "expert_ceiling": "tab:green"}.get(name, "tab:gray"), alpha=0.7)
        ax.scatter([k] * len(per_seed), per_seed, color="black", s=12, zorder=3)
    ax.axhline(95, color="tab:red", ls=":", lw=1, label="issue 16: FERT at 96 robots >= 95 %")
    ax.set_xticks(range(len(VARIANTS)), [v.replace("_", "\n") for v in VARIANTS], fontsize=8)
    ax.set_ylim(50, 100)
    ax.set_ylabel("success on tuning robots, % (thresholded)")
    g = result["grid"]
    ax.set_title(f"pack, the FERT cell's stored data retrained ({g['steps']} steps); {g['seeds']} seeds x "
                 f"{g['robots']} tuning robots x {g['trials']} trials", fontsize=9)
    ax.legend(fontsize=8, loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="1 seed, 8 robots, 1 round, tiny budgets")
    parser.add_argument("--workers", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    grid, name = (QUICK, "pack_fert_cap_quick") if args.quick else (FULL, "pack_fert_cap")
    started = time.perf_counter()
    context = multiprocessing.get_context("spawn")  # LanceDB and torch state do not survive a fork
    with tempfile.TemporaryDirectory(prefix="pack-fert-cap-") as scratch, \
            ProcessPoolExecutor(max(1, min(args.workers, grid.seeds)), mp_context=context) as pool:
        cells = list(pool.map(run_seed, range(grid.seeds), [grid] * grid.seeds, [scratch] * grid.seeds))
    result = {"benchmark": "pack_fert_cap", "commit": commit(), "grid": {**asdict(grid), "plan": asdict(grid.plan)},
              "robots": "tuning", "table": summarize(cells), "cells": cells, "seconds": time.perf_counter() - started}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"{name}.json").write_text(json.dumps(result, indent=1) + "\n")
    plot(result, args.out / f"{name}.png")
    for variant, row in result["table"].items():
        print(f"{variant:>20}: {row['rate']:.1%}  ({row['minus_champion_points']['mean']:+.1f} pts vs champion)")
    print(f"wrote {args.out / name}.json and .png in {result['seconds']:.0f}s")


if __name__ == "__main__":
    main()
