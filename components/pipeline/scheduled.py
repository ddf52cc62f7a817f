"""Train step through the embedded scheduler: ``train.workload: ppo | fert_iteration``.

    Settings ──workload spec (fleet robots, held-out robots, scheduler sizes)──► SchedulerRuntime
       ──scheduler.plan (sequential | coarse | planner | rose)──► iterations, reported one by one
       ──► ScheduledTrainOutcome: the same TrainOutcome the imitation path returns (the policy in
           ``result.policy``, lineage, frames) plus ``schedule`` (plan text, per-iteration times)

* ``ppo`` — PPO on the built-in fleet simulator, every fleet robot one env; the actor starts from
  the champion when there is one. ``frames`` counts the env steps trained on.
* ``fert_iteration`` — FERT fine-tuning iterations on the stored dataset: failure windows of the
  stored failed episodes query the segment store, retrieved successes and demos form the batch,
  and each iteration's held-out evaluation yields the next failure queries.

Every plan gives bit-identical weights (tests), so the plan only changes how long it takes.
"""

from __future__ import annotations

import contextvars
import hashlib
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from components.config import SchedulerConfig, Settings
from components.pipeline.steps import TrainOutcome, current_lineage
from components.pipeline.workspace import Workspace
from components.policy.factory import make_policy
from components.policy.normalizer import NormalizedPolicy
from components.store.encoder import NormalizedStateEncoder
from components.training.imitation import ProgressFn, TrainResult
from components.training.workloads.ppo import PPOSpec, initial_params, run_ppo

SCHEDULED_WORKLOADS = ("ppo", "fert_iteration")


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
    if workload == "ppo":
        return _train_ppo(settings, ws, on_iteration, log)
    return _train_fert(settings, ws, on_iteration, log)


def _progress_callback(progress: ProgressFn | None, total: int) -> Callable[[int, dict[str, Any]], None] | None:
    """The executor calls back from a worker thread; run ``progress`` in the caller's context
    (Prefect's run context lives in context variables, which new threads do not inherit)."""
    if progress is None:
        return None
    ctx = contextvars.copy_context()

    def on_iteration(i: int, recorded: dict[str, Any]) -> None:
        loss = float(recorded.get("stats", {}).get("loss", math.nan))
        ctx.run(progress, i + 1, total, loss)  # the executor serializes these calls

    return on_iteration


def _scheduler_cfg(cfg: SchedulerConfig, envs: int) -> tuple[SchedulerConfig, int]:
    """Stage counts that split ``envs`` evenly, and the inference chunk every group size divides."""
    stages = tuple(m for m in cfg.pipeline_stages if envs % m == 0) or (1,)
    chunk = envs // max(stages)
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
    res = run_ppo(spec, cfg, sc.iterations, plan=sc.plan, params=params, log=log, on_iteration=on_iteration)
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
    return ScheduledTrainOutcome(result, current_lineage(settings, ws, frames), frames, report)


def _train_fert(settings: Settings, ws: Workspace, on_iteration: Any, log: Any) -> ScheduledTrainOutcome:
    from components.training.workloads.fert_iteration import (
        FertData,
        FertIterSpec,
        StoreFertHooks,
        run_fert_iterations,
    )

    episodes = list(ws.dataset.episodes())
    successes = [e for e in episodes if e.success]
    if not successes:
        raise RuntimeError(f"train.workload=fert_iteration needs successful episodes in {settings.paths.episodes}; "
                           "run `fleetloop ingest` with expert demos first")
    encoder = ws.store.load_encoder()
    if not isinstance(encoder, NormalizedStateEncoder):
        raise RuntimeError(
            f"train.workload=fert_iteration queries the segment store {settings.paths.store} with its encoder, "
            f"which is {type(encoder).__name__ if encoder is not None else 'missing'}; it needs the "
            "normalized_state encoder (fert.encoder: normalized_state, then re-ingest)")
    sc = settings.scheduler
    demo_s = np.concatenate([e.states for e in successes]).astype(np.float32)
    demo_a = np.concatenate([e.actions for e in successes]).astype(np.float32)
    hooks = StoreFertHooks(settings.paths.store, settings.store, settings.fert, encoder.state_dict(),
                           {e.episode_id: e for e in successes}, (demo_s, demo_a), settings.train.batch_size)
    champion = ws.registry.load("champion") if ws.registry.champion() is not None else None
    if champion is None:
        torch.manual_seed(settings.seed)
        champion = make_policy(ws.obs_dim, ws.act_dim, settings.policy)
        assert isinstance(champion, NormalizedPolicy)
        champion.obs_norm.fit(torch.from_numpy(demo_s))
        champion.act_norm.fit(torch.from_numpy(demo_a))
    params = {k: v.detach().clone() for k, v in champion.state_dict().items()}
    w = settings.store.window
    failed = [e for e in episodes if not e.success and e.length >= w]
    windows = [e.states[s:s + w] for e in failed for s in range(0, e.length - w + 1, settings.store.stride)]
    windows = _subsample(windows, settings.fert.max_queries, settings.seed)
    queries = hooks.failure_queries(np.stack(windows) if windows else np.zeros((0, w, ws.obs_dim), np.float32))
    data = FertData(hooks, params, queries)
    spec = FertIterSpec(sim=settings.sim, policy=settings.policy, eval_robot_ids=tuple(settings.fleet.heldout_ids()),
                        hooks=hooks, window=w, eval_steps=sc.fert_eval_steps, learn_steps=sc.fert_learn_steps,
                        lr=settings.train.lr, seed=settings.seed)
    t0 = time.perf_counter()
    res = run_fert_iterations(spec, data, sc, sc.iterations, plan=sc.plan, log=log, on_iteration=on_iteration)
    seconds = time.perf_counter() - t0
    policy = make_policy(ws.obs_dim, ws.act_dim, settings.policy)
    policy.load_state_dict(res.weights)
    policy.eval()
    frames = int(sum(len(e.states) for e in successes))
    report = ScheduleReport("fert_iteration", res.plan.name, res.plan_text, res.iteration_s, res.losses,
                            res.success_rates)
    result = TrainResult(policy=policy, losses=res.losses, steps=sc.iterations * sc.fert_learn_steps,
                         seconds=seconds, device="cpu")
    return ScheduledTrainOutcome(result, current_lineage(settings, ws, frames), frames, report)


def _subsample(windows: list[np.ndarray], limit: int, seed: int) -> list[np.ndarray]:
    """At most ``limit`` windows, a seeded choice (deterministic for the same data and seed)."""
    if len(windows) <= limit:
        return windows
    digest = int.from_bytes(hashlib.blake2b(repr((seed, len(windows))).encode(), digest_size=8).digest(), "little")
    keep = np.sort(np.random.default_rng(digest).choice(len(windows), size=limit, replace=False))
    return [windows[i] for i in keep]
