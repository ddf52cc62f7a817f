"""benchmarks/fleet_scaling.py: the fine-tuning budget rule and a tiny end-to-end run of the study."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
import torch

from benchmarks import fleet_scaling as fs
from components.config import load_settings


def test_finetune_budget_is_about_the_steps_but_at_most_max_epochs_passes():
    settings = load_settings()  # batch_size 256
    assert fs.finetune_config(settings, 256 * 10, 600).epochs == 60  # 10 steps per pass
    assert fs.finetune_config(settings, 256 * 10, 600, max_epochs=6).epochs == 6
    assert fs.finetune_config(settings, 256 * 200, 600, max_epochs=6).epochs == 3  # the cap does not bind
    assert fs.finetune_config(settings, 10, 600).epochs == 600  # fewer frames than a batch: one step a pass


def test_tiny_study_writes_consistent_results(tmp_path, monkeypatch):
    monkeypatch.setattr(fs, "RESULTS", tmp_path)
    threads = torch.get_num_threads()
    plan = replace(fs.QUICK["pickplace"], fleet_sizes=(1, 2), steps_per_robot=60, finetune_steps=20,
                   heldout_robots=2, trials_per_robot=2)
    try:
        result = fs.run(plan, "tiny")
    finally:
        torch.set_num_threads(threads)  # run() pins torch to 1 thread, as the benchmark does
    saved = json.loads((tmp_path / "tiny.json").read_text())
    assert saved["plan"]["fleet_sizes"] == [1, 2] and (tmp_path / "tiny.png").exists()
    assert saved["settings"]["sim"]["motion_noise_std"] == pytest.approx(load_settings().sim.motion_noise_std)
    assert set(result["results"]) == {"bc", "filtered_bc", "fert"}
    for method, by_fleet in result["results"].items():
        for fleet, cell in by_fleet.items():
            t = cell["thresholded"]
            assert t["trials"] == plan.heldout_robots * plan.trials_per_robot, (method, fleet)
            # every failed held-out trial is counted once in the stage breakdown
            assert sum(cell["failures_by_stage"].values()) == t["trials"] - t["successes"], (method, fleet)
            assert t["ci_low"] <= t["rate"] <= t["ci_high"]
    assert set(result["targets"]) >= {"fert_largest_fleet_ge_97", "fert_beats_filtered_bc_by_3", "fert_grows_with_fleet"}
    fert_rounds = [r["rounds"] for r in result["runs"] if r["method"] == "fert"]
    assert all(len(rounds) == plan.rounds for rounds in fert_rounds)
