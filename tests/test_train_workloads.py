"""train.workload: the Prefect train task runs PPO and the FERT iteration through the embedded scheduler."""

from __future__ import annotations

import pytest
import torch

from components.config import FertConfig, PolicyConfig, SchedulerConfig, SimConfig, TrainConfig
from components.pipeline import steps
from components.pipeline.collect import collect_expert_demos, collect_fleet
from components.pipeline.evaluate import evaluate_policy
from components.pipeline.ingest import ingest_files
from components.pipeline.promote import gate_candidate, register_candidate
from components.pipeline.scheduled import ScheduledTrainOutcome, ppo_spec, train_scheduled
from components.pipeline.workspace import Workspace
from components.training.workloads.ppo import run_ppo
from tests.conftest import small_settings


def _ppo_settings(tmp_path):
    return small_settings(
        tmp_path,
        sim=SimConfig(max_steps=12),
        policy=PolicyConfig(hidden=16, layers=2),
        train=TrainConfig(method="filtered_bc", workload="ppo"),
        scheduler=SchedulerConfig(plan="planner", iterations=2, ppo_steps=4, ppo_epochs=1, ppo_minibatches=2,
                                  ppo_eval_steps=3, pipeline_stages=(1, 2), profile_iterations=2,
                                  validate_iterations=1, validate_rounds=1),
    )


def test_train_flow_runs_ppo_through_the_scheduler(tmp_path, prefect_harness):
    from flows.train import train

    settings = _ppo_settings(tmp_path)
    outcome = train(settings)
    assert isinstance(outcome, ScheduledTrainOutcome)
    report = outcome.schedule
    assert report is not None and report.workload == "ppo"
    assert report.plan_text.startswith("plan m2flow(m=") and "predicted iteration time" in report.plan_text
    assert len(report.iteration_s) == settings.scheduler.iterations and all(s > 0 for s in report.iteration_s)
    assert len(outcome.result.losses) == settings.scheduler.iterations
    assert outcome.frames == settings.fleet.num_robots * settings.scheduler.ppo_steps * settings.scheduler.iterations

    # the weights the flow trained equal a direct run of the sequential schedule, bit for bit
    spec, cfg = ppo_spec(settings)
    direct = run_ppo(spec, cfg, settings.scheduler.iterations, plan="sequential")
    got = outcome.result.policy.state_dict()
    assert got.keys() == direct.policy_weights.keys()
    assert all(torch.equal(got[k], direct.policy_weights[k]) for k in got)
    assert report.losses == [m.loss for m in direct.metrics]


def test_unknown_scheduled_workload_is_refused(tmp_path):
    settings = small_settings(tmp_path, train=TrainConfig(workload="imitation"))
    with pytest.raises(ValueError, match="train.workload='imitation'"):
        train_scheduled(settings)


def test_train_flow_runs_the_fert_iteration_through_the_scheduler(tmp_path, prefect_harness):
    """Demos -> champion -> a fleet round with failures; then the train task runs FERT iterations
    (retrieval for the failures, batch assembly, learner, held-out evaluation) under the planner's
    plan, and its weights equal the sequential schedule's bit for bit."""
    from flows.train import train

    settings = small_settings(
        tmp_path, sim=SimConfig(max_steps=40), fert=FertConfig(calibration_episodes=20),
        train=TrainConfig(method="fert", workload="fert_iteration", epochs=2, batch_size=64),
        scheduler=SchedulerConfig(plan="planner", iterations=2, fert_learn_steps=2, fert_eval_steps=10,
                                  pipeline_stages=(1,), profile_iterations=2, validate_iterations=1,
                                  validate_rounds=1),
    )
    ingest_files(settings, collect_expert_demos(settings, tmp_path / "demos").files, snapshot=False)
    first = steps.train_policy(settings)
    gate_candidate(settings, register_candidate(settings, first, evaluate_policy(settings, first.result.policy,
                                                                                 "candidate"), "bootstrap"), None)
    champion = Workspace(settings).registry.load("champion")
    fleet = collect_fleet(settings, champion, "v1", tmp_path / "round1", round_index=1)
    ingest_files(settings, fleet.files, snapshot=False)
    assert any(not e.success for e in Workspace(settings).dataset.episodes())  # failures to query with

    outcome = train(settings)
    report = outcome.schedule
    assert report is not None and report.workload == "fert_iteration"
    assert report.plan_text.startswith("plan m2flow(m=") and "predicted iteration time" in report.plan_text
    assert len(report.iteration_s) == len(report.losses) == settings.scheduler.iterations
    assert all(0.0 <= r <= 1.0 for r in report.eval_successes)

    sequential = train_scheduled(settings.model_copy(update={
        "scheduler": settings.scheduler.model_copy(update={"plan": "sequential"})}))
    got, want = outcome.result.policy.state_dict(), sequential.result.policy.state_dict()
    assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in got)
    assert report.losses == sequential.schedule.losses

    too_short = settings.model_copy(update={"scheduler": settings.scheduler.model_copy(update={"fert_eval_steps": 6})})
    with pytest.raises(ValueError, match="scheduler.fert_eval_steps=6 is shorter than store.window=8"):
        train_scheduled(too_short)
    # it fine-tuned the champion: same normalizers, different weights
    assert torch.equal(got["obs_norm.mean"], champion.state_dict()["obs_norm.mean"])
    assert any(not torch.equal(got[k], champion.state_dict()[k]) for k in got if k.startswith("core."))
