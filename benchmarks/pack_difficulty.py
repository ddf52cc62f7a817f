"""How hard is the pack task? The two difficulty criteria of components/sim/README.md ("pack"):

    python -m benchmarks.pack_difficulty                       # 3 seeds, ~4 min of one core
    python -m benchmarks.pack_difficulty --quick               # smoke run (~40 s), to pack_difficulty_quick.json
    python -m benchmarks.pack_difficulty --test-robots         # the same criteria on fresh test populations

1. The scripted expert on test robots (``heldout-*`` ids): ``--expert-robots`` x
   ``--expert-trials`` episodes; criterion >= 99%.
2. The initial BC policy, the product's bootstrap per seed: ``demo.expert_robots`` x
   ``demo.expert_episodes_per_robot`` scripted-expert demos on ``robot-*`` ids -> ingest -> BC with
   ``train:`` of params.yaml (``train.method: bc``, ``steps.train_policy``), evaluated thresholded
   (as deployed) on ``--robots`` held-out robots x ``--trials`` trials; criterion 55-75%, per seed
   and pooled.

Nothing here runs FERT, filtered BC or a fleet round. Writes benchmarks/results/pack_difficulty.json.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import tempfile
import time
from collections import Counter
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from benchmarks.fleet_scaling import finetune_config
from components.config import Settings, load_settings
from components.evaluation.intervals import wilson_interval
from components.evaluation.populations import check_reportable
from components.pipeline import steps
from components.pipeline.collect import collect_expert_demos
from components.pipeline.ingest import ingest_files
from components.policy.actor import PolicyActor
from components.sim.collect import run_episodes
from components.sim.factory import make_expert, make_thresholded, stages

RESULTS = Path(__file__).resolve().parent / "results" / "pack_difficulty.json"
EXPERT_SEED = 101  # the expert's trials: a stream of its own
EVAL_STREAM = 7919  # as benchmarks/fleet_scaling.py: evaluation trials apart from the demos' stream
SEED_STRIDE = 1000
EXPERT_TARGET = 0.99
BC_RANGE = (0.55, 0.75)


@dataclass(frozen=True)
class Rate:
    successes: int
    trials: int
    rate: float
    ci95: tuple[float, float]
    failures_by_stage: dict[str, int]


def rate_of(episodes, settings: Settings) -> Rate:
    wins = sum(e.success for e in episodes)
    ci = wilson_interval(wins, len(episodes), 0.95)
    names = stages(settings.sim)
    failed = Counter(names[e.stage_reached] for e in episodes if not e.success)
    return Rate(wins, len(episodes), wins / len(episodes), (ci.low, ci.high), dict(sorted(failed.items())))


def pack_settings(root: Path, seed: int) -> Settings:
    """params.yaml with ``sim.name: pack``, in its own product root; training as the bootstrap runs
    it in benchmarks/fleet_scaling.py (no validation rollouts, the sequential plan: same results)."""
    s = load_settings()
    return s.model_copy(update={
        "root": root, "seed": seed,
        "sim": s.sim.model_copy(update={"name": "pack", "task": "pack"}),
        "train": s.train.model_copy(update={"method": "bc", "validation_robots": 0}),
        "scheduler": s.scheduler.model_copy(update={"plan": "sequential"}),
    })


def scored_robots(settings: Settings, robots: int, test: bool) -> tuple[list[str], Settings]:
    """Who the criteria are measured on: ``heldout-*`` robots of population 0 (what the task was
    tuned on), or with ``test`` the study's test robots of a population drawn fresh for this seed
    (``fleet.test_population_seed(seed)``), refused unless they are test robots."""
    if not test:
        return settings.fleet.heldout_ids(robots), settings
    ids = settings.fleet.test_ids(robots)
    check_reportable(ids, settings.fleet)
    population = settings.fleet.test_population_seed(settings.seed)
    return ids, settings.model_copy(update={"sim": settings.sim.model_copy(update={"population_seed": population})})


def expert_rate(settings: Settings, robots: int, trials: int, test: bool = False) -> Rate:
    ids, scored = scored_robots(settings, robots, test)
    return rate_of(run_episodes(make_expert(scored.sim), ids, scored.sim, trials, EXPERT_SEED, "expert"), scored)


def bootstrap_policy(settings: Settings, train_steps: int | None = None) -> tuple[PolicyActor, dict]:
    """The product's bootstrap (scripted demos -> ingest -> BC with ``train:``) in the settings' root;
    ``train_steps``: about that many gradient steps instead (smoke runs)."""
    demos = collect_expert_demos(settings, settings.paths.incoming / "expert")
    ingest_files(settings, demos.files, snapshot=False)
    if train_steps is not None:
        settings = settings.model_copy(update={"train": finetune_config(settings, demos.env_steps, train_steps)})
    outcome = steps.train_policy(settings)
    info = {"demo_episodes": demos.episodes, "demo_success": demos.success_rate, "demo_frames": demos.env_steps,
            "train_frames": outcome.frames, "train_steps": outcome.result.steps,
            "final_loss": float(outcome.result.losses[-1])}
    return PolicyActor(outcome.result.policy), info


def bootstrap_bc_rate(settings: Settings, robots: int, trials: int, test: bool = False) -> tuple[Rate, dict]:
    """The product's bootstrap, then held-out trials, thresholded jaw."""
    policy, info = bootstrap_policy(settings)
    ids, scored = scored_robots(settings, robots, test)
    actor = make_thresholded(scored.sim, policy)
    seed = settings.seed * SEED_STRIDE + EVAL_STREAM
    episodes = run_episodes(actor, ids, scored.sim, trials, seed, "bc")
    return rate_of(episodes, settings), info


def pooled_rate(parts: list[Rate]) -> Rate:
    wins, trials = sum(p.successes for p in parts), sum(p.trials for p in parts)
    ci = wilson_interval(wins, trials, 0.95)
    stages_failed: Counter = Counter()
    for p in parts:
        stages_failed.update(p.failures_by_stage)
    return Rate(wins, trials, wins / trials, (ci.low, ci.high), dict(sorted(stages_failed.items())))


def commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--robots", type=int, default=16, help="held-out robots for the BC policy")
    parser.add_argument("--trials", type=int, default=25, help="trials per held-out robot for the BC policy")
    parser.add_argument("--expert-robots", type=int, default=32)
    parser.add_argument("--expert-trials", type=int, default=50)
    parser.add_argument("--out", type=Path, default=None, help=f"default {RESULTS}")
    parser.add_argument("--quick", action="store_true", help="1 seed, 8 robots x 8 trials, expert 8 x 10")
    parser.add_argument("--test-robots", action="store_true",
                        help="measure on each seed's fresh test population (test-* ids), to pack_difficulty_test.json;"
                             " the expert's trials are split over the seeds")
    args = parser.parse_args()
    if args.quick:
        args.seeds, args.robots, args.trials, args.expert_robots, args.expert_trials = 1, 8, 8, 8, 10
    default = RESULTS.with_name("pack_difficulty_test.json") if args.test_robots else RESULTS
    args.out = args.out or (default.with_name(default.stem + "_quick.json") if args.quick else default)
    torch.set_num_threads(1)
    started = time.perf_counter()
    scratch = Path(tempfile.mkdtemp(prefix="pack_difficulty_"))
    try:
        base = pack_settings(scratch / "expert", 0)
        if args.test_robots:  # one fresh test population per seed: the expert on each, pooled
            share = -(-args.expert_trials // args.seeds)
            parts = [expert_rate(pack_settings(scratch / "expert", seed), args.expert_robots, share, test=True)
                     for seed in range(args.seeds)]
            expert = pooled_rate(parts)
        else:
            expert = expert_rate(base, args.expert_robots, args.expert_trials)
        print(f"expert: {expert.rate:.2%} of {expert.trials} {expert.ci95}", flush=True)
        per_seed = []
        for seed in range(args.seeds):
            rate, info = bootstrap_bc_rate(pack_settings(scratch / f"seed-{seed}", seed), args.robots, args.trials,
                                           test=args.test_robots)
            per_seed.append({"seed": seed, **asdict(rate), **info})
            print(f"seed {seed}: initial BC {rate.rate:.2%} of {rate.trials} {rate.ci95} {rate.failures_by_stage}", flush=True)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    wins, trials = sum(r["successes"] for r in per_seed), sum(r["trials"] for r in per_seed)
    pooled = wilson_interval(wins, trials, 0.95)
    result = {
        "commit": commit(), "seconds": time.perf_counter() - started,
        "sim": base.sim.model_dump(), "train": base.train.model_dump(), "demo": base.demo.model_dump(),
        "plan": vars(args) | {"out": str(args.out)},
        "expert": asdict(expert), "initial_bc": {"per_seed": per_seed, "pooled": {
            "successes": wins, "trials": trials, "rate": wins / trials, "ci95": [pooled.low, pooled.high]}},
        "criteria": {
            "expert_at_least_99": expert.rate >= EXPERT_TARGET,
            "initial_bc_in_55_75_pooled": BC_RANGE[0] <= wins / trials <= BC_RANGE[1],
            "initial_bc_in_55_75_every_seed": all(BC_RANGE[0] <= r["rate"] <= BC_RANGE[1] for r in per_seed),
        },
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2, default=str) + "\n")
    print(json.dumps(result["criteria"]), f"pooled BC {wins / trials:.2%} [{pooled.low:.2%}, {pooled.high:.2%}]")


if __name__ == "__main__":
    main()
