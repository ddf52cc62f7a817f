"""The default policy: a plain MLP from observation to action."""

from __future__ import annotations

import torch
from torch import nn

from components.config import PolicyConfig


class MLPPolicy(nn.Module):
    def __init__(self, obs_dim: int, act_dim: int, cfg: PolicyConfig) -> None:
        super().__init__()
        layers: list[nn.Module] = []
        width = obs_dim
        for _ in range(cfg.layers):
            layers += [nn.Linear(width, cfg.hidden), nn.GELU()]
            width = cfg.hidden
        layers.append(nn.Linear(width, act_dim))
        self.net = nn.Sequential(*layers)
        self.aux_loss = torch.zeros(())

    def forward(self, obs: torch.Tensor) -> torch.Tensor:
        return self.net(obs)
