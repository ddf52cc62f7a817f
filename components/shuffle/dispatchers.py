"""Token dispatchers: the fused shuffle and the two baselines, behind one interface.

    d = dispatcher.dispatch(x, routing)      # x (T, H) -> d.x (N, H) expert-major local slots
    y = experts(d.x, d.tokens_per_expert)    # any row-wise expert computation
    out = dispatcher.combine(y, d.handle)    # (T, H): sum_k probs[t,k] * y(t,k)

fused           plan permute (``permute.py``, what auto runs at top-1, and at top-k > 1 when the MoE
                layer's global counts say rank dedup saves < ``dedup_min_saved_kib``): Megatron's
                op sequence with reused staging buffers, less per-call overhead, and no count
                exchange when the routing carries the group's counts.
                plan auto (top-k > 1, larger payloads) / rank_dedup (``rank_dedup.py``): one coalesced all-to-all per direction,
                each token once per expert rank, expanded into expert-major slots on arrival and
                reduced there on the way back. plan one_level / two_level: plan descriptors + the
                pipelined p2p engine; probabilities travel to the slots as one scalar per pair and
                weight the expert outputs there, so the combine is one add-mode shuffle that
                reduces on arrival (at the forwarder, then at the source).
megatron        Megatron-LM's MoEAlltoAllTokenDispatcher: permute (index_select into expert-major
                order) -> counts all_gather -> all_to_all_single -> sort chunks (source, expert)
                -> (expert, source) ... unsort chunks -> all_to_all_single -> unpermute (weight by
                probs, scatter_add).
dedup_permute   DeepEP-like: node-deduplicated two-level traffic, each hop as gather into a fresh
                buffer + all_to_all_single, and a separate permute into expert-major slots.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

import torch
import torch.distributed as dist
from torch import Tensor

from components.config import ShuffleConfig
from components.shuffle import permute, rank_dedup
from components.shuffle.engine import Transport, shuffle
from components.shuffle.plan import ShufflePlan, build_plan, prefer_two_level
from components.shuffle.routing import Placement, Routing


@dataclass(frozen=True)
class Dispatched:
    """Expert-major rows for this rank's local experts, and what ``combine`` needs back."""

    x: Tensor
    tokens_per_expert: tuple[int, ...]
    handle: Any


class Dispatcher(Protocol):
    transport: Transport

    def dispatch(self, x: Tensor, routing: Routing) -> Dispatched: ...

    def combine(self, y: Tensor, handle: Any) -> Tensor: ...


def _rank(group: dist.ProcessGroup | None) -> int:
    return 0 if group is None else dist.get_rank(group)


@dataclass(frozen=True)
class _PlanHandle:
    plan: ShufflePlan
    slot_probs: Tensor


@dataclass(frozen=True)
class _RankDedupHandle:
    inner: rank_dedup.RankDedupHandle
    slot_probs: Tensor


class FusedDispatcher:
    """Plan descriptors + fused transfers (``collective=False``) -- the FUSCO path.

    ``shuffle.plan``: permute (``permute.py``: Megatron's sequence, reused staging), rank_dedup
    (``rank_dedup.py``: one coalesced all-to-all per direction, each token once per expert rank),
    one_level / two_level (``plan.py`` + the pipelined ``engine.py``), or auto: permute at top-1
    (rank dedup factor 1: nothing to deduplicate, so the plain sequence is the cheapest) and where
    rank dedup would save little (``_auto_skips_dedup``), else rank_dedup unless
    ``prefer_two_level``'s cost model says two-level moves less.

    With ``collective=True`` and a two-level plan it is the dedup_permute baseline: the same
    deduplicated rows, moved as permute -> all_to_all_single -> permute.
    """

    def __init__(self, placement: Placement, group: dist.ProcessGroup | None, cfg: ShuffleConfig,
                 collective: bool = False, plan_kind: str | None = None) -> None:
        self.placement, self.group, self.cfg = placement, group, cfg
        self.rank = _rank(group)
        self.plan_kind = plan_kind or cfg.plan
        segment = cfg.min_segment_kib * 1024
        self.transport = Transport(group=group, collective=collective, min_segment_bytes=segment)
        self.last_plan: ShufflePlan | rank_dedup.RankDedupPlan | permute.PermutePlan | None = None

    def _auto_skips_dedup(self, x: Tensor, routing: Routing) -> bool:
        """Auto runs the permute sequence at top-1 (the same on every rank: one model), and at top-k > 1
        when the routing carries the group's counts and rank dedup would save under
        ``dedup_min_saved_kib`` (computed from global counts: every rank decides the same)."""
        if routing.top_k == 1:
            return True
        if routing.pairs_per_rank is None:
            return False
        row_bytes = x.shape[1] * x.element_size()
        saved = rank_dedup.expected_saved_bytes(routing.pairs_per_rank, self.placement, routing.top_k, row_bytes)
        return saved < self.cfg.dedup_min_saved_kib * 1024

    def dispatch(self, x: Tensor, routing: Routing) -> Dispatched:
        kind = self.plan_kind
        if (kind == "permute" or (kind == "auto" and self._auto_skips_dedup(x, routing))) and not self.transport.collective:
            routing.check(self.placement)
            slots, handle = permute.dispatch(x, routing, self.placement, self.rank, self.transport)
            self.last_plan = handle.plan
            return Dispatched(slots, handle.plan.tokens_per_expert, handle)
        if kind in ("auto", "rank_dedup") and not self.transport.collective:
            routing.check(self.placement)
            # auto reads global routing stats only where two-level could pay (several nodes, costly links);
            # they ride in the rank-dedup count exchange, so deciding costs no extra collective
            # (on accelerators auto stays rank_dedup: the plan.py plans build CPU descriptors)
            with_stats = (kind == "auto" and self.placement.num_nodes > 1 and self.cfg.internode_cost > 1.0
                          and x.device.type == "cpu")
            rd = rank_dedup.build_rank_dedup(routing, self.placement, self.rank, self.group, with_stats)
            row_bytes = x.shape[1] * x.element_size()
            if not (with_stats and prefer_two_level(rd.stats, self.placement, self.cfg, row_bytes)):
                self.last_plan = rd
                slots, handle, slot_probs = rank_dedup.dispatch(x, routing, rd, self.transport)
                return Dispatched(slots, rd.tokens_per_expert, _RankDedupHandle(handle, slot_probs))
            kind = "two_level"
        if x.device.type != "cpu":
            raise ValueError(f"shuffle.plan={kind} builds its descriptors on the CPU (gloo); for tensors on "
                             f"{x.device} use shuffle.plan: auto or rank_dedup, or shuffle.dispatcher: megatron")
        rounds = 1 if self.transport.collective else self.cfg.chunks
        plan = build_plan(routing, self.placement, self.rank, self.group, kind, rounds,
                          self.cfg.grouping, self.cfg.dedup_threshold)
        self.last_plan = plan
        rows, probs = x, routing.served_probs().reshape(-1, 1)  # pair-level plans move dropped pairs, weight 0
        for tok_stage, pair_stage, shared in zip(plan.token_stages, plan.pair_stages, plan.shared_hops):
            if shared:  # rows and their probabilities travel in the same messages
                rows, probs = shuffle((rows, probs), ((tok_stage, pair_stage),), "copy", self.transport)
            else:  # two-level hop A: one row per (token, node) but one probability per pair
                (rows,) = shuffle((rows,), ((tok_stage,),), "copy", self.transport)
                (probs,) = shuffle((probs,), ((pair_stage,),), "copy", self.transport)
        return Dispatched(rows, plan.tokens_per_expert, _PlanHandle(plan, probs))

    def combine(self, y: Tensor, handle: _PlanHandle | _RankDedupHandle | permute.PermuteHandle) -> Tensor:
        if isinstance(handle, permute.PermuteHandle):
            return permute.combine(y, handle, self.transport)
        if isinstance(handle, _RankDedupHandle):
            return rank_dedup.combine(y, handle.slot_probs, handle.inner, self.transport)
        weighted = y * handle.slot_probs
        self.transport.meter.copied(weighted)
        hops = tuple((s,) for s in handle.plan.token_stages)
        return shuffle((weighted,), hops, "add", self.transport, reverse=True)[0]


class _AllToAll(torch.autograd.Function):
    """all_to_all_single into a fresh buffer, differentiable (backward = the reverse exchange)."""

    @staticmethod
    def forward(ctx, x: Tensor, out_splits: list[int], in_splits: list[int], group) -> Tensor:  # type: ignore[override]
        ctx.splits, ctx.group = (out_splits, in_splits), group
        out = x.new_empty((sum(out_splits),) + tuple(x.shape[1:]))
        if group is None:
            out.copy_(x)
        else:
            dist.all_to_all_single(out, x.contiguous(), out_splits, in_splits, group=group)
        return out

    @staticmethod
    def backward(ctx, grad: Tensor):  # type: ignore[override]
        out_splits, in_splits = ctx.splits
        return _AllToAll.apply(grad.contiguous(), in_splits, out_splits, ctx.group), None, None, None


@dataclass(frozen=True)
class _MegatronHandle:
    sorted_tokens: Tensor
    sorted_probs: Tensor
    in_splits: list[int]
    out_splits: list[int]
    chunk_sizes: list[int]  # received chunks in (source, expert) order
    num_tokens: int


def _sort_chunks(x: Tensor, sizes: list[int], order: list[int]) -> Tensor:
    """Megatron's sort_chunks_by_idxs: reorder contiguous row chunks (one copy of every row)."""
    chunks = x.split(sizes)
    return torch.cat([chunks[i] for i in order]) if chunks else x


class MegatronDispatcher:
    """Megatron-LM's all-to-all token dispatcher (unfused permute path), for comparison."""

    def __init__(self, placement: Placement, group: dist.ProcessGroup | None, cfg: ShuffleConfig) -> None:
        self.placement, self.group, self.rank = placement, group, _rank(group)
        self.transport = Transport(group=group, collective=True)

    def dispatch(self, x: Tensor, routing: Routing) -> Dispatched:
        routing.check(self.placement)
        W, L, E = self.placement.world_size, self.placement.local_experts, self.placement.num_experts
        T, K = routing.num_tokens, routing.top_k
        meter = self.transport.meter
        e, tok, probs = routing.expert_ids.reshape(-1), torch.arange(T * K, device=x.device) // K, routing.probs.reshape(-1)
        pairs = routing.kept_pairs()
        if pairs is not None:  # Megatron's routing_map holds only the pairs within capacity
            e, tok, probs = e[pairs], tok[pairs], probs[pairs]
        order = torch.argsort(e * max(T, 1) + tok)  # routing_map.T.masked_select: expert-major
        sorted_tokens = tok[order]
        sorted_probs = probs[order]
        permuted = x.index_select(0, sorted_tokens)  # permute
        meter.copied(permuted)
        counts = torch.bincount(e, minlength=E)  # tokens per expert, this rank
        if self.group is None:
            global_counts = counts.view(1, E)
        else:
            parts = [torch.empty_like(counts) for _ in range(W)]
            dist.all_gather(parts, counts, group=self.group)
            global_counts = torch.stack(parts)
        mine = global_counts[:, self.rank * L : (self.rank + 1) * L]  # [source, local expert]
        in_splits = counts.view(W, L).sum(1).tolist()
        out_splits = mine.sum(1).tolist()
        for p, n in enumerate(in_splits):
            if p != self.rank:
                nbytes = n * x.shape[1] * x.element_size()
                meter.bytes_sent += 2 * nbytes  # dispatch + combine
                if self.placement.node_of(p) != self.placement.node_of(self.rank):
                    meter.bytes_internode += 2 * nbytes
        received = _AllToAll.apply(permuted, out_splits, in_splits, self.group)
        chunk_sizes = mine.reshape(-1).tolist()  # (source, expert)
        by_expert = [s * L + l for l in range(L) for s in range(W)]
        slots = _sort_chunks(received, chunk_sizes, by_expert)  # sort chunks -> (expert, source)
        meter.copied(slots)
        handle = _MegatronHandle(sorted_tokens, sorted_probs, in_splits, out_splits, chunk_sizes, T)
        return Dispatched(slots, tuple(mine.sum(0).tolist()), handle)

    def combine(self, y: Tensor, handle: _MegatronHandle) -> Tensor:
        W, L = self.placement.world_size, self.placement.local_experts
        meter = self.transport.meter
        sizes = [handle.chunk_sizes[s * L + l] for l in range(L) for s in range(W)]  # (expert, source)
        by_source = [l * W + s for s in range(W) for l in range(L)]
        unsorted = _sort_chunks(y, sizes, by_source)  # unsort chunks
        meter.copied(unsorted)
        back = _AllToAll.apply(unsorted, handle.in_splits, handle.out_splits, self.group)
        weighted = back * handle.sorted_probs.unsqueeze(1)  # unpermute: weight ...
        meter.copied(weighted)
        out = torch.zeros(handle.num_tokens, y.shape[1], dtype=y.dtype, device=y.device)
        index = handle.sorted_tokens.unsqueeze(1).expand(-1, y.shape[1])
        out = out.scatter_add(0, index, weighted)  # ... and scatter_add back to token order
        meter.copied(weighted)
        return out


DISPATCHERS = ("fused", "megatron", "dedup_permute")


def make_dispatcher(placement: Placement, group: dist.ProcessGroup | None, cfg: ShuffleConfig) -> Dispatcher:
    """The dispatcher ``cfg.dispatcher`` names (fused | megatron | dedup_permute)."""
    if cfg.dispatcher == "fused":
        return FusedDispatcher(placement, group, cfg)
    if cfg.dispatcher == "megatron":
        return MegatronDispatcher(placement, group, cfg)
    if cfg.dispatcher == "dedup_permute":
        kind = "two_level" if placement.num_nodes > 1 else "one_level"
        return FusedDispatcher(placement, group, cfg, collective=True, plan_kind=kind)
    raise ValueError(f"shuffle.dispatcher: unknown {cfg.dispatcher!r}, expected one of {DISPATCHERS}")
