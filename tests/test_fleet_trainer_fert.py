"""The fleet's async trainer trains FERT (the default method): the flow's own training-set builder on
a pinned segment store version, so a killed trainer resumes bit for bit however far the store moved."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import numpy as np
import pytest

from components.config import FertConfig, TrainConfig
from components.episodes.record import new_episode_id
from components.fleet.trainer import STATUS_NAME, FleetTrainer
from components.fleet.training_set import TAG_PREFIX
from components.pipeline import steps
from components.pipeline.collect import collect_expert_demos
from components.pipeline.ingest import (
    embed_pending,
    ingest_files,
    read_file,
    store_episodes,
)
from components.pipeline.workspace import Workspace
from components.training.bc import total_steps
from components.training.checkpoint import state_digest
from tests.conftest import small_settings


def _settings(root: Path, runtime_dir: str = "fleet-runtime", **runtime):
    base = small_settings(root, train=TrainConfig(method="fert", epochs=2, batch_size=32, steps_per_iteration=10,
                                                  validation_robots=1),
                          fert=FertConfig(calibration_episodes=4))
    knobs = {"runtime_dir": runtime_dir, "checkpoint_every": 10, "steps_per_episode": 2, "trainer_batch_size": 32,
             "trainer_rebuild_episodes": 5, **runtime}
    return base.model_copy(update={"runtime": base.runtime.model_copy(update=knobs)})


def _failures(settings, count: int, seed: int, interrupted: bool = False):
    """Failed episodes where the demos went: a demo's states drifting off (queries FERT can match)."""
    rng = np.random.default_rng(seed)
    demos = [ep for ep in Workspace(settings).dataset.episodes() if ep.success][:count]
    return [dataclasses.replace(ep, episode_id=new_episode_id(rng), success=False, interrupted=interrupted,
                                states=(ep.states + rng.normal(0, 0.3, ep.states.shape)).astype(np.float32),
                                policy_version="v1")
            for ep in demos]


def _add(settings, episodes) -> int:
    """Store ``episodes`` and embed them, as the fleet's ingest service does; the store's new version."""
    Workspace(settings).dataset.add_episodes(episodes)
    embed_pending(settings)
    return Workspace(settings).store.version


def test_fert_trainer_waits_for_the_store_then_resumes_bit_for_bit_from_its_pin_after_the_store_moved(tmp_path):
    settings = _settings(tmp_path, "run-a")
    ws = Workspace(settings)
    demos = collect_expert_demos(settings, tmp_path / "demos")
    store_episodes(settings, [read_file(settings, f) for f in demos.files])  # stored, not embedded
    waiting = FleetTrainer(settings)
    waiting.consume()  # stored, but nothing embedded yet: no FERT set, no training
    assert not waiting.ready() and "segment store" in waiting.pins.waiting
    assert waiting.describe_training_set().startswith("fert: waiting for the segment store")  # fleet status

    interrupted = _failures(settings, 1, seed=9, interrupted=True)  # a robot stopped mid-episode: not a failure
    pinned_version = _add(settings, _failures(settings, 4, seed=1) + interrupted)
    straight = FleetTrainer(settings)
    straight.consume()
    report = straight._built.report
    assert straight.ready() and straight.method == "fert" and report.method == "fert"
    assert report.failed_episodes == 4 and report.matches > 0  # the interrupted one neither queries nor is imitated
    assert straight._pin.store_version == pinned_version and straight._pin.episodes == ws.dataset.num_episodes
    straight.train(40)

    crashed = FleetTrainer(_settings(tmp_path, "run-b"))
    crashed.consume()
    crashed.train(27)  # "killed" at step 27: steps 21..27 were never checkpointed
    moved_on = _add(settings, _failures(settings, 4, seed=2) + _failures(settings, 3, seed=3))
    assert moved_on > pinned_version

    resumed = FleetTrainer(_settings(tmp_path, "run-b"))
    assert resumed.resume() and resumed.state.step == 20
    assert resumed._pin == straight._pin  # rebuilt from the checkpoint's pin, not from today's store
    assert resumed.describe_training_set() == f"fert on {straight._pin.episodes} episodes, store v{pinned_version}"
    resumed.train(20)
    assert resumed.state.losses == straight.state.losses  # steps 1..40, bit for bit

    # new data past the pin: the next look takes a new pin at the store's new version, and tags it
    assert resumed.consume() == 7 and resumed._pin.store_version == moved_on
    assert resumed._built.report.failed_episodes == 11
    tags = Workspace(settings).store.tags()
    assert tags[f"{TAG_PREFIX}{moved_on}"] == moved_on and tags[f"{TAG_PREFIX}{pinned_version}"] == pinned_version
    resumed.write_status()
    status = json.loads((resumed.layout.state / STATUS_NAME).read_text())
    assert status["training_set"]["pin"]["store_version"] == moved_on and status["waiting"] == ""


def test_fert_trainer_on_a_fixed_dataset_trains_the_weights_the_train_step_trains(tmp_path):
    """The one trainer of #8, FERT: the train step (no champion: from scratch, every failure queries)
    and the fleet trainer replaying the same embedded dataset at the same batch size agree bit for bit."""
    settings = _settings(tmp_path, checkpoint_every=10_000)
    ingest_files(settings, collect_expert_demos(settings, tmp_path / "demos").files, snapshot=False)
    _add(settings, _failures(settings, 4, seed=1))
    direct = steps.train_policy(settings)
    assert direct.summary.method == "fert" and direct.summary.retrieved_segments > 0

    trainer = FleetTrainer(settings)
    trainer.consume()
    assert trainer._built.report.matches == direct.summary.retrieved_segments
    trainer.train(total_steps(direct.frames, settings.train.batch_size, settings.train.epochs))
    assert state_digest(trainer.policy.state_dict()) == state_digest(direct.result.policy.state_dict())
    assert [loss for _, loss in trainer.state.losses] == direct.result.losses


@pytest.mark.parametrize("recipe", [{"lr_schedule": "cosine"}, {"state_noise": 0.05}])
def test_the_fleet_trainer_refuses_recipe_knobs_it_cannot_honour(tmp_path, recipe):
    """FATS has no run length for a cosine rate and samples its own batches: refused, naming the fix."""
    settings = _settings(tmp_path)
    settings = settings.model_copy(update={"train": settings.train.model_copy(update=recipe)})
    with pytest.raises(ValueError, match="fix: set train.lr_schedule: constant and train.state_noise: 0"):
        FleetTrainer(settings)
