"""Continuous training ships models: the fleet trainer's checkpoints become registered, gated
candidates (real MLflow + LanceDB in a scratch root), and a resumed trainer never ships one twice."""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path

from components.config import SimConfig
from components.episodes.dataset import EpisodeDataset
from components.fleet.local import synthetic_episode
from components.fleet.shipping import RUN_TAG, SOURCE, SOURCE_TAG, STEP_TAG
from components.fleet.trainer import STATUS_NAME, FleetTrainer
from components.pipeline.promote import CHAMPION_EVALUATION_ARTIFACT
from components.registry.model_registry import PolicyRegistry
from components.training.checkpoint import load_latest
from tests.conftest import small_settings

EVERY = 20  # candidate_every_steps


def _settings(root: Path):
    base = small_settings(root, sim=SimConfig(max_steps=30))
    runtime = base.runtime.model_copy(update={
        "checkpoint_every": 10, "steps_per_episode": 4, "trainer_batch_size": 16,
        "candidate_every_steps": EVERY, "candidate_every_s": 0.0,
    })
    return base.model_copy(update={"runtime": runtime})


def _stored(settings, episodes: int = 12) -> None:
    dataset = EpisodeDataset(settings.paths.episodes, settings.episodes)
    dataset.add_episodes([synthetic_episode(f"robot-{i % 2:04d}", seed=i, length=10) for i in range(episodes)])


def _registry(settings) -> PolicyRegistry:
    return PolicyRegistry(settings.paths.mlruns, settings.registry)


def test_the_trainer_ships_a_candidate_with_lineage_every_n_steps_and_promotes_it_without_a_champion(tmp_path):
    settings = _settings(tmp_path)
    _stored(settings)
    trainer = FleetTrainer(settings)
    assert trainer.consume() == 12 and trainer.state.owed == 48
    trainer.train(EVERY - 1)
    assert not trainer.ship_if_due()  # one step short of N
    trainer.train(1)
    assert trainer.ship_if_due()

    registry = _registry(settings)
    (candidate,) = registry.versions()
    tags = candidate.tags
    assert tags[RUN_TAG] == trainer.shipping.run_id and tags[STEP_TAG] == str(EVERY) and tags[SOURCE_TAG] == SOURCE
    assert tags["fleetloop.method"] == "filtered_bc"  # what the buffer imitates (train.method: filtered_bc)
    lineage = candidate.lineage  # the product's lineage: code, data snapshot, store version, params, data seen
    assert lineage.episodes == 12 and lineage.frames == 120 and lineage.params_hash and lineage.git_commit
    assert lineage.episodes_per_robot == {"robot-0000": 6, "robot-0001": 6} and lineage.lancedb_version >= 0
    heldout = settings.fleet.num_heldout_robots
    assert candidate.trials == heldout * settings.evaluation.trials_for(heldout)  # held-out robots, seeded trials
    assert tags["fleetloop.gate"] == "no champion yet"  # the gate's verdict, as on every path
    assert registry.champion().version == candidate.version  # registry.rollout: direct

    # the checkpoint *is* the candidate and records it; so does state/trainer.json
    ckpt = load_latest(trainer.layout.checkpoints)
    assert ckpt.step == EVERY and ckpt.extra["shipping"]["last"]["version"] == candidate.version
    status = json.loads((trainer.layout.state / STATUS_NAME).read_text())
    assert status["candidates"]["shipped"] == 1 and status["candidates"]["last"]["promoted"] is True
    assert status["candidates"]["last"]["seconds"] > 0
    assert {"step", "cursor", "owed", "resumes", "last_loss"} <= set(status)  # what chaos reads, unchanged

    # the next candidate is judged against the champion on the same trials
    trainer.train(EVERY)
    assert trainer.ship_if_due()
    second = registry.get_version(trainer.shipping.last.version)
    assert second.version == candidate.version + 1 and second.tags[STEP_TAG] == str(2 * EVERY)
    assert "vs champion" in second.tags["fleetloop.gate"]
    assert registry.champion().version == (second.version if trainer.shipping.last.promoted else candidate.version)
    # the champion's evaluation on those trials is kept on the run (the failure explorer's "before");
    # the first candidate met no champion, so its run has none
    kept = registry.run_dict(second.run_id, CHAMPION_EVALUATION_ARTIFACT)
    assert kept == registry.run_dict(candidate.run_id, "evaluation.json")  # the champion was the first candidate
    assert registry.run_dict(candidate.run_id, CHAMPION_EVALUATION_ARTIFACT) is None
    print(json.dumps({"checkpoint_to_registered_s": [round(h["seconds"], 2) for h in trainer.shipping.history],
                      "gate_s": [round(h["gate_seconds"], 2) for h in trainer.shipping.history]}))


def test_a_resumed_trainer_never_ships_the_same_checkpoint_twice(tmp_path):
    settings = _settings(tmp_path)
    _stored(settings)
    trainer = FleetTrainer(settings)
    trainer.consume()
    trainer.train(EVERY)
    before_ship = tmp_path / "checkpoints-before-ship"
    shutil.copytree(trainer.layout.checkpoints, before_ship)  # step 20, written before it shipped
    assert trainer.ship_if_due()
    registry = _registry(settings)
    assert len(registry.versions()) == 1

    # restarted after the ship was recorded: nothing due at the same step
    resumed = FleetTrainer(settings)
    assert resumed.resume() and resumed.state.step == EVERY and resumed.shipping.last.step == EVERY
    assert resumed.shipping.run_id == trainer.shipping.run_id
    assert not resumed.ship_if_due()
    assert len(registry.versions()) == 1

    # killed between registering and the checkpoint that records it: MLflow knows this run's step
    shutil.rmtree(trainer.layout.checkpoints)
    shutil.copytree(before_ship, trainer.layout.checkpoints)
    crashed = FleetTrainer(settings)
    assert crashed.resume() and crashed.state.step == EVERY and crashed.shipping.last is None
    assert crashed.ship_if_due()  # due again, found registered, recorded, not registered twice
    assert crashed.shipping.last.step == EVERY and crashed.shipping.last.version is None
    assert len(registry.versions()) == 1

    # and training goes on to ship the next step as usual
    crashed.train(EVERY)
    assert crashed.ship_if_due()
    assert [v.tags[STEP_TAG] for v in registry.versions()] == [str(EVERY), str(2 * EVERY)]


def test_with_canary_rollout_the_first_candidate_becomes_champion_and_a_live_canary_defers_the_next(tmp_path):
    base = _settings(tmp_path)
    settings = base.model_copy(update={
        "registry": base.registry.model_copy(update={"rollout": "canary"}),
        "runtime": base.runtime.model_copy(update={"candidate_retry_s": 0.001}),
    })
    _stored(settings)
    trainer = FleetTrainer(settings)
    trainer.consume()
    trainer.train(EVERY)
    assert trainer.ship_if_due()
    registry = _registry(settings)
    assert registry.champion().version == 1  # CanaryRollout.start with no champion: straight to champion

    registry.client.set_registered_model_alias(settings.registry.model_name, settings.runtime.canary_alias, "1")
    trainer.train(EVERY)
    assert not trainer.ship_if_due()  # one rollout at a time
    assert trainer.shipping.waiting == "canary v1 is rolling out" and len(registry.versions()) == 1
    registry.client.delete_registered_model_alias(settings.registry.model_name, settings.runtime.canary_alias)
    time.sleep(0.01)  # candidate_retry_s (1 ms) passes
    assert trainer.ship_if_due() and trainer.shipping.last.step == 2 * EVERY
    assert [v.version for v in registry.versions()] == [1, 2] and trainer.shipping.waiting == ""
