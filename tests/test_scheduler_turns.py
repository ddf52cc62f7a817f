"""Stateless side work on replicas taking turns (``WorkerSpec.turn``, ``Plan.lag``, Rose's ``replicate_side``).

A validator slower than the learner's chain paces every plan that runs it once per iteration. Two
replicas taking turns (iteration i on replica i mod 2), each turn allowed to finish one iteration
later, run two validations side by side: the same validations of the same weights, so every result
stays bit-identical, and the chain never runs more than the lag ahead.
"""

from __future__ import annotations

import time
from typing import Any

import pytest

from components.config import SchedulerConfig
from components.scheduler.executor import execute
from components.scheduler.graph import LegalityError, build_graph
from components.scheduler.placement import check_schedule
from components.scheduler.plan import Plan, WorkerSpec, plan_from_dict, plan_to_dict, sequential_plan
from components.scheduler.rose import candidate_transformations, replicate_side
from components.scheduler.simulate import simulate
from components.scheduler.synthetic import SyntheticSpec, _mlp, params_of, synthetic_workflow
from components.scheduler.workflow import Component, OpSpec, StateSpec, Workflow

SPEC = SyntheticSpec(envs=16, steps=4, hidden=16, eval_steps=2, retrieval_sleep_s=0.0)
CHECK_SLEEP_S = 0.15  # the side op: far slower than the chain's op (microseconds)


# ------------------------------------------------------------------ a chain and a slow stateless check
def _counter(ctx: Any) -> dict[str, int]:
    return {"steps": 0}


def _nothing(ctx: Any) -> None:
    return None


def op_step(state: dict[str, int], idx: dict[str, int], inp: dict[str, Any]) -> dict[str, Any]:
    state["steps"] += 1
    return {"x": inp["x"] * 3 + idx["iteration"]}


def op_check(_: None, idx: dict[str, int], inp: dict[str, Any]) -> dict[str, Any]:
    time.sleep(CHECK_SLEEP_S)
    return {"seen": (idx["iteration"], inp["x"])}


def _workflow(stateless: bool = True) -> Workflow:
    return Workflow("turns", (Component("chain", _counter), Component("checker", _nothing, stateless=stateless)),
                    (StateSpec("x"), StateSpec("seen")), {}, (
                        OpSpec("step", "chain", op_step, reads=("x@iteration",), writes=("x@iteration+1",)),
                        OpSpec("check", "checker", op_check, reads=("x@iteration",), writes=("seen@iteration",),
                               side=True)))


def _turns(kind: str = "thread") -> Plan:
    base = Plan("one-side", (WorkerSpec("main", ("chain",)), WorkerSpec("side", ("checker",), kind=kind)))
    plan = replicate_side(_workflow(), base, 2)
    assert plan is not None
    return plan if kind == "process" else plan.with_(
        workers=tuple(w if w.turn is None else WorkerSpec(w.name, w.components, turn=w.turn) for w in plan.workers))


def _execute(plan: Plan, iterations: range = range(6)):
    return execute(_workflow(), plan, SchedulerConfig(), None, iterations, inputs={"x": 1}, record=("seen", "x"))


def test_turns_validate_the_same_weights_as_one_validator_and_hold_the_chain_within_their_lag():
    ref = _execute(sequential_plan(_workflow()))
    got = _execute(_turns())
    assert got.records == ref.records and got.final == ref.final
    assert [got.records[k] for k in sorted(got.records, key=str) if k.state == "seen"][0] == (0, 1)
    spans = {(s.op, s.iteration): s for s in got.timeline.spans}
    assert {spans[("check", i)].worker for i in range(0, 6, 2)} == {"side0"}
    assert {spans[("check", i)].worker for i in range(1, 6, 2)} == {"side1"}
    for i in range(4):
        # lag 1: iteration i + 2 starts only once check[i] is done (the barrier of i + 1 waits for it) ...
        assert spans[("step", i + 2)].start >= spans[("check", i)].end
    # ... and the two turns overlap: check[i + 1] starts before check[i] ends (the chain takes microseconds)
    assert spans[("check", 1)].start < spans[("check", 0)].end


def test_one_validator_without_turns_holds_each_iteration():
    plan = Plan("one-side", (WorkerSpec("main", ("chain",)), WorkerSpec("side", ("checker",))))
    spans = {(s.op, s.iteration): s for s in _execute(plan, range(3)).timeline.spans}
    assert spans[("step", 1)].start >= spans[("check", 0)].end


def test_turns_in_processes_match_the_sequential_synthetic_iteration():
    """The synthetic iteration's evaluator and retriever on two processes taking turns: same records."""
    wf = synthetic_workflow(SPEC, groups=2)
    params = params_of(_mlp(SPEC))
    iterations = range(4)
    ref = execute(wf, sequential_plan(wf, threads=1), SchedulerConfig(), SPEC, iterations, inputs={"params": params},
                  record=("digest", "evalm"))
    plan = replicate_side(wf, sequential_plan(wf, threads=1), 2)
    assert plan is not None and plan.lag == {"eval": 1, "retrieve": 1}
    got = execute(wf, plan, SchedulerConfig(), SPEC, iterations, inputs={"params": params}, record=("digest", "evalm"))
    assert got.records == ref.records
    assert {s.worker for s in got.timeline.spans if s.op == "eval" and s.iteration % 2} == {"side1"}


def test_turns_are_refused_for_state_that_carries_over_or_turns_that_do_not_partition():
    wf = _workflow(stateless=False)
    base = Plan("one-side", (WorkerSpec("main", ("chain",)), WorkerSpec("side", ("checker",))))
    assert replicate_side(wf, base, 2) is None
    forced = Plan("forced", (WorkerSpec("main", ("chain",)), WorkerSpec("a", ("checker",), turn=(0, 2)),
                             WorkerSpec("b", ("checker",), turn=(1, 2))), lag={"check": 1})
    graph = build_graph(wf, range(3))
    with pytest.raises(LegalityError, match="'checker' .* not stateless"):
        check_schedule(graph, forced)
    gap = forced.with_(workers=(forced.workers[0], WorkerSpec("a", ("checker",), turn=(0, 2)),
                                WorkerSpec("b", ("checker",), turn=(0, 2))))
    with pytest.raises(LegalityError, match="take turns"):
        check_schedule(build_graph(_workflow(), range(3)), gap)
    with pytest.raises(LegalityError, match="only side ops may trail"):
        check_schedule(build_graph(_workflow(), range(3)), _turns().with_(lag={"step": 1}))


def test_rose_offers_turns_only_for_stateless_side_work_and_a_plan_round_trips():
    names = {t.name for t in candidate_transformations(_workflow(), sequential_plan(_workflow()), replicas=2)}
    assert "replicate_side" in names
    assert "replicate_side" not in {t.name for t in candidate_transformations(
        _workflow(stateless=False), sequential_plan(_workflow(stateless=False)), replicas=2)}
    assert replicate_side(_workflow(), _turns(), 2) is None  # already replicated
    plan = _turns("process")
    assert plan_from_dict(plan_to_dict(plan)) == plan
    assert "for iterations = 1 mod 2" in plan.describe() and "check by 1" in plan.describe()


def test_the_replay_predicts_turns_faster_only_when_the_side_work_paces_the_chain():
    """On 2 cores, chain 1.0 s + check 1.8 s an iteration: one checker paces it at 1.8 s; turns share
    the 2.8 s of work over both cores (1.4 s). A check faster than the chain gains nothing."""
    def predicted(plan: Plan, check_s: float) -> float:
        graph = build_graph(_workflow(), range(3 + 2 * max(plan.lag.values(), default=0)))
        return simulate(graph, plan, lambda inst, q: 1.0 if inst.name == "step" else check_s,
                        lambda inst, q: 1.0, capacity=2.0).iteration

    one = Plan("one-side", (WorkerSpec("main", ("chain",)), WorkerSpec("side", ("checker",), kind="process")))
    turns = _turns("process")
    assert predicted(one, 1.8) == pytest.approx(1.8)
    assert predicted(turns, 1.8) == pytest.approx(1.4, rel=0.05)
    assert predicted(turns, 0.5) == pytest.approx(predicted(one, 0.5)) == pytest.approx(1.0)
