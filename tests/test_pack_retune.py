"""benchmarks/pack_retune.py: the stated rule chooses, a candidate names only sim.pack fields, and one
cell bootstraps the chosen class and scores it on tuning robots of every tuning population only."""

from __future__ import annotations

import json
from dataclasses import asdict

import pytest

from benchmarks import pack_retune as pr


def _row(index: int, initial: float, expert: float) -> dict:
    return {"candidate": index, "initial": {"rate": initial}, "expert": {"rate": expert}}


def test_rule_takes_the_candidate_nearest_65_whose_expert_clears_99():
    rows = [_row(0, 0.76, 1.0), _row(1, 0.66, 0.98), _row(2, 0.61, 0.995), _row(3, 0.70, 1.0)]
    assert pr.choose(rows) == 2  # candidate 1 is nearer 65 % but its expert misses 99 %
    assert pr.choose([_row(0, 0.60, 1.0), _row(1, 0.70, 1.0)]) == 0  # a tie keeps the earlier
    assert pr.choose([_row(0, 0.65, 0.9)]) is None


def test_a_candidate_is_refused_unless_every_key_is_a_pack_field():
    assert pr.parse_candidate("goal_radius=0.06,push_scatter=0.2") == {"goal_radius": 0.06, "push_scatter": 0.2}
    with pytest.raises(SystemExit, match="'goal_radus' is not a sim.pack field"):
        pr.parse_candidate("goal_radus=0.06")


def test_one_cell_scores_the_chosen_class_on_tuning_robots_of_each_population(tmp_path):
    grid = pr.Grid(seeds=1, robots=2, trials=1, expert_trials=1, populations=(3000, 3001), train_steps=5)
    cell = pr.run_cell(0, {"goal_radius": 0.09}, 0, pr.chosen_class(), grid, str(tmp_path))
    assert cell["candidate"] == 0 and cell["train_steps"] >= 1
    assert list(cell["populations"]) == ["3000", "3001"]
    for got in cell["populations"].values():
        assert got["initial"]["trials"] == got["expert"]["trials"] == 2
    settings = pr.cell_settings(tmp_path, 0, pr.chosen_class(), {"goal_radius": 0.09})
    assert settings.sim.pack.goal_radius == 0.09 and settings.sim.name == "pack"
    assert settings.policy.kind == pr.classes()[pr.chosen_class()].kind
    (row,) = pr.summarize_candidates([cell], [{"goal_radius": 0.09}], grid)
    assert row["initial"]["trials"] == 4 and row["pack"] == {"goal_radius": 0.09}
    assert set(row["initial_per_population"]) == {"3000", "3001"}


def test_a_merge_keeps_the_earlier_cells_and_refuses_another_grid(tmp_path):
    grid = pr.Grid(seeds=1, robots=2, trials=1, expert_trials=1, populations=(3000,), train_steps=5)
    earlier = {"grid": json.loads(json.dumps(asdict(grid))), "policy_class": "mlp", "commit": "abc", "seconds": 1.0,
               "candidates": [{"pack": {}}, {"pack": {"goal_radius": 0.05}}], "cells": [{"candidate": 1}]}
    path = tmp_path / "earlier.json"
    path.write_text(json.dumps(earlier))
    candidates, got = pr.merged(path, grid, "mlp", [{}, {"goal_radius": 0.05}, {"push_scatter": 0.2}])
    assert candidates == [{}, {"goal_radius": 0.05}, {"push_scatter": 0.2}] and got["cells"] == [{"candidate": 1}]
    with pytest.raises(SystemExit, match="merge only a run of the same grid and class"):
        pr.merged(path, pr.Grid(2, 2, 1, 1, (3000,), 5), "mlp", [{}])
    with pytest.raises(SystemExit, match="same grid and class"):
        pr.merged(path, grid, "history_transformer", [{}])


def test_a_candidate_breaking_a_bound_of_sim_pack_is_refused(tmp_path):
    """Overrides are validated as params.yaml is: a broken bound is refused, not taken silently."""
    with pytest.raises(ValueError, match=r"push_distance_max.*below push_distance_min"):
        pr.cell_settings(tmp_path, 0, None, {"push_distance_min": 0.3, "push_distance_max": 0.2})
