"""Running a torch policy on a fleet: numpy observations in, numpy commands out.

How the gripper command is *executed* (sampled during collection, thresholded in evaluation)
is the simulator's concern: wrap an actor in ``components.sim.exploration``.
"""

from __future__ import annotations

import numpy as np
import torch
from torch import nn


class PolicyActor:
    """Callable ``obs (B, n) -> actions (B, m)`` around a torch policy, in eval mode, no grad."""

    def __init__(self, policy: nn.Module, device: torch.device | str = "cpu") -> None:
        self.device = torch.device(device)
        self.policy = policy.to(self.device).eval()

    @torch.no_grad()
    def __call__(self, obs: np.ndarray) -> np.ndarray:
        tensor = torch.as_tensor(np.asarray(obs, dtype=np.float32), device=self.device)
        return self.policy(tensor).float().cpu().numpy()
