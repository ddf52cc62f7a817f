"""Scheduler core: workflow → graph → executor, same results under every plan, legality, locks."""

from __future__ import annotations

import threading

import pytest

from components.config import SchedulerConfig
from components.scheduler.channels import Channel
from components.scheduler.devices import MemoryBudgetError, max_concurrent_owners
from components.scheduler.executor import check_schedule, execute, plan_workflow
from components.scheduler.graph import LegalityError, build_graph, verify_order
from components.scheduler.plan import Plan, WorkerSpec, sequential_plan
from components.scheduler.synthetic import SyntheticSpec, _mlp, params_of, synthetic_workflow
from components.scheduler.workflow import Component, OpSpec, StateSpec, Workflow, WorkflowError

SPEC = SyntheticSpec(envs=16, steps=4, hidden=16, eval_steps=2, retrieval_sleep_s=0.0)
ITERS = range(3)


def _run(plan: Plan, cfg: SchedulerConfig | None = None, groups: int = 2):
    wf = synthetic_workflow(SPEC, groups=groups)
    return execute(wf, plan, cfg or SchedulerConfig(), SPEC, ITERS, inputs={"params": params_of(_mlp(SPEC))},
                   record=("digest", "evalm", "act", "obs"))


def _pipelined(groups: int, kind: str = "thread", hoist: frozenset[str] = frozenset(),
               buffers: dict[str, int] | None = None) -> Plan:
    return Plan(
        "pipelined",
        workers=(WorkerSpec("sim", ("sim",)), WorkerSpec("pol", ("policy",), kind=kind),
                 WorkerSpec("learn", ("learner",)), WorkerSpec("side", ("evaluator", "retriever"))),
        groups=groups, default_threads=1, placement={"policy": ("cpu1",), "learner": ("cpu0", "cpu1")},
        hoist=hoist, buffers=buffers or {},
    )


def _comparable(result):
    """Records keyed by state+version, merged over partitions (group count changes parts)."""
    out = {}
    for key, value in result.records.items():
        if key.state in ("act", "obs"):
            continue
        out[str(key)] = value
    out["params"] = {k: v.numpy().tobytes() for k, v in result.final["params"].items()}
    return out


@pytest.fixture(scope="module")
def reference():
    return _run(sequential_plan(synthetic_workflow(SPEC), threads=1))


@pytest.mark.parametrize("groups", [1, 2, 4])
def test_every_plan_matches_sequential_bit_for_bit(reference, groups):
    hoist = frozenset({"retrieve", "reset", "sync"})
    result = _run(_pipelined(groups, hoist=hoist), groups=groups)
    assert _comparable(result) == _comparable(reference)
    assert result.graph_size > 0 and len(result.iteration_s) == len(ITERS)


def test_process_worker_matches_sequential(reference):
    params = params_of(_mlp(SPEC))
    wf = synthetic_workflow(SPEC, groups=2)
    result = execute(wf, _pipelined(2, kind="process"), SchedulerConfig(), SPEC, ITERS, inputs={"params": params},
                     record=("digest", "evalm", "act", "obs"))
    assert _comparable(result) == _comparable(reference)
    # sent by value: a tensor other workers may be reading is never moved into shared memory under them
    assert not any(t.is_shared() for t in params.values())


def test_sequential_thread_counts_do_not_change_results(reference):
    result = _run(sequential_plan(synthetic_workflow(SPEC), threads=2, blas_threads=1))
    assert _comparable(result) == _comparable(reference)


def test_illegal_hoist_is_refused_before_running():
    # inference of iteration i+1 needs the weights synced at i+1, which still waits for the barrier
    plan = _pipelined(2, hoist=frozenset({"infer"}))
    graph = build_graph(plan_workflow(synthetic_workflow(SPEC), plan), ITERS)
    with pytest.raises(LegalityError, match="contradict"):
        check_schedule(graph, plan)
    with pytest.raises(LegalityError):
        _run(plan)


def test_double_buffering_needs_a_declared_bufferable_state():
    wf = synthetic_workflow(SPEC)
    with pytest.raises(WorkflowError, match="double_bufferable"):
        build_graph(wf, ITERS, {"pol": 2})
    g2 = build_graph(wf, ITERS, {"env": 2})
    assert g2.buffers["env"] == 2


def test_verify_order_catches_a_read_of_an_overwritten_buffer():
    graph = build_graph(synthetic_workflow(SPEC, groups=1), range(2))
    order = list(range(len(graph)))
    verify_order(graph, order)  # sequential order is legal
    # move the next iteration's reset before the last env step of this iteration
    reset1 = next(i.uid for i in graph.instances if i.name == "reset" and i.iteration == 1)
    last_step0 = max(i.uid for i in graph.instances if i.name == "env_step" and i.iteration == 0)
    bad = [u for u in order if u != reset1]
    bad.insert(bad.index(last_step0), reset1)
    with pytest.raises(LegalityError, match="buffer already holds"):
        verify_order(graph, bad)
    # with two env buffers the same move is legal
    graph2 = build_graph(synthetic_workflow(SPEC, groups=1), range(2), {"env": 2})
    verify_order(graph2, bad)


def test_parallel_completion_order_replays_legally():
    result = _run(_pipelined(2, hoist=frozenset({"retrieve", "reset", "sync"})))
    wf = plan_workflow(synthetic_workflow(SPEC), result.plan)
    verify_order(build_graph(wf, ITERS), result.completion_order)


def test_at_most_one_lock_owner_per_device_and_budget_respected():
    cfg = SchedulerConfig(memory_budget_mb=35.0)
    plan = _pipelined(2).with_(placement={"policy": ("cpu0",), "learner": ("cpu0",)})
    result = _run(plan, cfg)
    assert result.lock_events, "exclusive components must take the device lock"
    assert all(n == 1 for n in max_concurrent_owners(result.lock_events).values())
    assert result.switch.offloads > 0  # policy (10) + learner (30) > 35: they must swap
    assert all(peak <= 35.0 for peak in result.switch.peak_memory_mb.values())


def test_component_larger_than_budget_fails_clearly():
    with pytest.raises(MemoryBudgetError, match="memory_budget_mb"):
        _run(_pipelined(2), SchedulerConfig(memory_budget_mb=20.0))


def test_channel_backpressure_bounds_the_inbox():
    ch = Channel("t", capacity=2, timeout_s=10)
    got: list[int] = []

    def consumer() -> None:
        for k in range(20):
            got.append(ch.get(k))

    t = threading.Thread(target=consumer)
    t.start()
    for k in range(20):
        ch.put(k, k * k)
    t.join()
    assert got == [k * k for k in range(20)]
    assert ch.stats().max_depth <= 2


def test_workflow_declaration_errors_name_the_fix():
    comp = (Component("c", lambda ctx: None),)
    fn = lambda s, i, x: {}  # noqa: E731
    with pytest.raises(WorkflowError, match="undeclared state"):
        Workflow("w", comp, (), {}, (OpSpec("a", "c", fn, writes=("x@iteration",)),))
    with pytest.raises(WorkflowError, match="written twice"):
        wf = Workflow("w", comp, (StateSpec("x"),), {},
                      (OpSpec("a", "c", fn, writes=("x@iteration",)), OpSpec("b", "c", fn, writes=("x@iteration",))))
        build_graph(wf, range(1))
    with pytest.raises(WorkflowError, match="not declared"):
        Workflow("w", comp, (StateSpec("x"),), {}, (OpSpec("a", "nope", fn, writes=("x@iteration",)),))
