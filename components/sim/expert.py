"""A scripted expert for the pick-and-place task: a memoryless function of the observation.

It sees only what any policy sees (noisy positions and the jaw opening) and reads the phase
off the jaw sensor: opening == OBJECT_WIDTH means holding, 0 means closed on nothing.

    holding, object over the goal -> open (place)
    holding                       -> move the object toward the goal, keep closed (carry)
    closed on nothing             -> open while moving back to the object (recover)
    open, object within reach     -> close while centring on it, and keep closing (grasp)
    open                          -> move to the object (reach)
"""

from __future__ import annotations

import numpy as np

from components.sim.pickplace import ACT_DIM, MAX_DELTA, OBJECT_WIDTH, OBS_FIELDS

HOLD_TOLERANCE = 0.05  # |opening - OBJECT_WIDTH| below this reads as holding
CLOSE_WITHIN = 0.05  # start closing (the jaw takes two steps) when the object is this close...
KEEP_CLOSING_WITHIN = 0.06  # ...and, once the jaw is moving, keep closing within this
RELEASE_WITHIN = 0.02  # open when the sensed object is this close to the goal
STEER_GAIN = 1.0  # fraction of the sensed error corrected per step

_OPENING = OBS_FIELDS.index("opening")
_OBJ_REL = slice(OBS_FIELDS.index("object_rel_x"), OBS_FIELDS.index("object_rel_y") + 1)
_GOAL_REL = slice(OBS_FIELDS.index("goal_rel_x"), OBS_FIELDS.index("goal_rel_y") + 1)


class ScriptedExpert:
    """``expert(obs (B, obs_dim)) -> actions (B, 3)``; solves the task across robots."""

    def __call__(self, obs: np.ndarray) -> np.ndarray:
        obs = np.asarray(obs, dtype=np.float64)
        opening = obs[:, _OPENING]
        to_object = obs[:, _OBJ_REL]
        object_to_goal = obs[:, _GOAL_REL]
        holding = np.abs(opening - OBJECT_WIDTH) < HOLD_TOLERANCE
        closed_empty = ~holding & (opening < OBJECT_WIDTH)
        distance = np.linalg.norm(to_object, axis=1)
        jaw_moving = ~holding & ~closed_empty & (opening < 1.0)
        near = (distance < CLOSE_WITHIN) | (jaw_moving & (distance < KEEP_CLOSING_WITHIN))
        over_goal = np.linalg.norm(object_to_goal, axis=1) < RELEASE_WITHIN

        target = np.where(holding[:, None], object_to_goal, to_object)
        target = np.where((holding & over_goal)[:, None], 0.0, target)
        close = (holding & ~over_goal) | (~holding & ~closed_empty & near)

        actions = np.empty((obs.shape[0], ACT_DIM), dtype=np.float32)
        actions[:, :2] = np.clip(STEER_GAIN * target / MAX_DELTA, -1.0, 1.0)
        actions[:, 2] = np.where(close, 1.0, -1.0)
        return actions
