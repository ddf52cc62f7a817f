"""The scheduler as a workload sees it: one object from profile to plan to optimized plan.

    SchedulerRuntime(workflow_at, roles, cfg, payload, inputs)
        .sequential(tuned) / .coarse()        baselines
        .coarse_processes() / .coarse_process_splits()   RLinf-style, one process per component
        .profile() -> .plan()                 M2Flow planner (cost curves, cut search)
        .optimize(plan)                       Rose rewrites, then slack-aware quotas
        .run(plan, iterations) -> RunResult   one execution under any plan
        .measure([plans], ...)                interleaved medians (shared, noisy machines)
        .measure_costs([plans], ...)          ... and each plan's fixed cost per run (start-up)

``workflow_at(m)`` builds the workload's workflow with ``m`` env groups; ``roles`` names the main
chain the planner cuts (e.g. sim → policy → learner). Every plan computes the same results.
"""

from __future__ import annotations

import os
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

from components.config import SchedulerConfig
from components.scheduler.costmodel import IpcCost, fit_ipc
from components.scheduler.executor import GROUP_LOOP, RunResult, execute, plan_workflow
from components.scheduler.graph import build_graph
from components.scheduler.plan import Plan, WorkerSpec, sequential_plan
from components.scheduler.planner import (
    ChainSpec,
    M2FlowPlanner,
    PlannerResult,
    Profile,
    op_size,
    profile_workflow,
    thread_slowdown,
)
from components.scheduler.profiler import (
    GpuTelemetry,
    Timeline,
    effective_cores,
    qualified_capacity,
)
from components.scheduler.quotas import Branch, ForkJoin, QuotaResult, SlackQuotaManager
from components.scheduler.rose import RoseOptimizer, RoseResult
from components.scheduler.simulate import simulate, transfer_seconds
from components.scheduler.workflow import Workflow

PLAN_KINDS = ("sequential", "coarse", "planner", "rose")
PIPELINED_GROUPS = 2  # RLinf's env/inference pipeline: two env groups, so one steps while the other infers


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

    @property
    def rollout(self) -> tuple[str, ...]:
        """The components a cyclic stream joins (env ↔ inference): the group Rose may move into one
        process, as the collocated process split does; empty when nothing streams in a cycle."""
        pair = next((p for p, kind in self.streaming.items() if kind == "cyclic"), ())
        return tuple(pair)


@dataclass(frozen=True)
class RunCost:
    """One plan's measured cost: its median steady iteration, and what every run of it pays once
    (worker start-up and teardown, the warm-up iteration's excess). A plan that saves a little per
    iteration but starts a process costs more for a short task; ``task_s`` says which wins."""

    iteration_s: float
    fixed_s: float

    def task_s(self, iterations: int) -> float:
        return self.fixed_s + iterations * self.iteration_s


@dataclass
class OptimizeResult:
    plan: Plan
    rose: RoseResult
    quotas: QuotaResult | None


class SchedulerRuntime:
    """Profile, plan, optimize and run one workload."""

    def __init__(self, workflow_at: Callable[[int], Workflow], roles: Roles, cfg: SchedulerConfig, payload: Any,
                 inputs: dict[str, Any], record: tuple[str, ...] = (), gpu: GpuTelemetry | None = None,
                 log: Callable[[str], None] | None = None,
                 capacity_probe: Callable[[int], float] = effective_cores) -> None:
        self.workflow_at = workflow_at
        self.roles = roles
        self.cfg = cfg
        self.payload = payload
        self.inputs = inputs
        self.record = record
        self.gpu = gpu
        self.devices = cfg.devices or (os.cpu_count() or 1)
        self.log = log or (lambda _: None)
        self.capacity_probe = capacity_probe
        self._profile: Profile | None = None
        self._ipc: IpcCost | None = None
        self._timelines: dict[str, Timeline] = {}

    # ------------------------------------------------------------------ running
    def _pin(self, plan: Plan) -> Plan:
        return plan.with_(pinned_threads={**self.roles.pinned_threads, **plan.pinned_threads})

    def run(self, plan: Plan, iterations: int | range, start: int = 0,
            on_iteration: Callable[[int, dict[str, Any]], None] | None = None) -> RunResult:
        its = iterations if isinstance(iterations, range) else range(start, start + iterations)
        plan = self._pin(plan)
        wf = self.workflow_at(plan.groups or 1)
        result = execute(wf, plan, self.cfg, self.payload, its, inputs=self.inputs, record=self.record, gpu=self.gpu,
                         on_iteration=on_iteration)
        self._timelines[plan.name] = result.timeline
        return result

    def measure(self, plans: list[Plan], iterations: int | None = None, rounds: int | None = None) -> list[float]:
        """Median iteration seconds per plan, runs interleaved (A B A B …), warm-up iteration dropped."""
        return [c.iteration_s for c in self.measure_costs(plans, iterations, rounds)]

    def measure_costs(self, plans: list[Plan], iterations: int | None = None,
                      rounds: int | None = None) -> list[RunCost]:
        """``measure``, plus each plan's fixed cost per run: the run's wall time less its steady
        iterations (the median over the plan's runs)."""
        n = (iterations or self.cfg.validate_iterations) + 1
        rounds = rounds or self.cfg.validate_rounds
        samples: list[list[float]] = [[] for _ in plans]
        fixed: list[list[float]] = [[] for _ in plans]
        for _ in range(rounds):
            for k, p in enumerate(plans):
                start = time.perf_counter()
                steady = self.run(p, n).iteration_s[1:]
                wall = time.perf_counter() - start
                samples[k] += steady
                fixed[k].append(wall - sum(steady) - statistics.median(steady))
        return [RunCost(statistics.median(s), statistics.median(f)) for s, f in zip(samples, fixed, strict=True)]

    def timeline(self, plan: Plan) -> Timeline:
        if plan.name not in self._timelines:
            self.run(plan, self.cfg.validate_iterations + 1)
        return self._timelines[plan.name]

    # ------------------------------------------------------------------ baselines
    def sequential(self, tuned: bool = True, groups: int = 1, threads: int | None = None) -> Plan:
        """Library-default threads, or tuned: BLAS 1 thread and torch ``threads`` per op (default
        ``scheduler.op_threads``, the quota every plan uses, so the reference is not handicapped)."""
        wf = self.workflow_at(groups)
        if not tuned:
            return self._pin(sequential_plan(wf, groups=groups, name="sequential-default"))
        t = threads or self.op_threads
        name = "sequential" if threads is None else f"sequential(t={t})"
        return self._pin(sequential_plan(wf, threads=t, blas_threads=1, groups=groups, name=name))

    @property
    def op_threads(self) -> int:
        """Per-op thread quota of the baselines and of the planner's profile (0 in config: all cores)."""
        return self.cfg.op_threads or self.devices

    @property
    def default_groups(self) -> int:
        """The env-group count of the layouts that do not name one (the coarse baselines, the IPC
        and interpreter-lock probes): ``PIPELINED_GROUPS`` where ``pipeline_stages`` offers it, else
        the largest count offered. Never a count outside ``pipeline_stages``: a workload narrows them
        to the group sizes it accepts (the train task's PPO: groups its inference chunk divides)."""
        stages = self.cfg.pipeline_stages
        return PIPELINED_GROUPS if PIPELINED_GROUPS in stages else max(stages)

    def coarse(self) -> Plan:
        """RLinf-style hybrid: env and rollout pipelined in ``default_groups`` stages (2 where
        offered) on separate halves; the learner (and everything else) then runs on all devices.
        Same per-op thread quota as ``sequential(tuned=True)``."""
        m = self.default_groups
        wf = self.workflow_at(m)
        sim, policy = self.roles.chain[0], self.roles.chain[1]
        rest = tuple(c.name for c in wf.components if c.name not in (sim, policy))
        half = max(self.devices // 2, 1)
        lo, hi = tuple(range(half)), tuple(range(half, self.devices)) or (0,)
        placement = {c.name: tuple(f"cpu{k}" for k in range(self.devices)) for c in wf.components if c.exclusive}
        if wf.component(policy).exclusive:
            placement[policy] = tuple(f"cpu{k}" for k in hi)
        threads = {c: min(self.op_threads, self.devices) for c in rest}
        threads.update({sim: min(self.op_threads, len(lo)), policy: min(self.op_threads, len(hi))})
        pin = self.cfg.pin_cores
        workers = (WorkerSpec("env", (sim,), cores=lo if pin else None),
                   WorkerSpec("rollout", (policy,), cores=hi if pin else None),
                   WorkerSpec("actor", rest))
        return self._pin(Plan(f"coarse-pipeline(m={m})", workers, groups=m, placement=placement, threads=threads,
                              blas_threads=1))

    def coarse_processes(self, threads: int | None = None, groups: int | None = None,
                         colocate_rollout: bool = False) -> Plan:
        """RLinf's natural form: every component in a worker process of its own (env, inference,
        learner, evaluator, ...), env groups pipelined in ``groups`` stages between env and inference
        (default ``default_groups`` where the workflow has groups); each op at ``threads`` (default:
        the per-op quota of every plan). ``colocate_rollout`` puts env and inference in one rollout
        process (RLinf's collocated mode: no per-step exchange between processes). Components that
        cannot leave the parent process (``process_ok`` false) stay on a thread."""
        grouped = GROUP_LOOP in self.workflow_at(1).loops
        m = (groups or self.default_groups) if grouped else 1
        wf = self.workflow_at(m)
        t = threads or self.op_threads
        sim, policy = self.roles.chain[0], self.roles.chain[1]
        kind = {c.name: "process" if c.process_ok else "thread" for c in wf.components}
        joined = (sim, policy) if colocate_rollout and kind.get(sim) == kind.get(policy) == "process" else ()
        workers = (WorkerSpec("rollout", joined, kind="process"),) if joined else ()
        workers += tuple(WorkerSpec(c.name, (c.name,), kind=kind[c.name]) for c in wf.components if c.name not in joined)
        placement = {c.name: tuple(f"cpu{k}" for k in range(self.devices)) for c in wf.components if c.exclusive}
        tags = [f"m={m}"] if grouped and groups else []
        tags += ["env+inference"] if joined else []
        tags += [f"t={t}"] if threads else []
        name = "coarse-processes" + (f"({', '.join(tags)})" if tags else "")
        return self._pin(Plan(name, workers, groups=m if grouped else None, placement=placement,
                              threads={c.name: min(t, self.devices) for c in wf.components}, blas_threads=1))

    def coarse_process_splits(self, thread_counts: tuple[int, ...] | None = None) -> list[Plan]:
        """The process-based coarse layouts a user tuning RLinf-style pipelining would try: env and
        inference in separate processes at each candidate env-group count (``pipeline_stages``),
        or collocated in one rollout process; each at 1 thread per op and at every core per op (or
        ``thread_counts``). The fastest, measured, is the baseline's best split."""
        grouped = GROUP_LOOP in self.workflow_at(1).loops
        layouts = [{"groups": m} for m in (self.cfg.pipeline_stages if grouped else (1,))] + [{"groups": 1, "colocate_rollout": True}]
        thread_counts = thread_counts or tuple(sorted({1, self.devices}))
        return [self.coarse_processes(threads=t, **layout) for layout in layouts for t in thread_counts]

    # ------------------------------------------------------------------ planner
    def profile(self, refresh: bool = False) -> Profile:
        """Per-op cost curves (sequential runs at each stage count, each op at the per-op quota the
        plans give it) and κ, the interpreter-lock slowdown of overlapping thread workers, from a probe run
        with every component on its own thread. ``refresh``: profile again (e.g. right before a
        measurement, so prediction and measurement see the same machine load)."""
        if self._profile is None or refresh:
            prof = profile_workflow(self.workflow_at, self.cfg, self.payload, self.roles.envs,
                                    self.cfg.pipeline_stages, [self.op_threads], self.inputs,
                                    iterations=self.cfg.profile_iterations)
            prof.thread_slowdown = self._probe_thread_slowdown(prof)
            prof.ipc = self._ipc = self._ipc or self._probe_ipc()
            reading = qualified_capacity(lambda: self.capacity_probe(self.devices), self.devices,
                                         self.cfg.capacity_qualify_fraction, self.cfg.capacity_probe_attempts,
                                         self.cfg.capacity_retry_wait_s)
            prof.capacity, prof.capacity_reading = reading.cores, reading
            if not reading.qualified:
                self.log(reading.note())
            self._profile = prof
        return self._profile

    def ipc_probe_plan(self) -> Plan:
        """The run the IPC probe measures: the process split at the per-op quota of every plan."""
        return self.coarse_processes(threads=self.op_threads)

    def _probe_ipc(self) -> IpcCost | None:
        """Pipe cost of process workers, measured once per runtime (process start-up is slow): one
        run of the process split with every component in a process of its own (most crossings), its
        per-message bytes and seconds fitted (``fit_ipc``), at ``default_groups`` env groups (a count
        the workload accepts). None where no component may leave the parent process."""
        plan = self.ipc_probe_plan()
        if not any(w.kind == "process" for w in plan.workers):
            return None
        res = self.run(plan, self.cfg.ipc_probe_iterations)
        if not res.transfers:
            return None
        wf = self.workflow_at(plan.groups or 1)
        rows = {op.name: op_size(wf, op.name, self.roles.envs) for op, _ in wf.ops_with_scope()}
        ipc = fit_ipc([(t.op, t.direction, t.bytes, t.seconds) for t in res.transfers], rows)
        self.log(f"IPC probe ({plan.name}): {ipc.latency_s * 1e3:.2f} ms per message + "
                 f"{ipc.s_per_byte * 1e9:.2f} ns per byte ({len(res.transfers)} crossings)")
        return ipc

    def _probe_thread_slowdown(self, prof: Profile) -> float:
        m = self.default_groups
        wf = self.workflow_at(m)
        t = self.op_threads
        probe = Plan("probe:thread-per-component", tuple(WorkerSpec(c.name, (c.name,)) for c in wf.components),
                     groups=m, threads={c.name: t for c in wf.components}, blas_threads=1)
        res = self.run(probe, 2)
        alone = {op.name: prof.curve(op.name, t)(op_size(wf, op.name, self.roles.envs)) for op, _ in wf.ops_with_scope()}
        pinned = {op.name for op, _ in wf.ops_with_scope() if not op.quota_invariant}
        for name in pinned:  # pinned ops ran with their pinned count in the probe
            comp = wf.op(name).component
            q = self._pin(probe).pinned_threads.get(comp, t)
            alone[name] = prof.curve(name, q)(op_size(wf, name, self.roles.envs))
        return thread_slowdown([s for s in res.timeline.spans if s.iteration > 0], alone)

    def planner(self) -> M2FlowPlanner:
        spec = ChainSpec(self.roles.chain, dict(self.roles.streaming), envs=self.roles.envs,
                         pinned_threads=dict(self.roles.pinned_threads))
        return M2FlowPlanner(self.workflow_at, spec, self.profile(), self.cfg, self.devices)

    def plan(self) -> PlannerResult:
        """The planner's search on the current profile; the chosen plan's notes say which capacity
        reading it was decided on (and if that reading never qualified)."""
        result = self.planner().plan(replay=self.predict)
        reading = self.profile().capacity_reading
        if reading is not None:
            best = result.best
            best = replace(best, plan=best.plan.with_(notes=(*best.plan.notes, reading.note())))
            result = replace(result, best=best, candidates=tuple(best if c is result.best else c for c in result.candidates))
        self.log(result.best.plan.describe())
        return result

    # ------------------------------------------------------------------ Rose + quotas
    def predict(self, plan: Plan, measured_from: Plan | None = None) -> float:
        """Replay ``plan`` from the profiled cost curves (each op at the thread quota the plan gives
        it, plus the measured per-op dispatch overhead) on the cores this process could get when
        profiled (``Profile.capacity`` ≤ ``devices``) shared by processor sharing, with κ slowing
        ops that overlap on thread workers. ``measured_from`` is accepted
        for Rose's interface; the profile is the only basis, so every plan is predicted alike."""
        del measured_from
        wf = plan_workflow(self.workflow_at(plan.groups or 1), plan)
        # side work trailing the barrier settles into its pace only after its lag: replay past it
        graph = build_graph(wf, range(3 + 2 * max(plan.lag.values(), default=0)), plan.buffers)
        prof = self.profile()

        def duration(inst: Any, threads: int) -> float:
            return prof.curve(inst.name, threads)(op_size(wf, inst.name, self.roles.envs)) + prof.dispatch_s

        def demand(inst: Any, threads: int) -> float:
            return float(min(threads, self.devices))

        capacity = min(prof.capacity or float(self.devices), float(self.devices))
        transfer = {}
        if prof.ipc is not None:
            ipc = prof.ipc
            transfer = transfer_seconds(graph, plan, ipc, lambda op: ipc.out_bytes(op, op_size(wf, op, self.roles.envs)))
        return simulate(graph, self._pin(plan), duration, demand, capacity,
                        thread_slowdown=prof.thread_slowdown, transfer=transfer).iteration

    def optimize(self, plan: Plan, quotas: bool = True) -> OptimizeResult:
        self.timeline(plan)
        rose = RoseOptimizer(
            self.workflow_at(plan.groups or 1), self.cfg, self.devices,
            measure=lambda plans: self.measure(plans),
            predict=lambda p, basis: self.predict(p, basis),
            timeline=self.timeline,
            rollout=self.roles.rollout,
            stages=self.cfg.pipeline_stages,
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

