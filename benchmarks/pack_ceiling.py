"""What caps a policy on pack: the expert data it sees, or its gradient steps? On tuning robots only.

    python -m benchmarks.pack_ceiling            # 2 seeds x demo robots 4, 32 x steps 500 .. 4000 (~2 min, 2 workers)
    python -m benchmarks.pack_ceiling --quick    # smoke run (1 seed, 2 cells, tiny budgets)

The pack study's fleet methods stop near 85% at 96 robots while the scripted expert succeeds on
every trial. Each cell here is the product's bootstrap (``benchmarks/pack_difficulty.py``: scripted
demos on ``robot-*`` ids -> ingest -> BC with ``train:`` of params.yaml) with more demo robots and a
gradient-step budget (epochs set as ``fleet_scaling.finetune_config`` sets a round's), scored thresholded
on *tuning* robots (``evaluate_tuning``: the only robots a setting may be chosen on). With
plentiful clean data, the steps show whether the MLP can fit the task at all and how many steps it
needs; at 4 demo robots they show what more steps alone buy. Nothing here runs FERT or a fleet round.
Writes benchmarks/results/pack_ceiling.json + .png.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from benchmarks.pack_difficulty import (
    EVAL_STREAM,
    SEED_STRIDE,
    bootstrap_policy,
    commit,
    pack_settings,
)
from components.evaluation.populations import evaluate_tuning
from components.sim.factory import make_thresholded

RESULTS = Path(__file__).resolve().parent / "results"


@dataclass(frozen=True)
class Grid:
    seeds: int
    demo_robots: tuple[int, ...]
    train_steps: tuple[int, ...]
    tuning_robots: int
    trials: int


FULL = Grid(2, (4, 32), (500, 1000, 2000, 4000), 16, 12)
QUICK = Grid(1, (2,), (20, 60), 4, 2)


def run_cell(seed: int, demo_robots: int, train_steps: int, tuning_robots: int, trials: int, scratch: str) -> dict:
    """One bootstrap with ``demo_robots`` x ``demo.expert_episodes_per_robot`` demos and about
    ``train_steps`` gradient steps, scored on tuning robots (thresholded jaw, as deployed)."""
    torch.set_num_threads(1)
    started = time.perf_counter()
    settings = pack_settings(Path(scratch) / f"{seed}-{demo_robots}-{train_steps}", seed)
    settings = settings.model_copy(update={"demo": settings.demo.model_copy(update={"expert_robots": demo_robots})})
    policy, info = bootstrap_policy(settings, train_steps)
    actor = make_thresholded(settings.sim, policy)
    report = evaluate_tuning(actor, settings.fleet.tuning_ids(tuning_robots), settings.sim, settings.fleet,
                             settings.evaluation, trials, seed * SEED_STRIDE + EVAL_STREAM, "bc")
    return {"seed": seed, "demo_robots": demo_robots, "demo_episodes": info["demo_episodes"],
            "demo_frames": info["demo_frames"], "train_steps_planned": train_steps, "train_steps": info["train_steps"],
            "final_loss": info["final_loss"], "rate": report.overall.rate,
            "successes": report.overall.successes, "trials": report.overall.trials,
            "ci95": [report.overall.low, report.overall.high], "failures_by_stage": dict(report.failures_by_stage),
            "seconds": time.perf_counter() - started}


def run_grid(grid: Grid, scratch: Path, workers: int) -> list[dict]:
    """Every (seed, demo robots, steps) cell; cells are independent (own root, seeded), so the
    worker count does not change a figure."""
    jobs = [(seed, robots, budget) for seed in range(grid.seeds) for robots in grid.demo_robots
            for budget in grid.train_steps]
    context = multiprocessing.get_context("spawn")  # LanceDB and torch state do not survive a fork
    with ProcessPoolExecutor(max(1, workers), mp_context=context) as pool:
        futures = [pool.submit(run_cell, *job, grid.tuning_robots, grid.trials, str(scratch)) for job in jobs]
        cells = []
        for i, future in enumerate(futures):
            cells.append(future.result())
            c = cells[-1]
            print(f"[{i + 1}/{len(jobs)}] seed {c['seed']}, {c['demo_robots']} demo robots, {c['train_steps']} steps: "
                  f"{c['rate']:.1%} on tuning robots (loss {c['final_loss']:.3f}, {c['seconds']:.0f}s)", flush=True)
    return cells


def summarize(cells: list[dict], grid: Grid) -> dict:
    """Per (demo robots, steps): successes pooled over seeds, and each seed's rate."""
    table: dict[str, dict[str, dict]] = {}
    for robots in grid.demo_robots:
        for budget in grid.train_steps:
            mine = [c for c in cells if c["demo_robots"] == robots and c["train_steps_planned"] == budget]
            wins, trials = sum(c["successes"] for c in mine), sum(c["trials"] for c in mine)
            table.setdefault(str(robots), {})[str(budget)] = {
                "rate": wins / trials, "successes": wins, "trials": trials,
                "per_seed": [c["rate"] for c in mine], "train_steps": [c["train_steps"] for c in mine]}
    return table


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.5, 4))
    for robots, by_steps in result["table"].items():
        budgets = [int(b) for b in by_steps]
        ax.plot(budgets, [100 * by_steps[str(b)]["rate"] for b in budgets], "o-", label=f"{robots} demo robots")
        for b in budgets:
            ax.scatter([b] * len(by_steps[str(b)]["per_seed"]), [100 * r for r in by_steps[str(b)]["per_seed"]],
                       s=10, alpha=0.4, color=ax.lines[-1].get_color())
    ax.axhline(100, color="grey", lw=0.8, ls=":", label="scripted expert (100% of its trials)")
    ax.set_xscale("log")
    budgets = [int(b) for b in next(iter(result["table"].values()))]
    ax.set_xticks(budgets, [str(b) for b in budgets])
    ax.minorticks_off()
    ax.set_xlabel("gradient steps (BC from scratch)")
    ax.set_ylabel("success on tuning robots, % (thresholded)")
    g = result["grid"]
    ax.set_title(f"pack: BC on scripted demos; {g['seeds']} seeds x {g['tuning_robots']} tuning robots x {g['trials']} trials",
                 fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="1 seed, 2 tiny cells")
    parser.add_argument("--workers", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    grid, name = (QUICK, "pack_ceiling_quick") if args.quick else (FULL, "pack_ceiling")
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="pack-ceiling-") as scratch:
        cells = run_grid(grid, Path(scratch), args.workers)
    result = {"benchmark": "pack_ceiling", "commit": commit(), "grid": asdict(grid), "robots": "tuning",
              "table": summarize(cells, grid), "cells": cells, "seconds": time.perf_counter() - started}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"{name}.json").write_text(json.dumps(result, indent=1) + "\n")
    plot(result, args.out / f"{name}.png")
    for robots, by_steps in result["table"].items():
        print(f"{robots:>3} demo robots: " + ", ".join(f"{b} steps {v['rate']:.1%}" for b, v in by_steps.items()))
    print(f"wrote {args.out / name}.json and .png in {result['seconds']:.0f}s")


if __name__ == "__main__":
    main()
