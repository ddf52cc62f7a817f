"""Per-dimension standardization stored inside the model, so a saved policy is self-contained."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from components.policy.observation import PIXEL_SCALE, ObservationLayout

# Dimensions with (almost) no spread keep unit scale instead of blowing up.
MIN_STD = 1e-3


class Normalizer(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.register_buffer("mean", torch.zeros(dim))
        self.register_buffer("std", torch.ones(dim))

    @torch.no_grad()
    def fit(self, data: torch.Tensor) -> None:
        self.mean.copy_(data.mean(dim=0))
        self.std.copy_(data.std(dim=0).clamp_min(MIN_STD))

    def normalize(self, x: torch.Tensor) -> torch.Tensor:
        return (x - self.mean) / self.std

    def denormalize(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.std + self.mean


class NormalizedPolicy(nn.Module):
    """Wraps a core policy that works in normalized units: raw observation in, raw action out.

    Training losses are computed on ``core`` outputs against normalized targets, so every action
    dimension counts equally whatever its physical scale. ``obs`` is (B, n), or for a core with an
    observation history (``history`` > 1) also windows (B, history, n) built by
    ``policy/history.py``; a plain (B, n) is then a window at an episode's first step.

    ``binary_jaw`` (``policy.head: binary_jaw``): the last action number is a jaw command that
    closes when > 0 (every built-in sim's). The core's last output is then a close logit, trained by
    cross-entropy against the demo's open/close, and executed as ``2 sigmoid(logit) - 1`` (the
    expected command, in [-1, 1], what the collection sampler and the thresholded evaluation read).
    """

    def __init__(self, core: nn.Module, obs_dim: int, act_dim: int, binary_jaw: bool = False) -> None:
        super().__init__()
        self.core = core
        self.obs_norm = Normalizer(obs_dim)
        self.act_norm = Normalizer(act_dim)
        self.obs_dim = obs_dim
        self.act_dim = act_dim
        self.binary_jaw = binary_jaw

    @property
    def history(self) -> int:
        """Observation frames per decision (1 for cores without a history)."""
        return int(getattr(self.core, "history", 1))

    @property
    def chunk(self) -> int:
        """Actions per decision: a chunk core's forward is (B, chunk, m); 1 = (B, m)."""
        return int(getattr(self.core, "chunk", 1))

    @property
    def chunk_execution(self) -> tuple[int, float]:
        """(replan_every, ensemble_decay) a chunk core was built with (``policy/ensemble.py``)."""
        return int(getattr(self.core, "replan_every", 1)), float(getattr(self.core, "ensemble_decay", 0.0))

    @property
    def layout(self) -> ObservationLayout:
        """Where the state and each camera's pixels sit in an observation (no cameras: the state alone)."""
        return getattr(self.core, "layout", None) or ObservationLayout(self.obs_dim)

    @property
    def state_dim(self) -> int:
        """Numbers of the robot's state in an observation (``obs_dim`` less any camera pixels)."""
        return self.layout.state_dim

    @property
    def sees_cameras(self) -> bool:
        """Whether the policy takes packed camera frames (``policy/observation.py``); read by the sim loops."""
        return bool(self.layout.cameras)

    @torch.no_grad()
    def fit(self, states: torch.Tensor, actions: torch.Tensor) -> None:
        """Fit the normalizers on a training set's states and actions; pixels get the fixed
        0..255 -> [-1, 1] scale (``PIXEL_SCALE``), the same whatever the data."""
        n = self.layout.state_dim
        self.obs_norm.mean.fill_(PIXEL_SCALE)
        self.obs_norm.std.fill_(PIXEL_SCALE)
        self.obs_norm.mean[:n] = states.mean(dim=0)
        self.obs_norm.std[:n] = states.std(dim=0).clamp_min(MIN_STD)
        self.act_norm.fit(actions)

    @property
    def aux_loss(self) -> torch.Tensor:
        return getattr(self.core, "aux_loss", torch.zeros(()))

    def forward_normalized(self, obs: torch.Tensor) -> torch.Tensor:
        return self.core(self.obs_norm.normalize(obs))

    def action_error(self, obs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """The trained loss of each predicted number, shaped like the normalized ``targets``: the
        squared error, or the core's own (a mixture head's likelihood: ``policy/mixture.py``)."""
        if hasattr(self.core, "action_error"):
            return self.core.action_error(self.obs_norm.normalize(obs), targets)
        pred = self.forward_normalized(obs)
        if pred.shape != targets.shape:
            raise ValueError(f"policy predicts {tuple(pred.shape)} but the targets are {tuple(targets.shape)}: "
                             "a chunk policy (policy.kind: chunk_transformer) trains on gather_chunks targets")
        if not self.binary_jaw:
            return (pred - targets).square()
        closes = (self.act_norm.denormalize(targets)[..., -1:] > 0).to(pred.dtype)
        jaw = F.binary_cross_entropy_with_logits(pred[..., -1:], closes, reduction="none")
        return torch.cat([(pred[..., :-1] - targets[..., :-1]).square(), jaw], dim=-1)

    def forward(self, obs: torch.Tensor) -> torch.Tensor:
        out = self.forward_normalized(obs)
        actions = self.act_norm.denormalize(out)
        if not self.binary_jaw:
            return actions
        return torch.cat([actions[..., :-1], torch.tanh(out[..., -1:] / 2)], dim=-1)
