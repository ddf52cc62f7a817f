"""Rose graph optimizer: fill low-activity windows without changing what any read sees.

Loop: measure the current plan → find low-activity windows (busy cores below a threshold for at
least ``min_window_ms``) → generate transformations → refuse illegal ones (``check_schedule``:
program order + barriers must not contradict the version edges; in-place states need their
buffers) → predict each legal one by replaying it from profiled durations (``simulate``) → for
those predicted to gain, run measured end-to-end iterations interleaved with the current plan →
keep only what the measurement confirms; otherwise roll back.

Transformations (all plan rewrites; the workflow never changes):

* ``pipeline_env_groups`` — split the envs into groups so env steps of one group overlap
  inference of another within a rollout step;
* ``side_worker`` / ``side_process`` — side work (evaluation with the previous weights, retrieval)
  on its own worker thread, or in its own process (no GIL sharing; pays pickling per op),
  overlapping the rollout tail and the learner;
* ``rollout_process`` / ``rollout_process(m=k)`` — the rollout group (env + inference, the
  components a cyclic stream joins) in one worker process of its own (RLinf's collocated mode, the
  best process split by hand), at the plan's env-group count or at another profiled count ``k``
  (its pipe carries one message per op, so fewer groups mean fewer messages): the rollout leaves
  the parent's interpreter lock to the learner and side work; pays the pipe (priced from the
  measured IPC cost);
* ``replicate_rollout`` — the replicable components (env groups and their policy copy) replicated
  on one process per core, each serving its share of the env groups: the rollout itself runs in
  parallel (data-parallel, as RLinf's env/rollout workers), the learner gathers every group;
* ``replicate_side`` — the stateless side components (``Component.stateless``: a validator that
  loads the weights it reads) on one process per core taking turns, iteration ``i`` on replica
  ``i mod k``, each turn allowed to trail the barrier by ``k - 1`` iterations (``Plan.lag``): side
  work slower than the chain no longer paces it, and no op runs twice or on a split of its inputs
  (splitting a rollout's robots into groups pays each step's fixed cost once per group);
* ``split:<component>`` — a component on its own worker (learner-side work such as per-group
  advantages starts as each group's rollout ends);
* ``hoist:<op>`` — exempt an op from the iteration barrier so it runs in the previous iteration's
  tail (next resets, retrieval/batch prefetch, weight sync with resets);
* ``prefetch:<a>+<b>`` / ``prefetch_process:<a>+<b>`` — the prefetch chain (``prefetch_chain``: the
  main-chain ops that depend on nothing but the iteration index, e.g. sample → augment) on a worker
  thread (or process) of its own *and* hoisted, in one step, so iteration ``i+1``'s inputs are made
  while iteration ``i`` learns. Neither half gains alone (on the learner's worker a hoisted op still
  waits for the learner; on its own worker an unhoisted one still waits for the barrier), and
  hoisting a chain op without its producers deadlocks, so greedy single steps never reach it;
* ``double_buffer:<state>`` — a second buffer for an in-place state (costs its memory), which
  makes more hoists legal.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable
from dataclasses import dataclass, field, replace

from components.config import SchedulerConfig
from components.scheduler.executor import GROUP_LOOP, check_schedule, plan_workflow
from components.scheduler.graph import LegalityError, build_graph
from components.scheduler.plan import Plan, WorkerSpec
from components.scheduler.profiler import Timeline
from components.scheduler.workflow import ITERATION, StateRef, Workflow, WorkflowError


@dataclass(frozen=True)
class Window:
    """A low-activity interval of a measured iteration and what ran during it."""

    start: float
    end: float
    busy_cores: float
    running: tuple[str, ...]

    @property
    def length(self) -> float:
        return self.end - self.start


def low_activity_windows(timeline: Timeline, capacity: float, threshold: float, min_window_s: float,
                         iteration: int | None = None) -> list[Window]:
    """Intervals where the running ops keep fewer than ``threshold · capacity`` cores busy.

    Something runs at every instant of an iteration, and in such an interval only a few ops do:
    they are the critical path there, and the idle cores beside them are what a rewrite can fill.
    """
    spans = [s for s in timeline.spans if iteration is None or s.iteration == iteration]
    if not spans:
        return []
    points = sorted({s.start for s in spans} | {s.end for s in spans})
    out: list[Window] = []
    cur: list[tuple[float, float, float, set[str]]] = []
    for a, b in zip(points, points[1:]):
        live = [s for s in spans if s.start < b and s.end > a]
        busy = sum(min(max(s.threads, 1), capacity) for s in live)
        if busy < threshold * capacity:
            cur.append((a, b, busy, {s.op for s in live}))
        elif cur:
            out.append(_merge(cur))
            cur = []
    if cur:
        out.append(_merge(cur))
    return [w for w in out if w.length >= min_window_s]


def _merge(parts: list[tuple[float, float, float, set[str]]]) -> Window:
    start, end = parts[0][0], parts[-1][1]
    busy = sum((b - a) * x for a, b, x, _ in parts) / max(end - start, 1e-12)
    ops: set[str] = set()
    for *_, s in parts:
        ops |= s
    return Window(start, end, busy, tuple(sorted(ops)))


@dataclass(frozen=True)
class Transformation:
    name: str
    apply: Callable[[Plan], Plan]


@dataclass(frozen=True)
class Decision:
    """What happened to one transformation."""

    name: str
    legal: bool
    refusal: str = ""
    predicted_before_s: float = 0.0
    predicted_after_s: float = 0.0
    measured_before_s: float = 0.0
    measured_after_s: float = 0.0
    kept: bool = False
    reason: str = ""


@dataclass
class RoseResult:
    plan: Plan
    decisions: list[Decision] = field(default_factory=list)
    windows: list[Window] = field(default_factory=list)

    def report(self) -> str:
        lines = [f"Rose: {len(self.windows)} low-activity window(s) on the measured iteration "
                 f"({sum(w.length for w in self.windows) * 1e3:.1f} ms)"]
        for d in self.decisions:
            if not d.legal:
                lines.append(f"  refused  {d.name:<28} {d.refusal}")
            elif d.measured_after_s:
                verdict = "KEPT     " if d.kept else "rolled back"
                lines.append(f"  {verdict} {d.name:<28} predicted {d.predicted_before_s * 1e3:.1f}→"
                             f"{d.predicted_after_s * 1e3:.1f} ms, measured {d.measured_before_s * 1e3:.1f}→"
                             f"{d.measured_after_s * 1e3:.1f} ms")
            else:
                lines.append(f"  skipped  {d.name:<28} {d.reason}")
        return "\n".join(lines)


def _workers_without(plan: Plan, comps: tuple[str, ...]) -> list[WorkerSpec]:
    out = []
    for w in plan.workers:
        rest = tuple(c for c in w.components if c not in comps)
        if rest:
            out.append(replace(w, components=rest))
    return out


def replicate_rollout(workflow: Workflow, plan: Plan, replicas: int) -> Plan | None:
    """``plan`` with its replicable components on ``replicas`` process workers, env groups split
    evenly between them (the stage count rises to ``replicas`` if it was lower); None if nothing
    is replicable or already replicated."""
    comps = tuple(c.name for c in workflow.components if c.replicable and c.process_ok)
    if GROUP_LOOP not in workflow.loops or not comps or replicas < 2:
        return None
    if any(len(plan.hosts(c)) > 1 for c in comps):
        return None
    groups = max(plan.groups or workflow.loops[GROUP_LOOP], replicas)
    groups += (-groups) % replicas
    share = groups // replicas
    rollout = tuple(WorkerSpec(f"rollout{r}", comps, kind="process", groups=tuple(range(r * share, (r + 1) * share)))
                    for r in range(replicas))
    threads = {**plan.threads, **{c: 1 for c in comps}}
    return plan.with_(workers=(*_workers_without(plan, comps), *rollout), groups=groups, threads=threads)


def replicate_side(workflow: Workflow, plan: Plan, replicas: int) -> Plan | None:
    """``plan`` with its stateless side components on ``replicas`` process workers taking turns by
    iteration, their side ops trailing the barrier by ``replicas - 1``; None if there are none, fewer
    than 2 replicas, or they are replicated already."""
    side_ops = [op for op, _ in workflow.ops_with_scope() if op.side]
    comps = tuple(sorted({op.component for op in side_ops}))
    if replicas < 2 or not comps or any(len(plan.hosts(c)) > 1 for c in comps):
        return None
    if not all(workflow.component(c).stateless and workflow.component(c).process_ok for c in comps):
        return None
    if any(op.component in comps for op, _ in workflow.ops_with_scope() if not op.side):
        return None  # a side component that also runs chain work keeps one home
    turns = tuple(WorkerSpec(f"side{r}", comps, kind="process", turn=(r, replicas)) for r in range(replicas))
    return plan.with_(workers=(*_workers_without(plan, comps), *turns),
                      threads={**plan.threads, **{c: 1 for c in comps}},
                      lag={**plan.lag, **{op.name: replicas - 1 for op in side_ops}})


def rollout_in_process(workflow: Workflow, plan: Plan, rollout: tuple[str, ...], groups: int | None = None) -> Plan | None:
    """``plan`` with the ``rollout`` components together on one process worker (the executor's
    process worker, as ``SchedulerRuntime.coarse_processes(colocate_rollout=True)`` places them),
    their quotas kept, at ``groups`` env groups (default: the plan's own count); None if there is
    no such group, one may not leave the parent process, it is replicated, or the plan already has
    that process at that group count."""
    if not rollout or not all(workflow.component(c).process_ok for c in rollout):
        return None
    if any(len(plan.hosts(c)) > 1 for c in rollout):
        return None
    m = _group_count(workflow, plan, groups)
    if m is None:
        return None
    placed = any(w.kind == "process" and set(w.components) == set(rollout) for w in plan.workers)
    if placed and m == plan.groups:
        return None
    moved = plan.with_(workers=(*_workers_without(plan, rollout), WorkerSpec("rollout", rollout, kind="process")))
    return moved.with_(groups=m) if m != plan.groups else moved


def _group_count(workflow: Workflow, plan: Plan, groups: int | None) -> int | None:
    """The env-group count a rewrite asking for ``groups`` gives ``plan`` (its own when None);
    None when the workflow has no group loop but a count was asked for."""
    if groups is None:
        return plan.groups
    if GROUP_LOOP not in workflow.loops:
        return None
    return groups


def _rollout_process_rewrites(workflow: Workflow, plan: Plan, rollout: tuple[str, ...],
                              stages: tuple[int, ...]) -> list[Transformation]:
    """``rollout_process`` at the plan's env-group count, and ``rollout_process(m=k)`` for every
    other candidate count ``k`` in ``stages`` (the counts the profile covers): a process rollout
    exchanges one message per op, so its best group count is not the thread plan's."""
    current = plan.groups or workflow.loops.get(GROUP_LOOP)
    out: list[Transformation] = []
    if rollout_in_process(workflow, plan, rollout) is not None:
        out.append(Transformation("rollout_process", lambda p: rollout_in_process(workflow, p, rollout) or p))
    for m in stages if GROUP_LOOP in workflow.loops else ():
        if m == current or rollout_in_process(workflow, plan, rollout, groups=m) is None:
            continue
        out.append(Transformation(f"rollout_process(m={m})",
                                  lambda p, m=m: rollout_in_process(workflow, p, rollout, groups=m) or p))
    return out


PREFETCH_WORKER = "prefetch"


def prefetch_chain(workflow: Workflow) -> tuple[str, ...]:
    """The ops (body order) that depend on nothing but the iteration index and feed the rest: the
    learner's input prefix, e.g. the vision trainer's sample → augment.

    An op belongs if it is at iteration scope, not ``side`` (side work has its own rewrites), every
    read is a same-iteration version (``name@iteration``) of a state that only chain ops write, every
    write is a same-iteration version, and its component runs no op outside the chain (the rewrite
    moves whole components). The largest such set: grown from the ops that read nothing, then the
    components that also run other ops are dropped and it is grown again, until it is stable. Empty
    when there is none, when it feeds no other op, or when it is every component."""
    ops = [op for op, _ in workflow.ops_with_scope()]
    scope = dict((op.name, sc) for op, sc in workflow.ops_with_scope())
    refs = {op.name: ([StateRef.parse(t, f"op {op.name!r}") for t in op.reads],
                      [StateRef.parse(t, f"op {op.name!r}") for t in op.writes]) for op in ops}
    writers: dict[str, set[str]] = {}
    for op in ops:
        for ref in refs[op.name][1]:
            writers.setdefault(ref.name, set()).add(op.name)

    def this_iteration(ref: StateRef) -> bool:
        return ref.loop == ITERATION and ref.offset == 0 and ref.absolute is None and ref.part is None

    allowed = {op.name for op in ops if scope[op.name] == (ITERATION,) and not op.side
               and all(this_iteration(r) for r in refs[op.name][0] + refs[op.name][1])}
    while True:
        chain: set[str] = set()
        grown = True
        while grown:  # least fixpoint: reads produced only by ops already in the chain
            more = {n for n in allowed - chain if all(writers.get(r.name) and writers[r.name] <= chain
                                                       for r in refs[n][0])}
            grown = bool(more)
            chain |= more
        shared = {op.component for op in ops if op.name not in chain}
        keep = {n for n in chain if workflow.op(n).component not in shared}
        if keep == chain:
            break
        allowed = keep
    made = {r.name for n in chain for r in refs[n][1]}
    feeds = any(r.name in made for op in ops if op.name not in chain for r in refs[op.name][0])
    comps = {workflow.op(n).component for n in chain}
    if not chain or not feeds or comps == {c.name for c in workflow.components}:
        return ()
    return tuple(op.name for op in ops if op.name in chain)


def prefetch_plan(workflow: Workflow, plan: Plan, chain: tuple[str, ...], kind: str = "thread") -> Plan | None:
    """``plan`` with the ``chain``'s components on one worker of their own (``kind``: thread or
    process) and every chain op hoisted, so the next iteration's chain runs beside this iteration's
    consumers; their quotas kept. None if there is no chain, a component may not go to a process
    (``process_ok``) or is replicated, or the plan already runs the chain that way."""
    if not chain:
        return None
    comps = tuple(dict.fromkeys(workflow.op(n).component for n in chain))
    if kind == "process" and not all(workflow.component(c).process_ok for c in comps):
        return None
    if any(len(plan.hosts(c)) != 1 for c in comps):
        return None
    host = plan.hosts(comps[0])[0]
    if set(chain) <= plan.hoist and set(host.components) == set(comps) and host.kind == kind:
        return None
    rest = _workers_without(plan, comps)
    taken = {w.name for w in rest}
    name = next(n for n in (PREFETCH_WORKER, *(f"{PREFETCH_WORKER}{k}" for k in range(1, len(taken) + 2)))
                if n not in taken)
    return plan.with_(workers=(*rest, WorkerSpec(name, comps, kind=kind)),  # type: ignore[arg-type]
                      hoist=plan.hoist | frozenset(chain))


def _prefetch_rewrites(workflow: Workflow, plan: Plan) -> list[Transformation]:
    """``prefetch:<chain>`` on a thread and ``prefetch_process:<chain>`` in a process, where legal to build."""
    chain = prefetch_chain(workflow)
    label = "+".join(chain)
    out: list[Transformation] = []
    for kind, prefix in (("thread", "prefetch"), ("process", "prefetch_process")):
        if prefetch_plan(workflow, plan, chain, kind) is not None:
            out.append(Transformation(f"{prefix}:{label}",
                                      lambda p, kind=kind: prefetch_plan(workflow, p, chain, kind) or p))
    return out


def candidate_transformations(workflow: Workflow, plan: Plan, replicas: int = 2,
                              rollout: tuple[str, ...] = (), stages: tuple[int, ...] = ()) -> list[Transformation]:
    """Every rewrite Rose may try on ``plan`` (legality is checked separately); ``replicas``: how
    many rollout replicas ``replicate_rollout`` makes (the cores there are); ``rollout``: the
    env + inference group ``rollout_process`` may move into a process (``Roles.rollout``);
    ``stages``: the env-group counts it may move it at (``scheduler.pipeline_stages``)."""
    out: list[Transformation] = []
    if GROUP_LOOP in workflow.loops and (plan.groups or workflow.loops[GROUP_LOOP]) == 1:
        def pipeline(p: Plan) -> Plan:
            sim = next((w for w in p.workers if "sim" in w.components), None)
            workers = list(p.workers)
            if sim is not None and len(sim.components) > 1:
                workers = [*_workers_without(p, ("sim",)), WorkerSpec("sim", ("sim",))]
            return p.with_(groups=2, workers=tuple(workers))
        out.append(Transformation("pipeline_env_groups", pipeline))
    side = tuple(sorted({op.component for op, _ in workflow.ops_with_scope() if op.side}))
    if side and not any(set(w.components) == set(side) for w in plan.workers):
        def side_worker(p: Plan, side: tuple[str, ...] = side) -> Plan:
            threads = {**p.threads, **{c: 1 for c in side}}
            return p.with_(workers=(*_workers_without(p, side), WorkerSpec("side", side)), threads=threads)
        out.append(Transformation("side_worker", side_worker))
        if all(workflow.component(c).process_ok for c in side):
            def side_process(p: Plan, side: tuple[str, ...] = side) -> Plan:
                threads = {**p.threads, **{c: 1 for c in side}}
                return p.with_(workers=(*_workers_without(p, side), WorkerSpec("side", side, kind="process")),
                               threads=threads)
            out.append(Transformation("side_process", side_process))
    if replicate_side(workflow, plan, replicas) is not None:
        out.append(Transformation("replicate_side", lambda p: replicate_side(workflow, p, replicas) or p))
    out += _rollout_process_rewrites(workflow, plan, rollout, stages)
    if replicate_rollout(workflow, plan, replicas) is not None:
        out.append(Transformation("replicate_rollout",
                                  lambda p: replicate_rollout(workflow, p, replicas) or p))
    for w in plan.workers:
        if len(w.components) > 1:
            for c in w.components:
                if c in side:
                    continue
                def split(p: Plan, c: str = c) -> Plan:
                    return p.with_(workers=(*_workers_without(p, (c,)), WorkerSpec(c, (c,))))
                out.append(Transformation(f"split:{c}", split))
    out += _prefetch_rewrites(workflow, plan)
    for op, _ in workflow.ops_with_scope():
        if op.name not in plan.hoist:
            out.append(Transformation(f"hoist:{op.name}", lambda p, n=op.name: p.with_(hoist=p.hoist | {n})))
    for s in workflow.states:
        if s.double_bufferable and plan.buffers.get(s.name, s.buffers) == 1:
            out.append(Transformation(f"double_buffer:{s.name}",
                                      lambda p, n=s.name: p.with_(buffers={**p.buffers, n: 2})))
    return out


def unoffered_groups(workflow: Workflow, plan: Plan, stages: tuple[int, ...]) -> str:
    """Why ``plan``'s env-group count is not one of ``stages`` (``scheduler.pipeline_stages``: the
    counts the profile covers and the workload accepts, e.g. PPO's inference chunk must divide each
    group), else empty. Rewrites that regroup (``pipeline_env_groups``, ``replicate_rollout``) pick
    their count without the workload, so each proposal is checked here; no ``stages``: any count."""
    if not stages or GROUP_LOOP not in workflow.loops:
        return ""
    m = plan.groups or workflow.loops[GROUP_LOOP]
    if m in stages:
        return ""
    return f"{m} env groups is not an offered stage count {tuple(stages)} (scheduler.pipeline_stages)"


def legality(workflow: Workflow, plan: Plan, iterations: range) -> str:
    """Empty string if ``plan`` is legal for ``workflow``, else why not."""
    try:
        wf = plan_workflow(workflow, plan)
        check_schedule(build_graph(wf, iterations, plan.buffers), plan)
    except (LegalityError, WorkflowError) as exc:
        return str(exc)
    return ""


class RoseOptimizer:
    """Window-guided, validated plan rewriting.

    ``measure(plans) -> list of median iteration seconds`` runs the plans interleaved;
    ``predict(plan, basis) -> seconds`` replays a plan from op durations measured on ``basis`` (the
    current plan), so a proposal and the current plan are predicted on the same footing;
    ``timeline(plan)`` gives a measured timeline to look for windows in.
    """

    def __init__(self, workflow: Workflow, cfg: SchedulerConfig, capacity: int,
                 measure: Callable[[list[Plan]], list[float]], predict: Callable[[Plan, Plan], float],
                 timeline: Callable[[Plan], Timeline], check_iterations: range = range(3),
                 rollout: tuple[str, ...] = (), stages: tuple[int, ...] = ()) -> None:
        self.workflow = workflow
        self.cfg = cfg
        self.capacity = capacity
        self.measure = measure
        self.predict = predict
        self.timeline = timeline
        self.check_iterations = check_iterations
        self.rollout = rollout
        self.stages = stages

    def optimize(self, plan: Plan, max_rounds: int = 3) -> RoseResult:
        result = RoseResult(plan)
        tl = self.timeline(plan)
        last_it = max((s.iteration for s in tl.spans), default=0)
        result.windows = low_activity_windows(tl, self.capacity, self.cfg.activity_threshold,
                                              self.cfg.min_window_ms / 1e3, iteration=last_it)
        current = plan
        tried: set[str] = set()
        for _ in range(max_rounds):
            if not result.windows:
                break
            current_pred = self.predict(current, current)
            scored: list[tuple[float, Transformation, Plan]] = []
            for t in candidate_transformations(self.workflow, current, replicas=max(int(self.capacity), 1),
                                               rollout=self.rollout, stages=self.stages):
                if t.name in tried:
                    continue
                tried.add(t.name)
                proposal = t.apply(current).with_(name=f"{current.name}+{t.name}")
                why = (unoffered_groups(self.workflow, proposal, self.stages)
                       or legality(self.workflow, proposal, self.check_iterations))
                if why:
                    result.decisions.append(Decision(t.name, False, refusal=why[:160]))
                    continue
                pred = self.predict(proposal, current)
                if pred >= current_pred * (1 - self.cfg.accept_margin):
                    result.decisions.append(Decision(t.name, True, predicted_before_s=current_pred,
                                                     predicted_after_s=pred, reason=(
                                                         f"predicted {current_pred * 1e3:.1f}→{pred * 1e3:.1f} ms: no gain")))
                    continue
                scored.append((pred, t, proposal))
            if not scored:
                break
            accepted = False
            for pred, t, proposal in sorted(scored, key=lambda x: x[0]):
                before, after = self.measure([current, proposal])
                kept = after < before * (1 - self.cfg.accept_margin)
                result.decisions.append(Decision(
                    t.name, True, predicted_before_s=current_pred, predicted_after_s=pred,
                    measured_before_s=before, measured_after_s=after, kept=kept,
                    reason="measured gain confirmed" if kept else "measured gain too small: rolled back"))
                if kept:
                    current, accepted = proposal.with_(predicted_s=pred), True  # describe() shows its replay
                    tried.discard(t.name)
                    tl = self.timeline(current)  # windows of the new plan guide the next round
                    last_it = max((s.iteration for s in tl.spans), default=0)
                    result.windows = low_activity_windows(tl, self.capacity, self.cfg.activity_threshold,
                                                          self.cfg.min_window_ms / 1e3, iteration=last_it)
                    break
            if not accepted:
                break
            tried = {d.name for d in result.decisions if d.kept}  # re-examine the rest on the new plan
        result.plan = current
        return result


def median(xs: list[float]) -> float:
    return statistics.median(xs)
