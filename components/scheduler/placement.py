"""Where each op instance of a plan runs and in what order, and whether that order is legal.

Each worker has a *program*: its op instances in sequential order, except hoisted ops, which move
to the tail of the previous iteration. ``check_schedule`` refuses, before anything runs, a plan
whose program order and barriers contradict the version dependencies (it would deadlock).
"""

from __future__ import annotations

from components.scheduler.graph import Graph, LegalityError, OpInstance
from components.scheduler.plan import Plan
from components.scheduler.workflow import Workflow

GROUP_LOOP = "group"


def plan_workflow(workflow: Workflow, plan: Plan) -> Workflow:
    """The workflow with the plan's env-group count applied (if it has a group loop)."""
    if plan.groups and GROUP_LOOP in workflow.loops and workflow.loops[GROUP_LOOP] != plan.groups:
        return workflow.replace_loops(**{GROUP_LOOP: plan.groups})
    return workflow


def worker_of_instance(plan: Plan, inst: OpInstance) -> str:
    """The worker that runs one op instance (a replicated component's group ops go to their replica,
    a component replicated by turns runs each iteration's ops on the replica whose turn it is)."""
    return plan.worker_of(inst.component, inst.indices.get(GROUP_LOOP), inst.iteration).name


def barrier_iteration(plan: Plan, inst: OpInstance, last: int) -> int:
    """The iteration whose barrier waits for ``inst``: its own, or ``plan.lag`` later (at most the last)."""
    return min(inst.iteration + plan.lag.get(inst.name, 0), last)


def instance_devices(plan: Plan, inst: OpInstance, worker: str) -> tuple[str, ...]:
    """Devices whose lock an op instance takes: its component's placement, or for a replicated
    component the one device of that placement its replica owns (replicas never share a lock)."""
    devs = plan.placement.get(inst.component, ())
    if devs and len(plan.hosts(inst.component)) > 1:
        return (devs[plan.replica_index(inst.component, worker) % len(devs)],)
    return devs


def programs(graph: Graph, plan: Plan) -> dict[str, list[int]]:
    """Each worker's op order: sequential order, hoisted ops moved to the previous iteration's tail."""
    first = graph.iterations.start
    out: dict[str, list[tuple[float, int]]] = {w.name: [] for w in plan.workers}
    for inst in graph.instances:
        w = worker_of_instance(plan, inst)
        it = inst.iteration
        key = it - 0.5 if (inst.name in plan.hoist and it > first) else float(it)
        out[w].append((key, inst.uid))
    return {w: [u for _, u in sorted(v)] for w, v in out.items()}


def check_schedule(graph: Graph, plan: Plan) -> None:
    """Raise ``LegalityError`` if the plan's program order + barriers contradict the version edges.

    Semantic edges are always enforced, so a legal plan can only wait, never read a wrong
    version; an illegal one would deadlock (a cycle) — this check refuses it up front.
    """
    _check_placement(graph.workflow, plan)
    ops = {op.name: op for op, _ in graph.workflow.ops_with_scope()}
    unknown = (set(plan.hoist) | set(plan.lag)) - set(ops)
    if unknown:
        raise LegalityError(f"plan {plan.name!r} hoists or lags unknown ops {sorted(unknown)}")
    trailing = [n for n, k in plan.lag.items() if k < 0 or (k > 0 and not ops[n].side)]
    if trailing:
        raise LegalityError(f"plan {plan.name!r} lags ops {sorted(trailing)}: only side ops may trail the "
                            "barrier, by 0 or more iterations")
    n = len(graph)
    its = list(graph.iterations)
    bidx = {it: n + k for k, it in enumerate(its)}  # barrier node of iteration it
    succ: list[list[int]] = [list(s) for s in graph.succs] + [[] for _ in its]
    for inst in graph.instances:
        succ[inst.uid].append(bidx[barrier_iteration(plan, inst, its[-1])])
        if plan.barrier:
            lag = 2 if inst.name in plan.hoist else 1
            prev = inst.iteration - lag
            if prev in bidx:
                succ[bidx[prev]].append(inst.uid)
    for prog in programs(graph, plan).values():
        for a, b in zip(prog, prog[1:]):
            succ[a].append(b)
    indeg = [0] * len(succ)
    for s in succ:
        for d in s:
            indeg[d] += 1
    ready = [u for u in range(len(succ)) if indeg[u] == 0]
    seen = 0
    while ready:
        u = ready.pop()
        seen += 1
        for d in succ[u]:
            indeg[d] -= 1
            if indeg[d] == 0:
                ready.append(d)
    if seen != len(succ):
        stuck = [graph.instances[u].label() for u in range(n) if indeg[u] > 0][:3]
        raise LegalityError(
            f"plan {plan.name!r}: its program order and barriers contradict the version dependencies "
            f"(would deadlock around {stuck}); un-hoist those ops or add the buffers they need"
        )


def _check_placement(workflow: Workflow, plan: Plan) -> None:
    """Every component placed once, or replicated: on several workers whose env groups partition the
    group loop, and only if the component declares itself ``replicable``; or on several workers whose
    turns partition the iterations, and only if it declares itself ``stateless``."""
    names = {c.name for c in workflow.components}
    placed = [c for w in plan.workers for c in w.components]
    if set(placed) != names:
        raise LegalityError(f"plan {plan.name!r} must place every component: {sorted(set(placed))} vs {sorted(names)}")
    groups = workflow.loops.get(GROUP_LOOP)
    for c in sorted(names):
        hosts = plan.hosts(c)
        if len(hosts) == 1:
            continue
        if any(w.turn is not None for w in hosts):
            _check_turns(workflow, plan, c)
            continue
        if not workflow.component(c).replicable:
            raise LegalityError(f"plan {plan.name!r} places component {c!r} on {len(hosts)} workers, but it is not "
                                "replicable (its state is not per env group); place it once")
        served = sorted(g for w in hosts for g in (w.groups or ()))
        if groups is None or served != list(range(groups)):
            raise LegalityError(f"plan {plan.name!r}: the replicas of {c!r} serve env groups {served}; they must "
                                f"serve each of the workflow's {groups} groups exactly once (WorkerSpec.groups)")


def _check_turns(workflow: Workflow, plan: Plan, component: str) -> None:
    """A component replicated by turns: declared ``stateless``, its replicas' turns ``(r, k)`` one
    ``k`` and each residue ``r`` exactly once, so every iteration's ops run on exactly one replica."""
    if not workflow.component(component).stateless:
        raise LegalityError(f"plan {plan.name!r} runs component {component!r} on replicas taking turns, but it is "
                            "not stateless (its ops' results may depend on its earlier ops); place it once")
    turns = [w.turn for w in plan.hosts(component)]
    k = len(turns)
    if any(t is None or t[1] != k for t in turns) or sorted(t[0] for t in turns if t) != list(range(k)):
        raise LegalityError(f"plan {plan.name!r}: the replicas of {component!r} take turns {turns}; each of "
                            f"the {k} must take one residue of iterations mod {k} (WorkerSpec.turn)")
