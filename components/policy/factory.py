"""`make_policy`: one place that turns a PolicyConfig into a torch module (LeRobot-style factory)."""

from __future__ import annotations

from collections.abc import Callable

from torch import nn

from components.config import PolicyConfig
from components.policy.mlp import MLPPolicy
from components.policy.normalizer import NormalizedPolicy


def _moe_transformer(obs_dim: int, act_dim: int, cfg: PolicyConfig) -> nn.Module:
    from components.policy.moe import MoETransformerPolicy  # imported lazily: optional room

    return MoETransformerPolicy(obs_dim, act_dim, cfg)


def _chunk_transformer(obs_dim: int, act_dim: int, cfg: PolicyConfig) -> nn.Module:
    from components.policy.chunk import ChunkTransformerPolicy

    return ChunkTransformerPolicy(obs_dim, act_dim, cfg)


CORES: dict[str, Callable[[int, int, PolicyConfig], nn.Module]] = {
    "mlp": MLPPolicy,
    "moe_transformer": _moe_transformer,
    "chunk_transformer": _chunk_transformer,
}


def make_policy(obs_dim: int, act_dim: int, cfg: PolicyConfig) -> NormalizedPolicy:
    """A normalized policy around the core named by ``cfg.kind``."""
    if cfg.kind not in CORES:
        raise ValueError(
            f"policy.kind={cfg.kind!r} is unknown; set policy.kind in params.yaml to one of {sorted(CORES)}"
        )
    return NormalizedPolicy(CORES[cfg.kind](obs_dim, act_dim, cfg), obs_dim, act_dim)
