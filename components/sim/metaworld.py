"""Meta-World (MuJoCo) pick-place-v3 as a fleet: one Sawyer env per robot, with the same quirks.

Selected by ``sim.name: metaworld`` (``sim.task`` must be ``pick-place-v3``). Nothing is
downloaded: the env and its assets ship in the ``metaworld`` wheel. The raw env class is used
(not ``gym.make``'s task-sampling wrappers) so that placement is ours to seed per robot.

Per-robot heterogeneity, from the same ``RobotProfile`` as the built-in task:

* **placement**: each robot draws object and goal positions from its own sub-box (half as wide)
  of Meta-World's reset space, placed by the robot's object/goal offsets; episode k of robot r
  always starts from the same layout.
* **actuation**: x/y motion commands are multiplied by the robot's gain and shifted by its bias.
* **sensing**: Gaussian noise (``obs_noise`` x ``NOISE_SCALE`` metres) on hand and object position.

Stages (as ``components.sim.pickplace.STAGES``): reach (hand not near the object), grasp (near,
not grasped), carry (grasped, off target), place (success). Success terminates; ``max_steps``
truncates. Same-step autoreset with ``info["final_obs"]``, like ``PickPlaceVecEnv``.

The expert is Meta-World's bundled scripted ``SawyerPickPlaceV3Policy``.

Cameras (``sim.cameras``): MuJoCo renders offscreen through ``sim.camera.mujoco_gl`` (``MUJOCO_GL``:
osmesa from Debian's ``libosmesa6``, or egl from ``libegl1`` + ``libegl-mesa0``), the scene view from
Meta-World's ``sim.camera.metaworld_scene_camera`` and the gripper view from its
``metaworld_gripper_camera``; each robot's exposure, white balance, pixel noise and dropped frames
apply as in the built-in sims (camera.py); the mount offset does not (the MuJoCo cameras stay put).
"""

from __future__ import annotations

import os
import sys
from typing import Any

import gymnasium as gym
import numpy as np
from gymnasium.vector import AutoresetMode, VectorEnv

from components.config import SimConfig
from components.sim.camera import STATE_KEY, FleetCameras, camera_keys
from components.sim.camera import observation_space as camera_observation_space
from components.sim.pickplace import CARRY, GRASP, PLACE, REACH
from components.sim.profile import (
    GOAL_CENTER,
    OBJECT_CENTER,
    RobotProfile,
    check_robot_ids,
    stable_robot_hash,
)

TASK = "pick-place-v3"
OBS_DIM = 39
ACT_DIM = 4  # dx, dy, dz, gripper effort (> 0 closes)
GRIPPER_ACTION = 3
HAND = slice(0, 3)
OBJECT = slice(4, 7)
NOISE_SCALE = 0.2  # built-in task is a unit square; Meta-World's reachable box is ~0.2 m across
REGION_FRACTION = 0.5  # a robot's placement box is this fraction of Meta-World's reset box
MIN_SEPARATION = 0.16  # object-goal xy distance; Meta-World itself insists on >= 0.15
PLACEMENT_TRIES = 100
_RESET_STREAM, _STEP_STREAM = 1, 2


def _check(cfg: SimConfig) -> None:
    if cfg.task != TASK:
        raise ValueError(f"sim.task={cfg.task!r}: the Meta-World adapter provides {TASK!r}; set sim.task: {TASK}")


# Building a MuJoCo Sawyer env takes ~1 s; envs are kept and reused (every reset restores the
# full simulator state from our placement vector, so a reused env behaves like a new one).
_IDLE_ENVS: list[Any] = []


def _make_raw_env(max_steps: int) -> Any:
    if _IDLE_ENVS:
        env = _IDLE_ENVS.pop()
        env.max_path_length = max_steps + 1
        return env
    from metaworld.envs.sawyer_pick_place_v3 import SawyerPickPlaceEnvV3

    env = SawyerPickPlaceEnvV3()
    env._partially_observable = False  # the goal is part of the observation (the expert needs it)
    env.__dict__.pop("sawyer_observation_space", None)  # cached with the goal bounds zeroed: recompute
    env._set_task_called = True
    env._freeze_rand_vec = True  # we set _last_rand_vec ourselves before every reset
    env.max_path_length = max_steps + 1  # our truncation comes first
    return env


class MetaWorldVecEnv(VectorEnv):
    """One Meta-World pick-place env per robot id, stepped in a loop."""

    metadata: dict[str, Any] = {"autoreset_mode": AutoresetMode.SAME_STEP}

    def __init__(self, cfg: SimConfig, robot_ids: list[str], seed: int = 0) -> None:
        _check(cfg)
        check_robot_ids(robot_ids)
        self.cfg = cfg
        self.robot_ids = list(robot_ids)
        self.num_envs = len(robot_ids)
        self.profiles = [RobotProfile.from_id(r, cfg) for r in robot_ids]
        self._hashes = [stable_robot_hash(r) for r in robot_ids]
        self.cameras = FleetCameras(cfg, self.profiles, self._hashes, seed) if camera_keys(cfg) else None
        if self.cameras is not None:  # MuJoCo picks its GL when it is first imported
            if "mujoco" in sys.modules and not os.environ.get("MUJOCO_GL"):
                raise RuntimeError(
                    "sim.cameras on Meta-World: MuJoCo was imported before MUJOCO_GL was set, so it cannot render "
                    f"offscreen; export MUJOCO_GL={cfg.camera.mujoco_gl} before starting Python"
                )
            os.environ.setdefault("MUJOCO_GL", cfg.camera.mujoco_gl)
        self.envs = [_make_raw_env(cfg.max_steps) for _ in robot_ids]
        self._renderers: list[Any] = []
        state_space = gym.spaces.Box(-np.inf, np.inf, (OBS_DIM,), np.float32)
        self.single_observation_space = camera_observation_space(cfg, state_space)
        self.single_action_space = gym.spaces.Box(-1.0, 1.0, (ACT_DIM,), np.float32)
        self.observation_space = gym.vector.utils.batch_space(self.single_observation_space, self.num_envs)
        self.action_space = gym.vector.utils.batch_space(self.single_action_space, self.num_envs)
        space = self.envs[0]._random_reset_space
        self._low, self._high = space.low.astype(np.float64), space.high.astype(np.float64)
        self._regions = [self._region(p, cfg) for p in self.profiles]
        self.elapsed = np.zeros(self.num_envs, dtype=np.int64)
        self.stage_reached = np.zeros(self.num_envs, dtype=np.int64)
        self._seed(seed)
        self._needs_reset = True

    def _region(self, profile: RobotProfile, cfg: SimConfig) -> tuple[np.ndarray, np.ndarray]:
        """This robot's (low, high) sub-box of the reset space (object xyz + goal xyz)."""
        spread = max(cfg.placement_spread, 1e-9)
        shift = np.zeros(6)
        shift[0:2] = (profile.object_center - np.asarray(OBJECT_CENTER)) / spread  # in [-1, 1]
        shift[3:5] = (profile.goal_center - np.asarray(GOAL_CENTER)) / spread
        half = (self._high - self._low) / 2
        width = half * REGION_FRACTION
        centre = (self._low + half) + np.clip(shift, -1.0, 1.0) * (half - width)
        return centre - width, centre + width

    def _seed(self, seed: int) -> None:
        if seed < 0:
            raise ValueError(f"seed must be a non-negative int, got {seed}")
        self._reset_rngs = [np.random.default_rng([seed, h, _RESET_STREAM]) for h in self._hashes]
        self._step_rngs = [np.random.default_rng([seed, h, _STEP_STREAM]) for h in self._hashes]
        if self.cameras is not None:
            self.cameras.seed(seed)

    # ----------------------------------------------------------------------------- cameras
    def _render(self, rows: np.ndarray, fresh: np.ndarray) -> dict[str, np.ndarray]:
        """The robots' camera frames of ``rows`` (MuJoCo offscreen, then each robot's quirks)."""
        assert self.cameras is not None
        if not self._renderers:
            import mujoco

            cam = self.cfg.camera
            self._renderers = [mujoco.Renderer(env.model, cam.height, cam.width) for env in self.envs]
        names = {"scene": self.cfg.camera.metaworld_scene_camera, "gripper": self.cfg.camera.metaworld_gripper_camera}
        drawn = {}
        for key in self.cameras.keys:
            images = []
            for i in rows:
                self._renderers[i].update_scene(self.envs[i].data, camera=names[key])
                images.append(self._renderers[i].render())
            drawn[key] = np.stack(images)
        return self.cameras.deliver(drawn, rows, fresh)

    def _observed(self, state: np.ndarray, fresh: np.ndarray) -> np.ndarray | dict[str, np.ndarray]:
        if self.cameras is None:
            return state
        return {STATE_KEY: state, **self._render(np.arange(self.num_envs), fresh)}

    def _placement(self, i: int) -> np.ndarray:
        """Object xyz + goal xyz from robot i's region, >= MIN_SEPARATION apart in xy.

        Meta-World re-draws a too-close layout in a loop, which never ends with a frozen vector,
        so the layout is redrawn here: from the robot's region first, then the whole reset box.
        """
        rng = self._reset_rngs[i]
        for attempt in range(2 * PLACEMENT_TRIES):
            low, high = self._regions[i] if attempt < PLACEMENT_TRIES else (self._low, self._high)
            vec = low + (high - low) * rng.random(6)
            if np.linalg.norm(vec[0:2] - vec[3:5]) >= MIN_SEPARATION:
                return vec
        raise RuntimeError("could not place object and goal apart; check the Meta-World reset space")

    def _reset_one(self, i: int) -> np.ndarray:
        env = self.envs[i]
        env._last_rand_vec = self._placement(i)
        obs, _ = env.reset()
        self.elapsed[i] = 0
        self.stage_reached[i] = REACH
        return self._sense(i, obs)

    def _sense(self, i: int, obs: np.ndarray) -> np.ndarray:
        noisy = np.array(obs, dtype=np.float64)
        std = self.profiles[i].obs_noise * NOISE_SCALE
        noisy[HAND] += std * self._step_rngs[i].standard_normal(3)
        noisy[OBJECT] += std * self._step_rngs[i].standard_normal(3)
        return noisy.astype(np.float32)

    def reset(self, *, seed: int | None = None, options: dict[str, Any] | None = None) -> tuple[np.ndarray, dict[str, Any]]:
        if seed is not None:
            self._seed(seed)
        self._needs_reset = False
        obs = np.stack([self._reset_one(i) for i in range(self.num_envs)])
        zeros = np.zeros(self.num_envs, dtype=bool)
        if self.cameras is not None:
            self.cameras.draw()
        return self._observed(obs, ~zeros), {"stage": np.zeros(self.num_envs, np.int64), "stage_reached": self.stage_reached.copy(), "success": zeros}

    def step(self, actions: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, dict[str, Any]]:
        if self._needs_reset:
            raise RuntimeError("call reset() before step()")
        a = np.asarray(actions, dtype=np.float64)
        if a.shape != (self.num_envs, ACT_DIM):
            raise ValueError(f"actions must have shape {(self.num_envs, ACT_DIM)}, got {a.shape}")
        if not np.all(np.isfinite(a)):
            raise ValueError("actions contain NaN or inf")
        a = np.clip(a, -1.0, 1.0)
        obs = np.zeros((self.num_envs, OBS_DIM), np.float32)
        final = np.zeros_like(obs)
        stage = np.zeros(self.num_envs, np.int64)
        success = np.zeros(self.num_envs, bool)
        for i, env in enumerate(self.envs):
            p = self.profiles[i]
            command = a[i].copy()
            command[:2] = np.clip(p.action_gain * command[:2] + p.action_bias, -1.0, 1.0)
            raw, _, _, _, info = env.step(command.astype(np.float32))
            success[i] = bool(info["success"])
            stage[i] = PLACE if success[i] else CARRY if info["grasp_success"] else GRASP if info["near_object"] else REACH
            final[i] = self._sense(i, raw)
        self.elapsed += 1
        self.stage_reached = np.maximum(self.stage_reached, stage)
        truncated = ~success & (self.elapsed >= self.cfg.max_steps)
        done = success | truncated
        info = {"stage": stage, "stage_reached": self.stage_reached.copy(), "success": success.copy(),
                "elapsed": self.elapsed.copy(), "final_obs": final, "_final_obs": done}
        obs[:] = final
        last_frames: dict[str, np.ndarray] = {}
        if self.cameras is not None:
            self.cameras.draw()  # one draw a step, whoever finishes
            if done.any():
                last_frames = self._render(np.flatnonzero(done), np.zeros(int(done.sum()), dtype=bool))
        for i in np.flatnonzero(done):
            obs[i] = self._reset_one(i)
        observed = self._observed(obs, done)
        if self.cameras is not None:
            final_images = {k: v.copy() for k, v in observed.items() if k != STATE_KEY}
            for key, frames in last_frames.items():
                final_images[key][done] = frames
            info["final_obs"] = {STATE_KEY: final, **final_images}
        return observed, success.astype(np.float32), success, truncated, info

    def close(self, **kwargs: Any) -> None:
        """Hands the envs back for reuse (see ``_IDLE_ENVS``)."""
        _IDLE_ENVS.extend(self.envs)
        self.envs = []
        for renderer in self._renderers:
            renderer.close()
        self._renderers = []


class MetaWorldExpert:
    """Meta-World's scripted ``SawyerPickPlaceV3Policy``, batched: ``obs (B, 39) -> actions (B, 4)``."""

    def __init__(self, cfg: SimConfig) -> None:
        _check(cfg)
        from metaworld.policies import SawyerPickPlaceV3Policy

        self.policy = SawyerPickPlaceV3Policy()

    def __call__(self, obs: np.ndarray) -> np.ndarray:
        actions = np.stack([self.policy.get_action(np.asarray(o, dtype=np.float64)) for o in obs])
        actions[:, GRIPPER_ACTION] = np.where(actions[:, GRIPPER_ACTION] > 0.0, 1.0, -1.0)
        return np.clip(actions, -1.0, 1.0).astype(np.float32)


