"""Discrete-event replay of a plan from profiled op durations (the optimizer's local prediction).

Workers follow their programs exactly as the executor does (semantic edges, iteration barriers,
hoisting, device locks). Running ops share the cores by processor sharing: an op that uses
``threads`` cores progresses at ``min(1, cores / total demand)`` of its profiled speed. Ops on
*thread* workers also share one interpreter lock: while ``k`` of them run at once, each runs
``1 + (κ − 1)(k − 1)`` times slower (``thread_slowdown`` κ, measured by the profiler on this
machine; process workers do not share it). The same engine, with SMs instead of cores, is the
core of the SM model (``sm_model.py``).
"""

from __future__ import annotations

import statistics
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from components.scheduler.costmodel import IpcCost
from components.scheduler.executor import barrier_iteration, instance_devices, programs, worker_of_instance
from components.scheduler.graph import Graph, OpInstance
from components.scheduler.plan import Plan


@dataclass(frozen=True)
class SimSpan:
    uid: int
    op: str
    worker: str
    start: float
    end: float
    demand: float


@dataclass(frozen=True)
class SimResult:
    makespan: float
    iteration_s: list[float]
    spans: list[SimSpan]

    @property
    def iteration(self) -> float:
        xs = self.iteration_s[1:] or self.iteration_s
        return statistics.median(xs)

    def busy_fraction(self, capacity: float) -> float:
        work = sum((s.end - s.start) * min(s.demand, capacity) for s in self.spans)
        return work / (capacity * self.makespan) if self.makespan > 0 else 0.0


def simulate(graph: Graph, plan: Plan, duration: Callable[[OpInstance, int], float],
             demand: Callable[[OpInstance, int], float], capacity: float,
             rate: Callable[[float, float, float], float] | None = None,
             thread_slowdown: float = 1.0, transfer: Mapping[int, float] | None = None) -> SimResult:
    """Replay ``plan`` over ``graph``.

    ``duration(inst, threads)``: seconds alone on the machine; ``demand(inst, threads)``: cores (or
    SMs) it occupies; ``rate(demand, total_demand, capacity)``: its speed relative to running alone
    (default processor sharing); ``thread_slowdown``: κ for ops overlapping on thread workers;
    ``transfer``: seconds an op instance (by uid) spends crossing a process pipe (``transfer_seconds``).
    """
    transfer = transfer or {}
    rate = rate or (lambda d, total, cap: min(1.0, cap / total) if total > 0 else 1.0)
    progs = programs(graph, plan)
    threaded = {w.name for w in plan.workers if w.kind == "thread"}
    pos = {w: 0 for w in progs}
    threads = {c: plan.threads.get(c, plan.default_threads or 1) for c in (x.name for x in graph.workflow.components)}
    done = [False] * len(graph)
    last = graph.iterations[-1]
    per_iter_left: dict[int, int] = {}
    barrier_left: dict[int, int] = {}  # the ops each barrier waits for (lagged ops: a later one)
    for inst in graph.instances:
        per_iter_left[inst.iteration] = per_iter_left.get(inst.iteration, 0) + 1
        gate = barrier_iteration(plan, inst, last)
        barrier_left[gate] = barrier_left.get(gate, 0) + 1
    barrier_done: dict[int, float] = {it: 0.0 for it in per_iter_left if it not in barrier_left}
    locks: dict[str, int | None] = {}
    running: dict[str, tuple[int, float, float, float]] = {}  # worker -> (uid, remaining work, demand, start)
    spans: list[SimSpan] = []
    now = 0.0
    iter_end: dict[int, float] = {}

    def startable(w: str) -> int | None:
        if w in running or pos[w] >= len(progs[w]):
            return None
        uid = progs[w][pos[w]]
        inst = graph.instances[uid]
        lag = 2 if inst.name in plan.hoist else 1
        if plan.barrier and (inst.iteration - lag) in per_iter_left and (inst.iteration - lag) not in barrier_done:
            return None
        if any(not done[p] for p in graph.preds[uid]):
            return None
        comp = graph.workflow.component(inst.component)
        if comp.exclusive:
            for d in instance_devices(plan, inst, w):
                if locks.get(d) is not None:
                    return None
        return uid

    while True:
        progressed = True
        while progressed:
            progressed = False
            for w in progs:
                uid = startable(w)
                if uid is None:
                    continue
                inst = graph.instances[uid]
                comp = graph.workflow.component(inst.component)
                if comp.exclusive:
                    for d in instance_devices(plan, inst, w):
                        locks[d] = uid
                q = threads[inst.component]
                if not inst.op.quota_invariant and inst.component in plan.pinned_threads:
                    q = plan.pinned_threads[inst.component]
                running[w] = (uid, duration(inst, q) + transfer.get(uid, 0.0), demand(inst, q), now)
                progressed = True
        if not running:
            break
        total = sum(r[2] for r in running.values())
        speeds = {w: rate(r[2], total, capacity) for w, r in running.items()}
        shared = [w for w in running if w in threaded]
        if len(shared) > 1 and thread_slowdown != 1.0:
            for w in shared:
                speeds[w] /= 1.0 + (thread_slowdown - 1.0) * (len(shared) - 1)
        dt = min(r[1] / max(speeds[w], 1e-12) for w, r in running.items())
        now += dt
        finished = []
        for w, (uid, rem, dem, st) in list(running.items()):
            rem -= dt * speeds[w]
            if rem <= 1e-12:
                finished.append(w)
            running[w] = (uid, rem, dem, st)
        for w in finished:
            uid, _, dem, st = running.pop(w)
            inst = graph.instances[uid]
            spans.append(SimSpan(uid, inst.name, w, st, now, dem))
            done[uid] = True
            pos[w] += 1
            comp = graph.workflow.component(inst.component)
            if comp.exclusive:
                for d in instance_devices(plan, inst, w):
                    locks[d] = None
            per_iter_left[inst.iteration] -= 1
            if per_iter_left[inst.iteration] == 0:
                iter_end[inst.iteration] = now
            gate = barrier_iteration(plan, inst, last)
            barrier_left[gate] -= 1
            if barrier_left[gate] == 0:
                barrier_done[gate] = now
    if not all(done):
        raise RuntimeError(f"simulated plan {plan.name!r} stalled (an illegal plan should have been refused)")
    ends = [iter_end[i] for i in sorted(iter_end)]
    starts = [0.0, *ends[:-1]]
    return SimResult(now, [e - s for s, e in zip(starts, ends)], spans)


def transfer_seconds(graph: Graph, plan: Plan, ipc: IpcCost, out_bytes: Callable[[str], float]) -> dict[int, float]:
    """Seconds each op instance on a process worker spends on its pipe, moved as the executor moves
    data: every op's outputs stream back to the parent (one message of ``out_bytes(op)``), and a
    version made on another worker crosses into the process once, on its first read there (one
    request). Thread workers pay nothing; graph inputs cross once per run and are not charged."""
    process = {w.name for w in plan.workers if w.kind == "process"}
    if not process:
        return {}
    where = [worker_of_instance(plan, i) for i in graph.instances]
    delivered: set[tuple[str, object]] = set()
    out: dict[int, float] = {}
    for inst in graph.instances:
        w = where[inst.uid]
        if w not in process:
            continue
        seconds = ipc.message_s(out_bytes(inst.name))
        fresh = [k for k in inst.reads if k in graph.producer and where[graph.producer[k]] != w
                 and (w, k) not in delivered]
        if fresh:
            delivered.update((w, k) for k in fresh)
            seconds += ipc.message_s(sum(out_bytes(graph.instances[graph.producer[k]].name) for k in fresh))
        out[inst.uid] = seconds
    return out


def durations_from_medians(medians: dict[tuple[str, int], float], fallback: dict[str, float]) -> Callable[[OpInstance, int], float]:
    """A duration function from measured per-(op, threads) medians, falling back per op."""

    def f(inst: OpInstance, threads: int) -> float:
        key = (inst.name, threads)
        if key in medians:
            return medians[key]
        return fallback.get(inst.name, 0.0)

    return f

