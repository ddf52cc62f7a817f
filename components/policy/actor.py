"""Running a torch policy on a fleet: numpy observations in, numpy commands out.

How the gripper command is *executed* (sampled during collection, thresholded in evaluation)
is the simulator's concern: wrap an actor in ``components.sim.exploration``.

A policy with an observation history (``policy.history`` > 1) gets each env's window from a
rolling buffer (``policy/history.FrameHistory``, the training rule); the fleet loop tells the
actor which envs start a new episode through ``end_episodes`` (``sim/collect.py`` does).
"""

from __future__ import annotations

import numpy as np
import torch
from torch import nn

from components.policy.history import FrameHistory


class PolicyActor:
    """Callable ``obs (B, n) -> actions (B, m)`` around a torch policy, in eval mode, no grad."""

    def __init__(self, policy: nn.Module, device: torch.device | str = "cpu") -> None:
        self.device = torch.device(device)
        self.policy = policy.to(self.device).eval()
        history = int(getattr(policy, "history", 1))
        self.frames = FrameHistory(history) if history > 1 else None

    def end_episodes(self, envs: np.ndarray) -> None:
        """Envs (mask or indices) whose next observation is a new episode's first frame."""
        if self.frames is not None:
            self.frames.restart(envs)

    @torch.no_grad()
    def __call__(self, obs: np.ndarray) -> np.ndarray:
        obs = np.asarray(obs, dtype=np.float32)
        if self.frames is not None:
            obs = self.frames.push(obs)
        tensor = torch.as_tensor(obs, device=self.device)
        return self.policy(tensor).float().cpu().numpy()
