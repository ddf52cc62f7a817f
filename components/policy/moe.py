"""Transformer policy over a short observation history whose feed-forward is a mixture of experts.

    window (B, H, n) of normalized observations (``policy/history.py``: the last ``history``
    frames, the episode's first frame repeated before it starts; a single frame (B, n) is a window
    at an episode's first step)
    -> one token per frame: linear embedding + learned position
    -> ``layers`` pre-norm blocks [self-attention over the frames, MoE feed-forward]
    -> the current frame's token -> action (B, m)

Every (frame) token is routed: ``top_k`` of ``num_experts`` experts by softmax router scores
(renormalized over the chosen k). The trained loss adds, per layer, the Switch load-balancing loss
``E * sum_e f_e * P_e`` and the ST-MoE router z-loss ``mean_t logsumexp(logits_t)^2``
(``PolicyConfig``'s weights). In training each expert processes at most
``C = ceil(capacity_factor * T * k / E)`` (token, expert) pairs of the global batch; pairs are
served first-choice first (GShard: every token's 1st expert before any 2nd), in token order
within a choice, and a dropped pair adds nothing -- its token passes through the residual.

The MoE feed-forward runs the dense single-process path (every expert local, ascending expert
order) until ``enable_expert_parallel`` shards its experts over a process group; from then on
tokens reach their experts through a shuffle dispatcher (``components.shuffle``: fused, or a
baseline by config). Routing counts are exchanged once per layer (one all-gather of k x E
counts), so capacity, drops, both aux losses and the utilisation are those of the global batch
on every rank: a model trained expert-parallel trains like the single-process model and loads
into it unchanged (after ``full_expert_state`` gathers the shards). On the expert-parallel path a
dropped pair does not travel: the routing carries the keep mask, and the default fused paths
(permute, rank_dedup) and the Megatron baseline leave dropped pairs out of the shuffle (the
pair-level plans one_level / two_level / dedup_permute still move them, with combine weight 0).
The routing also carries the served pairs per (source rank, expert) that every rank derives from
the count all-gather, so the fused permute path skips its own count exchange.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn

from components.config import PolicyConfig, ShuffleConfig
from components.shuffle.dispatchers import Dispatcher, make_dispatcher
from components.shuffle.routing import Placement, Routing

POSITION_INIT_STD = 0.02  # learned frame-position embeddings start small (GPT-2's init)


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

    def per_expert(self) -> list[tuple[Tensor, Tensor, Tensor, Tensor]]:
        """(w1, b1, w2, b2) of each local expert, split once per forward with ``unbind``: its backward
        stacks the experts' gradients in one pass, where indexing ``w1[l]`` per expert would zero-fill
        and add a full-size (L, ...) gradient per expert (L^2 memory traffic per step)."""
        return list(zip(*(p.unbind(0) for p in (self.w1, self.b1, self.w2, self.b2)), strict=True))

    @staticmethod
    def mlp(x: Tensor, w1: Tensor, b1: Tensor, w2: Tensor, b2: Tensor) -> Tensor:
        return F.gelu(x @ w1 + b1) @ w2 + b2

    def forward(self, x: Tensor, tokens_per_expert: tuple[int, ...]) -> Tensor:
        """Expert-major rows: the first tokens_per_expert[0] rows go to local expert 0, and so on."""
        weights = self.per_expert()
        parts = [self.mlp(rows, *weights[l]) for l, rows in enumerate(x.split(list(tokens_per_expert)))
                 if rows.shape[0]]
        return torch.cat(parts) if parts else x.new_zeros(0, self.w2.shape[2]) + 0 * x.sum()

    def shard(self, rank: int, world: int) -> None:
        """Keep only this rank's experts (contiguous block ``rank``)."""
        n = self.w1.shape[0] // world
        for name in ("w1", "b1", "w2", "b2"):
            full = getattr(self, name)
            setattr(self, name, nn.Parameter(full.detach()[rank * n : (rank + 1) * n].clone()))


@dataclass(frozen=True)
class RouterLosses:
    """One layer's auxiliary losses; on a rank of a process group, its additive share of them."""

    balance: Tensor  # Switch load-balancing loss
    z: Tensor  # router z-loss


@dataclass(frozen=True)
class ExpertUsage:
    """One layer's routing of the last forward's global batch: (token, expert) pairs per expert."""

    assigned: Tensor  # (E,) pairs routed to each expert (before capacity)
    kept: Tensor  # (E,) pairs each expert processed

    @property
    def share(self) -> Tensor:
        """(E,) each expert's share of the routed pairs (uniform = 1 / E)."""
        return self.assigned.double() / self.assigned.sum().clamp_min(1)

    @property
    def dropped_rate(self) -> float:
        total = int(self.assigned.sum())
        return (total - int(self.kept.sum())) / total if total else 0.0


class MoEFeedForward(nn.Module):
    """Router (softmax, top-k, renormalized) + capacity + experts -> (output, ``RouterLosses``)."""

    def __init__(self, d_model: int, hidden: int, num_experts: int, top_k: int, capacity_factor: float = 0.0) -> None:
        super().__init__()
        if not 1 <= top_k <= num_experts:
            raise ValueError(f"policy.top_k={top_k} must lie in [1, policy.num_experts={num_experts}]")
        self.num_experts, self.top_k, self.capacity_factor = num_experts, top_k, capacity_factor
        self.router = nn.Linear(d_model, num_experts, bias=False)
        self.experts = Experts(num_experts, d_model, hidden)
        self.dispatcher: Dispatcher | None = None
        self.group: dist.ProcessGroup | None = None
        self.usage: ExpertUsage | None = None  # the last forward's routing (global batch)

    def enable_expert_parallel(self, group: dist.ProcessGroup, cfg: ShuffleConfig) -> None:
        world, rank = dist.get_world_size(group), dist.get_rank(group)
        ranks_per_node = cfg.ranks_per_node or world
        placement = Placement(self.num_experts, world, ranks_per_node)
        self.experts.shard(rank, world)
        self.dispatcher = make_dispatcher(placement, group, cfg)
        self.group = group

    def forward(self, x: Tensor) -> tuple[Tensor, RouterLosses]:
        logits = self.router(x)
        scores = torch.softmax(logits, dim=-1)
        top_p, top_i = scores.topk(self.top_k, dim=-1)
        counts = self._global_counts(top_i)
        tokens = int(counts[:, -1].sum())
        keep, served = self._capacity(top_i, counts, tokens)
        assigned = counts[:, :-1].sum(0).view(self.top_k, self.num_experts).sum(0)
        self.usage = ExpertUsage(assigned, served.sum(0))
        probs = top_p / top_p.sum(dim=-1, keepdim=True)
        routing = Routing(top_i, probs, keep, served)
        if self.dispatcher is None:
            out = self._dense(x, routing)
        else:
            d = self.dispatcher.dispatch(x, routing)
            out = self.dispatcher.combine(self.experts(d.x, d.tokens_per_expert), d.handle)
        return out, self._losses(logits, scores, assigned, tokens)

    def _global_counts(self, top_i: Tensor) -> Tensor:
        """(world, k*E + 1) int64: per rank, pairs per (choice, expert) and its token count (rank order)."""
        one_hot = F.one_hot(top_i, self.num_experts)  # (T, k, E)
        local = torch.cat([one_hot.sum(0).reshape(-1), top_i.new_tensor([top_i.shape[0]])])
        if self.group is None:
            return local.unsqueeze(0)
        parts = [torch.empty_like(local) for _ in range(dist.get_world_size(self.group))]
        dist.all_gather(parts, local, group=self.group)
        return torch.stack(parts)

    def _capacity(self, top_i: Tensor, counts: Tensor, tokens: int) -> tuple[Tensor | None, Tensor]:
        """(T, k) keep mask of this rank's pairs (None: no capacity limit) and (world, E) pairs each
        rank has served per expert (global batch: the same on every rank).

        A pair's place in its expert's queue: pairs of earlier choices (all ranks), then pairs of
        the same choice on lower ranks (their tokens come first in the global batch), then this
        rank's earlier tokens. Kept iff the place is below the capacity.
        """
        k, e = self.top_k, self.num_experts
        per_rank = counts[:, :-1].view(-1, k, e)  # (world, k, E)
        if not (self.training and self.capacity_factor > 0):
            return None, per_rank.sum(1)
        capacity = math.ceil(self.capacity_factor * tokens * k / e)
        slot_totals = per_rank.sum(0)  # (k, E)
        queued_before = slot_totals.cumsum(0) - slot_totals + per_rank.cumsum(0) - per_rank  # (world, k, E)
        served = (capacity - queued_before).clamp_min(0).minimum(per_rank).sum(1)  # (world, E)
        rank = 0 if self.group is None else dist.get_rank(self.group)
        one_hot = F.one_hot(top_i, e)  # (T, k, E)
        place = ((one_hot.cumsum(0) - one_hot + queued_before[rank]) * one_hot).sum(-1)  # (T, k)
        return place < capacity, served

    def _dense(self, x: Tensor, routing: Routing) -> Tensor:
        """Every expert local, in ascending expert order (the order the fused shuffle reproduces)."""
        out = torch.zeros_like(x)
        served = routing.expert_ids if routing.keep is None else routing.expert_ids.masked_fill(~routing.keep, -1)
        weights = self.experts.per_expert()
        for e in range(self.num_experts):
            tok, k = (served == e).nonzero(as_tuple=True)
            if tok.numel():
                y = self.experts.mlp(x[tok], *weights[e])
                out = out.index_add(0, tok, y * routing.probs[tok, k].unsqueeze(1))
        return out

    def _losses(self, logits: Tensor, scores: Tensor, assigned: Tensor, tokens: int) -> RouterLosses:
        """Switch loss E * sum_e f_e * P_e and z-loss mean_t logsumexp(logits_t)^2 over the *global*
        batch; this rank returns its additive share (f_e and the token count are global, the sums
        over tokens local), so the shares of all ranks add up to what one process computes."""
        fraction = assigned.to(scores.dtype) / (tokens * self.top_k)
        balance = self.num_experts * (fraction * scores.sum(dim=0)).sum() / tokens
        z = torch.logsumexp(logits, dim=-1).square().sum() / tokens
        return RouterLosses(balance, z)


class Block(nn.Module):
    def __init__(self, cfg: PolicyConfig) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(cfg.d_model)
        self.attn = nn.MultiheadAttention(cfg.d_model, cfg.heads, batch_first=True)
        self.ln2 = nn.LayerNorm(cfg.d_model)
        self.moe = MoEFeedForward(cfg.d_model, cfg.hidden, cfg.num_experts, cfg.top_k, cfg.capacity_factor)

    def forward(self, h: Tensor) -> tuple[Tensor, RouterLosses]:
        a = self.ln1(h)
        h = h + self.attn(a, a, a, need_weights=False)[0]
        y, losses = self.moe(self.ln2(h).reshape(-1, h.shape[-1]))
        return h + y.view_as(h), losses


class MoETransformerPolicy(nn.Module):
    """Policy interface: ``forward(obs (B, n) or window (B, history, n)) -> (B, m)``; ``aux_loss`` =
    the weighted router losses of the last forward (part of the trained loss)."""

    def __init__(self, obs_dim: int, act_dim: int, cfg: PolicyConfig) -> None:
        super().__init__()
        if cfg.d_model % cfg.heads:
            raise ValueError(f"policy: d_model={cfg.d_model} must be a multiple of heads={cfg.heads}")
        self.obs_dim, self.history = obs_dim, cfg.history
        self.embed = nn.Linear(obs_dim, cfg.d_model)
        self.position = nn.Parameter(torch.randn(cfg.history, cfg.d_model) * POSITION_INIT_STD)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.layers))
        self.norm = nn.LayerNorm(cfg.d_model)
        self.head = nn.Linear(cfg.d_model, act_dim)
        self.aux_loss_weight, self.z_loss_weight = cfg.aux_loss_weight, cfg.z_loss_weight
        self.aux_loss = torch.zeros(())
        self.router_losses = RouterLosses(torch.zeros(()), torch.zeros(()))  # unweighted sums over layers

    def windows(self, obs: Tensor) -> Tensor:
        """(B, n) -> (B, history, n), the frame repeated (an episode's first step); (B, history, n) as is."""
        if obs.dim() == 2 and obs.shape[1] == self.obs_dim:
            return obs.unsqueeze(1).expand(-1, self.history, -1)
        if obs.dim() == 3 and obs.shape[1:] == (self.history, self.obs_dim):
            return obs
        raise ValueError(f"MoETransformerPolicy: expected obs (B, {self.obs_dim}) or windows "
                         f"(B, {self.history}, {self.obs_dim}) (policy.history), got {tuple(obs.shape)}")

    def forward(self, obs: Tensor) -> Tensor:
        h = self.embed(self.windows(obs)) + self.position
        balance, z = obs.new_zeros(()), obs.new_zeros(())
        for block in self.blocks:
            h, losses = block(h)
            balance, z = balance + losses.balance, z + losses.z
        self.router_losses = RouterLosses(balance.detach(), z.detach())
        self.aux_loss = self.aux_loss_weight * balance + self.z_loss_weight * z
        return self.head(self.norm(h[:, -1]))

    def moe_layers(self) -> list[MoEFeedForward]:
        return [b.moe for b in self.blocks]


def moe_layers(module: nn.Module) -> list[MoEFeedForward]:
    """Every MoE feed-forward inside ``module`` (e.g. a NormalizedPolicy around the transformer)."""
    return [m for m in module.modules() if isinstance(m, MoEFeedForward)]


@dataclass(frozen=True)
class StepUsage:
    """One forward's expert utilisation (global batch), averaged over the MoE layers."""

    share: tuple[float, ...]  # each expert's share of the routed (token, expert) pairs
    dropped_rate: float  # pairs dropped by the capacity limit / pairs routed


def step_usage(module: nn.Module) -> StepUsage | None:
    """The utilisation of ``module``'s last forward (None without MoE layers)."""
    usages = [layer.usage for layer in moe_layers(module) if layer.usage is not None]
    if not usages:
        return None
    share = torch.stack([u.share for u in usages]).mean(dim=0)
    return StepUsage(tuple(float(x) for x in share), sum(u.dropped_rate for u in usages) / len(usages))


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
