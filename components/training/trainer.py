"""The one trainer: a training set + starting weights -> a policy, run as a scheduler workflow.

    make_trainer(settings, data, init) ──TrainSpec──► Trainer
       .choose()  the plan: scheduler.plan, or ``auto``: cached per machine and workload shape, else
                  profile → M2Flow plan → Rose → kept only if its whole task (start-up + the task's
                  iterations, measured) is faster than sequential's (coarse process pipelining is
                  measured beside them)
       .run()     the iterations (``workflow.train_workflow``) under that plan ──► TrainRun
                  (policy, per-step losses, per-iteration time and validation, plan, time split)

Every plan gives bit-identical weights (tests), so the plan only changes how long training takes.
The flow's train task, ``fleetloop stage train`` (``dvc repro``), expert-parallel ranks under
torchrun and the FATS fleet trainer all train through here.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import platform
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from components.config import SchedulerConfig, Settings
from components.fsio import atomic_write_text
from components.policy.moe import StepUsage
from components.policy.normalizer import NormalizedPolicy
from components.scheduler.plan import Plan, plan_from_dict, plan_to_dict
from components.scheduler.profiler import Timeline
from components.scheduler.runtime import Roles, SchedulerRuntime
from components.training.bc import total_steps
from components.training.determinism import resolve_device
from components.training.imitation import TrainingSet
from components.training.workflow import TrainSpec, ValidationSpec, train_workflow

Log = Callable[[str], None]
IterationFn = Callable[[int, dict[str, Any]], None]  # (iteration, recorded states), from a worker thread
PLAN_CACHE_VERSION = 4  # 2: auto decides on the train task's time (start-up + its iterations); 3: coarse processes measured too; 4: Rose may replicate stateless side work by turns


@dataclass(frozen=True)
class PlanChoice:
    """Which plan runs and why; medians are from one interleaved measurement (same machine load)."""

    plan: Plan
    requested: str  # scheduler.plan
    source: str  # fixed | measured | cache
    sequential_s: float | None = None  # median iteration seconds of the sequential plan
    chosen_s: float | None = None  # ... of the chosen plan, in the same measurement
    candidates: dict[str, float] = field(default_factory=dict)  # plan name -> median seconds
    task_s: dict[str, float] = field(default_factory=dict)  # plan name -> this task's predicted seconds

    @property
    def predicted_s(self) -> float | None:
        return self.plan.predicted_s


@dataclass
class TrainRun:
    policy: NormalizedPolicy
    losses: list[float]  # one per optimizer step
    iteration_s: list[float]
    validation: list[float]  # success rate of each iteration's starting weights on validation robots
    choice: PlanChoice
    timeline: Timeline
    seconds: float
    shuffle_bytes_sent: int = 0  # expert-parallel: row payload this rank sent to other ranks
    expert_usage: list[StepUsage] = field(default_factory=list)  # MoE: one per optimizer step

    @property
    def median_iteration_s(self) -> float:
        steady = self.iteration_s[1:] or self.iteration_s
        return float(statistics.median(steady)) if steady else math.nan

    @property
    def speedup_vs_sequential(self) -> float | None:
        """The sequential plan's median iteration time (plan choice) over this run's."""
        if self.choice.sequential_s is None or not self.median_iteration_s:
            return None
        return self.choice.sequential_s / self.median_iteration_s

    def stage_seconds(self) -> dict[str, float]:
        """Seconds spent in each op (summed over iterations); overlapping ops both count."""
        return {op: float(sum(d)) for op, d in sorted(self.timeline.op_durations().items())}


class Trainer:
    def __init__(self, spec: TrainSpec, cfg: SchedulerConfig, cache_dir: Path | None = None,
                 log: Log | None = None) -> None:
        self.spec = spec
        self.cfg = cfg.model_copy(update={"pipeline_stages": (1,)})  # no env groups to split
        self.cache_dir = cache_dir
        self.log = log or (lambda _: None)
        self._runtime: SchedulerRuntime | None = None

    @property
    def runtime(self) -> SchedulerRuntime:
        if self._runtime is None:
            chain = ("sampler", "augmenter", "learner") if self.spec.sees_cameras else ("sampler", "learner")
            roles = Roles(chain=chain, streaming={}, envs=1,
                          pinned_threads={"learner": self.spec.learner_threads})
            params = {k: v.detach().clone() for k, v in _initial_state(self.spec).items()}
            self._runtime = SchedulerRuntime(lambda m: train_workflow(self.spec, m), roles, self.cfg, self.spec,
                                             {"params": params}, record=("stats", "valm"), log=self.log)
        return self._runtime

    # ------------------------------------------------------------------ the plan
    def choose(self, kind: str | None = None) -> PlanChoice:
        kind = kind or self.cfg.plan
        if kind != "auto":
            return PlanChoice(self.runtime.choose(kind), kind, "fixed")
        cached = self._cached()
        if cached is not None:
            return cached
        choice = self._measure_auto()
        reading = self.runtime.profile().capacity_reading
        if reading is None or reading.qualified:
            self._store(choice)
        else:  # a plan decided while the host held a core is used once, not cached for this machine
            self.log(f"plan auto: not cached ({reading.note()})")
        return choice

    def _measure_auto(self) -> PlanChoice:
        """Planner + Rose propose; one interleaved measurement against sequential, and against
        coarse process pipelining (every component in its own process: the baseline a user would
        write), decides. The cost model can misjudge a workflow whose side op is its longest (the
        vision workflow's camera validation: Rose predicted no gain from prefetching where the
        coarse split measured faster), so the baseline is measured, never assumed slower."""
        rt = self.runtime
        planned = rt.plan().best.plan
        sequential = rt.sequential()
        sequential = sequential.with_(predicted_s=rt.predict(sequential))  # logged beside the measured time
        optimized = rt.optimize(planned).plan
        proposed: dict[str, Plan] = {}  # by name: a plan proposed twice is measured once
        for plan in (planned, optimized, rt.coarse_processes()):
            if not _serial(plan):
                proposed.setdefault(plan.name, plan)
        plans = [sequential, *proposed.values()]
        costs = dict(zip((p.name for p in plans), rt.measure_costs(plans), strict=True))
        task = {n: c.task_s(self.spec.iterations) for n, c in costs.items()}
        chosen = plans[fastest_task(list(task.values()), self.cfg.accept_margin)]
        self.log(f"plan auto: {chosen.name} for {self.spec.iterations} iterations (" + ", ".join(
            f"{n} {c.iteration_s * 1e3:.1f} ms/iteration + {c.fixed_s:.1f} s start-up = {task[n]:.1f} s"
            for n, c in costs.items()) + ")")
        by_name = {n: c.iteration_s for n, c in costs.items()}
        return PlanChoice(chosen, "auto", "measured", by_name[sequential.name], by_name[chosen.name], by_name, task)

    def shape_key(self) -> str:
        """What the plan's speed depends on: workload shape, scheduler knobs and this machine."""
        s = self.spec
        shape = {
            "v": PLAN_CACHE_VERSION, "policy": s.policy.model_dump(mode="json"), "batch": s.batch_size,
            "steps_per_iteration": s.steps_per_iteration, "dims": [s.obs_dim, s.act_dim],
            "weighted": s.data.weights is not None,  # not the frame count: drawing a batch costs the same
            "validation": None if s.validation is None else [s.validation.sim.name, s.validation.sim.max_steps,
                                                             len(s.validation.robot_ids), s.validation.episodes_per_robot],
            "learner_threads": s.learner_threads, "device": s.device, "scheduler": self.cfg.model_dump(mode="json", exclude={"plan", "iterations"}),
            "machine": [platform.machine(), os.cpu_count(), platform.python_version(), torch.__version__],
        }
        return hashlib.sha256(json.dumps(shape, sort_keys=True).encode()).hexdigest()[:16]

    def _cache_path(self) -> Path | None:
        return None if self.cache_dir is None else self.cache_dir / f"train-{self.shape_key()}.json"

    def _cached(self) -> PlanChoice | None:
        path = self._cache_path()
        if path is None or not path.exists():
            return None
        try:
            raw = json.loads(path.read_text())
            choice = PlanChoice(plan_from_dict(raw["plan"]), "auto", "cache", raw["sequential_s"], raw["chosen_s"],
                                dict(raw["candidates"]), dict(raw["task_s"]))
        except (ValueError, KeyError, TypeError) as exc:
            self.log(f"plan cache {path} unreadable ({exc}); profiling again")
            return None
        self.log(f"plan auto: {choice.plan.name} from the cache {path.name}")
        return choice

    def _store(self, choice: PlanChoice) -> None:
        path = self._cache_path()
        if path is None:
            return
        atomic_write_text(path, json.dumps({
            "plan": plan_to_dict(choice.plan), "sequential_s": choice.sequential_s, "chosen_s": choice.chosen_s,
            "candidates": choice.candidates, "task_s": choice.task_s, "measured_at": time.time(),
        }, indent=2))

    # ------------------------------------------------------------------ training
    def run(self, choice: PlanChoice | None = None, on_iteration: IterationFn | None = None) -> TrainRun:
        choice = choice or self.choose()
        start = time.perf_counter()
        result = self.runtime.run(choice.plan, self.spec.iterations, on_iteration=on_iteration)
        seconds = time.perf_counter() - start
        per_iter = {k.version[0]: v for k, v in result.records.items() if k.state == "stats"}
        losses = [x for i in sorted(per_iter) for x in per_iter[i]["losses"]]
        usage = [u for i in sorted(per_iter) for u in per_iter[i].get("expert_usage", [])]
        val = {k.version[0]: v["success_rate"] for k, v in result.records.items() if k.state == "valm"}
        policy = self.spec.new_policy()
        policy.load_state_dict(result.final["params"])
        policy.eval()
        sent = int(per_iter[max(per_iter)].get("shuffle_bytes_sent", 0)) if per_iter else 0
        return TrainRun(policy, losses, list(result.iteration_s), [val[i] for i in sorted(val)], choice,
                        result.timeline, seconds, sent, usage)


def fastest_task(task: list[float], margin: float) -> int:
    """Index of the plan whose whole task (``RunCost.task_s``: its fixed cost + the task's steady
    iterations) is fastest; the first (sequential) unless another beats it by ``margin``. A plan
    that starts a process saves per iteration but pays its start-up on every task: for a short
    task that loses."""
    best = int(np.argmin(task))
    return best if best != 0 and task[best] <= task[0] * (1 - margin) else 0


def _serial(plan: Plan) -> bool:
    """One worker, nothing hoisted: the sequential schedule under another name (measuring it
    against sequential would only measure noise)."""
    return len(plan.workers) == 1 and not plan.hoist


def _initial_state(spec: TrainSpec) -> dict[str, torch.Tensor]:
    from components.training.workflow import initial_policy

    return initial_policy(spec).state_dict()


def train_spec(settings: Settings, data: TrainingSet, init: NormalizedPolicy | None = None,
               validate: bool = True) -> TrainSpec:
    """The run ``settings`` asks for on ``data``, fine-tuning ``init`` when given."""
    t = settings.train
    validation = None
    if validate and t.validation_robots > 0:
        validation = ValidationSpec(settings.sim, tuple(settings.fleet.validation_ids(t.validation_robots)),
                                    t.validation_episodes, settings.seed)
    return TrainSpec(
        data=data, policy=settings.policy, lr=t.lr, lr_schedule=t.lr_schedule, weight_decay=t.weight_decay,
        batch_size=t.batch_size, state_noise=t.state_noise,
        seed=settings.seed, total_steps=total_steps(len(data.states), t.batch_size, t.epochs),
        steps_per_iteration=t.steps_per_iteration,
        init_state=None if init is None else {k: v.detach().clone() for k, v in init.state_dict().items()},
        validation=validation, learner_threads=max(1, t.threads),
        device=str(resolve_device(settings.device)),  # params.yaml `device`: auto = the learner on CUDA when present
    )


def plan_cache_dir(settings: Settings) -> Path:
    return settings.root / ".fleetloop" / "plans"


def make_trainer(settings: Settings, data: TrainingSet, init: NormalizedPolicy | None = None,
                 log: Log | None = None, validate: bool = True) -> Trainer:
    """The trainer every entry point uses: same data + params + starting weights = same weights."""
    return Trainer(train_spec(settings, data, init, validate), settings.scheduler, plan_cache_dir(settings), log)
