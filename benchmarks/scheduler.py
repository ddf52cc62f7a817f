"""The embedded scheduler side by side with its baselines, on the PPO iteration (and FERT's).

    python -m benchmarks.scheduler            # 256 envs x 64 steps, ~5-8 min on 2 shared cores
    python -m benchmarks.scheduler --quick    # 64 envs x 16 steps, smoke run (~2-3 min)
    python -m benchmarks.scheduler --tiny     # 16 envs x 4 steps, code-path check only (seconds; tests)
    python -m benchmarks.scheduler --train-workflow-only --name scheduler_train_workflow
                                              # only the train task's FERT workflow (~5 min)

Every plan runs the *same* workflow with the same per-op thread quota (``scheduler.op_threads``,
1 here; the PPO learner pinned at ``learner_threads`` = 1), so every plan is bit-identical to the
sequential reference and a gain can only come from using the second core for concurrent work:

1. sequential, library-default threads (two rows: learner pinned at 1 — bit-identical — and
   learner at torch's default too, whose numerics differ ~1e-8, so nobody thinks the 1-thread
   reference was crippled);
2. sequential, torch 2 threads per op (BLAS 1), and sequential, 1 thread per op (the reference);
3. RLinf-style coarse pipelining: env | rollout in 2 stages on separate cores, actor after;
4. the M2Flow planner's plan (profile → cost curves → cut search, each layout replayed through the
   contention-aware discrete-event model);
5. planner + Rose (window-guided rewrites, validated end to end) + slack-aware thread quotas.

The workload: PPO on the built-in fleet (env groups, chunked inference, GAE, one learner epoch)
plus the evaluation of the previous weights (params@i, what the learner reads) on held-out robots,
which is legal to run while the learner produces params@i+1.

Measurement: plans run interleaved (A B C … B C A …), iteration 0 of each run is warm-up, medians
quoted, plus the median of per-round ratios. This VM's CPU speed moves with its host's load (a fixed
loop varies ~2x within seconds with nothing else running here; ``host_speed_probe`` records it each
round), so the profile is re-taken at the start of every round and a plan's prediction is the median
of its per-round predictions: predictions and measurements sample the same minutes. Load averages and
this process's CPU time are recorded; ``work_bound`` is the fastest any schedule could be.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import statistics
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

from components.config import PolicyConfig, load_settings
from components.scheduler.gantt import plot_timelines
from components.scheduler.plan import Plan, WorkerSpec
from components.scheduler.profiler import (
    GpuTelemetry,
    OpTimer,
    autogroup_scheduling,
    effective_cores,
)
from components.scheduler.sm_model import LABEL as SM_LABEL
from components.scheduler.sm_model import study
from components.training.workloads.ppo import PPOSpec, ppo_runtime

RESULTS = Path(__file__).resolve().parent / "results"
NAME = "scheduler"
EVAL_STEPS_PER_ROLLOUT_STEP = 5  # held-out evaluation: this many env steps per training rollout step
BRUTE_FORCE = {True: 4, False: 6}  # candidates measured against the planner's choice (quick, full)
HOST_PROBE_LOOPS = 200_000  # ~20 ms of pure Python on this machine when its host is quiet
CAPACITY_SETTLE_S = 1.0  # pause before the after-round capacity probe
MIN_QUALIFIED_ROUNDS = 3  # fewer qualified rounds than this: figures come from every round, flagged unqualified
PROCESS_SPLITS_KEPT = 2  # process-based coarse splits (fastest in the calibration run) that join the rounds


def log(msg: str) -> None:
    print(msg, flush=True)


def load() -> dict[str, float]:
    one, five, fifteen = os.getloadavg()
    ru_self, ru_kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return {"loadavg_1m": one, "loadavg_5m": five, "loadavg_15m": fifteen, "time": time.time(),
            "process_cpu_s": ru_self.ru_utime + ru_self.ru_stime,
            "children_cpu_s": ru_kids.ru_utime + ru_kids.ru_stime}


def host_speed_probe(loops: int = HOST_PROBE_LOOPS) -> float:
    """Seconds a fixed pure-Python loop takes now: this VM's CPU speed moves with its host's load
    (seen here: the same loop 24-128 ms within 20 s, nothing else running in the VM)."""
    t = time.perf_counter()
    acc = 0
    for i in range(loops):
        acc += i
    return time.perf_counter() - t


def interleaved(rt: Any, plans: list[Plan], iterations: int, rounds: int,
                max_rounds: dict[str, int] | None = None,
                before_round: Callable[[int], None] | None = None,
                after_round: Callable[[int], None] | None = None) -> dict[str, dict[str, Any]]:
    """Run every plan ``rounds`` times in turn (A B C, B C A, ...); iteration 0 of each run is warm-up.
    ``max_rounds`` caps slow reference rows (they join the first rounds only); ``before_round(r)``
    runs first in each round (the benchmark re-profiles there), ``after_round(r)`` last."""
    out: dict[str, dict[str, Any]] = {p.name: {"samples": [], "digests": set(), "process_cores": [],
                                               "machine_cores": [], "round_medians": {}, "round_samples": {}}
                                      for p in plans}
    for r in range(rounds):
        if before_round is not None:
            before_round(r)
        k = r % len(plans)  # rotate the order each round: a load drift within a round hits every plan alike
        for p in plans[k:] + plans[:k]:
            if r >= (max_rounds or {}).get(p.name, rounds):
                continue
            res = rt.run(p, iterations + 1)
            o = out[p.name]
            o["samples"] += res.iteration_s[1:]
            o["round_samples"][r] = list(res.iteration_s[1:])
            o["round_medians"][r] = statistics.median(res.iteration_s[1:])
            o["digests"].add(tuple(v["digest"] if isinstance(v, dict) and "digest" in v else repr(v.get("loss"))
                                   for k, v in sorted(res.records.items()) if k.state == "stats"))
            o["process_cores"].append(res.timeline.mean_process_cores())
            o["machine_cores"].append(res.timeline.mean_machine_cores())
            o["last"] = res
            log(f"  round {r + 1}/{rounds} {p.name:<48} median {o['round_medians'][r] * 1e3:8.1f} ms"
                f"  (load {os.getloadavg()[0]:.2f})")
        if after_round is not None:
            after_round(r)
    for o in out.values():
        o["median_s"] = statistics.median(o["samples"])
    return out


def probe_after_round(rt: Any, capacity: list[tuple[float, float]], r: int) -> None:
    """Round ``r``'s second capacity reading (its first was taken before the round)."""
    time.sleep(CAPACITY_SETTLE_S)  # the last run's worker processes finish exiting
    capacity[r] = (capacity[r][0], effective_cores(rt.devices))
    log(f"round {r + 1}: capacity probe {capacity[r][0]:.2f} -> {capacity[r][1]:.2f} cores")


def qualify(meas: dict[str, dict[str, Any]], capacity: list[tuple[float, float]], devices: int,
            fraction: float) -> dict[str, Any]:
    """Which rounds ran with the cores the plans need (capacity probe >= ``fraction`` of ``devices``,
    ``scheduler.capacity_qualify_fraction``, before *and* after the round), and every plan's median over those rounds only
    (``median_s`` is replaced; the all-round median stays as ``median_all_s``). With fewer than
    MIN_QUALIFIED_ROUNDS qualified rounds the figures come from every round and say so."""
    need = fraction * devices
    good = [r for r, (before, after) in enumerate(capacity) if min(before, after) >= need]
    used = good if len(good) >= MIN_QUALIFIED_ROUNDS else list(range(len(capacity)))
    for o in meas.values():
        o["median_all_s"] = o["median_s"]
        kept = [x for r in used for x in o["round_samples"].get(r, [])]
        o["median_s"] = statistics.median(kept) if kept else o["median_s"]
    return {"cores_needed": need, "rounds": len(capacity), "qualified": good, "qualified_count": len(good),
            "rounds_used": used,
            "figures_from": "qualified rounds" if used is good else "every round (too few qualified: not a quotable run)",
            "quotable": used is good, "capacity_per_round": [{"before": b, "after": a} for b, a in capacity]}


def ratio_per_round(meas: dict[str, dict[str, Any]], a: str, b: str, rounds: list[int]) -> dict[str, Any]:
    """a's median / b's median within each round (both ran minutes apart at most), and their spread."""
    ra, rb = meas[a]["round_medians"], meas[b]["round_medians"]
    xs = {r: ra[r] / rb[r] for r in rounds if r in ra and r in rb}
    vals = sorted(xs.values())
    if not vals:
        return {"per_round": {}, "median": None}
    q = statistics.quantiles(vals, n=4) if len(vals) >= 2 else [vals[0]] * 3
    return {"per_round": xs, "median": statistics.median(vals), "min": vals[0], "max": vals[-1],
            "iqr": [q[0], q[2]]}


def calibrate_splits(rt: Any, splits: list[Plan], iterations: int) -> dict[str, float]:
    """One run of every process-based coarse split (the measured iterations' median, ms): the
    baseline's best split is picked by measurement, in its favour (the fastest of noisy runs)."""
    out = {}
    for p in splits:
        t = time.perf_counter()
        res = rt.run(p, iterations + 1)
        out[p.name] = statistics.median(res.iteration_s[1:]) * 1e3
        log(f"  calibration {p.name:<48} {out[p.name]:8.1f} ms/iteration  ({time.perf_counter() - t:.1f} s with start-up)")
    return out


def train_workflow_section(settings: Any, quick: bool, iterations: int) -> dict[str, Any]:
    """The train task's FERT workflow (sample -> learn, validation beside it) on a product root:
    expert demos -> bootstrap policy -> one fleet round with failures -> the FERT training set ->
    ``make_trainer``; every plan kind measured interleaved, and the ``auto`` decision."""
    log("train workflow: building a FERT training set through the product path ...")
    with tempfile.TemporaryDirectory() as tmp:
        trainer, built = _fert_trainer(settings, quick, Path(tmp))
        run = _measure_train_workflow(settings, trainer, quick, iterations)
    return _train_workflow_report(run, trainer, built)


def _fert_trainer(settings: Any, quick: bool, root: Path) -> tuple[Any, Any]:
    """The product path on a fresh root: expert demos, bootstrap policy, one fleet round, the FERT
    training set, and the trainer the train task would build on it (with the study's scheduler)."""
    from components.pipeline import steps
    from components.pipeline.collect import collect_expert_demos, collect_fleet
    from components.pipeline.ingest import ingest_files
    from components.pipeline.workspace import Workspace
    from components.training.trainer import make_trainer

    cell = settings.model_copy(update={"root": root, "scheduler": settings.scheduler.model_copy(
        update={"plan": "sequential"})})
    ingest_files(cell, collect_expert_demos(cell, cell.paths.incoming / "expert").files, snapshot=False)
    boot = steps.train_policy(cell).result.policy
    fleet = collect_fleet(cell, boot, "v1", cell.paths.incoming / "round-001", round_index=1,
                          num_robots=4 if quick else 8)
    ingest_files(cell, fleet.files, snapshot=False)
    built = steps.training_set(cell, Workspace(cell))
    trainer = make_trainer(cell.model_copy(update={"scheduler": settings.scheduler}), built.data, boot, log)
    return trainer, built


@dataclass
class TrainWorkflowRun:
    """The FERT workflow's plans, their interleaved measurement and one whole train task per plan."""

    rt: Any
    seq: Plan
    process_rows: list[Plan]
    planner_plan: Plan
    rose_plan: Plan
    plans: list[Plan]
    auto: Any
    auto_s: float
    meas: dict[str, dict[str, Any]]
    qualified: dict[str, Any]
    task_s: dict[str, float]
    digests: dict[str, str]


def _measure_train_workflow(settings: Any, trainer: Any, quick: bool, iterations: int) -> TrainWorkflowRun:
    from components.training.checkpoint import state_digest

    rt = trainer.runtime
    seq, seq_default, coarse = rt.sequential(), rt.sequential(tuned=False), rt.coarse()
    process_rows = list({p.name: p for p in (rt.coarse_processes(), rt.coarse_processes(colocate_rollout=True))}.values())
    t = time.perf_counter()
    auto = trainer.choose("auto")  # profile -> planner -> Rose -> validated against sequential; cached after
    auto_s = time.perf_counter() - t
    planner_plan = rt.plan().best.plan
    rose_plan = rt.optimize(planner_plan).plan
    plans = [seq, seq_default, coarse, *process_rows, planner_plan, rose_plan]
    capacity: list[tuple[float, float]] = []  # cores this process could get, before and after each round

    meas = interleaved(rt, plans, iterations, 2 if quick else 3,
                       before_round=lambda r: capacity.append((effective_cores(rt.devices), 0.0)),
                       after_round=partial(probe_after_round, rt, capacity))
    qualified = qualify(meas, capacity, rt.devices, settings.scheduler.capacity_qualify_fraction)
    task_s, digests = {}, {}
    for p in plans:  # one whole train task per plan: worker start-up, every iteration, validation
        t = time.perf_counter()
        digests[p.name] = state_digest(rt.run(p, trainer.spec.iterations).final["params"])
        task_s[p.name] = time.perf_counter() - t
    return TrainWorkflowRun(rt, seq, process_rows, planner_plan, rose_plan, plans, auto, auto_s, meas, qualified,
                            task_s, digests)


def _train_workflow_report(run: TrainWorkflowRun, trainer: Any, built: Any) -> dict[str, Any]:
    """The FERT workflow section of the JSON (the whole of NAME.json's train_workflow)."""
    rt, meas, plans, seq, rose_plan = run.rt, run.meas, run.plans, run.seq, run.rose_plan
    planner_plan, auto, auto_s, task_s, digests, qualified = (run.planner_plan, run.auto, run.auto_s, run.task_s,
                                                              run.digests, run.qualified)
    med = {p.name: meas[p.name]["median_s"] for p in plans}
    shares = _op_shares(meas[seq.name]["last"])
    best_other = min((p for p in plans if p is not rose_plan), key=lambda p: med[p.name])
    coarse_proc = min(run.process_rows, key=lambda p: med[p.name])
    bound = work_bound(med[seq.name], statistics.fmean(meas[seq.name]["process_cores"]), rt.devices,
                       {p.name: med[p.name] for p in plans if p.name.startswith("sequential")})
    span = measured_span_bound(rt, plans, meas, digests, seq, med[best_other.name], bound["floor_ms"] / 1e3)
    # what the scheduler predicted for the plans it runs (the planner's and Rose's), against the measurement
    predicted = {p.name: rt.predict(p) for p in (planner_plan, rose_plan)}
    return {
        "end_to_end_task_s": {"iterations": trainer.spec.iterations, "per_plan": task_s,
                              "auto_choice_s (first task on a machine; later tasks read the cache)": auto_s,
                              "first_task_on_a_machine_s (auto's choice + the chosen plan's task)":
                                  auto_s + task_s.get(auto.plan.name, task_s[seq.name])},
        "best_baseline": {"name": best_other.name, "ms": med[best_other.name] * 1e3,
                          "bit_identical": len({digests[best_other.name], digests[seq.name]}) == 1},
        "rose": {"ms": med[rose_plan.name] * 1e3},
        "speedup_vs_best_baseline": med[best_other.name] / med[rose_plan.name],
        "rounds": {**qualified, "speedup_per_round": {
            "vs_best_baseline": ratio_per_round(meas, best_other.name, rose_plan.name, qualified["rounds_used"]),
            "vs_coarse_processes": ratio_per_round(meas, coarse_proc.name, rose_plan.name, qualified["rounds_used"])}},
        "speedup_vs_coarse_processes": med[coarse_proc.name] / med[rose_plan.name],
        "coarse_processes": {"best_split": coarse_proc.name, "ms": med[coarse_proc.name] * 1e3},
        "work_bound": bound,
        "span_bound": span,
        "prediction": {name: {"predicted_ms": v * 1e3, "measured_ms": med[name] * 1e3,
                              "error": abs(v - med[name]) / med[name]} for name, v in predicted.items()},
        "workload": {"frames": len(built.data.states), "method": built.report.method, "retrieved_segments": built.report.matches,
                     "batch_size": trainer.spec.batch_size, "steps_per_iteration": trainer.spec.steps_per_iteration,
                     "validation_robots": len(trainer.spec.validation.robot_ids) if trainer.spec.validation else 0,
                     "share_of_sequential_iteration": shares},
        "median_ms": {k: v * 1e3 for k, v in med.items()},
        "speedup_rose_vs_sequential": med[seq.name] / med[rose_plan.name],
        "speedup_rose_vs_best_other": med[best_other.name] / med[rose_plan.name], "best_other": best_other.name,
        "auto": {"chosen": auto.plan.name, "source": auto.source, "candidates_ms": {k: v * 1e3 for k, v in auto.candidates.items()},
                 "task_s (start-up + the task's iterations, what auto decides on)": auto.task_s},
        "bit_identical": len(set(digests.values())) == 1, "weights_digests": digests,
        "plans": {p.name: p.describe() for p in (planner_plan, rose_plan)},
    }


def plot_train_workflow(section: dict[str, Any], path: Path) -> None:
    """Per plan: steady-state ms per iteration (left) and one whole train task in s (right)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(section["median_ms"])
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.2), sharey=True)
    left.barh(names, [section["median_ms"][n] for n in names], color="tab:blue")
    left.set_xlabel("median ms per iteration (interleaved rounds)")
    span, best = section.get("span_bound"), section.get("best_baseline")
    if span and best:  # the floors of any bit-identical plan, and where the 1.15x target would sit
        left.axvline(section["work_bound"]["floor_ms"], color="0.5", ls=":", label="CPU-work floor")
        left.axvline(span["span_ms"], color="k", ls="--", label="critical path (learner chain)")
        left.axvline(best["ms"] / 1.15, color="tab:red", ls="-.", label="1.15x over the best baseline")
        left.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.16), ncol=3)
    task = section["end_to_end_task_s"]
    right.barh(names, [task["per_plan"][n] for n in names], color="tab:orange")
    right.set_xlabel(f"one train task, s ({task['iterations']} iterations, start-up + validation)")
    fig.suptitle(f"train task's FERT workflow: {section['workload']['frames']} frames; "
                 f"auto chose {section['auto']['chosen']}; bit-identical: {section['bit_identical']}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def paired_ratio(meas: dict[str, dict[str, Any]], a: str, b: str) -> float:
    """Median over every round of a's time / b's time in the same round (robust to drift between rounds)."""
    return ratio_per_round(meas, a, b, list(meas[a]["round_medians"]))["median"]


@dataclass
class Sizes:
    """The study's sizes (--tiny, --quick or full); ``rounds`` after --rounds."""

    tiny: bool
    quick: bool
    envs: int
    steps: int
    eval_envs: int
    iterations: int
    rounds: int


@dataclass
class Plans:
    """Every plan the study measures: the baselines, the planner's plan, Rose's plan and its steps."""

    seq: Plan  # the reference: every op at op_threads, BLAS 1
    seq_default: Plan
    seq_default_free: Plan
    seq_t2: Plan | None
    coarse: Plan
    split_calibration: dict[str, float]
    process_rows: list[Plan]
    planned: Any = None
    planning_prediction: float = 0.0
    planner_plan: Plan | None = None
    planning_profile: Any = None
    opt: Any = None
    rose_plan: Plan | None = None
    steps_kept: list[Plan] = field(default_factory=list)
    slow: tuple[Plan | None, ...] = ()
    rows: list[Plan] = field(default_factory=list)  # what the interleaved rounds run, in order
    predictable: list[Plan] = field(default_factory=list)


@dataclass
class Measured:
    """The interleaved rounds: per-plan samples, the rounds' qualification and each round's predictions."""

    meas: dict[str, dict[str, Any]]
    qualified: dict[str, Any]
    probes: list[float]
    capacity_probes: list[list[float]]
    round_predictions: list[dict[str, float]]
    predicted: dict[str, float]
    prof: Any
    load_start: dict[str, float]
    load_end: dict[str, float]


@dataclass
class Analysis:
    """What the measurement says: medians, bit-identity, the best rows, prediction errors, the floors."""

    med: dict[str, float]
    digests: dict[str, Any]
    identical: bool
    best_seq: Plan
    best_base: Plan
    coarse_proc: Plan
    errors: dict[str, float]
    bound: dict[str, Any]
    span: dict[str, Any]


@dataclass
class Study:
    """One run of the benchmark, everything the report reads."""

    args: argparse.Namespace
    size: Sizes
    spec: PPOSpec
    rt: Any
    gpu: Any
    started: float
    load_start: dict[str, float]
    plans: Plans
    measured: Measured
    analysis: Analysis
    candidates: list[dict[str, Any]]
    regret: float
    fert: dict[str, Any]
    sm: Any


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="small smoke version")
    ap.add_argument("--device", default="cpu", choices=("cpu", "cuda"),
                    help="where the PPO models run; cuda adds one CUDA stream per worker (gpu_check.sh)")
    ap.add_argument("--streams", action="store_true",
                    help="one CUDA stream per worker (implied by --device cuda; without CUDA a no-op)")
    ap.add_argument("--mps-eval", type=int, default=0, metavar="PCT",
                    help="run the evaluator as an MPS client process with this SM percentage (GPU only)")
    ap.add_argument("--tiny", action="store_true",
                    help="code-path check: tiny sizes, one round, no FERT section or SM sweep (numbers meaningless)")
    ap.add_argument("--no-fert", action="store_true", help="skip the train task's FERT workflow section")
    ap.add_argument("--train-workflow-only", action="store_true",
                    help="only the train task's FERT workflow section (JSON: NAME.json with its figures)")
    ap.add_argument("--rounds", type=int, help="interleaved measurement rounds (default 12; quick 2)")
    ap.add_argument("--name", default=NAME, help="results file stem (benchmarks/results/NAME.json/.png)")
    ap.add_argument("--out", type=Path, default=RESULTS, help="results directory")
    return ap.parse_args(argv)


def run_train_workflow_only(settings: Any, args: argparse.Namespace) -> None:
    """--train-workflow-only: the FERT workflow section alone, as NAME.json + NAME.png."""
    started = time.time()
    section = train_workflow_section(settings, args.quick, 2)
    body = {"train_workflow": section, "load": load(), "seconds": time.time() - started,
            "config": {"python": platform.python_version(), "cores": os.cpu_count(), "quick": args.quick}}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"{args.name}.json").write_text(json.dumps(body, indent=2, default=str))
    plot_train_workflow(section, args.out / f"{args.name}.png")
    log(json.dumps(section, indent=2, default=str))


def study_sizes(args: argparse.Namespace) -> Sizes:
    tiny = args.tiny
    quick = args.quick or tiny
    envs, steps = (16, 4) if tiny else (64, 16) if quick else (256, 64)
    eval_envs = 8 if tiny else 32 if quick else 128
    iterations, rounds = (1, 1) if tiny else (2, 2) if quick else (2, 12)  # many short runs: more host moments
    return Sizes(tiny, quick, envs, steps, eval_envs, iterations, args.rounds or rounds)


def study_config(cfg: Any, tiny: bool) -> Any:
    """The scheduler settings the study runs with (--tiny: one of everything)."""
    if tiny:
        cfg = cfg.model_copy(update={"pipeline_stages": (1, 2), "validate_iterations": 1, "validate_rounds": 1,
                                     "quota_max_steps": 1, "profile_iterations": 2,
                                     "capacity_probe_attempts": 1, "ipc_probe_iterations": 1})
    return cfg


def log_start(size: Sizes, gpu: Any, load_start: dict[str, float]) -> None:
    mode = "tiny" if size.tiny else "quick" if size.quick else "full"
    log(f"scheduler benchmark ({mode}): PPO {size.envs} envs x {size.steps} steps, "
        f"{os.cpu_count()} cores, load {load_start['loadavg_1m']:.2f}/{load_start['loadavg_5m']:.2f}")
    log(f"GPU telemetry: {'available' if gpu and gpu.available else 'unavailable (' + (gpu.reason if gpu else 'off') + ')'}"
        f"; op timer: {OpTimer().backend}")


def build_runtime(settings: Any, cfg: Any, device: str, size: Sizes, gpu: Any) -> tuple[PPOSpec, Any]:
    """The PPO workload and its scheduler runtime."""
    # a small actor-critic (2 x 128) as embodied RL uses; inference in fixed chunks (one per group at m = max)
    policy = PolicyConfig(hidden=128, layers=2)
    spec = PPOSpec(sim=settings.sim, policy=policy, robot_ids=tuple(settings.fleet.robot_ids(size.envs)),
                   eval_robot_ids=tuple(settings.fleet.heldout_ids(size.eval_envs)), steps=size.steps, epochs=1,
                   minibatches=4, eval_steps=EVAL_STEPS_PER_ROLLOUT_STEP * size.steps, learner_threads=1,
                   infer_chunk=size.envs // max(cfg.pipeline_stages), seed=settings.seed, device=device)
    return spec, ppo_runtime(spec, cfg, log=log, gpu=gpu)


def process_splits(rt: Any, size: Sizes) -> tuple[dict[str, float], list[Plan]]:
    """RLinf's natural form, one worker process per component, at its best split: every layout and
    thread count run once, the fastest PROCESS_SPLITS_KEPT join the rounds (--tiny: the default split)."""
    if size.tiny:
        return {}, [rt.coarse_processes()]
    log("process-based coarse pipelining: calibrating its splits (one run each) ...")
    splits = rt.coarse_process_splits((1,) if size.quick else None)  # quick: 1 thread per op only
    calibration = calibrate_splits(rt, splits, size.iterations)
    return calibration, sorted(splits, key=lambda p: calibration[p.name])[:PROCESS_SPLITS_KEPT]


def baseline_plans(rt: Any, size: Sizes) -> Plans:
    """The sequential rows, coarse pipelining on threads and the process-based splits."""
    seq = rt.sequential()  # the reference: every op at op_threads, BLAS 1
    seq_default = rt.sequential(tuned=False)
    seq_default_free = seq_default.with_(name="sequential-default(learner default threads; numerics differ)",
                                         pinned_threads={"learner": _torch_default_threads()})
    seq_t2 = rt.sequential(threads=2) if rt.devices >= 2 else None
    coarse = rt.coarse()
    split_calibration, process_rows = process_splits(rt, size)
    return Plans(seq, seq_default, seq_default_free, seq_t2, coarse, split_calibration, process_rows)


def plan_with_planner(rt: Any, plans: Plans, started: float) -> None:
    """The M2Flow planner's plan (profile -> cost curves -> cut search) and the profile it planned on."""
    log("profiling (sequential schedule at each stage count, thread-contention probe) ...")
    plans.planned = rt.plan()
    log(plans.planned.table())
    plans.planning_prediction = plans.planned.best.predicted_s
    plans.planner_plan = plans.planned.best.plan
    plans.planning_profile = rt.profile()
    log(f"planner done in {time.time() - started:.1f} s (kappa = {plans.planning_profile.thread_slowdown:.2f}, "
        f"effective cores {plans.planning_profile.capacity:.2f}); Rose + quotas ...")


def optimize_with_rose(rt: Any, plans: Plans, args: argparse.Namespace, size: Sizes) -> None:
    """Rose's rewrites + slack quotas on the planner's plan (CUDA streams, MPS evaluator as asked)."""
    t = time.time()
    if args.device == "cuda" or args.streams:
        plans.planner_plan = plans.planner_plan.with_(cuda_streams=True)
        plans.coarse = plans.coarse.with_(cuda_streams=True)
    if size.tiny:  # code-path check: Rose's measured validation is covered by the tests
        plans.opt = None
        plans.rose_plan = plans.planner_plan.with_(name=f"{plans.planner_plan.name}+rose(skipped: --tiny)")
    else:
        plans.opt = rt.optimize(plans.planner_plan)
        plans.rose_plan = plans.opt.plan
    if args.mps_eval:
        plans.rose_plan = _evaluator_as_mps_client(plans.rose_plan, args.mps_eval)
    log(plans.rose_plan.describe())
    log(f"Rose done in {time.time() - t:.1f} s")


def choose_rows(rt: Any, plans: Plans, size: Sizes) -> None:
    """The rows the rounds measure (Rose's steps as attribution rows) and those the model predicts."""
    plans.slow = () if size.tiny else (plans.seq_default_free, plans.seq_t2)  # 2 threads/op: slow on a loaded 2-core machine
    steps_kept = rose_steps(rt, plans.planner_plan, plans.opt) if plans.opt else []  # measured like the rest
    plans.steps_kept = [p for p in steps_kept if p.name != plans.rose_plan.name]
    plans.rows = [p for p in (plans.seq_default, *plans.slow, plans.seq, plans.coarse, *plans.process_rows,
                              plans.planner_plan, *plans.steps_kept, plans.rose_plan) if p is not None]
    plans.predictable = [p for p in plans.rows if p not in (plans.seq_default, plans.seq_default_free, plans.seq_t2)
                         and not p.gpu_percent]  # an MPS client's SM share is not in the CPU model


def build_plans(rt: Any, args: argparse.Namespace, size: Sizes) -> Plans:
    started = time.time()
    plans = baseline_plans(rt, size)
    plan_with_planner(rt, plans, started)
    optimize_with_rose(rt, plans, args, size)
    choose_rows(rt, plans, size)
    return plans


def measure(rt: Any, plans: Plans, size: Sizes, cfg: Any) -> Measured:
    """Predictions at the load of the measurement: the profile is re-taken at the start of every
    measurement round and each plan's prediction is the median over rounds, like its measurement."""
    round_predictions: list[dict[str, float]] = []
    probes: list[float] = []
    capacity: list[tuple[float, float]] = []  # effective cores measured before and after each round
    capacity_probes: list[list[float]] = []  # the probes behind each round's "before" reading (re-probed until qualified)

    def reprofile(r: int) -> None:
        probes.append(host_speed_probe())
        prof = rt.profile(refresh=True)
        capacity.append((prof.capacity, prof.capacity))
        capacity_probes.append(list(prof.capacity_reading.readings) if prof.capacity_reading else [prof.capacity])
        round_predictions.append({p.name: rt.predict(p) for p in plans.predictable})
        log(f"round {r + 1}: re-profiled (kappa {prof.thread_slowdown:.2f}, effective cores {prof.capacity:.2f}, "
            f"host probe {probes[-1] * 1e3:.1f} ms); predicted ms: "
            + ", ".join(f"{k} {v * 1e3:.1f}" for k, v in round_predictions[-1].items()))

    log("side-by-side measurement (interleaved rounds, each after a fresh profile):")
    load_measure_start = load()
    # 2 threads/op oversubscribe a loaded machine: these rows join the first half of the rounds only
    slow_rows = {p.name: max(1, size.rounds // 2) for p in plans.slow if p is not None}
    meas = interleaved(rt, plans.rows, size.iterations, size.rounds, slow_rows, before_round=reprofile,
                       after_round=partial(probe_after_round, rt, capacity))
    qualified = qualify(meas, capacity, rt.devices, cfg.capacity_qualify_fraction)
    log(f"{qualified['qualified_count']}/{size.rounds} rounds had >= {qualified['cores_needed']:.1f} cores before "
        f"and after; figures from {qualified['figures_from']}")
    prof = rt.profile()
    predicted = {p.name: statistics.median(rp[p.name] for rp in round_predictions) for p in plans.predictable}
    return Measured(meas, qualified, probes, capacity_probes, round_predictions, predicted, prof,
                    load_measure_start, load())


def analyse(rt: Any, plans: Plans, measured: Measured) -> Analysis:
    meas, rows = measured.meas, plans.rows
    med = {p.name: meas[p.name]["median_s"] for p in rows}
    checked = [p for p in rows if p is not plans.seq_default_free]  # same numerics as the reference
    digests = {p.name: sorted(meas[p.name]["digests"]) for p in rows}
    identical = (len({tuple(map(tuple, digests[p.name])) for p in checked}) == 1
                 and all(len(digests[p.name]) == 1 for p in checked))
    best_seq = min((p for p in checked if p.name.startswith("sequential")), key=lambda p: med[p.name])
    # the baseline a user would pick: the fastest row that is not Rose's, bit-identical or not
    rose_rows = {plans.rose_plan.name, *(p.name for p in plans.steps_kept)}  # Rose's plan and its ablation steps
    best_base = min((p for p in rows if p.name not in rose_rows), key=lambda p: med[p.name])
    coarse_proc = min(plans.process_rows, key=lambda p: med[p.name])  # the process-based baseline at its best split
    errors = {k: abs(v - med[k]) / med[k] for k, v in measured.predicted.items()}
    bound = work_bound(med[plans.seq.name], statistics.fmean(meas[plans.seq.name]["process_cores"]), rt.devices,
                       {p.name: med[p.name] for p in rows if p.name.startswith("sequential")})
    span = measured_span_bound(rt, rows, meas, digests, plans.seq, med[best_base.name], bound["floor_ms"] / 1e3)
    return Analysis(med, digests, identical, best_seq, best_base, coarse_proc, errors, bound, span)


def brute_force(rt: Any, planned: Any, size: Sizes) -> tuple[list[dict[str, Any]], float]:
    """The planner's regret against brute force over its candidate plans, measured side by side."""
    log("brute force over the planner's candidate plans ...")
    cands = sorted(planned.candidates, key=lambda c: c.predicted_s)[: 2 if size.tiny else BRUTE_FORCE[size.quick]]
    if planned.best not in cands:
        cands.append(planned.best)
    bf_plans = [c.plan.with_(name=f"cand{k}:{c.plan.name}:{c.tree.describe()}") for k, c in enumerate(cands)]
    bf = interleaved(rt, bf_plans, size.iterations, size.rounds if size.tiny else 2)
    bf_rows = []
    for c, p in zip(cands, bf_plans):
        m = bf[p.name]["median_s"]
        replay = rt.predict(c.plan)
        bf_rows.append({"stages": c.stages, "placement": c.tree.describe(), "formula_ms": c.formula_s * 1e3,
                        "predicted_at_planning_ms": c.predicted_s * 1e3, "predicted_ms": replay * 1e3,
                        "measured_ms": m * 1e3, "error": abs(replay - m) / m, "chosen": c is planned.best})
    best_measured = min(r["measured_ms"] for r in bf_rows)
    chosen_row = next(r for r in bf_rows if r["chosen"])
    return bf_rows, chosen_row["measured_ms"] / best_measured - 1.0


def sm_section(size: Sizes) -> Any:
    """The SM model's four schedules (+ its sensitivity sweep at full size); None with --tiny."""
    if size.tiny:
        return None
    log(f"{SM_LABEL}: four schedules + sensitivity sweep ...")
    return study(sweep=not size.quick)


def _ratio(med: dict[str, float], a: Plan, b: Plan) -> float:
    return med[a.name] / med[b.name]


def _speedup_rows(st: Study) -> dict[str, Any]:
    """iteration_ms ... rounds: each plan's median and Rose's speed-up over every baseline."""
    P, A, meas = st.plans, st.analysis, st.measured.meas
    med, rose, rounds_used = A.med, P.rose_plan, st.measured.qualified["rounds_used"]
    env_steps = st.size.envs * st.size.steps
    return {
        "iteration_ms": {k: v * 1e3 for k, v in med.items()},
        "iteration_ms_every_round": {k: meas[k]["median_all_s"] * 1e3 for k in med},
        "env_steps_per_s": {k: env_steps / v for k, v in med.items()},
        "reference": P.seq.name,
        "best_sequential": A.best_seq.name,
        "speedup_vs_sequential": _ratio(med, P.seq, rose),
        "speedup_vs_best_sequential": _ratio(med, A.best_seq, rose),
        "speedup_vs_sequential_default": _ratio(med, P.seq_default, rose),
        "speedup_vs_coarse_pipelining": _ratio(med, P.coarse, rose),
        "speedup_vs_coarse_processes": _ratio(med, A.coarse_proc, rose),
        "coarse_processes": {"best_split": A.coarse_proc.name, "ms": med[A.coarse_proc.name] * 1e3,
                             "calibration_ms (one run per split; the fastest joined the rounds)": P.split_calibration,
                             "measured_in_rounds": [p.name for p in P.process_rows]},
        "best_baseline": {"name": A.best_base.name, "ms": med[A.best_base.name] * 1e3,
                          "bit_identical": A.best_base is not P.seq_default_free},
        "speedup_vs_best_baseline": _ratio(med, A.best_base, rose),
        "rounds": {**st.measured.qualified, "speedup_per_round": {
            "vs_best_baseline": ratio_per_round(meas, A.best_base.name, rose.name, rounds_used),
            "vs_coarse_processes": ratio_per_round(meas, A.coarse_proc.name, rose.name, rounds_used),
            "vs_sequential": ratio_per_round(meas, P.seq.name, rose.name, rounds_used)}},
    }


def _attribution_rows(st: Study, shares: dict[str, float]) -> dict[str, Any]:
    """end_to_end_task_s ... host_speed_probe_ms: where the gain comes from, and the workload."""
    P, A, meas, spec, size = st.plans, st.analysis, st.measured.meas, st.spec, st.size
    med, rose, probes = A.med, P.rose_plan, st.measured.probes
    return {
        "end_to_end_task_s": st.fert.get("end_to_end_task_s") if isinstance(st.fert, dict) else None,
        "attribution": {
            "thread quotas (sequential default -> sequential 1 thread/op)": _ratio(med, P.seq_default, P.seq),
            "placement + pipelining (sequential -> planner)": _ratio(med, P.seq, P.planner_plan),
            "graph rewrites + slack quotas (planner -> planner+Rose)": _ratio(med, P.planner_plan, rose),
            "coarse pipelining vs sequential": _ratio(med, P.seq, P.coarse),
            "coarse pipelining in processes vs sequential": _ratio(med, P.seq, A.coarse_proc),
        },
        # planner, then each rewrite Rose kept applied cumulatively in its order, then the quotas:
        # measured side by side (ms), not modelled
        "rose_ablation_ms": {p.name: med[p.name] * 1e3 for p in (P.planner_plan, *P.steps_kept, rose)},
        "workload": {"envs": size.envs, "steps": size.steps, "epochs": spec.epochs, "minibatches": spec.minibatches,
                     "eval_envs": size.eval_envs, "eval_steps": spec.eval_steps, "learner_threads": spec.learner_threads,
                     "op_threads": st.rt.op_threads, "infer_chunk": spec.infer_chunk,
                     "share_of_sequential_iteration": shares},
        "paired_speedup": {  # median over rounds of the ratio within a round
            "vs_sequential": paired_ratio(meas, P.seq.name, rose.name),
            "vs_best_sequential": paired_ratio(meas, A.best_seq.name, rose.name),
            "vs_coarse_pipelining": paired_ratio(meas, P.coarse.name, rose.name),
            "vs_coarse_processes": paired_ratio(meas, A.coarse_proc.name, rose.name),
            "vs_best_baseline": paired_ratio(meas, A.best_base.name, rose.name),
        },
        "host_speed_probe_ms": {"loops": HOST_PROBE_LOOPS, "per_round": [x * 1e3 for x in probes],
                                "max_over_min": max(probes) / min(probes)},
    }


def _prediction_row(st: Study) -> dict[str, Any]:
    """The cost model's predictions (at planning and per round) against the measurement."""
    P, A, M = st.plans, st.analysis, st.measured
    prof, planning, med, errors = M.prof, P.planning_profile, A.med, A.errors
    planner = P.planner_plan.name
    return {"kappa_thread_slowdown": prof.thread_slowdown, "dispatch_ms_per_op": prof.dispatch_s * 1e3,
            "effective_cores": prof.capacity, "effective_cores_at_planning": planning.capacity,
            "capacity_at_planning": asdict(planning.capacity_reading) if planning.capacity_reading else None,
            "planning_qualified": bool(planning.capacity_reading and planning.capacity_reading.qualified),
            "capacity_probes_before_each_round": M.capacity_probes,
            "ipc": asdict(prof.ipc) if prof.ipc else None,
            "kappa_at_planning": planning.thread_slowdown,
            "predicted_ms": {k: v * 1e3 for k, v in M.predicted.items()},
            "predicted_ms_per_round": [{k: v * 1e3 for k, v in rp.items()} for rp in M.round_predictions],
            "error": errors,
            "planner_prediction_error": errors[planner],
            "planner_prediction_at_planning_ms": P.planning_prediction * 1e3,
            "planner_prediction_error_at_planning": abs(P.planning_prediction - med[planner]) / med[planner]}


def _planner_and_rose_rows(st: Study) -> dict[str, Any]:
    """planner (its plan, regret against brute force) and rose (its plan, windows, decisions, quotas)."""
    P, opt, bf_rows = st.plans, st.plans.opt, st.candidates
    return {
        "planner": {"plan": P.planner_plan.describe(), "table": P.planned.table(),
                    "regret_vs_brute_force": st.regret, "candidates": bf_rows,
                    "mean_abs_error_all_candidates": statistics.fmean(r["error"] for r in bf_rows)},
        "rose": {"ms": st.analysis.med[P.rose_plan.name] * 1e3, "plan": P.rose_plan.describe(),
                 "report": opt.rose.report() if opt else "skipped (--tiny)",
                 "windows_ms": [(w.start * 1e3, w.end * 1e3, w.busy_cores) for w in opt.rose.windows] if opt else [],
                 "decisions": [asdict(d) for d in opt.rose.decisions] if opt else [],
                 "quota_steps": [asdict(q) for q in (opt.quotas.steps if opt and opt.quotas else [])]},
    }


def _sm_row(sm: Any) -> Any:
    if not sm:
        return "skipped (--tiny)"
    return {"label": sm.label, "params": asdict(sm.params),
            "runs": [{"name": r.name, "iteration_ms": r.iteration_s * 1e3, "env_steps_per_s": r.env_steps_per_s,
                      "sm_activity": r.sm_activity} for r in sm.runs],
            "notes": sm.notes, "sensitivity": sm.sweep}


def _load_row(st: Study, load_end: dict[str, float]) -> dict[str, Any]:
    """Load averages and the CPU this process (and its workers) used while the rounds ran."""
    start, end, meas, rows = st.measured.load_start, st.measured.load_end, st.measured.meas, st.plans.rows
    return {"sched_autogroup_enabled": autogroup_scheduling(), "start": st.load_start, "measurement_start": start,
            "measurement_end": end, "end": load_end,
            "process_cpu_cores_during_measurement": (
                (end["process_cpu_s"] + end["children_cpu_s"] - start["process_cpu_s"] - start["children_cpu_s"])
                / max(end["time"] - start["time"], 1e-9)),
            "process_cores_mean": {p.name: statistics.fmean(meas[p.name]["process_cores"]) for p in rows},
            "machine_cores_mean": {p.name: statistics.fmean(meas[p.name]["machine_cores"]) for p in rows}}


def _targets(st: Study) -> dict[str, bool]:
    P, A = st.plans, st.analysis
    med, rose, errors = A.med, P.rose_plan, A.errors
    return {
        ">=1.5x over sequential (1 thread/op reference)": _ratio(med, P.seq, rose) >= 1.5,
        ">=1.5x over the best sequential row (bit-identical)": _ratio(med, A.best_seq, rose) >= 1.5,
        ">=1.5x over the best sequential row reachable by any schedule (work bound)":
            A.bound["max_speedup"][A.best_seq.name] >= 1.5,
        ">=1.15x over coarse pipelining": _ratio(med, P.coarse, rose) >= 1.15,
        ">=1.15x over the best baseline (fastest non-Rose row)": _ratio(med, A.best_base, rose) >= 1.15,
        ">=1.1x over coarse pipelining in processes": _ratio(med, A.coarse_proc, rose) >= 1.1,
        "planner prediction error <= 15%": errors[P.planner_plan.name] <= 0.15,
        "prediction error <= 15% for every plan the scheduler runs (planner, Rose's steps, Rose)":
            all(errors.get(p.name, 1.0) <= 0.15 for p in (P.planner_plan, *P.steps_kept, rose)),
        "quotable: enough rounds had the cores the plans need": st.measured.qualified["quotable"],
    }


def _config_row(st: Study) -> dict[str, Any]:
    size, args, gpu = st.size, st.args, st.gpu
    return {"envs": size.envs, "steps": size.steps, "iterations_per_run": size.iterations, "rounds": size.rounds,
            "quick": size.quick, "tiny": size.tiny, "device": args.device, "mps_eval_percent": args.mps_eval,
            "python": platform.python_version(), "cores": os.cpu_count(),
            "gpu_telemetry": "available" if gpu and gpu.available else (gpu.reason if gpu else "off")}


def build_summary(st: Study) -> dict[str, Any]:
    """NAME.json's body, its keys in the order the report has always had."""
    A = st.analysis
    shares = _op_shares(st.measured.meas[st.plans.seq.name]["last"])
    load_end = load()
    wall = load_end["time"] - st.measured.load_start["time"]
    return {
        **_speedup_rows(st),
        **_attribution_rows(st, shares),
        "prediction": _prediction_row(st),
        **_planner_and_rose_rows(st),
        "work_bound": A.bound,
        "span_bound": A.span,
        "bit_identical_across_plans": A.identical,
        "digests": {k: [list(x) for x in v] for k, v in A.digests.items()},
        "train_workflow": st.fert,
        "sm_model": _sm_row(st.sm),
        "load": _load_row(st, load_end),
        "targets": _targets(st),
        "config": _config_row(st),
        "seconds": time.time() - st.started,
        "seconds_from_measurement_start": wall,
    }


def write_report(st: Study, summary: dict[str, Any]) -> None:
    """NAME.json, NAME.png (the timelines of four rows), NAME_sm_model.png, and the console summary."""
    out_dir, name, P, A = st.args.out, st.args.name, st.plans, st.analysis
    meas, med, bound = st.measured.meas, A.med, A.bound
    (out_dir / f"{name}.json").write_text(json.dumps(summary, indent=2, default=str))
    last = st.size.iterations  # plot the last iteration of each run
    plot_timelines([(f"{P.seq.name} {med[P.seq.name] * 1e3:.0f} ms", meas[P.seq.name]["last"].timeline),
                    (f"coarse pipelining {med[P.coarse.name] * 1e3:.0f} ms", meas[P.coarse.name]["last"].timeline),
                    (f"{A.coarse_proc.name} {med[A.coarse_proc.name] * 1e3:.0f} ms",
                     meas[A.coarse_proc.name]["last"].timeline),
                    (f"planner + Rose {med[P.rose_plan.name] * 1e3:.0f} ms", meas[P.rose_plan.name]["last"].timeline)],
                   out_dir / f"{name}.png", capacity=float(st.rt.devices), iterations=(last, last))
    if st.sm is not None:
        _plot_sm(st.sm, out_dir / f"{name}_sm_model.png")
    start, end = st.measured.load_start, st.measured.load_end
    log(json.dumps({k: summary[k] for k in ("iteration_ms", "attribution", "targets")}, indent=2))
    log(f"work bound: {bound['floor_ms']:.0f} ms ({bound['cpu_work_ms']:.0f} core-ms on {st.rt.devices} cores); "
        f"ceiling vs best sequential {bound['max_speedup'][A.best_seq.name]:.2f}x")
    log(f"speedup vs sequential {summary['speedup_vs_sequential']:.2f}x, vs coarse "
        f"{summary['speedup_vs_coarse_pipelining']:.2f}x; planner prediction error "
        f"{A.errors[P.planner_plan.name]:.1%}, regret {st.regret:.1%}; bit-identical {A.identical}; "
        f"load {start['loadavg_1m']:.2f}->{end['loadavg_1m']:.2f}; "
        f"{summary['seconds']:.0f} s; wrote {out_dir / name}.json/.png")


def main() -> None:
    args = parse_args()
    s = load_settings()
    if args.train_workflow_only:
        run_train_workflow_only(s, args)
        return
    size = study_sizes(args)
    cfg = study_config(s.scheduler, size.tiny)
    started = time.time()
    load_start = load()
    gpu = GpuTelemetry() if cfg.gpu_telemetry else None
    log_start(size, gpu, load_start)
    spec, rt = build_runtime(s, cfg, args.device, size, gpu)
    plans = build_plans(rt, args, size)
    measured = measure(rt, plans, size, cfg)
    analysis = analyse(rt, plans, measured)
    candidates, regret = brute_force(rt, plans.planned, size)
    # the train task's own workflow (FERT fine-tuning through the one trainer)
    fert: dict[str, Any] = {"skipped": True}
    if not (args.no_fert or size.tiny):
        fert = train_workflow_section(s, size.quick, size.iterations)
    sm = sm_section(size)
    args.out.mkdir(parents=True, exist_ok=True)
    st = Study(args, size, spec, rt, gpu, started, load_start, plans, measured, analysis, candidates, regret, fert, sm)
    write_report(st, build_summary(st))


def rose_steps(rt: Any, planner_plan: Plan, opt: Any) -> list[Plan]:
    """The planner's plan with each rewrite Rose kept applied in Rose's order, one plan per step
    (cumulative), so each step's gain is measured. Rewrites are rebuilt by name on the plan they
    were applied to, as Rose did."""
    from components.scheduler.rose import candidate_transformations

    rows, current = [], planner_plan
    for decision in (d for d in opt.rose.decisions if d.kept):
        workflow = rt.workflow_at(current.groups or 1)
        replicas = max(int(rt.profile().capacity or rt.devices), 1)
        rewrite = next(t for t in candidate_transformations(workflow, current, replicas, rt.roles.rollout,
                                                           rt.cfg.pipeline_stages)
                       if t.name == decision.name)
        current = rewrite.apply(current).with_(name=f"{current.name}+{rewrite.name}")
        rows.append(current)
    return rows


def work_bound(reference_s: float, reference_cores: float, devices: int, rows: dict[str, float]) -> dict[str, Any]:
    """The fastest any schedule of these ops could be: their CPU work (the 1-thread reference's
    iteration time x the cores it kept busy, as measured) spread perfectly over every core. Giving an
    op more threads never makes it cheaper in CPU time, so no plan beats this bound; ``max_speedup``
    is each sequential row's time over it, the ceiling of any speed-up claimed against that row."""
    work = reference_s * reference_cores
    floor = work / devices
    return {"cpu_work_ms": work * 1e3, "devices": devices, "floor_ms": floor * 1e3,
            "max_speedup": {name: t / floor for name, t in rows.items()}}


def span_bound(workflow: Any, rows: dict[str, tuple[Any, bool]], best_baseline_s: float, work_floor_s: float,
               target: float = 1.15, unroll: tuple[int, int] = (2, 8)) -> dict[str, Any]:
    """The other floor of a bit-identical schedule: its critical path, from measured op times.

    ``rows``: plan name -> (its last RunResult, whether its weights were bit-identical to the
    reference's). Each op weighs its fastest median over the rows (warm-up iteration left out) that
    a bit-identical plan could copy: every bit-identical row, and for an op whose results do not
    depend on its thread count (``quota_invariant``) the other rows too. Placement changes op times
    (an op in a process of its own can run faster than in the parent), so every row counts, not
    just the sequential ones. The longest path through the workflow's semantic edges (version
    dependencies, double-bufferable states double-buffered, no schedule edges) grows by the span per
    iteration; no bit-identical plan iterates faster than max(span, CPU-work floor), up to
    measurement noise."""
    from components.scheduler.graph import build_graph, critical_path

    invariant = {op.name for op, _ in workflow.ops_with_scope() if op.quota_invariant}
    weight: dict[str, float] = {}
    source: dict[str, str] = {}
    for name, (result, identical) in rows.items():
        by_op: dict[str, list[float]] = {}
        for sp in result.timeline.spans:
            if sp.iteration >= 1:
                by_op.setdefault(sp.op, []).append(sp.duration)
        for op, durations in by_op.items():
            d = statistics.median(durations)
            if (identical or op in invariant) and d < weight.get(op, float("inf")):
                weight[op], source[op] = d, name
    # every state a plan may double-buffer, double-buffered: the fewest write-after-read waits
    buffers = {st.name: 2 for st in workflow.states if st.double_bufferable and st.buffers == 1}
    lengths = []
    for k in unroll:
        graph = build_graph(workflow, range(k), buffers)
        lengths.append(critical_path(graph, [weight.get(i.op.name, 0.0) for i in graph.instances])[0])
    span = (lengths[1] - lengths[0]) / (unroll[1] - unroll[0])
    floor = max(span, work_floor_s)
    return {"span_ms": span * 1e3, "op_ms": {k: v * 1e3 for k, v in sorted(weight.items())},
            "op_fastest_in": dict(sorted(source.items())), "floor_ms": floor * 1e3,
            "max_speedup_vs_best_baseline": best_baseline_s / floor,
            f"{target}x_over_best_baseline_reachable": best_baseline_s / target >= floor}


def measured_span_bound(rt: Any, plans: list[Plan], meas: dict[str, dict[str, Any]], digests: dict[str, Any],
                        reference: Plan, best_baseline_s: float, work_floor_s: float) -> dict[str, Any]:
    """``span_bound`` of measured plans (``meas``, ``digests`` by plan name), per env-group count
    they ran at (op times differ with the group size; a workflow without groups has one count),
    each from the rows at that count; the lowest holds for every plan at those counts (plans at
    counts nobody measured are not covered)."""
    by_m: dict[int, dict[str, tuple[Any, bool]]] = {}
    for p in plans:
        by_m.setdefault(p.groups or 1, {})[p.name] = (meas[p.name]["last"], digests[p.name] == digests[reference.name])
    spans = {m: span_bound(rt.workflow_at(m), rows, best_baseline_s, work_floor_s) for m, rows in sorted(by_m.items())}
    lowest = min(spans.values(), key=lambda b: b["floor_ms"])
    return {**lowest, "env_groups_covered": sorted(spans), "by_env_groups": {str(m): b for m, b in spans.items()}}


def _torch_default_threads() -> int:
    import torch

    return torch.get_num_threads()


def _op_shares(result: Any) -> dict[str, float]:
    """Each op's share of the sequential iteration (last measured iteration)."""
    last = max(s.iteration for s in result.timeline.spans)
    spans = [s for s in result.timeline.spans if s.iteration == last]
    total = sum(s.duration for s in spans)
    out: dict[str, float] = {}
    for sp in spans:
        out[sp.op] = out.get(sp.op, 0.0) + sp.duration / total
    return dict(sorted(out.items(), key=lambda x: -x[1]))


def _evaluator_as_mps_client(plan: Plan, percent: int) -> Plan:
    """The evaluator in its own process, launched with CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=percent."""
    workers = [w.__class__(w.name, tuple(c for c in w.components if c != "evaluator"), w.kind, w.cores)
               for w in plan.workers]
    workers = [w for w in workers if w.components]
    workers.append(WorkerSpec("eval-mps", ("evaluator",), kind="process"))
    return plan.with_(name=f"{plan.name}+mps-eval{percent}", workers=tuple(workers),
                      gpu_percent={**plan.gpu_percent, "evaluator": percent})


def _plot_sm(sm: Any, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3 if sm.sweep else 2, figsize=(13 if sm.sweep else 9, 3.8))
    names = [r.name for r in sm.runs]
    axes[0].bar(names, [r.env_steps_per_s / 1e3 for r in sm.runs], color="#4e79a7")
    axes[0].set_ylabel("k env-steps/s (modelled)")
    axes[1].bar(names, [r.sm_activity for r in sm.runs], color="#f28e2b")
    axes[1].set_ylabel("SM activity (modelled)")
    for ax in axes[:2]:
        ax.tick_params(axis="x", rotation=20, labelsize=7)
    if sm.sweep:
        for scale in sorted({r["cap_scale"] for r in sm.sweep}):
            rows = [r for r in sm.sweep if r["cap_scale"] == scale]
            axes[2].plot([r["interference"] for r in rows], [r["throughput_gain_vs_coarse"] for r in rows], marker="o",
                         label=f"parallelism cap x{scale}")
        axes[2].set_xlabel("interference")
        axes[2].set_ylabel("Rose / coarse throughput")
        axes[2].legend(fontsize=7)
    fig.suptitle(sm.label, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    main()
