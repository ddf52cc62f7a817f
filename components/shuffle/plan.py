"""Routing plan: turn a top-k routing into per-peer row-index descriptors.

A *stage* moves rows of a local source tensor to rows of a destination tensor on other ranks:
for every message it says, on the sending side, which source rows to read (``send``), and on the
receiving side, which destination rows to fill (``recv``). Both sides derive the same message
list (same peers, rounds, row counts, order) from the routing plus one small count exchange, so
the row data itself never carries metadata. The wire order inside a message is free, because
both ends hold the indices: the sender gathers straight from the unpermuted tokens and the
receiver scatters straight into expert-major slots.

    one level   tokens --(pairs, rank/expert-major)--> expert slots
    two level   tokens --(one row per (token, node))--> forwarder rows F
                F      --(expand to (token, expert) pairs, intra-node)--> expert slots

Slots on a rank are expert-major: all rows of local expert 0, then expert 1, ...; inside an
expert, one level orders them (source rank, token) -- exactly the order a single process would
see -- and two level orders them (round, forwarder, source rank, token).

Rounds split the tokens of every source into ``rounds`` contiguous blocks; message (round r) only
carries rows of block r. The engine pipelines rounds (gather r+1 while r is in flight) and, since
all contributions of a token arrive in the same round, in peer then expert order, the combine adds
each token's expert outputs in ascending expert order: the same sum a single process computes.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Literal

import torch
import torch.distributed as dist
from torch import Tensor

from components.shuffle.routing import Placement, Routing

Grouping = Literal["static", "balanced"]
PlanKind = Literal["one_level", "two_level"]


@dataclass(frozen=True)
class Message:
    """One send or receive: ``count`` rows to/from ``peer`` in ``round``.

    ``rows`` indexes the local tensor (source rows for a send, destination rows for a receive).
    ``start >= 0`` says they are the contiguous range start..start+count (``index`` is None), so
    the engine can send from / receive into a view without a staging copy.
    """

    peer: int
    round: int
    tag: int
    count: int
    start: int
    index: Tensor | None = None

    @property
    def rows(self) -> Tensor:
        return self.index if self.index is not None else torch.arange(self.start, self.start + self.count)


@dataclass(frozen=True)
class RoundRows:
    """All of one side's rows of a round, peer-major (self included): what one all-to-all moves."""

    rows: Tensor
    splits: tuple[int, ...]  # rows per peer
    start: int  # >= 0: rows are the range start..start+len (send/receive a view, no staging)


def _round_rows(messages: list[Message], rounds: int, world: int) -> tuple[RoundRows, ...]:
    out = []
    for r in range(rounds):
        ms = [m for m in messages if m.round == r]
        rows = torch.cat([m.rows for m in ms]) if ms else torch.empty(0, dtype=torch.long)
        splits = [0] * world
        for m in ms:
            splits[m.peer] += m.count
        out.append(RoundRows(rows, tuple(splits), _range_start(rows) if rows.numel() else 0))
    return tuple(out)


@dataclass(frozen=True)
class StagePlan:
    """One all-to-all-like movement of rows, as this rank sees it."""

    rank: int
    rounds: int
    src_rows: int
    dst_rows: int
    sends: tuple[Message, ...]  # wire order: (round, peer, segment)
    recvs: tuple[Message, ...]
    dst_covered: bool  # every destination row is received exactly once
    src_once: bool  # every source row is sent exactly once
    node_of_peer: tuple[int, ...]
    segment_rows: float  # global mean rows per message segment (same on every rank)
    send_rounds: tuple[RoundRows, ...]  # the same rows, grouped for one all-to-all per round
    recv_rounds: tuple[RoundRows, ...]

    def reversed(self) -> StagePlan:
        """The adjoint movement: destination rows travel back to the source rows they came from."""
        return replace(
            self,
            src_rows=self.dst_rows,
            dst_rows=self.src_rows,
            sends=self.recvs,
            recvs=self.sends,
            dst_covered=self.src_once,
            src_once=self.dst_covered,
            send_rounds=self.recv_rounds,
            recv_rounds=self.send_rounds,
        )

    def rows_sent(self, internode_only: bool = False) -> int:
        me = self.node_of_peer[self.rank]
        return sum(
            m.count
            for m in self.sends
            if m.peer != self.rank and (not internode_only or self.node_of_peer[m.peer] != me)
        )


@dataclass(frozen=True)
class ShufflePlan:
    """Everything the fused dispatch/combine of one MoE call needs on this rank."""

    kind: PlanKind
    token_stages: tuple[StagePlan, ...]  # x (T, H) -> ... -> slots (N, H)
    pair_stages: tuple[StagePlan, ...]  # probs (T*K,) -> ... -> slots (N,)
    tokens_per_expert: tuple[int, ...]  # slot rows of each local expert, expert-major
    num_tokens: int
    top_k: int
    forwarders: Tensor | None = field(default=None)  # (W, nodes) two-level forwarder map

    @property
    def shared_hops(self) -> tuple[bool, ...]:
        """Per hop: do token rows and pair probabilities move in the same messages? (Same on every
        rank by construction -- the coalesced transfer is collective, so this must not depend on data.)"""
        return (True,) if self.kind == "one_level" else (False, True)

    @property
    def num_slots(self) -> int:
        return sum(self.tokens_per_expert)


# --------------------------------------------------------------------------------------------
# building blocks


def _messages(peer: Tensor, rnd: Tensor, seg: Tensor, rows: Tensor, segments: int, world: int) -> list[Message]:
    """Group items (already sorted in wire order) into messages by (round, peer, segment)."""
    if rows.numel() == 0:
        return []
    key = (rnd * world + peer) * segments + seg
    keys, counts = torch.unique_consecutive(key, return_counts=True)
    if keys.numel() > 1 and not bool((keys.diff() > 0).all()):
        raise AssertionError("plan: items are not sorted in wire order")
    # a message is a range iff no step inside it differs from +1 (vectorized over all messages)
    breaks = torch.cat([torch.zeros(1, dtype=torch.long), torch.cumsum((rows.diff() != 1).long(), 0)])
    ends = torch.cumsum(counts, 0)
    firsts = ends - counts
    ranged = (breaks[ends - 1] - breaks[firsts] == 0).tolist()
    starts = rows[firsts].tolist()
    out = []
    for k, chunk, is_range, start in zip(keys.tolist(), rows.split(counts.tolist()), ranged, starts):
        r, p = divmod(k // segments, world)
        out.append(Message(p, r, 0, chunk.numel(), start if is_range else -1, None if is_range else chunk))
    return out


def _range_messages(peer: list[int], rnd: list[int], start: list[int], count: list[int]) -> list[Message]:
    """Messages whose destination rows are known ranges (receivers of a layout computed from counts)."""
    return [
        Message(peer=p, round=r, tag=0, count=c, start=s)
        for p, r, s, c in zip(peer, rnd, start, count)
        if c > 0
    ]


def _range_start(rows: Tensor) -> int:
    n = rows.numel()
    if n == 0:
        return -1
    first = int(rows[0])
    if int(rows[-1]) - first != n - 1 or (n > 1 and not bool((rows.diff() == 1).all())):
        return -1
    return first


def _tagged(messages: list[Message]) -> tuple[Message, ...]:
    """Tag = sequence number per peer, so the i-th send to p matches p's i-th receive from us."""
    seen: dict[int, int] = {}
    out = []
    for m in sorted(messages, key=lambda m: (m.round, m.peer)):  # stable: keeps segment order
        tag = seen.get(m.peer, 0)
        seen[m.peer] = tag + 1
        out.append(Message(m.peer, m.round, tag, m.count, m.start, m.index))
    return tuple(out)


def _stage(rank: int, rounds: int, src_rows: int, dst_rows: int, sends: list[Message], recvs: list[Message],
           placement: Placement, segment_rows: float) -> StagePlan:
    return StagePlan(
        rank=rank,
        rounds=rounds,
        src_rows=src_rows,
        dst_rows=dst_rows,
        sends=_tagged(sends),
        recvs=_tagged(recvs),
        dst_covered=_exactly_once(recvs, dst_rows),
        src_once=_exactly_once(sends, src_rows),
        node_of_peer=tuple(placement.node_of(r) for r in range(placement.world_size)),
        segment_rows=segment_rows,
        send_rounds=_round_rows(sends, rounds, placement.world_size),
        recv_rounds=_round_rows(recvs, rounds, placement.world_size),
    )


def _exactly_once(messages: list[Message], n: int) -> bool:
    """Do the messages' rows cover 0..n-1 exactly once?"""
    if sum(m.count for m in messages) != n:
        return False
    if all(m.index is None for m in messages):  # ranges: sorted spans must tile [0, n)
        pos = 0
        for start, count in sorted((m.start, m.count) for m in messages):
            if start != pos:
                return False
            pos += count
        return True
    rows = torch.cat([m.rows for m in messages])
    return bool((torch.bincount(rows, minlength=n) == 1).all())


def _exchange_counts(send: Tensor, group: dist.ProcessGroup | None) -> Tensor:
    """send[p, ...] = what this rank sends to peer p; returns recv[s, ...] = what s sends here."""
    if group is None:
        return send.clone()
    recv = torch.empty_like(send)
    dist.all_to_all_single(recv.view(-1), send.contiguous().view(-1), group=group)
    return recv


def _exchange_rows(send: Tensor, send_counts: list[int], recv_counts: list[int],
                   group: dist.ProcessGroup | None) -> Tensor:
    """Variable-size all-to-all of small integer metadata rows (plan time only)."""
    if group is None:
        return send.clone()
    recv = torch.empty((sum(recv_counts),) + tuple(send.shape[1:]), dtype=send.dtype)
    width = int(torch.tensor(send.shape[1:]).prod()) if send.dim() > 1 else 1
    dist.all_to_all_single(
        recv.view(-1), send.contiguous().view(-1),
        output_split_sizes=[c * width for c in recv_counts],
        input_split_sizes=[c * width for c in send_counts], group=group,
    )
    return recv


def _expert_major_recvs(counts: Tensor, rounds: int) -> tuple[list[Message], tuple[int, ...]]:
    """Receive ranges for slot layout (local expert, round, source/forwarder) from counts[peer, round, l]."""
    world, _, local = counts.shape
    blocks = counts.permute(2, 1, 0).reshape(-1)  # order (l, round, peer)
    base = (torch.cumsum(blocks, 0) - blocks).view(local, rounds, world)
    peer, rnd, start, count = [], [], [], []
    for r in range(rounds):  # wire order (round, peer, l)
        for p in range(world):
            for l in range(local):
                peer.append(p), rnd.append(r), start.append(int(base[l, r, p])), count.append(int(counts[p, r, l]))
    return _range_messages(peer, rnd, start, count), tuple(counts.sum(dim=(0, 1)).tolist())


# --------------------------------------------------------------------------------------------
# one level


def build_one_level(
    routing: Routing, placement: Placement, rank: int, group: dist.ProcessGroup | None, rounds: int = 1
) -> ShufflePlan:
    """Every (token, expert) pair travels straight to the expert's rank.

    Sender wire order per peer: (round, local expert, token); receiver slots (expert, source, token).
    """
    T, K = routing.num_tokens, routing.top_k
    W, L = placement.world_size, placement.local_experts
    e = routing.expert_ids.reshape(-1)
    pair = torch.arange(T * K)
    tok = pair // K
    dest, local = e // L, e % L
    rnd = tok * rounds // max(T, 1)
    order = torch.argsort(((rnd * W + dest) * L + local) * max(T, 1) + tok)
    dest, local, rnd, tok, pair = dest[order], local[order], rnd[order], tok[order], pair[order]

    send_counts = torch.bincount((dest * rounds + rnd) * L + local, minlength=W * rounds * L).view(W, rounds * L)
    got = _exchange_counts(torch.cat([send_counts, torch.full((W, 1), T)], dim=1), group)  # + every rank's T
    recv_counts = got[:, :-1].reshape(W, rounds, L)  # [source, round, l]
    segment_rows = float(got[:, -1].sum()) * K / (W * placement.num_experts * rounds)
    # slots (l, source, token): the round dimension is inside the source block, so layout (l, s, r)
    blocks = recv_counts.permute(2, 0, 1).reshape(-1)
    base = (torch.cumsum(blocks, 0) - blocks).view(L, W, rounds)
    peer, rr, start, count = [], [], [], []
    for r in range(rounds):
        for s in range(W):
            for l in range(L):
                peer.append(s), rr.append(r), start.append(int(base[l, s, r])), count.append(int(recv_counts[s, r, l]))
    recvs = _range_messages(peer, rr, start, count)
    per_expert = tuple(recv_counts.sum(dim=(0, 1)).tolist())
    slots = sum(per_expert)

    token_sends = _messages(dest, rnd, local, tok, L, W)
    pair_sends = _messages(dest, rnd, local, pair, L, W)
    return ShufflePlan(
        kind="one_level",
        token_stages=(_stage(rank, rounds, T, slots, token_sends, recvs, placement, segment_rows),),
        pair_stages=(_stage(rank, rounds, T * K, slots, pair_sends, recvs, placement, segment_rows),),
        tokens_per_expert=per_expert,
        num_tokens=T,
        top_k=K,
    )


# --------------------------------------------------------------------------------------------
# two level


def assign_forwarders(load: Tensor, placement: Placement, grouping: Grouping) -> Tensor:
    """fwd[s, n] = the rank on node n that forwards source s's tokens to node n's experts.

    load[s, n] = unique tokens rank s sends to node n. A source forwards to its own node itself.
    static: the rank with the same local index. balanced: per destination node b, visit the other
    source nodes in circular order starting after b; pair that node's sources sorted by load
    (heaviest first) with b's ranks sorted by forwarding load so far (lightest first, ties broken
    by a circular shift of the local index) -- longest-processing-time assignment, one source per
    forwarder per node so fan-in stays equal.
    """
    W, R, N = placement.world_size, placement.ranks_per_node, placement.num_nodes
    fwd = torch.empty(W, N, dtype=torch.long)
    for s in range(W):
        for n in range(N):
            fwd[s, n] = n * R + s % R
    if grouping == "static" or N == 1:
        return fwd
    if grouping != "balanced":
        raise ValueError(f"assign_forwarders: unknown grouping {grouping!r} (static | balanced)")
    for b in range(N):
        ranks_b = list(range(b * R, (b + 1) * R))
        acc = {f: int(load[f, b]) for f in ranks_b}  # its own node's forwarding work
        for step in range(1, N):
            a = (b + step) % N
            sources = sorted(range(a * R, (a + 1) * R), key=lambda s: (-int(load[s, b]), s))
            targets = sorted(ranks_b, key=lambda f: (acc[f], (f - b * R - a) % R))
            for s, f in zip(sources, targets):
                fwd[s, b] = f
                acc[f] += int(load[s, b])
    return fwd


def forwarder_loads(load: Tensor, fwd: Tensor, placement: Placement) -> Tensor:
    """Unique token rows each rank receives as a forwarder (the work the balancer evens out)."""
    out = torch.zeros(placement.world_size, dtype=torch.long)
    for s in range(placement.world_size):
        for n in range(placement.num_nodes):
            out[int(fwd[s, n])] += int(load[s, n])
    return out


def build_two_level(
    routing: Routing,
    placement: Placement,
    rank: int,
    group: dist.ProcessGroup | None,
    rounds: int = 1,
    grouping: Grouping = "balanced",
) -> ShufflePlan:
    """Each token crosses to a node at most once; a forwarder there expands it to its pairs.

    Stage A: source -> forwarder, one row per unique (token, node), into forwarder rows F laid out
    (source, round, token). Stage B: forwarder -> expert rank on its node, one row per pair.
    The combine runs B then A backwards in add mode: the forwarder sums a token's (already
    probability-weighted) expert outputs before the single row crosses back.
    """
    T, K = routing.num_tokens, routing.top_k
    W, L, R, N, E = (placement.world_size, placement.local_experts, placement.ranks_per_node,
                     placement.num_nodes, placement.num_experts)
    Tb = max(T, 1)
    me = rank
    e = routing.expert_ids.reshape(-1)
    pair = torch.arange(T * K)
    tok = pair // K
    node = e // L // R
    rnd = tok * rounds // Tb

    # unique (token, node) crossings and the forwarder of each
    tn = torch.unique(tok * N + node)
    u_tok, u_node = tn // N, tn % N
    load_me = torch.bincount(u_node, minlength=N)
    if grouping == "balanced" and N > 1 and group is not None:
        load = _all_gather(load_me, group)
    else:
        load = load_me.expand(W, N).clone()
    fwd = assign_forwarders(load, placement, grouping if group is not None else "static")
    fwd_me = fwd[me]

    # stage A sends: unique token rows, wire order (round, forwarder, token)
    u_f, u_rnd = fwd_me[u_node], u_tok * rounds // Tb
    order = torch.argsort((u_rnd * W + u_f) * Tb + u_tok)
    a_sends = _messages(u_f[order], u_rnd[order], torch.zeros_like(order), u_tok[order], 1, W)

    # stage A' sends: pair probabilities, wire order (round, forwarder, token, expert)
    p_f = fwd_me[node]
    order = torch.argsort(((rnd * W + p_f) * Tb + tok) * E + e)
    ap_sends = _messages(p_f[order], rnd[order], torch.zeros_like(order), pair[order], 1, W)

    # metadata to forwarders: (round, token, expert) per pair, grouped by forwarder
    order = torch.argsort(((p_f * rounds + rnd) * Tb + tok) * E + e)
    meta = torch.stack([rnd[order], tok[order], e[order]], dim=1)
    meta_counts = torch.bincount(p_f, minlength=W)
    got_counts = _exchange_counts(torch.stack([meta_counts, torch.full((W,), T)], dim=1), group)
    tokens_all = float(got_counts[:, 1].sum())
    got_counts = got_counts[:, 0].tolist()
    got = _exchange_rows(meta, meta_counts.tolist(), got_counts, group)  # sorted (source, round, token, expert)
    m_src = torch.repeat_interleave(torch.arange(W), torch.tensor(got_counts, dtype=torch.long))
    m_rnd, m_tok, m_e = got[:, 0], got[:, 1], got[:, 2]
    P = int(got.shape[0])

    frow, F, a_recvs, ap_recvs = _forwarder_rows(m_src, m_rnd, m_tok, W, rounds)

    # stage B sends: forwarder -> expert rank, wire order (round, dest, local expert, source, token)
    d, l = m_e // L, m_e % L
    order = torch.argsort((m_rnd * W + d) * L + l, stable=True)  # Q order already (source, token)
    b_sends = _messages(d[order], m_rnd[order], l[order], frow[order], L, W)
    bp_sends = _messages(d[order], m_rnd[order], l[order], torch.arange(P)[order], L, W)
    send_counts = torch.bincount((d * rounds + m_rnd) * L + l, minlength=W * rounds * L).view(W, rounds, L)
    recv_counts = _exchange_counts(send_counts, group)
    b_recvs, per_expert = _expert_major_recvs(recv_counts, rounds)
    slots = sum(per_expert)
    # global estimates of rows per message segment, for the engine's segmented-vs-coalesced choice
    a_rows = tokens_all / (W * rounds)  # (source, forwarder, round): at most a rank's tokens
    b_rows = tokens_all * K / (W * R * L * rounds)  # (forwarder, expert rank, expert, round)

    return ShufflePlan(
        kind="two_level",
        token_stages=(
            _stage(me, rounds, T, F, a_sends, a_recvs, placement, a_rows),
            _stage(me, rounds, F, slots, b_sends, b_recvs, placement, b_rows),
        ),
        pair_stages=(
            _stage(me, rounds, T * K, P, ap_sends, ap_recvs, placement, a_rows * K),
            _stage(me, rounds, P, slots, bp_sends, b_recvs, placement, b_rows),
        ),
        tokens_per_expert=per_expert,
        num_tokens=T,
        top_k=K,
        forwarders=fwd,
    )


def _forwarder_rows(m_src: Tensor, m_rnd: Tensor, m_tok: Tensor, W: int, rounds: int) -> tuple[Tensor, int, list, list]:
    """A forwarder's rows F: one per unique (source, token) of the pairs it received (sorted
    (source, round, token, expert)), in (source, round, token) order. Returns each pair's row, F,
    and the stage-A receives (token rows) and stage-A' receives (pair probabilities) per
    (round, source) block."""
    P = int(m_src.shape[0])
    new_row = torch.ones(P, dtype=torch.bool)
    if P > 1:
        new_row[1:] = (m_src[1:] != m_src[:-1]) | (m_tok[1:] != m_tok[:-1])
    frow = torch.cumsum(new_row.long(), 0) - 1
    f_src, f_rnd = m_src[new_row], m_rnd[new_row]
    per_block = torch.bincount(f_src * rounds + f_rnd, minlength=W * rounds).view(W, rounds)
    base = (torch.cumsum(per_block.view(-1), 0) - per_block.view(-1)).view(W, rounds)
    pairs_block = torch.bincount(m_src * rounds + m_rnd, minlength=W * rounds).view(W, rounds)
    pbase = (torch.cumsum(pairs_block.view(-1), 0) - pairs_block.view(-1)).view(W, rounds)
    a_recvs, ap_recvs = [], []
    for r in range(rounds):
        for s in range(W):
            a_recvs += _range_messages([s], [r], [int(base[s, r])], [int(per_block[s, r])])
            ap_recvs += _range_messages([s], [r], [int(pbase[s, r])], [int(pairs_block[s, r])])
    return frow, int(new_row.sum()), a_recvs, ap_recvs


def _all_gather(mine: Tensor, group: dist.ProcessGroup) -> Tensor:
    gathered = [torch.empty_like(mine) for _ in range(dist.get_world_size(group))]
    dist.all_gather(gathered, mine, group=group)
    return torch.stack(gathered)


# --------------------------------------------------------------------------------------------
# choosing


@dataclass(frozen=True)
class DedupStats:
    """How much node-level dedup saves for a routing (global over ranks)."""

    internode_pairs: int  # (token, expert) pairs whose expert is on another node
    internode_crossings: int  # unique (token, other node): rows two-level sends across nodes

    @property
    def factor(self) -> float:
        return self.internode_pairs / self.internode_crossings if self.internode_crossings else 1.0


def dedup_stats(routing: Routing, placement: Placement, rank: int, group: dist.ProcessGroup | None) -> DedupStats:
    L, R, N = placement.local_experts, placement.ranks_per_node, placement.num_nodes
    T, K = routing.num_tokens, routing.top_k
    node = routing.expert_ids.reshape(-1) // L // R
    tok = torch.arange(T * K) // K
    remote = node != placement.node_of(rank)
    counts = torch.tensor([int(remote.sum()), int(torch.unique(tok[remote] * N + node[remote]).numel())])
    if group is not None:
        dist.all_reduce(counts, group=group)
    return DedupStats(int(counts[0]), int(counts[1]))


TWO_LEVEL_EXTRA_COLLECTIVES = 6  # load all-gather, 2 metadata exchanges, 3 more row hops than rank_dedup


def prefer_two_level(stats: Tensor | None, placement: Placement, cfg, row_bytes: int) -> bool:
    """Auto's cost model, from global routing stats (``rank_dedup.STAT_FIELDS``), same on every rank.

    Two level is considered only on several nodes with a node dedup factor >= ``dedup_threshold``;
    it is chosen when its weighted bytes -- unique (token, node) rows x ``internode_cost`` plus
    the intra-node expansion hop (one row per pair) plus its extra collectives -- undercut rank
    dedup's unique (token, rank) rows (inter-node ones x ``internode_cost``). With
    ``internode_cost = 1`` (one host) the expansion hop alone outweighs the saving.
    """
    if stats is None or placement.num_nodes < 2:
        return False
    pairs_offrank, pairs_inter, rank_rows, rank_rows_inter, node_rows_inter = (float(v) for v in stats.tolist())
    if node_rows_inter == 0 or pairs_inter / node_rows_inter < cfg.dedup_threshold:
        return False
    c, R = cfg.internode_cost, placement.ranks_per_node
    one = rank_rows_inter * c + (rank_rows - rank_rows_inter)
    hop_b = (pairs_offrank - pairs_inter) + pairs_inter * (R - 1) / R
    two = node_rows_inter * c + hop_b + TWO_LEVEL_EXTRA_COLLECTIVES * cfg.collective_cost_kib * 1024 / row_bytes
    return two < one


def build_plan(
    routing: Routing,
    placement: Placement,
    rank: int,
    group: dist.ProcessGroup | None,
    kind: Literal["auto", "one_level", "two_level"] = "auto",
    rounds: int = 1,
    grouping: Grouping = "balanced",
    dedup_threshold: float = 1.5,
) -> ShufflePlan:
    """auto: two-level when several of a token's experts share a remote node (factor >= threshold)."""
    if rounds < 1:
        raise ValueError(f"shuffle.chunks must be >= 1, got {rounds}")
    routing.check(placement)
    if kind == "auto":
        two = placement.num_nodes > 1 and dedup_stats(routing, placement, rank, group).factor >= dedup_threshold
        kind = "two_level" if two else "one_level"
    if kind == "one_level":
        return build_one_level(routing, placement, rank, group, rounds)
    if kind == "two_level":
        return build_two_level(routing, placement, rank, group, rounds, grouping)
    raise ValueError(f"build_plan: unknown plan kind {kind!r} (auto | one_level | two_level)")
