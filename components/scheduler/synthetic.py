"""A synthetic embodied-RL iteration for the scheduler's own tests and quick benchmarks.

Same shape as the real PPO workload (which lives in the training room) without depending on it:
``groups`` env groups of numpy envs stepped for ``steps`` rollout steps, a torch MLP policy,
per-group advantages, a learner, an evaluation rollout with the previous weights, and an
I/O-like retrieval prefetch (sleeps, releasing the GIL, like a vector-store query).

Every random draw is per env and per iteration, so results do not depend on the group count;
inference is row-wise, so they do not depend on the batch split either.
"""

from __future__ import annotations

import hashlib
import time
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import nn

from components.scheduler.workflow import Component, ForEach, OpSpec, StateSpec, Workflow

LEARN_EPOCHS = 2
LR = 1e-2
GAMMA = 0.97


@dataclass(frozen=True)
class SyntheticSpec:
    """Sizes of the synthetic iteration (picklable: also the payload for process workers)."""

    envs: int = 64
    steps: int = 8
    obs_dim: int = 16
    act_dim: int = 4
    hidden: int = 64
    eval_steps: int = 4
    retrieval_sleep_s: float = 0.002
    env_work: int = 1  # repeats of the env's matmul (makes the env heavier)
    seed: int = 0


def group_slice(envs: int, groups: int, g: int) -> slice:
    if envs % groups:
        raise ValueError(f"envs={envs} must divide evenly into {groups} groups")
    n = envs // groups
    return slice(g * n, (g + 1) * n)


class EnvGroup:
    """The envs of one group: a linear-tanh system with per-env noise streams."""

    def __init__(self, spec: SyntheticSpec, rows: slice) -> None:
        rng = np.random.default_rng([spec.seed, 7])
        self.a = rng.standard_normal((spec.obs_dim, spec.obs_dim)) / np.sqrt(spec.obs_dim)
        self.b = rng.standard_normal((spec.act_dim, spec.obs_dim)) / np.sqrt(spec.act_dim)
        self.spec = spec
        self.rows = range(rows.start, rows.stop)
        self.x = np.zeros((len(self.rows), spec.obs_dim))
        self.noise = np.zeros((spec.steps, len(self.rows), spec.obs_dim))

    def reset(self, iteration: int) -> np.ndarray:
        draws = [np.random.default_rng([self.spec.seed, iteration, e]) for e in self.rows]
        self.x = np.stack([g.standard_normal(self.spec.obs_dim) for g in draws])
        self.noise = np.stack([g.standard_normal((self.spec.steps, self.spec.obs_dim)) for g in draws], 1) * 0.1
        return self.x.astype(np.float32)

    def step(self, t: int, action: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        x = self.x
        for _ in range(self.spec.env_work):
            x = np.tanh(self.x @ self.a + action.astype(np.float64) @ self.b + self.noise[t])
        self.x = x
        reward = -np.square(self.x).mean(axis=1)
        return self.x.astype(np.float32), reward.astype(np.float32)


def _mlp(spec: SyntheticSpec) -> nn.Module:
    torch.manual_seed(spec.seed)
    return nn.Sequential(nn.Linear(spec.obs_dim, spec.hidden), nn.Tanh(), nn.Linear(spec.hidden, spec.act_dim))


def params_of(model: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def digest(*arrays: Any) -> str:
    h = hashlib.sha256()
    for a in arrays:
        a = a.detach().numpy() if isinstance(a, torch.Tensor) else np.asarray(a)
        h.update(np.ascontiguousarray(a).tobytes())
    return h.hexdigest()[:16]


# ----------------------------------------------------------------------------------- components
class SimState:
    def __init__(self, spec: SyntheticSpec, groups: int) -> None:
        self.envs = [EnvGroup(spec, group_slice(spec.envs, groups, g)) for g in range(groups)]


class PolicyState:
    def __init__(self, spec: SyntheticSpec) -> None:
        self.model = _mlp(spec)
        self.spec = spec


class LearnerState:
    def __init__(self, spec: SyntheticSpec) -> None:
        self.model = _mlp(spec)
        self.opt = torch.optim.SGD(self.model.parameters(), lr=LR)
        self.spec = spec


def _sim(ctx: Any) -> SimState:
    return SimState(ctx.payload, ctx.loops["group"])


def _policy(ctx: Any) -> PolicyState:
    return PolicyState(ctx.payload)


def _learner(ctx: Any) -> LearnerState:
    return LearnerState(ctx.payload)


def _retriever(ctx: Any) -> SyntheticSpec:
    return ctx.payload


# ----------------------------------------------------------------------------------- ops
def op_reset(s: SimState, idx: dict[str, int], inp: dict[str, Any]) -> dict[str, Any]:
    return {"obs": s.envs[idx["group"]].reset(idx["iteration"]), "env": None}


def op_sync(p: PolicyState, idx: dict[str, int], inp: dict[str, Any]) -> dict[str, Any]:
    p.model.load_state_dict(inp["params"])
    return {"pol": None}


def op_infer(p: PolicyState, idx: dict[str, int], inp: dict[str, Any]) -> dict[str, Any]:
    with torch.no_grad():
        act = p.model(torch.from_numpy(inp["obs"])).numpy()
    return {"act": act}


def op_env_step(s: SimState, idx: dict[str, int], inp: dict[str, Any]) -> dict[str, Any]:
    obs, rew = s.envs[idx["group"]].step(idx["step"], inp["act"])
    return {"obs": obs, "rew": rew, "env": None}


def op_advantage(_: LearnerState, idx: dict[str, int], inp: dict[str, Any]) -> dict[str, Any]:
    obs, act, rew = np.stack(inp["obs"]), np.stack(inp["act"]), np.stack(inp["rew"])
    ret = np.zeros_like(rew)
    acc = np.zeros(rew.shape[1], dtype=np.float32)
    for t in range(rew.shape[0] - 1, -1, -1):
        acc = rew[t] + np.float32(GAMMA) * acc
        ret[t] = acc
    return {"adv": {"obs": obs, "act": act, "ret": ret}}


def op_learn(ls: LearnerState, idx: dict[str, int], inp: dict[str, Any]) -> dict[str, Any]:
    groups = inp["adv"]
    obs = torch.from_numpy(np.concatenate([g["obs"] for g in groups], axis=1).reshape(-1, ls.spec.obs_dim))
    act = torch.from_numpy(np.concatenate([g["act"] for g in groups], axis=1).reshape(-1, ls.spec.act_dim))
    ret = torch.from_numpy(np.concatenate([g["ret"] for g in groups], axis=1).reshape(-1))
    ls.model.load_state_dict(inp["params"])
    ctx = torch.from_numpy(inp["ctx"])
    for _ in range(LEARN_EPOCHS):
        pred = ls.model(obs)
        w = torch.softmax(ret - ret.max(), 0)
        loss = ((pred - act).square().sum(1) * w).sum() + 1e-3 * ls.model(ctx).square().mean()
        ls.opt.zero_grad()
        loss.backward()
        ls.opt.step()
    params = params_of(ls.model)
    return {"params": params, "digest": digest(obs, act, ret, *params.values())}


def op_eval(p: PolicyState, idx: dict[str, int], inp: dict[str, Any]) -> dict[str, Any]:
    spec = p.spec
    model = _mlp(spec)
    model.load_state_dict(inp["params"])
    env = EnvGroup(spec, slice(0, spec.envs))
    obs = env.reset(10_000 + idx["iteration"])
    total = 0.0
    with torch.no_grad():
        for t in range(spec.eval_steps):
            obs, rew = env.step(t, model(torch.from_numpy(obs)).numpy())
            total += float(rew.mean())
    return {"evalm": total}


def op_retrieve(spec: SyntheticSpec, idx: dict[str, int], inp: dict[str, Any]) -> dict[str, Any]:
    time.sleep(spec.retrieval_sleep_s)  # stands in for an I/O-bound vector-store query
    rng = np.random.default_rng([spec.seed, 99, idx["iteration"]])
    return {"ctx": rng.standard_normal((32, spec.obs_dim)).astype(np.float32)}


def synthetic_workflow(spec: SyntheticSpec, groups: int = 2, with_side: bool = True) -> Workflow:
    """The synthetic iteration as a workflow (``groups`` = env groups, the pipeline stage count)."""
    comps = (
        Component("sim", _sim),
        Component("policy", _policy, exclusive=True, memory_mb=10.0),
        Component("learner", _learner, exclusive=True, memory_mb=30.0),
        Component("evaluator", _policy, stateless=True),  # op_eval builds its model from the weights it reads
        Component("retriever", _retriever, stateless=True),
    )
    states = (
        StateSpec("obs"), StateSpec("act"), StateSpec("rew"), StateSpec("adv"), StateSpec("params"), StateSpec("digest"), StateSpec("evalm"), StateSpec("ctx"),
        StateSpec("env", buffers=1, double_bufferable=True),
        StateSpec("pol", buffers=1),
    )
    body: list[OpSpec | ForEach] = [
        OpSpec("retrieve", "retriever", op_retrieve, writes=("ctx@iteration",), side=True),
        OpSpec("sync", "policy", op_sync, reads=("params@iteration",), writes=("pol@iteration",)),
        ForEach("group", (OpSpec("reset", "sim", op_reset, writes=("obs[group]@step=0", "env[group]@step=0")),)),
        ForEach("step", (ForEach("group", (
            OpSpec("infer", "policy", op_infer, reads=("obs[group]@step", "pol@iteration"),
                   writes=("act[group]@step",)),
            OpSpec("env_step", "sim", op_env_step, reads=("act[group]@step", "env[group]@step"),
                   writes=("obs[group]@step+1", "rew[group]@step", "env[group]@step+1")),
        )),)),
        ForEach("group", (
            OpSpec("advantage", "learner", op_advantage,
                   reads=("obs[group]@step=*", "act[group]@step=*", "rew[group]@step=*"),
                   writes=("adv[group]@iteration",)),
        )),
        OpSpec("learn", "learner", op_learn, reads=("adv[group=*]@iteration", "params@iteration", "ctx@iteration"),
               writes=("params@iteration+1", "digest@iteration")),
    ]
    if with_side:
        body.append(OpSpec("eval", "evaluator", op_eval, reads=("params@iteration",), writes=("evalm@iteration",),
                           side=True))
    return Workflow("synthetic", comps, states, {"step": spec.steps, "group": groups}, tuple(body))
