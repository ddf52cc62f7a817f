"""M2Flow planner: profile → cost curves → memoized recursive cut search → a plan with its predicted time.

The main component chain (e.g. sim → policy → learner) is cut recursively. For a segment on
``d`` devices and each cut point:

* **collocated** — both halves share the ``d`` devices and take turns:
  ``T = T_src + T_sink + switches · switch_cost`` (plus offload/onload when both do not fit in the
  memory budget together);
* **disaggregated** — the halves get ``d1`` and ``d − d1`` devices. Across a streaming edge they
  pipeline over ``m`` micro-batches (env groups): ``(c_s + c_t) + (m − 1) · max(c_s, c_t)`` for a
  one-way stream. The env ↔ policy edge is a *cycle* (actions go back to the env), so per rollout
  step a group's round trip ``c_s + c_t`` also bounds it: over ``T`` steps
  ``T · max(m · max(c_s, c_t), c_s + c_t) + min(c_s, c_t)`` (RLinf's form degenerates here: it
  charges the fill once per micro-batch instead of once per rollout).

Compared with RLinf's auto placement, this adds the switch cost, a memory budget, and searches the
stage count ``m`` (RLinf sets it by hand). Per-op costs come from curves fitted to profiled
(size, seconds) points at each thread count (``costmodel.fit_curve``).
"""

from __future__ import annotations

import bisect
import statistics
from collections import defaultdict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Any

from components.config import SchedulerConfig
from components.scheduler.costmodel import CostCurve, IpcCost, fit_curve
from components.scheduler.executor import GROUP_LOOP, RunResult, execute
from components.scheduler.plan import Plan, WorkerSpec, sequential_plan
from components.scheduler.profiler import CapacityReading, Span
from components.scheduler.workflow import Workflow

STEP_LOOP = "step"


@dataclass(frozen=True)
class ChainSpec:
    """The main chain the planner cuts, and which adjacent edges stream per rollout step."""

    chain: tuple[str, ...]
    streaming: dict[tuple[str, str], str] = field(default_factory=dict)  # pair -> "cyclic" | "oneway"
    envs: int = 1
    offload_gb_per_s: float = 10.0  # host<->device bandwidth for offload/onload cost
    pinned_threads: dict[str, int] = field(default_factory=dict)  # components whose thread count is numerics


@dataclass
class Profile:
    """Profiled (size, seconds) samples per (op, threads), and the measured per-switch cost."""

    samples: dict[tuple[str, int], list[tuple[float, float]]] = field(default_factory=lambda: defaultdict(list))
    switch_s: float = 0.0
    dispatch_s: float = 0.0  # executor overhead per op (iteration time not covered by op spans)
    thread_slowdown: float = 1.0  # κ: slowdown of ops overlapping on thread workers (shared interpreter lock)
    capacity: float = 0.0  # cores this process could get when profiled (profiler.effective_cores); 0 = all
    capacity_reading: CapacityReading | None = None  # the probes behind ``capacity`` and whether they qualified
    ipc: IpcCost | None = None  # measured pipe cost of process workers (None: not measured, priced at 0)
    forms: tuple[str, ...] = ("power", "exponential", "log", "quadratic")
    curves: dict[tuple[str, int], CostCurve] = field(default_factory=dict, repr=False)  # fitted, memoized

    def curve(self, op: str, threads: int) -> CostCurve:
        return _curve(self, op, threads)

    def threads_for(self, op: str) -> list[int]:
        return sorted(t for (o, t) in self.samples if o == op)


def _curve(profile: Profile, op: str, threads: int) -> CostCurve:
    key = (op, threads)
    _curve_cache = profile.curves
    if key not in _curve_cache:
        options = profile.threads_for(op)
        if not options:
            raise KeyError(f"no profile for op {op!r}; profile the workflow first")
        t = min(options, key=lambda x: (abs(x - threads), -x))
        pts = profile.samples[(op, t)]
        _curve_cache[key] = fit_curve([p[0] for p in pts], [p[1] for p in pts], profile.forms)
    return _curve_cache[key]


def op_size(workflow: Workflow, op: str, envs: int) -> float:
    """Rows an op processes per call: one env group's share inside the group loop, else all envs."""
    for o, scope in workflow.ops_with_scope():
        if o.name == op:
            return envs / workflow.loops.get(GROUP_LOOP, 1) if GROUP_LOOP in scope else float(envs)
    raise KeyError(f"workflow {workflow.name} has no op {op!r}")


def profile_workflow(workflow_at: Callable[[int], Workflow], cfg: SchedulerConfig, payload: Any, envs: int,
                     stages: Sequence[int], threads: Sequence[int], inputs: dict[str, Any],
                     iterations: int = 2, blas_threads: int | None = 1) -> Profile:
    """Run the sequential schedule at each (m, threads) and collect per-op (size, seconds).

    As RLinf profiles: every component collocated on all its devices; the first iteration is
    warm-up and dropped.
    """
    prof = Profile(forms=tuple(cfg.cost_curves))
    switches = 0
    switch_s = 0.0
    gaps: list[float] = []
    for m in stages:
        wf = workflow_at(m)
        for t in threads:
            plan = sequential_plan(wf, threads=t, blas_threads=blas_threads, groups=m)
            plan = plan.with_(placement={c.name: tuple(f"cpu{k}" for k in range(t)) for c in wf.components
                                         if c.exclusive})
            res = execute(wf, plan, cfg, payload, range(iterations), inputs=inputs)
            for s in res.timeline.spans:
                if s.iteration == 0 and iterations > 1:
                    continue
                prof.samples[(s.op, t)].append((op_size(wf, s.op, envs), s.duration))
            switches += res.switch.switches
            switch_s += res.switch.switch_s
            steady = [s for s in res.timeline.spans if s.iteration > 0] or res.timeline.spans
            busy = sum(s.duration for s in steady)
            wall = sum(res.iteration_s[1:] or res.iteration_s)
            if steady:
                gaps.append(max(wall - busy, 0.0) / len(steady))
    prof.switch_s = switch_s / switches if switches else 0.0
    prof.dispatch_s = statistics.median(gaps) if gaps else 0.0
    return prof


def thread_slowdown(spans: Sequence[Span], alone: dict[str, float], max_kappa: float = 4.0) -> float:
    """κ from a run whose thread workers overlapped: fit ``duration = alone · (1 + f · (κ − 1))``
    by least squares, ``f`` being the fraction of a span that overlapped another worker's span.

    Two Python threads only overlap where their ops release the interpreter lock (large kernels);
    small numpy/torch calls hold it, so κ ≈ 2 means threads give no parallelism at all.
    """
    by_worker: dict[str, list[Span]] = defaultdict(list)
    for s in spans:
        by_worker[s.worker].append(s)
    for xs in by_worker.values():
        xs.sort(key=lambda s: s.start)
    starts = {w: [s.start for s in xs] for w, xs in by_worker.items()}
    num = den = 0.0
    for s in spans:
        base = alone.get(s.op, 0.0)
        if base <= 0 or s.duration <= 0:
            continue
        overlap = 0.0
        for w, xs in by_worker.items():
            if w == s.worker:
                continue
            k = max(bisect.bisect_left(starts[w], s.start) - 1, 0)
            while k < len(xs) and xs[k].start < s.end:
                overlap += max(0.0, min(s.end, xs[k].end) - max(s.start, xs[k].start))
                k += 1
        f = min(overlap / s.duration, 1.0)
        num += f * (s.duration / base - 1.0)
        den += f * f
    if den <= 0:
        return 1.0
    return min(max(1.0 + num / den, 1.0), max_kappa)


# ------------------------------------------------------------------------------------- the search
@dataclass(frozen=True)
class Node:
    """A placement subtree: ``single`` component, or a ``colloc``/``disagg`` cut of two subtrees."""

    kind: str
    comps: tuple[str, ...]
    devices: tuple[int, ...]
    left: Node | None = None
    right: Node | None = None

    def describe(self) -> str:
        d = ",".join(map(str, self.devices))
        if self.kind == "single":
            return f"{self.comps[0]}@[{d}]"
        sep = " | " if self.kind == "disagg" else " + "
        assert self.left and self.right
        return f"({self.left.describe()}{sep}{self.right.describe()})"


@dataclass(frozen=True)
class Candidate:
    """One plan alternative with its predicted iteration time."""

    stages: int
    tree: Node
    predicted_s: float
    plan: Plan
    formula_s: float = 0.0  # the cut-search cost formula (before the replay refinement)


@dataclass(frozen=True)
class PlannerResult:
    best: Candidate
    candidates: tuple[Candidate, ...]

    def table(self) -> str:
        rows = [f"{'m':>2}  {'predicted ms':>12}  {'formula ms':>10}  placement"]
        for c in sorted(self.candidates, key=lambda c: c.predicted_s):
            mark = "  <- chosen" if c is self.best else ""
            rows.append(f"{c.stages:>2}  {c.predicted_s * 1e3:>12.1f}  {c.formula_s * 1e3:>10.1f}  {c.tree.describe()}{mark}")
        return "\n".join(rows)


class M2FlowPlanner:
    """Chooses placement, device split and stage count for a workflow from its profile."""

    def __init__(self, workflow_at: Callable[[int], Workflow], spec: ChainSpec, profile: Profile,
                 cfg: SchedulerConfig, devices: int, blas_threads: int | None = 1) -> None:
        self.workflow_at = workflow_at
        self.spec = spec
        self.profile = profile
        self.cfg = cfg
        self.devices = devices
        self.blas_threads = blas_threads
        self.budget = cfg.memory_budget_mb or float("inf")

    # ---- per-component costs
    def _ops(self, wf: Workflow, comp: str) -> list[tuple[str, tuple[str, ...]]]:
        return [(o.name, sc) for o, sc in wf.ops_with_scope() if o.component == comp]

    def _calls(self, wf: Workflow, scope: tuple[str, ...]) -> int:
        n = 1
        for loop in scope[1:]:
            n *= wf.loops[loop]
        return n

    def threads_for(self, wf: Workflow, comp: str, devices: int) -> int:
        """The component's thread quota on ``devices`` devices: pinned if its numerics fix it,
        else the count (≤ devices) with the lowest profiled cost per iteration."""
        if comp in self.spec.pinned_threads:
            return self.spec.pinned_threads[comp]
        options = range(1, max(devices, 1) + 1)
        return min(options, key=lambda t: (self._comp_cost(wf, comp, t), t))

    def _comp_cost(self, wf: Workflow, comp: str, threads: int) -> float:
        total = 0.0
        for op, scope in self._ops(wf, comp):
            total += self._calls(wf, scope) * self.profile.curve(op, threads)(op_size(wf, op, self.spec.envs))
        return total

    def step_cost(self, wf: Workflow, comps: Sequence[str], devices: int) -> float:
        """Per micro-batch (one group, one step) cost of the step-loop ops of ``comps``."""
        total = 0.0
        for c in comps:
            t = self.threads_for(wf, c, devices)
            for op, scope in self._ops(wf, c):
                if STEP_LOOP in scope:
                    total += self.profile.curve(op, t)(op_size(wf, op, self.spec.envs))
        return total

    def iter_cost(self, wf: Workflow, comps: Sequence[str], devices: int) -> float:
        """Per-iteration cost of the ops of ``comps`` outside the step loop."""
        total = 0.0
        for c in comps:
            t = self.threads_for(wf, c, devices)
            for op, scope in self._ops(wf, c):
                if STEP_LOOP not in scope:
                    total += self._calls(wf, scope) * self.profile.curve(op, t)(op_size(wf, op, self.spec.envs))
        return total

    def _memory(self, wf: Workflow, comps: Sequence[str]) -> float:
        """Resident memory of ``comps`` all onloaded together."""
        return sum(wf.component(c).memory_mb for c in comps if wf.component(c).exclusive)

    def _peak(self, wf: Workflow, comps: Sequence[str]) -> float:
        """The least a segment needs: its largest component (the others offloaded meanwhile)."""
        return max((wf.component(c).memory_mb for c in comps if wf.component(c).exclusive), default=0.0)

    def _edge(self, a: str, b: str) -> str | None:
        return self.spec.streaming.get((a, b)) or self.spec.streaming.get((b, a))

    # ---- the recursion
    def search(self, m: int) -> list[tuple[float, Node]]:
        """Every placement of the chain for stage count ``m`` with its predicted time (memoized)."""
        wf = self.workflow_at(m)
        chain = self.spec.chain
        steps = wf.loops.get(STEP_LOOP, 1)

        @lru_cache(maxsize=None)
        def seg(a: int, b: int, devs: tuple[int, ...]) -> tuple[tuple[float, Node], ...]:
            comps = chain[a: b + 1]
            d = len(devs)
            if a == b and self._memory(wf, comps) > self.budget:
                return ()
            if a == b and self.spec.pinned_threads.get(comps[0], 1) > d:
                return ()  # its numerics need more threads than these devices have cores
            if a == b:
                t = steps * m * self.step_cost(wf, comps, d) + self.iter_cost(wf, comps, d)
                return ((t, Node("single", comps, devs)),)
            out: list[tuple[float, Node]] = []
            for k in range(a, b):
                edge = self._edge(chain[k], chain[k + 1])
                lefts, rights = seg(a, k, devs), seg(k + 1, b, devs)
                # collocated: take turns on all devices
                mem_l, mem_r = self._memory(wf, chain[a:k + 1]), self._memory(wf, chain[k + 1:b + 1])
                if max(self._peak(wf, chain[a:k + 1]), self._peak(wf, chain[k + 1:b + 1])) <= self.budget:
                    switches = 2 * steps * m if edge else 2
                    per_switch = self.profile.switch_s
                    if mem_l + mem_r > self.budget:
                        per_switch += (min(mem_l, mem_r) / 1024) / self.spec.offload_gb_per_s * 2
                    for tl, nl in lefts:
                        for tr, nr in rights:
                            out.append((tl + tr + switches * per_switch, Node("colloc", comps, devs, nl, nr)))
                # disaggregated: split the devices
                for d1 in range(1, d):
                    dl, dr = devs[:d1], devs[d1:]
                    if self._peak(wf, chain[a:k + 1]) > self.budget or self._peak(wf, chain[k + 1:b + 1]) > self.budget:
                        continue
                    for tl, nl in seg(a, k, dl):
                        for tr, nr in seg(k + 1, b, dr):
                            if edge:
                                cs = self.step_cost(wf, chain[a:k + 1], d1)
                                ct = self.step_cost(wf, chain[k + 1:b + 1], d - d1)
                                rest = self.iter_cost(wf, chain[a:k + 1], d1) + self.iter_cost(wf, chain[k + 1:b + 1], d - d1)
                                if edge == "cyclic":
                                    pipe = steps * max(m * max(cs, ct), cs + ct) + min(cs, ct)
                                else:
                                    n = steps * m
                                    pipe = (cs + ct) + (n - 1) * max(cs, ct)
                                t = pipe + rest
                            else:
                                t = tl + tr
                            out.append((t, Node("disagg", comps, devs, nl, nr)))
            return tuple(out)

        return list(seg(0, len(chain) - 1, tuple(range(self.devices))))

    def _ops_per_iteration(self, wf: Workflow) -> int:
        return sum(self._calls(wf, scope) for _, scope in wf.ops_with_scope())

    def side_cost(self, wf: Workflow) -> float:
        side = [c.name for c in wf.components if c.name not in self.spec.chain]
        return self.iter_cost(wf, side, self.devices) + self.step_cost(wf, side, self.devices)

    def plan(self, stages: Sequence[int] | None = None,
             replay: Callable[[Plan], float] | None = None) -> PlannerResult:
        """The best plan over placements × device splits × stage counts, and every alternative.

        The cut search enumerates and prices layouts with the M2Flow formula; with ``replay`` each
        distinct layout is then re-priced by replaying its worker programs (barriers, device
        locks, core sharing, interpreter-lock contention — ``simulate``) and the best replay wins.
        """
        cands: list[Candidate] = []
        for m in stages or self.cfg.pipeline_stages:
            wf = self.workflow_at(m)
            side = self.side_cost(wf) + self.profile.dispatch_s * self._ops_per_iteration(wf)
            seen: set[str] = set()
            for t, node in sorted(self.search(m), key=lambda x: x[0]):
                plan = self.to_plan(wf, node, m, t + side)
                # ((a + b) + c) and (a + (b + c)) are the same execution: keep one of each layout
                key = repr((plan.workers, sorted(plan.threads.items()), sorted(plan.placement.items())))
                if key in seen:
                    continue
                seen.add(key)
                cands.append(Candidate(m, node, t + side, plan, formula_s=t + side))
        if not cands:
            raise ValueError("no placement fits the memory budget (scheduler.memory_budget_mb); raise it")
        if replay is not None:
            priced = []
            for c in cands:
                r = replay(c.plan)
                priced.append(Candidate(c.stages, c.tree, r, c.plan.with_(predicted_s=r), formula_s=c.formula_s))
            cands = priced
        # an extra worker must earn its keep: ties (e.g. a split that cannot overlap) go to fewer workers
        best = min(cands, key=lambda c: c.predicted_s * (1 + self.cfg.accept_margin * (len(c.plan.workers) - 1)))
        return PlannerResult(best, tuple(cands))

    def to_plan(self, wf: Workflow, node: Node, m: int, predicted: float) -> Plan:
        """Workers from a placement tree: collocated subtrees share a worker, disaggregated ones don't."""
        workers: list[tuple[list[str], tuple[int, ...]]] = []

        def pure(n: Node) -> bool:
            return n.kind == "single" or (n.kind == "colloc" and pure(n.left) and pure(n.right))  # type: ignore[arg-type]

        def walk(n: Node) -> None:
            if pure(n):
                workers.append((list(n.comps), n.devices))
                return
            assert n.left is not None and n.right is not None
            walk(n.left)
            walk(n.right)

        walk(node)
        side = [c.name for c in wf.components if c.name not in self.spec.chain]
        workers[-1][0].extend(side)  # side work runs after the chain, on the last worker
        threads: dict[str, int] = {}
        placement: dict[str, tuple[str, ...]] = {}

        def devices_of(n: Node) -> None:
            if n.kind == "single":
                c = n.comps[0]
                threads[c] = self.threads_for(wf, c, len(n.devices))
                if wf.component(c).exclusive:
                    placement[c] = tuple(f"cpu{k}" for k in n.devices)
                return
            assert n.left is not None and n.right is not None
            devices_of(n.left)
            devices_of(n.right)

        devices_of(node)
        for c in side:
            threads[c] = self.threads_for(wf, c, self.devices)
            if wf.component(c).exclusive:
                placement[c] = tuple(f"cpu{k}" for k in range(self.devices))
        specs = []
        for k, (comps, devs) in enumerate(workers):
            disagg = len(devs) < self.devices
            pin = disagg and self.cfg.pin_cores
            specs.append(WorkerSpec(f"w{k}-{comps[0]}", tuple(comps), cores=devs if pin else None))
        return Plan(f"m2flow(m={m})", tuple(specs), groups=m, placement=placement, threads=threads,
                    blas_threads=self.blas_threads, predicted_s=predicted, notes=(node.describe(),))


def measured_iteration(result: RunResult, skip: int = 1) -> float:
    """Median iteration time of a run, skipping warm-up iterations."""
    xs = result.iteration_s[skip:] or result.iteration_s
    return statistics.median(xs)
