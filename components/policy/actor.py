"""Running a torch policy on a fleet: numpy observations in, numpy commands out.

Fleet learning needs exploration that can cover the fix (FERT-NOTES #1): with a deterministic
gripper command, successful episodes only repeat the policy's own choices. So during collection
the gripper command is *sampled* — Bernoulli(sigmoid(temperature · g)) — plus a small share of
random flips. Evaluation reports the thresholded policy unless told otherwise.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from torch import nn


@dataclass(frozen=True)
class GripperExploration:
    sample: bool = False
    flip_prob: float = 0.0
    temperature: float = 4.0


class PolicyActor:
    """Callable ``obs (B, n) -> actions (B, m)`` around a torch policy; deterministic given seed."""

    def __init__(
        self,
        policy: nn.Module,
        gripper_dim: int | None,
        exploration: GripperExploration = GripperExploration(),
        seed: int = 0,
        device: torch.device | str = "cpu",
    ) -> None:
        self.policy = policy.to(device).eval()
        self.device = torch.device(device)
        self.gripper_dim = gripper_dim
        self.exploration = exploration
        self.rng = np.random.default_rng(seed)

    @torch.no_grad()
    def __call__(self, obs: np.ndarray) -> np.ndarray:
        tensor = torch.as_tensor(np.asarray(obs, dtype=np.float32), device=self.device)
        actions = self.policy(tensor).float().cpu().numpy()
        if self.gripper_dim is None:
            return actions
        g = actions[:, self.gripper_dim]
        if self.exploration.sample:
            p_close = 1.0 / (1.0 + np.exp(-self.exploration.temperature * g))
            closed = self.rng.random(g.shape) < p_close
        else:
            closed = g > 0.0
        if self.exploration.flip_prob > 0.0:
            closed ^= self.rng.random(g.shape) < self.exploration.flip_prob
        actions[:, self.gripper_dim] = np.where(closed, 1.0, -1.0)
        return actions
