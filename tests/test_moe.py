"""MoE transformer policy: interface, expert-parallel layer == dense layer (capacity drops and router
losses included), 2-rank training == 1-rank."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from components.config import PolicyConfig, ShuffleConfig, TrainConfig
from components.policy.factory import make_policy
from components.policy.moe import MoEFeedForward, MoETransformerPolicy
from components.shuffle.local_group import run_local_group
from components.training.expert_parallel import launch_expert_parallel, load_npz, train_expert_parallel

POLICY = PolicyConfig(kind="moe_transformer", d_model=16, heads=2, hidden=32, layers=2, num_experts=4, top_k=2,
                      history=4, aux_loss_weight=0.01, z_loss_weight=0.01, capacity_factor=1.0)
EPISODE = 16  # frames per synthetic episode
LAYER_SHUFFLES = {
    "fused": ShuffleConfig(plan="one_level", chunks=2),
    "fused_auto": ShuffleConfig(),  # permute with the layer's counts: rank dedup would save too little here
    "fused_auto_dedup": ShuffleConfig(dedup_min_saved_kib=0),  # rank_dedup: one coalesced all-to-all each way
    "fused_two_level": ShuffleConfig(plan="two_level", ranks_per_node=2),
    "megatron": ShuffleConfig(dispatcher="megatron"),
    "dedup_permute": ShuffleConfig(dispatcher="dedup_permute", ranks_per_node=2),
}
TOKENS_PER_RANK = 48


def test_moe_policy_follows_the_policy_interface() -> None:
    torch.manual_seed(0)
    policy = MoETransformerPolicy(obs_dim=11, act_dim=3, cfg=POLICY)
    assert policy(torch.randn(5, 11)).shape == (5, 3)  # a single frame: a window at an episode's start
    action = policy(torch.randn(5, POLICY.history, 11))
    assert action.shape == (5, 3)
    assert policy.aux_loss.dim() == 0 and float(policy.aux_loss.detach()) > 0
    (action.square().mean() + policy.aux_loss).backward()
    layer = policy.moe_layers()[0]
    assert layer.router.weight.grad is not None and layer.router.weight.grad.abs().sum() > 0
    assert layer.experts.w1.grad is not None and layer.experts.w1.grad.abs().sum() > 0
    with pytest.raises(ValueError, match="expected obs"):
        policy(torch.randn(5, 10))
    with pytest.raises(ValueError, match="policy.history"):
        policy(torch.randn(5, POLICY.history + 1, 11))


def _layer_inputs(world: int) -> tuple[MoEFeedForward, torch.Tensor, torch.Tensor]:
    torch.manual_seed(3)
    layer = MoEFeedForward(d_model=16, hidden=24, num_experts=8, top_k=2, capacity_factor=1.0)
    x = torch.randn(TOKENS_PER_RANK * world, 16)
    grad = torch.randn(TOKENS_PER_RANK * world, 16)
    return layer, x, grad


def _layer_worker(rank: int, world: int) -> dict:
    out = {}
    for name, cfg in LAYER_SHUFFLES.items():
        layer, x, grad = _layer_inputs(world)
        layer.enable_expert_parallel(torch.distributed.group.WORLD, cfg)
        shard = slice(rank * TOKENS_PER_RANK, (rank + 1) * TOKENS_PER_RANK)
        xs = x[shard].clone().requires_grad_(True)
        y, losses = layer(xs)
        ((y * grad[shard]).sum() + losses.balance + losses.z).backward()
        out[name] = (y.detach(), (float(losses.balance), float(losses.z)), xs.grad, layer.router.weight.grad,
                     layer.experts.w1.grad, (layer.usage.assigned, layer.usage.kept),
                     layer.dispatcher.transport.meter.bytes_sent, getattr(layer.dispatcher, "last_plan", None))
    return out


def _served_expert_ranks(layer: MoEFeedForward, x: torch.Tensor, world: int) -> torch.Tensor:
    """(T, k) expert rank of each pair the dense layer serves on the global batch, -1 where dropped."""
    with torch.no_grad():
        top_i = torch.softmax(layer.router(x), dim=-1).topk(layer.top_k, dim=-1).indices
        keep, _ = layer._capacity(top_i, layer._global_counts(top_i), len(x))
    return (top_i // (layer.num_experts // world)).masked_fill(~keep, -1)


def test_expert_parallel_layer_matches_dense_layer() -> None:
    world = 4
    layer, x, grad = _layer_inputs(world)
    x = x.clone().requires_grad_(True)
    y, losses = layer(x)
    ((y * grad).sum() + losses.balance + losses.z).backward()
    dropped = int(layer.usage.assigned.sum() - layer.usage.kept.sum())
    assert 0 < dropped < int(layer.usage.assigned.sum())  # capacity 1.0 with random routing drops some pairs
    results = run_local_group(_layer_worker, world)
    for name in LAYER_SHUFFLES:
        for i, dense in enumerate((losses.balance, losses.z)):  # the ranks' shares add up to the global loss
            assert sum(r[name][1][i] for r in results) == pytest.approx(float(dense.detach()), rel=1e-6), name
        for r in results:  # every rank sees the global batch's routing and drops
            assert torch.equal(r[name][5][0], layer.usage.assigned) and torch.equal(r[name][5][1], layer.usage.kept)
        router_grad = sum(r[name][3] for r in results)  # dense grads: each rank holds its share
        torch.testing.assert_close(router_grad, layer.router.weight.grad, rtol=1e-5, atol=1e-6, msg=name)
        for rank, (ys, _, gx, _, gw1, *_) in enumerate(results[i][name] for i in range(world)):
            shard = slice(rank * TOKENS_PER_RANK, (rank + 1) * TOKENS_PER_RANK)
            if name in ("fused", "fused_auto", "megatron"):  # same rows in the same order as the dense loop
                assert torch.equal(ys, y.detach()[shard]), name
            torch.testing.assert_close(ys, y.detach()[shard], rtol=1e-5, atol=1e-6, msg=name)
            torch.testing.assert_close(gx, x.grad[shard], rtol=1e-5, atol=1e-6, msg=name)
            torch.testing.assert_close(gw1, layer.experts.w1.grad[rank * 2 : (rank + 1) * 2], rtol=1e-5, atol=1e-6,
                                       msg=name)
    # pairs over capacity do not travel: Megatron and the default fused paths send only served pairs;
    # auto picks permute here (tiny payload) and rank_dedup when told any saving pays
    served = _served_expert_ranks(layer, x, world)
    row_bytes = x.shape[1] * x.element_size()
    for rank, r in enumerate(results):
        mine = served[rank * TOKENS_PER_RANK : (rank + 1) * TOKENS_PER_RANK]
        pairs_out = int(((mine != rank) & (mine >= 0)).sum())
        rows_out = sum(int((mine == d).any(dim=1).sum()) for d in range(world) if d != rank)  # per-rank dedup
        theirs = [served[s * TOKENS_PER_RANK : (s + 1) * TOKENS_PER_RANK] for s in range(world) if s != rank]
        pairs_back = sum(int((t == rank).sum()) for t in theirs)
        rows_back = sum(int((t == rank).any(dim=1).sum()) for t in theirs)
        assert r["megatron"][6] == 2 * pairs_out * row_bytes, rank
        assert r["fused_auto"][7].kind == "permute" and r["fused_auto_dedup"][7].kind == "rank_dedup"
        assert r["fused_auto"][6] == (pairs_out + pairs_back) * row_bytes, rank
        assert r["fused_auto_dedup"][6] == (rows_out + rows_back) * row_bytes, rank


def _dataset(path: Path) -> Path:
    """512 frames in episodes of ``EPISODE`` frames (history windows stop at each episode's start)."""
    rng = np.random.default_rng(0)
    states = rng.normal(size=(512, 10)).astype(np.float32)
    actions = np.tanh(states[:, :4] @ rng.normal(size=(4, 4))).astype(np.float32)
    np.savez(path, states=states, actions=actions, weights=rng.uniform(0.5, 1.5, size=512),
             frame_in_episode=np.arange(512) % EPISODE)
    return path


def _init_state(path: Path) -> Path:
    """A starting model whose normalizers differ from what the training data would give."""
    torch.manual_seed(3)
    policy = make_policy(10, 4, POLICY)
    policy.obs_norm.fit(torch.randn(64, 10) * 3 + 1)
    policy.act_norm.fit(torch.randn(64, 4) * 2)
    torch.save(policy.state_dict(), path)
    return path


def test_expert_parallel_fine_tunes_the_given_state(tmp_path: Path) -> None:
    data = _dataset(tmp_path / "data.npz")
    init_path = _init_state(tmp_path / "init.pt")
    init = torch.load(init_path)
    train = TrainConfig(batch_size=64, epochs=1, lr=1e-3)
    tuned = torch.load(train_expert_parallel(data, tmp_path / "tuned.pt", POLICY, train, ShuffleConfig(), seed=7,
                                             max_steps=1, init_path=init_path).state_dict_path)
    fresh = torch.load(train_expert_parallel(data, tmp_path / "fresh.pt", POLICY, train, ShuffleConfig(), seed=7,
                                             max_steps=1).state_dict_path)
    norms = [k for k in init if "_norm." in k and not k.startswith("core")]
    assert norms and all(torch.equal(tuned[k], init[k]) for k in norms)  # kept, not refitted on the data
    assert any(not torch.equal(fresh[k], init[k]) for k in norms)
    # one AdamW step moves each weight by about lr: the result is the given model, nudged
    drift = max(float((tuned[k] - init[k]).abs().max()) for k in init if init[k].is_floating_point())
    assert 0 < drift <= 3 * train.lr


def test_two_rank_training_matches_one_rank(tmp_path: Path) -> None:
    data = _dataset(tmp_path / "data.npz")
    train = TrainConfig(batch_size=64, epochs=1, lr=3e-3)
    steps = 6
    init = _init_state(tmp_path / "init.pt")  # both fine-tune the same starting model (the champion's role)
    one = train_expert_parallel(data, tmp_path / "one.pt", POLICY, train, ShuffleConfig(), seed=7, max_steps=steps,
                                init_path=init)
    two = launch_expert_parallel(data, tmp_path / "two.pt", POLICY, train, ShuffleConfig(), seed=7, nproc=2,
                                 max_steps=steps, timeout_s=240, init_path=init)
    assert two.world_size == 2 and len(two.losses) == steps and len(two.step_times_s) == steps
    assert two.shuffle_bytes_sent > 0
    np.testing.assert_allclose(two.losses, one.losses, rtol=1e-5)  # MSE + balance + z-loss, global batch
    assert two.dropped_rate == one.dropped_rate and max(one.dropped_rate) > 0  # the same pairs over capacity
    np.testing.assert_allclose(two.expert_share, one.expert_share, rtol=1e-12)
    full_one, full_two = torch.load(one.state_dict_path), torch.load(two.state_dict_path)
    assert full_one.keys() == full_two.keys()
    d = POLICY.d_model
    for key, value in full_one.items():
        if key.endswith("attn.in_proj_bias"):
            # the key bias has an exactly-zero gradient (softmax is shift-invariant), so AdamW turns
            # fp noise into +-lr steps; compare the query and value biases only
            value, other = torch.cat([value[:d], value[2 * d :]]), torch.cat([full_two[key][:d], full_two[key][2 * d :]])
        else:
            other = full_two[key]
        torch.testing.assert_close(other, value, rtol=1e-4, atol=1e-5, msg=key)
    policy = make_policy(10, 4, POLICY)
    policy.load_state_dict(full_two)  # the expert shards were gathered into the single-process model
    assert policy(torch.zeros(2, 10)).shape == (2, 4)


def test_bad_training_data_names_the_file(tmp_path: Path) -> None:
    path = tmp_path / "bad.npz"
    np.savez(path, states=np.zeros((4, 3), np.float32))
    with pytest.raises(ValueError, match="bad.npz: missing arrays"):
        load_npz(path)
