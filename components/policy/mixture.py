"""A Gaussian-mixture action head (``policy.head: gmm``): several modes per decision, the likeliest executed.

Trained by MSE, a policy predicts the *mean* action of the frames that look alike to it. Where the
expert switches sharply on its input (pack: close the jaw within 2 cm of the push point, step
toward the goal only once the fist is behind the container), the network's smooth fit blurs the
switch into a band of in-between actions that no demo took. A mixture head (robomimic's BC-GMM,
Bishop's mixture density network) fits ``mixtures`` diagonal Gaussians instead, by negative
log-likelihood, and executes the mean of the most probable one: on either side of a switch one
component wins outright, so the executed action switches as sharply as the expert's.

    core(obs) -> raw (B, K * (1 + 2m))  ->  logits (B, K), means (B, K, m), stds (B, K, m)
    forward(obs)              -> means[argmax logits]           (B, m): deterministic, what robots execute
    action_error(obs, target) -> NLL(target) / m per number      (B, m): summed by bc_step like squared errors

All in normalized action units (``NormalizedPolicy``). Each std is softplus(raw) + ``min_std``: a
jaw command takes two values only, and without a floor its std would shrink until the likelihood
overflows.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn


def mixture_outputs(act_dim: int, components: int) -> int:
    """Raw numbers the core must output per decision: a logit, m means and m stds per component."""
    return components * (1 + 2 * act_dim)


class MixtureHead(nn.Module):
    """Wraps a core whose output is ``mixture_outputs(act_dim, components)`` raw numbers."""

    def __init__(self, core: nn.Module, act_dim: int, components: int, min_std: float) -> None:
        super().__init__()
        if components < 1 or min_std <= 0:
            raise ValueError(f"policy.mixtures={components} must be >= 1 and policy.mixture_min_std={min_std} > 0")
        self.core, self.act_dim, self.components, self.min_std = core, act_dim, components, min_std

    @property
    def history(self) -> int:
        """The core's observation frames per decision (read through, never a copy)."""
        return int(getattr(self.core, "history", 1))

    @property
    def aux_loss(self) -> Tensor:
        return getattr(self.core, "aux_loss", torch.zeros(()))

    def mixture(self, obs: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """(logits (B, K), means (B, K, m), stds (B, K, m)) of ``obs``'s action distribution."""
        raw = self.core(obs)
        k, m = self.components, self.act_dim
        logits = raw[:, :k]
        means = raw[:, k: k + k * m].reshape(-1, k, m)
        stds = F.softplus(raw[:, k + k * m:].reshape(-1, k, m)) + self.min_std
        return logits, means, stds

    def forward(self, obs: Tensor) -> Tensor:
        logits, means, _ = self.mixture(obs)
        best = logits.argmax(dim=1)
        return means[torch.arange(len(means)), best]

    def action_error(self, obs: Tensor, targets: Tensor) -> Tensor:
        """(B, m): each decision's negative log-likelihood, spread evenly over its m numbers."""
        logits, means, stds = self.mixture(obs)
        z = (targets.unsqueeze(1) - means) / stds
        per_component = (-0.5 * z.square() - stds.log()).sum(dim=-1) - 0.5 * self.act_dim * math.log(2 * math.pi)
        nll = -torch.logsumexp(F.log_softmax(logits, dim=1) + per_component, dim=1)
        return (nll / self.act_dim).unsqueeze(-1).expand_as(targets)
