"""train.workload: the Prefect train task runs PPO through the embedded scheduler."""

from __future__ import annotations

import torch

from components.config import PolicyConfig, SchedulerConfig, SimConfig, TrainConfig
from components.pipeline.scheduled import ScheduledTrainOutcome, ppo_spec
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
    import pytest

    from components.pipeline.scheduled import train_scheduled

    settings = small_settings(tmp_path, train=TrainConfig(workload="imitation"))
    with pytest.raises(ValueError, match="train.workload='imitation'"):
        train_scheduled(settings)
