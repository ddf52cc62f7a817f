"""Train step for ``train.workload: ppo``: PPO on the built-in fleet simulator, through the scheduler.

(``train.workload: imitation``, the default, trains ``train.method`` with the one trainer in
``steps.train_policy``, also through the scheduler.)

    Settings ──workload spec (fleet robots, held-out robots, scheduler sizes)──► SchedulerRuntime
       ──scheduler.plan (sequential | coarse | planner | rose)──► iterations, reported one by one
       ──► ScheduledTrainOutcome: the same TrainOutcome the imitation path returns (the policy in
           ``result.policy``, lineage, frames) plus ``schedule`` (plan text, per-iteration times)

* ``ppo`` — PPO on the built-in fleet simulator, every fleet robot one env; the actor starts from
  the champion when there is one. ``frames`` counts the env steps trained on.

Every plan gives bit-identical weights (tests), so the plan only changes how long it takes.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from components.config import SchedulerConfig, Settings
from components.pipeline.steps import TrainOutcome, current_lineage, in_caller_context
from components.pipeline.workspace import Workspace
from components.policy.factory import make_policy
from components.training.imitation import ProgressFn, TrainResult
from components.training.workloads.ppo import PPOSpec, initial_params, run_ppo

SCHEDULED_WORKLOADS = ("ppo",)


@dataclass(frozen=True)
class ScheduleReport:
    """How the scheduled workload ran: the plan and one row per iteration."""

    workload: str
    plan_name: str
    plan_text: str
    iteration_s: list[float]
    losses: list[float]
    eval_successes: list[float]  # held-out evaluation of the weights each iteration started from
    env_steps_per_s: float | None = None  # PPO: rollout env steps per second (median iteration)

    def metrics(self) -> dict[str, float]:
        """Flat numbers for a tracking run."""
        steady = self.iteration_s[1:] or self.iteration_s
        out = {"iterations": float(len(self.iteration_s)), "median_iteration_s": float(np.median(steady)),
               "final_loss": self.losses[-1] if self.losses else math.nan}
        if self.env_steps_per_s is not None:
            out["env_steps_per_s"] = self.env_steps_per_s
        return out


@dataclass
class ScheduledTrainOutcome(TrainOutcome):
    """``TrainOutcome`` (what evaluation, lineage and promotion read) plus the schedule report."""

    schedule: ScheduleReport | None = field(default=None)


def train_scheduled(settings: Settings, progress: ProgressFn | None = None,
                    log: Callable[[str], None] | None = None) -> ScheduledTrainOutcome:
    """Run ``settings.train.workload`` through the scheduler (plan ``settings.scheduler.plan``)."""
    workload = settings.train.workload
    if workload not in SCHEDULED_WORKLOADS:
        raise ValueError(f"train.workload={workload!r} does not run through the scheduler; "
                         f"use one of {SCHEDULED_WORKLOADS} (or 'imitation' for steps.train_policy)")
    ws = Workspace(settings)
    total = settings.scheduler.iterations
    on_iteration = _progress_callback(progress, total)
    return _train_ppo(settings, ws, on_iteration, log)


def _progress_callback(progress: ProgressFn | None, total: int) -> Callable[[int, dict[str, Any]], None] | None:
    """Per-iteration executor callback -> ``progress(iterations done, total, loss)``."""
    if progress is None:
        return None
    report = in_caller_context(progress)

    def on_iteration(i: int, recorded: dict[str, Any]) -> None:
        report(i + 1, total, float(recorded.get("stats", {}).get("loss", math.nan)))

    return on_iteration


MIN_GROUP_ENVS = 2  # one-row groups are refused by the chunk rule; groups of 2 match one group bit for bit (a test)


def _scheduler_cfg(cfg: SchedulerConfig, envs: int) -> tuple[SchedulerConfig, int]:
    """Stage counts that split ``envs`` evenly into groups of at least ``MIN_GROUP_ENVS``, and the
    inference chunk every group size divides (their gcd: stages (1, 2, 3) of 12 envs give groups
    of 12, 6 and 4, which the smallest group, 4, does not all divide)."""
    stages = tuple(m for m in cfg.pipeline_stages if envs % m == 0 and envs // m >= MIN_GROUP_ENVS) or (1,)
    chunk = math.gcd(*(envs // m for m in stages))
    return cfg.model_copy(update={"pipeline_stages": stages}), chunk


def ppo_spec(settings: Settings) -> tuple[PPOSpec, SchedulerConfig]:
    """The PPO workload the train task runs (every fleet robot one env) and its scheduler config."""
    robots = tuple(settings.fleet.robot_ids())
    cfg, chunk = _scheduler_cfg(settings.scheduler, len(robots))
    sc = settings.scheduler
    spec = PPOSpec(sim=settings.sim, policy=settings.policy, robot_ids=robots,
                   eval_robot_ids=tuple(settings.fleet.heldout_ids()), steps=sc.ppo_steps, epochs=sc.ppo_epochs,
                   minibatches=sc.ppo_minibatches, eval_steps=sc.ppo_eval_steps, infer_chunk=chunk,
                   seed=settings.seed)
    return spec, cfg


def _train_ppo(settings: Settings, ws: Workspace, on_iteration: Any, log: Any) -> ScheduledTrainOutcome:
    spec, cfg = ppo_spec(settings)
    sc = settings.scheduler
    params = initial_params(spec)
    champion = ws.registry.load("champion") if ws.registry.champion() is not None else None
    if champion is not None:  # fine-tune the fleet's policy: the actor starts from the champion
        for k, v in champion.state_dict().items():
            params[f"actor.{k}"] = v.detach().clone()
    t0 = time.perf_counter()
    plan = "planner" if sc.plan == "auto" else sc.plan  # PPO keeps no plan cache: auto = the planner's plan
    res = run_ppo(spec, cfg, sc.iterations, plan=plan, params=params, log=log, on_iteration=on_iteration)
    seconds = time.perf_counter() - t0
    policy = make_policy(ws.obs_dim, ws.act_dim, settings.policy)
    policy.load_state_dict(res.policy_weights)
    policy.eval()
    losses = [m.loss for m in res.metrics]
    frames = spec.envs * spec.steps * sc.iterations
    report = ScheduleReport("ppo", res.plan.name, res.plan_text, [m.seconds for m in res.metrics], losses,
                            [m.eval_successes for m in res.metrics], res.env_steps_per_s)
    result = TrainResult(policy=policy, losses=losses, steps=sc.iterations * spec.epochs * spec.minibatches,
                         seconds=seconds, device=spec.device)
    return ScheduledTrainOutcome(result, current_lineage(settings, ws, frames), frames, schedule=report)
