"""Fleet scaling: does the shared policy get better from the fleet's own executions, and with more robots?

    python -m benchmarks.fleet_scaling                   # built-in pick-place task (9 seeds, ~45 min of one core)
    python -m benchmarks.fleet_scaling --sim pack        # the 7-stage pack task (4 seeds, ~45 min, 2 workers)
    python -m benchmarks.fleet_scaling --sim metaworld   # Meta-World pick-place-v3 (smaller plan, see PLANS)
    python -m benchmarks.fleet_scaling --cells DIR       # keep each finished cell and seed in DIR: a stopped run resumes
    python -m benchmarks.fleet_scaling --cells DIR --finished-only   # report the seeds DIR holds
    python -m benchmarks.fleet_scaling --sim pack --tuning --seeds 2 --fleet-sizes 96   # on tuning robots: to choose a setting
    python -m benchmarks.fleet_scaling --quick           # smoke run (< 1 min; --sim metaworld --quick ~1 min)
    python -m benchmarks.fleet_scaling --replot          # redraw PNG + docs section from the saved JSON

``--workers N`` runs N seeds at once, one process each (default: one per core); the figures do not
depend on it. A study longer than a session keeps its ``--cells`` folder's records (``seed-*.json``,
``cells-done/*.json``) in git: a fresh clone resumes at the next cell. The cells' final policies stay
on the machine that trained them (``.gitignore``); a report logs those it finds to MLflow.

Targets per task (``TARGETS``) are issue 16's, stated before the runs (docs/results.md). Sizes
(``PLANS``) are cut to fit the shared machine and written into the JSON. Built-in task: 9
seeds (3 until the FERT - filtered BC gap's interval was seen to straddle its target; seeds 0-1
chose the FERT settings, 2-8 never did) x 6 rounds of 1200 steps per robot, 16 held-out robots x 12
trials per seed, ablations (fert_uniform, fert_learned) at 96 robots on the first seed, 16
validation robots x 12 trials for per-round selection. Meta-World: 2 seeds x 1 round, 12 x 4
trials, no per-round selection, robots' action bias widened to 0.15 (at the default quirks BC from
the demos already solves 100% of held-out trials).

Protocol, one run per simulator (every figure of a run is measured side by side in that run):

1. Expert-supervised initialization: ``demo.expert_robots`` x ``demo.expert_episodes_per_robot``
   scripted-expert demos, BC with the project's bootstrap recipe (``train:`` of params.yaml).
2. CEL rounds for fleet sizes 1, 8, 32, 96: each round the current policy runs on the fleet for a
   fixed time per robot (``--steps-per-robot``; exploration: jaw sampled + ``sim.motion_noise_std``), the episodes go into
   a real LanceDB segment store, and the policy is fine-tuned *from the current one* on the
   method's training set for about ``--finetune-steps`` gradient steps (same budget for every
   method). The fine-tuned policy replaces the current one only if it succeeds at least as often
   on *validation* robots (``validation_robots`` x ``validation_trials``, the same trials for both;
   robots neither in the fleet nor held out), and the kept policy collects the next round. This is
   rollout-based checkpoint selection, as a fleet would do before shipping a round; it is looser than
   the registry's gate (a one-sided test per promotion), under which round-to-round gains of a few
   points at this trial count would rarely pass. ``--validation-robots 0`` keeps every round.
3. Methods: ``bc`` (expert demos only: it cannot use the fleet, so it is one line, trained with
   the same per-round budget), ``filtered_bc`` (all successes, uniform), ``fert`` (failure
   contexts of the round's failures -> retrieval -> priority weights -> pool mix), optionally
   ``fert_uniform`` (``--ablation``, largest fleet only).
4. Reported evaluation on *test* robots (``plan.heldout_robots`` of them, ``fleet.test_ids``) drawn
   fresh per seed from sim population ``fleet.test_population_seed(seed)``: never collected on,
   never used for a decision (the gate uses the validation robots; ``evaluate_test`` refuses any
   non-test robot). Thresholded jaw (the deployed policy; the headline) and sampled jaw. Primary
   intervals are seed-level (``by_fleet.<n>.seed_level``: FERT − filtered BC and FERT's step from the
   previous fleet size, paired t over seeds, hierarchical bootstrap over seeds then test robots,
   seeds needed at the observed variance); Wilson / Newcombe on pooled trials stay as a secondary
   column. Runs keep per-robot success counts. Results written before issue 16 were measured on
   the fixed ``heldout-0000..`` robots the settings had been tuned on.

Writes benchmarks/results/fleet_scaling_<sim>.json + .png and the ``## Fleet scaling (FERT)``
section of docs/results.md (other sections are left as they are). Every cell's final policy goes to
the root's MLflow (experiment ``fleet-scaling``, registered model ``fleet-scaling-policy``, tags task,
method, fleet_size, seed, population_seed, test_population_seed, commit; ``--no-log-models`` skips
it); each JSON run carries its ``model_uri`` for ``fleetloop evaluate``.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import platform
import shutil
import sys
import tempfile
import time
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor, as_completed
from dataclasses import asdict, dataclass, field, replace
from functools import partial
from pathlib import Path

import numpy as np
import torch

from components.config import Settings, load_settings
from components.evaluation.heldout import EvaluationReport
from components.evaluation.intervals import (
    SeedRobotOutcomes,
    difference_interval,
    hierarchical_bootstrap,
    paired_seed_interval,
    seeds_needed,
    wilson_interval,
)
from components.evaluation.populations import evaluate_test, evaluate_tuning
from components.fert.corpus import episode_infos
from components.fsio import atomic_write_text
from components.pipeline import loop
from components.pipeline.collect import CollectResult
from components.pipeline.evaluate import evaluate_policy
from components.pipeline.explain import explain_version
from components.pipeline.workspace import Workspace
from components.policy.actor import PolicyActor
from components.policy.normalizer import NormalizedPolicy
from components.registry.lineage import Lineage, git_commit
from components.registry.model_registry import PolicyRegistry
from components.sim.factory import make_exploration, make_thresholded

RESULTS = Path(__file__).resolve().parent / "results"
DOCS = Path(__file__).resolve().parent.parent / "docs" / "results.md"
SECTION = "## Fleet scaling (FERT)"
SECTION_INTRO = (
    "Does the shared policy get better from the fleet's own executions (binary outcome labels, no new "
    "expert data), and more so with more robots? Protocol: `benchmarks/fleet_scaling.py` (module doc)."
)
FLEET_METHODS = ("filtered_bc", "fert")
SEED_STRIDE = 1000  # keeps the streams of different seeds / rounds apart
EVAL_STREAM = 7919
VALIDATION_STREAM = 4099
EXPERIMENT = "fleet-scaling"  # the MLflow experiment holding every cell's final policy
MODEL_NAME = "fleet-scaling-policy"  # ... registered under this name: `fleetloop evaluate --model-uri models:/...`
GATE_ALPHA = 0.501  # the product gate then promotes a candidate that is not worse on the same validation trials (z >= ~0)


@dataclass(frozen=True)
class Plan:
    """Everything that sizes a run; written into the JSON."""

    sim: str
    seeds: int
    rounds: int
    fleet_sizes: tuple[int, ...]
    steps_per_robot: int
    finetune_steps: int
    heldout_robots: int
    trials_per_robot: int
    ablation: bool
    sim_overrides: dict = field(default_factory=dict)
    fert_overrides: dict = field(default_factory=dict)
    policy_overrides: dict = field(default_factory=dict)  # e.g. kind=vision (with sim cameras=[scene,gripper])
    methods: tuple[str, ...] = FLEET_METHODS
    max_epochs: int = 0  # cap on passes over a round's training set (0 = none): few frames, few steps
    # non-empty: every fert round of every cell writes the failure explorer (components/fert/explorer.py)
    # under <explain_dir>/<cell>/<round>; off by default (a few seconds of matplotlib per round)
    explain_dir: str = ""
    # each round's fine-tuned policy replaces the current one only if it succeeds at least as often on
    # validation robots (rollout-based selection); 0 robots = every round's policy is kept
    validation_robots: int = 16
    validation_trials: int = 12
    # the initial policy: the bootstrap recipe (train: of params.yaml), then up to this many rounds of
    # fine-tuning on the demos alone, each kept only if validation says so -- demos-only training run
    # until it stops paying, so that what the fleet rounds add is not simply more training
    init_rounds: int = 0
    # the study's seeds are first_seed .. first_seed + seeds - 1: a re-measurement after a change of
    # settings takes seeds no earlier run used, so its test populations (1000 + seed) are fresh too
    first_seed: int = 0
    # "test": figures on test robots (reported); "tuning": on tuning robots, the only figures a
    # setting may be chosen on (``--tuning``: its own JSON, no docs section, no models logged)
    robots: str = "test"

    @property
    def seed_ids(self) -> list[int]:
        return list(range(self.first_seed, self.first_seed + self.seeds))


# steps_per_robot: from b1d88c9 (2026-12-01, cells drive the product) until 2026-12-07 the cells collected
# fleet.steps_per_robot (params.yaml: 1200) and the plan's number (then 200) was only written into the
# JSON. Every pick-place and pack figure since was collected at 1200 steps per robot per round, so
# that is the plans' number now, and cell_settings applies it (journal 2026-12-07-camera-study-and-inference-tail)
PLANS = {
    "pickplace": Plan("pickplace", 9, 6, (1, 8, 32, 96), 1200, 600, 16, 12, True),
    # the multi-stage task (components/sim/pack.py); FERT settings frozen as params.yaml has them. Collection
    # noise 0.25 (params.yaml: 0.35, chosen on pick-place) was chosen on pack's tuning robots
    # (fleet_scaling_pack_tuning_*.json); seeds 4-7: seeds 0-3 (test populations 1000-1003) were measured
    # at 0.35 before that choice, so the re-measurement takes fresh test populations (1004-1007)
    "pack": Plan("pack", 4, 6, (1, 8, 32, 96), 1200, 600, 16, 12, False, {"motion_noise_std": 0.25}, first_seed=4),
    "metaworld": Plan("metaworld", 2, 1, (1, 8, 32, 96), 150, 300, 12, 4, False,
                      {"bias_spread": 0.15, "motion_noise_std": 0.0}, validation_robots=0),
}
QUICK = {
    "pickplace": Plan("pickplace", 1, 2, (1, 8), 200, 150, 8, 4, False, validation_robots=4, validation_trials=4),
    "metaworld": Plan("metaworld", 1, 1, (1, 4), 60, 60, 2, 2, False, validation_robots=2, validation_trials=2),
    "pack": Plan("pack", 1, 2, (1, 8), 200, 150, 8, 4, False, validation_robots=4, validation_trials=4),
}


@dataclass(frozen=True)
class Targets:
    """What a study must show (issue 16), stated before the run that tests it; every figure is the
    thresholded (deployed) policy on test robots, the gap at the largest fleet size."""

    initial: tuple[float, float]  # the initial (bootstrap) policy lands in this range
    fert_at_largest: float  # FERT at the largest fleet size at least this
    gap_points: float = 0.0  # FERT − filtered BC at least this many points ...
    residual_removed: float = 0.0  # ... and FERT removes at least this share of filtered BC's failures
    grows_from: int | None = None  # FERT's seed-level step is above 0 at every size after this one


TARGETS = {
    "pickplace": Targets((0.70, 0.85), 0.97, residual_removed=0.40),
    "pack": Targets((0.55, 0.75), 0.95, gap_points=3.0, grows_from=8),
    "metaworld": Targets((0.70, 0.85), 0.97, gap_points=3.0, grows_from=1),
}


@dataclass
class Score:
    """Test-robot result of one policy: thresholded (deployed) and sampled jaw, and the thresholded
    successes per test robot (the robot level of the hierarchical bootstrap)."""

    successes: int
    trials: int
    sampled_successes: int
    failures_by_stage: dict[str, int]
    successes_by_robot: dict[str, int] = field(default_factory=dict)
    trials_per_robot: int = 0
    population_seed: int = 0  # the sim population the test robots were drawn from

    @property
    def rate(self) -> float:
        return self.successes / self.trials

    @property
    def sampled_rate(self) -> float:
        return self.sampled_successes / self.trials


@dataclass
class RunRow:
    seed: int
    method: str
    fleet: int
    score: Score
    rounds: list[dict] = field(default_factory=list)
    seconds: float = 0.0
    policy_path: str = ""  # the cell's final policy (torch.save), until it is logged to MLflow
    lineage: Lineage | None = None  # of the cell's final champion (its registry goes with the cell)
    model_uri: str = ""  # models:/<MODEL_NAME>/<version> once logged


def log(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", flush=True)


# ------------------------------------------------------------------------------- the loop pieces
# Each (seed, method, fleet) cell is a product root of its own (dataset, segment store, registry),
# run through the loop the flows run (components/pipeline/loop.py: bootstrap, then fleet rounds of
# collect -> ingest -> train -> evaluate -> promote) with its plain steps. Only the grid, the seeds,
# the round budget, the final test-robot scoring and the report live here.
def evaluate(settings: Settings, plan: Plan, policy: NormalizedPolicy, seed: int) -> Score:
    """The reported figure: ``plan.heldout_robots`` *test* robots drawn fresh for this seed
    (population ``fleet.test_population_seed(seed)``), never collected on, never used for a decision;
    ``evaluate_test`` refuses any other robot. A tuning plan (``plan.robots == "tuning"``) scores on
    *tuning* robots of the sim's own population instead: the figures settings are chosen on."""
    eval_seed = seed * SEED_STRIDE + EVAL_STREAM
    actor = PolicyActor(policy)
    if plan.robots == "tuning":
        robots, population = settings.fleet.tuning_ids(plan.heldout_robots), settings.sim.population_seed
        scored_on = partial(evaluate_tuning, robot_ids=robots)
    else:
        robots, population = settings.fleet.test_ids(plan.heldout_robots), settings.fleet.test_population_seed(seed)
        scored_on = partial(evaluate_test, robot_ids=robots, population_seed=population)
    score = partial(scored_on, sim_cfg=settings.sim, fleet_cfg=settings.fleet, eval_cfg=settings.evaluation,
                    trials_per_robot=plan.trials_per_robot, seed=eval_seed, policy_version="eval")
    report = score(make_thresholded(settings.sim, actor))
    sampled = score(make_exploration(settings.sim, actor, eval_seed, motion=False))
    return Score(
        report.overall.successes, report.overall.trials, sampled.overall.successes, dict(report.failures_by_stage),
        {r: p.successes for r, p in report.by_robot.items()}, plan.trials_per_robot, population,
    )


def cell_settings(settings: Settings, plan: Plan, method: str, root: Path, seed: int) -> Settings:
    """A cell's product settings: its own root; the promotion gate evaluates on *validation* robots
    (``validation_robots`` x ``validation_trials``, never the test ones reported), and promotes a
    candidate that is not worse on the same trials (``registry.gate_alpha`` 0.5: one-sided z >= 0)."""
    fert = settings.fert.model_copy(update={"encoder": "learned"}) if method == "fert_learned" else settings.fert
    validation = max(plan.validation_robots, 1)
    return settings.model_copy(update={
        "root": root, "seed": seed, "fert": fert,
        "train": settings.train.model_copy(update={"method": "fert" if method == "fert_learned" else method,
                                                   "validation_robots": 0}),
        # the product gate evaluates fleet.heldout_ids(): in a cell those are the validation robots
        "fleet": settings.fleet.model_copy(update={"heldout_prefix": settings.fleet.validation_prefix,
                                                   "num_heldout_robots": validation,
                                                   "steps_per_robot": plan.steps_per_robot}),
        "evaluation": settings.evaluation.model_copy(update={"trials_per_robot": plan.validation_trials, "trials_per_task": 1}),
        "registry": settings.registry.model_copy(update={"gate_alpha": GATE_ALPHA if plan.validation_robots > 0 else 1.0}),
        "scheduler": settings.scheduler.model_copy(update={"plan": "sequential"}),
    })


def finetune_config(settings: Settings, frames: int, steps: int, max_epochs: int = 0):
    """Epochs so that one round is ~``steps`` gradient steps, but at most ``max_epochs`` passes over
    the round's ``frames`` (0 = no cap): a small fleet's few, noisy frames are not fitted 20 times over."""
    per_epoch = max(1, frames // settings.train.batch_size)
    epochs = max(1, round(steps / per_epoch))
    if max_epochs > 0:
        epochs = min(epochs, max_epochs)
    return settings.train.model_copy(update={"epochs": epochs})


def study_steps(cell: Settings, plan: Plan, budget_steps: int | None,
                validated: dict[int, EvaluationReport]) -> loop.FleetSteps[loop.Retrain]:
    """The loop's plain steps (``components/pipeline/loop.py``), with what the study sets:
    - no DVC snapshot per round (speed; the models are the same);
    - ``budget_steps`` not None: a round trains ~that many gradient steps on the stored successes
      (``finetune_config``), the same budget for every method;
    - the gate's champion evaluation is the champion's own report from the round that registered
      it (``validated``, by registry version): the cell's settings never change and
      ``evaluate_policy`` is seeded by them alone, so re-running it would give the same episodes
      (the flow re-evaluates because its champion may come from another run or code version)."""

    def budgeted(settings: Settings) -> Settings:
        stored = episode_infos(Workspace(settings).dataset)  # the episodes table alone
        frames = sum(info.length for _, info in stored if info.success)
        return settings.model_copy(update={"train": finetune_config(settings, frames, budget_steps, plan.max_epochs)})

    def evaluate(policy: NormalizedPolicy, version: str, settings: Settings) -> EvaluationReport:
        known = validated.get(int(version[1:])) if version.startswith("v") else None
        return known or evaluate_policy(settings, policy, version)

    return loop.plain_fleet_steps(loop.plain_retrain_steps(
        snapshot=False, evaluate=evaluate, configure=budgeted if budget_steps is not None else None))


def round_info(cell: Settings, plan: Plan, label: str, done: loop.Retrain,
               validated: dict[int, EvaluationReport]) -> dict:
    """What the study keeps of one retrain of the loop; its validation report goes into ``validated``
    (the gate's champion evaluation in later rounds) and, with ``plan.explain_dir``, a fert round's
    failure explorer is written (the cell's root is deleted after its last round)."""
    version, report, promotion = done.promotion.candidate, done.report, done.promotion
    validated[version.version] = report
    if plan.explain_dir and done.outcome.retrieval is not None:
        explain_version(cell, version.version, Path(plan.explain_dir) / cell.root.name / label)
    kept = report.overall.rate if promotion.decision.promote or promotion.champion_eval is None \
        else promotion.champion_eval["success_rate"]
    info = {"seconds": sum(done.seconds.values()), "ingest_seconds": done.seconds["ingest"],  # with the budget
            "train_steps": done.outcome.result.steps, "train_seconds": done.outcome.result.seconds,
            "validation": report.overall.rate, "accepted": promotion.decision.promote,
            "validation_kept": kept, "version": version.version}
    if done.ingested is not None:
        info["episodes_added"] = len(done.ingested.report.added)
    # what the cell keeps on disk after this round: the episode dataset (tables + camera videos) and
    # the segment store (the cell's root is deleted after its last round, so it is counted here)
    info["stored_bytes"] = {"episodes": tree_bytes(cell.paths.episodes), "store": tree_bytes(cell.paths.store)}
    summary = done.outcome.summary
    if summary is not None and summary.method.startswith("fert"):
        info.update({k: summary.fert.get(k) for k in ("queries", "matches", "matched_robots", "retrieved_frames",
                                                       "retrieved_mass", "sigma", "fallback_rate")})
    return info


def tree_bytes(folder: Path) -> int:
    """Bytes of every file under ``folder`` (0 when it does not exist)."""
    return sum(f.stat().st_size for f in folder.rglob("*") if f.is_file()) if folder.exists() else 0


def bootstrap_cell(cell: Settings, plan: Plan, validated: dict[int, EvaluationReport]) -> tuple[CollectResult, loop.Retrain]:
    """The product's bootstrap in the cell's root: scripted-expert demos -> the first champion
    (BC on the demos with train: of params.yaml), then ``plan.init_rounds`` demos-only retrains
    through the gate. The same in every cell of a seed (deterministic), so every method starts
    from one policy."""
    boot = cell.model_copy(update={"train": cell.train.model_copy(update={"method": "bc"})})
    first_steps = study_steps(boot, plan, None, validated)
    later = study_steps(boot, plan, plan.finetune_steps, validated)
    rounds = loop.campaign(boot, plan.init_rounds, lambda s: loop.bootstrap(s, first_steps),
                           lambda s, r: loop.stored_data_round(s, r, later, "init"))
    demos, first = next(rounds)[1:]
    round_info(boot, plan, "bootstrap", first, validated)
    for r, _, done in rounds:
        round_info(boot, plan, f"init-{r}", done, validated)
    return demos, first


def cell_root(scratch: Path, seed: int, method: str, fleet: int) -> Path:
    return scratch / f"cell-{seed}-{method}-{fleet}"


def run_study_cell(settings: Settings, plan: Plan, method: str, fleet: int, seed: int, scratch: Path,
            keep_root: bool = False) -> tuple[RunRow, Score]:
    """``plan.rounds`` CEL rounds of ``method`` on ``fleet`` robots in a fresh product root: the loop's
    campaign, each round a fleet round (``bc``: a demos-only retrain, the same budget, no fleet data).
    ``keep_root``: leave the root (``cell_root``) for a diagnostic to retrain from its data."""
    start = time.perf_counter()
    root = cell_root(scratch, seed, method, fleet)
    shutil.rmtree(root, ignore_errors=True)  # a stopped run's half-done cell (--cells): start it afresh
    cell = cell_settings(settings, plan, method, root, seed)
    validated: dict[int, EvaluationReport] = {}
    fleet_steps = study_steps(cell, plan, plan.finetune_steps, validated)

    def one_round(s: Settings, r: int) -> tuple[CollectResult | None, loop.Retrain]:
        if method == "bc":
            return loop.stored_data_round(s, r, fleet_steps)
        return loop.fleet_round(s, r, fleet, fleet_steps)

    rounds, initial = [], None
    for r, got, done in loop.campaign(cell, plan.rounds, lambda s: bootstrap_cell(s, plan, validated), one_round):
        if r == 0:  # the bootstrap champion on the test robots, before any round
            registry = Workspace(cell).registry
            initial = evaluate(settings, plan, registry.load("champion"), seed)
            continue
        collected = {} if got is None else {"episodes": got.episodes, "collected_success": got.success_rate,
                                            "failed": got.episodes - got.successes}
        rounds.append({"round": r, **collected, **round_info(cell, plan, f"round-{r}", done, validated)})
        log(f"seed {seed}: {method}/{fleet} round {r}/{plan.rounds}: validation {rounds[-1]['validation']:.1%} "
            f"({'kept' if rounds[-1]['accepted'] else 'not kept'}), {time.perf_counter() - start:.0f}s into the cell")
    final = registry.champion()
    policy = registry.load(final.version)
    score = evaluate(settings, plan, policy, seed)
    saved = scratch / "policies" / f"{seed}-{method}-{fleet}.pt"
    saved.parent.mkdir(parents=True, exist_ok=True)
    torch.save(policy, saved)
    if not keep_root:
        shutil.rmtree(root, ignore_errors=True)
    return RunRow(seed, method, fleet, score, rounds, time.perf_counter() - start, str(saved), final.lineage), initial


# ------------------------------------------------------------------------------- the run
def run(plan: Plan, out_name: str, workers: int = 1, settings: Settings | None = None, log_models: bool = True,
        cells: Path | None = None, finished_only: bool = False, command: str = "") -> dict:
    """Every seed of ``plan`` (``workers`` > 1: that many seeds at once, one process and one torch
    thread each; a seed's figures do not depend on which process ran it), then every cell's final
    policy to MLflow (``log_models``; the root's store), then the JSON + PNG.

    ``cells``: a folder that keeps each seed's results (and final policies) as the seed finishes;
    seeds already there are not run again, so a stopped study resumes; a seed kept by a plan with
    other fleet sizes or methods (``kept_seed``) runs again for the cells it lacks. ``finished_only``: run
    nothing, report the seeds the folder holds (the JSON's ``seeds_reported`` says which)."""
    torch.set_num_threads(1)
    settings = plan_settings(plan, settings)
    scratch = cells or Path(tempfile.mkdtemp(prefix="fleet_scaling_"))
    scratch.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    todo = [] if finished_only else [s for s in plan.seed_ids if kept_seed(scratch, s, plan) is None]
    try:
        for seed, done in run_seeds(settings, plan, todo, scratch, workers):
            seed_file(scratch, seed).write_text(json.dumps(_seed_json(done), indent=1) + "\n")
        kept = {s: kept_seed(scratch, s, plan) for s in plan.seed_ids}
        seeds = [s for s in plan.seed_ids if kept[s] is not None]
        if not seeds:
            raise SystemExit(f"{scratch} holds no finished seed of this plan: nothing to report")
        per_seed = [kept[s] for s in seeds]
        rows = [row for _, seed_rows in per_seed for row in seed_rows]
        if log_models:
            log_cell_policies(settings, plan, rows)
    finally:
        if cells is None:
            shutil.rmtree(scratch, ignore_errors=True)
    initial = [score for score, _ in per_seed]
    result = summarize_run(plan, settings, rows, initial, time.perf_counter() - started, min(workers, plan.seeds),
                           initial_seeds=seeds)
    result["seeds_reported"] = seeds
    if command:
        result["command"] = command
    write_outputs(result, out_name)
    return result


def run_seeds(settings: Settings, plan: Plan, seeds: list[int], scratch: Path, workers: int,
              job: Callable[[Settings, Plan, int, Path], object] | None = None):
    """(seed, ``job(settings, plan, seed, scratch)``) as each seed finishes (``job``: ``run_seed``
    unless given; a module-level function, so a spawned worker can import it)."""
    job = job or run_seed
    if min(workers, len(seeds)) > 1:
        context = multiprocessing.get_context("spawn")  # LanceDB and torch state do not survive a fork
        with ProcessPoolExecutor(min(workers, len(seeds)), mp_context=context) as pool:
            futures = {pool.submit(job, settings, plan, seed, scratch): seed for seed in seeds}
            for future in as_completed(futures):
                yield futures[future], future.result()
    else:
        for seed in seeds:
            yield seed, job(settings, plan, seed, scratch)


def seed_file(folder: Path, seed: int) -> Path:
    return folder / f"seed-{seed}.json"


def study_cells(plan: Plan, seed: int) -> list[tuple[str, int]]:
    """The (method, fleet) cells a seed of ``plan`` runs beside its bc line, in run order."""
    cells = [(m, n) for n in plan.fleet_sizes for m in plan.methods]
    if plan.ablation and seed == 0:  # ablations: largest fleet, first seed only (time)
        cells += [("fert_uniform", plan.fleet_sizes[-1]), ("fert_learned", plan.fleet_sizes[-1])]
    return cells


def kept_seed(folder: Path, seed: int, plan: Plan) -> tuple[Score, list[RunRow]] | None:
    """The seed's kept results, restricted to ``plan``'s cells; None when the folder's seed file is
    missing or lacks one of them: a seed kept by a plan with other fleet sizes or methods (the pack
    study ran its 96-robot cells first) runs again, and its finished cells are read back."""
    path = seed_file(folder, seed)
    if not path.exists():
        return None
    initial, rows = _seed_from_json(json.loads(path.read_text()))
    wanted = {*study_cells(plan, seed), *(("bc", n) for n in plan.fleet_sizes)}  # the rows run_seed keeps
    rows = [r for r in rows if (r.method, r.fleet) in wanted]
    return (initial, rows) if {(r.method, r.fleet) for r in rows} == wanted else None


def _seed_json(done: tuple[Score, list[RunRow]]) -> dict:
    initial, rows = done
    return {"initial": asdict(initial), "rows": [asdict(row) for row in rows]}


def _seed_from_json(data: dict) -> tuple[Score, list[RunRow]]:
    rows = []
    for row in data["rows"]:
        lineage = row.pop("lineage")
        rows.append(RunRow(**{**row, "score": Score(**row["score"]),
                              "lineage": Lineage(**lineage) if lineage is not None else None}))
    return Score(**data["initial"]), rows


def log_cell_policies(settings: Settings, plan: Plan, rows: list[RunRow]) -> None:
    """Every cell's final policy into the root's MLflow (experiment ``EXPERIMENT``, registered as
    ``MODEL_NAME``), tagged task / method / fleet size / seed / population seeds / commit, so anyone
    can re-check a figure on robots nobody has seen: ``fleetloop evaluate --model-uri <row.model_uri>``.
    In the main process, after the seeds: one writer to the store. The ``bc`` cell is logged once.
    A cell finished on another machine (its record committed, its policy file not: ``.gitignore``)
    is reported without a model URI, and named here."""
    away = sorted({row.policy_path for row in rows if not Path(row.policy_path).exists()})
    if away:
        log(f"{len(away)} cell policies were kept on another machine and are not logged: {', '.join(away)}")
    rows = [row for row in rows if row.policy_path not in away]
    registry = PolicyRegistry(settings.paths.mlruns, settings.registry.model_copy(
        update={"experiment": EXPERIMENT, "model_name": MODEL_NAME}))
    commit = git_commit(Path(__file__).resolve().parent)
    logged: dict[str, str] = {}
    for row in rows:
        if row.policy_path not in logged:
            score = row.score
            p = wilson_interval(score.successes, score.trials, settings.evaluation.confidence)
            evaluation = {"success_rate": p.rate, "ci_low": p.low, "ci_high": p.high, "successes": p.successes,
                          "trials": p.trials, "sampled_success_rate": score.sampled_rate,
                          "successes_by_robot": score.successes_by_robot, "robots": "test"}
            tags = {"task": settings.sim.task, "sim": plan.sim, "method": row.method, "fleet_size": str(row.fleet),
                    "seed": str(row.seed), "population_seed": str(settings.sim.population_seed),
                    "test_population_seed": str(score.population_seed), "commit": commit}
            version = registry.log_candidate(
                torch.load(row.policy_path, weights_only=False), evaluation,
                row.lineage or Lineage(commit, "", -1, "", 0, 0), {"plan": asdict(plan)},
                {"test_success_rate": score.rate, "test_sampled_success_rate": score.sampled_rate}, [],
                f"{plan.sim}-{row.method}-{row.fleet}-seed{row.seed}", tags)
            logged[row.policy_path] = version.uri
        row.model_uri = logged[row.policy_path]


def plan_settings(plan: Plan, base: Settings | None = None) -> Settings:
    """params.yaml (or ``base``) with the plan's simulator and its sim / FERT / policy overrides."""
    settings = base or load_settings()
    settings = settings.model_copy(update={
        "sim": settings.sim.overridden({"name": plan.sim, **plan.sim_overrides}, "--sim-set"),
        "fert": settings.fert.overridden(plan.fert_overrides, "--fert-set"),
        "policy": settings.policy.overridden(plan.policy_overrides, "--policy-set"),
    })
    task = {"metaworld": {"task": "pick-place-v3", "max_steps": 150}, "pack": {"task": "pack"}}.get(plan.sim)
    if task:
        settings = settings.model_copy(update={"sim": settings.sim.model_copy(update=task)})
    return settings


def cell_file(scratch: Path, seed: int, method: str, fleet: int | str) -> Path:
    """Where a finished cell is kept (``fleet="*"``: the glob pattern of the method's cells of the seed)."""
    return scratch / "cells-done" / f"seed-{seed}-{method}-{fleet}.json"


def finished_study_cell(settings: Settings, plan: Plan, method: str, fleet: int, seed: int, scratch: Path
                     ) -> tuple[RunRow, Score]:
    """``run_study_cell``, kept in ``scratch`` as it finishes: a cell already there is read back, not run again,
    so a study stopped inside a seed (a camera seed is hours of one core) resumes at its next cell."""
    done = cell_file(scratch, seed, method, fleet)
    if done.exists():
        initial, (row,) = _seed_from_json(json.loads(done.read_text()))
        log(f"seed {seed}: {method}/{fleet} finished earlier ({done}): read back")
        return row, initial
    row, initial = run_study_cell(settings, plan, method, fleet, seed, scratch)
    done.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_text(done, json.dumps(_seed_json((initial, [row])), indent=1) + "\n")  # a kill leaves no half cell
    return row, initial


def bc_fleet(scratch: Path, seed: int, plan: Plan) -> int:
    """The fleet size the seed's bc cell is kept under: bc never sees the fleet, so a bc cell an
    earlier plan of this folder finished is read back under its own size; else the plan's first."""
    pattern = cell_file(scratch, seed, "bc", "*")
    kept = sorted(_seed_from_json(json.loads(p.read_text()))[1][0].fleet for p in pattern.parent.glob(pattern.name))
    return kept[0] if kept else plan.fleet_sizes[0]


def run_seed(settings: Settings, plan: Plan, seed: int, scratch: Path) -> tuple[Score, list[RunRow]]:
    """One seed of the study: the ``bc`` line and every (method, fleet) cell, each from the same bootstrap."""
    torch.set_num_threads(1)
    rows: list[RunRow] = []
    bc, initial = finished_study_cell(settings, plan, "bc", bc_fleet(scratch, seed, plan), seed, scratch)
    rows += [replace(bc, fleet=fleet) for fleet in plan.fleet_sizes]
    log(f"seed {seed}: initial policy {initial.rate:.1%} on {plan.robots} robots (sampled {initial.sampled_rate:.1%}); "
        f"bc (demos only) {bc.score.rate:.1%}")
    for method, fleet in study_cells(plan, seed):
        row, start = finished_study_cell(settings, plan, method, fleet, seed, scratch)
        if (start.successes, start.trials) != (initial.successes, initial.trials):
            raise RuntimeError(f"seed {seed}: cell {method}/{fleet} bootstrapped a different policy than the bc cell; "
                               "the bootstrap must be deterministic")
        rows.append(row)
        last = row.rounds[-1]
        log(f"seed {seed}: {method:12s} fleet {fleet:3d}: {row.score.rate:.1%} on {plan.robots} robots "
            f"(sampled {row.score.sampled_rate:.1%}); last round collected {last['collected_success']:.1%} "
            f"of {last['episodes']} episodes; {row.seconds:.0f}s")
    return initial, rows


# ------------------------------------------------------------------------------- reporting
def pooled(scores: list[Score], confidence: float, sampled: bool = False) -> dict:
    successes = sum(s.sampled_successes if sampled else s.successes for s in scores)
    trials = sum(s.trials for s in scores)
    p = wilson_interval(successes, trials, confidence)
    per_seed = [(s.sampled_rate if sampled else s.rate) for s in scores]
    return {
        "rate": p.rate, "ci_low": p.low, "ci_high": p.high, "successes": successes, "trials": trials,
        "per_seed": per_seed, "seed_min": min(per_seed), "seed_max": max(per_seed),
        "seed_std": float(np.std(per_seed, ddof=1)) if len(per_seed) > 1 else 0.0,
    }


def summarize_run(
    plan: Plan, settings: Settings, rows: list[RunRow], initial: list[Score], seconds: float, workers: int = 1,
    initial_seeds: list[int] | None = None,
) -> dict:
    """The run's JSON; ``initial_seeds``: the seed of each ``initial`` score (adds FERT − initial per fleet size)."""
    conf = settings.evaluation.confidence
    methods = sorted({r.method for r in rows}, key=["bc", "filtered_bc", "fert", "fert_uniform", "fert_learned"].index)
    table = {}
    for method in methods:
        for fleet in plan.fleet_sizes:
            scores = [r.score for r in rows if r.method == method and r.fleet == fleet]
            if scores:
                table.setdefault(method, {})[str(fleet)] = {
                    "thresholded": pooled(scores, conf), "sampled": pooled(scores, conf, sampled=True),
                    "failures_by_stage": _sum_dicts([s.failures_by_stage for s in scores]),
                }
    init = pooled(initial, conf)
    start_rows = [RunRow(seed, "initial", n, score) for seed, score in zip(initial_seeds or [], initial)
                  for n in plan.fleet_sizes]
    by_fleet = seed_level(rows + start_rows, plan.fleet_sizes, settings)
    targets = study_targets(TARGETS[plan.sim], table, by_fleet, init, plan.fleet_sizes, conf)
    return {
        "benchmark": "fleet_scaling",
        "plan": asdict(plan),
        "settings": {
            "sim": settings.sim.model_dump(mode="json"), "train": settings.train.model_dump(mode="json"),
            "policy": settings.policy.model_dump(mode="json"), "fert": settings.fert.model_dump(mode="json"),
            "store": {"window": settings.store.window, "stride": settings.store.stride, "metric": settings.store.metric},
            "demo": settings.demo.model_dump(mode="json"),
        },
        "machine": {"platform": platform.platform(), "cpus": os.cpu_count(), "torch_threads": torch.get_num_threads(),
                    "workers": workers,
                    "load_avg_end": os.getloadavg()},
        "seconds": seconds,
        "initial": {"thresholded": init, "sampled": pooled(initial, conf, sampled=True)},
        "results": table,
        "by_fleet": by_fleet,
        "scored_on": plan.robots,  # test robots (reported) or tuning robots (settings chosen on them)
        "test_population_seeds": [s.population_seed for s in initial],
        "targets": targets,
        "runs": [
            {"seed": r.seed, "method": r.method, "fleet": r.fleet, "rate": r.score.rate, "sampled_rate": r.score.sampled_rate,
             "trials": r.score.trials, "test_population_seed": r.score.population_seed,
             "trials_per_robot": r.score.trials_per_robot, "successes_by_robot": r.score.successes_by_robot,
             "model_uri": r.model_uri,
             "seconds": r.seconds, "rounds": r.rounds}
            for r in rows
        ],
    }


def seed_level(rows: list[RunRow], fleet_sizes, settings: Settings) -> dict:
    """Per fleet size, the method differences with seeds as the unit (both methods of a seed share
    its bootstrap and test robots: paired): FERT − filtered BC, and FERT's step from the previous
    fleet size, and (rows of method ``initial``: each seed's bootstrap policy) FERT − the initial policy.
    Points; ``ci95`` is the paired t-interval over seeds (None with one seed), ``bootstrap_ci95`` the
    hierarchical bootstrap over seeds then test robots."""
    out: dict[str, dict] = {}
    for i, n in enumerate(fleet_sizes):
        comparisons = {"fert_minus_filtered_bc": (("fert", n), ("filtered_bc", n)),
                       "fert_minus_initial": (("fert", n), ("initial", n))}
        if i > 0:
            comparisons["fert_step_from_previous_fleet"] = (("fert", n), ("fert", fleet_sizes[i - 1]))
        level = {name: _seed_difference(rows, a, b, settings) for name, (a, b) in comparisons.items()}
        level = {name: d for name, d in level.items() if d is not None}
        if level:
            out[str(n)] = {"seed_level": level}
    return out


def _seed_difference(rows: list[RunRow], a: tuple[str, int], b: tuple[str, int], settings: Settings) -> dict | None:
    """``a`` − ``b`` over the seeds that ran both cells, in points (None when no seed ran both)."""
    def by_seed(method: str, fleet: int) -> dict[int, Score]:
        return {r.seed: r.score for r in rows if r.method == method and r.fleet == fleet}

    sa, sb = by_seed(*a), by_seed(*b)
    seeds = sorted(set(sa) & set(sb))
    if not seeds:
        return None
    ev = settings.evaluation
    gap = paired_seed_interval([sa[s].rate for s in seeds], [sb[s].rate for s in seeds], ev.confidence)
    low, high = hierarchical_bootstrap([_outcomes(sa[s]) for s in seeds], [_outcomes(sb[s]) for s in seeds],
                                       ev.bootstrap_resamples, settings.seed, ev.confidence)
    return {
        "a": f"{a[0]}@{a[1]}", "b": f"{b[0]}@{b[1]}", "unit": "points", "seeds": seeds,
        "per_seed": [100 * d for d in gap.differences], "mean": 100 * gap.mean, "sd": 100 * gap.sd,
        "ci95": None if gap.seeds < 2 else [100 * gap.low, 100 * gap.high],
        "bootstrap_ci95": [100 * low, 100 * high],
        "seeds_needed": seeds_needed(gap.sd, gap.mean, ev.confidence, ev.power) if gap.seeds > 1 else None,
        "confidence": ev.confidence, "power": ev.power,
    }


def _outcomes(score: Score) -> SeedRobotOutcomes:
    return SeedRobotOutcomes(tuple(score.successes_by_robot[r] for r in sorted(score.successes_by_robot)),
                             score.trials_per_robot)


def study_targets(criteria: Targets, table: dict, by_fleet: dict, init: dict, fleet_sizes, conf: float) -> dict:
    """Each criterion of ``criteria`` against the run: figures, and whether each holds. A gap target
    holds only when its seed-level interval is above 0 too; growth needs every step's seed-level
    mean above 0 (the intervals are reported beside it). Empty without both fleet methods."""
    largest = str(fleet_sizes[-1])
    if largest not in table.get("fert", {}) or largest not in table.get("filtered_bc", {}):
        return {}
    fert, fbc = table["fert"][largest]["thresholded"]["rate"], table["filtered_bc"][largest]["thresholded"]["rate"]
    gap = by_fleet[largest]["seed_level"]["fert_minus_filtered_bc"]
    above_0 = gap["ci95"] is not None and gap["ci95"][0] > 0
    removed = (fert - fbc) / (1.0 - fbc) if fbc < 1.0 else 0.0
    steps = {str(n): by_fleet[str(n)]["seed_level"]["fert_step_from_previous_fleet"]["mean"] for n in fleet_sizes[1:]}
    judged = [steps[str(n)] for n in fleet_sizes[1:] if criteria.grows_from is not None and n > criteria.grows_from]
    return {
        "criteria": asdict(criteria),
        "initial_in_range": criteria.initial[0] <= init["rate"] <= criteria.initial[1],
        "fert_largest_fleet_rate": fert,
        "fert_largest_fleet_meets": fert >= criteria.fert_at_largest,
        "fert_minus_filtered_bc_points": 100 * (fert - fbc),
        "residual_failures_removed": removed,
        "fert_minus_filtered_bc_seed_level_above_0": above_0,
        "gap_meets": above_0 and 100 * (fert - fbc) >= criteria.gap_points and removed >= criteria.residual_removed,
        "fert_step_means_points": steps,
        "fert_grows_with_fleet": None if criteria.grows_from is None else bool(judged) and all(v > 0 for v in judged),
        **interval_targets(table, fleet_sizes, conf),
    }


def interval_targets(table: dict, fleet_sizes, confidence: float) -> dict:
    """Newcombe intervals of the differences the targets compare (pooled trials; the seed spread
    is in the table): FERT − filtered BC at the largest fleet, and FERT's step between fleet sizes."""
    fert = table["fert"]
    return {
        "fert_minus_filtered_bc_ci_points": _difference_points(
            fert[str(fleet_sizes[-1])], table["filtered_bc"][str(fleet_sizes[-1])], confidence),
        "fert_growth_steps_ci_points": {
            f"{a}->{b}": _difference_points(fert[str(b)], fert[str(a)], confidence)
            for a, b in zip(fleet_sizes, fleet_sizes[1:], strict=False)
        },
    }


def _difference_points(a: dict, b: dict, confidence: float) -> list[float]:
    """[difference, low, high] in points of ``a`` − ``b`` (thresholded), Newcombe's interval."""
    d = difference_interval(*(wilson_interval(c["thresholded"]["successes"], c["thresholded"]["trials"], confidence)
                              for c in (a, b)))
    return [100 * d.value, 100 * d.low, 100 * d.high]


def _sum_dicts(dicts: list[dict[str, int]]) -> dict[str, int]:
    out: dict[str, int] = {}
    for d in dicts:
        for k, v in d.items():
            out[k] = out.get(k, 0) + v
    return out


def write_outputs(result: dict, out_name: str) -> None:
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / f"{out_name}.json").write_text(json.dumps(result, indent=2) + "\n")
    plot(result, RESULTS / f"{out_name}.png")
    log(f"wrote {RESULTS / (out_name + '.json')} and .png")


def plot_seed_gap(ax, result: dict) -> None:
    """FERT − filtered BC per seed (thresholded), paired over seeds: the unit the targets are judged on."""
    fleets = [n for n in result["plan"]["fleet_sizes"]
              if "fert_minus_filtered_bc" in result.get("by_fleet", {}).get(str(n), {}).get("seed_level", {})]
    for i, n in enumerate(fleets):
        gap = result["by_fleet"][str(n)]["seed_level"]["fert_minus_filtered_bc"]
        ax.scatter([i] * len(gap["per_seed"]), gap["per_seed"], s=10, color="tab:red", alpha=0.4)
        for dx, key, marker, color, what in ((-0.12, "ci95", "o", "black", "paired t"),
                                             (0.12, "bootstrap_ci95", "s", "tab:gray", "hierarchical bootstrap")):
            lo, hi = gap.get(key) or (gap["mean"], gap["mean"])  # one seed: no interval
            ax.errorbar([i + dx], [gap["mean"]], yerr=[[gap["mean"] - lo], [hi - gap["mean"]]], marker=marker,
                        capsize=4, color=color, label=f"mean, {what} 95% CI" if i == 0 else None)
    ax.axhline(0, color="black", lw=1)
    target = (result.get("targets") or {}).get("criteria", {}).get("gap_points") or 0
    if target:
        ax.axhline(target, color="tab:red", ls="--", lw=1, label=f"target ≥ +{target:.0f} pts")
    ax.set_xticks(range(len(fleets)), [str(n) for n in fleets])
    ax.set_xlim(-0.5, len(fleets) - 0.5)
    ax.set_xlabel("robots collecting")
    ax.set_ylabel("FERT − filtered BC, points (dots = seeds)")
    ax.set_title("the gap by seed, thresholded jaw")
    ax.grid(alpha=0.3)
    if fleets:
        ax.legend(fontsize=8, loc="upper left")


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fleets = result["plan"]["fleet_sizes"]
    tuning = result.get("scored_on") == "tuning"
    who = "tuning robots (population 0)" if tuning else "test robots (fresh per seed)"
    fig = plt.figure(figsize=(17, 4.5))
    axes = [fig.add_subplot(1, 3, 1)]
    axes.append(fig.add_subplot(1, 3, 2, sharey=axes[0]))
    colors = {"bc": "tab:gray", "filtered_bc": "tab:blue", "fert": "tab:red", "fert_uniform": "tab:orange", "fert_learned": "tab:purple"}
    for ax, mode in zip(axes, ("thresholded", "sampled"), strict=True):
        init = result["initial"][mode]
        ax.axhline(100 * init["rate"], color="black", ls=":", lw=1, label=f"initial BC ({100 * init['rate']:.1f}%)")
        for method, by_fleet in result["results"].items():
            xs = [n for n in fleets if str(n) in by_fleet]
            ys = np.array([100 * by_fleet[str(n)][mode]["rate"] for n in xs])
            lo = np.array([100 * by_fleet[str(n)][mode]["ci_low"] for n in xs])
            hi = np.array([100 * by_fleet[str(n)][mode]["ci_high"] for n in xs])
            offset = {"bc": 0.97, "filtered_bc": 0.99, "fert": 1.01, "fert_uniform": 1.03, "fert_learned": 1.05}[method]
            xo = np.array(xs) * offset
            ax.errorbar(xo, ys, yerr=[ys - lo, hi - ys], marker="o", capsize=3, color=colors[method], label=method,
                        ls="-" if len(xs) > 1 else "none")
            for n, x in zip(xs, xo, strict=True):
                seeds = by_fleet[str(n)][mode]["per_seed"]
                ax.scatter([x] * len(seeds), [100 * s for s in seeds], s=8, color=colors[method], alpha=0.4)
        if len(fleets) > 1:
            ax.set_xscale("log")
        else:  # one fleet size: the methods side by side around it
            ax.set_xlim(fleets[0] * 0.9, fleets[0] * 1.1)
        ax.set_xticks(fleets, [str(n) for n in fleets])
        ax.minorticks_off()
        ax.set_xlabel("robots collecting (fixed time per robot)")
        ax.set_title(f"{'tuning' if tuning else 'test'}-robot success, {mode} jaw")
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("success % (Wilson 95% CI; dots = seeds)")
    axes[0].legend(fontsize=8, loc="lower left")
    plot_seed_gap(fig.add_subplot(1, 3, 3), result)
    plan = result["plan"]
    fig.suptitle(f"{plan['sim']}: {plan['rounds']} CEL rounds, {len(result.get('seeds_reported', range(plan['seeds'])))} seeds, "
                 f"{plan['heldout_robots']} {who} x {plan['trials_per_robot']} trials per seed"
                 + (f"; {plan['finetune_steps']} fine-tuning steps per round" if tuning else ""))
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


# ------------------------------------------------------------------------------- CLI
def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sim", choices=sorted(PLANS), default="pickplace")
    parser.add_argument("--quick", action="store_true", help="small smoke run")
    parser.add_argument("--seeds", type=int)
    parser.add_argument("--first-seed", type=int, help="seeds first..first+seeds-1 (a re-measurement takes unused "
                                                       "seeds: fresh test populations)")
    parser.add_argument("--tuning", action="store_true",
                        help="score on tuning robots (the only figures a setting may be chosen on): writes "
                             "fleet_scaling_<sim>_tuning.json, no docs section, no models logged")
    parser.add_argument("--rounds", type=int)
    parser.add_argument("--fleet-sizes", type=int, nargs="+")
    parser.add_argument("--steps-per-robot", type=int)
    parser.add_argument("--finetune-steps", type=int)
    parser.add_argument("--max-epochs", type=int, help="cap on passes over a round's training set (0 = none)")
    parser.add_argument("--heldout-robots", type=int,
                        help="test robots per seed (drawn fresh per seed); with --tuning, the tuning robots scored "
                             "(tuning-0000..0015 are easier than a typical population: pack_initial_variance)")
    parser.add_argument("--validation-robots", type=int, help="robots for per-round selection (0 = keep every round)")
    parser.add_argument("--validation-trials", type=int, help="trials per validation robot")
    parser.add_argument("--init-rounds", type=int, help="demos-only rounds (with validation selection) after the bootstrap")
    parser.add_argument("--trials-per-robot", type=int)
    parser.add_argument("--no-ablation", action="store_true")
    parser.add_argument("--sim-set", nargs="*", default=[], metavar="KEY=VALUE", help="override sim: fields")
    parser.add_argument("--fert-set", nargs="*", default=[], metavar="KEY=VALUE", help="override fert: fields")
    parser.add_argument("--policy-set", nargs="*", default=[], metavar="KEY=VALUE",
                        help="override policy: fields (cameras: --sim-set 'cameras=[\"scene\",\"gripper\"]' --policy-set kind=vision)")
    parser.add_argument("--methods", nargs="+", help="fleet methods (default filtered_bc fert)")
    parser.add_argument("--workers", type=int, default=os.cpu_count() or 1,
                        help="seeds run at once, one process each (same figures; default: one per core)")
    parser.add_argument("--out", help="results file stem (default fleet_scaling_<sim>[_quick])")
    parser.add_argument("--no-log-models", action="store_true",
                        help=f"do not log each cell's final policy to MLflow (experiment {EXPERIMENT})")
    parser.add_argument("--explain", metavar="DIR", help="write the failure explorer of every fert round under "
                        "DIR/<cell>/<round> (off by default: a few seconds of plotting per round)")
    parser.add_argument("--replot", action="store_true", help="redraw the PNG and docs section from the saved JSON")
    parser.add_argument("--cells", type=Path, help="keep each finished seed here; seeds already there are not re-run")
    parser.add_argument("--finished-only", action="store_true",
                        help="with --cells: run nothing, report the seeds that folder holds")
    args = parser.parse_args()
    if args.replot:
        path = RESULTS / f"fleet_scaling_{args.sim}.json"
        result = json.loads(path.read_text())
        plot(result, RESULTS / f"fleet_scaling_{args.sim}.png")
        write_docs(result)
        return
    plan = (QUICK if args.quick else PLANS)[args.sim]
    updates = {k: v for k, v in {
        "seeds": args.seeds, "rounds": args.rounds, "steps_per_robot": args.steps_per_robot,
        "finetune_steps": args.finetune_steps, "max_epochs": args.max_epochs, "heldout_robots": args.heldout_robots,
        "validation_robots": args.validation_robots, "validation_trials": args.validation_trials,
        "init_rounds": args.init_rounds, "first_seed": args.first_seed,
        "trials_per_robot": args.trials_per_robot,
        "fleet_sizes": tuple(args.fleet_sizes) if args.fleet_sizes else None,
    }.items() if v is not None}
    if args.sim_set:
        updates["sim_overrides"] = key_values(args.sim_set)
    if args.fert_set:
        updates["fert_overrides"] = key_values(args.fert_set)
    if args.policy_set:
        updates["policy_overrides"] = key_values(args.policy_set)
    if args.methods:
        updates["methods"] = tuple(args.methods)
    if args.no_ablation:
        updates["ablation"] = False
    if args.tuning:
        updates["robots"] = "tuning"
    if args.explain:
        updates["explain_dir"] = str(Path(args.explain).resolve())
    plan = Plan(**{**asdict(plan), **updates})
    try:
        plan_settings(plan)  # a misspelt or mistyped override is refused now, not in a worker an hour in
    except ValueError as error:
        parser.error(str(error))
    out = args.out or f"fleet_scaling_{args.sim}" + ("_quick" if args.quick else "") + ("_tuning" if args.tuning else "")
    log(f"plan: {plan}")
    if args.finished_only and not args.cells:
        parser.error("--finished-only reports the seeds of a --cells folder: pass --cells DIR")
    result = run(plan, out, workers=args.workers, log_models=not (args.no_log_models or args.tuning), cells=args.cells,
                 finished_only=args.finished_only, command=" ".join(["python -m benchmarks.fleet_scaling", *sys.argv[1:]]))
    log(f"targets: {json.dumps(result['targets'])}")
    if not args.quick and not args.out and not args.tuning:
        write_docs(result)


def key_values(items: list[str]) -> dict[str, float | int | str | list]:
    """``KEY=VALUE`` flags -> {key: value}, each value cast as ``_value`` does."""
    return {k: _value(v) for k, v in (item.split("=", 1) for item in items)}


def _value(text: str) -> float | int | str | list:
    if text.startswith("["):  # a list, as JSON: cameras=["scene","gripper"]
        return json.loads(text)
    for cast in (int, float):
        try:
            return cast(text)
        except ValueError:
            pass
    return text


def write_docs(result: dict) -> None:
    """Replace (or add) this simulator's part of the ``## Fleet scaling (FERT)`` section."""
    update_results_md(DOCS, result["plan"]["sim"], render_section(result))


def _pct(cell: dict) -> str:
    return f"{100 * cell['rate']:.1f} [{100 * cell['ci_low']:.1f}, {100 * cell['ci_high']:.1f}]"


def _spread(cell: dict) -> str:
    return f"{100 * cell['seed_min']:.1f}–{100 * cell['seed_max']:.1f}"


def _ci(points: list[float]) -> str:
    return f"{points[0]:+.1f} pts [{points[1]:+.1f}, {points[2]:+.1f}]"


def _workers(result: dict) -> str:
    workers = result["machine"].get("workers", 1)  # results from before --workers ran one seed at a time
    return f", {workers} seeds at a time" if workers > 1 else ""


def render_section(result: dict) -> str:
    """This simulator's sub-section: the table, the targets, and how the run was sized."""
    plan, sim = result["plan"], result["plan"]["sim"]
    fleets = plan["fleet_sizes"]
    seeds = len(result.get("seeds_reported", range(plan["seeds"])))
    planned = "" if seeds == plan["seeds"] else f" (of {plan['seeds']} planned; seeds {result['seeds_reported']})"
    command = result.get("command", f"python -m benchmarks.fleet_scaling --sim {sim}")
    lines = [
        f"### {sim}",
        "",
        f"`{command}` → `benchmarks/results/fleet_scaling_{sim}.json`, "
        f"`fleet_scaling_{sim}.png`; {result['seconds'] / 60:.0f} min on the shared 2-core machine"
        f"{_workers(result)}.",
        "",
        f"Plan: {seeds} seeds{planned} × {plan['rounds']} CEL rounds; fleet sizes {', '.join(map(str, fleets))}; "
        f"{plan['steps_per_robot']} steps per robot per round (fixed collection time); ~{plan['finetune_steps']} "
        f"fine-tuning steps per round for every method, starting from the current policy; "
        + (f"a round's policy is kept only if it does at least as well on {plan['validation_robots']} validation robots × "
           f"{plan['validation_trials']} trials; " if plan.get("validation_robots") else "every round's policy is kept; ")
        + f"held-out: "
        f"{plan['heldout_robots']} robots × {plan['trials_per_robot']} trials per seed "
        f"({plan['heldout_robots'] * plan['trials_per_robot'] * seeds} pooled per cell). "
        f"Motion exploration noise (collection): {result['settings']['sim'].get('motion_noise_std', plan.get('motion_noise', 0.0))}; "
        f"sim overrides: {plan.get('sim_overrides') or 'none'}; FERT overrides: {plan.get('fert_overrides') or 'none'}; "
        f"policy overrides: {plan.get('policy_overrides') or 'none'}.",
        "",
        "Held-out success, % [Wilson 95% CI of pooled trials] and (min–max over seeds). "
        "*Thresholded* = the deployed policy (jaw command thresholded); *sampled* = jaw sampled as in collection "
        "(motion without the collection's exploration noise).",
        "",
        "| method | jaw | " + " | ".join(f"{n} robots" for n in fleets) + " |",
        "|---|---|" + "---|" * len(fleets),
    ]
    init = result["initial"]
    for mode in ("thresholded", "sampled"):
        cell = init[mode]
        lines.append(f"| initial BC | {mode} | " + " | ".join(
            [f"{_pct(cell)} ({_spread(cell)})"] + ["″"] * (len(fleets) - 1)) + " |")
    for method, by_fleet in result["results"].items():
        for mode in ("thresholded", "sampled"):
            cells = [f"{_pct(by_fleet[str(n)][mode])} ({_spread(by_fleet[str(n)][mode])})" if str(n) in by_fleet else "–"
                     for n in fleets]
            lines.append(f"| {method} | {mode} | " + " | ".join(cells) + " |")
    lines += _target_lines(result)
    lines += _seed_level_lines(result)
    return "\n".join(lines) + "\n"


def _target_lines(result: dict) -> list[str]:
    """The targets of the run's task as stated before it (``TARGETS``), each with its figure."""
    targets, fleets = result.get("targets") or {}, result["plan"]["fleet_sizes"]
    if "criteria" not in targets:  # results from before per-task targets: their figures are in the JSON
        return []
    c = targets["criteria"]
    parts = [
        f"initial in {100 * c['initial'][0]:.0f}–{100 * c['initial'][1]:.0f}%: **{targets['initial_in_range']}**",
        (f"FERT at {fleets[-1]} robots ≥ {100 * c['fert_at_largest']:.0f}%: "
         f"**{targets['fert_largest_fleet_meets']}** ({100 * targets['fert_largest_fleet_rate']:.1f}%)"),
        (f"FERT − filtered BC at {fleets[-1]} robots {targets['fert_minus_filtered_bc_points']:+.2f} pts, "
         f"{100 * targets['residual_failures_removed']:.0f}% of filtered BC's failures removed, seed-level interval "
         f"above 0: {targets['fert_minus_filtered_bc_seed_level_above_0']} (target {_gap_criterion(c)} with the "
         f"interval above 0: **{targets['gap_meets']}**)"),
    ]
    if c["grows_from"] is not None:
        steps = ", ".join(f"→ {n}: {v:+.1f}" for n, v in targets["fert_step_means_points"].items())
        parts.append(f"FERT grows at every step after {c['grows_from']} robots: **{targets['fert_grows_with_fleet']}** "
                     f"(seed-level mean steps, pts: {steps})")
    gap = targets["fert_minus_filtered_bc_ci_points"]
    sizes = "; ".join(f"{k.replace('->', ' → ')}: {_ci(v)}" for k, v in targets["fert_growth_steps_ci_points"].items())
    return ["", "Targets (thresholded, test robots; stated before the run): " + "; ".join(parts) + ".", "",
            f"Secondary (Newcombe, pooled trials as if independent): FERT − filtered BC at {fleets[-1]} robots "
            f"{_ci(gap)}; FERT from one fleet size to the next: {sizes}."]


def _gap_criterion(c: dict) -> str:
    parts = [f"≥ {c['gap_points']:+.0f} pts"] if c["gap_points"] else []
    parts += [f"≥ {100 * c['residual_removed']:.0f}% of failures removed"] if c["residual_removed"] else []
    return " and ".join(parts) or "> 0"


def _seed_level_lines(result: dict) -> list[str]:
    """The primary intervals (seeds as the unit); results from before they existed have none."""
    by_fleet = result.get("by_fleet") or {}
    if not by_fleet:
        return []

    def one(d: dict) -> str:
        ci = "n/a (one seed)" if d["ci95"] is None else f"[{d['ci95'][0]:+.1f}, {d['ci95'][1]:+.1f}]"
        boot = d["bootstrap_ci95"]
        need = "n/a" if d["ci95"] is None else d["seeds_needed"] if d["seeds_needed"] is not None else "none at this gap"
        return (f"{d['mean']:+.1f} pts {ci} paired over {len(d['seeds'])} seeds, bootstrap "
                f"[{boot[0]:+.1f}, {boot[1]:+.1f}], seeds needed {need}")

    rows = []
    for n, cell in by_fleet.items():
        level = cell["seed_level"]
        parts = [f"FERT − filtered BC {one(level['fert_minus_filtered_bc'])}"] if "fert_minus_filtered_bc" in level else []
        if "fert_step_from_previous_fleet" in level:
            parts.append(f"FERT step from the previous size {one(level['fert_step_from_previous_fleet'])}")
        rows.append(f"- {n} robots: " + "; ".join(parts))
    seeds = result.get("test_population_seeds", [])
    return ["", f"Seed-level differences (the primary intervals; test robots fresh per seed, populations {seeds}):",
            "", *rows]


def update_results_md(path: Path, sim: str, body: str) -> None:
    """Put ``body`` under ``## Fleet scaling (FERT)`` / ``### <sim>``, leaving everything else as it is."""
    text = path.read_text() if path.exists() else "# Benchmark results\n\nOne section per benchmark.\n"
    if SECTION not in text:
        text = text.rstrip("\n") + f"\n\n{SECTION}\n\n{SECTION_INTRO}\n"
    start = text.index(SECTION)
    next_section = text.find("\n## ", start + len(SECTION))
    end = len(text) if next_section == -1 else next_section + 1
    section = text[start:end]
    header = f"### {sim}"
    if header in section:
        a = section.index(header)
        b = section.find("\n### ", a + len(header))
        section = section[:a] + body + ("" if b == -1 else "\n" + section[b + 1:])
    else:
        section = section.rstrip("\n") + "\n\n" + body
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text[:start] + section.rstrip("\n") + "\n" + ("\n" + text[end:] if end < len(text) else ""))


if __name__ == "__main__":
    main()
