"""Where the pack initial policy's spread comes from: the bootstrap's seed, or the robots it is scored on?

    python -m benchmarks.pack_initial_variance           # 8 seeds x 24 fresh populations (+ tuning, heldout), ~3 min, 2 workers
    python -m benchmarks.pack_initial_variance --quick   # smoke run (2 seeds x 2 populations, tiny budgets)
    python -m benchmarks.pack_initial_variance --policy-class history_transformer --pack goal_radius=0.06 \
        --population-base 2100 --name pack_initial_variance_retuned   # a class and difficulty on other fresh populations

Issue 16's pack line "initial policy in 55-75 %" is judged per study on 16 test robots of a population
drawn fresh for each seed, so a study's seed changes two things at once: the bootstrap (demos,
initialisation, batches) and the robots. The studies report 36-72 % per seed. This crosses the two
instead: every bootstrap seed (the product's bootstrap, ``pack_difficulty.bootstrap_policy``) is
scored on every one of ``--populations`` fresh test populations (``evaluate_test``: ``test-*`` robots
of populations ``DIAGNOSTIC_POPULATION_BASE + p``, used by no study), with the same trial stream,
and beside them on the two fixed robot sets decisions were made on: the 16 ``tuning-*`` robots
(FERT's pack grid) and the 16 ``heldout-*`` robots of population 0 (the task's own tuning).

A two-way random-effects decomposition (no replication: one cell per seed x population) splits the
cell rates' variance into a seed part, a population part and a residual (interaction + trial noise;
the binomial part of it is printed beside it). The grand mean over the fresh populations is the
task's difficulty for this recipe; each fixed set's mean is placed against the spread of population
means, and so is the representative tuning set ``pack_retune`` tunes on (``tuning_representative``:
16 ``tuning-*`` robots of each of its tuning populations). Nothing here chooses a setting. Writes benchmarks/results/pack_initial_variance.json + .png.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import numpy as np
import torch

from benchmarks.pack_difficulty import (
    EVAL_STREAM,
    SEED_STRIDE,
    bootstrap_policy,
    commit,
)
from benchmarks.pack_retune import cell_settings, evaluate_tuning_set, parse_candidate
from benchmarks.policy_ceiling import classes
from components.config import EvaluationConfig, load_settings
from components.evaluation.heldout import EvaluationReport, summarize
from components.evaluation.populations import evaluate_test, evaluate_tuning
from components.sim.collect import run_episodes
from components.sim.factory import make_thresholded

RESULTS = Path(__file__).resolve().parent / "results"
DIAGNOSTIC_POPULATION_BASE = 2000  # studies use 1000 + seed (seeds < 1000): these populations are nobody's test set
FIXED_SETS = ("tuning", "heldout", "tuning_representative")


@dataclass(frozen=True)
class Grid:
    seeds: int
    populations: int
    robots: int
    trials: int
    train_steps: int | None = None  # None: the bootstrap's own budget (params.yaml); --quick shortens it
    population_base: int = DIAGNOSTIC_POPULATION_BASE  # fresh populations base .. base + populations - 1
    policy_class: str | None = None  # a policy_ceiling class; None: params.yaml's policy
    pack: dict = field(default_factory=dict)  # sim.pack overrides (a pack_retune candidate)

    def population_names(self) -> list[str]:
        return [f"population-{self.population_base + p}" for p in range(self.populations)]


FULL = Grid(seeds=8, populations=24, robots=16, trials=12)
QUICK = Grid(seeds=2, populations=2, robots=4, trials=2, train_steps=20)


def score_seed(seed: int, grid: Grid, scratch: str) -> dict:
    """One bootstrap, scored on every fresh population and on both fixed sets: rate and per-robot successes."""
    torch.set_num_threads(1)
    started = time.perf_counter()
    settings = cell_settings(Path(scratch) / f"seed-{seed}", seed, grid.policy_class, grid.pack)
    policy, info = bootstrap_policy(settings, grid.train_steps)
    actor = make_thresholded(settings.sim, policy)
    stream = seed * SEED_STRIDE + EVAL_STREAM  # the trial stream pack_difficulty and the studies use
    columns: dict[str, dict] = {}
    for p in range(grid.populations):
        population = grid.population_base + p
        report = evaluate_test(actor, settings.fleet.test_ids(grid.robots), population, settings.sim, settings.fleet,
                               settings.evaluation, grid.trials, stream, "initial")
        columns[f"population-{population}"] = _column(report)
    columns["tuning"] = _column(evaluate_tuning(actor, settings.fleet.tuning_ids(grid.robots), settings.sim,
                                                settings.fleet, settings.evaluation, grid.trials, stream, "initial"))
    heldout = run_episodes(actor, settings.fleet.heldout_ids(grid.robots), settings.sim, grid.trials, stream, "initial")
    columns["heldout"] = _column(summarize(heldout, settings.sim, settings.evaluation.confidence, "initial"))
    representative = evaluate_tuning_set(actor, settings, grid.robots, grid.trials, stream)
    columns["tuning_representative"] = _pooled_column([_column(r) for r in representative.values()],
                                                      tuple(representative))
    return {"seed": seed, **info, "columns": columns, "seconds": time.perf_counter() - started}


def _column(report: EvaluationReport) -> dict:
    return {"rate": report.overall.rate, "successes": report.overall.successes, "trials": report.overall.trials,
            "successes_by_robot": {r: p.successes for r, p in report.by_robot.items()}}


def _pooled_column(columns: list[dict], populations: tuple[int, ...]) -> dict:
    """One column over several populations; a robot is ``population/id`` (the ids repeat)."""
    wins, trials = sum(c["successes"] for c in columns), sum(c["trials"] for c in columns)
    return {"rate": wins / trials, "successes": wins, "trials": trials,
            "successes_by_robot": {f"{p}/{r}": w for p, c in zip(populations, columns)
                                   for r, w in c["successes_by_robot"].items()}}


def variance_components(rates: np.ndarray) -> dict:
    """Two-way random effects without replication (rows: seeds, columns: populations), the method of
    moments (ANOVA) estimates, each clipped at 0: var(cell) = seed + population + residual."""
    s, p = rates.shape
    grand = rates.mean()
    row, col = rates.mean(axis=1), rates.mean(axis=0)
    ms_seed = p * ((row - grand) ** 2).sum() / (s - 1)
    ms_pop = s * ((col - grand) ** 2).sum() / (p - 1)
    resid = rates - row[:, None] - col[None, :] + grand
    ms_res = (resid ** 2).sum() / ((s - 1) * (p - 1))
    return {"seed_var": max(0.0, (ms_seed - ms_res) / p), "population_var": max(0.0, (ms_pop - ms_res) / s),
            "residual_var": float(ms_res), "grand_mean": float(grand),
            "seed_means": row.tolist(), "population_means": col.tolist()}


def grand_mean_ci(rates: np.ndarray, resamples: int, seed: int, confidence: float) -> list[float]:
    """Percentile interval of the grand mean, seeds and populations resampled independently
    (both are random draws the figure should generalise over)."""
    rng = np.random.default_rng(seed)
    s, p = rates.shape
    means = [rates[rng.integers(0, s, s)][:, rng.integers(0, p, p)].mean() for _ in range(resamples)]
    tail = 100 * (1 - confidence) / 2
    return [float(np.percentile(means, tail)), float(np.percentile(means, 100 - tail))]


def robot_spread(cells: list[dict], trials: int) -> dict:
    """Between-robot variance of success within the fresh populations (per-robot rates pooled over seeds,
    less their binomial part): what one 16-robot population mean should vary by, if robots are iid."""
    per_robot: dict[tuple[str, str], list[int]] = {}
    for cell in cells:
        for name, column in cell["columns"].items():
            if name.startswith("population-"):
                for robot, wins in column["successes_by_robot"].items():
                    per_robot.setdefault((name, robot), []).append(wins)
    n = trials * len(cells)
    rates = np.array([sum(w) / n for w in per_robot.values()])
    binomial = float(np.mean(rates * (1 - rates) / n))
    return {"robots": len(rates), "robot_var": max(0.0, float(rates.var(ddof=1)) - binomial),
            "robot_rate_min": float(rates.min()), "robot_rate_max": float(rates.max())}


def analyse(cells: list[dict], grid: Grid, evaluation: EvaluationConfig, seed: int) -> dict:
    cells = sorted(cells, key=lambda c: c["seed"])
    names = grid.population_names()
    rates = np.array([[c["columns"][n]["rate"] for n in names] for c in cells])
    parts = variance_components(rates)
    pop_sd = float(np.sqrt(parts["population_var"]))
    fixed = {}
    for name in FIXED_SETS:
        mean = float(np.mean([c["columns"][name]["rate"] for c in cells]))
        fixed[name] = {"mean": mean, "per_seed": [c["columns"][name]["rate"] for c in cells],
                       "z_vs_populations": (mean - parts["grand_mean"]) / pop_sd if pop_sd > 0 else None}
    p = parts["grand_mean"]
    robots = robot_spread(cells, grid.trials)
    ci = grand_mean_ci(rates, evaluation.bootstrap_resamples, seed, evaluation.confidence)
    return {"populations": names, "rates": rates.tolist(), **parts, "grand_mean_ci95": ci,
            "seed_sd_points": 100 * float(np.sqrt(parts["seed_var"])), "population_sd_points": 100 * pop_sd,
            "residual_sd_points": 100 * float(np.sqrt(parts["residual_var"])),
            "binomial_sd_points": 100 * float(np.sqrt(p * (1 - p) / (grid.robots * grid.trials))),
            "robots": robots,
            "population_sd_from_robots_points": 100 * float(np.sqrt(robots["robot_var"] / grid.robots)),
            "fixed_sets": fixed}


def run_grid(grid: Grid, scratch: Path, workers: int) -> list[dict]:
    context = multiprocessing.get_context("spawn")  # LanceDB and torch state do not survive a fork
    with ProcessPoolExecutor(max(1, workers), mp_context=context) as pool:
        futures = [pool.submit(score_seed, seed, grid, str(scratch)) for seed in range(grid.seeds)]
        cells = []
        for future in futures:
            cells.append(future.result())
            c = cells[-1]
            print(f"seed {c['seed']}: " + ", ".join(f"{n} {v['rate']:.1%}" for n, v in c["columns"].items())
                  + f" ({c['seconds']:.0f}s)", flush=True)
    return cells


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    a = result["analysis"]
    rates = 100 * np.array(a["rates"])
    fig, (left, right) = plt.subplots(1, 2, figsize=(15, 4.6), gridspec_kw={"width_ratios": [1.6, 1]})
    image = left.imshow(rates, cmap="viridis", aspect="auto", vmin=30, vmax=90)
    left.set_xticks(range(len(a["populations"])), [n.split("-")[1] for n in a["populations"]], fontsize=7, rotation=90)
    left.set_yticks(range(rates.shape[0]), [str(s) for s in range(rates.shape[0])], fontsize=8)
    left.set_xlabel("fresh test population")
    left.set_ylabel("bootstrap seed")
    for (i, j), value in np.ndenumerate(rates):
        left.text(j, i, f"{value:.0f}", ha="center", va="center", fontsize=6, color="white")
    fig.colorbar(image, ax=left, label="initial policy success, %")
    means = 100 * np.array(a["population_means"])
    right.scatter(range(len(means)), means, color="tab:blue", label="fresh population (mean over seeds)")
    for k, name in enumerate(FIXED_SETS):
        right.scatter([len(means) + k], [100 * a["fixed_sets"][name]["mean"]], color="tab:red", marker="D",
                      label="fixed sets decisions were made on" if k == 0 else None)
    right.axhspan(55, 75, color="grey", alpha=0.15, label="issue 16: 55-75 %")
    right.axhline(100 * a["grand_mean"], color="tab:blue", ls="--", lw=0.8, label="grand mean")
    right.axhspan(*(100 * np.array(a["grand_mean_ci95"])), color="tab:blue", alpha=0.1, label="its 95% interval")
    right.set_xticks(range(len(means) + len(FIXED_SETS)),
                     [n.split("-")[1] for n in a["populations"]] + list(FIXED_SETS), fontsize=7, rotation=90)
    right.set_ylabel("mean over bootstrap seeds, %")
    right.set_title(f"sd: seeds {a['seed_sd_points']:.1f}, populations {a['population_sd_points']:.1f}, "
                    f"residual {a['residual_sd_points']:.1f} pts", fontsize=9)
    right.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1))
    g = result["grid"]
    recipe = f"{g.get('policy_class') or 'params.yaml policy'}, sim.pack {g.get('pack') or 'params.yaml'}"
    fig.suptitle(f"pack initial policy ({recipe}): {g['seeds']} bootstrap seeds x {g['populations']} populations, "
                 f"{g['robots']} robots x {g['trials']} trials a cell (thresholded)", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="2 seeds x 2 populations, tiny budgets")
    parser.add_argument("--workers", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--out", type=Path, default=RESULTS)
    parser.add_argument("--policy-class", choices=list(classes()), help="a policy_ceiling class (default: params.yaml's)")
    parser.add_argument("--pack", default="", metavar="KEY=VALUE[,KEY=VALUE]", help="sim.pack overrides")
    parser.add_argument("--population-base", type=int, default=DIAGNOSTIC_POPULATION_BASE,
                        help="fresh test populations BASE .. BASE + populations - 1 (2000: the first diagnostic's)")
    parser.add_argument("--name", help="results name (default pack_initial_variance[_quick])")
    args = parser.parse_args()
    grid, name = (QUICK, "pack_initial_variance_quick") if args.quick else (FULL, "pack_initial_variance")
    grid = replace(grid, population_base=args.population_base, policy_class=args.policy_class,
                   pack=parse_candidate(args.pack))
    name = args.name or name
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="pack-initial-variance-") as scratch:
        cells = run_grid(grid, Path(scratch), args.workers)
    result = {"benchmark": "pack_initial_variance", "commit": commit(), "grid": asdict(grid),
              "population_base": grid.population_base, "cells": cells,
              "seconds": time.perf_counter() - started}
    settings = load_settings()
    result["analysis"] = analyse(cells, grid, settings.evaluation, settings.seed)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"{name}.json").write_text(json.dumps(result, indent=1) + "\n")
    plot(result, args.out / f"{name}.png")
    a = result["analysis"]
    print(f"grand mean {a['grand_mean']:.1%} [{a['grand_mean_ci95'][0]:.1%}, {a['grand_mean_ci95'][1]:.1%}]; sd in points: seeds {a['seed_sd_points']:.1f}, populations "
          f"{a['population_sd_points']:.1f} (from robots {a['population_sd_from_robots_points']:.1f}), residual "
          f"{a['residual_sd_points']:.1f} (binomial {a['binomial_sd_points']:.1f}); "
          + ", ".join(f"{n} {v['mean']:.1%}" for n, v in a["fixed_sets"].items()))
    print(f"wrote {args.out / name}.json and .png in {result['seconds']:.0f}s")


if __name__ == "__main__":
    main()
