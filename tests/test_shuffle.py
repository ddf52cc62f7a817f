"""FUSCO shuffle on real gloo process groups: exactness vs a single-process dense reference.

One spawn of 4 ranks runs every case and dispatcher variant; the parent compares each rank's
outputs and gradients with ``dense_reference`` computed on the concatenated global batch.
"Dyadic" cases use small integers and multiples of 1/8, where every fp32 sum is exact whatever
its order, so any misplaced row shows up as an inequality: those compare with ``torch.equal``.
The random-float case checks the one-level fused path, the permute plan (auto's top-1 path) and
Megatron bit for bit in the forward (they reproduce the reference's row and addition order) and
gradients to fp32 tolerance. The capacity-drop cases carry a keep mask: dropped pairs add nothing,
and the permute, rank_dedup and Megatron paths send no row for them.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

from components.config import ShuffleConfig
from components.shuffle.dispatchers import make_dispatcher
from components.shuffle.local_group import run_local_group
from components.shuffle.plan import assign_forwarders, build_plan, forwarder_loads, prefer_two_level
from components.shuffle.rank_dedup import STAT_FIELDS
from components.shuffle.routing import Placement, Routing, dense_reference, synthetic_routing

WORLD = 4


@dataclass(frozen=True)
class Case:
    name: str
    tokens: int  # per rank
    hidden: int
    experts: int
    top_k: int
    routing: str  # uniform | node_confined | zipf | empty_rank | one_expert | rank_confined
    ranks_per_node: int = 2
    dyadic: bool = True
    seed: int = 0
    drop: float = 0.0  # share of pairs dropped (over capacity); each rank's last token loses all of its pairs


@dataclass(frozen=True)
class Variant:
    name: str
    cfg: ShuffleConfig
    bitwise_float: bool  # reproduces the reference's order of rows and additions


VARIANTS = (
    Variant("fused_one_level", ShuffleConfig(plan="one_level"), True),
    Variant("fused_one_level_chunked", ShuffleConfig(plan="one_level", chunks=3), True),
    Variant("fused_one_level_segmented", ShuffleConfig(plan="one_level", chunks=2, min_segment_kib=0), True),
    Variant("fused_two_level_static", ShuffleConfig(plan="two_level", grouping="static", chunks=2), False),
    Variant("fused_two_level_segmented", ShuffleConfig(plan="two_level", chunks=3, min_segment_kib=0), False),
    Variant("fused_two_level_balanced", ShuffleConfig(plan="two_level", grouping="balanced"), False),
    Variant("fused_rank_dedup", ShuffleConfig(plan="rank_dedup"), False),  # fused multiply-add reductions
    Variant("fused_permute", ShuffleConfig(plan="permute"), True),  # Megatron's sequence, reused staging
    Variant("fused_auto", ShuffleConfig(), False),  # the production default: permute at top-1, else rank_dedup
    Variant("fused_auto_costly_links", ShuffleConfig(plan="auto", internode_cost=16.0, collective_cost_kib=0), False),
    Variant("megatron", ShuffleConfig(dispatcher="megatron"), True),
    Variant("dedup_permute", ShuffleConfig(dispatcher="dedup_permute"), False),
)

CASES = (
    Case("uniform_top2", 64, 16, 8, 2, "uniform"),
    Case("node_confined_top4", 64, 16, 16, 4, "node_confined"),
    Case("zipf_top2", 96, 16, 8, 2, "zipf"),
    Case("rank_gets_nothing", 64, 16, 8, 2, "empty_rank"),
    Case("all_to_one_expert_top1", 64, 16, 8, 1, "one_expert"),
    Case("top1_uniform", 64, 16, 8, 1, "uniform"),
    Case("topk_equals_local_experts", 64, 16, 16, 4, "rank_confined"),
    Case("single_node_top2", 64, 16, 8, 2, "uniform", ranks_per_node=4),
    Case("float_uniform_top2", 64, 32, 8, 2, "uniform", dyadic=False),
    Case("float_uniform_top4", 64, 32, 16, 4, "uniform", dyadic=False),  # a sum of 4 floats: order shows
    Case("capacity_drops_top1", 64, 16, 8, 1, "uniform", drop=0.4),
    Case("capacity_drops_top2", 64, 16, 8, 2, "uniform", drop=0.4),
)


def _inputs(case: Case) -> tuple[torch.Tensor, Routing, torch.Tensor, torch.Tensor]:
    """Global batch (every rank builds the same one and takes its shard)."""
    g = torch.Generator().manual_seed(case.seed)
    T, H, E, K = case.tokens * WORLD, case.hidden, case.experts, case.top_k
    placement = Placement(E, WORLD, case.ranks_per_node)
    L = placement.local_experts
    if case.routing == "empty_rank":  # nobody routes to the last rank's experts
        ids = torch.rand(T, E - L, generator=g).topk(K, dim=1).indices
    elif case.routing == "one_expert":
        ids = torch.full((T, K), 5, dtype=torch.long)
    elif case.routing == "rank_confined":  # all K = L experts of one rank
        ids = torch.randint(WORLD, (T, 1), generator=g) * L + torch.arange(L)
    else:
        ids = synthetic_routing(case.routing, T, K, placement, g)
    if case.dyadic:
        x = torch.randint(-4, 5, (T, H), generator=g).float()
        probs = torch.randint(1, 9, (T, K), generator=g).float() / 8
        weights = torch.randint(-2, 3, (E, H, H), generator=g).float() / 2
        grad = torch.randint(-2, 3, (T, H), generator=g).float()
    else:
        x = torch.randn(T, H, generator=g)
        probs = torch.softmax(torch.randn(T, K, generator=g), dim=1)
        weights = torch.randn(E, H, H, generator=g) / H**0.5
        grad = torch.randn(T, H, generator=g)
    keep = None
    if case.drop:
        keep = torch.rand(T, K, generator=g) >= case.drop
        keep.view(WORLD, case.tokens, K)[:, -1] = False  # a token with no served pair, last in its bag list
    return x, Routing(ids, probs, keep), weights, grad


def _run_cases(rank: int, world: int) -> dict:
    out, kinds, sent = {}, {}, {}
    for case in CASES:
        x, routing, weights, grad = _inputs(case)
        placement = Placement(case.experts, world, case.ranks_per_node)
        T, L = case.tokens, placement.local_experts
        shard = slice(rank * T, (rank + 1) * T)
        for v in VARIANTS:
            xs = x[shard].clone().requires_grad_(True)
            ps = routing.probs[shard].clone().requires_grad_(True)
            w = weights[rank * L : (rank + 1) * L].clone().requires_grad_(True)
            disp = make_dispatcher(placement, torch.distributed.group.WORLD, v.cfg)
            keep = None if routing.keep is None else routing.keep[shard]
            d = disp.dispatch(xs, Routing(routing.expert_ids[shard], ps, keep))
            ys = [rows @ w[l] for l, rows in enumerate(d.x.split(list(d.tokens_per_expert)))]
            y = torch.cat(ys) if ys else d.x
            o = disp.combine(y, d.handle)
            (o * grad[shard]).sum().backward()
            crossings = None
            plan = getattr(disp, "last_plan", None)
            kinds[(case.name, v.name)] = plan.kind if plan is not None else None
            sent[(case.name, v.name)] = disp.transport.meter.bytes_sent
            if plan is not None and plan.kind == "two_level":
                me = placement.node_of(rank)
                crossings = [
                    (int(t), placement.node_of(m.peer))
                    for m in plan.token_stages[0].sends
                    if placement.node_of(m.peer) != me
                    for t in m.rows
                ]
            out[(case.name, v.name)] = (o.detach(), xs.grad, ps.grad, w.grad, crossings)
    out["plan_kinds"], out["bytes_sent"] = kinds, sent
    return out


@pytest.fixture(scope="module")
def results() -> list[dict]:
    return run_local_group(_run_cases, WORLD)


def _reference(case: Case) -> tuple[torch.Tensor, ...]:
    x, routing, weights, grad = _inputs(case)
    x, probs, weights = (t.clone().requires_grad_(True) for t in (x, routing.probs, weights))
    out = dense_reference(x, Routing(routing.expert_ids, probs, routing.keep), lambda e, rows: rows @ weights[e],
                          case.experts)
    (out * grad).sum().backward()
    return out.detach(), x.grad, probs.grad, weights.grad


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_dispatch_combine_matches_dense_reference(results: list[dict], case: Case) -> None:
    ref_out, ref_gx, ref_gp, ref_gw = _reference(case)
    T, L = case.tokens, case.experts // WORLD
    for v in VARIANTS:
        for rank, res in enumerate(results):
            out, gx, gp, gw, _ = res[(case.name, v.name)]
            shard, experts = slice(rank * T, (rank + 1) * T), slice(rank * L, (rank + 1) * L)
            where = f"{case.name}/{v.name}/rank{rank}"
            if case.dyadic:
                assert torch.equal(out, ref_out[shard]), where
                assert torch.equal(gx, ref_gx[shard]), where
                assert torch.equal(gp, ref_gp[shard]), where
                assert torch.equal(gw, ref_gw[experts]), where
            else:
                if v.bitwise_float:
                    assert torch.equal(out, ref_out[shard]), where
                torch.testing.assert_close(out, ref_out[shard], rtol=1e-5, atol=1e-6, msg=where)
                torch.testing.assert_close(gx, ref_gx[shard], rtol=1e-5, atol=1e-5, msg=where)
                torch.testing.assert_close(gp, ref_gp[shard], rtol=1e-5, atol=1e-5, msg=where)
                torch.testing.assert_close(gw, ref_gw[experts], rtol=1e-5, atol=1e-5, msg=where)


def test_two_level_sends_each_token_node_pair_at_most_once(results: list[dict]) -> None:
    for case in (c for c in CASES if c.ranks_per_node < WORLD):
        _, routing, _, _ = _inputs(case)
        placement = Placement(case.experts, WORLD, case.ranks_per_node)
        T = case.tokens
        for v in ("fused_two_level_static", "fused_two_level_balanced", "fused_two_level_segmented"):
            for rank, res in enumerate(results):
                crossings = res[(case.name, v)][4]
                ids = routing.expert_ids[rank * T : (rank + 1) * T]
                nodes = ids // placement.local_experts // placement.ranks_per_node
                needed = {(t, int(n)) for t in range(T) for n in nodes[t].tolist() if n != placement.node_of(rank)}
                assert len(crossings) == len(set(crossings)), f"{case.name}/{v}/rank{rank}: duplicate crossing"
                assert set(crossings) == needed, f"{case.name}/{v}/rank{rank}: wrong crossings"


def test_two_level_moves_fewer_internode_rows_when_experts_share_a_node() -> None:
    placement = Placement(16, 4, 2)
    g = torch.Generator().manual_seed(1)
    ids = synthetic_routing("node_confined", 128, 4, placement, g)
    routing = Routing(ids, torch.full(ids.shape, 0.25))
    one = build_plan(routing, placement, 0, None, "one_level")
    two = build_plan(routing, placement, 0, None, "two_level", grouping="static")
    remote_pairs = int((ids // 8 != 0).sum())
    remote_tokens = int((ids[:, 0] // 8 != 0).sum())
    assert one.token_stages[0].rows_sent(internode_only=True) == remote_pairs
    assert two.token_stages[0].rows_sent(internode_only=True) == remote_tokens
    assert remote_pairs == 4 * remote_tokens


def test_balanced_grouping_evens_forwarder_load() -> None:
    placement = Placement(8, 4, 2)  # nodes {0,1}, {2,3}
    load = torch.tensor([[0, 100], [0, 10], [100, 100], [10, 10]])
    static = assign_forwarders(load, placement, "static")
    balanced = assign_forwarders(load, placement, "balanced")
    assert static[0, 1] == 2 and static[1, 1] == 3
    assert int(forwarder_loads(load, balanced, placement).max()) < int(forwarder_loads(load, static, placement).max())
    for fwd in (static, balanced):  # every source forwards to its own node through itself
        assert all(int(fwd[s, placement.node_of(s)]) == s for s in range(4))


def _served_ranks(routing: Routing, placement: Placement) -> torch.Tensor:
    """(global token, k) -> expert rank of each served pair, -1 where the pair was dropped."""
    ranks_of = routing.expert_ids // placement.local_experts
    return ranks_of if routing.keep is None else ranks_of.masked_fill(~routing.keep, -1)


def test_rank_dedup_sends_each_token_once_per_rank(results: list[dict]) -> None:
    """Per-rank dedup: a token crosses to a rank once, whatever how many of its experts live there;
    dropped pairs (capacity) send nothing, in rank_dedup as in Megatron."""
    for case in CASES:
        _, routing, _, _ = _inputs(case)
        placement = Placement(case.experts, WORLD, case.ranks_per_node)
        T = case.tokens
        ranks_of = _served_ranks(routing, placement)  # (global token, k) -> expert rank, -1: dropped
        # unique[s][d]: tokens of source s with at least one expert on rank d
        unique = [[sum(1 for t in range(s * T, (s + 1) * T) if d in ranks_of[t].tolist()) for d in range(WORLD)]
                  for s in range(WORLD)]
        row_bytes = case.hidden * 4
        for rank, res in enumerate(results):
            ranks = ranks_of[rank * T : (rank + 1) * T]
            rows = sum(unique[rank][d] for d in range(WORLD) if d != rank)  # unique (token, other rank)
            back = sum(unique[s][rank] for s in range(WORLD) if s != rank)  # combine returns what arrived
            pairs = int(((ranks != rank) & (ranks >= 0)).sum())
            assert res["bytes_sent"][(case.name, "fused_rank_dedup")] == (rows + back) * row_bytes, case.name
            assert res["bytes_sent"][(case.name, "megatron")] == 2 * pairs * row_bytes, case.name
        if case.name == "topk_equals_local_experts":  # all K experts on one rank: K-fold fewer rows
            assert rows * case.top_k == pairs


def test_auto_plan_choice(results: list[dict]) -> None:
    """Auto runs the plain permute path at top-1 (nothing to dedup) and never at top-k > 1; on one
    host it is rank_dedup otherwise; with costly inter-node links it picks two-level where node
    dedup pays (node-confined top-4) and never for top-1; ranks agree."""
    assert any(c.top_k == 1 for c in CASES) and any(c.top_k > 1 for c in CASES)
    for case in CASES:
        default = {res["plan_kinds"][(case.name, "fused_auto")] for res in results}
        assert default == ({"permute"} if case.top_k == 1 else {"rank_dedup"}), case.name
        kinds = {res["plan_kinds"][(case.name, "fused_auto_costly_links")] for res in results}
        assert len(kinds) == 1, f"{case.name}: ranks disagree on the plan {kinds}"
        if case.top_k == 1:
            assert kinds == {"permute"}, case.name
        elif case.ranks_per_node == WORLD:
            assert kinds == {"rank_dedup"}, case.name
        if case.name == "node_confined_top4":
            assert kinds == {"two_level"}, case.name


def test_permute_plan_moves_megatrons_rows(results: list[dict]) -> None:
    """The permute plan sends Megatron's rows: one per off-rank pair out, one per pair received back."""
    for case in CASES:
        _, routing, _, _ = _inputs(case)
        placement = Placement(case.experts, WORLD, case.ranks_per_node)
        T = case.tokens
        ranks_of = _served_ranks(routing, placement)
        for rank, res in enumerate(results):
            mine = ranks_of[rank * T : (rank + 1) * T]
            out = int(((mine != rank) & (mine >= 0)).sum())
            back = sum(int((ranks_of[s * T : (s + 1) * T] == rank).sum()) for s in range(WORLD) if s != rank)
            assert res["bytes_sent"][(case.name, "fused_permute")] == (out + back) * case.hidden * 4, case.name


def test_cost_model_needs_costly_links_and_dedup() -> None:
    placement = Placement(16, 4, 2)
    # node-confined top-8 on 2 nodes x 2 ranks, 1024 tokens/rank: per rank 512 tokens cross to the
    # other node, 8 pairs each, spread over its 2 ranks
    stats = torch.tensor([4 * 512 * 8 + 4 * 512 * 4, 4 * 512 * 8, 4 * (512 * 2 + 512), 4 * 512 * 2, 4 * 512])
    assert len(stats) == len(STAT_FIELDS)
    one_host = ShuffleConfig()
    costly = ShuffleConfig(internode_cost=8.0)
    assert not prefer_two_level(stats, placement, one_host, row_bytes=4096)
    assert prefer_two_level(stats, placement, costly, row_bytes=4096)
    assert not prefer_two_level(stats, placement, costly, row_bytes=16)  # tiny rows: collectives dominate
    top1 = torch.tensor([4 * 768, 4 * 512, 4 * 768, 4 * 512, 4 * 512])  # node dedup factor 1
    assert not prefer_two_level(top1, placement, costly, row_bytes=4096)
    assert not prefer_two_level(None, placement, costly, row_bytes=4096)


def test_expected_rank_dedup_saving_follows_the_uniform_dedup_factor() -> None:
    """Auto's estimate (from global counts, so every rank agrees): nothing at top-1 or on one rank; at
    top-8 over 8 experts on 2 ranks a token's 4 off-rank pairs share one row: 3/4 of their bytes saved."""
    from components.shuffle.rank_dedup import expected_saved_bytes

    placement = Placement(8, 2, 2)
    counts = torch.tensor([[10, 10, 10, 10, 10, 10, 10, 10], [10, 10, 10, 10, 10, 10, 10, 10]])  # 40 off-rank pairs each
    assert expected_saved_bytes(counts, placement, 1, 64) == 0.0
    assert expected_saved_bytes(counts[:1], Placement(8, 1, 1), 8, 64) == 0.0
    assert expected_saved_bytes(counts, placement, 8, 64) == pytest.approx(2 * 64 * 80 * 0.75 / 2)
