"""How a fleet executes a policy: thresholded jaw (evaluation) or exploring (collection).

Fleet learning only improves on the policy if exploration covers the fix (see FERT notes): a
deterministic policy repeats its own choices forever, so its successes can only re-teach them.
``SampledGripper`` treats the jaw command ``g`` as a Bernoulli with ``p(close) = sigmoid(gain * g)``
and then flips it with a small probability; ``MotionNoise`` adds Gaussian noise to the motion
commands, so that the successes among many robots select motions that work where the policy's own
do not (a held-out robot's failures are mostly wrong motions at placements the demos never showed).
Every wrapper returns the executed command, which is what the robot logs as its action, and
passes ``end_episodes`` through to the policy it wraps (a policy with an observation history
restarts those envs' windows).
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from components.config import SimConfig
from components.sim.pickplace import GRIPPER_ACTION

Policy = Callable[[np.ndarray], np.ndarray]
EXPLORATION_STREAM = 4  # salt for the jaw-exploration generator
MOTION_STREAM = 5  # salt for the motion-exploration generator


def end_episodes(policy: Policy, envs: np.ndarray) -> None:
    """Tell ``policy`` (if it keeps per-env memory) that ``envs`` (bool mask) start a new episode."""
    hook = getattr(policy, "end_episodes", None)
    if hook is not None:
        hook(envs)


class _Wrapper:
    policy: Policy

    @property
    def sees_cameras(self) -> bool:
        """The wrapped policy's: a vision policy gets the simulator's Dict observation (sim/collect.py)."""
        return bool(getattr(self.policy, "sees_cameras", False))

    def end_episodes(self, envs: np.ndarray) -> None:
        end_episodes(self.policy, envs)


class ThresholdedGripper(_Wrapper):
    """Jaw command > 0 closes, else opens; motion passes through unchanged.

    ``gripper_index`` is the jaw's position in the action vector (the built-in task's by default).
    """

    def __init__(self, policy: Policy, gripper_index: int = GRIPPER_ACTION) -> None:
        self.policy = policy
        self.gripper_index = gripper_index

    def __call__(self, obs: np.ndarray) -> np.ndarray:
        actions = np.array(self.policy(obs), dtype=np.float32)
        g = self.gripper_index
        actions[:, g] = np.where(actions[:, g] > 0.0, 1.0, -1.0)
        return actions


class SampledGripper(_Wrapper):
    """Jaw close with probability sigmoid(gain * g), then flipped with ``flip_prob``."""

    def __init__(self, policy: Policy, cfg: SimConfig, seed: int, gripper_index: int = GRIPPER_ACTION) -> None:
        self.policy = policy
        self.gripper_index = gripper_index
        self.gain = cfg.gripper_sample_gain
        self.flip_prob = cfg.gripper_flip_prob
        self.rng = np.random.default_rng([seed, EXPLORATION_STREAM])

    def __call__(self, obs: np.ndarray) -> np.ndarray:
        actions = np.array(self.policy(obs), dtype=np.float32)
        g = actions[:, self.gripper_index].astype(np.float64)
        p_close = 1.0 / (1.0 + np.exp(-self.gain * g))
        close = self.rng.random(g.shape) < p_close
        flip = self.rng.random(g.shape) < self.flip_prob
        actions[:, self.gripper_index] = np.where(close ^ flip, 1.0, -1.0)
        return actions


class MotionNoise(_Wrapper):
    """Adds N(0, std) to every executed command but the jaw's, clipped to [-1, 1]."""

    def __init__(self, policy: Policy, std: float, seed: int, gripper_index: int = GRIPPER_ACTION) -> None:
        if std < 0:
            raise ValueError(f"sim.motion_noise_std={std} must be >= 0")
        self.policy = policy
        self.std = std
        self.gripper_index = gripper_index
        self.rng = np.random.default_rng([seed, MOTION_STREAM])

    def __call__(self, obs: np.ndarray) -> np.ndarray:
        actions = np.array(self.policy(obs), dtype=np.float32)
        motion = np.arange(actions.shape[1]) != self.gripper_index % actions.shape[1]
        noise = self.rng.standard_normal((actions.shape[0], int(motion.sum()))) * self.std
        actions[:, motion] = np.clip(actions[:, motion] + noise, -1.0, 1.0)
        return actions
