"""One trainer: the same data + params + starting weights give the same weights on every entry point."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from components.config import PolicyConfig, TrainConfig
from components.fleet.trainer import FleetTrainer
from components.pipeline import steps
from components.pipeline.collect import collect_expert_demos
from components.pipeline.dvc_stages import BUILD_DIR, run_stage
from components.pipeline.ingest import ingest_files
from components.pipeline.workspace import Workspace
from components.training.bc import total_steps
from components.training.checkpoint import state_digest
from components.training.expert_parallel import train_expert_parallel
from tests.conftest import small_settings


def _settings(root: Path, **train):
    base = small_settings(root)
    cfg = base.train.model_copy(update={"method": "filtered_bc", "epochs": 2, "batch_size": 64,
                                        "steps_per_iteration": 7, "validation_robots": 1, **train})
    return base.model_copy(update={"train": cfg})


def _ingest(settings, root: Path) -> None:
    """The demos, stored under ``root``'s dataset (the same files for every entry point)."""
    target = settings.model_copy(update={"root": root})
    ingest_files(target, collect_expert_demos(settings, settings.root / "demos").files, snapshot=False)


def test_flow_task_dvc_stage_and_fleet_trainer_train_the_same_weights(tmp_path, prefect_harness):
    from components.pipeline.references import load_candidate
    from flows.train import train

    settings = _settings(tmp_path / "flow")
    _ingest(settings, settings.root)
    flow = load_candidate(train(settings)).result.policy.state_dict()
    direct = steps.train_policy(settings)
    assert state_digest(direct.result.policy.state_dict()) == state_digest(flow)
    assert direct.summary.plan_name == "sequential" and len(direct.summary.validation) == direct.summary.iterations

    stage_root = tmp_path / "stage"
    stage = settings.model_copy(update={"root": stage_root})
    _ingest(settings, stage_root / BUILD_DIR)
    run_stage("train", stage)
    assert state_digest(torch.load(stage_root / BUILD_DIR / "model" / "policy.pt")) == state_digest(flow)

    # the FATS trainer replaying the same fixed dataset, for the run's step count, at the same batch size
    fleet = settings.model_copy(update={"runtime": settings.runtime.model_copy(update={
        "trainer_batch_size": settings.train.batch_size, "checkpoint_every": 10_000})})
    trainer = FleetTrainer(fleet)
    assert trainer.consume() == Workspace(settings).dataset.num_episodes
    trainer.train(total_steps(direct.frames, settings.train.batch_size, settings.train.epochs))
    assert state_digest(trainer.policy.state_dict()) == state_digest(flow)
    assert [loss for _, loss in trainer.state.losses] == direct.result.losses


def test_moe_policy_trains_in_one_process_through_the_same_path(tmp_path):
    """policy.kind: moe_transformer, every expert local: the train step and the expert-parallel
    entry (one process, no group) train the same weights from the same training set."""
    policy = PolicyConfig(kind="moe_transformer", d_model=16, heads=2, num_experts=4, top_k=2, history=2)
    settings = _settings(tmp_path, epochs=1).model_copy(update={"policy": policy})
    _ingest(settings, settings.root)
    outcome = steps.train_policy(settings)
    built = steps.training_set(settings, Workspace(settings))
    arrays = {"states": built.data.states, "actions": built.data.actions}
    if built.data.weights is not None:
        arrays["weights"] = built.data.weights.astype(np.float64)
    arrays["frame_in_episode"] = built.data.frame_in_episode  # the history windows stop at episode starts
    np.savez(tmp_path / "set.npz", **arrays)
    train_cfg = TrainConfig(**{**settings.train.model_dump(), "threads": 0})
    ep = train_expert_parallel(tmp_path / "set.npz", tmp_path / "ep.pt", policy, train_cfg, settings.shuffle,
                               seed=settings.seed)
    assert ep.losses == outcome.result.losses
    assert state_digest(torch.load(ep.state_dict_path)) == state_digest(outcome.result.policy.state_dict())
    usage = outcome.summary.expert_usage  # per step: what training.json and the MLflow series carry
    assert usage is not None and len(usage["share"]) == len(outcome.result.losses) == len(ep.expert_share)
    assert usage["share"] == ep.expert_share and usage["dropped_rate"] == ep.dropped_rate
    assert all(abs(sum(step) - 1) < 1e-9 for step in usage["share"])
    assert Path(outcome.summary.usage_png).stat().st_size > 0
    from flows.artifacts import training_markdown  # the retrain artifact's training table

    assert sum("expert token share" in line for line in training_markdown(outcome.summary)) == 1


def test_auto_weighs_a_plans_start_up_against_what_it_saves_over_the_task():
    """``auto`` picks by the whole train task: a side process that saves 10% per iteration but
    costs seconds to start loses a 20-iteration task and wins a 1000-iteration one."""
    from components.scheduler.runtime import RunCost
    from components.training.trainer import fastest_task

    sequential, side_process = RunCost(iteration_s=0.200, fixed_s=0.3), RunCost(iteration_s=0.180, fixed_s=3.5)
    def tasks(costs: list[RunCost], iterations: int) -> list[float]:
        return [c.task_s(iterations) for c in costs]

    assert sequential.task_s(20) < side_process.task_s(20)
    assert fastest_task(tasks([sequential, side_process], 20), 0.02) == 0
    assert fastest_task(tasks([sequential, side_process], 1000), 0.02) == 1
    # faster, but by less than the accept margin: sequential stays
    assert fastest_task(tasks([sequential, RunCost(iteration_s=0.199, fixed_s=0.3)], 1000), 0.02) == 0


def test_the_learner_goes_where_params_device_says(tmp_path):
    """``device`` (params.yaml) places the one trainer's learner: auto = CUDA when present (here: the
    CPU), cpu = the CPU; cuda without a GPU is refused with the setting to change. The plan cache
    keys on it: a plan measured with the learner on the CPU is not reused on a GPU."""
    import pytest

    from components.training.imitation import TrainingSet
    from components.training.trainer import make_trainer, train_spec

    data = TrainingSet(np.zeros((64, 11), np.float32), np.zeros((64, 4), np.float32))
    settings = small_settings(tmp_path)
    expected = "cuda" if torch.cuda.is_available() else "cpu"
    assert train_spec(settings.model_copy(update={"device": "auto"}), data).device == expected
    assert train_spec(settings.model_copy(update={"device": "cpu"}), data).device == "cpu"
    cpu_key = make_trainer(settings.model_copy(update={"device": "cpu"}), data).shape_key()
    if not torch.cuda.is_available():
        with pytest.raises(RuntimeError, match="set device: auto or cpu"):
            train_spec(settings.model_copy(update={"device": "cuda"}), data)
    else:
        assert make_trainer(settings.model_copy(update={"device": "cuda"}), data).shape_key() != cpu_key
