"""policy.head: binary_jaw (components/policy/normalizer.py): the jaw trained as open/close, executed in [-1, 1]."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from components.config import PolicyConfig
from components.policy.factory import make_policy
from components.sim import metaworld, pickplace
from components.training.bc import bc_step, make_optimizer


def test_every_built_in_sim_commands_its_jaw_with_its_last_action_number():
    """The head reads the jaw as the last action number: true of every sim the project ships."""
    assert pickplace.GRIPPER_ACTION == pickplace.ACT_DIM - 1
    assert metaworld.GRIPPER_ACTION == metaworld.ACT_DIM - 1


def test_the_jaw_is_scored_by_cross_entropy_on_the_demos_sign_and_the_rest_by_squared_error():
    torch.manual_seed(0)
    policy = make_policy(4, 3, PolicyConfig(hidden=16, layers=2, head="binary_jaw"))
    actions = torch.tensor([[0.3, -0.2, 1.0], [0.1, 0.4, -1.0], [-0.5, 0.0, 1.0], [0.2, 0.2, 1.0]])
    policy.fit(torch.randn(4, 4), actions)  # the jaw's mean is 0.5: its normalized 0 is not the raw threshold
    obs, targets = torch.randn(4, 4), policy.act_norm.normalize(actions)
    pred = policy.forward_normalized(obs)
    error = policy.action_error(obs, targets)
    assert error.shape == targets.shape
    torch.testing.assert_close(error[:, :2], (pred[:, :2] - targets[:, :2]).square())
    closes = torch.tensor([1.0, 0.0, 1.0, 1.0])
    torch.testing.assert_close(error[:, 2], F.binary_cross_entropy_with_logits(pred[:, 2], closes, reduction="none"))
    executed = policy(obs)
    torch.testing.assert_close(executed[:, 2], 2 * torch.sigmoid(pred[:, 2]) - 1)
    torch.testing.assert_close(executed[:, :2], policy.act_norm.denormalize(pred)[:, :2])


def test_a_chunk_policy_classifies_the_jaw_of_every_step_of_its_chunk():
    cfg = PolicyConfig(kind="chunk_transformer", d_model=16, heads=2, hidden=16, layers=1, chunk_size=3,
                       head="binary_jaw")
    policy = make_policy(5, 3, cfg)
    windows = torch.randn(2, 2, 5)
    targets = torch.tensor([[-1.0, 0.0, -1.0], [0.0, 0.0, 1.0], [0.0, 0.0, 1.0]]).expand(2, 3, 3)
    error = policy.action_error(windows, targets)  # normalizers untouched: the raw jaw is the target
    pred = policy.forward_normalized(windows)
    torch.testing.assert_close(error[..., 2], F.binary_cross_entropy_with_logits(
        pred[..., 2], torch.tensor([0.0, 1.0, 1.0]).expand(2, 3), reduction="none"))
    assert policy(windows)[..., 2].abs().max() < 1


def _jaw_decisions(head: str) -> tuple[torch.Tensor, torch.Tensor]:
    """A policy taught a jaw that closes right of 0, with most demo frames closed (so the jaw's mean
    is not 0); then its thresholded jaw on a grid across the switch, and the truth."""
    torch.manual_seed(1)
    policy = make_policy(1, 2, PolicyConfig(hidden=32, layers=2, head=head))
    x = torch.linspace(-0.5, 1, 512).unsqueeze(1)
    y = torch.cat([0.5 * x, torch.where(x >= 0, 1.0, -1.0)], dim=1)
    policy.fit(x, y)
    optimizer = make_optimizer(policy, 3e-3, 0.0)
    generator = torch.Generator().manual_seed(2)
    for _ in range(400):
        rows = torch.randint(len(x), (64,), generator=generator)
        bc_step(policy, optimizer, x[rows], policy.act_norm.normalize(y[rows]))
    grid = torch.linspace(-0.5, 1, 301).unsqueeze(1)
    with torch.no_grad():
        return policy(grid)[:, 1] > 0, grid[:, 0] >= 0


@pytest.mark.parametrize("head", ["mse", "binary_jaw"])
def test_both_heads_learn_where_the_jaw_closes(head: str):
    closed, truth = _jaw_decisions(head)
    assert (closed != truth).sum() <= 6, int((closed != truth).sum())


def test_the_head_is_one_of_the_configured_choices():
    with pytest.raises(ValueError, match="head"):
        PolicyConfig(head="binary")
