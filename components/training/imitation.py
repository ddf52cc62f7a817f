"""Supervised imitation: (weighted) behaviour cloning on state → action pairs.

BC, success-filtered BC and FERT differ only in *which* frames go in and with what sampling
weight; this loop is the same for all of them. Batches are drawn with replacement by weight
(uniform when no weights are given) from a seeded generator, so CPU runs reproduce bit for bit.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import torch
from torch import nn

from components.config import PolicyConfig, TrainConfig
from components.policy.factory import make_policy
from components.policy.normalizer import NormalizedPolicy
from components.training.determinism import resolve_device, seed_everything

ProgressFn = Callable[[int, int, float], None]  # (step, total_steps, loss)


@dataclass(frozen=True)
class TrainingSet:
    states: np.ndarray  # (N, n) float32
    actions: np.ndarray  # (N, m) float32
    weights: np.ndarray | None = None  # (N,) sampling weights, None = uniform

    def __post_init__(self) -> None:
        if self.states.ndim != 2 or self.actions.ndim != 2 or len(self.states) != len(self.actions):
            raise ValueError(
                f"training set: states {self.states.shape} and actions {self.actions.shape} must be "
                "(N, n) and (N, m) with the same N"
            )
        if len(self.states) == 0:
            raise ValueError("training set is empty: ingest episodes (or expert demos) before training")
        if self.weights is not None and (len(self.weights) != len(self.states) or (self.weights < 0).any()):
            raise ValueError("training set: weights must be (N,) and non-negative")


@dataclass
class TrainResult:
    policy: NormalizedPolicy
    losses: list[float] = field(default_factory=list)
    steps: int = 0
    seconds: float = 0.0
    device: str = "cpu"

    @property
    def final_loss(self) -> float:
        tail = self.losses[-20:]
        return float(np.mean(tail)) if tail else float("nan")


def train_imitation(
    data: TrainingSet,
    policy_cfg: PolicyConfig,
    train_cfg: TrainConfig,
    seed: int,
    device: str = "auto",
    init_policy: NormalizedPolicy | None = None,
    on_progress: ProgressFn | None = None,
) -> TrainResult:
    """Train a policy by (weighted) behaviour cloning; fine-tunes ``init_policy`` when given."""
    generator = seed_everything(seed)
    if train_cfg.threads > 0:
        torch.set_num_threads(train_cfg.threads)
    dev = resolve_device(device)
    obs_dim, act_dim = data.states.shape[1], data.actions.shape[1]
    states = torch.as_tensor(data.states, dtype=torch.float32)
    actions = torch.as_tensor(data.actions, dtype=torch.float32)

    if init_policy is None:
        policy = make_policy(obs_dim, act_dim, policy_cfg)
        policy.obs_norm.fit(states)
        policy.act_norm.fit(actions)
    else:
        policy = init_policy
    policy = policy.to(dev).train()
    states, actions = states.to(dev), actions.to(dev)
    targets = policy.act_norm.normalize(actions)

    optimizer = torch.optim.AdamW(policy.parameters(), lr=train_cfg.lr, weight_decay=train_cfg.weight_decay)
    n = len(states)
    steps_per_epoch = max(1, n // train_cfg.batch_size)
    total = steps_per_epoch * train_cfg.epochs
    probs = None if data.weights is None else torch.as_tensor(data.weights, dtype=torch.float64)

    result = TrainResult(policy=policy, device=str(dev))
    start = time.perf_counter()
    for step in range(total):
        if probs is None:
            idx = torch.randint(n, (train_cfg.batch_size,), generator=generator)
        else:
            idx = torch.multinomial(probs, train_cfg.batch_size, replacement=True, generator=generator)
        idx = idx.to(dev)
        pred = policy.forward_normalized(states[idx])
        loss = nn.functional.mse_loss(pred, targets[idx]) + policy.aux_loss
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        result.losses.append(float(loss.detach()))
        if on_progress is not None and (step % train_cfg.log_every == 0 or step == total - 1):
            on_progress(step + 1, total, result.losses[-1])
    result.steps = total
    result.seconds = time.perf_counter() - start
    policy.eval()
    return result
