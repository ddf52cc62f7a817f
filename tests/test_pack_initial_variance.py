"""benchmarks/pack_initial_variance.py: the variance decomposition recovers known parts, and one
bootstrap is scored on fresh test populations and the two fixed sets through the product's evaluation."""

from __future__ import annotations

import numpy as np
import pytest

from benchmarks import pack_initial_variance as piv
from benchmarks.pack_retune import TUNING_POPULATIONS


def test_additive_seed_and_population_effects_are_split_exactly():
    seed = np.array([0.1, 0.3, 0.2, 0.6])
    population = np.array([0.0, 0.05, 0.4])
    parts = piv.variance_components(0.5 + seed[:, None] + population[None, :])
    assert parts["residual_var"] == pytest.approx(0.0, abs=1e-12)
    assert parts["seed_var"] == pytest.approx(seed.var(ddof=1))
    assert parts["population_var"] == pytest.approx(population.var(ddof=1))
    assert parts["grand_mean"] == pytest.approx(0.5 + seed.mean() + population.mean())


def test_noise_without_structure_is_residual():
    rates = np.random.default_rng(3).normal(0.6, 0.05, size=(40, 40))
    parts = piv.variance_components(rates)
    assert parts["residual_var"] == pytest.approx(0.05 ** 2, rel=0.1)
    assert parts["seed_var"] < 0.1 * parts["residual_var"]
    assert parts["population_var"] < 0.1 * parts["residual_var"]


def test_one_seed_is_scored_on_every_population_and_fixed_set(tmp_path):
    grid = piv.Grid(seeds=1, populations=2, robots=2, trials=1, train_steps=5)
    cell = piv.score_seed(0, grid, str(tmp_path))
    names = [f"population-{piv.DIAGNOSTIC_POPULATION_BASE + p}" for p in range(2)] + list(piv.FIXED_SETS)
    assert list(cell["columns"]) == names
    for name, column in cell["columns"].items():
        populations = len(TUNING_POPULATIONS) if name == "tuning_representative" else 1
        assert column["trials"] == populations * grid.robots * grid.trials, name
        assert sum(column["successes_by_robot"].values()) == column["successes"], name
    assert set(cell["columns"]["tuning"]["successes_by_robot"]) == {"tuning-0000", "tuning-0001"}
    assert set(cell["columns"]["population-2000"]["successes_by_robot"]) == {"test-0000", "test-0001"}
    assert "3003/tuning-0001" in cell["columns"]["tuning_representative"]["successes_by_robot"]
    assert cell["train_steps"] >= 1


def test_a_class_and_difficulty_are_scored_on_the_populations_asked_for(tmp_path):
    grid = piv.Grid(seeds=1, populations=1, robots=1, trials=1, train_steps=5, population_base=2100,
                    policy_class="history_transformer", pack={"goal_radius": 0.06})
    cell = piv.score_seed(0, grid, str(tmp_path))
    assert grid.population_names() == ["population-2100"]
    assert list(cell["columns"])[0] == "population-2100"
    settings = piv.cell_settings(tmp_path, 0, grid.policy_class, grid.pack)
    assert settings.policy.kind == "moe_transformer" and settings.sim.pack.goal_radius == 0.06


def test_grand_mean_interval_resamples_seeds_and_populations():
    assert piv.grand_mean_ci(np.full((3, 4), 0.6), 200, 0, 0.95) == pytest.approx([0.6, 0.6])
    rates = 0.5 + np.array([0.0, 0.2])[:, None] + np.zeros((2, 5))  # only the seeds differ
    low, high = piv.grand_mean_ci(rates, 400, 0, 0.95)
    assert low == pytest.approx(0.5) and high == pytest.approx(0.7)  # a resample can draw one seed twice
