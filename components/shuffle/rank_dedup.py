"""One-level shuffle with per-rank dedup: one coalesced all-to-all per direction, no per-call Python loops.

    dispatch  tokens --(one row per unique (token, expert rank), + (slot, prob) metadata)--> expanded
              into expert-major slots (expert, source, token) on arrival
    combine   slot outputs x probs --(summed per (source, token) on the expert rank)--> one row back
              per unique (token, rank) --(added in rank order)--> (T, H)

A token whose k experts include several on one rank crosses to that rank once; the receiver
expands it into its expert slots (one ``index_select``) and, on the way back, sums that token's
weighted expert outputs (one fused ``embedding_bag`` pass) before the single row returns. With top-1 (or no
shared ranks) nothing is deduplicated and the path is exactly Megatron's traffic minus its copies:
gather straight into the send buffer, one ``all_to_all_single``, expand straight into the slots.

Pairs the routing drops (``Routing.keep``: over an expert's capacity) are left out of the plan:
they add no row, no metadata and no slot; a token left without a served pair comes back as zeros.

Collectives per call: one small count exchange + one row all-to-all (dispatch), one row
all-to-all (combine) -- the same as Megatron's all-gather + 2 all-to-alls. The per-pair metadata
(the slot's row inside the source's block, and the probability) rides in the dispatch
all-to-all as whole padding rows after each peer's token rows, so it costs no extra collective.
Staging buffers come from the engine's ``Workspace``. All index tensors live on ``x.device``;
the only host syncs are the per-peer split sizes, as in Megatron.

Order of additions: a token's contributions on one rank are summed in ascending expert order
(one ``embedding_bag`` pass, which may fuse multiply and add), then the per-rank partial sums
in ascending rank order. Top-1 is bit for bit the single-process result; top-k matches it to
fp32 rounding (bit for bit on dyadic data, where every sum is exact -- the tests).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor

from components.shuffle.engine import Meter, Transport
from components.shuffle.routing import Placement, Routing

META_DTYPE = torch.int32  # metadata words: slot row (int32) and probability bits (float32 viewed as int32)
COUNT_DTYPE = torch.int64


@dataclass(frozen=True)
class _Layout:
    """Per-peer blocks of one all-to-all buffer: ``data`` token rows, then ``meta`` words padded to rows."""

    data: list[int]  # token rows per peer
    meta_words: list[int]  # metadata words per peer
    words_per_row: int

    @property
    def meta_rows(self) -> list[int]:
        w = self.words_per_row
        return [-(-m // w) for m in self.meta_words]

    @property
    def splits(self) -> list[int]:
        return [d + m for d, m in zip(self.data, self.meta_rows)]

    @property
    def base(self) -> list[int]:
        out, at = [], 0
        for s in self.splits:
            out.append(at)
            at += s
        return out

    @property
    def rows(self) -> int:
        return sum(self.splits)


def _block_offsets(counts: Tensor) -> Tensor:
    return torch.cumsum(counts, 0) - counts


def _words_per_row(width: int, like: Tensor) -> int:
    nbytes = width * like.element_size()
    if nbytes % 4:
        raise ValueError(f"rank_dedup: a row of {width} x {like.dtype} is not a whole number of 4-byte words; "
                         "use an even hidden size (or shuffle.plan: one_level)")
    return nbytes // 4


@dataclass(frozen=True)
class RankDedupPlan:
    """What both directions need on this rank (sender side: s_*, receiver side: r_*)."""

    num_tokens: int
    top_k: int
    node_of_peer: tuple[int, ...]
    rank: int
    # sender side (this rank's tokens)
    s_tok: Tensor  # (U,) token of each unique (dest rank, token) row, dest-major, tokens ascending
    s_unique: list[int]  # unique rows per dest rank
    s_pairs: list[int]  # pairs per dest rank
    s_pair_order: Tensor  # (P,) flat pair index (token*K + k) of each served pair in wire order (dest, local expert, token)
    s_pair_row: Tensor  # (P,) row of the pair's token inside the dest block (0..U_d-1)
    s_by_token: tuple[Tensor, Tensor]  # unique rows grouped by token (ranks ascending): index, bag offsets
    # receiver side (this rank's expert slots)
    r_unique: list[int]  # unique rows per source rank
    r_pairs: list[int]  # pairs per source rank
    r_chunk_counts: list[int]  # pairs per (source, local expert), row-major
    tokens_per_expert: tuple[int, ...]
    stats: Tensor | None  # global routing statistics the auto choice reads (see build_rank_dedup)
    kind: str = "rank_dedup"

    @property
    def num_slots(self) -> int:
        return sum(self.tokens_per_expert)


def _bags(owner: Tensor, bags: int, every_bag_filled: bool = True) -> tuple[Tensor, Tensor]:
    """Items grouped by owner for ``embedding_bag``: item indices (owner-major, stable) and bag offsets.

    When every bag owns at least one item, ``len(owner) == bags`` means one item each (top-1):
    then the grouping is the inverse permutation, no sort needed. (Capacity drops can leave a
    token without items: pass ``every_bag_filled=False``; its bag is empty and sums to 0.)
    """
    if every_bag_filled and owner.numel() == bags:
        order = torch.empty_like(owner)
        order[owner] = torch.arange(bags, device=owner.device)
        return order, torch.arange(bags, device=owner.device)
    order = torch.argsort(owner, stable=True)
    counts = torch.bincount(owner, minlength=bags)
    return order, torch.cumsum(counts, 0) - counts


def _sum_bags(rows: Tensor, index: Tensor, offsets: Tensor, weights: Tensor | None = None) -> Tensor:
    """out[b] = sum_i weights[i] * rows[index[i]] over bag b's items, in item order: a fused
    gather (+ scale) + reduce, one pass instead of mul, zero-fill and index_add."""
    if rows.shape[0] == 0 or index.numel() == 0:
        return rows.new_zeros(offsets.numel(), rows.shape[1])
    return F.embedding_bag(index, rows, offsets, mode="sum", per_sample_weights=weights)


STAT_FIELDS = ("pairs_offrank", "pairs_internode", "rank_rows", "rank_rows_internode", "node_rows_internode")


def routing_stats(routing: Routing, placement: Placement, rank: int) -> Tensor:
    """This rank's share of the numbers the auto plan choice needs (summed over ranks by the count exchange).

    pairs leaving the rank, pairs crossing nodes, unique (token, other rank) rows, of those crossing nodes, unique
    (token, other node) rows -- the rows one level without dedup, one level with per-rank dedup and
    two level put on the links.
    """
    ids = routing.expert_ids
    T = routing.num_tokens
    dev = ids.device
    rank_of = ids // placement.local_experts
    node_of = rank_of // placement.ranks_per_node
    me_node = placement.node_of(rank)
    remote_rank, remote_node = rank_of != rank, node_of != me_node
    occ_r = torch.zeros(T, placement.world_size, dtype=torch.bool, device=dev)
    occ_r.scatter_(1, rank_of, True)
    occ_r[:, rank] = False
    occ_n = torch.zeros(T, placement.num_nodes, dtype=torch.bool, device=dev)
    occ_n.scatter_(1, node_of, True)
    occ_n[:, me_node] = False
    ranks_remote_node = torch.tensor([placement.node_of(r) != me_node for r in range(placement.world_size)],
                                     device=dev)
    return torch.stack([
        remote_rank.sum(),
        remote_node.sum(),
        occ_r.sum(),
        occ_r[:, ranks_remote_node].sum(),
        occ_n.sum(),
    ]).to(COUNT_DTYPE)


def expected_saved_bytes(pairs_per_rank: Tensor, placement: Placement, top_k: int, row_bytes: int) -> float:
    """Bytes per-rank dedup is expected to save per rank and call (dispatch + combine), from the group's
    (W, E) served-pair counts and the dedup factor of uniform routing.

    Off-rank pairs come from the counts; per (token, other rank) a uniform top-k token sends
    ``top_k (E - L) / E`` pairs but hits each other rank with probability ``1 - C(E-L, k) / C(E, k)``,
    so rank dedup sends pairs / factor rows, factor = pairs per token / ((W - 1) x that probability).
    Every rank computes the same number (the counts are global), so all pick the same plan.
    """
    W, L, E = placement.world_size, placement.local_experts, placement.num_experts
    if W == 1 or top_k == 1:
        return 0.0
    pairs_per_token = top_k * (E - L) / E
    rows_per_token = (W - 1) * (1 - math.comb(E - L, top_k) / math.comb(E, top_k))
    dev = pairs_per_rank.device
    off_rank = torch.arange(E, device=dev).unsqueeze(0) // L != torch.arange(W, device=dev).unsqueeze(1)  # (W, E)
    off_rank_pairs = int(pairs_per_rank[off_rank].sum())
    return 2 * row_bytes * off_rank_pairs * (1 - rows_per_token / pairs_per_token) / W


_TOKEN_OF_PAIR: dict[tuple, Tensor] = {}


def _token_of_pair(T: int, K: int, device) -> Tensor:
    """arange(T*K) // K, cached per call shape (read-only)."""
    key = (T, K, str(device))
    tok = _TOKEN_OF_PAIR.get(key)
    if tok is None:
        if len(_TOKEN_OF_PAIR) > 64:
            _TOKEN_OF_PAIR.clear()
        tok = _TOKEN_OF_PAIR[key] = torch.arange(T * K, device=device) // K
    return tok


def build_rank_dedup(routing: Routing, placement: Placement, rank: int, group: dist.ProcessGroup | None,
                     with_stats: bool = False) -> RankDedupPlan:
    """Sender descriptors from the routing, receiver layout from one count all-to-all.

    ``with_stats`` appends this rank's ``routing_stats`` to every peer's counts, so after the
    exchange every rank holds the global sums (no extra collective for the auto choice).
    """
    ids = routing.expert_ids
    dev = ids.device
    T, K = routing.num_tokens, routing.top_k
    W, L = placement.world_size, placement.local_experts
    e = ids.reshape(-1)
    tok = _token_of_pair(T, K, dev)
    pairs = routing.kept_pairs()  # capacity drops: only served pairs travel
    if pairs is not None:
        e, tok = e[pairs], tok[pairs]
    dest = e // L

    # unique (dest, token) rows, dest-major, tokens ascending; row of each (dest, token) inside its block
    occ = torch.zeros(W, max(T, 1), dtype=torch.bool, device=dev)
    occ[dest, tok] = True
    flat = occ.view(-1)
    csum = torch.cumsum(flat, 0)
    u_key = flat.nonzero().squeeze(1)
    s_tok = u_key % max(T, 1)
    u_per_dest = occ.sum(1)
    u_base = _block_offsets(u_per_dest)

    pair_counts = torch.bincount(e, minlength=W * L).view(W, L)
    send = torch.cat([u_per_dest.view(W, 1), pair_counts], dim=1).to(COUNT_DTYPE)
    if with_stats:
        send = torch.cat([send, routing_stats(routing, placement, rank).expand(W, -1)], dim=1)
    recv, work = _post_counts(send, group)

    # while the counts travel: pairs in wire order (dest, local expert, token) = (expert, token)
    order = torch.argsort(e * max(T, 1) + tok)
    e_s, tok_s = e[order], tok[order]
    d_s = e_s // L
    s_pair_row = csum[d_s * max(T, 1) + tok_s] - 1 - u_base[d_s]
    s_by_token = _bags(s_tok, T, every_bag_filled=pairs is None)
    if pairs is not None:
        order = pairs[order]
    if work is not None:
        work.wait()
    stats = recv[:, L + 1 :].sum(0) if with_stats else None
    host = torch.cat([send[:, : L + 1], recv[:, : L + 1]], dim=1).cpu()  # the one host sync
    s_unique, s_pairs = host[:, 0].tolist(), host[:, 1 : L + 1].sum(1).tolist()
    r_unique, r_pairs = host[:, L + 1].tolist(), host[:, L + 2 :].sum(1).tolist()
    per_expert = tuple(host[:, L + 2 :].sum(0).tolist())
    return RankDedupPlan(
        num_tokens=T, top_k=K, node_of_peer=tuple(placement.node_of(r) for r in range(W)), rank=rank,
        s_tok=s_tok, s_by_token=s_by_token, s_unique=s_unique, s_pairs=s_pairs, s_pair_order=order, s_pair_row=s_pair_row,
        r_unique=r_unique, r_pairs=r_pairs, r_chunk_counts=host[:, L + 2 :].reshape(-1).tolist(), tokens_per_expert=per_expert,
        stats=stats,
    )


def _post_counts(send: Tensor, group: dist.ProcessGroup | None):
    """Start the count all-to-all (send[p] -> peer p); returns (recv buffer, work or None)."""
    if group is None:
        return send.clone(), None
    recv = torch.empty_like(send)
    work = dist.all_to_all_single(recv.view(-1), send.contiguous().view(-1), group=group, async_op=True)
    return recv, work


def _all_to_all(out: Tensor, inp: Tensor, out_splits: list[int], in_splits: list[int], t: Transport,
                async_op: bool = False):
    if t.group is None:
        out.copy_(inp)
        return None
    return dist.all_to_all_single(out, inp, out_splits, in_splits, group=t.group, async_op=async_op)


def _count(meter: Meter, plan: RankDedupPlan, rows_to_peer: list[int], row_bytes: int, side_to_peer: list[int]) -> None:
    me = plan.node_of_peer[plan.rank]
    for p, (n, side) in enumerate(zip(rows_to_peer, side_to_peer)):
        if p == plan.rank:
            continue
        meter.bytes_sent += n * row_bytes
        meter.bytes_side += side
        if plan.node_of_peer[p] != me:
            meter.bytes_internode += n * row_bytes


@dataclass
class _Received:
    """Receiver-side index tensors, computed once in dispatch and reused by combine and backward."""

    slot_row: Tensor  # (N,) compact received row (source-major, unique rows) feeding each slot
    slot_probs: Tensor  # (N,)
    pair_slot: Tensor  # (N,) slot of each received pair, pairs in arrival order (source, expert, token)
    by_row: tuple[Tensor, Tensor]  # slots grouped by received row (experts ascending): index, bag offsets


def _offsets(counts: list[int]) -> list[int]:
    out, at = [], 0
    for c in counts:
        out.append(at)
        at += c
    return out


def _per_item(shift: list[int], counts: list[int], device, arange: bool = True) -> Tensor:
    """Blocked items (block b holds counts[b]): shift[b] (+ the item's global index with ``arange``).

    Per-block values are plain Python (at most W * L of them); one expansion per call, so the
    per-call index math is a handful of tensor ops whatever the number of peers and experts. The
    expansion runs on ``device``: only the 2 x blocks values cross from the host, not the n items.
    (Expanded on the host, the n-item copies were 28% of the GPU time of a round trip at 32k tokens,
    top-8, on one H200, and the fused path ran at 0.31-0.36x Megatron's speed there; 1.07-1.20x now.)
    """
    n = sum(counts)
    blocks = torch.tensor([shift, counts], dtype=torch.long).to(device)
    per = torch.repeat_interleave(blocks[0], blocks[1], output_size=n)
    return per + torch.arange(n, device=device) if arange else per


def _meta_shift(layout: _Layout, counts: list[int], second: bool = False) -> list[int]:
    """Per peer: word index of its first metadata item minus the item's global index.

    A peer's metadata is ``counts[p]`` words, or with ``second`` a second run of ``counts[p]``
    words right after the first, listed after all first runs (items P..2P-1 of one expansion).
    """
    w, total = layout.words_per_row, sum(counts)
    return [(b + d) * w - o + ((c - total) if second else 0)
            for b, d, o, c in zip(layout.base, layout.data, _offsets(counts), counts)]


def _data_positions(layout: _Layout, device) -> Tensor:
    """Padded buffer row of each compact data row (peer-major)."""
    return _per_item([b - o for b, o in zip(layout.base, _offsets(layout.data))], layout.data, device)


class _Dispatch(torch.autograd.Function):
    @staticmethod
    def forward(ctx, plan: RankDedupPlan, t: Transport, holder: dict, x: Tensor, probs: Tensor):  # type: ignore[override]
        H = x.shape[1]
        dev = x.device
        words = _words_per_row(H, x)
        send_l = _Layout(plan.s_unique, [2 * p for p in plan.s_pairs], words)
        recv_l = _Layout(plan.r_unique, [2 * p for p in plan.r_pairs], words)
        # gather straight into the send buffer (metadata rows gather row 0 as a placeholder, overwritten)
        gather = torch.zeros(send_l.rows, dtype=torch.long, device=dev)
        gather[_data_positions(send_l, dev)] = plan.s_tok
        sbuf = t.workspace.get("send", 0, send_l.rows, x)
        torch.index_select(x, 0, gather, out=sbuf)
        t.meter.copied(sbuf)
        words_view = sbuf.view(-1).view(META_DTYPE) if sbuf.numel() else sbuf.new_empty(0, dtype=META_DTYPE)
        # per peer: P_d slot rows, then P_d probability words
        pos = _per_item(_meta_shift(send_l, plan.s_pairs) + _meta_shift(send_l, plan.s_pairs, second=True),
                        plan.s_pairs + plan.s_pairs, dev)
        p_s = probs.detach().reshape(-1)[plan.s_pair_order].to(torch.float32)
        words_view[pos] = torch.cat([plan.s_pair_row.to(META_DTYPE), p_s.view(META_DTYPE)])
        rbuf = t.workspace.get("recv", 0, recv_l.rows, x)
        work = _all_to_all(rbuf, sbuf, recv_l.splits, send_l.splits, t, async_op=True)
        _count(t.meter, plan, plan.s_unique, H * x.element_size(),
               [(r - d) * H * x.element_size() for r, d in zip(send_l.splits, plan.s_unique)])

        # while the rows travel: everything the receiver derives from counts alone
        W, L = len(plan.r_unique), len(plan.tokens_per_expert)
        P = sum(plan.r_pairs)
        rpos = _per_item(_meta_shift(recv_l, plan.r_pairs) + _meta_shift(recv_l, plan.r_pairs, second=True),
                         plan.r_pairs + plan.r_pairs, dev)
        bases = _per_item(_offsets(plan.r_unique) + recv_l.base, plan.r_pairs + plan.r_pairs, dev, arange=False)
        # arrival order (source, expert, token) -> slots (expert, source, token): one shift per chunk
        chunks = plan.r_chunk_counts  # (source, expert) row-major
        slot_start = _offsets([chunks[s_ * L + l] for l in range(L) for s_ in range(W)])
        chunk_start = _offsets(chunks)
        shift = [slot_start[l * W + s_] - chunk_start[s_ * L + l] for s_ in range(W) for l in range(L)]
        pair_slot = _per_item(shift, chunks, dev)
        if work is not None:
            work.wait()

        # receiver: metadata -> slot of each received pair, its row and probability
        rwords = rbuf.view(-1).view(META_DTYPE) if rbuf.numel() else rbuf.new_empty(0, dtype=META_DTYPE)
        got = rwords[rpos]
        row_in_block = got[:P].long()
        prob = got[P:].view(torch.float32)
        N = plan.num_slots
        slot_rows = torch.empty(2, N, dtype=torch.long, device=dev)  # compact row, padded row of each slot
        slot_rows[:, pair_slot] = (bases + row_in_block.repeat(2)).view(2, P)
        slot_row, slot_padded = slot_rows[0], slot_rows[1]
        slot_probs = torch.empty(N, dtype=probs.dtype, device=dev)
        slot_probs[pair_slot] = prob.to(probs.dtype)
        slots = rbuf.index_select(0, slot_padded)  # expand straight into expert-major slots
        t.meter.copied(slots)
        ctx.plan, ctx.t = plan, t
        by_row = _bags(slot_row, sum(plan.r_unique))
        ctx.received = holder["received"] = _Received(slot_row, slot_probs, pair_slot, by_row)
        ctx.x_shape, ctx.probs_shape = x.shape, probs.shape
        return slots, slot_probs

    @staticmethod
    def backward(ctx, g_slots: Tensor, g_probs: Tensor | None):  # type: ignore[override]
        plan, t, rec = ctx.plan, ctx.t, ctx.received
        want_p = ctx.needs_input_grad[4]
        H = ctx.x_shape[1]
        dev = g_slots.device
        words = _words_per_row(H, g_slots)
        # expert side: reduce each token's slot gradients into its unique row, probs grads as metadata
        send_l = _Layout(plan.r_unique, [p if want_p else 0 for p in plan.r_pairs], words)
        recv_l = _Layout(plan.s_unique, [p if want_p else 0 for p in plan.s_pairs], words)
        # bags over the padded send layout: data rows sum their slots, metadata rows are empty bags
        per_row = torch.zeros(send_l.rows, dtype=torch.long, device=dev)
        per_row[_data_positions(send_l, dev)] = torch.bincount(rec.slot_row, minlength=sum(plan.r_unique))
        sbuf = _sum_bags(g_slots.contiguous(), rec.by_row[0], torch.cumsum(per_row, 0) - per_row)
        if want_p:
            gp = (g_probs if g_probs is not None else torch.zeros_like(rec.slot_probs))[rec.pair_slot]
            pos = _per_item(_meta_shift(send_l, plan.r_pairs), plan.r_pairs, dev)
            sbuf.view(-1).view(META_DTYPE)[pos] = gp.to(torch.float32).view(META_DTYPE)
        rbuf = t.workspace.get("recv", 0, recv_l.rows, g_slots)
        _all_to_all(rbuf, sbuf, recv_l.splits, send_l.splits, t)
        index, offsets = plan.s_by_token
        g_x = _sum_bags(rbuf, _data_positions(recv_l, dev)[index], offsets)
        g_p = None
        if want_p:
            pos = _per_item(_meta_shift(recv_l, plan.s_pairs), plan.s_pairs, dev)
            vals = rbuf.view(-1).view(META_DTYPE)[pos].view(torch.float32)
            g_p = torch.zeros(plan.num_tokens * plan.top_k, dtype=g_slots.dtype, device=dev)
            g_p[plan.s_pair_order] = vals.to(g_slots.dtype)
            g_p = g_p.view(ctx.probs_shape)
        return None, None, None, g_x, g_p


class _Combine(torch.autograd.Function):
    @staticmethod
    def forward(ctx, plan: RankDedupPlan, t: Transport, rec: _Received, y: Tensor, slot_probs: Tensor):  # type: ignore[override]
        H = y.shape[1]
        # expert side: weight and sum each token's slots into its single return row (one fused pass)
        index, offsets = rec.by_row
        if y.shape[0] == sum(plan.r_unique):  # one slot per row (e.g. top-1): gather + scale in staging
            sbuf = t.workspace.get("send", 1, y.shape[0], y)
            torch.index_select(y, 0, index, out=sbuf).mul_(slot_probs[index].unsqueeze(1))
        else:
            sbuf = _sum_bags(y, index, offsets, slot_probs[index])
        t.meter.copied(sbuf)
        rbuf = t.workspace.get("recv", 1, sum(plan.s_unique), y)
        _all_to_all(rbuf, sbuf, plan.s_unique, plan.r_unique, t)
        _count(t.meter, plan, plan.r_unique, H * y.element_size(), [0] * len(plan.r_unique))
        index, offsets = plan.s_by_token
        out = _sum_bags(rbuf, index, offsets)  # per token: ranks ascending = experts ascending
        t.meter.copied(out)
        ctx.plan, ctx.t, ctx.rec = plan, t, rec
        ctx.save_for_backward(y, slot_probs)
        return out

    @staticmethod
    def backward(ctx, g_out: Tensor):  # type: ignore[override]
        plan, t, rec = ctx.plan, ctx.t, ctx.rec
        y, slot_probs = ctx.saved_tensors
        sbuf = t.workspace.get("send", 1, sum(plan.s_unique), g_out)
        torch.index_select(g_out.contiguous(), 0, plan.s_tok, out=sbuf)
        rbuf = t.workspace.get("recv", 1, sum(plan.r_unique), g_out)
        _all_to_all(rbuf, sbuf, plan.r_unique, plan.s_unique, t)
        g_w = rbuf.index_select(0, rec.slot_row)
        g_p = torch.linalg.vecdot(g_w, y) if ctx.needs_input_grad[4] else None
        g_y = g_w.mul_(slot_probs.unsqueeze(1)) if ctx.needs_input_grad[3] else None
        return None, None, None, g_y, g_p


@dataclass(frozen=True)
class RankDedupHandle:
    plan: RankDedupPlan
    received: _Received


def dispatch(x: Tensor, routing: Routing, plan: RankDedupPlan, t: Transport) -> tuple[Tensor, RankDedupHandle, Tensor]:
    """x (T, H) -> (slots (N, H) expert-major, handle, slot probabilities (N,))."""
    holder: dict = {}
    slots, slot_probs = _Dispatch.apply(plan, t, holder, x, routing.probs)
    return slots, RankDedupHandle(plan, holder["received"]), slot_probs


def combine(y: Tensor, slot_probs: Tensor, handle: RankDedupHandle, t: Transport) -> Tensor:
    """sum_k probs[t, k] * y(t, k) back at the tokens' ranks: (T, H)."""
    return _Combine.apply(handle.plan, t, handle.received, y, slot_probs)
