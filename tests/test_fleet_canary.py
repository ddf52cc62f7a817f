"""Canary rollout on a real MLflow registry and a real episode dataset: promote, wait, roll back."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import mlflow
import pytest
import torch

from components.episodes.dataset import EpisodeDataset
from components.registry.canary import CanaryRollout, assigned_alias, rollout_fraction
from components.fleet.local import register_policy, synthetic_episode
from components.policy.factory import make_policy
from components.registry.model_registry import PolicyRegistry
from tests.conftest import small_settings

SEEDS = iter(range(10_000, 1_000_000))


@pytest.fixture
def world(tmp_path: Path):
    base = small_settings(tmp_path)
    settings = base.model_copy(
        update={"runtime": base.runtime.model_copy(update={"canary_min_episodes": 30, "canary_max_episodes": 80, "canary_share": 0.25})}
    )
    registry = PolicyRegistry(settings.paths.mlruns, settings.registry)
    dataset = EpisodeDataset(settings.paths.episodes, settings.episodes)
    versions = []
    for seed in range(3):
        torch.manual_seed(seed)
        versions.append(register_policy(settings, make_policy(11, 3, settings.policy), run_name=f"v{seed}"))
    return settings, registry, dataset, versions


def _outcomes(dataset: EpisodeDataset, version: int, successes: int, trials: int, interrupted: int = 0) -> None:
    episodes = []
    for i in range(trials + interrupted):
        ep = synthetic_episode(f"robot-{i % 8:04d}", seed=next(SEEDS), length=4, success=i < successes)
        episodes.append(dataclasses.replace(ep, policy_version=f"v{version}", interrupted=i >= trials, success=i < successes and i < trials))
    dataset.add_episodes(episodes)


def _decision_runs(settings) -> list[str]:
    runs = mlflow.search_runs(experiment_names=[settings.registry.experiment], output_format="list")
    return sorted(r.data.tags.get("fleetloop.canary.decision", "") for r in runs if r.data.tags.get("fleetloop.canary.decision"))


def test_assignment_is_stable_and_respects_the_share(tmp_path: Path):
    settings = small_settings(tmp_path)
    robots = settings.fleet.robot_ids(400)
    share = sum(rollout_fraction(r) < 0.25 for r in robots) / len(robots)
    assert 0.18 < share < 0.32
    assert all(assigned_alias(r, 0.25, False, settings.registry, "canary") == "champion" for r in robots)
    assert assigned_alias(robots[0], 1.0, True, settings.registry, "canary") == "canary"


def test_better_canary_waits_for_evidence_then_becomes_champion(world):
    settings, registry, dataset, (v1, v2, _) = world
    rollout = CanaryRollout(registry, dataset, settings.runtime)
    assert rollout.start(v1).action == "promote"  # first model: no champion to compare with
    _outcomes(dataset, v1, successes=40, trials=40)  # before the canary: must not count
    assert rollout.start(v2).action == "start" and rollout.live() == v2
    _outcomes(dataset, v1, successes=15, trials=30)
    _outcomes(dataset, v2, successes=10, trials=20, interrupted=5)
    waiting = rollout.evaluate()
    assert waiting.action == "wait" and waiting.canary.trials == 20 and waiting.canary.interrupted == 5
    assert waiting.champion.trials == 30  # the 40 pre-canary episodes are not in the comparison
    _outcomes(dataset, v2, successes=20, trials=20)
    decision = rollout.evaluate()
    assert decision.action == "promote" and decision.p_value < settings.registry.gate_alpha
    assert registry.aliases() == {"champion": v2, "previous": v1}
    assert "promote" in registry.get_version(v2).tags["fleetloop.canary.decision"]
    assert _decision_runs(settings) == ["promote", "promote", "start"]


def test_worse_canary_is_rolled_back_and_champion_untouched(world):
    settings, registry, dataset, (v1, _, v3) = world
    rollout = CanaryRollout(registry, dataset, settings.runtime)
    rollout.start(v1)
    rollout.start(v3)
    _outcomes(dataset, v1, successes=28, trials=32)
    _outcomes(dataset, v3, successes=8, trials=32)
    decision = rollout.evaluate()
    assert decision.action == "rollback" and "champion" in decision.reason
    assert registry.aliases() == {"champion": v1} and rollout.live() is None
    assert registry.get_version(v3).tags["fleetloop.rolled_back"] == "true"
    assert rollout.evaluate().action == "none"


def test_canary_not_better_within_its_budget_is_rolled_back(world):
    settings, registry, dataset, (v1, v2, _) = world
    rollout = CanaryRollout(registry, dataset, settings.runtime)
    rollout.start(v1)
    rollout.start(v2)
    _outcomes(dataset, v1, successes=40, trials=80)
    _outcomes(dataset, v2, successes=42, trials=80)  # at the budget, equal within noise
    decision = rollout.evaluate()
    assert decision.action == "rollback" and "not significantly better" in decision.reason
    assert registry.aliases()["champion"] == v1 and rollout.live() is None
