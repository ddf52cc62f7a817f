"""FERT fine-tuning iteration, run through the scheduler.

One iteration:

    retrieve   nbrs@i     <- failures@i      kNN in the segment store (successful windows only)
    assemble   batch@i    <- nbrs@i          priority-weighted frames of retrieved windows + demos
    learn      params@i+1 <- batch@i, params@i   behaviour cloning steps on the weighted batch
    eval       evalm@i, failures@i+1 <- params@i  rollouts of the *previous* weights on held-out
                                                  robots; their failure windows are the next queries

``eval`` only needs ``params@i``, so a plan may overlap it with retrieval and learning, and
``retrieve@i+1`` may start as soon as ``eval@i`` is done (hoisting across the iteration loop).

The FERT-specific parts sit behind ``FertHooks`` (failure queries, retrieval, batch assembly), so
the FERT room can supply its own; ``StoreFertHooks`` is a plain implementation on the segment
store's kNN search.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import torch

from components.config import FertConfig, PolicyConfig, SchedulerConfig, SimConfig, StoreConfig
from components.episodes.record import Episode
from components.policy.factory import make_policy
from components.scheduler.executor import RunResult
from components.scheduler.plan import Plan
from components.scheduler.profiler import GpuTelemetry, Timeline
from components.scheduler.runtime import Roles, SchedulerRuntime
from components.scheduler.workflow import BuildContext, Component, OpSpec, StateSpec, Workflow
from components.sim import ScriptedExpert, action_dim, make_env, observation_dim, run_episodes
from components.store.encoder import NormalizedStateEncoder
from components.store.segment_store import SegmentStore

EVAL_STREAM, BATCH_STREAM = 21, 22


@dataclass(frozen=True)
class Retrieved:
    """Frames of the retrieved successful windows and their distances to the failure queries."""

    states: np.ndarray  # (K, W, n)
    actions: np.ndarray  # (K, W, m)
    distances: np.ndarray  # (K,)


@dataclass(frozen=True)
class Batch:
    states: np.ndarray  # (B, n)
    actions: np.ndarray  # (B, m)
    weights: np.ndarray  # (B,)


class FertHooks(Protocol):
    """What the FERT room provides to the iteration (all deterministic given their inputs)."""

    def failure_queries(self, windows: np.ndarray) -> np.ndarray: ...
    def retrieve(self, queries: np.ndarray) -> Retrieved: ...
    def assemble(self, retrieved: Retrieved, rng: np.random.Generator) -> Batch: ...


class StoreFertHooks:
    """kNN over successful segments; weights exp(−d / σ) with σ the median distance; demo mix-in."""

    def __init__(self, store_uri: Path, store_cfg: StoreConfig, fert: FertConfig, encoder_state: dict[str, Any],
                 episodes: dict[str, Episode], demos: tuple[np.ndarray, np.ndarray], batch_size: int) -> None:
        self.store_uri, self.store_cfg, self.fert = store_uri, store_cfg, fert
        self.encoder = NormalizedStateEncoder.from_state_dict(encoder_state)
        self.episodes = episodes
        self.demo_states, self.demo_actions = demos
        self.batch_size = batch_size
        self._store: SegmentStore | None = None

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        state["_store"] = None  # a LanceDB handle never crosses a process boundary; reopened lazily
        return state

    @property
    def store(self) -> SegmentStore:
        if self._store is None:  # opened lazily, in the worker that uses it (never across fork)
            self._store = SegmentStore.open(self.store_uri, self.store_cfg, self.encoder.dim)
        return self._store

    def failure_queries(self, windows: np.ndarray) -> np.ndarray:
        return self.encoder.encode(windows) if len(windows) else np.zeros((0, self.encoder.dim), np.float32)

    def retrieve(self, queries: np.ndarray) -> Retrieved:
        w = self.store_cfg.window
        n, m = self.demo_states.shape[1], self.demo_actions.shape[1]
        if len(queries) == 0:
            return Retrieved(np.zeros((0, w, n), np.float32), np.zeros((0, w, m), np.float32), np.zeros(0, np.float32))
        res = self.store.search(queries, k=self.fert.top_k, success=True, exact=True)
        states, actions, dists = [], [], []
        for q in range(len(res)):
            for j in range(int(res.counts[q])):
                ep = self.episodes.get(str(res.episode_ids[q, j]))
                if ep is None:
                    continue
                s, e = int(res.starts[q, j]), int(res.ends[q, j])
                if e - s < w:
                    continue
                states.append(ep.states[s:s + w])
                actions.append(ep.actions[s:s + w])
                dists.append(float(res.distances[q, j]))
        if not states:
            return Retrieved(np.zeros((0, w, n), np.float32), np.zeros((0, w, m), np.float32), np.zeros(0, np.float32))
        return Retrieved(np.stack(states), np.stack(actions), np.asarray(dists, np.float32))

    def assemble(self, retrieved: Retrieved, rng: np.random.Generator) -> Batch:
        b = self.batch_size
        n_ret = int(round(b * self.fert.mix_retrieved)) if len(retrieved.distances) else 0
        n_demo = b - n_ret
        di = rng.integers(0, len(self.demo_states), n_demo)
        states = [self.demo_states[di]]
        actions = [self.demo_actions[di]]
        weights = [np.ones(n_demo, np.float32)]
        if n_ret:
            sigma = float(np.median(retrieved.distances)) or 1.0
            prio = np.exp(-retrieved.distances / sigma)
            k = rng.choice(len(prio), size=n_ret, p=prio / prio.sum())
            t = rng.integers(0, retrieved.states.shape[1], n_ret)
            states.append(retrieved.states[k, t])
            actions.append(retrieved.actions[k, t])
            weights.append(np.full(n_ret, 1.0 + self.fert.alpha, np.float32))
        return Batch(np.concatenate(states).astype(np.float32), np.concatenate(actions).astype(np.float32),
                     np.concatenate(weights))


@dataclass(frozen=True)
class FertIterSpec:
    """Sizes of the FERT iteration; ``hooks`` is built lazily in the worker from ``hooks_factory``."""

    sim: SimConfig
    policy: PolicyConfig
    eval_robot_ids: tuple[str, ...]
    hooks: Any  # FertHooks (picklable or thread workers only)
    window: int
    eval_steps: int = 60
    learn_steps: int = 8
    lr: float = 1e-3
    learner_threads: int = 1
    seed: int = 0

    def __post_init__(self) -> None:
        # the evaluation's last `window` steps of each failed rollout are the next iteration's queries
        if self.eval_steps < self.window:
            raise ValueError(f"scheduler.fert_eval_steps={self.eval_steps} is shorter than store.window={self.window}: "
                             "the evaluation rollouts must be at least one window long; raise fert_eval_steps")


def _policy(spec: FertIterSpec) -> torch.nn.Module:
    torch.manual_seed(spec.seed)
    return make_policy(observation_dim(spec.sim), action_dim(spec.sim), spec.policy)


class Learner:
    def __init__(self, spec: FertIterSpec) -> None:
        self.model = _policy(spec)
        self.opt = torch.optim.Adam(self.model.parameters(), lr=spec.lr)
        self.spec = spec


class Evaluator:
    def __init__(self, spec: FertIterSpec) -> None:
        self.model = _policy(spec)
        self.env = make_env(spec.sim, list(spec.eval_robot_ids), spec.seed)
        self.spec = spec


def _seed(*parts: int) -> int:
    return int.from_bytes(hashlib.blake2b(repr(parts).encode(), digest_size=8).digest(), "little") % (2**31)


def op_retrieve(spec: FertIterSpec, idx: dict[str, int], inp: dict[str, Any]) -> dict[str, Any]:
    return {"nbrs": spec.hooks.retrieve(inp["failures"])}


def op_assemble(spec: FertIterSpec, idx: dict[str, int], inp: dict[str, Any]) -> dict[str, Any]:
    rng = np.random.default_rng(_seed(spec.seed, BATCH_STREAM, idx["iteration"]))
    return {"batch": spec.hooks.assemble(inp["nbrs"], rng)}


def op_learn(ls: Learner, idx: dict[str, int], inp: dict[str, Any]) -> dict[str, Any]:
    batch: Batch = inp["batch"]
    model = ls.model
    model.load_state_dict(inp["params"])
    s = torch.from_numpy(batch.states)
    target = model.act_norm.normalize(torch.from_numpy(batch.actions))
    w = torch.from_numpy(batch.weights)
    losses = []
    for _ in range(ls.spec.learn_steps):
        loss = ((model.forward_normalized(s) - target).square().mean(1) * w).sum() / w.sum()
        ls.opt.zero_grad()
        loss.backward()
        ls.opt.step()
        losses.append(float(loss.detach()))
    params = {k: v.detach().clone() for k, v in model.state_dict().items()}
    return {"params": params, "stats": {"loss": float(np.mean(losses)), "batch": len(w)}}


def op_eval(e: Evaluator, idx: dict[str, int], inp: dict[str, Any]) -> dict[str, Any]:
    spec = e.spec
    e.model.load_state_dict(inp["params"])
    obs, _ = e.env.reset(seed=_seed(spec.seed, EVAL_STREAM, idx["iteration"]))
    history = np.zeros((spec.eval_steps, len(obs), obs.shape[1]), np.float32)
    succeeded = np.zeros(len(obs), bool)
    with torch.no_grad():
        for t in range(spec.eval_steps):
            history[t] = obs
            obs, success, *_ = e.env.step(e.model(torch.from_numpy(obs)).clamp(-1, 1).numpy())
            succeeded |= success.astype(bool)
    failed = np.flatnonzero(~succeeded)
    windows = history[-spec.window:, failed].transpose(1, 0, 2) if len(failed) else np.zeros((0, spec.window, obs.shape[1]), np.float32)
    return {"evalm": {"success_rate": float(succeeded.mean()), "failures": int(len(failed))},
            "failures": spec.hooks.failure_queries(windows)}


def _learner(ctx: BuildContext) -> Learner:
    return Learner(ctx.payload)


def _evaluator(ctx: BuildContext) -> Evaluator:
    return Evaluator(ctx.payload)


def _payload(ctx: BuildContext) -> FertIterSpec:
    return ctx.payload


def fert_workflow(spec: FertIterSpec, groups: int = 1) -> Workflow:
    """The FERT iteration as a workflow (no env groups: ``groups`` is accepted and ignored)."""
    del groups
    comps = (
        Component("retriever", _payload),
        Component("assembler", _payload),
        Component("learner", _learner, exclusive=True, memory_mb=4.0),
        Component("evaluator", _evaluator),
    )
    states = tuple(StateSpec(n) for n in ("failures", "nbrs", "batch", "params", "stats", "evalm"))
    body = (
        OpSpec("retrieve", "retriever", op_retrieve, reads=("failures@iteration",), writes=("nbrs@iteration",)),
        OpSpec("assemble", "assembler", op_assemble, reads=("nbrs@iteration",), writes=("batch@iteration",)),
        OpSpec("learn", "learner", op_learn, reads=("batch@iteration", "params@iteration"),
               writes=("params@iteration+1", "stats@iteration"), quota_invariant=False),
        OpSpec("eval", "evaluator", op_eval, reads=("params@iteration",),
               writes=("evalm@iteration", "failures@iteration+1"), side=True),
    )
    return Workflow("fert", comps, states, {}, body)


# ------------------------------------------------------------------------------------ data + entry
@dataclass(frozen=True)
class FertData:
    """A small segment store of expert episodes plus everything the hooks need."""

    hooks: StoreFertHooks
    initial_params: dict[str, torch.Tensor]
    initial_failures: np.ndarray


def build_fert_data(root: Path, sim: SimConfig, store_cfg: StoreConfig, fert: FertConfig, policy: PolicyConfig,
                    robot_ids: list[str], episodes_per_robot: int, batch_size: int, seed: int = 0) -> FertData:
    """Collect scripted-expert episodes, upsert their windows into a LanceDB store under ``root``."""
    episodes = run_episodes(ScriptedExpert(), robot_ids, sim, episodes_per_robot, seed, "expert")
    w = store_cfg.window
    windows = np.concatenate([np.stack([e.states[s:s + w] for s in range(0, e.length - w + 1, store_cfg.stride)])
                              for e in episodes if e.length >= w])
    encoder = NormalizedStateEncoder(w, windows.shape[2]).fit(windows)
    store = SegmentStore.open(Path(root) / "segments.lance", store_cfg, encoder.dim)
    store.upsert(episodes, encoder, snapshot="scheduler-workload")
    demo_s = np.concatenate([e.states for e in episodes]).astype(np.float32)
    demo_a = np.concatenate([e.actions for e in episodes]).astype(np.float32)
    hooks = StoreFertHooks(Path(root) / "segments.lance", store_cfg, fert, encoder.state_dict(),
                           {e.episode_id: e for e in episodes}, (demo_s, demo_a), batch_size)
    torch.manual_seed(seed)
    model = make_policy(observation_dim(sim), action_dim(sim), policy)
    model.obs_norm.fit(torch.from_numpy(demo_s))
    model.act_norm.fit(torch.from_numpy(demo_a))
    params = {k: v.detach().clone() for k, v in model.state_dict().items()}
    failures = hooks.failure_queries(windows[:: max(len(windows) // 8, 1)][:8])
    return FertData(hooks, params, failures)


@dataclass(frozen=True)
class FertIterationResult:
    weights: dict[str, torch.Tensor]  # NormalizedPolicy state_dict
    success_rates: list[float]  # eval of params@i for each iteration i (previous weights)
    losses: list[float]
    iteration_s: list[float]
    plan: Plan
    plan_text: str
    timeline: Timeline
    run: RunResult = field(repr=False)


def fert_runtime(spec: FertIterSpec, data: FertData, cfg: SchedulerConfig, log: Any = None,
                 gpu: GpuTelemetry | None = None) -> SchedulerRuntime:
    roles = Roles(chain=("retriever", "assembler", "learner"), streaming={}, envs=1,
                  pinned_threads={"learner": spec.learner_threads})
    return SchedulerRuntime(lambda m: fert_workflow(spec, m), roles, cfg, spec,
                            {"params": data.initial_params, "failures": data.initial_failures},
                            record=("stats", "evalm"), gpu=gpu, log=log)


def run_fert_iterations(spec: FertIterSpec, data: FertData, cfg: SchedulerConfig, iterations: int,
                        plan: str | Plan | None = None, log: Any = None,
                        on_iteration: Callable[[int, dict[str, Any]], None] | None = None) -> FertIterationResult:
    """Run ``iterations`` FERT iterations under ``plan`` (a Plan or a kind); plan-independent results."""
    rt = fert_runtime(spec, data, cfg, log)
    chosen = plan if isinstance(plan, Plan) else rt.choose(plan or cfg.plan)
    result = rt.run(chosen, iterations, on_iteration=on_iteration)
    get = lambda state, i: next(v for k, v in result.records.items() if k.state == state and k.version == (i,))  # noqa: E731
    return FertIterationResult(
        result.final["params"], [get("evalm", i)["success_rate"] for i in range(iterations)],
        [get("stats", i)["loss"] for i in range(iterations)], result.iteration_s, chosen, chosen.describe(),
        result.timeline, result)
