"""The camera study's report (benchmarks/camera_study.py): made-up studies, built by fleet_scaling's own
summary, judged by the committed criteria and stopping rule."""

from __future__ import annotations

import pytest

from benchmarks import camera_study as cs
from benchmarks import fleet_scaling as fs
from components.config import load_settings

ROBOTS, TRIALS = 16, 12


def _score(rate: float, seed: int) -> fs.Score:
    """``rate`` of 192 trials, spread over 16 test robots (the first robots take the failures)."""
    failures = round((1 - rate) * ROBOTS * TRIALS)
    by_robot = {f"test-{r:04d}": TRIALS - min(TRIALS, max(0, failures - r * TRIALS)) for r in range(ROBOTS)}
    successes = sum(by_robot.values())
    return fs.Score(successes, ROBOTS * TRIALS, successes, {"grasp": ROBOTS * TRIALS - successes}, by_robot, TRIALS,
                    1000 + seed)


def _study(rates: dict[tuple[str, int], list[float]], initial: list[float]) -> dict:
    plan = fs.Plan("pickplace", len(initial), 6, (32, 96), 200, 600, ROBOTS, TRIALS, False)
    seeds = list(range(len(initial)))
    rows = [fs.RunRow(s, m, n, _score(r[s], s), [{"train_seconds": 10.0 + s,
                                                   "stored_bytes": {"episodes": 1000 * (s + 1), "store": 10}}])
            for (m, n), r in rates.items() for s in seeds]
    starts = [_score(r, s) for s, r in zip(seeds, initial)]
    result = fs.summarize_run(plan, load_settings(), rows, starts, 1.0, initial_seeds=seeds)
    return {**result, "seeds_reported": seeds}


def _state() -> dict:
    return _study({("fert", 96): [0.98, 0.99, 0.985, 0.99, 0.975]}, [0.75, 0.76, 0.74, 0.77, 0.75])


def test_clear_gains_over_four_seeds_meet_every_paired_criterion():
    camera = _study({("bc", 32): [0.70, 0.72, 0.71, 0.69],
                     ("filtered_bc", 32): [0.80, 0.82, 0.81, 0.79], ("fert", 32): [0.84, 0.86, 0.85, 0.84],
                     ("filtered_bc", 96): [0.85, 0.86, 0.84, 0.85], ("fert", 96): [0.92, 0.93, 0.92, 0.91]},
                    [0.70, 0.71, 0.69, 0.72])
    result = cs.judge(camera, _state())
    assert result["stopping_rule"]["done"]  # 4 seeds, and a gap this steady needs fewer
    assert {name: c["holds"] for name, c in result["criteria"].items()} == dict.fromkeys(cs.PAIRED, True)
    gap = result["criteria"]["fert_beats_filtered_bc"]
    assert gap["mean_points"] == pytest.approx(100 * (0.92 + 0.93 + 0.92 + 0.91 - 0.85 - 0.86 - 0.84 - 0.85) / 4, abs=0.3)
    versus = result["cameras_vs_state"]
    assert versus["camera_minus_state_points"]["mean"] < 0 and versus["camera_minus_state_points"]["seeds"] == [4, 5]
    assert versus["sides"]["camera"]["stored_bytes_after_last_round"] == {"episodes": 2500, "store": 10}
    assert versus["sides"]["camera"]["train_seconds_per_round"] == pytest.approx(11.5)


def test_a_noisy_gap_keeps_the_study_running_and_is_not_judged():
    camera = _study({("bc", 32): [0.70, 0.72], ("filtered_bc", 32): [0.80, 0.82], ("fert", 32): [0.84, 0.80],
                     ("filtered_bc", 96): [0.85, 0.90], ("fert", 96): [0.90, 0.86]}, [0.70, 0.71])
    result = cs.judge(camera, _state())
    assert not result["stopping_rule"]["done"]  # two seeds: fewer than the first four
    assert all(c["judged"] is False and c["holds"] is None for c in result["criteria"].values())
