"""Transformer policy whose feed-forward is a mixture of experts (top-k routing, Switch balance loss).

    obs (B, n) -> `context` feature tokens (each a group of ceil(n / context) dims, learned
    embedding + position) -> `layers` pre-norm blocks [self-attention, MoE feed-forward]
    -> mean-pool -> action (B, m)

The MoE feed-forward runs the dense single-process path (every expert local, ascending expert
order) until ``enable_expert_parallel`` shards its experts over a process group; from then on
tokens reach their experts through a shuffle dispatcher (``components.shuffle``: fused, or a
baseline by config). The routing, expert math and balance loss are the same on both paths, so a
model trained expert-parallel loads into the single-process model unchanged (after
``full_expert_state`` gathers the shards).
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn

from components.config import PolicyConfig, ShuffleConfig
from components.shuffle.dispatchers import Dispatcher, make_dispatcher
from components.shuffle.routing import Placement, Routing


class Experts(nn.Module):
    """``num_experts`` two-layer GELU MLPs as stacked weights; after ``shard`` only a contiguous slice."""

    def __init__(self, num_experts: int, d_model: int, hidden: int) -> None:
        super().__init__()
        self.w1 = nn.Parameter(torch.empty(num_experts, d_model, hidden))
        self.b1 = nn.Parameter(torch.empty(num_experts, hidden))
        self.w2 = nn.Parameter(torch.empty(num_experts, hidden, d_model))
        self.b2 = nn.Parameter(torch.empty(num_experts, d_model))
        for w, b, fan_in in ((self.w1, self.b1, d_model), (self.w2, self.b2, hidden)):
            bound = 1.0 / math.sqrt(fan_in)  # nn.Linear's default init
            nn.init.uniform_(w, -bound, bound)
            nn.init.uniform_(b, -bound, bound)

    def expert(self, local: int, x: Tensor) -> Tensor:
        return F.gelu(x @ self.w1[local] + self.b1[local]) @ self.w2[local] + self.b2[local]

    def forward(self, x: Tensor, tokens_per_expert: tuple[int, ...]) -> Tensor:
        """Expert-major rows: the first tokens_per_expert[0] rows go to local expert 0, and so on."""
        parts = [self.expert(l, rows) for l, rows in enumerate(x.split(list(tokens_per_expert))) if rows.shape[0]]
        return torch.cat(parts) if parts else x.new_zeros(0, self.w2.shape[2]) + 0 * x.sum()

    def shard(self, rank: int, world: int) -> None:
        """Keep only this rank's experts (contiguous block ``rank``)."""
        n = self.w1.shape[0] // world
        for name in ("w1", "b1", "w2", "b2"):
            full = getattr(self, name)
            setattr(self, name, nn.Parameter(full.detach()[rank * n : (rank + 1) * n].clone()))


class MoEFeedForward(nn.Module):
    """Router (softmax, top-k, renormalized) + experts; returns (output, balance loss share)."""

    def __init__(self, d_model: int, hidden: int, num_experts: int, top_k: int) -> None:
        super().__init__()
        if not 1 <= top_k <= num_experts:
            raise ValueError(f"policy.top_k={top_k} must lie in [1, policy.num_experts={num_experts}]")
        self.num_experts, self.top_k = num_experts, top_k
        self.router = nn.Linear(d_model, num_experts, bias=False)
        self.experts = Experts(num_experts, d_model, hidden)
        self.dispatcher: Dispatcher | None = None
        self.group: dist.ProcessGroup | None = None

    def enable_expert_parallel(self, group: dist.ProcessGroup, cfg: ShuffleConfig) -> None:
        world, rank = dist.get_world_size(group), dist.get_rank(group)
        ranks_per_node = cfg.ranks_per_node or world
        placement = Placement(self.num_experts, world, ranks_per_node)
        self.experts.shard(rank, world)
        self.dispatcher = make_dispatcher(placement, group, cfg)
        self.group = group

    def forward(self, x: Tensor) -> tuple[Tensor, Tensor]:
        scores = torch.softmax(self.router(x), dim=-1)
        top_p, top_i = scores.topk(self.top_k, dim=-1)
        routing = Routing(top_i, top_p / top_p.sum(dim=-1, keepdim=True))
        if self.dispatcher is None:
            out = self._dense(x, routing)
        else:
            d = self.dispatcher.dispatch(x, routing)
            out = self.dispatcher.combine(self.experts(d.x, d.tokens_per_expert), d.handle)
        return out, self._balance_loss(scores, top_i)

    def _dense(self, x: Tensor, routing: Routing) -> Tensor:
        """Every expert local, in ascending expert order (the order the fused shuffle reproduces)."""
        out = torch.zeros_like(x)
        for e in range(self.num_experts):
            tok, k = (routing.expert_ids == e).nonzero(as_tuple=True)
            if tok.numel():
                out = out.index_add(0, tok, self.experts.expert(e, x[tok]) * routing.probs[tok, k].unsqueeze(1))
        return out

    def _balance_loss(self, scores: Tensor, top_i: Tensor) -> Tensor:
        """Switch loss E * sum_e f_e * P_e over the *global* batch; this rank returns its additive share.

        f_e (fraction of assignments to e) and the token count are all-reduced; P_e's sum is
        local, so the shares of all ranks add up to the loss a single process computes.
        """
        stats = torch.cat([torch.bincount(top_i.reshape(-1), minlength=self.num_experts).to(scores.dtype),
                           scores.new_tensor([scores.shape[0]])])
        if self.group is not None:
            dist.all_reduce(stats, group=self.group)
        counts, tokens = stats[:-1], stats[-1].clamp_min(1)
        fraction = counts / (tokens * self.top_k)
        return self.num_experts * (fraction * scores.sum(dim=0)).sum() / tokens


class Block(nn.Module):
    def __init__(self, d_model: int, heads: int, hidden: int, num_experts: int, top_k: int) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(d_model)
        self.attn = nn.MultiheadAttention(d_model, heads, batch_first=True)
        self.ln2 = nn.LayerNorm(d_model)
        self.moe = MoEFeedForward(d_model, hidden, num_experts, top_k)

    def forward(self, h: Tensor) -> tuple[Tensor, Tensor]:
        a = self.ln1(h)
        h = h + self.attn(a, a, a, need_weights=False)[0]
        y, aux = self.moe(self.ln2(h).reshape(-1, h.shape[-1]))
        return h + y.view_as(h), aux


class MoETransformerPolicy(nn.Module):
    """Policy interface: ``forward(obs (B, obs_dim)) -> (B, act_dim)``; ``aux_loss`` = weighted balance loss."""

    def __init__(self, obs_dim: int, act_dim: int, cfg: PolicyConfig) -> None:
        super().__init__()
        if cfg.context < 1 or cfg.d_model % cfg.heads:
            raise ValueError(
                f"policy: context={cfg.context} must be >= 1 and d_model={cfg.d_model} a multiple of heads={cfg.heads}"
            )
        self.obs_dim, self.tokens = obs_dim, cfg.context
        self.dims_per_token = -(-obs_dim // cfg.context)
        self.embed = nn.Linear(self.dims_per_token, cfg.d_model)
        self.position = nn.Parameter(torch.randn(cfg.context, cfg.d_model) * 0.02)
        self.blocks = nn.ModuleList(
            Block(cfg.d_model, cfg.heads, cfg.hidden, cfg.num_experts, cfg.top_k) for _ in range(cfg.layers)
        )
        self.norm = nn.LayerNorm(cfg.d_model)
        self.head = nn.Linear(cfg.d_model, act_dim)
        self.aux_loss_weight = cfg.aux_loss_weight
        self.aux_loss = torch.zeros(())

    def forward(self, obs: Tensor) -> Tensor:
        if obs.dim() != 2 or obs.shape[1] != self.obs_dim:
            raise ValueError(f"MoETransformerPolicy: expected obs (B, {self.obs_dim}), got {tuple(obs.shape)}")
        pad = self.tokens * self.dims_per_token - self.obs_dim
        tokens = F.pad(obs, (0, pad)).view(obs.shape[0], self.tokens, self.dims_per_token)
        h = self.embed(tokens) + self.position
        aux = obs.new_zeros(())
        for block in self.blocks:
            h, block_aux = block(h)
            aux = aux + block_aux
        self.aux_loss = self.aux_loss_weight * aux
        return self.head(self.norm(h.mean(dim=1)))

    def moe_layers(self) -> list[MoEFeedForward]:
        return [b.moe for b in self.blocks]


def moe_layers(module: nn.Module) -> list[MoEFeedForward]:
    """Every MoE feed-forward inside ``module`` (e.g. a NormalizedPolicy around the transformer)."""
    return [m for m in module.modules() if isinstance(m, MoEFeedForward)]


def expert_parameter_names(module: nn.Module) -> set[str]:
    """Names of parameters held per rank under expert parallelism (never all-reduced)."""
    return {
        f"{name}.{p}" if name else p
        for name, m in module.named_modules()
        if isinstance(m, Experts)
        for p, _ in m.named_parameters(recurse=False)
    }


def enable_expert_parallel(module: nn.Module, group: dist.ProcessGroup, cfg: ShuffleConfig) -> None:
    """Shard every MoE layer's experts over ``group`` and route through the configured dispatcher."""
    for layer in moe_layers(module):
        layer.enable_expert_parallel(group, cfg)


def full_expert_state(module: nn.Module, group: dist.ProcessGroup | None) -> dict[str, Tensor]:
    """The state_dict with expert shards gathered from all ranks (collective: every rank calls it)."""
    state = {k: v.detach().clone() for k, v in module.state_dict().items()}
    if group is None:
        return state
    for name in sorted(expert_parameter_names(module)):
        shard = state[name].contiguous()
        parts = [torch.empty_like(shard) for _ in range(dist.get_world_size(group))]
        dist.all_gather(parts, shard, group=group)
        state[name] = torch.cat(parts)
    return state
