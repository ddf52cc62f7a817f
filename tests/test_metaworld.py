"""Meta-World pick-place-v3 adapter: the fleet env contract, per-robot quirks, the bundled expert."""

from __future__ import annotations

import numpy as np
import pytest

from components.config import SimConfig
from components.sim.collect import collect, run_episodes
from components.sim.factory import action_dim, make_env, make_expert, make_exploration, make_thresholded, observation_dim
from components.sim.metaworld import GRIPPER_ACTION, OBS_DIM

CFG = SimConfig(name="metaworld", task="pick-place-v3", max_steps=80)
ROBOTS = ["robot-0000", "heldout-0003"]


def test_bundled_expert_solves_pick_place_on_different_robots():
    episodes = run_episodes(make_expert(CFG), ROBOTS, CFG, episodes_per_robot=1, seed=0, policy_version="expert")
    assert [e.robot_id for e in episodes] == ROBOTS
    for episode in episodes:
        assert episode.success and episode.stage_reached == 3  # place
        assert episode.states.shape == (episode.length, OBS_DIM) and episode.actions.shape[1] == 4
        assert set(np.unique(episode.actions[:, GRIPPER_ACTION])) <= {-1.0, 1.0}
        stages = episode.extras["stage"]
        assert stages[0] == 0 and stages[-1] == 3 and (np.diff(stages[stages >= 2]) >= -1).all()
    assert observation_dim(CFG) == OBS_DIM and action_dim(CFG) == 4


def test_robots_differ_and_seeds_reproduce():
    env = make_env(CFG, ROBOTS, seed=3)
    obs_a, _ = env.reset()
    again, _ = make_env(CFG, ROBOTS, seed=3).reset()
    np.testing.assert_array_equal(obs_a, again)  # same seed -> identical layouts and sensor noise
    other, _ = make_env(CFG, ROBOTS, seed=4).reset()
    assert not np.array_equal(obs_a[:, 4:7], other[:, 4:7])  # another seed, other object placements
    low = [env._regions[i][0] for i in range(2)]
    assert not np.allclose(low[0], low[1])  # each robot places objects in its own region
    assert env.profiles[0].action_gain.tolist() != env.profiles[1].action_gain.tolist()


def test_failures_truncate_and_exploration_samples_the_gripper():
    still = lambda obs: np.zeros((obs.shape[0], 4), np.float32)  # noqa: E731 - never moves: always fails
    result = collect(still, ROBOTS[:1], CFG, steps_per_robot=CFG.max_steps, seed=0, policy_version="v1")
    (episode,) = result.episodes
    assert not episode.success and episode.length == CFG.max_steps and episode.stage_reached == 0
    half_open = lambda obs: np.full((obs.shape[0], 4), 0.0, np.float32)  # noqa: E731
    sampled = make_exploration(CFG, half_open, seed=0)(np.zeros((2000, OBS_DIM), np.float32))
    assert 0.4 < (sampled[:, GRIPPER_ACTION] > 0).mean() < 0.6
    assert (make_thresholded(CFG, half_open)(np.zeros((3, OBS_DIM), np.float32))[:, GRIPPER_ACTION] == -1).all()
    with pytest.raises(ValueError, match="sim.task"):
        make_env(SimConfig(name="metaworld"), ROBOTS, seed=0)


def test_layouts_keep_object_and_goal_apart():
    # Meta-World loops forever on a frozen layout with object and goal closer than 0.15 in xy
    env = make_env(CFG, [f"robot-{i:04d}" for i in range(12)], seed=0)
    for i in range(env.num_envs):
        for _ in range(50):
            vec = env._placement(i)
            assert np.linalg.norm(vec[0:2] - vec[3:5]) >= 0.15
            assert (vec >= env._low).all() and (vec <= env._high).all()
    env.close()
