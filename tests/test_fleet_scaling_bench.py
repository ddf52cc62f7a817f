"""benchmarks/fleet_scaling.py: the fine-tuning budget rule and a tiny end-to-end run of the study."""

from __future__ import annotations

import json
from dataclasses import replace

import numpy as np
import pytest
import torch

from benchmarks import fleet_scaling as fs
from components.config import load_settings
from components.training.imitation import TrainingSet


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
                   heldout_robots=2, trials_per_robot=2, init_rounds=1)
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
    gap, low, high = result["targets"]["fert_minus_filtered_bc_ci_points"]
    assert gap == pytest.approx(result["targets"]["fert_minus_filtered_bc_points"]) and low <= gap <= high
    assert list(result["targets"]["fert_growth_steps_ci_points"]) == ["1->2"]
    fert_rounds = [r["rounds"] for r in result["runs"] if r["method"] == "fert"]
    assert all(len(rounds) == plan.rounds for rounds in fert_rounds)
    for run in result["runs"]:  # validation selection: the kept policy's score never goes down
        kept = [r["validation_kept"] for r in run["rounds"]]
        assert kept == sorted(kept), run["method"]


def test_seeds_run_in_worker_processes_give_the_same_study(tmp_path, monkeypatch):
    monkeypatch.setattr(fs, "RESULTS", tmp_path)
    threads = torch.get_num_threads()
    plan = replace(fs.QUICK["pickplace"], seeds=2, rounds=1, fleet_sizes=(2,), steps_per_robot=60, finetune_steps=10,
                   heldout_robots=2, trials_per_robot=2, validation_robots=2, validation_trials=2, methods=("fert",))
    try:
        alone = fs.run(plan, "alone")
        pooled = fs.run(plan, "pooled", workers=2)
    finally:
        torch.set_num_threads(threads)

    def figures(result):
        return result["initial"], result["results"], [
            {k: v for k, v in run.items() if k != "seconds"} | {"rounds": [
                {k: v for k, v in r.items() if not k.endswith("seconds")} for r in run["rounds"]]}
            for run in result["runs"]]

    assert [r["seed"] for r in pooled["runs"]] == [0, 0, 1, 1]  # seed order kept: bc, fert per seed
    assert figures(pooled) == figures(alone)


def test_a_round_keeps_the_fine_tuned_policy_only_if_validation_says_it_is_not_worse():
    torch.set_num_threads(1)
    settings = load_settings()
    plan = replace(fs.QUICK["pickplace"], finetune_steps=40, validation_robots=4, validation_trials=3)
    demos = fs.run_episodes(fs.make_expert(settings.sim), settings.fleet.robot_ids(4), settings.sim, 30, 0, fs.DEMO_VERSION)
    demo_set = TrainingSet(np.concatenate([e.states for e in demos]), np.concatenate([e.actions for e in demos]))
    champion = fs.train_imitation(demo_set, settings.policy, settings.train, seed=0, device="cpu").policy
    before = {k: v.clone() for k, v in champion.state_dict().items()}
    score = fs.validate(settings, plan, champion, seed=0)
    assert score > 0.3  # a policy worth protecting

    # labels scrambled across frames: the fine-tuned copy is worse, so the champion stays
    rng = np.random.default_rng(0)
    scrambled = replace(demo_set, actions=demo_set.actions[rng.permutation(len(demo_set.actions))])
    kept, kept_score, info = fs.finetune_round(settings, plan, scrambled, champion, score, seed=0, round_seed=1)
    assert not info["accepted"] and info["validation"] < score
    assert kept is champion and kept_score == score
    assert all(torch.equal(before[k], v) for k, v in champion.state_dict().items())  # never fine-tuned in place

    # fine-tuned on the demos again it is not worse than a bar it clears, so it replaces the champion
    kept, kept_score, info = fs.finetune_round(settings, plan, demo_set, champion, 0.0, seed=0, round_seed=1)
    assert info["accepted"] and kept is not champion and kept_score == info["validation"]

    # without validation robots every round is kept (nothing to compare with)
    unvalidated = replace(plan, validation_robots=0)
    assert np.isnan(fs.validate(settings, unvalidated, champion, seed=0))
    kept, _, info = fs.finetune_round(settings, unvalidated, scrambled, champion, float("nan"), seed=0, round_seed=1)
    assert kept is not champion and "accepted" not in info
