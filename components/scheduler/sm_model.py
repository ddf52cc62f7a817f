"""A discrete-event SM model of one GPU, to study the GPU policy without a GPU. **A MODEL.**

Every number this module produces is *modelled*, not measured; reports label it so.

The PPO iteration's shape (env groups on the CPU, inference / advantages / learner /
evaluation kernels on the GPU) is replayed by the scheduler's own plan replay (``simulate``)
with SMs as the shared resource:

* a GPU op has ``work`` in SM-seconds and a **per-kernel parallelism cap** (a small inference
  batch cannot fill 132 SMs): alone it occupies ``min(cap, quota · SMs)`` SMs;
* an MPS **quota** (``CUDA_MPS_ACTIVE_THREAD_PERCENTAGE``) caps a process's SMs;
* concurrent kernels share SMs (processor sharing) and slow each other by an **interference**
  term: speed × 1 / (1 + interference · other kernels' SM share);
* CPU ops (env steps, resets) take fixed time and use no SMs.

SM activity = time-averaged fraction of SMs occupied (what GPM's SM-utilization metric reports).
``sensitivity`` sweeps interference and the inference parallelism cap.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from components.scheduler.graph import OpInstance, build_graph
from components.scheduler.plan import Plan, WorkerSpec
from components.scheduler.quotas import Branch, ForkJoin, SlackQuotaManager
from components.scheduler.simulate import SimResult, simulate
from components.scheduler.workflow import Component, ForEach, OpSpec, StateSpec, Workflow

LABEL = "SM MODEL (simulated, not measured)"
GPU_COMPONENTS = ("policy", "learner", "evaluator")


@dataclass(frozen=True)
class SmModelParams:
    """A GPU-scale embodied-RL iteration (defaults: H100/H200-like, 132 SMs)."""

    sms: int = 132
    envs: int = 4096
    steps: int = 64
    env_step_s_per_env: float = 1.0e-6  # CPU simulator, vectorized: 4 ms per step for 4096 envs
    env_overhead_s: float = 0.3e-3  # per env-group step call
    reset_s_per_env: float = 2.0e-6
    infer_sm_s_per_env: float = 0.6e-6 * 132  # SM-seconds per env per inference step
    infer_envs_per_sm: float = 24.0  # parallelism cap: a kernel over n envs fills n / 24 SMs
    launch_s: float = 30e-6  # per-kernel launch/sync latency
    learn_sm_s: float = 0.20 * 132  # learner: 200 ms at the full GPU
    learn_cap_fraction: float = 1.0
    eval_sm_s: float = 0.06 * 132  # eval rollouts (small batches): 60 ms of SM-seconds...
    eval_cap_fraction: float = 0.25  # ...that can only fill a quarter of the GPU
    advantage_sm_s_per_env: float = 2e-7 * 132
    interference: float = 0.15

    def cap(self, op: str, envs_in_call: float) -> float:
        if op in ("infer", "bootstrap"):
            return max(1.0, min(float(self.sms), envs_in_call / self.infer_envs_per_sm))
        if op == "learn":
            return self.sms * self.learn_cap_fraction
        if op == "eval":
            return self.sms * self.eval_cap_fraction
        if op == "advantage":
            return max(1.0, min(float(self.sms), envs_in_call / self.infer_envs_per_sm))
        return 0.0

    def work(self, op: str, envs_in_call: float) -> float:
        """SM-seconds of a GPU op, or seconds of a CPU op."""
        return {
            "infer": self.infer_sm_s_per_env * envs_in_call,
            "bootstrap": self.infer_sm_s_per_env * envs_in_call,
            "advantage": self.advantage_sm_s_per_env * envs_in_call * self.steps,
            "learn": self.learn_sm_s,
            "eval": self.eval_sm_s,
            "env_step": self.env_step_s_per_env * envs_in_call + self.env_overhead_s,
            "reset": self.reset_s_per_env * envs_in_call,
        }.get(op, 0.0)


def _noop(*_: Any) -> dict[str, Any]:  # the model never runs ops
    return {}


def model_workflow(p: SmModelParams, groups: int) -> Workflow:
    """The PPO iteration's shape (same ops and versions as the training workload)."""
    comps = (Component("sim", _noop), Component("policy", _noop), Component("learner", _noop),
             Component("evaluator", _noop))
    states = tuple(StateSpec(n) for n in ("noise", "obs", "act", "rew", "last", "adv", "params", "evalm")) + (
        StateSpec("env", buffers=1, double_bufferable=True), StateSpec("pol", buffers=1))
    body = (
        OpSpec("draw", "sim", _noop, writes=("noise@iteration",)),
        OpSpec("sync", "policy", _noop, reads=("params@iteration",), writes=("pol@iteration",)),
        ForEach("group", (OpSpec("reset", "sim", _noop, writes=("obs[group]@step=0", "env[group]@step=0")),)),
        ForEach("step", (ForEach("group", (
            OpSpec("infer", "policy", _noop, reads=("obs[group]@step", "pol@iteration", "noise@iteration"),
                   writes=("act[group]@step",)),
            OpSpec("env_step", "sim", _noop, reads=("act[group]@step", "env[group]@step"),
                   writes=("obs[group]@step+1", "rew[group]@step", "env[group]@step+1")),
        )),)),
        ForEach("group", (
            OpSpec("bootstrap", "policy", _noop, reads=("obs[group]@step=end", "pol@iteration"),
                   writes=("last[group]@iteration",)),
            OpSpec("advantage", "learner", _noop, reads=("rew[group]@step=*", "last[group]@iteration"),
                   writes=("adv[group]@iteration",)),
        )),
        OpSpec("learn", "learner", _noop, reads=("adv[group=*]@iteration", "params@iteration"),
               writes=("params@iteration+1",)),
        OpSpec("eval", "evaluator", _noop, reads=("params@iteration",), writes=("evalm@iteration",), side=True),
    )
    return Workflow("ppo-sm-model", comps, states, {"step": p.steps, "group": groups}, body)


@dataclass(frozen=True)
class ModelRun:
    """One schedule on the model."""

    name: str
    plan: Plan
    iteration_s: float
    env_steps_per_s: float
    sm_activity: float


def run_model(p: SmModelParams, plan: Plan, iterations: int = 3) -> tuple[ModelRun, SimResult]:
    groups = plan.groups or 1
    wf = model_workflow(p, groups)
    graph = build_graph(wf, range(iterations), plan.buffers)
    per_group = p.envs / groups

    def size(inst: OpInstance) -> float:
        return per_group if "group" in inst.indices else float(p.envs)

    def demand(inst: OpInstance, quota_pct: int) -> float:
        cap = p.cap(inst.name, size(inst))
        return 0.0 if cap == 0 else min(cap, max(1.0, quota_pct / 100.0 * p.sms))

    def duration(inst: OpInstance, quota_pct: int) -> float:
        w = p.work(inst.name, size(inst))
        d = demand(inst, quota_pct)
        return w if d == 0 else w / d + p.launch_s

    def rate(d: float, total: float, cap: float) -> float:
        if d == 0:
            return 1.0
        share = min(1.0, cap / total) if total > 0 else 1.0
        others = max(total - d, 0.0) / cap
        return share / (1.0 + p.interference * others)

    res = simulate(graph, plan, duration, demand, float(p.sms), rate)
    return ModelRun(plan.name, plan, res.iteration, p.envs * p.steps / res.iteration,
                    sm_activity(res, p.sms, skip_first=True)), res


def sm_activity(res: SimResult, sms: int, skip_first: bool = True) -> float:
    """Time-averaged fraction of SMs occupied (GPU spans only), over the steady iterations."""
    t0 = res.iteration_s[0] if skip_first and len(res.iteration_s) > 1 else 0.0
    spans = [s for s in res.spans if s.demand > 0 and s.end > t0]
    points = sorted({t0, res.makespan} | {max(s.start, t0) for s in spans} | {s.end for s in spans})
    busy = 0.0
    for a, b in zip(points, points[1:]):
        load = sum(s.demand for s in spans if s.start < b and s.end > a)
        busy += (b - a) * min(load, sms)
    total = res.makespan - t0
    return busy / (sms * total) if total > 0 else 0.0


# ------------------------------------------------------------------------------------ schedules
def _quotas(pct: int = 100) -> dict[str, int]:
    return {c: pct for c in ("sim", *GPU_COMPONENTS)}


def sequential(p: SmModelParams) -> Plan:
    return Plan("sequential", (WorkerSpec("main", ("sim", *GPU_COMPONENTS)),), groups=1, threads=_quotas())


def coarse(p: SmModelParams) -> Plan:
    return Plan("coarse-pipeline(m=2)", (WorkerSpec("env", ("sim",)), WorkerSpec("rollout", ("policy",)),
                                         WorkerSpec("actor", ("learner", "evaluator"))), groups=2, threads=_quotas())


def planned(p: SmModelParams, stages: tuple[int, ...] = (1, 2, 4, 8)) -> Plan:
    """The planner's choice on the model: the best stage count for the hybrid placement."""
    best = None
    for m in stages:
        plan = coarse(p).with_(name=f"planner(m={m})", groups=m)
        run, _ = run_model(p, plan)
        if best is None or run.iteration_s < best[0]:
            best = (run.iteration_s, plan)
    assert best is not None
    return best[1]


def rose(p: SmModelParams, base: Plan) -> tuple[Plan, list[str]]:
    """Rose on the model: eval on its own MPS client overlapping rollout/learner, resets and the
    noise draw hoisted, then slack-aware MPS quotas (greedy, each step validated on the model)."""
    notes: list[str] = []
    plan = base.with_(name="planner+rose",
                      workers=(WorkerSpec("env", ("sim",)), WorkerSpec("rollout", ("policy",)),
                               WorkerSpec("actor", ("learner",)), WorkerSpec("side", ("evaluator",))),
                      hoist=frozenset({"reset", "draw"}))
    before, _ = run_model(p, base)
    after, _ = run_model(p, plan)
    if after.iteration_s >= before.iteration_s:
        notes.append("side-worker + hoists rolled back on the model")
        plan = base
    state = {"plan": plan}

    def with_q(q: dict[str, int]) -> Plan:
        return plan.with_(threads={**plan.threads, **{k: v * 10 for k, v in q.items()}})

    def measure(q: dict[str, int]) -> float:
        state["plan"] = with_q(q)
        return run_model(p, state["plan"])[0].iteration_s

    def regions(q: dict[str, int]) -> list[ForkJoin]:
        _, res = run_model(p, state["plan"])
        last = max(s.end for s in res.spans)
        t0 = res.iteration_s[0] if len(res.iteration_s) > 1 else 0.0
        busy: dict[str, float] = {}
        for s in res.spans:
            if s.start >= t0 and s.end <= last:
                busy[s.worker] = busy.get(s.worker, 0.0) + (s.end - s.start)
        ws = {w.name: w.components for w in state["plan"].workers}
        return [ForkJoin("iteration", tuple(Branch(w, tuple(c for c in ws[w] if c in GPU_COMPONENTS), t)
                                            for w, t in busy.items() if w in ws))]

    mgr = SlackQuotaManager(measure, regions, total=10, accept_margin=0.005, max_steps=12)
    res = mgr.optimize({c: 10 for c in GPU_COMPONENTS})
    for s in res.steps:
        notes.append(f"MPS quota {s.donor}→{s.receiver}: {s.reason}")
    return with_q(res.quotas).with_(name="planner+rose"), notes


@dataclass(frozen=True)
class SmStudy:
    label: str
    params: SmModelParams
    runs: list[ModelRun]
    notes: list[str]
    sweep: list[dict[str, float]]


def study(p: SmModelParams | None = None, sweep: bool = True) -> SmStudy:
    """All four schedules on the model, plus the sensitivity sweep."""
    p = p or SmModelParams()
    base = planned(p)
    r_plan, notes = rose(p, base)
    runs = [run_model(p, plan)[0] for plan in (sequential(p), coarse(p), base, r_plan)]
    rows = sensitivity(p) if sweep else []
    return SmStudy(LABEL, p, runs, notes, rows)


def sensitivity(p: SmModelParams, interference: tuple[float, ...] = (0.0, 0.15, 0.3, 0.6),
                cap_scale: tuple[float, ...] = (0.5, 1.0, 2.0)) -> list[dict[str, float]]:
    """Rose-vs-coarse throughput and SM-activity gains across the model's two soft parameters."""
    rows = []
    for inter in interference:
        for scale in cap_scale:
            q = replace(p, interference=inter, infer_envs_per_sm=p.infer_envs_per_sm / scale,
                        eval_cap_fraction=min(1.0, p.eval_cap_fraction * scale))
            c = run_model(q, coarse(q))[0]
            base = planned(q)
            r = run_model(q, rose(q, base)[0])[0]
            rows.append({"interference": inter, "cap_scale": scale,
                         "throughput_gain_vs_coarse": r.env_steps_per_s / c.env_steps_per_s,
                         "sm_activity_coarse": c.sm_activity, "sm_activity_rose": r.sm_activity})
    return rows
