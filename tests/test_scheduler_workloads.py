"""PPO and the one trainer's workflow through the scheduler: every plan gives bit-identical weights."""

from __future__ import annotations

import pytest
import torch

from components.config import PolicyConfig, SchedulerConfig, SimConfig
from components.scheduler.devices import max_concurrent_owners
from components.scheduler.plan import Plan, WorkerSpec
from components.scheduler.rose import candidate_transformations, legality, replicate_rollout
from components.training.workloads.ppo import PPOSpec, ppo_runtime, ppo_workflow, run_ppo

POLICY = PolicyConfig(hidden=32, layers=2)
SIM = SimConfig(max_steps=12)
# the smallest planning that still profiles, probes IPC and validates every decision: these tests are
# about results (bit-identity), not about which plan wins on this host
CFG = SchedulerConfig(pipeline_stages=(1, 2), validate_iterations=1, validate_rounds=1, quota_max_steps=1,
                      profile_iterations=2, capacity_retry_wait_s=0.0, ipc_probe_iterations=1,
                      capacity_qualify_fraction=0.01)


def _spec(robots: int = 16) -> PPOSpec:
    """16 robots: 4 env groups of 4. Groups of 2 diverge from one group (test below)."""
    return PPOSpec(sim=SIM, policy=POLICY, robot_ids=tuple(f"robot-{i:04d}" for i in range(robots)),
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
    collocated = rt.coarse_processes(groups=1, colocate_rollout=True)  # RLinf collocated mode: env + inference in one process
    assert [w.components for w in collocated.workers][0] == ("sim", "policy")
    for plan in (rt.coarse(), rt.coarse_processes(), collocated, rt.sequential(tuned=False), pipelined):
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


def test_env_groups_of_two_robots_match_one_group():
    """Was a strict xfail (groups of 2 gave other weights, numpy 2.4.6); it passes again on main as
    of 492ba86 (which change fixed it was not bisected), so the train task offers groups of 2 again
    (pipeline.scheduled.MIN_GROUP_ENVS) and this test guards them."""
    spec = _spec(robots=8)
    rt = ppo_runtime(spec, CFG)
    one = run_ppo(spec, CFG, iterations=2, plan=rt.sequential())
    four = run_ppo(spec, CFG, iterations=2, plan=rt.sequential(groups=4))
    assert _same(four.weights, one.weights)


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


def test_ppo_rose_plan_is_bit_identical(ppo_reference):
    """Rose's plan is the planner's plan plus its measured rewrites: one run covers both (the
    planner alone: tests/test_train_workloads.py runs PPO on plan=planner through the train flow)."""
    got = run_ppo(_spec(), CFG, iterations=3, plan="rose")
    assert _same(got.weights, ppo_reference.weights)
    assert got.plan_text.startswith("plan ")


def test_ppo_learns_something(ppo_reference):
    assert all(m.loss == m.loss for m in ppo_reference.metrics)  # finite
    first = ppo_reference.metrics[0].weights_digest
    assert len({m.weights_digest for m in ppo_reference.metrics}) == 3 and first


# an action-chunk policy (ACT-style): windows in, the next 4 actions out, targets masked at episode ends
CHUNK_POLICY = PolicyConfig(kind="chunk_transformer", d_model=16, heads=2, hidden=16, layers=1, history=2, chunk_size=4)


def _train_spec(policy: PolicyConfig = POLICY):
    import numpy as np

    from components.policy.history import frame_positions
    from components.training.imitation import TrainingSet
    from components.training.workflow import TrainSpec, ValidationSpec

    rng = np.random.default_rng(0)
    states = rng.normal(size=(500, 11)).astype(np.float32)
    positions = frame_positions([120, 80, 200, 100]) if policy.actions() > 1 else None
    data = TrainingSet(states, np.tanh(states[:, :3]).astype(np.float32), rng.uniform(0.5, 2.0, size=500), positions)
    return TrainSpec(data=data, policy=policy, lr=1e-3, weight_decay=1e-4, batch_size=32, seed=5, total_steps=9,
                     steps_per_iteration=2, validation=ValidationSpec(SIM, ("validation-0000",), 1, 5))


@pytest.mark.parametrize("policy", [POLICY, CHUNK_POLICY, POLICY.model_copy(update={"head": "gmm"}),
                                    POLICY.model_copy(update={"head": "binary_jaw"})],
                         ids=["mlp", "chunk_transformer", "mlp_gmm", "mlp_binary_jaw"])
def test_training_workflow_overlaps_without_changing_results(policy):
    """The one trainer's workflow: sampling hoisted on its own thread and validation in its own
    process give the sequential plan's weights, losses and validation, bit for bit."""
    from components.training.trainer import PlanChoice, Trainer

    trainer = Trainer(_train_spec(policy), CFG)
    ref = trainer.run(trainer.choose("sequential"))
    assert len(ref.losses) == 9 and len(ref.iteration_s) == len(ref.validation) == 5  # 4 x 2 steps + 1
    overlapped = Plan("overlap", (WorkerSpec("io", ("sampler",)), WorkerSpec("main", ("learner",)),
                                  WorkerSpec("side", ("validator",), kind="process")),
                      threads={"learner": 1, "validator": 1, "sampler": 1}, blas_threads=1, hoist=frozenset({"sample"}))
    got = trainer.run(PlanChoice(overlapped, "overlap", "fixed"))
    assert _same(got.policy.state_dict(), ref.policy.state_dict())
    assert got.losses == ref.losses and got.validation == ref.validation
    spans = got.timeline.spans
    assert {s.worker for s in spans if s.op == "validate"} == {"side"}
    sample1 = next(s for s in spans if s.op == "sample" and s.iteration == 1)
    learn0 = next(s for s in spans if s.op == "learn" and s.iteration == 0)
    assert sample1.worker == "io" and learn0.worker == "main"
    coarse = trainer.runtime.coarse_processes()
    assert {w.kind for w in coarse.workers} == {"process"} and len(coarse.workers) == 3
    got = trainer.run(PlanChoice(coarse, "coarse-processes", "fixed"))
    assert _same(got.policy.state_dict(), ref.policy.state_dict()) and got.losses == ref.losses


def test_validation_on_replicas_taking_turns_matches_the_sequential_plan():
    """The validator is stateless (it loads the weights it reads): two process replicas taking turns
    by iteration, each turn trailing the barrier by one, validate what the sequential plan does."""
    from components.scheduler.rose import replicate_side
    from components.training.trainer import PlanChoice, Trainer

    trainer = Trainer(_train_spec(), CFG)
    ref = trainer.run(trainer.choose("sequential"))
    plan = replicate_side(trainer.runtime.workflow_at(1), trainer.runtime.coarse_processes(), 2)
    assert plan is not None and plan.lag == {"validate": 1}
    got = trainer.run(PlanChoice(plan, "turns", "fixed"))
    assert _same(got.policy.state_dict(), ref.policy.state_dict())
    assert got.losses == ref.losses and got.validation == ref.validation
    assert {s.worker for s in got.timeline.spans if s.op == "validate"} == {"side0", "side1"}


def test_a_cosine_rate_is_set_by_the_step_so_every_plan_trains_the_same_weights():
    """train.lr_schedule: cosine sets each step's rate from the global step alone: the coarse
    processes plan (learner rebuilt in its own process) matches the sequential one bit for bit, the
    weights differ from a constant rate's, and the rate runs from lr down toward 0."""
    from dataclasses import replace

    from components.training.bc import scheduled_lr
    from components.training.trainer import PlanChoice, Trainer

    spec = replace(_train_spec(), lr_schedule="cosine")
    trainer = Trainer(spec, CFG)
    ref = trainer.run(trainer.choose("sequential"))
    coarse = trainer.run(PlanChoice(trainer.runtime.coarse_processes(), "coarse-processes", "fixed"))
    assert _same(coarse.policy.state_dict(), ref.policy.state_dict()) and coarse.losses == ref.losses
    constant = Trainer(_train_spec(), CFG).run(Trainer(_train_spec(), CFG).choose("sequential"))
    assert ref.losses[0] == constant.losses[0] and ref.losses[-1] != constant.losses[-1]
    rates = [scheduled_lr(1e-3, "cosine", step, spec.total_steps) for step in range(spec.total_steps + 1)]
    assert rates[0] == 1e-3 and rates[-1] == 0.0 and all(a > b for a, b in zip(rates, rates[1:]))
    assert scheduled_lr(1e-3, "constant", 7, 9) == 1e-3
    with pytest.raises(ValueError, match="train.lr_schedule='linear'"):
        scheduled_lr(1e-3, "linear", 0, 9)


def test_state_noise_is_seeded_by_the_iteration_and_the_same_on_every_rank_and_plan():
    """train.state_noise: a frame's jitter depends on (seed, iteration, its row of the global batch)
    only: two ranks' halves are the whole batch's; a number of zero std is left as it is; the
    coarse processes plan trains the sequential plan's weights bit for bit, not the clean ones."""
    from dataclasses import replace

    from components.training.augment import jitter_states
    from components.training.trainer import PlanChoice, Trainer

    states = torch.randn(3, 8, 2, 5)
    scale = torch.tensor([1.0, 0.5, 0.0, 2.0, 1.0])
    whole = jitter_states(states, scale, 5, 4, 8, slice(0, 8))
    halves = [jitter_states(states[:, r * 4:(r + 1) * 4], scale, 5, 4, 8, slice(r * 4, (r + 1) * 4)) for r in (0, 1)]
    assert torch.equal(torch.cat(halves, dim=1), whole)
    assert torch.equal(whole[..., 2], states[..., 2]) and not torch.equal(whole, states)
    assert not torch.equal(jitter_states(states, scale, 5, 5, 8, slice(0, 8)), whole)  # the next iteration

    trainer = Trainer(replace(_train_spec(), state_noise=0.1), CFG)
    ref = trainer.run(trainer.choose("sequential"))
    coarse = trainer.run(PlanChoice(trainer.runtime.coarse_processes(), "coarse-processes", "fixed"))
    assert _same(coarse.policy.state_dict(), ref.policy.state_dict()) and coarse.losses == ref.losses
    clean = Trainer(_train_spec(), CFG).run(Trainer(_train_spec(), CFG).choose("sequential"))
    assert ref.losses[0] != clean.losses[0]


def test_process_coarse_splits_cover_layouts_and_thread_counts():
    """The process baseline's split search: every env-group count and the collocated rollout, at 1
    thread per op and at every core; all processes, named apart."""
    rt = ppo_runtime(_spec(), CFG)
    splits = rt.coarse_process_splits()
    names = [p.name for p in splits]
    assert len(set(names)) == len(names) == (len(CFG.pipeline_stages) + 1) * len({1, rt.devices})
    assert all(w.kind == "process" for p in splits for w in p.workers)
    assert {p.groups for p in splits} == set(CFG.pipeline_stages)
    assert any(("sim", "policy") in [w.components for w in p.workers] for p in splits)


def test_rose_rollout_process_rewrite_is_bit_identical_and_its_pipe_is_measured(ppo_reference):
    """Rose's rollout_process (env + inference in one process, as the best process split places
    them) composed with side_process: same weights as sequential; every pipe crossing recorded."""
    from components.scheduler.rose import rollout_in_process

    spec = _spec()
    rt = ppo_runtime(spec, CFG)
    assert rt.roles.rollout == ("sim", "policy")
    wf = rt.workflow_at(2)
    base = rt.sequential(groups=2)
    names = [t.name for t in candidate_transformations(wf, base, 2, rollout=rt.roles.rollout)]
    assert "rollout_process" in names
    assert "rollout_process" not in [t.name for t in candidate_transformations(wf, base, 2)]  # no group, no rewrite
    moved = rollout_in_process(wf, base, rt.roles.rollout)
    assert moved is not None and not legality(wf, moved, range(3))
    assert [(w.components, w.kind) for w in moved.workers] == [(("learner", "evaluator"), "thread"),
                                                              (("sim", "policy"), "process")]
    assert rollout_in_process(wf, moved, rt.roles.rollout) is None  # already there: not offered again
    both = next(t for t in candidate_transformations(wf, moved, 2, rt.roles.rollout) if t.name == "side_process").apply(moved)
    # with the profiled env-group counts, Rose may also move the rollout at another count (m = 1 here)
    regroup = {t.name: t for t in candidate_transformations(wf, base, 2, rt.roles.rollout, CFG.pipeline_stages)}
    assert "rollout_process(m=1)" in regroup and "rollout_process(m=2)" not in regroup  # m = 2 is the plan's own
    at_one = regroup["rollout_process(m=1)"].apply(base)
    assert at_one.groups == 1 and not legality(wf, at_one, range(3))
    assert [(w.components, w.kind) for w in at_one.workers] == [(("learner", "evaluator"), "thread"),
                                                               (("sim", "policy"), "process")]
    later = [t.name for t in candidate_transformations(wf, at_one, 2, rt.roles.rollout, CFG.pipeline_stages)]
    assert "rollout_process(m=2)" in later and "rollout_process" not in later and "rollout_process(m=1)" not in later
    at_one_side = next(t for t in candidate_transformations(wf, at_one, 2, rt.roles.rollout, CFG.pipeline_stages)
                       if t.name == "side_process").apply(at_one)
    for plan in (moved, both, at_one_side):
        got = run_ppo(spec, CFG, iterations=3, plan=plan)
        assert _same(got.weights, ppo_reference.weights), plan.name
        assert [m.eval_successes for m in got.metrics] == [m.eval_successes for m in ppo_reference.metrics]
    directions = {(t.worker, t.direction) for t in got.run.transfers}
    assert {("rollout", "in"), ("rollout", "out"), ("side", "in"), ("side", "out")} <= directions
    assert all(t.bytes > 0 and t.seconds >= 0 for t in got.run.transfers)


def test_unqualified_capacity_is_noted_in_the_plan_and_priced_ipc_is_in_the_profile():
    """A host that never shows the cores (fake probe: 1 of 2): the planner still plans, on the best
    reading, and its plan says it was decided unqualified; the IPC probe priced the pipe."""
    spec = _spec()
    readings: list[int] = []

    def probe(devices: int) -> float:
        readings.append(devices)
        return 1.0

    cfg = CFG.model_copy(update={"devices": 2, "capacity_probe_attempts": 3, "capacity_qualify_fraction": 0.9})
    rt = ppo_runtime(spec, cfg)
    rt.capacity_probe = probe
    plan = rt.plan().best.plan
    prof = rt.profile()
    assert readings == [2, 2, 2] and prof.capacity == 1.0 and not prof.capacity_reading.qualified
    assert any("UNQUALIFIED" in n for n in plan.notes)
    # priced from measured crossings: a fixed cost, a per-byte cost or both (on a busy host the fit
    # may put it all in one term: CI once fitted latency 0 and 0.53 us per byte)
    ipc = prof.ipc
    assert ipc is not None and ipc.latency_s + ipc.s_per_byte > 0 and ipc.out_bytes_per_row.get("infer", 0) > 0
    rt.capacity_probe = lambda devices: 2.0
    rt.profile(refresh=True)
    assert rt.profile().capacity_reading.qualified
    assert any("qualified capacity reading" in n for n in rt.plan().best.plan.notes)


def test_train_task_ppo_layouts_use_only_the_env_groups_it_offers(tmp_path):
    """Regression (#19): the train task's PPO on 2 fleet robots offers only m = 1 (groups of at least
    MIN_GROUP_ENVS rows) with infer_chunk = 2, yet profiling ran the IPC probe's process split at m = 2:
    1-row groups, refused by the chunk rule. Every layout the runtime builds on its own (the probes'
    and the coarse baselines') now takes an offered stage count, and runs."""
    from components.pipeline.scheduled import ppo_spec
    from tests.conftest import small_settings

    settings = small_settings(tmp_path, sim=SimConfig(max_steps=4), policy=PolicyConfig(hidden=8, layers=1),
                              scheduler=CFG.model_copy(update={"ppo_steps": 2, "ppo_epochs": 1, "ppo_minibatches": 1,
                                                               "ppo_eval_steps": 1}))
    spec, cfg = ppo_spec(settings)
    assert cfg.pipeline_stages == (1,) and spec.infer_chunk == spec.envs == 2  # m = 2 would give 1-row groups
    rt = ppo_runtime(spec, cfg)
    layouts = (rt.coarse(), rt.coarse_processes(), *rt.coarse_process_splits())
    assert {p.groups for p in layouts} == {1}
    assert len(rt.run(rt.coarse(), 1).iteration_s) == 1  # a thread layout: no process start-up in this test
    assert rt.ipc_probe_plan().groups == rt.default_groups == 1


def test_rose_refuses_rewrites_to_env_group_counts_not_offered():
    """Rose's regrouping rewrites (pipeline_env_groups, replicate_rollout) choose a count without the
    workload: with ``stages`` (scheduler.pipeline_stages) given, a proposal outside it is refused,
    never predicted or measured."""
    from components.scheduler.profiler import Span, Timeline
    from components.scheduler.rose import RoseOptimizer

    spec = _spec(robots=8)
    rt = ppo_runtime(spec, CFG)
    wf = rt.workflow_at(1)
    base = rt.sequential(groups=1).with_(placement={"policy": ("cpu0", "cpu1"), "learner": ("cpu0", "cpu1")})
    seen: list[int | None] = []

    def predict(plan, basis=None):
        seen.append(plan.groups)
        return 1.0 if plan is base or plan.groups == base.groups else 0.5  # regrouping "looks" faster

    def measure(plans):
        seen.extend(p.groups for p in plans)
        return [1.0 for _ in plans]

    spans = [Span("learn", "learn", "learner", "main", 0, 0.0, 0.01, 1)]
    cfg = CFG.model_copy(update={"activity_threshold": 0.99, "min_window_ms": 0.0})
    result = RoseOptimizer(wf, cfg, 2, measure, predict, lambda p: Timeline(spans), stages=(1,)).optimize(base)
    refused = {d.name: d.refusal for d in result.decisions if not d.legal}
    assert "not an offered stage count (1,)" in refused["pipeline_env_groups"]
    assert "not an offered stage count (1,)" in refused["replicate_rollout"]
    assert set(seen) == {1} and result.plan.groups == 1
