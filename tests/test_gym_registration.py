"""The simulators under gymnasium ids: gym.make / gym.make_vec as RL users start, and gymnasium's
own env checker on the single-robot env."""

from __future__ import annotations

import warnings

import gymnasium as gym
import numpy as np
import pytest
from gymnasium.utils.env_checker import check_env

import components.sim  # noqa: F401 - registers the ids
from components.config import FleetConfig
from components.sim.expert import ScriptedExpert
from components.sim.factory import make_env
from components.sim.metaworld import MetaWorldVecEnv
from components.sim.pickplace import PickPlaceVecEnv
from components.sim.registration import (
    METAWORLD_ID,
    PICKPLACE_ID,
    OneRobotEnv,
    _sim_config,
    metaworld_available,
)

SHORT = 25  # max_steps: short episodes, so a few hundred steps cross several episode ends


def test_gymnasium_env_checker_passes_on_the_single_robot_env():
    env = gym.make(PICKPLACE_ID, robot_id="robot-0002")
    assert isinstance(env.unwrapped, OneRobotEnv) and env.unwrapped.robot_id == "robot-0002"
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the checker reports most problems as warnings
        check_env(env.unwrapped)


def test_make_vec_is_a_fleet_with_default_or_given_robot_ids():
    fleet = gym.make_vec(PICKPLACE_ID, num_envs=8)
    assert isinstance(fleet, PickPlaceVecEnv)
    assert fleet.robot_ids == FleetConfig().robot_ids(8)
    obs, _ = fleet.reset(seed=0)
    assert obs.shape == (8, 11) and obs.dtype == np.float32

    picked = gym.make_vec(PICKPLACE_ID, num_envs=2, robot_ids=["heldout-0001", "robot-0005"], max_steps=SHORT)
    assert picked.robot_ids == ["heldout-0001", "robot-0005"] and picked.cfg.max_steps == SHORT
    with pytest.raises(ValueError, match="num_envs=len\\(robot_ids\\)"):
        gym.make_vec(PICKPLACE_ID, num_envs=3, robot_ids=["robot-0000"])


def test_single_robot_env_replays_that_robot_of_the_fleet_env_across_episode_ends():
    """No autoreset in the single env: its terminal observation is the fleet env's final_obs and
    reset() continues with the episode the fleet env started, so both see the same episodes."""
    robot, seed, steps = "robot-0003", 7, 200
    expert = ScriptedExpert()
    single = gym.make(PICKPLACE_ID, robot_id=robot, seed=seed, max_steps=SHORT).unwrapped
    fleet = make_env(_sim_config({}, {"max_steps": SHORT}), [robot], seed)

    obs, _ = single.reset()
    fleet_obs, _ = fleet.reset()
    ends = 0
    for _ in range(steps):
        np.testing.assert_array_equal(obs, fleet_obs[0])
        action = expert(obs[None])[0]
        obs, reward, terminated, truncated, info = single.step(action)
        fleet_obs, fleet_reward, _, _, fleet_info = fleet.step(action[None])
        assert reward == fleet_reward[0] and info["success"] == fleet_info["success"][0]
        if terminated or truncated:
            ends += 1
            np.testing.assert_array_equal(obs, fleet_info["final_obs"][0])
            obs, _ = single.reset()
    assert ends >= 3


@pytest.mark.skipif(not metaworld_available(), reason="metaworld is not installed")
def test_metaworld_adapter_is_registered_with_per_robot_ids():
    fleet = gym.make_vec(METAWORLD_ID, num_envs=2, robot_ids=["robot-0000", "heldout-0003"], max_steps=SHORT)
    assert isinstance(fleet, MetaWorldVecEnv) and fleet.cfg.task == "pick-place-v3"
    obs, _ = fleet.reset(seed=0)
    assert obs.shape == (2, 39)
    single = gym.make(METAWORLD_ID, max_steps=SHORT)
    first, _ = single.reset(seed=0)
    assert first in single.observation_space
    assert single.step(single.action_space.sample())[0].shape == (39,)
