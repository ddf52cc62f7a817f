"""ACT-style action chunks: a transformer over the observation history that predicts the next k actions.

    window (B, H, n) of normalized observations (``policy/history.py``'s rule; a bare (B, n) is a
    window at an episode's first step)
    -> H frame tokens (linear embedding + learned position) and k learned action queries
    -> ``layers`` pre-norm blocks [self-attention over all H + k tokens, feed-forward]
    -> each query's token -> one action: the chunk (B, k, m) for steps t, t+1, ..., t+k-1

The feed-forward is dense (``policy.chunk_ffn: dense``: GELU MLP of width ``hidden``) or the
mixture of experts of ``moe.py`` (``moe``: the same router, capacity, router losses and, once
``moe.enable_expert_parallel`` shards it, the fused shuffle). Training (``training/bc.py``) regresses
the chunk onto the recorded actions t .. t+k-1 of t's own episode; targets past the episode's end
are masked (``history.gather_chunks``). Executing a chunk (temporal ensembling, re-planning) is the
caller's job (``policy/ensemble.py``): the model stays stateless, as the history policies do.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from components.config import PolicyConfig
from components.policy.moe import POSITION_INIT_STD, MoEFeedForward, RouterLosses


class DenseFeedForward(nn.Module):
    """Two-layer GELU MLP with the MoE layer's call signature (no router losses)."""

    def __init__(self, d_model: int, hidden: int) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(d_model, hidden), nn.Linear(hidden, d_model)

    def forward(self, x: Tensor) -> tuple[Tensor, RouterLosses]:
        zero = x.new_zeros(())
        return self.fc2(F.gelu(self.fc1(x))), RouterLosses(zero, zero)


class ChunkBlock(nn.Module):
    def __init__(self, cfg: PolicyConfig) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(cfg.d_model)
        self.attn = nn.MultiheadAttention(cfg.d_model, cfg.heads, batch_first=True)
        self.ln2 = nn.LayerNorm(cfg.d_model)
        self.ffn = (MoEFeedForward(cfg.d_model, cfg.hidden, cfg.num_experts, cfg.top_k, cfg.capacity_factor)
                    if cfg.chunk_ffn == "moe" else DenseFeedForward(cfg.d_model, cfg.hidden))

    def forward(self, h: Tensor) -> tuple[Tensor, RouterLosses]:
        a = self.ln1(h)
        h = h + self.attn(a, a, a, need_weights=False)[0]
        y, losses = self.ffn(self.ln2(h).reshape(-1, h.shape[-1]))
        return h + y.view_as(h), losses


class ChunkTransformerPolicy(nn.Module):
    """Policy interface: ``forward(obs (B, n) or window (B, history, n)) -> chunk (B, chunk, m)``;
    ``aux_loss`` = the weighted router losses of the last forward (0 for the dense feed-forward)."""

    def __init__(self, obs_dim: int, act_dim: int, cfg: PolicyConfig) -> None:
        super().__init__()
        if cfg.d_model % cfg.heads:
            raise ValueError(f"policy: d_model={cfg.d_model} must be a multiple of heads={cfg.heads}")
        self.obs_dim, self.history, self.chunk = obs_dim, cfg.history, cfg.chunk_size
        # how the chunks run (``policy/ensemble.py``): travels with the saved model, so a registry
        # model executes as configured when it was trained (``PolicyActor(execution=...)`` overrides)
        self.replan_every, self.ensemble_decay = cfg.replan_every, cfg.ensemble_decay
        self.embed = nn.Linear(obs_dim, cfg.d_model)
        self.position = nn.Parameter(torch.randn(cfg.history, cfg.d_model) * POSITION_INIT_STD)
        self.queries = nn.Parameter(torch.randn(cfg.chunk_size, cfg.d_model) * POSITION_INIT_STD)
        self.blocks = nn.ModuleList(ChunkBlock(cfg) for _ in range(cfg.layers))
        self.norm = nn.LayerNorm(cfg.d_model)
        self.head = nn.Linear(cfg.d_model, act_dim)
        self.aux_loss_weight, self.z_loss_weight = cfg.aux_loss_weight, cfg.z_loss_weight
        self.aux_loss = torch.zeros(())
        self.router_losses = RouterLosses(torch.zeros(()), torch.zeros(()))

    def windows(self, obs: Tensor) -> Tensor:
        """(B, n) -> (B, history, n), the frame repeated (an episode's first step); (B, history, n) as is."""
        if obs.dim() == 2 and obs.shape[1] == self.obs_dim:
            return obs.unsqueeze(1).expand(-1, self.history, -1)
        if obs.dim() == 3 and obs.shape[1:] == (self.history, self.obs_dim):
            return obs
        raise ValueError(f"ChunkTransformerPolicy: expected obs (B, {self.obs_dim}) or windows "
                         f"(B, {self.history}, {self.obs_dim}) (policy.history), got {tuple(obs.shape)}")

    def forward(self, obs: Tensor) -> Tensor:
        frames = self.embed(self.windows(obs)) + self.position
        h = torch.cat([frames, self.queries.expand(len(frames), -1, -1)], dim=1)
        balance, z = obs.new_zeros(()), obs.new_zeros(())
        for block in self.blocks:
            h, losses = block(h)
            balance, z = balance + losses.balance, z + losses.z
        self.router_losses = RouterLosses(balance.detach(), z.detach())
        self.aux_loss = self.aux_loss_weight * balance + self.z_loss_weight * z
        return self.head(self.norm(h[:, self.history:]))
