"""The scheduler as a workload sees it: one object from profile to plan to optimized plan.

    SchedulerRuntime(workflow_at, roles, cfg, payload, inputs)
        .sequential(tuned) / .coarse()        baselines
        .profile() -> .plan()                 M2Flow planner (cost curves, cut search)
        .optimize(plan)                       Rose rewrites, then slack-aware quotas
        .run(plan, iterations) -> RunResult   one execution under any plan
        .measure([plans], ...)                interleaved medians (shared, noisy machines)

``workflow_at(m)`` builds the workload's workflow with ``m`` env groups; ``roles`` names the main
chain the planner cuts (e.g. sim → policy → learner). Every plan computes the same results.
"""

from __future__ import annotations

import os
import statistics
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from components.config import SchedulerConfig
from components.scheduler.executor import RunResult, execute, plan_workflow
from components.scheduler.graph import build_graph
from components.scheduler.plan import Plan, WorkerSpec, sequential_plan
from components.scheduler.planner import ChainSpec, M2FlowPlanner, PlannerResult, Profile, op_size, profile_workflow
from components.scheduler.profiler import GpuTelemetry, Timeline
from components.scheduler.quotas import Branch, ForkJoin, QuotaResult, SlackQuotaManager
from components.scheduler.rose import RoseOptimizer, RoseResult
from components.scheduler.simulate import simulate
from components.scheduler.workflow import Workflow

PLAN_KINDS = ("sequential", "coarse", "planner", "rose")


@dataclass(frozen=True)
class Roles:
    """Which components form the main chain, which edges stream, and pinned thread counts."""

    chain: tuple[str, ...] = ("sim", "policy", "learner")
    streaming: dict[tuple[str, str], str] = field(default_factory=lambda: {("sim", "policy"): "cyclic"})
    envs: int = 1
    pinned_threads: dict[str, int] = field(default_factory=dict)

    @property
    def sim(self) -> str:
        return self.chain[0]


@dataclass
class OptimizeResult:
    plan: Plan
    rose: RoseResult
    quotas: QuotaResult | None


class SchedulerRuntime:
    """Profile, plan, optimize and run one workload."""

    def __init__(self, workflow_at: Callable[[int], Workflow], roles: Roles, cfg: SchedulerConfig, payload: Any,
                 inputs: dict[str, Any], record: tuple[str, ...] = (), gpu: GpuTelemetry | None = None,
                 log: Callable[[str], None] | None = None) -> None:
        self.workflow_at = workflow_at
        self.roles = roles
        self.cfg = cfg
        self.payload = payload
        self.inputs = inputs
        self.record = record
        self.gpu = gpu
        self.devices = cfg.devices or (os.cpu_count() or 1)
        self.log = log or (lambda _: None)
        self._profile: Profile | None = None
        self._timelines: dict[str, Timeline] = {}

    # ------------------------------------------------------------------ running
    def _pin(self, plan: Plan) -> Plan:
        return plan.with_(pinned_threads={**self.roles.pinned_threads, **plan.pinned_threads})

    def run(self, plan: Plan, iterations: int | range, start: int = 0) -> RunResult:
        its = iterations if isinstance(iterations, range) else range(start, start + iterations)
        plan = self._pin(plan)
        wf = self.workflow_at(plan.groups or 1)
        result = execute(wf, plan, self.cfg, self.payload, its, inputs=self.inputs, record=self.record, gpu=self.gpu)
        self._timelines[plan.name] = result.timeline
        return result

    def measure(self, plans: list[Plan], iterations: int | None = None, rounds: int | None = None) -> list[float]:
        """Median iteration seconds per plan, runs interleaved (A B A B …), warm-up iteration dropped."""
        n = (iterations or self.cfg.validate_iterations) + 1
        rounds = rounds or self.cfg.validate_rounds
        samples: list[list[float]] = [[] for _ in plans]
        for _ in range(rounds):
            for k, p in enumerate(plans):
                samples[k] += self.run(p, n).iteration_s[1:]
        return [statistics.median(s) for s in samples]

    def timeline(self, plan: Plan) -> Timeline:
        if plan.name not in self._timelines:
            self.run(plan, self.cfg.validate_iterations + 1)
        return self._timelines[plan.name]

    # ------------------------------------------------------------------ baselines
    def sequential(self, tuned: bool = True, groups: int = 1, threads: int | None = None) -> Plan:
        """Default threads (library defaults) or hand-tuned (BLAS 1, torch ``threads``, default all cores)."""
        wf = self.workflow_at(groups)
        if not tuned:
            return self._pin(sequential_plan(wf, groups=groups, name="sequential-default"))
        t = threads or self.devices
        name = "sequential-tuned" if threads is None else f"sequential-tuned(t={t})"
        return self._pin(sequential_plan(wf, threads=t, blas_threads=1, groups=groups, name=name))

    def coarse(self) -> Plan:
        """RLinf-style hybrid: env and rollout pipelined in 2 stages on separate halves; the
        learner (and everything else) then runs on all devices. Same thread tuning as
        ``sequential(tuned=True)``."""
        wf = self.workflow_at(2)
        sim, policy = self.roles.chain[0], self.roles.chain[1]
        rest = tuple(c.name for c in wf.components if c.name not in (sim, policy))
        half = max(self.devices // 2, 1)
        lo, hi = tuple(range(half)), tuple(range(half, self.devices)) or (0,)
        placement = {c.name: tuple(f"cpu{k}" for k in range(self.devices)) for c in wf.components if c.exclusive}
        if wf.component(policy).exclusive:
            placement[policy] = tuple(f"cpu{k}" for k in hi)
        threads = {c: self.devices for c in rest}
        threads.update({sim: len(lo), policy: len(hi)})
        workers = (WorkerSpec("env", (sim,), cores=lo), WorkerSpec("rollout", (policy,), cores=hi),
                   WorkerSpec("actor", rest))
        return self._pin(Plan("coarse-pipeline(m=2)", workers, groups=2, placement=placement, threads=threads,
                              blas_threads=1))

    # ------------------------------------------------------------------ planner
    def profile(self) -> Profile:
        if self._profile is None:
            threads = sorted({1, self.devices})
            self._profile = profile_workflow(self.workflow_at, self.cfg, self.payload, self.roles.envs,
                                             self.cfg.pipeline_stages, threads, self.inputs)
        return self._profile

    def planner(self) -> M2FlowPlanner:
        spec = ChainSpec(self.roles.chain, dict(self.roles.streaming), envs=self.roles.envs,
                         pinned_threads=dict(self.roles.pinned_threads))
        return M2FlowPlanner(self.workflow_at, spec, self.profile(), self.cfg, self.devices)

    def plan(self) -> PlannerResult:
        result = self.planner().plan()
        self.log(result.best.plan.describe())
        return result

    # ------------------------------------------------------------------ Rose + quotas
    def predict(self, plan: Plan, measured_from: Plan | None = None) -> float:
        """Replay ``plan`` from the profiled cost curves, each scaled by how the op actually ran in
        ``measured_from``'s latest run (median measured / curve at that run's size and threads):
        local profiling, calibrated to the machine's current state."""
        wf = plan_workflow(self.workflow_at(plan.groups or 1), plan)
        graph = build_graph(wf, range(3), plan.buffers)
        prof = self.profile()
        calib: dict[str, float] = {}
        if measured_from is not None:
            basis = plan_workflow(self.workflow_at(measured_from.groups or 1), measured_from)
            measured: dict[tuple[str, int], list[float]] = {}
            for s in self.timeline(measured_from).spans:
                if s.iteration > 0:
                    measured.setdefault((s.op, max(s.threads, 1)), []).append(s.duration)
            ratios: dict[str, list[float]] = {}
            for (op, t), xs in measured.items():
                model = prof.curve(op, t)(op_size(basis, op, self.roles.envs))
                if model > 0:
                    ratios.setdefault(op, []).append(statistics.median(xs) / model)
            calib = {op: statistics.median(r) for op, r in ratios.items()}

        def duration(inst: Any, threads: int) -> float:
            base = prof.curve(inst.name, threads)(op_size(wf, inst.name, self.roles.envs))
            return base * calib.get(inst.name, 1.0)

        def demand(inst: Any, threads: int) -> float:
            return float(min(threads, self.devices))

        return simulate(graph, self._pin(plan), duration, demand, float(self.devices)).iteration

    def optimize(self, plan: Plan, quotas: bool = True) -> OptimizeResult:
        self.timeline(plan)
        rose = RoseOptimizer(
            self.workflow_at(plan.groups or 1), self.cfg, self.devices,
            measure=lambda plans: self.measure(plans),
            predict=lambda p, basis: self.predict(p, basis),
            timeline=self.timeline,
        )
        result = rose.optimize(plan)
        self.log(result.report())
        best = result.plan
        qres: QuotaResult | None = None
        if quotas:
            best, qres = self.tune_quotas(best)
        return OptimizeResult(best.with_(name=f"{plan.name}+rose"), result, qres)

    def fork_joins(self, plan: Plan) -> list[ForkJoin]:
        """Fork/join regions of the latest measured iteration: the rollout (env vs policy worker)
        and the tail after it (learner vs side workers)."""
        tl = self.timeline(plan)
        last = max(s.iteration for s in tl.spans)
        spans = [s for s in tl.spans if s.iteration == last]
        roll_end = max((s.end for s in spans if s.component in self.roles.chain[:2]), default=0.0)
        regions: list[ForkJoin] = []
        for name, pred in (("rollout", lambda s: s.end <= roll_end), ("tail", lambda s: s.start >= roll_end)):
            busy: dict[str, float] = {}
            for s in spans:
                if pred(s):
                    busy[s.worker] = busy.get(s.worker, 0.0) + s.duration
            branches = tuple(Branch(w.name, w.components, busy[w.name]) for w in plan.workers if w.name in busy)
            if len(branches) > 1:
                regions.append(ForkJoin(name, branches))
        return regions

    def tune_quotas(self, plan: Plan) -> tuple[Plan, QuotaResult]:
        wf = self.workflow_at(plan.groups or 1)
        invariant = {c.name for c in wf.components} - {
            op.component for op, _ in wf.ops_with_scope() if not op.quota_invariant}
        base = {c.name: plan.threads.get(c.name, plan.default_threads or 1) for c in wf.components}
        state: dict[str, Plan] = {"plan": plan}

        def with_quotas(q: dict[str, int]) -> Plan:
            name = "q[" + ",".join(f"{k}={v}" for k, v in sorted(q.items()) if v != base.get(k)) + "]"
            return plan.with_(threads={**plan.threads, **q}, name=f"{plan.name}+{name}")

        def measure(q: dict[str, int]) -> float:
            p = with_quotas(q)
            state["plan"] = p
            return self.measure([p])[0]

        def regions(q: dict[str, int]) -> list[ForkJoin]:
            fjs = self.fork_joins(state["plan"])
            # only components whose ops may change thread count can trade quota
            return [ForkJoin(f.name, tuple(Branch(b.name, tuple(c for c in b.components if c in invariant), b.seconds)
                                           for b in f.branches)) for f in fjs]

        mgr = SlackQuotaManager(measure, regions, total=self.devices, accept_margin=self.cfg.accept_margin,
                                max_steps=self.cfg.quota_max_steps)
        res = mgr.optimize(base)
        for step in res.steps:
            self.log(f"quota {step.region}: {step.donor}→{step.receiver} {step.reason}")
        return with_quotas(res.quotas), res

    # ------------------------------------------------------------------ one entry point
    def choose(self, kind: str) -> Plan:
        """The plan of a given kind: sequential | coarse | planner | rose."""
        if kind not in PLAN_KINDS:
            raise ValueError(f"scheduler.plan={kind!r} is unknown; use one of {PLAN_KINDS}")
        if kind == "sequential":
            return self.sequential(tuned=True)
        if kind == "coarse":
            return self.coarse()
        best = self.plan().best.plan
        if kind == "planner":
            return best
        return self.optimize(best).plan

