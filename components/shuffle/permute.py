"""The plain permute shuffle with reused staging: what ``shuffle.plan: auto`` runs at top-1 (and at
top-k > 1 when per-rank dedup would save less than ``shuffle.dedup_min_saved_kib``).

    dispatch  permute (tokens -> expert-major pairs, gathered into a reused send buffer)
              -> count all-to-all -> all_to_all_single (into a reused receive buffer)
              -> sort chunks (source, expert) -> (expert, source): the slots
    combine   unsort chunks (into a reused send buffer) -> all_to_all_single
              -> unpermute: x probs, back to token order

The op sequence is Megatron's (``dispatchers.MegatronDispatcher``); what differs is the
overhead around it: staging buffers come from the engine's ``Workspace`` instead of fresh
allocations, the pair order is one stable sort of the expert ids, the count exchange is one
async ``all_to_all_single`` of this rank's (peer, local expert) counts that travels while the
permute runs -- or none at all when the routing carries the group's counts
(``Routing.pairs_per_rank``: the MoE layer already all-gathers them for capacity and its
losses, so in the policy the fused forward has one collective fewer per layer than Megatron's)
-- the split sizes come back in one host sync, and at top-1 the unpermute is a
copy plus an in-place scale (every token has exactly one pair: no zero fill, no scatter-add).
Pairs the routing drops (``Routing.keep``: over an expert's capacity) are left out of the permute,
so they never travel; tokens left without a pair come back as zeros.

Why it exists: with top-1 (rank dedup factor 1 by construction) there is nothing to
deduplicate, so rank_dedup's per-pair metadata rows and ``embedding_bag`` reductions are pure
overhead; nothing can move fewer bytes or make fewer passes than this sequence. At top-k > 1 with
a small payload (the policy's few hundred 64-wide tokens per rank) the same holds in practice:
rank_dedup's fixed cost (metadata packing, index expansions, bag reductions: ~1.5-2.5 ms CPU per
layer forward + backward here) exceeds what the rows it saves cost to move.

Exactness: the rows and additions are in Megatron's order -- expert-major, tokens ascending;
a token's pairs added in ascending expert order -- so it equals the single-process reference
bit for bit (top-1: one product per output element). Autograd: dispatch and combine are
autograd functions whose backward is the reverse shuffle.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor

from components.shuffle.engine import Meter, Transport
from components.shuffle.routing import Placement, Routing

COUNT_DTYPE = torch.int64


@dataclass(frozen=True)
class PermutePlan:
    """Both directions' layout on this rank, from the routing and one count exchange."""

    num_tokens: int
    top_k: int
    rank: int
    node_of_peer: tuple[int, ...]
    order: Tensor  # (P,) flat pair index (token*K + k) of each served pair, expert-major, tokens ascending
    in_splits: list[int]  # pairs this rank sends to each peer (dispatch)
    out_splits: list[int]  # pairs this rank receives from each peer (dispatch)
    chunk_sizes: list[int]  # received pairs per (source, local expert), row-major
    tokens_per_expert: tuple[int, ...]
    complete: bool = True  # every pair served (no capacity drops): at top-1 each token has its one pair
    kind: str = "permute"

    @property
    def sorted_tokens(self) -> Tensor:
        """Token of each pair in wire order (the order itself at top-1)."""
        return self.order if self.top_k == 1 else self.order // self.top_k

    @property
    def num_slots(self) -> int:
        return sum(self.out_splits)


def _sort_chunks(rows: Tensor, sizes: list[int], order: list[int], out: Tensor | None = None) -> Tensor:
    """Reorder contiguous row chunks (Megatron's sort_chunks_by_idxs): one copy of every row."""
    chunks = rows.split(sizes)
    picked = [chunks[i] for i in order]
    if out is None:
        return torch.cat(picked) if picked else rows.new_empty(0, rows.shape[1])
    return torch.cat(picked, out=out) if picked else out


def _by_expert(plan: PermutePlan) -> tuple[list[int], list[int]]:
    """Chunk sizes in (source, expert) order and the chunk order that makes it (expert, source)."""
    L = len(plan.tokens_per_expert)
    W = len(plan.in_splits)
    return plan.chunk_sizes, [s * L + l for l in range(L) for s in range(W)]


def _by_source(plan: PermutePlan) -> tuple[list[int], list[int]]:
    """Chunk sizes in (expert, source) order and the chunk order that makes it (source, expert)."""
    L = len(plan.tokens_per_expert)
    W = len(plan.in_splits)
    sizes = [plan.chunk_sizes[s * L + l] for l in range(L) for s in range(W)]
    return sizes, [l * W + s for s in range(W) for l in range(L)]


def _all_to_all(out: Tensor, inp: Tensor, out_splits: list[int], in_splits: list[int], t: Transport) -> None:
    if t.group is None:
        out.copy_(inp)
    else:
        dist.all_to_all_single(out, inp, out_splits, in_splits, group=t.group)


def _count(meter: Meter, plan: PermutePlan, rows_to_peer: list[int], row_bytes: int) -> None:
    me = plan.node_of_peer[plan.rank]
    for p, n in enumerate(rows_to_peer):
        if p == plan.rank:
            continue
        meter.bytes_sent += n * row_bytes
        if plan.node_of_peer[p] != me:
            meter.bytes_internode += n * row_bytes


def _to_tokens(rows: Tensor, plan: PermutePlan) -> Tensor:
    """Pair rows in wire order -> (T, H), summed per token (a copy at top-1, an index_add otherwise).

    A token whose pairs were all dropped gets zeros (then no zero fill is needed only at complete top-1).
    """
    T, H = plan.num_tokens, rows.shape[1]
    if plan.top_k == 1:
        out = (torch.empty if plan.complete else torch.zeros)(T, H, dtype=rows.dtype, device=rows.device)
        return out.index_copy_(0, plan.order, rows)
    out = torch.zeros(T, H, dtype=rows.dtype, device=rows.device)
    return out.index_add_(0, plan.sorted_tokens, rows)  # ascending pair index = ascending expert per token


def _post_counts(send: Tensor, group: dist.ProcessGroup | None):
    if group is None:
        return send.clone(), None
    recv = torch.empty_like(send)
    work = dist.all_to_all_single(recv.view(-1), send.view(-1), group=group, async_op=True)
    return recv, work


def _counts(e: Tensor, routing: Routing, placement: Placement, rank: int, group: dist.ProcessGroup | None):
    """(W, L) served pairs this rank sends to each peer's experts, (W, L) it receives, pending work.

    With ``routing.pairs_per_rank`` (the MoE layer's global counts) both are read from it: no
    collective. Otherwise the count all-to-all is started here.
    """
    W, L = placement.world_size, placement.local_experts
    known = routing.pairs_per_rank
    if known is not None:
        if known.shape != (W, W * L):
            raise ValueError(f"Routing.pairs_per_rank: expected ({W}, {W * L}), got {tuple(known.shape)}")
        return known[rank].view(W, L), known[:, rank * L : (rank + 1) * L], None
    counts = torch.bincount(e, minlength=W * L).view(W, L)
    return (counts, *_post_counts(counts, group))


class _Dispatch(torch.autograd.Function):
    @staticmethod
    def forward(ctx, routing: Routing, placement: Placement, rank: int, t: Transport, holder: dict,  # type: ignore[override]
                x: Tensor) -> Tensor:
        W, L = placement.world_size, placement.local_experts
        T, K = routing.num_tokens, routing.top_k
        e = routing.expert_ids.reshape(-1)
        pairs = routing.kept_pairs()  # capacity drops: only served pairs travel
        if pairs is not None:
            e = e[pairs]
        counts, recv, work = _counts(e, routing, placement, rank, t.group)
        # while the counts travel: the permute, straight into the reused send buffer
        order = torch.sort(e, stable=True).indices  # flat index is token-major: tokens ascending per expert
        if pairs is not None:
            order = pairs[order]
        sorted_tokens = order if K == 1 else order // K
        sbuf = t.workspace.get("send", 0, order.numel(), x)
        torch.index_select(x, 0, sorted_tokens, out=sbuf)
        if work is not None:
            work.wait()
        host = torch.cat([counts, recv], dim=1).tolist()  # the one host sync
        in_splits = [sum(r[:L]) for r in host]
        out_splits = [sum(r[L:]) for r in host]
        chunk_sizes = [c for r in host for c in r[L:]]
        per_expert = tuple(sum(r[L + l] for r in host) for l in range(L))
        plan = PermutePlan(T, K, rank, tuple(placement.node_of(r) for r in range(W)), order, in_splits,
                           out_splits, chunk_sizes, per_expert, complete=order.numel() == T * K)
        rbuf = t.workspace.get("recv", 0, plan.num_slots, x)
        _all_to_all(rbuf, sbuf, out_splits, in_splits, t)
        slots = _sort_chunks(rbuf, *_by_expert(plan))  # fresh: the caller keeps it
        row_bytes = x.shape[1] * x.element_size()
        _count(t.meter, plan, in_splits, row_bytes)
        t.meter.copied(sbuf)
        t.meter.copied(slots)
        ctx.plan, ctx.t = plan, t
        holder["plan"] = plan
        return slots

    @staticmethod
    def backward(ctx, g_slots: Tensor):  # type: ignore[override]
        plan, t = ctx.plan, ctx.t
        g_slots = g_slots.contiguous()
        sbuf = _sort_chunks(g_slots, *_by_source(plan), out=t.workspace.get("send", 0, plan.num_slots, g_slots))
        rbuf = t.workspace.get("recv", 0, sum(plan.in_splits), g_slots)
        _all_to_all(rbuf, sbuf, plan.in_splits, plan.out_splits, t)
        return None, None, None, None, None, _to_tokens(rbuf, plan)


class _Combine(torch.autograd.Function):
    @staticmethod
    def forward(ctx, plan: PermutePlan, t: Transport, y: Tensor, probs: Tensor) -> Tensor:  # type: ignore[override]
        H = y.shape[1]
        y = y.contiguous()
        sbuf = _sort_chunks(y, *_by_source(plan), out=t.workspace.get("send", 1, plan.num_slots, y))
        want_p = ctx.needs_input_grad[3]
        P = sum(plan.in_splits)
        # the returned rows stay alive for the probability gradient; otherwise they are staging
        back = y.new_empty(P, H) if want_p else t.workspace.get("recv", 1, P, y)
        _all_to_all(back, sbuf, plan.in_splits, plan.out_splits, t)
        _count(t.meter, plan, plan.out_splits, H * y.element_size())
        t.meter.copied(sbuf)
        if plan.top_k == 1:  # one pair per token: place, then scale in token order
            out = _to_tokens(back, plan).mul_(probs.detach().reshape(-1, 1).to(y.dtype))
            t.meter.copied(out)
        else:
            p_sorted = probs.detach().reshape(-1)[plan.order].to(y.dtype)
            weighted = torch.mul(back, p_sorted.unsqueeze(1), out=t.workspace.get("weighted", 1, P, y))
            t.meter.copied(weighted)
            out = _to_tokens(weighted, plan)
        t.meter.copied(out)
        ctx.plan, ctx.t = plan, t
        ctx.save_for_backward(probs, back if want_p else None)
        return out

    @staticmethod
    def backward(ctx, g_out: Tensor):  # type: ignore[override]
        plan, t = ctx.plan, ctx.t
        probs, back = ctx.saved_tensors
        g = g_out.contiguous().index_select(0, plan.sorted_tokens)  # per pair, wire order
        g_p = None
        if ctx.needs_input_grad[3]:
            g_p = torch.zeros(plan.num_tokens * plan.top_k, dtype=probs.dtype, device=probs.device)
            g_p[plan.order] = torch.linalg.vecdot(g, back).to(probs.dtype)
            g_p = g_p.view(probs.shape)
        g_y = None
        if ctx.needs_input_grad[2]:
            g.mul_(probs.reshape(-1)[plan.order].to(g.dtype).unsqueeze(1))
            rbuf = t.workspace.get("recv", 1, plan.num_slots, g)
            _all_to_all(rbuf, g, plan.out_splits, plan.in_splits, t)
            g_y = _sort_chunks(rbuf, *_by_expert(plan))
        return None, None, g_y, g_p


@dataclass(frozen=True)
class PermuteHandle:
    plan: PermutePlan
    probs: Tensor  # the routing probabilities (T, K), weighted in at the combine


def dispatch(x: Tensor, routing: Routing, placement: Placement, rank: int, t: Transport) -> tuple[Tensor, PermuteHandle]:
    """x (T, H) -> (slots (N, H) expert-major, handle for ``combine``)."""
    holder: dict = {}
    slots = _Dispatch.apply(routing, placement, rank, t, holder, x)
    return slots, PermuteHandle(holder["plan"], routing.probs)


def combine(y: Tensor, handle: PermuteHandle, t: Transport) -> Tensor:
    """sum_k probs[t, k] * y(t, k) back at the tokens' ranks: (T, H)."""
    return _Combine.apply(handle.plan, t, y, handle.probs)
