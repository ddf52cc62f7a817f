"""Routing inputs of the shuffle: where experts live, which experts each token picked.

``Placement`` maps experts to ranks (contiguous blocks of ``local_experts``) and ranks to nodes
(contiguous blocks of ``ranks_per_node``). ``Routing`` is a top-k routing: per token, K distinct
expert ids, their combine probabilities and optionally which pairs are served (a capacity limit
drops the rest: a dropped pair adds nothing, and the permute, rank_dedup and Megatron paths do
not move it at all). The synthetic routings (uniform, node-confined,
Zipf-skewed) and the single-process dense reference live here too, because tests and the
benchmark both need them.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

ROUTINGS = ("uniform", "node_confined", "zipf")
ZIPF_EXPONENT = 1.2


@dataclass(frozen=True)
class Placement:
    """Experts ``e`` live on rank ``e // local_experts``; rank ``r`` lives on node ``r // ranks_per_node``."""

    num_experts: int
    world_size: int
    ranks_per_node: int

    def __post_init__(self) -> None:
        if self.world_size < 1 or self.num_experts % self.world_size:
            raise ValueError(
                f"Placement: num_experts={self.num_experts} must be a positive multiple of "
                f"world_size={self.world_size} (set policy.num_experts to a multiple of the ranks)"
            )
        if self.ranks_per_node < 1 or self.world_size % self.ranks_per_node:
            raise ValueError(
                f"Placement: ranks_per_node={self.ranks_per_node} must divide world_size="
                f"{self.world_size} (set shuffle.ranks_per_node, 0 = one node)"
            )

    @property
    def local_experts(self) -> int:
        return self.num_experts // self.world_size

    @property
    def num_nodes(self) -> int:
        return self.world_size // self.ranks_per_node

    def node_of(self, rank: int) -> int:
        return rank // self.ranks_per_node

    def experts_of(self, rank: int) -> range:
        return range(rank * self.local_experts, (rank + 1) * self.local_experts)


@dataclass(frozen=True)
class Routing:
    """Top-k routing of T tokens: ``expert_ids`` (T, K) int64 distinct per row, ``probs`` (T, K),
    ``keep`` (T, K) bool: the pairs served (None = all; a dropped pair adds nothing to its token).

    ``pairs_per_rank`` (W, E) int64, optional: served pairs per (source rank, expert) of the whole
    group, identical on every rank. The MoE layer knows it from its own routing count exchange
    (capacity needs the global counts anyway); given it, the permute path needs no count exchange.
    """

    expert_ids: Tensor
    probs: Tensor
    keep: Tensor | None = None
    pairs_per_rank: Tensor | None = None

    def __post_init__(self) -> None:
        if self.expert_ids.dim() != 2 or self.expert_ids.shape != self.probs.shape:
            raise ValueError(
                f"Routing: expert_ids {tuple(self.expert_ids.shape)} and probs "
                f"{tuple(self.probs.shape)} must both be (tokens, top_k)"
            )
        if self.expert_ids.dtype != torch.int64:
            raise ValueError(f"Routing: expert_ids must be int64, got {self.expert_ids.dtype}")
        if self.keep is not None and (self.keep.shape != self.expert_ids.shape or self.keep.dtype != torch.bool):
            raise ValueError(f"Routing: keep must be a (tokens, top_k) bool mask like expert_ids "
                             f"{tuple(self.expert_ids.shape)}, got {self.keep.dtype} {tuple(self.keep.shape)}")

    def kept_pairs(self) -> Tensor | None:
        """Flat indices (token * K + k, ascending) of the served pairs; None when every pair is served."""
        if self.keep is None:
            return None
        return self.keep.reshape(-1).nonzero().squeeze(1)

    def served_probs(self) -> Tensor:
        """(T, K) probabilities with dropped pairs at 0: for paths that move every pair."""
        return self.probs if self.keep is None else self.probs * self.keep

    @property
    def num_tokens(self) -> int:
        return int(self.expert_ids.shape[0])

    @property
    def top_k(self) -> int:
        return int(self.expert_ids.shape[1])

    def check(self, placement: Placement) -> None:
        """Raise if an expert id is out of range or a token picks one expert twice."""
        ids = self.expert_ids
        if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= placement.num_experts):
            raise ValueError(f"Routing: expert ids must lie in [0, {placement.num_experts})")
        if ids.numel() and bool((ids.sort(dim=1).values.diff(dim=1) == 0).any()):
            raise ValueError("Routing: a token picked the same expert twice (top-k must be distinct)")


def synthetic_routing(
    kind: str, tokens: int, top_k: int, placement: Placement, generator: torch.Generator
) -> Tensor:
    """Expert ids (tokens, top_k) for a benchmark/test routing pattern.

    uniform: K distinct experts uniformly. node_confined: each token picks one node uniformly, then
    K distinct experts on it (DeepSeek-style node-limited routing, M = 1). zipf: K distinct experts
    drawn without replacement with popularity ~ 1/rank^1.2 over a random expert order.
    """
    E = placement.num_experts
    if top_k > E:
        raise ValueError(f"synthetic_routing: top_k={top_k} exceeds num_experts={E}")
    if kind == "uniform":
        return torch.rand(tokens, E, generator=generator).topk(top_k, dim=1).indices
    if kind == "node_confined":
        per_node = E // placement.num_nodes
        if top_k > per_node:
            raise ValueError(f"node_confined: top_k={top_k} exceeds the {per_node} experts of a node")
        node = torch.randint(placement.num_nodes, (tokens, 1), generator=generator)
        local = torch.rand(tokens, per_node, generator=generator).topk(top_k, dim=1).indices
        return node * per_node + local
    if kind == "zipf":
        popularity = 1.0 / torch.arange(1, E + 1, dtype=torch.float64) ** ZIPF_EXPONENT
        popularity = popularity[torch.randperm(E, generator=generator)]
        return torch.multinomial(popularity.expand(tokens, E), top_k, generator=generator)
    raise ValueError(f"synthetic_routing: unknown kind {kind!r}, expected one of {ROUTINGS}")


def dense_reference(
    x: Tensor, routing: Routing, expert: Callable[[int, Tensor], Tensor], num_experts: int
) -> Tensor:
    """out[t] = sum_k probs[t,k] * expert(e[t,k], x[t]) over the served pairs, in ascending expert order.

    Each expert sees its (served) tokens in ascending token order. The one-level fused shuffle reproduces
    exactly this order of rows and of additions, so it matches bit for bit.
    """
    out = torch.zeros_like(x)
    served = routing.expert_ids if routing.keep is None else routing.expert_ids.masked_fill(~routing.keep, -1)
    for e in range(num_experts):
        tok, k = (served == e).nonzero(as_tuple=True)
        if tok.numel():
            out.index_add_(0, tok, expert(e, x[tok]) * routing.probs[tok, k].unsqueeze(1))
    return out
