"""PPO and FERT iterations through the scheduler: every plan gives bit-identical weights."""

from __future__ import annotations

import pytest
import torch

from components.config import FertConfig, PolicyConfig, SchedulerConfig, SimConfig, StoreConfig
from components.scheduler.devices import max_concurrent_owners
from components.scheduler.plan import Plan, WorkerSpec
from components.scheduler.rose import candidate_transformations, legality, replicate_rollout
from components.training.workloads.fert_iteration import FertIterSpec, build_fert_data, run_fert_iterations
from components.training.workloads.ppo import PPOSpec, ppo_runtime, ppo_workflow, run_ppo

POLICY = PolicyConfig(hidden=32, layers=2)
SIM = SimConfig(max_steps=12)
CFG = SchedulerConfig(pipeline_stages=(1, 2), validate_iterations=1, validate_rounds=1, quota_max_steps=1,
                      profile_iterations=2)


def _spec() -> PPOSpec:
    return PPOSpec(sim=SIM, policy=POLICY, robot_ids=tuple(f"robot-{i:04d}" for i in range(8)),
                   eval_robot_ids=tuple(f"heldout-{i:04d}" for i in range(4)), steps=6, eval_steps=4,
                   minibatches=2, learner_threads=1, infer_chunk=2, seed=3)


def _same(a, b) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.fixture(scope="module")
def ppo_reference():
    return run_ppo(_spec(), CFG, iterations=3, plan="sequential")


def test_ppo_plans_are_bit_identical(ppo_reference):
    spec = _spec()
    rt = ppo_runtime(spec, CFG)
    pipelined = Plan("pipelined-m4", (WorkerSpec("env", ("sim",)), WorkerSpec("rollout", ("policy",)),
                                      WorkerSpec("actor", ("learner",)), WorkerSpec("side", ("evaluator",))),
                     groups=4, threads={"sim": 1, "policy": 1, "learner": 2, "evaluator": 1}, blas_threads=1,
                     placement={"policy": ("cpu1",), "learner": ("cpu0", "cpu1")}, hoist=frozenset({"reset", "draw"}))
    for plan in (rt.coarse(), rt.sequential(tuned=False), pipelined):
        got = run_ppo(spec, CFG, iterations=3, plan=plan)
        assert _same(got.weights, ppo_reference.weights), plan.name
        assert [m.weights_digest for m in got.metrics] == [m.weights_digest for m in ppo_reference.metrics]
        assert [m.eval_successes for m in got.metrics] == [m.eval_successes for m in ppo_reference.metrics]
    assert ppo_reference.metrics[0].env_steps_per_s > 0
    assert set(ppo_reference.policy_weights) == {k[len("actor."):] for k in ppo_reference.weights if k.startswith("actor.")}


@pytest.mark.parametrize("groups", [2, 4])
def test_replicated_rollout_is_bit_identical(ppo_reference, groups):
    """Env groups and their policy copies on two processes (data-parallel rollout), the evaluator on
    a third: same trajectories and weights as the sequential schedule, one lock owner per device."""
    spec = _spec()
    rt = ppo_runtime(spec, CFG)
    base = rt.sequential(groups=groups).with_(placement={"policy": ("cpu0", "cpu1"), "learner": ("cpu0", "cpu1")})
    base = base.with_(workers=(WorkerSpec("main", ("sim", "policy", "learner")),
                               WorkerSpec("side", ("evaluator",), kind="process")))
    assert "replicate_rollout" in [t.name for t in candidate_transformations(rt.workflow_at(groups), base, 2)]
    plan = replicate_rollout(rt.workflow_at(groups), base, 2)
    assert plan is not None and plan.groups == groups
    got = run_ppo(spec, CFG, iterations=3, plan=plan)
    assert _same(got.weights, ppo_reference.weights)
    assert [m.weights_digest for m in got.metrics] == [m.weights_digest for m in ppo_reference.metrics]
    assert [m.eval_successes for m in got.metrics] == [m.eval_successes for m in ppo_reference.metrics]
    assert {s.worker for s in got.timeline.spans if s.op == "infer"} == {"rollout0", "rollout1"}
    ops_on = {w: sum(s.worker == w for s in got.timeline.spans) for w in ("rollout0", "rollout1")}
    for w, n in ops_on.items():  # a rollout's ready ops go in a few requests, not one per op
        assert 0 < got.run.process_requests[w] < n / 4, (w, got.run.process_requests[w], n)
    assert all(n == 1 for n in max_concurrent_owners(got.run.lock_events).values())


def test_replicas_must_serve_every_env_group_once():
    wf = ppo_workflow(_spec(), 4)
    rest = WorkerSpec("main", ("learner", "evaluator"))
    overlap = Plan("overlap", (WorkerSpec("r0", ("sim", "policy"), groups=(0, 1)),
                               WorkerSpec("r1", ("sim", "policy"), groups=(1, 2)), rest), groups=4)
    assert "exactly once" in legality(wf, overlap, range(2))
    learner_twice = Plan("learner-twice", (WorkerSpec("r0", ("sim", "policy", "learner"), groups=(0, 1)),
                                           WorkerSpec("r1", ("sim", "policy", "learner"), groups=(2, 3)),
                                           WorkerSpec("side", ("evaluator",))), groups=4)
    assert "'learner'" in legality(wf, learner_twice, range(2)) and "not replicable" in legality(wf, learner_twice, range(2))


def test_ppo_planner_and_rose_plans_are_bit_identical(ppo_reference):
    for kind in ("planner", "rose"):
        got = run_ppo(_spec(), CFG, iterations=3, plan=kind)
        assert _same(got.weights, ppo_reference.weights), kind
        assert got.plan_text.startswith("plan ")


def test_ppo_learns_something(ppo_reference):
    assert all(m.loss == m.loss for m in ppo_reference.metrics)  # finite
    first = ppo_reference.metrics[0].weights_digest
    assert len({m.weights_digest for m in ppo_reference.metrics}) == 3 and first


@pytest.fixture(scope="module")
def fert_data(tmp_path_factory):
    root = tmp_path_factory.mktemp("fert-store")
    return build_fert_data(root, SIM.model_copy(update={"max_steps": 40}), StoreConfig(window=4, stride=2),
                           FertConfig(top_k=4), POLICY, [f"robot-{i:04d}" for i in range(4)], 1, batch_size=64)


def test_fert_iteration_overlaps_without_changing_results(fert_data):
    spec = FertIterSpec(sim=SIM.model_copy(update={"max_steps": 40}), policy=POLICY,
                        eval_robot_ids=tuple(f"heldout-{i:04d}" for i in range(4)), hooks=fert_data.hooks,
                        window=4, eval_steps=10, learn_steps=2, learner_threads=1)
    ref = run_fert_iterations(spec, fert_data, CFG, 3, plan="sequential")
    overlapped = Plan("overlap", (WorkerSpec("io", ("retriever", "assembler")), WorkerSpec("main", ("learner",)),
                                  WorkerSpec("side", ("evaluator",))), threads={"learner": 1, "evaluator": 1},
                      blas_threads=1, hoist=frozenset({"retrieve", "assemble"}))
    got = run_fert_iterations(spec, fert_data, CFG, 3, plan=overlapped)
    assert _same(got.weights, ref.weights)
    assert got.success_rates == ref.success_rates and got.losses == ref.losses
    # retrieval of iteration i+1 is hoisted: it waits for eval@i (its query), not for learn@i
    spans = got.timeline.spans
    retrieve1 = next(s for s in spans if s.op == "retrieve" and s.iteration == 1)
    eval0 = next(s for s in spans if s.op == "eval" and s.iteration == 0)
    assert retrieve1.start >= eval0.end
    assert retrieve1.worker == "io" and eval0.worker == "side"
