"""policy.head: gmm (components/policy/mixture.py): its likelihood, what it executes, where it applies."""

from __future__ import annotations

import pytest
import torch
from torch.distributions import Categorical, Independent, MixtureSameFamily, Normal

from components.config import PolicyConfig
from components.policy.factory import make_policy
from components.training.bc import bc_step, make_optimizer

STEPS = 400


def test_the_trained_error_is_the_mixtures_negative_log_likelihood_and_forward_its_likeliest_mean():
    torch.manual_seed(0)
    policy = make_policy(4, 3, PolicyConfig(hidden=16, layers=2, head="gmm", mixtures=3))
    obs, targets = torch.randn(6, 4), torch.randn(6, 3)
    logits, means, stds = policy.core.mixture(obs)
    expected = -MixtureSameFamily(Categorical(logits=logits), Independent(Normal(means, stds), 1)).log_prob(targets)
    error = policy.action_error(obs, targets)  # normalizers untouched: identity
    assert error.shape == targets.shape
    torch.testing.assert_close(error.sum(dim=1), expected)
    assert (stds >= 0.01).all()
    torch.testing.assert_close(policy(obs), means[torch.arange(6), logits.argmax(dim=1)])


def _fit(head: str) -> torch.Tensor:
    """A policy taught a sharp switch (the first action number is -1 left of 0, +1 right of it), then
    its executed actions on a fine grid across the switch."""
    torch.manual_seed(1)
    policy = make_policy(1, 2, PolicyConfig(hidden=32, layers=2, head=head, mixtures=2))
    x = torch.linspace(-1, 1, 512).unsqueeze(1)
    y = torch.cat([torch.where(x >= 0, 1.0, -1.0), 0.5 * x], dim=1)
    policy.fit(x, y)
    optimizer = make_optimizer(policy, 3e-3, 0.0)
    generator = torch.Generator().manual_seed(2)
    for _ in range(STEPS):
        rows = torch.randint(len(x), (64,), generator=generator)
        bc_step(policy, optimizer, x[rows], policy.act_norm.normalize(y[rows]))
    with torch.no_grad():
        return policy(torch.linspace(-0.1, 0.1, 201).unsqueeze(1))[:, 0]


def test_a_mixture_switches_where_squared_error_blurs():
    """Near the switch the MSE fit takes in-between actions no demo took; the mixture head executes one side."""
    blurred = (_fit("mse").abs() < 0.5).sum()
    sharp = (_fit("gmm").abs() < 0.5).sum()
    assert blurred >= 10 and sharp <= blurred // 4, (int(blurred), int(sharp))


def test_a_mixture_head_needs_a_single_action_policy():
    with pytest.raises(ValueError, match="policy.head=gmm .* not 'chunk_transformer'"):
        PolicyConfig(kind="chunk_transformer", head="gmm")
    policy = make_policy(5, 3, PolicyConfig(kind="moe_transformer", d_model=16, heads=2, num_experts=2, hidden=16,
                                            layers=1, head="gmm"))
    assert policy.history == 2 and policy(torch.randn(4, 2, 5)).shape == (4, 3)
    assert policy.aux_loss.shape == ()
