"""The built-in simulated fleet: gymnasium contract, determinism, robot quirks, expert, collection."""

from __future__ import annotations

import uuid

import numpy as np
import pytest
from gymnasium.vector import AutoresetMode, VectorEnv

from components.config import SimConfig
from components.sim import (
    STAGES,
    MotionNoise,
    RobotProfile,
    SampledGripper,
    ScriptedExpert,
    ThresholdedGripper,
    action_dim,
    collect,
    make_env,
    observation_dim,
    run_episodes,
    stable_robot_hash,
)
from components.sim import pickplace as pp
from components.sim.profile import OBJECT_CENTER

CFG = SimConfig()
ROBOTS = [f"robot-{i:04d}" for i in range(4)]


def _random_policy(seed: int):
    rng = np.random.default_rng(seed)
    return lambda obs: rng.uniform(-1, 1, size=(obs.shape[0], 3)).astype(np.float32)


def _rollout(env, policy, steps: int) -> list[np.ndarray]:
    obs, _ = env.reset()
    out = [obs]
    for _ in range(steps):
        obs, reward, term, trunc, _ = env.step(policy(obs))
        out += [obs, reward, term, trunc]
    return out


# ------------------------------------------------------------------------------------- gymnasium API
def test_spaces_and_shapes():
    env = make_env(CFG, ROBOTS, seed=0)
    assert isinstance(env, VectorEnv)
    assert env.metadata["autoreset_mode"] == AutoresetMode.SAME_STEP
    assert env.num_envs == len(ROBOTS)
    assert env.single_observation_space.shape == (observation_dim(CFG),) == (len(pp.OBS_FIELDS),)
    assert env.single_action_space.shape == (action_dim(CFG),) == (3,)
    assert env.single_observation_space.dtype == np.float32
    assert np.all(env.single_action_space.low == -1) and np.all(env.single_action_space.high == 1)
    assert env.observation_space.shape == (4, observation_dim(CFG))
    assert env.action_space.shape == (4, 3)

    obs, info = env.reset()
    assert obs.dtype == np.float32 and obs in env.observation_space
    assert set(info) >= {"stage", "stage_reached", "success"}
    obs, reward, term, trunc, info = env.step(env.action_space.sample())
    assert obs.shape == (4, observation_dim(CFG)) and obs.dtype == np.float32
    assert obs in env.observation_space
    assert reward.shape == term.shape == trunc.shape == (4,)
    assert term.dtype == trunc.dtype == np.bool_
    assert info["stage"].shape == (4,) and info["final_obs"].shape == obs.shape
    assert np.all((0 <= info["stage"]) & (info["stage"] < len(STAGES)))


def test_bad_inputs_raise_clear_errors():
    with pytest.raises(ValueError, match="duplicates"):
        make_env(CFG, ["robot-0000", "robot-0000"], seed=0)
    with pytest.raises(ValueError, match="empty"):
        make_env(CFG, [], seed=0)
    env = make_env(CFG, ROBOTS, seed=0)
    with pytest.raises(RuntimeError, match="reset"):
        env.step(np.zeros((4, 3), np.float32))
    env.reset()
    with pytest.raises(ValueError, match="shape"):
        env.step(np.zeros((3, 3), np.float32))
    with pytest.raises(ValueError, match="sim.task"):  # Meta-World is pick-place-v3 only (tests/test_metaworld.py)
        make_env(SimConfig(name="metaworld"), ROBOTS, seed=0)
    with pytest.raises(ValueError, match="policy returned"):
        collect(lambda o: np.zeros((o.shape[0], 2)), ROBOTS, CFG, 5, 0, "v")


# ------------------------------------------------------------------------------------- determinism
def test_same_seed_is_bit_identical_and_seeds_differ():
    a = _rollout(make_env(CFG, ROBOTS, seed=7), _random_policy(1), 300)
    b = _rollout(make_env(CFG, ROBOTS, seed=7), _random_policy(1), 300)
    c = _rollout(make_env(CFG, ROBOTS, seed=8), _random_policy(1), 300)
    assert all(np.array_equal(x, y) for x, y in zip(a, b, strict=True))
    assert not np.array_equal(a[0], c[0])

    env = make_env(CFG, ROBOTS, seed=7)
    first, _ = env.reset()
    env.step(env.action_space.sample())
    again, _ = env.reset(seed=7)  # reseeding restarts the same episode sequence
    assert np.array_equal(first, again)


def test_collect_is_deterministic():
    x = collect(ScriptedExpert(), ROBOTS, CFG, 80, seed=3, policy_version="v1")
    y = collect(ScriptedExpert(), ROBOTS, CFG, 80, seed=3, policy_version="v1")
    assert [e.episode_id for e in x.episodes] == [e.episode_id for e in y.episodes]
    for e, f in zip(x.episodes, y.episodes, strict=True):
        assert np.array_equal(e.states, f.states) and np.array_equal(e.actions, f.actions)
        assert e.success == f.success and e.robot_id == f.robot_id


# ------------------------------------------------------------------------------------- robot quirks
def test_profiles_are_persistent_and_differ_across_robots():
    # pinned: the id -> profile map must never change between processes or releases
    assert stable_robot_hash("robot-0000") == 996156254611399084
    p, q = RobotProfile.from_id("robot-0001", CFG), RobotProfile.from_id("robot-0001", CFG)
    assert np.array_equal(p.action_gain, q.action_gain) and p.obs_noise == q.obs_noise
    profiles = [RobotProfile.from_id(f"robot-{i:04d}", CFG) for i in range(16)]
    gains = np.stack([r.action_gain for r in profiles])
    centers = np.stack([r.object_center for r in profiles])
    assert len({tuple(g) for g in gains}) == 16 and len({tuple(c) for c in centers}) == 16
    assert np.all(np.abs(gains - 1) <= CFG.gain_spread)
    assert np.all(np.abs(np.stack([r.action_bias for r in profiles])) <= CFG.bias_spread)
    assert all(0 <= r.obs_noise <= CFG.obs_noise_max for r in profiles)
    assert np.all(np.abs(centers - np.asarray(OBJECT_CENTER)) <= CFG.placement_spread)
    # a wider spread stretches the same quirk rather than reshuffling robots
    wide = RobotProfile.from_id("robot-0001", SimConfig(gain_spread=0.3))
    assert np.allclose(wide.action_gain - 1, 2 * (p.action_gain - 1))


def test_population_seed_zero_is_the_original_fleet_and_others_draw_new_robots():
    # population 0 is the id alone: the original profiles, bit for bit (every committed figure stands)
    original = RobotProfile.from_id("heldout-0000", CFG)
    rng = np.random.default_rng([0x5EED_0F11, stable_robot_hash("heldout-0000")])
    unit = rng.uniform(-1.0, 1.0, size=8)
    assert np.array_equal(original.action_gain, 1.0 + CFG.gain_spread * unit[0:2])
    assert np.array_equal(original.object_center, np.asarray(OBJECT_CENTER) + CFG.placement_spread * unit[4:6])
    explicit = RobotProfile.from_id("heldout-0000", SimConfig(population_seed=0))
    assert np.array_equal(explicit.action_bias, original.action_bias) and explicit.slip_rate == original.slip_rate
    # another population: the same id is another robot, reproducibly, and populations differ from each other
    one, again, two = (RobotProfile.from_id("heldout-0000", SimConfig(population_seed=p)) for p in (1, 1, 2))
    assert np.array_equal(one.action_gain, again.action_gain) and one.grasp_miss == again.grasp_miss
    assert not np.array_equal(one.action_gain, original.action_gain)
    assert not np.array_equal(one.object_center, two.object_center)
    # the env picks the population up from its SimConfig
    env = make_env(SimConfig(population_seed=1), ["heldout-0000"], seed=0)
    assert np.array_equal(env.profiles[0].action_gain, one.action_gain)
    with pytest.raises(ValueError, match="population_seed"):
        SimConfig(population_seed=-1)


def test_robot_quirks_show_in_the_env_and_do_not_depend_on_the_batch():
    ids = [f"robot-{i:04d}" for i in range(8)]
    env = make_env(CFG, ids, seed=0)
    env.reset()
    env.gripper[:] = 0.5
    env.holding[:] = False
    env.step(np.tile(np.array([[1.0, 0.0, -1.0]], np.float32), (8, 1)))
    moved = env.gripper - 0.5
    expected = np.stack([(p.action_gain * [1, 0] + p.action_bias) * pp.MAX_DELTA for p in env.profiles])
    assert np.allclose(moved, expected) and len(set(np.round(moved[:, 0], 9))) == 8

    # robot-0003's episode layouts are its own, whoever else is in the fleet
    solo = make_env(CFG, ["robot-0003"], seed=5)
    mixed = make_env(CFG, ["robot-0009", "robot-0003"], seed=5)
    solo.reset(), mixed.reset()
    assert np.array_equal(solo.object[0], mixed.object[1]) and np.array_equal(solo.goal[0], mixed.goal[1])

    # placement distributions differ per robot
    eps = run_episodes(ScriptedExpert(), ["robot-0000", "robot-0001"], CFG, 20, 0, "expert")
    starts = {
        r: np.stack([e.states[0, 3:5] for e in eps if e.robot_id == r]).mean(0)
        for r in ("robot-0000", "robot-0001")
    }
    c0, c1 = (RobotProfile.from_id(r, CFG).object_center for r in ("robot-0000", "robot-0001"))
    assert np.linalg.norm(starts["robot-0000"] - c0) < np.linalg.norm(starts["robot-0000"] - c1)


# ------------------------------------------------------------------------------------- task + expert
def test_expert_solves_the_task_across_robots():
    robots = [f"heldout-{i:04d}" for i in range(12)]
    episodes = run_episodes(ScriptedExpert(), robots, CFG, 10, seed=11, policy_version="expert")
    success = np.mean([e.success for e in episodes])
    assert success >= 0.95, f"expert success {success:.3f}"


def test_stages_progress_reach_grasp_carry_place():
    episodes = run_episodes(ScriptedExpert(), ROBOTS, CFG, 5, seed=2, policy_version="expert")
    clean = [e for e in episodes if e.success and np.all(np.diff(e.extras["stage"].astype(int)) >= 0)]
    assert clean, "expected at least one clean expert episode"
    for e in clean:
        assert e.extras["stage"][0] in (pp.REACH, pp.GRASP)
        assert {pp.GRASP, pp.CARRY} <= set(e.extras["stage"].tolist())
        assert e.stage_reached == e.extras["stage"].max()
    assert any(e.stage_reached == STAGES.index("place") for e in clean)


def test_a_missed_grasp_is_recoverable():
    env = make_env(CFG, ["robot-0000"], seed=0)
    env.reset()
    env.gripper[0] = env.object[0] + [0.15, 0.0]  # far out of reach
    close_in_place = np.array([[0.0, 0.0, 1.0]], np.float32)
    for _ in range(2):
        env.step(close_in_place)
    assert env.opening[0] == 0.0 and not env.holding[0]  # jaw closed on nothing: a miss
    obs = env._observe(np.zeros((1, 6)))
    expert = ScriptedExpert()
    stages, done = [], False
    for _ in range(CFG.max_steps - 3):
        obs, _, term, trunc, info = env.step(expert(obs))
        stages.append(int(info["stage"][0]))
        if term[0] or trunc[0]:
            done = True
            break
    assert done and term[0], "the expert should re-open, re-approach and succeed"
    assert pp.CARRY in stages


def test_a_slip_drops_the_object_and_closes_the_jaw():
    env = make_env(CFG, ["robot-0000"], seed=0)
    env.reset()
    env.gripper[0] = env.object[0]
    env.opening[0], env.holding[0] = pp.OBJECT_WIDTH, True
    env._slip[:] = 1.0  # this robot slips on every full-speed step
    env.step(np.array([[1.0, 0.0, 1.0]], np.float32))
    assert not env.holding[0] and env.opening[0] == 0.0


# ------------------------------------------------------------------------------------- collection
def test_collect_contract():
    steps = 150
    result = collect(ScriptedExpert(), ROBOTS, CFG, steps, seed=0, policy_version="v7")
    assert result.env_steps == steps * len(ROBOTS)
    assert result.episodes and len({e.episode_id for e in result.episodes}) == len(result.episodes)
    first_obs, _ = make_env(CFG, ROBOTS, seed=0).reset()
    expert = ScriptedExpert()
    for robot_index, robot in enumerate(ROBOTS):
        mine = [e for e in result.episodes if e.robot_id == robot]
        used = sum(e.length for e in mine)
        assert used <= steps and steps - used < CFG.max_steps  # only the cut-off episode is missing
        assert np.array_equal(mine[0].states[0], first_obs[robot_index])  # states = what the policy saw
    for e in result.episodes:
        assert uuid.UUID(e.episode_id).version == 4
        assert e.task == CFG.task and e.policy_version == "v7" and not e.interrupted
        assert e.states.dtype == e.actions.dtype == e.timestamps.dtype == np.float32
        assert e.states.shape == (e.length, observation_dim(CFG)) and e.actions.shape == (e.length, 3)
        assert 1 <= e.length <= CFG.max_steps and e.timestamps[0] == 0.0
        assert np.all(np.diff(e.timestamps) > 0)
        assert np.allclose(e.timestamps, np.arange(e.length) / CFG.control_hz)
        assert np.array_equal(e.actions, expert(e.states))  # actions = what the policy commanded
        assert 0 <= e.stage_reached < len(STAGES) and e.extras["stage"].shape == (e.length,)
        assert e.success or e.length == CFG.max_steps  # failures run out the clock
    assert result.success_rate >= 0.95


def test_run_episodes_returns_exactly_n_per_robot_and_failures_are_truncated():
    episodes = run_episodes(_random_policy(0), ROBOTS, CFG, 3, seed=0, policy_version="random")
    assert sorted(e.robot_id for e in episodes) == sorted(ROBOTS * 3)
    failures = [e for e in episodes if not e.success]
    assert failures and all(e.length == CFG.max_steps for e in failures)


def test_gripper_execution_wrappers():
    obs, _ = make_env(CFG, ROBOTS, seed=0).reset()
    raw = lambda o: np.tile(np.array([[0.3, -0.2, 0.1]], np.float32), (o.shape[0], 1))  # noqa: E731
    assert np.array_equal(ThresholdedGripper(raw)(obs)[:, 2], np.ones(4))
    cfg = SimConfig(gripper_flip_prob=0.0, gripper_sample_gain=4.0)
    big = np.repeat(obs, 2500, axis=0)
    sampled = SampledGripper(raw, cfg, seed=0)(big)
    assert set(np.unique(sampled[:, 2])) == {-1.0, 1.0} and np.array_equal(sampled[:, :2], raw(big)[:, :2])
    p_close = 1 / (1 + np.exp(-0.4))
    assert abs(np.mean(sampled[:, 2] > 0) - p_close) < 0.02
    again = SampledGripper(raw, cfg, seed=0)(big)
    assert np.array_equal(sampled, again)
    always_close = lambda o: np.tile([[0, 0, 100.0]], (o.shape[0], 1))  # noqa: E731
    flips = SampledGripper(always_close, SimConfig(gripper_flip_prob=0.1), 0)(big)
    assert abs(np.mean(flips[:, 2] < 0) - 0.1) < 0.02


def test_motion_noise_explores_motion_only_and_collection_uses_it():
    from components.sim.factory import make_exploration

    obs, _ = make_env(CFG, ROBOTS, seed=0).reset()
    big = np.repeat(obs, 5000, axis=0)
    raw = lambda o: np.tile(np.array([[0.1, -0.2, 0.7]], np.float32), (o.shape[0], 1))  # noqa: E731
    noisy = MotionNoise(raw, 0.3, seed=0)(big)
    assert np.array_equal(noisy[:, 2], raw(big)[:, 2])  # the jaw command passes through
    assert np.allclose(noisy[:, :2].mean(axis=0), [0.1, -0.2], atol=0.02)
    assert np.allclose(noisy[:, :2].std(axis=0), 0.3, atol=0.02) and np.abs(noisy).max() <= 1.0
    assert np.array_equal(noisy, MotionNoise(raw, 0.3, seed=0)(big)) and not np.array_equal(noisy, MotionNoise(raw, 0.3, 1)(big))
    # the fleet's collection samples the jaw and adds sim.motion_noise_std; motion=False is jaw-only
    cfg = SimConfig(motion_noise_std=0.3, gripper_flip_prob=0.0)
    explored = make_exploration(cfg, raw, seed=0)(big)
    assert set(np.unique(explored[:, 2])) == {-1.0, 1.0} and abs(explored[:, 0].std() - 0.3) < 0.02
    jaw_only = make_exploration(cfg, raw, seed=0, motion=False)(big)
    assert np.array_equal(jaw_only[:, :2], raw(big)[:, :2])
    assert np.array_equal(make_exploration(SimConfig(motion_noise_std=0.0), raw, 0)(big)[:, :2], raw(big)[:, :2])
    with pytest.raises(ValueError, match="motion_noise_std"):
        MotionNoise(raw, -0.1, seed=0)
