"""MLP vs the history MoE policy on the same data and budget, and how the MoE training step scales.

    python -m benchmarks.moe_policy            # full: 3 seeds, FERT rounds at 32 and 96 robots + the scaling grid (hours on 2 cores)
    python -m benchmarks.moe_policy --quick    # smoke run: tiny sizes, same code (a few minutes)
    python -m benchmarks.moe_policy --success --workers 2   # only MLP vs MoE with FERT rounds, 2 seeds at once
    python -m benchmarks.moe_policy --probe    # one seed: `retrain --bootstrap`'s steps at params.yaml settings, MLP vs MoE
    python -m benchmarks.moe_policy --probe --seed 1   # the same with another seed (demos, trials)
    python -m benchmarks.moe_policy --scaling  # only the expert-scaling grid (experts 8-64 x top-k 1/2/8 x 1/2/4 processes)
    python -m benchmarks.moe_policy --scaling --experts 64 --worlds 4  # a subset of the grid (same keys)

**Success** (``success.mlp``, ``success.moe``, ``success.moe_minus_mlp``). Per seed and policy kind
(``mlp`` = ``policy:`` of params.yaml with ``kind: mlp``; ``moe`` = the same with
``kind: moe_transformer``, its knobs from params.yaml), every fleet size runs the product loop of
``benchmarks/fleet_scaling.py`` (``run_study_cell``: demos -> bootstrap champion -> FERT rounds through
ingest, the one trainer, validation-robot gate; fresh test robots per seed). Same demos, rounds,
step budget and test robots for both kinds. Reported: the bootstrap champion and the final champion
per fleet size on test robots (thresholded jaw), per seed, pooled Wilson intervals, and the
seed-level paired interval of MoE - MLP (``evaluation/intervals.paired_seed_interval``; seeds are
the unit of replication).

**Expert scaling** (``scaling``, ``step_speedup_fused_vs_megatron``). Per (experts, top-k, processes)
the MoE policy (params.yaml's, experts and top-k overridden) trains on synthetic windows with the
one expert-parallel step (``ExpertParallelTrainer``); on > 1 process a fused-shuffle model and a
Megatron-dispatcher model share the process group and step in alternation (ABAB, order flipped
every step), each step timed as its slowest rank. Split: *shuffle* = dispatch + combine forward
(timed around the dispatcher calls, slowest rank) x 2 (the backward is the same shuffle reversed:
an estimate, not a measurement); *compute* = step - shuffle. Bytes = row payload sent to other
ranks per step, mean over ranks. ``step_speedup_fused_vs_megatron`` = median over top-k of the
median per-step ratio megatron / fused at the largest expert count on the most processes.
Per cell also: ``losses_bit_identical`` (fused and Megatron trained the same losses bit for bit),
and the 1-minute load average before and after the cell (``load``: 2 shared cores, so read the
figures next to it).

Writes benchmarks/results/moe_policy[_quick].json + .png (``--probe``: moe_policy_probe.json;
``--scaling``: moe_scaling.json + .png, the scaling keys only).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from benchmarks.fleet_scaling import (
    PLANS,
    QUICK,
    Plan,
    Score,
    run_study_cell,
    log,
    plan_settings,
    run_seeds,
    seed_file,
)
from components.config import (
    PolicyConfig,
    Settings,
    ShuffleConfig,
    TrainConfig,
    load_settings,
)
from components.evaluation.intervals import paired_seed_interval, wilson_interval
from components.shuffle.local_group import run_local_group

RESULTS = Path(__file__).resolve().parent / "results"
KINDS = {"mlp": "mlp", "moe": "moe_transformer"}
METHOD = "fert"
DISPATCHERS = {"fused": ShuffleConfig(), "megatron": ShuffleConfig(dispatcher="megatron")}
SYNTHETIC_FRAMES = 4096
SYNTHETIC_OBS, SYNTHETIC_ACT = 11, 3  # the built-in task's widths
BACKWARD_SHUFFLES = 2  # forward shuffle time x this = the step's shuffle estimate (backward mirrors it)


@dataclass(frozen=True)
class ScalingPlan:
    experts: tuple[int, ...]
    top_k: tuple[int, ...]
    worlds: tuple[int, ...]
    batch_size: int
    steps: int
    warmup: int


@dataclass(frozen=True)
class StudyPlan:
    cells: Plan  # fleet_scaling's sizes: seeds, rounds, fleet sizes, budgets, test robots
    scaling: ScalingPlan
    demo: dict  # overrides of demo: (quick only)
    train: dict  # overrides of train: (quick only; the bootstrap recipe)


FULL = StudyPlan(
    replace(PLANS["pickplace"], seeds=3, fleet_sizes=(32, 96), ablation=False, methods=(METHOD,)),
    ScalingPlan((8, 16, 32, 64), (1, 2, 8), (1, 2, 4), batch_size=256, steps=20, warmup=3),
    {}, {},
)
QUICK_PLAN = StudyPlan(
    replace(QUICK["pickplace"], seeds=2, rounds=1, fleet_sizes=(4,), finetune_steps=40, heldout_robots=4,
            trials_per_robot=4, validation_robots=2, validation_trials=2, methods=(METHOD,)),
    ScalingPlan((8, 16), (1, 2), (1, 2), batch_size=64, steps=4, warmup=1),
    {"expert_robots": 2, "expert_episodes_per_robot": 6}, {"epochs": 4},
)


def with_kind(settings: Settings, kind: str) -> Settings:
    return settings.model_copy(update={"policy": settings.policy.model_copy(update={"kind": KINDS[kind]})})


# ------------------------------------------------------------------------------- success
def success_study(settings: Settings, plan: Plan, workers: int = 1, cells: Path | None = None,
                  finished_only: bool = False) -> tuple[dict, list[int]]:
    """Test-robot scores per kind (``bootstrap`` and ``fleet_<n>`` lists, one Score per seed), and
    the seeds they are from.

    ``workers`` > 1: that many seeds at once, one process and one torch thread each (a seed's
    figures do not depend on which process ran it). ``cells``: a folder that keeps each seed's
    scores as the seed finishes; seeds already there are not run again, so a stopped study resumes.
    ``finished_only``: run nothing, report the seeds the folder holds."""
    scratch = cells or Path(tempfile.mkdtemp(prefix="moe_policy_"))
    scratch.mkdir(parents=True, exist_ok=True)
    try:
        todo = [] if finished_only else [seed for seed in range(plan.seeds) if not seed_file(scratch, seed).exists()]
        for seed, done in run_seeds(settings, plan, todo, scratch, workers, success_seed):
            seed_file(scratch, seed).write_text(json.dumps(
                {kind: {phase: asdict(score) for phase, score in phases.items()} for kind, phases in done.items()},
                indent=1) + "\n")
        seeds = [seed for seed in range(plan.seeds) if seed_file(scratch, seed).exists()]
        if not seeds:
            raise SystemExit(f"{scratch} holds no finished seed of this plan: nothing to report")
        per_seed = [json.loads(seed_file(scratch, seed).read_text()) for seed in seeds]
    finally:
        if cells is None:
            shutil.rmtree(scratch, ignore_errors=True)
    scores = {kind: {phase: [Score(**seed[kind][phase]) for seed in per_seed] for phase in per_seed[0][kind]}
              for kind in KINDS}
    return scores, seeds


def success_seed(settings: Settings, plan: Plan, seed: int, scratch: Path) -> dict[str, dict[str, Score]]:
    """One seed (in its own folder under ``scratch``): per kind, the bootstrap champion and the
    final champion per fleet size."""
    torch.set_num_threads(1)
    scratch = scratch / f"seed-{seed}"
    scores: dict[str, dict[str, Score]] = {}
    for kind in KINDS:
        for fleet in plan.fleet_sizes:
            # a scratch folder per kind: run_study_cell names a cell's root by (seed, method, fleet)
            # only, and MLflow keeps state per store path within a process
            row, initial = run_study_cell(with_kind(settings, kind), plan, METHOD, fleet, seed, scratch / kind)
            scores.setdefault(kind, {}).setdefault("bootstrap", initial)
            scores[kind][f"fleet_{fleet}"] = row.score
            log(f"seed {seed} {kind}: bootstrap {initial.rate:.1%}, after {plan.rounds} {METHOD} rounds at "
                f"{fleet} robots {row.score.rate:.1%} ({row.seconds:.0f}s)")
    return scores


def _finite(x: float) -> float | None:
    return x if math.isfinite(x) else None


def summarize_success(scores: dict[str, dict[str, list[Score]]], confidence: float) -> dict:
    out: dict = {}
    for kind, phases in scores.items():
        out[kind] = {}
        for phase, per_seed in phases.items():
            pooled = wilson_interval(sum(s.successes for s in per_seed), sum(s.trials for s in per_seed), confidence)
            out[kind][phase] = {"per_seed": [s.rate for s in per_seed], "mean": float(np.mean([s.rate for s in per_seed])),
                                "pooled": {"rate": pooled.rate, "low": pooled.low, "high": pooled.high,
                                           "trials": pooled.trials}}
    out["moe_minus_mlp"] = {}
    for phase in scores["mlp"]:
        d = paired_seed_interval([s.rate for s in scores["moe"][phase]], [s.rate for s in scores["mlp"][phase]],
                                 confidence)
        out["moe_minus_mlp"][phase] = {"per_seed": list(d.differences), "mean": d.mean, "sd": d.sd,
                                       "low": _finite(d.low), "high": _finite(d.high), "seeds": len(d.differences)}
    return out


# ------------------------------------------------------------------------------- expert scaling
class ShuffleClock:
    """Seconds spent in the dispatchers' forward calls (dispatch + combine) of one model."""

    def __init__(self, model: torch.nn.Module) -> None:
        from components.policy.moe import moe_layers

        self.seconds = 0.0
        for layer in moe_layers(model):
            if layer.dispatcher is not None:
                layer.dispatcher.dispatch = self._timed(layer.dispatcher.dispatch)
                layer.dispatcher.combine = self._timed(layer.dispatcher.combine)

    def _timed(self, fn: Callable) -> Callable:
        def call(*args, **kwargs):
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.seconds += time.perf_counter() - start
        return call


def _slowest(value: float, group: dist.ProcessGroup | None, op=dist.ReduceOp.MAX) -> float:
    if group is None:
        return value
    t = torch.tensor([value], dtype=torch.float64)
    dist.all_reduce(t, op=op, group=group)
    return float(t)


def _scaling_worker(rank: int, world: int, policy: PolicyConfig, batch: int, steps: int, warmup: int) -> dict:
    from components.training.expert_parallel import ExpertParallelTrainer, _Data

    torch.set_num_threads(1)
    rng = np.random.default_rng(0)
    states = rng.normal(size=(SYNTHETIC_FRAMES, SYNTHETIC_OBS)).astype(np.float32)
    actions = np.tanh(states[:, :SYNTHETIC_ACT] + states[:, SYNTHETIC_ACT:2 * SYNTHETIC_ACT]).astype(np.float32)
    data = _Data(torch.from_numpy(states), torch.from_numpy(actions), None)
    group = dist.group.WORLD if world > 1 else None
    train = TrainConfig(batch_size=batch, epochs=1)
    names = list(DISPATCHERS) if world > 1 else ["local"]
    trainers = {n: ExpertParallelTrainer(data, policy, train, DISPATCHERS.get(n, ShuffleConfig()), seed=0, group=group)
                for n in names}
    clocks = {n: ShuffleClock(t.model) for n, t in trainers.items()}
    rows: dict[str, dict[str, list[float]]] = {n: {"step": [], "shuffle": [], "bytes": [], "loss": []} for n in names}
    for i in range(warmup + steps):
        order = names if i % 2 == 0 else names[::-1]
        for n in order:
            if group is not None:
                dist.barrier(group)
            clocks[n].seconds, sent = 0.0, trainers[n].shuffle_bytes_sent() if group is not None else 0
            loss, seconds = trainers[n].step()
            rows[n]["loss"].append(loss)
            step_s, shuffle_s = _slowest(seconds, group), _slowest(clocks[n].seconds, group)
            moved = (trainers[n].shuffle_bytes_sent() - sent) if group is not None else 0
            if i >= warmup:
                rows[n]["step"].append(step_s)
                rows[n]["shuffle"].append(BACKWARD_SHUFFLES * shuffle_s)
                rows[n]["bytes"].append(_slowest(float(moved), group, dist.ReduceOp.SUM) / world)
    return rows


def scaling_cell(base: PolicyConfig, experts: int, k: int, world: int, plan: ScalingPlan) -> dict:
    policy = base.model_copy(update={"kind": KINDS["moe"], "num_experts": experts, "top_k": k})
    load_before = os.getloadavg()[0]
    rows = run_local_group(_scaling_worker, world, policy, plan.batch_size, plan.steps, plan.warmup)[0]
    cell: dict = {"experts": experts, "top_k": k, "world": world, "batch_size": plan.batch_size,
                  "tokens_per_step": plan.batch_size * policy.history, "variants": {},
                  "load": {"before": load_before, "after": os.getloadavg()[0]}}
    for name, r in rows.items():
        step = statistics.median(r["step"])
        shuffle = min(statistics.median(r["shuffle"]), step)
        cell["variants"][name] = {"step_ms": 1e3 * step, "shuffle_ms": 1e3 * shuffle, "compute_ms": 1e3 * (step - shuffle),
                                  "samples_per_s": plan.batch_size / step, "mib_per_step": statistics.median(r["bytes"]) / 2**20}
    if "fused" in rows:
        cell["speedup_fused_vs_megatron"] = statistics.median(
            m / f for m, f in zip(rows["megatron"]["step"], rows["fused"]["step"], strict=True))
        cell["losses_bit_identical"] = rows["fused"]["loss"] == rows["megatron"]["loss"]
    return cell


def scaling_study(settings: Settings, plan: ScalingPlan) -> list[dict]:
    cells = []
    for world in plan.worlds:
        for experts in plan.experts:
            for k in plan.top_k:
                if k > experts or experts % world:
                    continue
                cell = scaling_cell(settings.policy, experts, k, world, plan)
                cells.append(cell)
                log(f"scaling E={experts} k={k} W={world}: " + ", ".join(
                    f"{n} {v['step_ms']:.1f} ms ({v['shuffle_ms']:.1f} shuffle, {v['mib_per_step']:.2f} MiB)"
                    for n, v in cell["variants"].items()))
    return cells


def headline_speedup(cells: list[dict]) -> dict:
    parallel = [c for c in cells if "speedup_fused_vs_megatron" in c]
    if not parallel:
        return {"value": None}
    world = max(c["world"] for c in parallel)
    experts = max(c["experts"] for c in parallel if c["world"] == world)
    at = {c["top_k"]: c["speedup_fused_vs_megatron"] for c in parallel if c["world"] == world and c["experts"] == experts}
    return {"value": statistics.median(at.values()), "experts": experts, "world": world, "by_top_k": at}


# ------------------------------------------------------------------------------- probe
def bootstrap_probe(settings: Settings, kinds: tuple[str, ...] = tuple(KINDS)) -> dict:
    """``fleetloop retrain --bootstrap``'s steps (demos -> ingest -> train -> evaluate on the held-out
    robots) at ``settings``, once per kind, each in a fresh root: the same demos and trials."""
    from components.pipeline import steps
    from components.pipeline.collect import collect_expert_demos
    from components.pipeline.evaluate import evaluate_policy
    from components.pipeline.ingest import ingest_files

    out = {}
    for kind in kinds:
        root = Path(tempfile.mkdtemp(prefix=f"moe_probe_{kind}_"))
        try:
            cell = with_kind(settings, kind).model_copy(update={"root": root})
            demos = collect_expert_demos(cell, cell.paths.incoming / "expert")
            ingest_files(cell, demos.files, snapshot=False)
            started = time.perf_counter()
            outcome = steps.train_policy(cell)
            train_s = time.perf_counter() - started
            report = evaluate_policy(cell, outcome.result.policy, kind)
            p = report.overall
            usage = outcome.summary.expert_usage if outcome.summary else None
            out[kind] = {"success": p.rate, "low": p.low, "high": p.high, "trials": p.trials, "demos": demos.episodes,
                         "train_steps": outcome.result.steps, "train_s": train_s, "final_loss": outcome.result.final_loss,
                         "mean_dropped_rate": usage["mean_dropped_rate"] if usage else None,
                         "mean_share": usage["mean_share"] if usage else None}
            log(f"probe {kind}: {p.rate:.1%} [{p.low:.1%}, {p.high:.1%}] of {p.trials} held-out trials; "
                f"{outcome.result.steps} steps in {train_s:.0f}s, final loss {outcome.result.final_loss:.4f}")
        finally:
            shutil.rmtree(root, ignore_errors=True)
    return out


# ------------------------------------------------------------------------------- report
def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    if "scaling" in result:
        fig, (left, right) = plt.subplots(1, 2, figsize=(15, 5), width_ratios=(1, 2))
    else:  # --success: the scaling grid is moe_scaling.png
        fig, left = plt.subplots(figsize=(6, 5))
    success = result["success"]
    phases = list(success["mlp"])
    for j, kind in enumerate(KINDS):
        xs = np.arange(len(phases)) + (j - 0.5) * 0.35
        means = [success[kind][p]["mean"] for p in phases]
        lows = [success[kind][p]["pooled"]["low"] for p in phases]
        highs = [success[kind][p]["pooled"]["high"] for p in phases]
        left.bar(xs, means, 0.35, label=kind, yerr=[np.subtract(means, lows), np.subtract(highs, means)], capsize=3)
        for x, p in zip(xs, phases, strict=True):
            left.plot([x] * len(success[kind][p]["per_seed"]), success[kind][p]["per_seed"], "k.", ms=4)
    left.set_xticks(range(len(phases)), [p.replace("_", " ") for p in phases])
    left.set_ylim(0, 1)
    left.set_ylabel("test-robot success")
    left.set_xlabel("bars: mean over seeds, pooled Wilson 95%; dots: one seed each")
    reported = result.get("seeds_reported", list(range(result["plan"]["seeds"])))
    left.set_title(f"MLP vs MoE, {len(reported)} seeds" + (f" (of {result['plan']['seeds']} planned)"
                                                            if len(reported) < result["plan"]["seeds"] else ""))
    left.legend()
    if "scaling" in result:
        _plot_scaling(right, result)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def plot_scaling(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(max(8, 0.22 * sum(len(c["variants"]) for c in result["scaling"])), 5))
    _plot_scaling(ax, result)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def _plot_scaling(right, result: dict) -> None:
    cells = result["scaling"]
    labels, x = [], 0
    for cell in cells:
        for name, v in cell["variants"].items():
            color = {"fused": "C0", "megatron": "C1", "local": "C2"}[name]
            right.bar(x, v["compute_ms"], color=color, alpha=0.5)
            right.bar(x, v["shuffle_ms"], bottom=v["compute_ms"], color=color, hatch="//")
            labels.append(f"E{cell['experts']} k{cell['top_k']} W{cell['world']} {name[:3]}")
            x += 1
    right.set_xticks(range(len(labels)), labels, rotation=90, fontsize=6)
    right.set_ylabel("median step ms (solid: compute, hatched: shuffle est.)")
    head = result["step_speedup_detail"]
    value = "n/a" if head["value"] is None else f"{head['value']:.2f}x"
    right.set_title(f"MoE step, fused vs Megatron-style: {value} at E={head.get('experts')} on W={head.get('world')}")


def run(study: StudyPlan, out_name: str, settings: Settings | None = None, workers: int = 1,
        cells: Path | None = None, scaling: bool = True, command: str = "", finished_only: bool = False) -> dict:
    """The success study (``workers`` seeds at once; ``cells`` keeps finished seeds) and, with
    ``scaling``, the expert-scaling grid; ``scaling=False`` (``--success``) leaves the grid to
    ``--scaling``'s moe_scaling.json."""
    torch.set_num_threads(1)
    base = settings or load_settings()
    base = base.model_copy(update={"demo": base.demo.model_copy(update=study.demo),
                                   "train": base.train.model_copy(update=study.train)})
    settings = plan_settings(study.cells, base)
    started = time.perf_counter()
    scores, seeds = success_study(settings, study.cells, workers, cells, finished_only)
    result = {
        "plan": {**{k: v for k, v in study.cells.__dict__.items()}, "scaling": study.scaling.__dict__,
                 "demo": settings.demo.model_dump(), "train": settings.train.model_dump(),
                 "policy_moe": with_kind(settings, "moe").policy.model_dump(), "policy_mlp": settings.policy.model_dump()},
        "success": summarize_success(scores, settings.evaluation.confidence),
        "seeds_reported": seeds,
    }
    if scaling:
        grid = scaling_study(settings, study.scaling)
        headline = headline_speedup(grid)
        result.update({"scaling": grid, "step_speedup_fused_vs_megatron": headline["value"],
                       "step_speedup_detail": headline})
    result.update({"seconds": time.perf_counter() - started, "workers": workers,
                   "machine": {"cpus": os.cpu_count(), "python": platform.python_version(), "torch": torch.__version__}})
    if command:
        result["command"] = command
    write(result, out_name)
    return result


def run_scaling(plan: ScalingPlan, out_name: str = "moe_scaling", settings: Settings | None = None) -> dict:
    """Only the expert-scaling grid (``--scaling``), with the scaling keys of the full run."""
    torch.set_num_threads(1)
    settings = settings or load_settings()
    started = time.perf_counter()
    cells = scaling_study(settings, plan)
    headline = headline_speedup(cells)
    loads = [v for c in cells for v in c["load"].values()]
    result = {
        "plan": {"scaling": plan.__dict__, "policy_moe": with_kind(settings, "moe").policy.model_dump()},
        "scaling": cells,
        "step_speedup_fused_vs_megatron": headline["value"],
        "step_speedup_detail": headline,
        "load_1min": {"min": min(loads), "median": statistics.median(loads), "max": max(loads)} if loads else None,
        "seconds": time.perf_counter() - started,
        "machine": {"cpus": os.cpu_count(), "python": platform.python_version(), "torch": torch.__version__},
    }
    write(result, out_name)
    return result


def write(result: dict, out_name: str) -> None:
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / f"{out_name}.json").write_text(json.dumps(result, indent=2, default=list) + "\n")
    if "success" in result:
        plot(result, RESULTS / f"{out_name}.png")
    elif "scaling" in result:
        plot_scaling(result, RESULTS / f"{out_name}.png")
    log(f"wrote {RESULTS / (out_name + '.json')}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="smoke sizes (a few minutes)")
    parser.add_argument("--probe", action="store_true", help="only the bootstrap comparison at params.yaml settings")
    parser.add_argument("--seed", type=int, default=None, help="--probe: this seed instead of params.yaml's")
    parser.add_argument("--scaling", action="store_true", help="only the expert-scaling grid -> moe_scaling.json")
    parser.add_argument("--experts", type=int, nargs="+", default=None, help="--scaling: these expert counts")
    parser.add_argument("--top-k", type=int, nargs="+", default=None, help="--scaling: these top-k")
    parser.add_argument("--worlds", type=int, nargs="+", default=None, help="--scaling: these process counts")
    parser.add_argument("--steps", type=int, default=None, help="--scaling: timed steps per cell")
    parser.add_argument("--success", action="store_true",
                        help="only the MLP vs MoE success study (bootstrap + FERT rounds), no scaling grid")
    parser.add_argument("--workers", type=int, default=1, help="seeds run at once, one process each")
    parser.add_argument("--cells", type=Path, default=None,
                        help="keep each finished seed's scores here; a rerun skips them (a stopped study resumes)")
    parser.add_argument("--finished-only", action="store_true",
                        help="with --cells: run nothing, report the seeds the folder holds")
    args = parser.parse_args()
    torch.set_num_threads(1)  # one thread per process: on a busy 2-core machine threaded tiny ops stall
    if args.probe:
        settings = load_settings()
        seed = settings.seed if args.seed is None else args.seed
        settings = settings.model_copy(update={  # the plan and the validation side op change time, not weights
            "seed": seed,
            "scheduler": settings.scheduler.model_copy(update={"plan": "sequential"}),
            "train": settings.train.model_copy(update={"validation_robots": 0})})
        write({"probe": bootstrap_probe(settings), "policy": settings.policy.model_dump(),
               "demo": settings.demo.model_dump(), "train": settings.train.model_dump(), "seed": seed},
              "moe_policy_probe" if args.seed is None else f"moe_policy_probe_seed{seed}")
        return
    if args.scaling:
        grid = (QUICK_PLAN if args.quick else FULL).scaling
        overrides = {"experts": args.experts, "top_k": args.top_k, "worlds": args.worlds, "steps": args.steps}
        grid = replace(grid, **{k: tuple(v) if isinstance(v, list) else v for k, v in overrides.items() if v})
        run_scaling(grid, "moe_scaling_quick" if args.quick else "moe_scaling")
        return
    if args.finished_only and args.cells is None:
        parser.error("--finished-only reports what a --cells folder holds: give --cells DIR")
    command = "python -m benchmarks.moe_policy" + (" --quick" if args.quick else "") + (
        " --success" if args.success else "") + (f" --workers {args.workers}" if args.workers > 1 else "")
    run(QUICK_PLAN if args.quick else FULL, "moe_policy_quick" if args.quick else "moe_policy",
        workers=args.workers, cells=args.cells, scaling=not args.success, command=command,
        finished_only=args.finished_only)


if __name__ == "__main__":
    main()
