"""The wiring of one run: which workers each produced version goes to, the devices with their
memory budgets, and each worker's inbox channel."""

from __future__ import annotations

import os
from collections import defaultdict

from components.config import SchedulerConfig
from components.scheduler.channels import Channel
from components.scheduler.devices import DeviceRegistry, MemoryBudgetError
from components.scheduler.graph import Graph, LegalityError, VersionKey
from components.scheduler.plan import Plan
from components.scheduler.workflow import Workflow


def routes(graph: Graph, inst_worker: list[str]
            ) -> tuple[list[list[tuple[VersionKey, list[str]]]], dict[tuple[str, VersionKey], int]]:
    """Which other workers need each produced version, and each worker's local reader count per
    version (for eviction)."""
    route: list[list[tuple[VersionKey, list[str]]]] = [[] for _ in graph.instances]
    local_readers: dict[tuple[str, VersionKey], int] = defaultdict(int)
    for inst in graph.instances:
        for key in inst.writes:
            dests = sorted({inst_worker[r] for r in graph.readers.get(key, [])} - {inst_worker[inst.uid]})
            route[inst.uid].append((key, dests))
        for key in inst.reads:
            local_readers[(inst_worker[inst.uid], key)] += 1
    return route, local_readers


def device_registry(wf: Workflow, plan: Plan, cfg: SchedulerConfig) -> DeviceRegistry:
    """The run's devices (cores, and GPUs the plan names) with their memory budgets, checked
    against every placed component."""
    devices = tuple(f"cpu{k}" for k in range(cfg.devices or (os.cpu_count() or 1)))
    if any(d.startswith("gpu") for v in plan.placement.values() for d in v):
        devices = devices + tuple(sorted({d for v in plan.placement.values() for d in v if d.startswith("gpu")}))
    budget = {d: (cfg.memory_budget_mb or float("inf")) for d in devices}
    for comp, devs in plan.placement.items():
        need = wf.component(comp).memory_mb
        for d in devs:
            if d not in budget:
                raise LegalityError(f"plan {plan.name!r} places {comp!r} on unknown device {d!r}; devices: {devices}")
            if need > budget[d]:
                raise MemoryBudgetError(
                    f"plan {plan.name!r}: component {comp!r} needs {need:.0f} MB but device {d} has a budget of "
                    f"{budget[d]:.0f} MB (scheduler.memory_budget_mb); place it on a larger device"
                )
    return DeviceRegistry(devices, budget)


def inboxes(plan: Plan, cfg: SchedulerConfig, route: list[list[tuple[VersionKey, list[str]]]],
             iterations: range) -> dict[str, Channel]:
    """One inbox per worker. It holds at least two iterations of the worker's remote inputs: a
    legal plan (whose consumers may gather a whole rollout at once) never deadlocks on
    backpressure, while a producer still cannot run more than about two iterations ahead of its
    consumer."""
    remote_in: dict[str, int] = defaultdict(int)
    for outputs in route:
        for _, dests in outputs:
            for d in dests:
                remote_in[d] += 1
    per_iter = {w: -(-n // max(len(iterations), 1)) for w, n in remote_in.items()}
    return {
        w.name: Channel(f"inbox:{w.name}", max(cfg.channel_capacity, 2 * per_iter.get(w.name, 0)), cfg.channel_timeout_s)
        for w in plan.workers
    }
