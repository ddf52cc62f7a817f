"""A vectorized 2D pick-and-place task: reach -> grasp -> carry -> place, one env per robot.

The world (unit square): a point gripper with a one-dof jaw, one object, one goal disc.

* **Motion.** ``action[:2]`` in [-1, 1] is a motion command; the robot moves
  ``(gain * a + bias) * MAX_DELTA`` (its own gain and bias, see ``RobotProfile``), clipped to the
  workspace.
* **Jaw.** ``action[2] > 0`` closes, otherwise opens. The sensed opening is 1 when open,
  ``OBJECT_WIDTH`` when the jaw holds the object, and 0 when it closed on nothing; closing takes
  two steps, opening one. A grasp is attempted when the closing jaw passes ``OBJECT_WIDTH``:
  it succeeds with a chance that falls with the object's distance from the jaw (and the speed
  of the gripper), times the robot's own ``1 - grasp_miss``. A miss snaps the jaw shut on nothing.
* **Slip.** While carrying, the object slips with ``slip_rate * speed^2`` per step; it drops
  near where it was and the jaw snaps shut on nothing.
* **Place.** The episode succeeds (terminates, reward 1) when the object rests in the goal disc
  and the jaw is open. At ``max_steps`` it is truncated: a failure.

So the failures real robots have are here and recoverable the way real ones are: a missed grasp
or a slip leaves "jaw closed, not holding"; re-opening, re-approaching and closing again still
succeeds within the time limit.

Randomness is per robot and split in two streams, both seeded by ``(seed, robot id)``: a
*reset* stream (episode k of robot r always starts from the same layout, whatever the policy or
the other robots in the batch) and a *step* stream indexed by global step (sensor noise, grasp
and slip luck). Autoreset is same-step: a finished env returns the next episode's first
observation, and its final observation is in ``info["final_obs"]``.
"""

from __future__ import annotations

from typing import Any

import gymnasium as gym
import numpy as np
from gymnasium.vector import AutoresetMode, VectorEnv

from components.config import SimConfig
from components.sim.camera import (
    GOAL,
    OBJECT,
    OBJECT_RADIUS,
    STATE_KEY,
    Disc,
    FleetCameras,
    camera_keys,
    gripper_disc,
)
from components.sim.camera import observation_space as camera_observation_space
from components.sim.profile import RobotProfile, check_robot_ids, stable_robot_hash

STAGES: tuple[str, ...] = ("reach", "grasp", "carry", "place")
REACH, GRASP, CARRY, PLACE = range(len(STAGES))

# geometry and dynamics of the task (unit workspace)
MAX_DELTA = 0.05  # distance moved per step at full command
OBJECT_WIDTH = 0.4  # jaw opening when holding the object
CLOSE_RATE = 0.3  # jaw closes this much per step...
OPEN_RATE = 0.5  # ...and opens this much
GRASP_SURE = 0.02  # within this distance a grasp only misses by the robot's grasp_miss
GRASP_REACH = 0.06  # beyond this distance a grasp always misses (also the "grasp" stage radius)
GRASP_SPEED_PENALTY = 0.5  # distance added per unit of motion during the closing step
GOAL_RADIUS = 0.05  # the object must rest within this distance of the goal
DROP_SCATTER = 0.02  # std of where a slipped object lands around the jaw
PLACEMENT_HALF_WIDTH = 0.12  # object/goal uniform in a square of this half-width around centre
PLACE_LOW, PLACE_HIGH = 0.05, 0.95  # objects and goals stay inside this square
MIN_SEPARATION = 0.2  # the goal starts at least this far from the object
START_LOW, START_HIGH = 0.1, 0.9  # gripper start, uniform in this square
WORKSPACE_LOW, WORKSPACE_HIGH = 0.0, 1.0
OBS_LIMIT = 2.0  # observation bound (positions plus noise never reach it)

# observation layout
OBS_FIELDS: tuple[str, ...] = (
    "gripper_x", "gripper_y", "opening", "object_x", "object_y", "goal_x", "goal_y",
    "object_rel_x", "object_rel_y", "goal_rel_x", "goal_rel_y",
)  # fmt: skip
OBS_DIM = len(OBS_FIELDS)
ACT_DIM = 3  # dx, dy, jaw (> 0 = close)
GRIPPER_ACTION = 2

# per-step random draws (columns of the step stream)
_STEP_NORMALS = 8  # 6 sensor-noise coordinates + 2 drop scatter
_STEP_UNIFORMS = 2  # grasp luck, slip luck
_STEP_BLOCK = 256  # steps drawn at once per robot (amortizes the per-robot generator calls)
_RESET_STREAM, _STEP_STREAM = 1, 2



def kept_apart(anchor: np.ndarray, points: np.ndarray, min_distance: float = MIN_SEPARATION) -> np.ndarray:
    """(N, 2) ``points``, each closer than ``min_distance`` to its ``anchor`` pushed away along the
    anchor->point line to exactly that distance (a goal or container never starts on the object)."""
    gap = points - anchor
    norm = np.maximum(np.linalg.norm(gap, axis=1, keepdims=True), 1e-9)
    return np.where(norm < min_distance, anchor + gap / norm * min_distance, points)

class PickPlaceVecEnv(VectorEnv):
    """One pick-and-place env per robot id, stepped together with numpy."""

    metadata: dict[str, Any] = {"autoreset_mode": AutoresetMode.SAME_STEP}
    # what a subclass with more bodies (components/sim/pack.py) changes
    obs_dim: int = OBS_DIM
    sensed_coords: int = 6  # sensor-noise coordinates per observation (gripper, object, goal xy)
    step_normals: int = _STEP_NORMALS
    step_uniforms: int = _STEP_UNIFORMS

    def __init__(self, cfg: SimConfig, robot_ids: list[str], seed: int = 0) -> None:
        check_robot_ids(robot_ids)
        self.cfg = cfg
        self.robot_ids = list(robot_ids)
        self.num_envs = len(robot_ids)
        self.profiles = [RobotProfile.from_id(r, cfg) for r in robot_ids]
        self._hashes = [stable_robot_hash(r) for r in robot_ids]
        state_space = gym.spaces.Box(-OBS_LIMIT, OBS_LIMIT, (self.obs_dim,), np.float32)
        self.single_observation_space = camera_observation_space(cfg, state_space)
        # sim.cameras: the views render into a Dict observation (camera.py); none: the state array
        self.cameras = FleetCameras(cfg, self.profiles, self._hashes, seed) if camera_keys(cfg) else None
        self.single_action_space = gym.spaces.Box(-1.0, 1.0, (ACT_DIM,), np.float32)
        self.observation_space = gym.vector.utils.batch_space(self.single_observation_space, self.num_envs)
        self.action_space = gym.vector.utils.batch_space(self.single_action_space, self.num_envs)

        self._gain = np.stack([p.action_gain for p in self.profiles])
        self._bias = np.stack([p.action_bias for p in self.profiles])
        self._noise = np.array([p.obs_noise for p in self.profiles])[:, None]
        self._obj_center = np.stack([p.object_center for p in self.profiles])
        self._goal_center = np.stack([p.goal_center for p in self.profiles])
        self._miss = np.array([p.grasp_miss for p in self.profiles])
        self._slip = np.array([p.slip_rate for p in self.profiles])

        b = self.num_envs
        self.gripper = np.zeros((b, 2))
        self.opening = np.ones(b)
        self.object = np.zeros((b, 2))
        self.goal = np.zeros((b, 2))
        self.holding = np.zeros(b, dtype=bool)
        self.elapsed = np.zeros(b, dtype=np.int64)
        self.stage_reached = np.zeros(b, dtype=np.int64)
        self._seed(seed)
        self._needs_reset = True

    # ----------------------------------------------------------------------------- randomness
    def _seed(self, seed: int) -> None:
        if seed < 0:
            raise ValueError(f"seed must be a non-negative int, got {seed}")
        self._seed_value = int(seed)
        self._reset_rngs = [np.random.default_rng([seed, h, _RESET_STREAM]) for h in self._hashes]
        self._step_rngs = [np.random.default_rng([seed, h, _STEP_STREAM]) for h in self._hashes]
        self._block_pos = _STEP_BLOCK  # forces a refill on the first step
        if self.cameras is not None:
            self.cameras.seed(seed)

    def _step_draws(self) -> tuple[np.ndarray, np.ndarray]:
        if self._block_pos == _STEP_BLOCK:
            shape_n, shape_u = (_STEP_BLOCK, self.step_normals), (_STEP_BLOCK, self.step_uniforms)
            self._normals = np.stack([g.standard_normal(shape_n) for g in self._step_rngs], 1)
            self._uniforms = np.stack([g.random(shape_u) for g in self._step_rngs], 1)
            self._block_pos = 0
        k = self._block_pos
        self._block_pos += 1
        return self._normals[k], self._uniforms[k]

    def _reset_envs(self, mask: np.ndarray) -> None:
        for i in np.flatnonzero(mask):
            u = self._reset_rngs[i].random(6)
            self.gripper[i] = START_LOW + (START_HIGH - START_LOW) * u[0:2]
            self.object[i] = self._obj_center[i] + PLACEMENT_HALF_WIDTH * (2.0 * u[2:4] - 1.0)
            self.goal[i] = self._goal_center[i] + PLACEMENT_HALF_WIDTH * (2.0 * u[4:6] - 1.0)
        self.goal[mask] = kept_apart(self.object[mask], self.goal[mask])
        np.clip(self.object, PLACE_LOW, PLACE_HIGH, out=self.object)
        np.clip(self.goal, PLACE_LOW, PLACE_HIGH, out=self.goal)
        self.opening[mask] = 1.0
        self.holding[mask] = False
        self.elapsed[mask] = 0
        self.stage_reached[mask] = REACH

    # ----------------------------------------------------------------------------- gym API
    def reset(
        self, *, seed: int | None = None, options: dict[str, Any] | None = None
    ) -> tuple[np.ndarray, dict[str, Any]]:
        if seed is not None:
            self._seed(seed)
        self._needs_reset = False
        self._reset_envs(np.ones(self.num_envs, dtype=bool))
        noise = np.stack([g.standard_normal(self.sensed_coords) for g in self._reset_rngs])
        everyone = np.ones(self.num_envs, dtype=bool)
        if self.cameras is not None:
            self.cameras.draw()
        return self._with_images(self._observe(noise), everyone), self._info(self.stage(), ~everyone)

    def step(
        self, actions: np.ndarray
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, dict[str, Any]]:
        a = self._checked(actions)
        normals, uniforms = self._step_draws()
        speed = self._move(a)
        self._jaw(a, speed, uniforms[:, 0], uniforms[:, 1], normals[:, 6:8])
        return self._finish(normals[:, :6])

    # ----------------------------------------------------------------------------- step pieces
    def _checked(self, actions: np.ndarray) -> np.ndarray:
        if self._needs_reset:
            raise RuntimeError("call reset() before step()")
        a = np.asarray(actions, dtype=np.float64)
        if a.shape != (self.num_envs, ACT_DIM):
            raise ValueError(f"actions must have shape {(self.num_envs, ACT_DIM)}, got {a.shape}")
        if not np.all(np.isfinite(a)):
            raise ValueError("actions contain NaN or inf")
        return np.clip(a, -1.0, 1.0)

    def _move(self, a: np.ndarray) -> np.ndarray:
        """The robot's gain and bias act on the command; a held object moves along. Returns the
        speed (distance moved / ``MAX_DELTA``)."""
        before = self.gripper
        self.gripper = np.clip(
            before + (self._gain * a[:, :2] + self._bias) * MAX_DELTA, WORKSPACE_LOW, WORKSPACE_HIGH
        )
        moved = self.gripper - before
        self.object = np.where(self.holding[:, None], self.object + moved, self.object)
        return np.linalg.norm(moved, axis=1) / MAX_DELTA

    def _jaw(self, a: np.ndarray, speed: np.ndarray, grasp_luck: np.ndarray, slip_luck: np.ndarray,
             drop_noise: np.ndarray) -> None:
        """Jaw opening, grasp attempts and slips (see the module docstring)."""
        close = a[:, GRIPPER_ACTION] > 0.0
        carrying = self.holding & close
        release = self.holding & ~close
        closing = ~self.holding & close
        closed_to = self.opening - CLOSE_RATE
        attempt = closing & (self.opening > OBJECT_WIDTH) & (closed_to <= OBJECT_WIDTH)
        distance = np.linalg.norm(self.object - self.gripper, axis=1)
        reach = np.clip(
            (GRASP_REACH - distance - GRASP_SPEED_PENALTY * speed * MAX_DELTA) / (GRASP_REACH - GRASP_SURE),
            0.0,
            1.0,
        )
        grasped = attempt & (grasp_luck < (1.0 - self._miss) * reach)
        slipped = carrying & (slip_luck < self._slip * speed**2)

        opening = np.where(close, np.maximum(closed_to, 0.0), np.minimum(self.opening + OPEN_RATE, 1.0))
        opening = np.where(attempt & ~grasped, 0.0, opening)  # a miss snaps shut on nothing
        opening = np.where(grasped | (carrying & ~slipped), OBJECT_WIDTH, opening)
        opening = np.where(slipped, 0.0, opening)
        self.opening = opening
        self.holding = (self.holding & ~release & ~slipped) | grasped
        dropped = self.gripper + DROP_SCATTER * drop_noise
        self.object = np.where(slipped[:, None], np.clip(dropped, WORKSPACE_LOW, WORKSPACE_HIGH), self.object)

    def _finish(
        self, sensor_noise: np.ndarray
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, dict[str, Any]]:
        """Outcome, info, observation and same-step autoreset of the envs that ended."""
        self.elapsed += 1
        stage = self.stage()
        self.stage_reached = np.maximum(self.stage_reached, stage)
        success = self._success()
        terminated = success
        truncated = ~success & (self.elapsed >= self.cfg.max_steps)
        done = terminated | truncated
        info = self._info(stage, success)
        obs = self._observe(sensor_noise)
        info["final_obs"] = obs
        info["_final_obs"] = done
        if self.cameras is not None:
            self.cameras.draw()  # one draw a step, whoever finishes: a robot's frames never depend on the batch
        last_frames = self._last_frames(done)
        if done.any():
            self._reset_envs(done)
            obs = self._observe(sensor_noise)
        if self.cameras is not None:
            obs = self._with_images(obs, done)
            info["final_obs"] = self._final_with_images(info["final_obs"], obs, done, last_frames)
        return obs, success.astype(np.float32), terminated, truncated, info

    # ----------------------------------------------------------------------------- cameras
    def camera_bodies(self) -> list[Disc]:
        """What the cameras draw, bottom to top (a subclass with more bodies adds them)."""
        return [Disc(GOAL, self.goal, GOAL_RADIUS), Disc(OBJECT, self.object, OBJECT_RADIUS),
                gripper_disc(self.gripper, self.opening)]

    def _with_images(self, state: np.ndarray, fresh: np.ndarray) -> np.ndarray | dict[str, np.ndarray]:
        """Every robot's frames beside the state (the step's draws of noise and drops): a Dict
        observation; the state array alone without cameras. ``fresh``: envs starting an episode."""
        if self.cameras is None:
            return state
        rows = np.arange(self.num_envs)
        return {STATE_KEY: state, **self.cameras.capture(self.camera_bodies(), self.gripper, rows, fresh)}

    def _last_frames(self, done: np.ndarray) -> dict[str, np.ndarray]:
        """The frames an ending episode ends on, before its env resets (for ``info["final_obs"]``)."""
        if self.cameras is None or not done.any():
            return {}
        rows = np.flatnonzero(done)
        return self.cameras.capture(self.camera_bodies(), self.gripper, rows, np.zeros(len(rows), dtype=bool))

    def _final_with_images(self, state: np.ndarray, obs: dict[str, np.ndarray], done: np.ndarray,
                           last_frames: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        final: dict[str, np.ndarray] = {STATE_KEY: state}
        for key in self.cameras.keys if self.cameras is not None else ():
            frames = obs[key].copy()
            if key in last_frames:
                frames[done] = last_frames[key]
            final[key] = frames
        return final

    # ----------------------------------------------------------------------------- state views
    def stage(self) -> np.ndarray:
        """Current stage index per env (see ``STAGES``), from the true state.

        reach: object out of the jaw's reach; grasp: within reach, not held; carry: held, off the
        goal; place: on the goal (held, or resting there after release)."""
        near = np.linalg.norm(self.object - self.gripper, axis=1) <= GRASP_REACH
        at_goal = np.linalg.norm(self.object - self.goal, axis=1) <= GOAL_RADIUS
        # an object resting on the goal (released or dropped there) is still in the place stage
        return np.where(at_goal, PLACE, np.where(self.holding, CARRY, np.where(near, GRASP, REACH)))

    def _success(self) -> np.ndarray:
        at_goal = np.linalg.norm(self.object - self.goal, axis=1) <= GOAL_RADIUS
        return ~self.holding & at_goal & (self.opening > OBJECT_WIDTH)

    def _observe(self, noise: np.ndarray) -> np.ndarray:
        sensed = np.concatenate([self.gripper, self.object, self.goal], axis=1) + self._noise * noise
        grip, obj, goal = sensed[:, 0:2], sensed[:, 2:4], sensed[:, 4:6]
        obs = np.concatenate([grip, self.opening[:, None], obj, goal, obj - grip, goal - obj], axis=1)
        return np.clip(obs, -OBS_LIMIT, OBS_LIMIT).astype(np.float32)

    def _info(self, stage: np.ndarray, success: np.ndarray) -> dict[str, Any]:
        return {
            "stage": stage.astype(np.int64),
            "stage_reached": self.stage_reached.copy(),
            "success": success.copy(),
            "holding": self.holding.copy(),
            "elapsed": self.elapsed.copy(),
        }
