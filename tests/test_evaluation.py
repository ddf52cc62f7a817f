"""Held-out evaluation: trials per task, Wilson CIs, failure breakdown by stage and robot."""

from __future__ import annotations

import numpy as np
import pytest

from components.config import EvaluationConfig, SimConfig
from components.episodes.record import Episode
from components.evaluation.heldout import evaluate_heldout, summarize
from components.sim.expert import ScriptedExpert

SIM = SimConfig()


def _ep(robot: str, success: bool, stage: int) -> Episode:
    z = np.zeros((3, 2), np.float32)
    return Episode("e", robot, "pick-place", z, z, np.zeros(3, np.float32), success, stage_reached=stage)


def test_summary_breaks_failures_down_by_stage_and_robot():
    episodes = [_ep("a", True, 3)] * 6 + [_ep("a", False, 1)] * 2 + [_ep("b", False, 2)] * 3 + [_ep("b", True, 3)]
    report = summarize(episodes, SIM, 0.95, "v1")
    assert report.overall.successes == 7 and report.overall.trials == 12
    assert report.failures_by_stage == {"grasp": 2, "carry": 3}
    assert report.failures_by_robot == {"a": {"grasp": 2}, "b": {"carry": 3}}
    assert report.by_robot["a"].rate == pytest.approx(0.75)
    assert report.overall.low < 7 / 12 < report.overall.high
    assert report.by_task["pick-place"].trials == 12
    assert report.to_dict()["failures_by_robot"]["b"] == {"carry": 3}
    unknown = summarize([_ep("c", False, -1)], SIM, 0.95, "v1")  # read back from disk: no stage
    assert unknown.failures_by_stage == {"unknown": 1}
    with pytest.raises(ValueError, match="no episodes"):
        summarize([], SIM, 0.95, "v1")


def test_every_task_gets_at_least_trials_per_task():
    cfg = EvaluationConfig(trials_per_task=120, trials_per_robot=1)
    assert cfg.trials_for(16) == 8 and cfg.trials_for(7) == 18 and cfg.trials_for(200) == 1
    assert EvaluationConfig(trials_per_task=10, trials_per_robot=4).trials_for(2) == 5
    with pytest.raises(ValueError, match="held-out robot"):
        cfg.trials_for(0)
    report = evaluate_heldout(
        ScriptedExpert(), ["heldout-0000", "heldout-0001", "heldout-0002"], SIM,
        EvaluationConfig(trials_per_task=10, trials_per_robot=1), seed=0, policy_version="expert",
    )
    assert report.overall.trials == 12 and report.trials_per_robot == 4
    assert report.overall.rate > 0.9  # the scripted expert solves the task on held-out robots
    assert set(report.by_robot) == {"heldout-0000", "heldout-0001", "heldout-0002"}


def test_difference_interval_matches_newcombes_published_examples():
    from components.evaluation.intervals import difference_interval, wilson_interval

    # Newcombe (1998), Statistics in Medicine 17:873, Table II, method 10 (hybrid score)
    for a, b, low, high in (((56, 70), (48, 80), 0.0524, 0.3339), ((9, 10), (3, 10), 0.1705, 0.8090),
                            ((10, 10), (0, 20), 0.6791, 1.0)):
        d = difference_interval(wilson_interval(*a), wilson_interval(*b))
        assert (round(d.low, 4), round(d.high, 4)) == (low, high)
        assert d.low <= d.value <= d.high
    with pytest.raises(ValueError, match="same confidence"):
        difference_interval(wilson_interval(1, 2, 0.95), wilson_interval(1, 2, 0.9))
