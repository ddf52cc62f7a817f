"""The pack task: stages, success, push physics, determinism, one robot vs the fleet, the expert,
and the product's collection path with ``sim.name: pack``."""

from __future__ import annotations

import warnings

import gymnasium as gym
import numpy as np
import pyarrow.parquet as pq
import pytest
from gymnasium.utils.env_checker import check_env

from components.config import SimConfig
from components.episodes.schema import table_to_episode
from components.evaluation.heldout import summarize
from components.pipeline.collect import collect_expert_demos
from components.sim import (
    PACK_ID,
    PackExpert,
    collect,
    make_env,
    observation_dim,
    run_episodes,
)
from components.sim import pack as pk
from components.sim.factory import action_dim, make_expert, make_exploration, stages
from components.sim.pickplace import OBJECT_WIDTH
from components.sim.registration import OneRobotEnv, _sim_config
from tests.conftest import small_settings

CFG = SimConfig(name="pack", task="pack")
ROBOTS = [f"robot-{i:04d}" for i in range(4)]
EXPERT = PackExpert(CFG.pack)
HOLD, OPEN = np.array([[0.0, 0.0, 1.0]], np.float32), np.array([[0.0, 0.0, -1.0]], np.float32)


def _random_policy(seed: int):
    rng = np.random.default_rng(seed)
    return lambda obs: rng.uniform(-1, 1, size=(obs.shape[0], 3)).astype(np.float32)


def _one_robot(seed: int = 0) -> pk.PackVecEnv:
    env = make_env(CFG, ["robot-0000"], seed)
    env.reset()
    return env


# ------------------------------------------------------------------------------------- contract
def test_factory_spaces_and_stage_names():
    env = make_env(CFG, ROBOTS, seed=0)
    assert isinstance(env, pk.PackVecEnv)
    assert observation_dim(CFG) == pk.OBS_DIM == len(pk.OBS_FIELDS) == 17 and action_dim(CFG) == 3
    assert env.single_observation_space.shape == (17,) and env.single_action_space.shape == (3,)
    assert stages(CFG) == pk.STAGES and len(pk.STAGES) >= 6
    obs, info = env.reset()
    assert obs.shape == (4, 17) and obs.dtype == np.float32 and obs in env.observation_space
    assert np.all(info["stage"] <= pk.GRASP)  # nothing is held, nothing is in the container yet
    assert np.all(np.linalg.norm(env.container - env.goal, axis=1) >= CFG.pack.push_distance_min - 1e-9)
    with pytest.raises(ValueError, match="sim.task: pack"):  # pack episodes are never labelled pick-place
        make_env(SimConfig(name="pack"), ROBOTS, seed=0)


# ------------------------------------------------------------------------------------- stages
def test_expert_stages_are_monotone_and_reach_every_stage():
    """Stages are first reached in order (a re-approach after a lost push may step back, as a missed
    grasp does in pick-place), and every stage is reached."""
    episodes = run_episodes(EXPERT, ROBOTS, CFG, 6, seed=2, policy_version="expert")
    for e in (e for e in episodes if e.success):
        stage = e.extras["stage"].astype(int)
        first = [int(np.argmax(stage >= k)) for k in range(pk.CARRY, pk.DELIVER + 1)]
        assert set(range(pk.CARRY, pk.DELIVER + 1)) <= set(stage.tolist())  # nothing skipped ...
        assert first == sorted(first) and first[-1] == len(stage) - 1  # ... in order, delivered last
        assert stage[0] in (pk.REACH, pk.GRASP) and e.stage_reached == pk.DELIVER == stage.max()
    assert any(np.all(np.diff(e.extras["stage"].astype(int)) >= 0) for e in episodes if e.success)
    assert set().union(*(set(e.extras["stage"].tolist()) for e in episodes)) == set(range(len(pk.STAGES)))

    env = make_env(CFG, ROBOTS, seed=4)  # info["stage_reached"]: the running max of info["stage"], per episode
    obs, _ = env.reset()
    running = np.zeros(len(ROBOTS), dtype=int)
    for _ in range(200):
        obs, _, term, trunc, info = env.step(EXPERT(obs))
        running = np.maximum(running, info["stage"])
        assert np.array_equal(info["stage_reached"], running)
        running[term | trunc] = 0


def test_success_only_when_every_stage_is_done():
    expert = run_episodes(EXPERT, ROBOTS, CFG, 4, seed=1, policy_version="expert")
    random = run_episodes(_random_policy(0), ROBOTS, CFG, 4, seed=1, policy_version="random")
    for e in expert + random:
        assert e.success == (e.stage_reached == pk.DELIVER == e.extras["stage"][-1])
        assert e.success or e.length == CFG.max_steps
    assert any(e.success for e in expert) and not all(e.success for e in random)


def test_delivered_needs_the_object_in_the_container_and_the_container_on_its_goal():
    env = _one_robot()
    env.gripper[0] = env.container[0] + [0.2, 0.2]
    env.container[0] = env.goal[0]  # an empty container on its goal is not a success
    _, reward, term, _, info = env.step(OPEN)
    assert not term[0] and reward[0] == 0.0 and info["stage"][0] in (pk.REACH, pk.GRASP)

    env = _one_robot()
    env.gripper[0] = env.object[0] = env.goal[0]  # holding the object over the goal, no container: carry
    env.opening[0], env.holding[0] = OBJECT_WIDTH, True
    _, _, term, _, info = env.step(HOLD)
    assert not term[0] and info["stage"][0] == pk.CARRY

    env = _one_robot()
    env.gripper[0] = env.container[0] + [0.2, 0.2]
    env.object[0] = env.container[0]  # in the container, off the goal: approach
    _, _, term, _, info = env.step(OPEN)
    assert not term[0] and info["stage"][0] == pk.APPROACH and info["in_container"][0]
    env.container[0] = env.object[0] = env.goal[0]  # ... and on the goal: delivered
    _, reward, term, _, info = env.step(OPEN)
    assert term[0] and reward[0] == 1.0 and info["stage"][0] == pk.DELIVER and info["success"][0]


# ------------------------------------------------------------------------------------- physics
def test_a_fist_pushes_the_container_with_the_object_in_it_and_an_open_jaw_passes_over():
    env = _one_robot()
    env._noise[:] = 0.0
    env.pack = env.pack.model_copy(update={"push_scatter": 0.0})
    env._slip[:] = 0.0
    env.container[0] = [0.5, 0.5]
    env.object[0] = [0.5, 0.5]  # resting in the container
    env.gripper[0] = [0.5 - env.pack.push_radius - 0.01, 0.5]  # just left of it
    env.opening[0] = 0.0  # a fist
    env._gain[:], env._bias[:] = 1.0, 0.0
    env.step(np.array([[1.0, 0.0, 1.0]], np.float32))
    assert env.container[0, 0] > 0.5 and np.isclose(env.container[0, 1], 0.5)
    assert np.allclose(env.object[0], env.container[0])  # the object rode along
    assert np.isclose(np.linalg.norm(env.container[0] - env.gripper[0]), env.pack.push_radius)

    env.opening[0] = 1.0  # open: the gripper passes over the rim
    before = env.container.copy()
    for _ in range(3):
        env.step(np.array([[1.0, 0.0, -1.0]], np.float32))
    assert np.array_equal(env.container, before) and env.gripper[0, 0] > before[0, 0]


def test_a_spill_leaves_the_object_beside_the_container_and_the_expert_recovers():
    env = _one_robot(seed=3)
    env.container[0] = [0.5, 0.4]
    env.object[0] = [0.5, 0.4]
    env.goal[0] = [0.5, 0.7]
    env.gripper[0] = [0.5, 0.4 - env.pack.push_radius - 0.01]
    env.opening[0] = 0.0
    env._slip[:] = 100.0  # this robot spills on every push step
    env.step(np.array([[0.0, 1.0, 1.0]], np.float32))
    assert not env.in_container()[0]
    assert np.linalg.norm(env.object[0] - env.container[0]) > env.pack.container_radius
    env._slip[:] = 0.0
    obs = env._observe(np.zeros((1, pk._SENSED)))
    stages_seen = []
    for _ in range(CFG.max_steps - 2):
        obs, _, term, trunc, info = env.step(EXPERT(obs))
        stages_seen.append(int(info["stage"][0]))
        if term[0] or trunc[0]:
            break
    assert term[0], "the expert should pick the object up, put it back and push on"
    assert pk.INSERT in stages_seen and stages_seen[-1] == pk.DELIVER


# ------------------------------------------------------------------------------------- determinism
def test_same_seed_is_bit_identical_and_seeds_differ():
    def rollout(seed: int) -> list[np.ndarray]:
        env, policy = make_env(CFG, ROBOTS, seed), _random_policy(1)
        obs, _ = env.reset()
        out = [obs]
        for t in range(300):
            obs, reward, term, trunc, info = env.step(policy(obs) if t % 2 else EXPERT(obs))
            out += [obs, reward, term, trunc, info["stage"]]
        return out

    a, b, c = rollout(7), rollout(7), rollout(8)
    assert all(np.array_equal(x, y) for x, y in zip(a, b, strict=True))
    assert not np.array_equal(a[0], c[0])
    x = collect(EXPERT, ROBOTS, CFG, 120, seed=3, policy_version="v1")
    y = collect(EXPERT, ROBOTS, CFG, 120, seed=3, policy_version="v1")
    assert [e.episode_id for e in x.episodes] == [e.episode_id for e in y.episodes]
    assert all(np.array_equal(e.states, f.states) for e, f in zip(x.episodes, y.episodes, strict=True))


def test_one_robot_env_equals_that_robot_of_the_fleet():
    """A robot's episodes do not depend on the batch, and ``gym.make`` replays the fleet's robot."""
    fleet = run_episodes(EXPERT, ROBOTS, CFG, 3, seed=5, policy_version="e")
    for robot in (ROBOTS[0], ROBOTS[2]):
        alone = run_episodes(EXPERT, [robot], CFG, 3, seed=5, policy_version="e")
        mine = [e for e in fleet if e.robot_id == robot]
        for e, f in zip(mine, alone, strict=True):
            assert np.array_equal(e.states, f.states) and np.array_equal(e.actions, f.actions)
            assert e.success == f.success and e.stage_reached == f.stage_reached

    robot, seed, short = "robot-0003", 7, 40
    single = gym.make(PACK_ID, robot_id=robot, seed=seed, max_steps=short).unwrapped
    assert isinstance(single, OneRobotEnv) and isinstance(single.fleet, pk.PackVecEnv)
    fleet_env = make_env(_sim_config({"name": "pack", "task": "pack"}, {"max_steps": short}), [robot], seed)
    obs, _ = single.reset()
    fleet_obs, _ = fleet_env.reset()
    ends = 0
    for _ in range(150):
        assert np.array_equal(obs, fleet_obs[0])
        action = EXPERT(obs[None])
        obs, _, term, trunc, info = single.step(action[0])
        fleet_obs, _, fterm, ftrunc, finfo = fleet_env.step(action)
        assert (term, trunc, info["stage"]) == (bool(fterm[0]), bool(ftrunc[0]), int(finfo["stage"][0]))
        if term or trunc:
            ends += 1
            assert np.array_equal(obs, finfo["final_obs"][0])
            obs, _ = single.reset()
    assert ends >= 2
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        check_env(gym.make(PACK_ID, robot_id="robot-0001").unwrapped)
    assert isinstance(gym.make_vec(PACK_ID, num_envs=3), pk.PackVecEnv)


# ------------------------------------------------------------------------------------- expert
def test_expert_solves_the_task_on_test_robots():
    robots = [f"heldout-{i:04d}" for i in range(12)]
    episodes = run_episodes(make_expert(CFG), robots, CFG, 10, seed=11, policy_version="expert")
    success = np.mean([e.success for e in episodes])
    assert success >= 0.95, f"expert success {success:.3f}"


# ------------------------------------------------------------------------------------- product path
def test_the_product_collects_pack_episodes(tmp_path):
    settings = small_settings(tmp_path, sim=CFG)
    demos = collect_expert_demos(settings, tmp_path / "expert")
    assert demos.episodes == 12 and demos.successes >= 11 and len(demos.files) == 12
    episode = table_to_episode(pq.read_table(demos.files[0]))
    assert episode.task == "pack" and episode.states.shape[1] == 17 and episode.actions.shape[1] == 3

    explored = collect(make_exploration(CFG, EXPERT, seed=0), ROBOTS[:2], CFG, 150, seed=0, policy_version="v1")
    assert explored.episodes and all(e.states.shape[1] == 17 for e in explored.episodes)
    report = summarize(run_episodes(_random_policy(2), ROBOTS[:2], CFG, 2, 0, "random"), CFG, 0.95, "random")
    assert set(report.failures_by_stage) <= set(pk.STAGES)  # failures are named by the pack stages
    assert sum(report.failures_by_stage.values()) == report.overall.trials - report.overall.successes
