"""The Prefect train task runs through the embedded scheduler: FERT (the one trainer) and PPO."""

from __future__ import annotations

import json

import pytest
import torch

from components.config import FertConfig, PolicyConfig, SchedulerConfig, SimConfig, TrainConfig
from components.pipeline import steps
from components.pipeline.collect import collect_expert_demos, collect_fleet
from components.pipeline.evaluate import evaluate_policy
from components.pipeline.ingest import ingest_files
from components.pipeline.promote import gate_candidate, register_candidate
from components.pipeline.references import load_candidate
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
                                  validate_iterations=1, validate_rounds=1, capacity_probe_attempts=1,
                                  ipc_probe_iterations=1),
    )


def test_train_flow_runs_ppo_through_the_scheduler(tmp_path, prefect_harness):
    from flows.train import train

    settings = _ppo_settings(tmp_path)
    outcome = load_candidate(train(settings))  # the flow returns a reference to the staged candidate
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


@pytest.mark.parametrize(("stages", "envs", "chunk"), [((1, 2, 4), 8, 2), ((1, 2, 4), 16, 4), ((1, 2, 3), 12, 2), ((2, 3), 24, 4), ((5,), 8, 8)])
def test_the_inference_chunk_divides_every_offered_group(stages, envs, chunk):
    """PPO refuses env groups its chunk does not divide; the chunk was envs // max(stages), which
    breaks for stage counts that do not divide each other (12 envs in 1, 2, 3 groups: 6 % 4)."""
    from components.config import SchedulerConfig
    from components.pipeline.scheduled import _scheduler_cfg

    cfg, got = _scheduler_cfg(SchedulerConfig(pipeline_stages=stages), envs)
    assert got == chunk and all((envs // m) % got == 0 for m in cfg.pipeline_stages), (cfg.pipeline_stages, got)


def test_unknown_scheduled_workload_is_refused(tmp_path):
    settings = small_settings(tmp_path, train=TrainConfig(workload="imitation"))
    with pytest.raises(ValueError, match="train.workload='imitation'"):
        train_scheduled(settings)


def test_train_flow_runs_fert_through_the_scheduler_and_caches_the_plan(tmp_path, prefect_harness):
    """Demos -> champion -> a fleet round with failures; then the train task fine-tunes the champion
    with FERT (one FERT: components/fert) through the one trainer under ``scheduler.plan: auto``:
    profiled once, the choice cached under the root, weights bit-identical to the sequential plan."""
    from flows.train import train

    settings = small_settings(
        tmp_path, sim=SimConfig(max_steps=40), fert=FertConfig(calibration_episodes=20),
        train=TrainConfig(method="fert", epochs=2, batch_size=64, steps_per_iteration=4, validation_robots=1),
        scheduler=SchedulerConfig(plan="sequential"),
    )
    ingest_files(settings, collect_expert_demos(settings, tmp_path / "demos").files, snapshot=False)
    first = steps.train_policy(settings)
    gate_candidate(settings, register_candidate(settings, first, evaluate_policy(settings, first.result.policy,
                                                                                 "candidate"), "bootstrap"), None)
    champion = Workspace(settings).registry.load("champion")
    fleet = collect_fleet(settings, champion, "v1", tmp_path / "round1", round_index=1)
    ingest_files(settings, fleet.files, snapshot=False)
    assert any(not e.success for e in Workspace(settings).dataset.episodes())  # failures to query with

    # this test is about the plan cache: any capacity reading qualifies (a loaded host's reading would
    # leave the plan uncached; qualification has its own tests in tests/test_scheduler_*.py)
    auto = settings.model_copy(update={"scheduler": SchedulerConfig(
        plan="auto", profile_iterations=2, validate_iterations=1, validate_rounds=1, quota_max_steps=1,
        capacity_qualify_fraction=0.01, ipc_probe_iterations=1)})
    candidate = train(auto)
    outcome = load_candidate(candidate)
    summary = outcome.summary
    assert candidate.summary == summary  # the reference carries the summary the UI and the demo table show
    assert summary is not None and summary.method == "fert" and summary.retrieved_segments > 0
    assert summary.plan_requested == "auto" and summary.plan_source == "measured"
    assert summary.sequential_iteration_s and summary.sequential_iteration_s > 0
    assert summary.predicted_iteration_s and summary.predicted_iteration_s > 0  # whichever plan won
    assert summary.iterations == len(summary.validation) == -(-len(outcome.result.losses) // 4)
    assert set(summary.stage_seconds) == {"sample", "learn", "validate"}
    tags = summary.tags()
    assert tags["fleetloop.method"] == "fert" and tags["fleetloop.scheduler.plan"] == summary.plan_name
    cached = list((tmp_path / ".fleetloop" / "plans").glob("train-*.json"))
    assert len(cached) == 1
    decision = json.loads(cached[0].read_text())  # decided on the whole task: start-up + its iterations
    assert set(decision["task_s"]) == set(decision["candidates"]) and "sequential" in decision["task_s"]
    assert decision["task_s"][summary.plan_name] <= decision["task_s"]["sequential"]

    sequential = steps.train_policy(settings)
    got, want = outcome.result.policy.state_dict(), sequential.result.policy.state_dict()
    assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in got)
    assert outcome.result.losses == sequential.result.losses
    assert outcome.summary.validation == sequential.summary.validation

    again = steps.train_policy(auto)  # the machine and the workload's shape are unchanged: no profiling
    assert again.summary.plan_source == "cache" and again.summary.plan_name == summary.plan_name
    # it fine-tuned the champion: same normalizers, different weights
    assert torch.equal(got["obs_norm.mean"], champion.state_dict()["obs_norm.mean"])
    assert any(not torch.equal(got[k], champion.state_dict()[k]) for k in got if k.startswith("core."))

    # the candidate's MLflow run carries the method, the plan, the speed-up and the Gantt image
    version = register_candidate(auto, outcome, evaluate_policy(auto, outcome.result.policy, "candidate"), "round-1")
    registry = Workspace(auto).registry
    run = registry.client.get_run(version.run_id)
    assert run.data.tags["fleetloop.method"] == "fert"
    assert run.data.tags["fleetloop.scheduler.plan"] == summary.plan_name
    assert float(run.data.tags["fleetloop.scheduler.speedup_vs_sequential"]) > 0
    names = {a.path for a in registry.client.list_artifacts(version.run_id)}
    assert {"schedule_gantt.png", "training.json"} <= names
