"""The executor: runs a workflow's unrolled graph under a plan, with workers, channels and locks.

Each worker (a thread, or a proxy thread driving a spawned process) has a *program*: its op
instances in sequential order, except hoisted ops, which move to the tail of the previous
iteration (placement.py). Before an op runs, the worker waits for its semantic predecessors,
takes its inputs, takes the device lock if the component is exclusive, runs, and routes each
output to the workers that read it (run.py; process workers: process_worker.py).

In-place states are guarded at run time: every read checks that its buffer slot still holds the
version the sequential schedule would read (``LegalityError`` otherwise), so an illegal plan fails
instead of silently computing something else.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from components.config import SchedulerConfig
from components.scheduler.placement import (
    GROUP_LOOP,
    barrier_iteration,
    check_schedule,
    instance_devices,
    plan_workflow,
    programs,
    worker_of_instance,
)
from components.scheduler.plan import Plan
from components.scheduler.profiler import GpuTelemetry
from components.scheduler.run import PlanRun
from components.scheduler.run_result import Callback, ExecutionError, RunResult
from components.scheduler.workflow import BuildContext, Workflow

# the names callers import from here (the executor's parts hold them)
__all__ = [
    "GROUP_LOOP", "Callback", "ExecutionError", "RunResult", "barrier_iteration", "build_states", "check_schedule",
    "execute",
    "instance_devices", "plan_workflow", "programs", "worker_of_instance",
]


def execute(
    workflow: Workflow,
    plan: Plan,
    cfg: SchedulerConfig,
    payload: Any,
    iterations: range,
    inputs: Mapping[str, Any] | None = None,
    record: tuple[str, ...] = (),
    components: dict[str, Any] | None = None,
    gpu: GpuTelemetry | None = None,
    on_iteration: Callable[[int, dict[str, Any]], None] | None = None,
) -> RunResult:
    """Run ``iterations`` of ``workflow`` under ``plan``.

    ``payload`` goes to component factories; ``components`` may pass already-built component
    states (thread workers only) so a caller can keep them across calls. ``record`` names states
    whose every version is returned in ``RunResult.records``; ``final`` always holds the latest
    version of every immutable state. ``on_iteration(i, recorded)`` is called (from a worker
    thread, one call at a time) when every op of iteration ``i`` is done, with that iteration's
    recorded states — live progress for a caller.
    """
    run = PlanRun(workflow, plan, cfg, iterations, dict(inputs or {}), record, gpu, on_iteration)
    run.build_workers(payload, components or {})
    return run.run()


def build_states(workflow: Workflow, plan: Plan, payload: Any) -> dict[str, Any]:
    """Build every component's state once (to reuse across ``execute`` calls on thread workers)."""
    wf = plan_workflow(workflow, plan)
    ctx = BuildContext(payload, dict(wf.loops))
    return {c.name: c.factory(ctx) for c in wf.components}
