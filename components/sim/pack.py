"""A vectorized 2D pack task: pick an object, put it in a container, push the container to a goal.

The pick-and-place world (``pickplace.py``: point gripper, one-dof jaw, the same motion, grasp and
slip physics, the same per-robot quirks) plus a container (a disc) and the container's goal.

* **Insert.** An object released within ``sim.pack.container_radius`` of the container's centre
  is *in* the container; it rides along when the container moves. Released elsewhere, it rests
  on the table where it was let go (grasp it again).
* **Push.** A *closed* jaw that holds nothing (a fist) pushes the container: if the gripper ends a
  step closer than ``push_radius`` to the container's centre, the container is shoved along the
  gripper -> centre line until it touches the gripper again (a point pushing a disc), with some
  sideways drift (``push_scatter``, uneven friction). An open jaw, or one holding the object,
  passes over the container's rim. Pushed fast, the object may spill out beside the container
  (the robot's ``slip_rate`` x ``spill_scale`` x speed^2): put it back in and push on.
* **Success** (terminates, reward 1): the container rests within ``goal_radius`` of its goal with
  the object in it. At ``max_steps`` the episode is truncated: a failure.

Stages (``STAGES``): reach (object out of reach) -> grasp (within reach, not held) -> carry
(held, away from the container) -> insert (held over the container) -> approach (object in the
container, no fist in contact) -> push (a fist in contact, container off its goal) -> deliver
(container on its goal with the object in it; reaching it is success).

Layout per episode: the object around the robot's object region, the container around the robot's
goal region (``RobotProfile.goal_center``), the container's goal ``push_distance_min..max`` from
it in a direction +y +- ``push_angle_spread`` (mirrored back into the workspace where needed).
Randomness, seeding and same-step autoreset are those of ``PickPlaceVecEnv``.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from components.config import SimConfig
from components.sim.camera import (
    CONTAINER,
    CONTAINER_WALL,
    GOAL,
    OBJECT,
    OBJECT_RADIUS,
    Disc,
    gripper_disc,
)
from components.sim.pickplace import (
    GRASP_REACH,
    OBJECT_WIDTH,
    OBS_LIMIT,
    PLACE_HIGH,
    PLACE_LOW,
    PLACEMENT_HALF_WIDTH,
    START_HIGH,
    START_LOW,
    WORKSPACE_HIGH,
    WORKSPACE_LOW,
    PickPlaceVecEnv,
    kept_apart,
)

TASK = "pack"  # sim.task with sim.name: pack; the episodes' task label
STAGES: tuple[str, ...] = ("reach", "grasp", "carry", "insert", "approach", "push", "deliver")
REACH, GRASP, CARRY, INSERT, APPROACH, PUSH, DELIVER = range(len(STAGES))

CONTACT_MARGIN = 0.04  # a fist within push_radius + this of the container is in the push stage (the push point and a step or two of lost contact)
SPILL_GAP = 0.03  # a spilled object lands this far outside the container's rim, to one side
# the container and its goal lie this far inside the workspace, so the gripper can get behind it
# whatever the goal (sim.pack.push_distance_max is at most half this region's width)
CONTAINER_LOW, CONTAINER_HIGH = 0.15, 0.85

# observation layout
OBS_FIELDS: tuple[str, ...] = (
    "gripper_x", "gripper_y", "opening", "object_x", "object_y", "container_x", "container_y",
    "goal_x", "goal_y", "object_rel_x", "object_rel_y", "container_rel_object_x", "container_rel_object_y",
    "container_rel_x", "container_rel_y", "goal_rel_x", "goal_rel_y",
)  # fmt: skip
OBS_DIM = len(OBS_FIELDS)

# per-step random draws (columns of the step stream)
_SENSED = 8  # sensor-noise coordinates: gripper, object, container, goal
_DROP = slice(8, 10)
_SCATTER = 10
_SPILL_SIDE = 11
_GRASP_LUCK, _SLIP_LUCK, _SPILL_LUCK = 0, 1, 2
_RESET_UNIFORMS = 8  # gripper xy, object xy, container xy, push distance, push angle
GOAL_DIRECTION = np.pi / 2  # nominal push direction (+y); sim.pack.push_angle_spread widens it


class PackVecEnv(PickPlaceVecEnv):
    """One pack env per robot id, stepped together with numpy (the pick-place robots and physics,
    plus a container to fill and push)."""

    obs_dim = OBS_DIM
    sensed_coords = _SENSED
    step_normals = 12  # 8 sensor-noise coordinates + 2 drop scatter + push drift + spill side
    step_uniforms = 3  # grasp, slip, spill luck

    def __init__(self, cfg: SimConfig, robot_ids: list[str], seed: int = 0) -> None:
        if cfg.task != TASK:  # episodes carry sim.task: pack data must never be labelled pick-place
            raise ValueError(f"sim.task={cfg.task!r}: sim.name: pack runs the {TASK!r} task; set sim.task: {TASK}")
        self.pack = cfg.pack
        self.container = np.zeros((len(robot_ids), 2))
        super().__init__(cfg, robot_ids, seed)

    # ----------------------------------------------------------------------------- layout
    def _reset_envs(self, mask: np.ndarray) -> None:
        p = self.pack
        for i in np.flatnonzero(mask):
            u = self._reset_rngs[i].random(_RESET_UNIFORMS)
            self.gripper[i] = START_LOW + (START_HIGH - START_LOW) * u[0:2]
            self.object[i] = self._obj_center[i] + PLACEMENT_HALF_WIDTH * (2.0 * u[2:4] - 1.0)
            self.container[i] = self._goal_center[i] + PLACEMENT_HALF_WIDTH * (2.0 * u[4:6] - 1.0)
            distance = p.push_distance_min + (p.push_distance_max - p.push_distance_min) * u[6]
            angle = GOAL_DIRECTION + p.push_angle_spread * (2.0 * u[7] - 1.0)
            self.goal[i] = distance * np.array([np.cos(angle), np.sin(angle)])  # offset for now
        self.container[mask] = kept_apart(self.object[mask], self.container[mask])
        np.clip(self.object, PLACE_LOW, PLACE_HIGH, out=self.object)
        np.clip(self.container, CONTAINER_LOW, CONTAINER_HIGH, out=self.container)
        # the goal offset, mirrored on any axis where it would leave the container's region (an
        # offset of at most half the region's width leaves it on one side only)
        offset = self.goal[mask]
        out = (self.container[mask] + offset < CONTAINER_LOW) | (self.container[mask] + offset > CONTAINER_HIGH)
        self.goal[mask] = np.clip(self.container[mask] + np.where(out, -offset, offset), CONTAINER_LOW, CONTAINER_HIGH)
        self.opening[mask] = 1.0
        self.holding[mask] = False
        self.elapsed[mask] = 0
        self.stage_reached[mask] = REACH

    # ----------------------------------------------------------------------------- gym API
    def step(
        self, actions: np.ndarray
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, dict[str, Any]]:
        a = self._checked(actions)
        normals, uniforms = self._step_draws()
        speed = self._move(a)
        self._jaw(a, speed, uniforms[:, _GRASP_LUCK], uniforms[:, _SLIP_LUCK], normals[:, _DROP])
        self._push(speed, normals[:, _SCATTER], normals[:, _SPILL_SIDE], uniforms[:, _SPILL_LUCK])
        return self._finish(normals[:, :_SENSED])

    def _push(self, speed: np.ndarray, drift: np.ndarray, side: np.ndarray, spill_luck: np.ndarray) -> None:
        """A fist closer than ``push_radius`` shoves the container back to touching distance along
        the gripper -> centre line (plus sideways drift); an object in it rides along or spills."""
        p = self.pack
        inside = self.in_container()
        fist = ~self.holding & (self.opening < OBJECT_WIDTH)
        to_centre = self.container - self.gripper
        gap = np.linalg.norm(to_centre, axis=1)
        contact = fist & (gap < p.push_radius)
        line = to_centre / np.maximum(gap, 1e-9)[:, None]
        shoved = self.gripper + line * p.push_radius
        sideways = np.stack([-line[:, 1], line[:, 0]], axis=1)
        shift = np.linalg.norm(shoved - self.container, axis=1)
        shoved = shoved + sideways * (p.push_scatter * shift * drift)[:, None]
        shoved = np.clip(shoved, WORKSPACE_LOW, WORKSPACE_HIGH)
        moved = np.where(contact[:, None], shoved - self.container, 0.0)
        self.container = self.container + moved
        rides = inside & contact
        self.object = np.where(rides[:, None], np.clip(self.object + moved, WORKSPACE_LOW, WORKSPACE_HIGH), self.object)
        spilled = rides & (spill_luck < self._slip * p.spill_scale * speed**2)
        rim = self.container + sideways * np.where(side >= 0, 1.0, -1.0)[:, None] * (p.container_radius + SPILL_GAP)
        self.object = np.where(spilled[:, None], np.clip(rim, WORKSPACE_LOW, WORKSPACE_HIGH), self.object)

    def camera_bodies(self) -> list[Disc]:
        """The container's goal, the container (a ring: an object in it shows), the object, the gripper."""
        p = self.pack
        return [Disc(GOAL, self.goal, p.goal_radius),
                Disc(CONTAINER, self.container, p.container_radius, p.container_radius * (1.0 - CONTAINER_WALL)),
                Disc(OBJECT, self.object, OBJECT_RADIUS), gripper_disc(self.gripper, self.opening)]

    # ----------------------------------------------------------------------------- state views
    def in_container(self) -> np.ndarray:
        """The object rests (not held) within ``container_radius`` of the container's centre."""
        near = np.linalg.norm(self.object - self.container, axis=1) <= self.pack.container_radius
        return ~self.holding & near

    def stage(self) -> np.ndarray:
        """Current stage index per env (see ``STAGES``), from the true state."""
        p = self.pack
        inside = self.in_container()
        near_object = np.linalg.norm(self.object - self.gripper, axis=1) <= GRASP_REACH
        over = np.linalg.norm(self.object - self.container, axis=1) <= p.container_radius
        fist = ~self.holding & (self.opening < OBJECT_WIDTH)
        contact = fist & (np.linalg.norm(self.container - self.gripper, axis=1) <= p.push_radius + CONTACT_MARGIN)
        at_goal = np.linalg.norm(self.container - self.goal, axis=1) <= p.goal_radius
        loose = np.where(near_object, GRASP, REACH)
        held = np.where(over, INSERT, CARRY)
        packed = np.where(at_goal, DELIVER, np.where(contact, PUSH, APPROACH))
        return np.where(inside, packed, np.where(self.holding, held, loose))

    def _success(self) -> np.ndarray:
        at_goal = np.linalg.norm(self.container - self.goal, axis=1) <= self.pack.goal_radius
        return self.in_container() & at_goal

    def _observe(self, noise: np.ndarray) -> np.ndarray:
        bodies = np.concatenate([self.gripper, self.object, self.container, self.goal], axis=1)
        sensed = bodies + self._noise * noise
        grip, obj, box, goal = sensed[:, 0:2], sensed[:, 2:4], sensed[:, 4:6], sensed[:, 6:8]
        obs = np.concatenate(
            [grip, self.opening[:, None], obj, box, goal, obj - grip, box - obj, box - grip, goal - box], axis=1
        )
        return np.clip(obs, -OBS_LIMIT, OBS_LIMIT).astype(np.float32)

    def _info(self, stage: np.ndarray, success: np.ndarray) -> dict[str, Any]:
        info = super()._info(stage, success)
        info["in_container"] = self.in_container()
        return info

