"""`make_policy`: one place that turns a PolicyConfig into a torch module (LeRobot-style factory)."""

from __future__ import annotations

from collections.abc import Callable

from torch import nn

from components.config import PolicyConfig
from components.policy.mlp import MLPPolicy
from components.policy.normalizer import NormalizedPolicy
from components.policy.observation import ObservationLayout


def _moe_transformer(obs_dim: int, act_dim: int, cfg: PolicyConfig) -> nn.Module:
    from components.policy.moe import MoETransformerPolicy  # imported lazily: optional room

    return MoETransformerPolicy(obs_dim, act_dim, cfg)


def _chunk_transformer(obs_dim: int, act_dim: int, cfg: PolicyConfig) -> nn.Module:
    from components.policy.chunk import ChunkTransformerPolicy

    return ChunkTransformerPolicy(obs_dim, act_dim, cfg)


def _vision(obs_dim: int, act_dim: int, cfg: PolicyConfig) -> nn.Module:
    raise ValueError("policy.kind=vision is built from an observation layout: make_policy(..., layout=...)")


CORES: dict[str, Callable[[int, int, PolicyConfig], nn.Module]] = {
    "mlp": MLPPolicy,
    "moe_transformer": _moe_transformer,
    "chunk_transformer": _chunk_transformer,
    "vision": _vision,
}


def make_policy(obs_dim: int, act_dim: int, cfg: PolicyConfig,
                layout: ObservationLayout | None = None) -> NormalizedPolicy:
    """A normalized policy around the core named by ``cfg.kind``. ``obs_dim`` is the state's; a
    vision policy also takes ``layout`` (the cameras it sees: ``policy/observation.py``), and its
    observations are the packed vectors of ``layout.dim`` numbers."""
    if cfg.kind not in CORES:
        raise ValueError(
            f"policy.kind={cfg.kind!r} is unknown; set policy.kind in params.yaml to one of {sorted(CORES)}"
        )
    binary_jaw = cfg.head == "binary_jaw"
    if cfg.kind == "vision":
        from components.policy.vision import VisionPolicy

        layout = layout or ObservationLayout(obs_dim)
        if layout.state_dim != obs_dim:
            raise ValueError(f"make_policy: layout's state has {layout.state_dim} numbers, the data {obs_dim}")
        return NormalizedPolicy(VisionPolicy(layout, act_dim, cfg), layout.dim, act_dim, binary_jaw)
    if cfg.head == "gmm":
        from components.policy.mixture import MixtureHead, mixture_outputs

        core = CORES[cfg.kind](obs_dim, mixture_outputs(act_dim, cfg.mixtures), cfg)
        return NormalizedPolicy(MixtureHead(core, act_dim, cfg.mixtures, cfg.mixture_min_std), obs_dim, act_dim)
    return NormalizedPolicy(CORES[cfg.kind](obs_dim, act_dim, cfg), obs_dim, act_dim, binary_jaw)
