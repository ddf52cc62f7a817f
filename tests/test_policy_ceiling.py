"""benchmarks/policy_ceiling.py: a cell's settings carry the grid's follow-up knobs, and nothing else moves."""

from __future__ import annotations

from dataclasses import replace

import pytest

from benchmarks.policy_ceiling import FULL, cell_settings
from components.config import load_settings


def test_a_cell_takes_the_grids_class_recipe_and_demos(tmp_path):
    base = load_settings()
    plain = cell_settings("history_transformer", 3, FULL, tmp_path / "plain")
    assert (plain.seed, plain.sim.name, plain.policy.kind) == (3, "pack", "moe_transformer")
    assert plain.demo.expert_robots == FULL.demo_robots
    assert plain.demo.expert_episodes_per_robot == base.demo.expert_episodes_per_robot

    grid = replace(FULL, demo_episodes=60, demo_robots=64, policy_overrides=(("head", "gmm"),), lr_schedule="cosine")
    changed = cell_settings("mlp", 3, grid, tmp_path / "changed")
    assert changed.demo.expert_episodes_per_robot == 60 and changed.demo.expert_robots == 64
    assert changed.policy.head == "gmm"
    assert changed.train.lr_schedule == "cosine" and changed.policy.kind == "mlp"
    assert changed.sim == plain.sim  # the task is params.yaml's in every cell

    with pytest.raises(ValueError, match="--policy-set"):
        cell_settings("mlp", 0, replace(FULL, policy_overrides=(("head", "softmax"),)), tmp_path / "bad")
