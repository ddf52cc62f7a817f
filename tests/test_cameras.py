"""Cameras in the sims: Dict observations, per-robot camera quirks, and a state that never changes."""

from __future__ import annotations

import itertools
import os
import subprocess
import sys

import gymnasium as gym
import numpy as np
import pytest
from gymnasium.utils.env_checker import check_env

import components.sim  # noqa: F401  (registers the gymnasium ids)
from components.config import CameraConfig, SimConfig
from components.episodes.record import camera_key
from components.sim.camera import (
    OBJECT,
    PALETTE,
    SCENE_CENTRE,
    SCENE_HALF_WIDTH,
    STATE_KEY,
)
from components.sim.collect import collect, run_episodes
from components.sim.factory import make_env, make_expert
from components.sim.profile import CameraQuirks, RobotProfile

SIMS = [SimConfig(max_steps=40), SimConfig(name="pack", task="pack", max_steps=40)]
BOTH = ("scene", "gripper")
ROBOTS = ["robot-0000", "robot-0003", "heldout-0001"]


def _on(cfg: SimConfig, **camera: float) -> SimConfig:
    return cfg.model_copy(update={"cameras": BOTH, "camera": CameraConfig(**camera)})


@pytest.mark.parametrize("cfg", SIMS, ids=["pickplace", "pack"])
def test_state_and_episodes_are_the_same_with_cameras_on(cfg: SimConfig) -> None:
    off = collect(make_expert(cfg), ROBOTS, cfg, 60, seed=4, policy_version="expert")
    on = collect(make_expert(cfg), ROBOTS, _on(cfg), 60, seed=4, policy_version="expert")
    assert len(off.episodes) == len(on.episodes) > 0
    for a, b in zip(off.episodes, on.episodes):
        assert a.episode_id == b.episode_id and a.success == b.success
        np.testing.assert_array_equal(a.states, b.states)
        np.testing.assert_array_equal(a.actions, b.actions)
        assert a.cameras == {}
        assert set(b.cameras) == {camera_key("scene"), camera_key("gripper")}
        for frames in b.cameras.values():
            assert frames.shape == (b.length, 64, 64, 3) and frames.dtype == np.uint8


@pytest.mark.parametrize("env_id", ["fleetloop/PickPlace-v0", "fleetloop/Pack-v0"])
def test_dict_space_and_env_checker_with_cameras(env_id: str) -> None:
    env = gym.make(env_id, robot_id="robot-0003", cameras=BOTH, camera={"width": 48, "height": 32})
    space = env.observation_space
    assert isinstance(space, gym.spaces.Dict) and set(space.spaces) == {STATE_KEY, *BOTH}
    assert space["scene"] == gym.spaces.Box(0, 255, (32, 48, 3), np.uint8)
    check_env(env.unwrapped)
    fleet = gym.make_vec(env_id, num_envs=2, cameras=("gripper",), max_steps=3)
    obs, _ = fleet.reset(seed=0)
    for _ in range(3):
        obs, _, terminated, truncated, info = fleet.step(fleet.action_space.sample())
    assert (terminated | truncated).all() and fleet.observation_space.contains(obs)
    assert set(info["final_obs"]) == {STATE_KEY, "gripper"} and info["final_obs"]["gripper"].shape == (2, 64, 64, 3)


def test_default_is_state_only() -> None:
    env = make_env(SIMS[0], ROBOTS, 0)
    obs, _ = env.reset()
    assert env.cameras is None and isinstance(obs, np.ndarray)
    assert isinstance(env.single_observation_space, gym.spaces.Box)


def test_camera_quirks_are_per_robot_stable_and_per_population() -> None:
    cfg = _on(SIMS[0])
    a = RobotProfile.from_id("robot-0003", cfg).camera
    again = RobotProfile.from_id("robot-0003", cfg).camera
    other = RobotProfile.from_id("robot-0004", cfg).camera
    moved = RobotProfile.from_id("robot-0003", cfg.model_copy(update={"population_seed": 7})).camera
    for field in ("mount_offset", "mount_rotation", "white_balance"):
        np.testing.assert_array_equal(getattr(a, field), getattr(again, field))
        assert not np.array_equal(getattr(a, field), getattr(other, field))
        assert not np.array_equal(getattr(a, field), getattr(moved, field))
    flat = CameraQuirks.from_id("robot-0003", CameraConfig(mount_offset_spread=0, mount_rotation_spread=0, exposure_spread=0,
                                                           white_balance_spread=0, pixel_noise_max=0, drop_rate_max=0))
    assert not flat.mount_offset.any() and flat.exposure == 1.0 and flat.pixel_noise == 0 and flat.drop_rate == 0
    # the other quirks are drawn as before cameras existed
    base = RobotProfile.from_id("robot-0003", SIMS[0])
    np.testing.assert_array_equal(base.action_gain, RobotProfile.from_id("robot-0003", cfg).action_gain)


def test_robots_see_the_same_world_differently() -> None:
    cfg = _on(SIMS[0])
    env = make_env(cfg, ROBOTS, 0)
    env.reset()
    env.gripper[:], env.object[:], env.goal[:], env.opening[:] = (0.5, 0.5), (0.3, 0.6), (0.7, 0.4), 1.0
    frames = env._with_images(env._observe(np.zeros((3, 6))), np.ones(3, dtype=bool))["scene"]
    assert not np.array_equal(frames[0], frames[1]) and not np.array_equal(frames[1], frames[2])


def test_the_scene_view_draws_the_object_where_it_is() -> None:
    flat = CameraConfig(mount_offset_spread=0, mount_rotation_spread=0, exposure_spread=0, white_balance_spread=0,
                        pixel_noise_max=0, drop_rate_max=0)
    cfg = SIMS[0].model_copy(update={"cameras": ("scene",), "camera": flat})
    env = make_env(cfg, ROBOTS[:1], 0)
    obs, _ = env.reset()
    x, y = env.object[0]
    col = int((x - SCENE_CENTRE[0] + SCENE_HALF_WIDTH) / (2 * SCENE_HALF_WIDTH) * 64)
    row = int((SCENE_CENTRE[1] + SCENE_HALF_WIDTH - y) / (2 * SCENE_HALF_WIDTH) * 64)
    np.testing.assert_array_equal(obs["scene"][0, row, col], PALETTE[OBJECT].astype(np.uint8))


def test_frames_are_seeded_and_a_robot_never_depends_on_its_batch() -> None:
    cfg = _on(SIMS[1])
    alone = run_episodes(make_expert(cfg), ["robot-0003"], cfg, 2, seed=5, policy_version="expert")
    again = run_episodes(make_expert(cfg), ["robot-0003"], cfg, 2, seed=5, policy_version="expert")
    batch = run_episodes(make_expert(cfg), ROBOTS, cfg, 2, seed=5, policy_version="expert")
    mine = [e for e in batch if e.robot_id == "robot-0003"]
    for a, b, c in zip(alone, again, mine):
        for key in a.cameras:
            np.testing.assert_array_equal(a.cameras[key], b.cameras[key])
            np.testing.assert_array_equal(a.cameras[key], c.cameras[key])


def test_dropped_frames_repeat_the_last_one_but_never_start_an_episode() -> None:
    def repeats(rate: float) -> tuple[int, int]:
        cfg = SIMS[0].model_copy(update={"cameras": ("scene",), "camera": CameraConfig(drop_rate_max=rate)})
        episodes = run_episodes(make_expert(cfg), ROBOTS, cfg, 3, seed=1, policy_version="expert")
        frames = [e.cameras[camera_key("scene")] for e in episodes]
        same = sum(int((f[1:] == f[:-1]).all(axis=(1, 2, 3)).sum()) for f in frames)
        first_repeats = sum(int(np.array_equal(a[-1], b[0])) for a, b in itertools.pairwise(frames))
        return same, first_repeats

    none, _ = repeats(0.0)
    many, first = repeats(0.95)
    assert none == 0 and many > 10 and first == 0


METAWORLD_SCRIPT = """
import gymnasium as gym, numpy as np
from gymnasium.utils.env_checker import check_env
import components.sim
from components.config import SimConfig
from components.sim.factory import make_env
from components.sim.registration import METAWORLD_ID
env = gym.make(METAWORLD_ID, robot_id="robot-0001", cameras=("scene", "gripper"), max_steps=3)
assert isinstance(env.observation_space, gym.spaces.Dict)
check_env(env.unwrapped, skip_render_check=True)
cfg = SimConfig(name="metaworld", task="pick-place-v3", max_steps=3, cameras=("scene",))
fleet = make_env(cfg, ["robot-0000", "robot-0001"], 0)
obs, _ = fleet.reset()
assert obs["scene"].shape == (2, 64, 64, 3) and obs["scene"].dtype == np.uint8 and obs["scene"].std() > 10
assert not np.array_equal(obs["scene"][0], obs["scene"][1])  # two robots, two exposures
for _ in range(3):
    obs, _, terminated, truncated, info = fleet.step(np.zeros((2, 4), np.float32))
assert (terminated | truncated).all() and info["final_obs"]["scene"].shape == (2, 64, 64, 3)
fleet.close()
states = []
for cameras in ((), ("scene",)):  # the state is the same with cameras on
    fleet = make_env(cfg.model_copy(update={"cameras": cameras}), ["robot-0002"], 1)
    obs, _ = fleet.reset()
    run = [obs["state"] if cameras else obs]
    for _ in range(2):
        obs, *_ = fleet.step(np.full((1, 4), 0.3, np.float32))
        run.append(obs["state"] if cameras else obs)
    states.append(np.stack(run))
    fleet.close()
np.testing.assert_array_equal(states[0], states[1])
print("rendered")
"""


def test_metaworld_renders_offscreen_with_the_robots_quirks() -> None:
    """In a fresh process: MuJoCo picks its GL (sim.camera.mujoco_gl) when first imported."""
    pytest.importorskip("metaworld")
    env = {k: v for k, v in os.environ.items() if k not in ("MUJOCO_GL", "PYOPENGL_PLATFORM")}
    done = subprocess.run([sys.executable, "-c", METAWORLD_SCRIPT], capture_output=True, text=True, env=env, timeout=300, check=False)
    assert done.returncode == 0 and "rendered" in done.stdout, done.stderr[-2000:]
