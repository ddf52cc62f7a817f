"""The pack task's scripted expert: a memoryless function of the observation.

Until the object is in the container it *is* the pick-and-place expert (``ScriptedExpert``), with
the container as the goal: reach, grasp, carry, release over the container, recover from misses
and slips. Once the sensed object lies in the container it pushes:

    open jaw                      -> go to the push point (behind the container, seen from its
                                     goal); close there (a fist)
    fist, behind the container    -> step toward the goal, keeping the container on the line
    fist, not behind it           -> clear of the container and on its far side from the goal: move
                                     to the push point; else open in place (a fist moving around
                                     the container would shove it)
"""

from __future__ import annotations

import numpy as np

from components.config import PackConfig
from components.sim import pickplace as pp
from components.sim.expert import HOLD_TOLERANCE, ScriptedExpert
from components.sim.pack import OBS_FIELDS

# the sensed object counts as in the container within container_radius + this: lenient, as sensor
# noise would flip a tight test back and forth; an object left just outside stays behind when the
# container moves, and is then picked up again
INSIDE_MARGIN = 0.01
STANDOFF = 0.03  # the push point lies this far beyond push_radius: the fist closes out of the object's reach
AT_PUSH_POINT = 0.02  # close the jaw within this of the push point ...
KEEP_CLOSING_WITHIN = 0.04  # ... and, once it is closing, keep closing within this
ALIGN_TOLERANCE = 0.04  # a fist this far off the container -> goal line is no longer behind it (~3 noise std)
ALIGN_SLACK = 0.03  # ... nor one farther behind than the push point plus this
CLEARANCE = 0.02  # a fist farther than push_radius + this from the container may move around behind it

_idx = OBS_FIELDS.index
_OPENING = _idx("opening")
_OBJ_REL = slice(_idx("object_rel_x"), _idx("object_rel_y") + 1)
_BOX_REL_OBJ = slice(_idx("container_rel_object_x"), _idx("container_rel_object_y") + 1)
_BOX_REL = slice(_idx("container_rel_x"), _idx("container_rel_y") + 1)
_GOAL_REL = slice(_idx("goal_rel_x"), _idx("goal_rel_y") + 1)
_GRIPPER = slice(_idx("gripper_x"), _idx("gripper_y") + 1)
_OBJECT = slice(_idx("object_x"), _idx("object_y") + 1)
_BOX = slice(_idx("container_x"), _idx("container_y") + 1)


def as_pickplace(obs: np.ndarray) -> np.ndarray:
    """The pick-and-place observation of the same scene with the container as the goal."""
    out = np.empty((obs.shape[0], pp.OBS_DIM), dtype=obs.dtype)
    out[:, 0:2] = obs[:, _GRIPPER]
    out[:, 2] = obs[:, _OPENING]
    out[:, 3:5] = obs[:, _OBJECT]
    out[:, 5:7] = obs[:, _BOX]
    out[:, 7:9] = obs[:, _OBJ_REL]
    out[:, 9:11] = obs[:, _BOX_REL_OBJ]
    return out


class PackExpert:
    """``expert(obs (B, 17)) -> actions (B, 3)``; solves the pack task across robots."""

    def __init__(self, cfg: PackConfig) -> None:
        self.cfg = cfg
        self.pick = ScriptedExpert()

    def __call__(self, obs: np.ndarray) -> np.ndarray:
        obs = np.asarray(obs, dtype=np.float64)
        actions = self.pick(as_pickplace(obs))
        opening = obs[:, _OPENING]
        holding = np.abs(opening - pp.OBJECT_WIDTH) < HOLD_TOLERANCE
        inside = ~holding & (np.linalg.norm(obs[:, _BOX_REL_OBJ], axis=1) < self.cfg.container_radius + INSIDE_MARGIN)
        push = self._push(obs, opening, holding)
        return np.where(inside[:, None], push, actions).astype(np.float32)

    def _push(self, obs: np.ndarray, opening: np.ndarray, holding: np.ndarray) -> np.ndarray:
        c = self.cfg
        box_rel = obs[:, _BOX_REL]  # container - gripper
        goal_rel = obs[:, _GOAL_REL]  # goal - container
        to_goal = np.linalg.norm(goal_rel, axis=1)
        u = goal_rel / np.maximum(to_goal, 1e-9)[:, None]
        behind = c.push_radius + STANDOFF
        to_point = box_rel - u * behind  # push point - gripper
        along = np.sum(box_rel * u, axis=1)
        lateral = np.linalg.norm(box_rel - along[:, None] * u, axis=1)
        fist = ~holding & (opening < pp.OBJECT_WIDTH)
        closing = ~holding & ~fist & (opening < 1.0)
        aligned = (lateral < ALIGN_TOLERANCE) & (along > 0.0) & (along < behind + ALIGN_SLACK)

        step = np.minimum(to_goal, pp.MAX_DELTA)[:, None]
        shove = box_rel + u * (step - c.push_radius)  # where the gripper must go for the container to move `step`
        at_point = np.linalg.norm(to_point, axis=1)
        close_now = (at_point < AT_PUSH_POINT) | (closing & (at_point < KEEP_CLOSING_WITHIN))

        clear = (along > 0.0) & (np.linalg.norm(box_rel, axis=1) > c.push_radius + CLEARANCE)
        stuck = fist & ~aligned & ~clear  # must open before moving
        motion = np.where((fist & aligned)[:, None], shove, np.where(stuck[:, None], 0.0, to_point))
        close = (fist & ~stuck) | (~fist & close_now)
        out = np.empty((obs.shape[0], pp.ACT_DIM))
        command = motion / pp.MAX_DELTA
        # scaled, not clipped per axis: a push goes where it is aimed
        out[:, :2] = command / np.maximum(np.abs(command).max(axis=1), 1.0)[:, None]
        out[:, 2] = np.where(close, 1.0, -1.0)
        return out
