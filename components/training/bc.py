"""The one weighted behaviour-cloning step, and the batches it is fed.

BC, success-filtered BC and FERT differ only in *which* frames go in and with what sampling
weight (``TrainingSet.weights``); every trainer of the project — the retrain flow's train task,
``dvc repro``'s train stage, expert-parallel ranks under torchrun and the FATS fleet trainer —
draws its batches with ``batch_indices`` and updates with ``bc_step``.

Batches are drawn with replacement, by weight (uniform when there are none), from a generator
seeded by ``(seed, iteration)`` alone: iteration ``i``'s batches never depend on which worker or
process draws them, or on what ran before, so every schedule of the training workflow gives the
same batches, and a run resumed at iteration ``i`` continues exactly.
"""

from __future__ import annotations

import hashlib
import math

import numpy as np
import torch
import torch.distributed as dist
from torch import nn

from components.policy.normalizer import NormalizedPolicy

BATCH_STREAM = 7  # keeps the batch stream apart from other seeded streams of the same seed


def iteration_seed(seed: int, iteration: int, stream: int = BATCH_STREAM) -> int:
    digest = hashlib.blake2b(repr((seed, stream, iteration)).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") % (2**63)


def batch_indices(n: int, weights: torch.Tensor | None, batch_size: int, steps: int, seed: int,
                  iteration: int) -> torch.Tensor:
    """``(steps, batch_size)`` frame indices for iteration ``iteration``, drawn with replacement."""
    generator = torch.Generator().manual_seed(iteration_seed(seed, iteration))
    if weights is None:
        return torch.randint(n, (steps, batch_size), generator=generator)
    flat = torch.multinomial(weights, steps * batch_size, replacement=True, generator=generator)
    return flat.view(steps, batch_size)


def bc_step(policy: NormalizedPolicy, optimizer: torch.optim.Optimizer, states: torch.Tensor,
            targets: torch.Tensor, global_batch: int | None = None, group: dist.ProcessGroup | None = None,
            dense: list[nn.Parameter] | None = None, mask: torch.Tensor | None = None) -> float:
    """One optimizer step on normalized-action MSE, or a mixture head's likelihood
    (``NormalizedPolicy.action_error``), + the policy's auxiliary loss; returns the loss.

    Alone (``group=None``) the loss is the batch mean. Expert-parallel, each rank passes its slice
    of the global batch: its squared error is divided by the *global* element count, so summing
    ``dense`` gradients over ranks (expert gradients arrive through the shuffle's backward) gives
    the gradient of the global loss, and the returned loss is the global one.

    A chunk policy's ``targets`` are (B, k, m) with ``mask`` (B, k): a masked target (past its
    episode's end, ``policy/history.gather_chunks``) adds nothing; the divisor stays the element
    count B * k * m, the same on every rank and plan, so a chunk starting near an episode's end
    weighs by the steps it has left.
    """
    total = (global_batch or len(states)) * targets[0].numel()
    error = policy.action_error(states, targets)
    if mask is not None:
        error = error * mask.unsqueeze(-1).to(error.dtype)
    loss = error.sum() / total + policy.aux_loss
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    value = loss.detach().clone()
    if group is not None:
        all_reduce_grads(dense or [], group)
        dist.all_reduce(value, group=group)
    optimizer.step()
    return float(value)


def all_reduce_grads(params: list[nn.Parameter], group: dist.ProcessGroup) -> None:
    """Sum gradients over ranks in one flat buffer (each rank's loss is its share of the global one)."""
    grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
    if not grads:
        return
    flat = torch.cat([g.reshape(-1) for g in grads])
    dist.all_reduce(flat, group=group)
    offset = 0
    for p, g in zip(params, grads, strict=True):
        p.grad = flat[offset: offset + g.numel()].view_as(g).clone()
        offset += g.numel()


def make_optimizer(policy: nn.Module, lr: float, weight_decay: float) -> torch.optim.Optimizer:
    return torch.optim.AdamW(policy.parameters(), lr=lr, weight_decay=weight_decay)


def scheduled_lr(lr: float, schedule: str, step: int, total: int) -> float:
    """The rate of optimizer step ``step`` (0-based) of a ``total``-step run: ``lr`` throughout
    (``constant``), or half a cosine from ``lr`` down to 0 at the last step (``cosine``). A pure
    function of the step, so every plan, and a resumed run, sets the same rate."""
    if schedule == "constant":
        return lr
    if schedule == "cosine":
        return 0.5 * lr * (1.0 + math.cos(math.pi * min(step, total) / total))
    raise ValueError(f"train.lr_schedule={schedule!r}: choose constant or cosine")


def total_steps(frames: int, batch_size: int, epochs: int) -> int:
    """Steps of a training run: ``epochs`` passes' worth of batches over ``frames``."""
    return max(1, frames // batch_size) * epochs


def as_weights(weights: np.ndarray | None) -> torch.Tensor | None:
    return None if weights is None else torch.as_tensor(weights, dtype=torch.float64)
