"""The history MoE policy: one windowing rule for training and deployment, router losses in the
trained loss, capacity drops counted and passed through, and the fleet's interface (raw obs in,
raw action out) on the evaluation path."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from components.config import PolicyConfig
from components.fert.priority import FrameTable
from components.pipeline.collect import fleet_actor
from components.policy.factory import make_policy
from components.policy.history import FrameHistory, fit_window, frame_positions, gather_windows
from components.policy.moe import MoEFeedForward, step_usage
from components.sim.collect import run_episodes
from components.sim.factory import action_dim, make_expert, observation_dim
from components.training.bc import bc_step, make_optimizer
from tests.conftest import small_settings

POLICY = PolicyConfig(kind="moe_transformer", d_model=16, heads=2, hidden=16, layers=1, num_experts=4, top_k=2,
                      history=3, aux_loss_weight=0.01, z_loss_weight=0.01, capacity_factor=1.0)
SHORT_EPISODE = 25  # sim.max_steps: an untrained policy's episodes end by truncation, two per robot stay short


def _stream(lengths: list[int], obs_dim: int = 2) -> np.ndarray:
    return np.arange(sum(lengths) * obs_dim, dtype=np.float32).reshape(-1, obs_dim)


def test_frame_positions_restart_at_every_episode() -> None:
    assert frame_positions([3, 1, 2]).tolist() == [0, 1, 2, 0, 0, 1]


def test_rolling_buffer_gives_the_training_windows() -> None:
    """Two envs whose episodes end at different steps: the buffer the fleet loop keeps and the
    windows training gathers from the stored episodes are the same arrays."""
    history = 3
    episodes = {0: [4, 1, 5], 1: [2, 6, 2]}  # per env: episode lengths, same total steps
    streams = {env: _stream(lengths) + 1000 * env for env, lengths in episodes.items()}
    steps = len(streams[0])
    buffer = FrameHistory(history)
    online = []
    for t in range(steps):
        online.append(buffer.push(np.stack([streams[0][t], streams[1][t]])))
        ends = np.array([t + 1 in np.cumsum(episodes[env]) for env in (0, 1)])
        buffer.restart(ends)
    for env, lengths in episodes.items():
        positions = torch.as_tensor(frame_positions(lengths))
        offline = gather_windows(torch.as_tensor(streams[env]), positions, torch.arange(steps), history)
        np.testing.assert_array_equal(np.stack([w[env] for w in online]), offline.numpy())
    first = gather_windows(torch.as_tensor(streams[0]), torch.as_tensor(frame_positions(episodes[0])),
                           torch.tensor([4]), history)[0]  # the second episode's first frame, repeated
    assert torch.equal(first, torch.as_tensor(streams[0][4]).expand(history, -1))


def test_training_sets_carry_episode_positions(tmp_path) -> None:
    settings = small_settings(tmp_path)
    episodes = run_episodes(make_expert(settings.sim), settings.fleet.robot_ids(2), settings.sim, 3, seed=0,
                            policy_version="expert")
    data = FrameTable.from_episodes(episodes, "expert").uniform_set()
    kept = [ep for ep in episodes if ep.success]
    assert kept and data.frame_in_episode is not None
    np.testing.assert_array_equal(data.frame_in_episode, frame_positions([ep.length for ep in kept]))


def test_evaluation_feeds_the_policy_its_history(tmp_path) -> None:
    """Raw observations in, raw actions out through the fleet actor that evaluation uses; the core
    sees, at every step, the window training would build from the episodes the loop recorded."""
    base = small_settings(tmp_path)
    settings = base.model_copy(update={"sim": base.sim.model_copy(update={"max_steps": SHORT_EPISODE})})
    torch.manual_seed(0)
    policy = make_policy(observation_dim(settings.sim), action_dim(settings.sim), POLICY)
    seen: list[torch.Tensor] = []
    policy.core.register_forward_pre_hook(lambda _m, args: seen.append(args[0].clone()))
    robots = settings.fleet.heldout_ids()[:2]
    actor = fleet_actor(settings, policy, seed=0, explore=False)
    episodes = run_episodes(actor, robots, settings.sim, 2, seed=3, policy_version="moe")
    assert policy.training is False and len(episodes) == 4
    for env, robot in enumerate(robots):
        mine = [ep for ep in episodes if ep.robot_id == robot]
        states = torch.as_tensor(np.concatenate([ep.states for ep in mine]))
        positions = torch.as_tensor(frame_positions([ep.length for ep in mine]))
        expected = gather_windows(states, positions, torch.arange(len(states)), POLICY.history)
        expected = policy.obs_norm.normalize(expected)
        got = torch.stack([w[env] for w in seen[: len(states)]])
        torch.testing.assert_close(got, expected, rtol=0, atol=0)
        assert all(np.abs(ep.actions).max() <= 1 for ep in mine)
    seen.clear()  # the same actor in a second loop (fleet_scaling scores one actor twice): no window carries over
    again = run_episodes(actor, robots, settings.sim, 1, seed=3, policy_version="moe")
    assert [ep.states.tolist() for ep in again] == [ep.states.tolist() for ep in episodes[:2]]
    first = policy.obs_norm.normalize(torch.as_tensor(np.stack([ep.states[0] for ep in again])))
    torch.testing.assert_close(seen[0], first.unsqueeze(1).expand(-1, POLICY.history, -1), rtol=0, atol=0)


def test_router_losses_are_finite_and_part_of_the_trained_loss() -> None:
    torch.manual_seed(0)
    policy = make_policy(5, 2, POLICY)
    states, targets = torch.randn(32, POLICY.history, 5), torch.randn(32, 2)
    before = {k: v.clone() for k, v in policy.state_dict().items()}
    loss = bc_step(policy, make_optimizer(policy, 1e-3, 0.0), states, targets)
    balance, z = policy.core.router_losses.balance, policy.core.router_losses.z
    assert torch.isfinite(balance) and torch.isfinite(z) and float(balance) >= 1 - 1e-6 and float(z) > 0
    policy.load_state_dict(before)
    with torch.no_grad():
        mse = float((policy.forward_normalized(states) - targets).square().mean())
    assert loss == pytest.approx(mse + POLICY.aux_loss_weight * float(balance) + POLICY.z_loss_weight * float(z),
                                 rel=1e-6)
    router = policy.core.blocks[0].moe.router.weight
    router.grad = None
    policy.forward_normalized(states)
    policy.aux_loss.backward()  # the aux losses alone move the router
    assert router.grad is not None and router.grad.abs().sum() > 0


def test_capacity_drops_the_latest_pairs_and_they_pass_through() -> None:
    """All 10 tokens pick expert 0 (top-1): with capacity ceil(1.0 * 10 / 4) = 3 the first three
    are processed, the other seven add nothing (the block's residual carries them); in eval mode
    nothing is dropped, so a robot's action never depends on its batch."""
    torch.manual_seed(0)
    layer = MoEFeedForward(d_model=4, hidden=8, num_experts=4, top_k=1, capacity_factor=1.0)
    with torch.no_grad():
        layer.router.weight.zero_()
        layer.router.weight[0] = 1.0
    x = torch.rand(10, 4) + 0.1  # positive: expert 0 wins every token
    y, _ = layer(x)
    assert layer.usage.assigned.tolist() == [10, 0, 0, 0] and layer.usage.kept.tolist() == [3, 0, 0, 0]
    assert layer.usage.dropped_rate == pytest.approx(0.7)
    assert (y[:3].abs().sum(dim=1) > 0).all() and torch.equal(y[3:], torch.zeros(7, 4))
    assert step_usage(layer).share == (1.0, 0.0, 0.0, 0.0)
    layer.eval()
    y_eval, _ = layer(x)
    assert layer.usage.dropped_rate == 0 and (y_eval.abs().sum(dim=1) > 0).all()
    torch.testing.assert_close(y_eval[:3], y[:3])


def test_the_inference_service_takes_a_robots_window() -> None:
    """A robot sends its last frames ({"obs": [[...], ...]}); the batcher hands each served model
    the window it takes (fit_window), so a history policy answers as on the window and an MLP on
    the newest frame; a single frame still works (an episode's first step)."""
    from components.config import PolicyConfig as P
    from components.fleet.inference_service import DynamicBatcher, ModelSlots, ServedModel, _Request, parse_obs

    torch.manual_seed(0)
    moe, mlp = make_policy(5, 2, POLICY).eval(), make_policy(5, 2, P(kind="mlp", hidden=8, layers=1)).eval()
    slots = ModelSlots()
    slots.put(ServedModel("champion", 1, moe))
    slots.put(ServedModel("canary", 2, mlp))
    frames = np.arange(4 * 5, dtype=np.float32).reshape(4, 5) / 10
    window = parse_obs(json.dumps({"obs": frames.tolist()}).encode(), 5, 100.0)
    assert window.shape == (4, 5)
    single = parse_obs(json.dumps({"obs": frames[0].tolist()}).encode(), 5, 100.0)
    batcher = DynamicBatcher(slots, "champion", 0.0, 8)
    requests = [_Request("champion", window, None), _Request("champion", single, None), _Request("canary", window, None)]
    (a_window, _), (a_single, _), (a_mlp, _) = batcher._forward(requests)
    with torch.no_grad():
        np.testing.assert_allclose(a_window, moe(torch.as_tensor(frames[None, -POLICY.history:]))[0].numpy(), atol=1e-6)
        np.testing.assert_allclose(a_single, moe(torch.as_tensor(frames[None, 0]))[0].numpy(), atol=1e-6)
        np.testing.assert_allclose(a_mlp, mlp(torch.as_tensor(frames[None, -1]))[0].numpy(), atol=1e-6)
    short = fit_window(frames[:2], 3)  # fewer frames than the history: the oldest repeated in front
    np.testing.assert_array_equal(short, frames[[0, 0, 1]])
