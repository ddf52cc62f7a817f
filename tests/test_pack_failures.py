"""benchmarks/pack_failures.py: failed trials read against the demonstrator, per robot."""

from __future__ import annotations

import numpy as np

from benchmarks import pack_failures as pf
from benchmarks.policy_ceiling import QUICK
from components.sim.pack import STAGES


def test_a_split_is_the_first_run_of_disagreements_not_a_flicker():
    expert = np.array([1, 1, -1, 1, 1, 1, 1, 1, 1, 1], dtype=float)
    executed = np.array([1, 1, 1, 1, -1, -1, -1, -1, -1, 1], dtype=float)  # a 1-step flicker at 2, a run from 4
    assert pf.jaw_split(executed, expert) == 4
    assert pf.jaw_split(expert, expert) == -1


def test_a_quick_cell_accounts_for_every_trial_and_robot():
    result = pf.run("mlp", 0, QUICK, 20)
    failed = result["trials"] - result["successes"]
    assert result["trials"] == QUICK.robots * QUICK.trials and len(result["failed_trials"]) == failed
    assert sum(r["failures"] for r in result["per_robot"]) == failed
    assert {r["robot"] for r in result["per_robot"]} == {f"tuning-{i:04d}" for i in range(QUICK.robots)}
    assert all(f["reached"] in STAGES for f in result["failed_trials"])
    split = [f for f in result["failed_trials"] if f["jaw_split_step"] >= 0]
    assert result["jaw_splits"]["failures"] == len(split) and all(f["stage"] in STAGES for f in split)
    assert result["nearest_quarter"]["failures"] <= failed
