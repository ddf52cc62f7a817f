"""Embodied RL iteration: PPO on the built-in fleet simulator, run through the scheduler.

One iteration (CleanRL's PPO, written as a workflow so any plan can run it):

    draw       noise@i                  one N(0,1) block for every env and step (group-independent)
    reset[g]   obs[g]@0, env[g]@0       reseeded from (seed, i): episode layouts per robot
    for t < T, for g < G:
      infer[g]     act[g]@t <- obs[g]@t, params@i, noise@i  a = μ(o) + σ·ε,  log π(a|o),  V(o)
      env_step[g]  obs[g]@t+1, rew[g]@t <- act[g]@t, env[g]@t
    bootstrap[g] last[g]@i  <- obs[g]@T, params@i           V(o_T)
    advantage[g] adv[g]@i   <- rollout of group g, last[g]@i   GAE(γ, λ)
    learn        params@i+1 <- adv[*]@i, params@i           clipped surrogate + value + entropy, Adam
    eval         evalm@i    <- params@i                     held-out robots, mean actions (previous weights)

Every random draw is per robot (sim) or per (iteration, env) (noise, minibatch order), so the
trajectories and weights do not depend on the group count or the plan; tests check it bit for bit.
Inference loads ``params@i`` into its model the first time an op of iteration ``i`` reads it, so the
simulator and the policy hold only per-group state: a plan may replicate them, one replica per set
of env groups on its own process (data-parallel rollout).
``run_ppo`` is what the Prefect train task calls.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from torch import nn

from components.config import PolicyConfig, SchedulerConfig, SimConfig
from components.policy.factory import make_policy
from components.policy.mlp import MLPPolicy
from components.scheduler.executor import RunResult
from components.scheduler.plan import Plan
from components.scheduler.profiler import GpuTelemetry, Timeline
from components.scheduler.runtime import Roles, SchedulerRuntime
from components.scheduler.workflow import BuildContext, Component, ForEach, OpSpec, StateSpec, Workflow
from components.sim import action_dim, make_env, observation_dim

STEP_REWARD_PER_STAGE = 0.01  # dense shaping: stage index (reach..place) per step, plus 1 on success
NOISE_STREAM, MINIBATCH_STREAM, RESET_STREAM, EVAL_STREAM = 11, 12, 13, 14


@dataclass(frozen=True)
class PPOSpec:
    """PPO sizes and hyper-parameters (named as in CleanRL). Picklable: the workload payload."""

    sim: SimConfig
    policy: PolicyConfig
    robot_ids: tuple[str, ...]
    eval_robot_ids: tuple[str, ...]
    steps: int = 64
    epochs: int = 2
    minibatches: int = 4
    lr: float = 3e-4
    gamma: float = 0.99
    gae_lambda: float = 0.95
    clip: float = 0.2
    vf_coef: float = 0.5
    ent_coef: float = 0.0
    init_log_std: float = -0.5
    eval_steps: int = 32
    learner_threads: int = 1  # numerics of the learner: the same in every plan and the reference
    seed: int = 0
    infer_chunk: int = 32  # rows per inference call: fixed, so results never depend on the group size
    device: str = "cpu"  # "cuda": policy, learner and evaluator models on the GPU (benchmarks/gpu_check.sh)

    @property
    def envs(self) -> int:
        return len(self.robot_ids)


def _seed(*parts: int) -> int:
    return int.from_bytes(hashlib.blake2b(repr(parts).encode(), digest_size=8).digest(), "little") % (2**63)


class ActorCritic(nn.Module):
    """The fleet policy (``make_policy``) as the Gaussian mean, a state-independent log σ, and a critic."""

    def __init__(self, spec: PPOSpec) -> None:
        super().__init__()
        torch.manual_seed(spec.seed)
        obs_dim, act_dim = observation_dim(spec.sim), action_dim(spec.sim)
        self.actor = make_policy(obs_dim, act_dim, spec.policy)
        self.critic = MLPPolicy(obs_dim, 1, spec.policy)
        self.log_std = nn.Parameter(torch.full((act_dim,), spec.init_log_std))

    def dist(self, obs: torch.Tensor) -> torch.distributions.Normal:
        return torch.distributions.Normal(self.actor(obs), self.log_std.exp())

    def value(self, obs: torch.Tensor) -> torch.Tensor:
        return self.critic(obs).squeeze(-1)


def initial_params(spec: PPOSpec) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in ActorCritic(spec).state_dict().items()}


def chunked(fn: Any, x: torch.Tensor, chunk: int) -> torch.Tensor:
    """``fn`` over fixed-size row chunks. A matmul's rounding can depend on the batch size (gemv vs
    gemm paths), so inference always sees the same shapes whatever the env-group split."""
    if len(x) % chunk:
        raise ValueError(f"{len(x)} rows per env group is not a multiple of ppo infer_chunk={chunk}; "
                         "choose env counts / stage counts that keep groups a multiple of it")
    return torch.cat([fn(x[i:i + chunk]) for i in range(0, len(x), chunk)])


def group_rows(envs: int, groups: int, g: int) -> slice:
    if envs % groups:
        raise ValueError(f"{envs} envs cannot be split into {groups} equal env groups; "
                         "choose scheduler.pipeline_stages that divide the env count")
    n = envs // groups
    return slice(g * n, (g + 1) * n)


# ------------------------------------------------------------------------------------ components
class Sim:
    """One vectorized env per group, each over its own slice of the robots (a replica builds only the
    groups it serves)."""

    def __init__(self, spec: PPOSpec, groups: int, served: tuple[int, ...] | None = None) -> None:
        self.spec = spec
        self.envs = [make_env(spec.sim, list(spec.robot_ids[group_rows(spec.envs, groups, g)]), spec.seed)
                     if served is None or g in served else None for g in range(groups)]
        self.groups = groups


class Inference:
    def __init__(self, spec: PPOSpec) -> None:
        self.model = ActorCritic(spec).to(spec.device)
        self.spec = spec
        self.loaded: int | None = None  # iteration whose params@iteration the model holds

    def weights_of(self, iteration: int, params: dict[str, torch.Tensor]) -> ActorCritic:
        """The model holding ``params@iteration`` (loaded once per iteration, whatever the op order)."""
        if self.loaded != iteration:
            self.model.load_state_dict(params)
            self.loaded = iteration
        return self.model


class Learner:
    def __init__(self, spec: PPOSpec) -> None:
        self.model = ActorCritic(spec).to(spec.device)
        self.opt = torch.optim.Adam(self.model.parameters(), lr=spec.lr, eps=1e-5)
        self.spec = spec


class Evaluator:
    def __init__(self, spec: PPOSpec) -> None:
        self.model = ActorCritic(spec).to(spec.device)
        self.env = make_env(spec.sim, list(spec.eval_robot_ids), spec.seed)
        self.spec = spec


def _move_optimizer(opt: torch.optim.Optimizer, device: str) -> None:
    for state in opt.state.values():
        for k, v in state.items():
            if isinstance(v, torch.Tensor):
                state[k] = v.to(device)


def onload(component: Inference | Learner) -> None:
    """Device lock handed to this component: bring its model (and optimizer state) back on device."""
    component.model.to(component.spec.device)
    if isinstance(component, Learner):
        _move_optimizer(component.opt, component.spec.device)


def offload(component: Inference | Learner) -> None:
    """Memory budget pressure: park the model (and optimizer state) in host memory."""
    if component.spec.device != "cpu":
        component.model.to("cpu")
        if isinstance(component, Learner):
            _move_optimizer(component.opt, "cpu")


def _sim(ctx: BuildContext) -> Sim:
    return Sim(ctx.payload, ctx.loops["group"], ctx.groups)


def _inference(ctx: BuildContext) -> Inference:
    return Inference(ctx.payload)


def _learner(ctx: BuildContext) -> Learner:
    return Learner(ctx.payload)


def _evaluator(ctx: BuildContext) -> Evaluator:
    return Evaluator(ctx.payload)


# ------------------------------------------------------------------------------------ ops
def op_draw(s: Sim, idx: dict[str, int], inp: dict[str, Any]) -> dict[str, Any]:
    spec = s.spec
    rng = np.random.default_rng(_seed(spec.seed, NOISE_STREAM, idx["iteration"]))
    return {"noise": rng.standard_normal((spec.steps, spec.envs, action_dim(spec.sim)), dtype=np.float32)}


def op_reset(s: Sim, idx: dict[str, int], inp: dict[str, Any]) -> dict[str, Any]:
    obs, _ = s.envs[idx["group"]].reset(seed=_seed(s.spec.seed, RESET_STREAM, idx["iteration"]) % (2**31))
    return {"obs": obs, "env": None}


def op_infer(p: Inference, idx: dict[str, int], inp: dict[str, Any]) -> dict[str, Any]:
    groups = inp["noise"].shape[1] // len(inp["obs"])
    rows = group_rows(p.spec.envs, groups, idx["group"])
    dev = p.spec.device
    obs = torch.from_numpy(inp["obs"]).to(dev)
    eps = torch.from_numpy(inp["noise"][idx["step"], rows]).to(dev)
    model = p.weights_of(idx["iteration"], inp["params"])
    with torch.no_grad():
        mean = chunked(model.actor, obs, p.spec.infer_chunk)
        dist = torch.distributions.Normal(mean, model.log_std.exp())
        action = dist.mean + dist.stddev * eps
        logp = dist.log_prob(action).sum(-1)
        value = chunked(model.value, obs, p.spec.infer_chunk)
    return {"act": {"action": action.cpu().numpy(), "logp": logp.cpu().numpy(), "value": value.cpu().numpy()}}


def op_env_step(s: Sim, idx: dict[str, int], inp: dict[str, Any]) -> dict[str, Any]:
    obs, success, terminated, truncated, info = s.envs[idx["group"]].step(np.clip(inp["act"]["action"], -1.0, 1.0))
    reward = success.astype(np.float32) + STEP_REWARD_PER_STAGE * info["stage"].astype(np.float32)
    done = (terminated | truncated).astype(np.float32)
    return {"obs": obs, "rew": {"reward": reward, "done": done, "success": success.astype(np.float32)}, "env": None}


def op_bootstrap(p: Inference, idx: dict[str, int], inp: dict[str, Any]) -> dict[str, Any]:
    model = p.weights_of(idx["iteration"], inp["params"])
    with torch.no_grad():
        obs = torch.from_numpy(inp["obs"]).to(p.spec.device)
        return {"last": chunked(model.value, obs, p.spec.infer_chunk).cpu().numpy()}


def op_advantage(ls: Learner, idx: dict[str, int], inp: dict[str, Any]) -> dict[str, Any]:
    spec = ls.spec
    obs = np.stack(inp["obs"])  # (T, n, obs_dim): observations acted on
    acts = inp["act"]
    rews = inp["rew"]
    action = np.stack([a["action"] for a in acts])
    logp = np.stack([a["logp"] for a in acts])
    value = np.stack([a["value"] for a in acts])
    reward = np.stack([r["reward"] for r in rews])
    done = np.stack([r["done"] for r in rews])
    adv = np.zeros_like(reward)
    gae = np.zeros(reward.shape[1], dtype=np.float32)
    next_value = inp["last"]
    for t in range(spec.steps - 1, -1, -1):
        keep = 1.0 - done[t]
        delta = reward[t] + spec.gamma * next_value * keep - value[t]
        gae = delta + spec.gamma * spec.gae_lambda * keep * gae
        adv[t] = gae
        next_value = value[t]
    succ = float(np.stack([r["success"] for r in rews]).sum())
    return {"adv": {"obs": obs, "action": action, "logp": logp, "adv": adv, "ret": adv + value,
                    "reward": float(reward.sum()), "successes": succ}}


def op_learn(ls: Learner, idx: dict[str, int], inp: dict[str, Any]) -> dict[str, Any]:
    """PPO update on the whole rollout; groups concatenated in env order (plan-independent)."""
    spec = ls.spec
    parts = inp["adv"]
    cat = lambda k: torch.from_numpy(np.concatenate([p[k] for p in parts], axis=1)).to(spec.device)  # noqa: E731
    obs = cat("obs").reshape(-1, observation_dim(spec.sim))
    action = cat("action").reshape(-1, action_dim(spec.sim))
    old_logp, adv, ret = cat("logp").reshape(-1), cat("adv").reshape(-1), cat("ret").reshape(-1)
    ls.model.load_state_dict(inp["params"])
    n = obs.shape[0]
    mb = math.ceil(n / spec.minibatches)
    gen = torch.Generator().manual_seed(_seed(spec.seed, MINIBATCH_STREAM, idx["iteration"]))
    losses = []
    for _ in range(spec.epochs):
        perm = torch.randperm(n, generator=gen).to(spec.device)
        for k in range(0, n, mb):
            b = perm[k: k + mb]
            dist = ls.model.dist(obs[b])
            logp = dist.log_prob(action[b]).sum(-1)
            ratio = (logp - old_logp[b]).exp()
            a = adv[b]
            a = (a - a.mean()) / (a.std() + 1e-8)
            pg = torch.max(-a * ratio, -a * ratio.clamp(1 - spec.clip, 1 + spec.clip)).mean()
            v = (ls.model.value(obs[b]) - ret[b]).square().mean()
            ent = dist.entropy().sum(-1).mean()
            loss = pg + spec.vf_coef * v - spec.ent_coef * ent
            ls.opt.zero_grad()
            loss.backward()
            ls.opt.step()
            losses.append(loss.detach())
    losses = [float(x) for x in losses]  # one device sync per update, not per minibatch
    params = {k: v.detach().cpu().clone() for k, v in ls.model.state_dict().items()}
    stats = {"loss": float(np.mean(losses)), "reward": sum(p["reward"] for p in parts),
             "successes": sum(p["successes"] for p in parts), "digest": weights_digest(params)}
    return {"params": params, "stats": stats}


def op_eval(e: Evaluator, idx: dict[str, int], inp: dict[str, Any]) -> dict[str, Any]:
    """Mean-action rollout of the *previous* weights (params@i) on held-out robots."""
    e.model.load_state_dict(inp["params"])
    obs, _ = e.env.reset(seed=_seed(e.spec.seed, EVAL_STREAM, idx["iteration"]) % (2**31))
    successes = 0.0
    with torch.no_grad():
        for _ in range(e.spec.eval_steps):
            action = e.model.actor(torch.from_numpy(obs).to(e.spec.device)).clamp(-1, 1).cpu().numpy()
            obs, success, *_ = e.env.step(action)
            successes += float(success.sum())
    return {"evalm": {"successes": successes, "episodes_steps": e.spec.eval_steps * len(e.spec.eval_robot_ids)}}


def weights_digest(params: dict[str, torch.Tensor]) -> str:
    h = hashlib.sha256()
    for k in sorted(params):
        h.update(k.encode())
        h.update(params[k].detach().contiguous().numpy().tobytes())
    return h.hexdigest()[:16]


def ppo_workflow(spec: PPOSpec, groups: int = 1) -> Workflow:
    """The PPO iteration as a scheduler workflow with ``groups`` env groups."""
    comps = (
        Component("sim", _sim, replicable=True),
        Component("policy", _inference, exclusive=True, memory_mb=_model_mb(spec), onload=onload, offload=offload,
                  replicable=True),
        Component("learner", _learner, exclusive=True, memory_mb=4 * _model_mb(spec), onload=onload,
                  offload=offload),
        Component("evaluator", _evaluator),
    )
    states = (
        StateSpec("noise"), StateSpec("obs"), StateSpec("act"), StateSpec("rew"), StateSpec("last"),
        StateSpec("adv"), StateSpec("params"), StateSpec("stats"), StateSpec("evalm"),
        StateSpec("env", buffers=1, double_bufferable=True),
    )
    body: tuple[OpSpec | ForEach, ...] = (
        OpSpec("draw", "sim", op_draw, writes=("noise@iteration",)),
        ForEach("group", (OpSpec("reset", "sim", op_reset, writes=("obs[group]@step=0", "env[group]@step=0")),)),
        ForEach("step", (ForEach("group", (
            OpSpec("infer", "policy", op_infer, reads=("obs[group]@step", "params@iteration", "noise@iteration"),
                   writes=("act[group]@step",)),
            OpSpec("env_step", "sim", op_env_step, reads=("act[group]@step", "env[group]@step"),
                   writes=("obs[group]@step+1", "rew[group]@step", "env[group]@step+1")),
        )),)),
        ForEach("group", (
            OpSpec("bootstrap", "policy", op_bootstrap, reads=("obs[group]@step=end", "params@iteration"),
                   writes=("last[group]@iteration",)),
            OpSpec("advantage", "learner", op_advantage,
                   reads=("obs[group]@step=*", "act[group]@step=*", "rew[group]@step=*", "last[group]@iteration"),
                   writes=("adv[group]@iteration",)),
        )),
        OpSpec("learn", "learner", op_learn, reads=("adv[group=*]@iteration", "params@iteration"),
               writes=("params@iteration+1", "stats@iteration"), quota_invariant=False),
        OpSpec("eval", "evaluator", op_eval, reads=("params@iteration",), writes=("evalm@iteration",), side=True),
    )
    return Workflow("ppo", comps, states, {"step": spec.steps, "group": groups}, body)


def _model_mb(spec: PPOSpec) -> float:
    return sum(v.numel() * 4 for v in initial_params(spec).values()) / 2**20


# ------------------------------------------------------------------------------------ entry point
@dataclass(frozen=True)
class IterationMetrics:
    iteration: int
    seconds: float
    env_steps_per_s: float
    loss: float
    reward: float
    successes: float
    eval_successes: float
    weights_digest: str


@dataclass(frozen=True)
class PPOResult:
    """What ``run_ppo`` returns: the weights after the last iteration and how the run went."""

    weights: dict[str, torch.Tensor]  # ActorCritic state_dict (actor.* is the fleet policy)
    policy_weights: dict[str, torch.Tensor]  # the NormalizedPolicy state_dict alone
    metrics: list[IterationMetrics]
    plan: Plan
    plan_text: str
    timeline: Timeline
    env_steps_per_s: float
    run: RunResult = field(repr=False)


def ppo_runtime(spec: PPOSpec, cfg: SchedulerConfig, params: dict[str, torch.Tensor] | None = None,
                log: Any = None, gpu: GpuTelemetry | None = None) -> SchedulerRuntime:
    """A scheduler runtime for the PPO workload (profile / plan / optimize / run)."""
    roles = Roles(envs=spec.envs, pinned_threads={"learner": spec.learner_threads})
    return SchedulerRuntime(lambda m: ppo_workflow(spec, m), roles, cfg, spec,
                            {"params": params if params is not None else initial_params(spec)},
                            record=("stats", "evalm"), gpu=gpu, log=log)


def run_ppo(spec: PPOSpec, cfg: SchedulerConfig, iterations: int, plan: str | Plan | None = None,
            params: dict[str, torch.Tensor] | None = None, log: Any = None,
            on_iteration: Callable[[int, dict[str, Any]], None] | None = None) -> PPOResult:
    """Run ``iterations`` PPO iterations under ``plan`` (a Plan, or a kind: sequential | coarse |
    planner | rose; default ``cfg.plan``). Results are identical under every plan.
    ``on_iteration(i, {"stats": ..., "evalm": ...})`` reports each finished iteration."""
    rt = ppo_runtime(spec, cfg, params, log)
    chosen = plan if isinstance(plan, Plan) else rt.choose(plan or cfg.plan)
    result = rt.run(chosen, iterations, on_iteration=on_iteration)
    metrics = []
    for i, secs in enumerate(result.iteration_s):
        st = next(v for k, v in result.records.items() if k.state == "stats" and k.version == (i,))
        ev = next(v for k, v in result.records.items() if k.state == "evalm" and k.version == (i,))
        metrics.append(IterationMetrics(i, secs, spec.envs * spec.steps / secs, st["loss"], st["reward"],
                                        st["successes"], ev["successes"], st["digest"]))
    weights = result.final["params"]
    policy = {k[len("actor."):]: v for k, v in weights.items() if k.startswith("actor.")}
    steady = result.iteration_s[1:] or result.iteration_s
    return PPOResult(weights, policy, metrics, chosen, chosen.describe(), result.timeline,
                     spec.envs * spec.steps / float(np.median(steady)), result)
