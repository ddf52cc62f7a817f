"""``make_env``: the one place that turns a ``SimConfig`` into a vectorized fleet env.

Every env it returns is a ``gymnasium.vector.VectorEnv`` with one sub-env per robot id,
same-step autoreset, ``info["stage"]``/``info["stage_reached"]``/``info["success"]`` per env,
float32 observations of ``observation_dim(cfg)`` and actions of ``action_dim(cfg)``
(motion deltas and a jaw command in [-1, 1], > 0 = close).
"""

from __future__ import annotations

from gymnasium.vector import VectorEnv

from components.config import SimConfig
from components.sim import pickplace


def make_env(cfg: SimConfig, robot_ids: list[str], seed: int) -> VectorEnv:
    """A vectorized env with one sub-env per robot, seeded by ``(seed, robot id)``."""
    if cfg.name == "pickplace":
        return pickplace.PickPlaceVecEnv(cfg, list(robot_ids), seed)
    raise NotImplementedError(
        f"sim.name={cfg.name!r} has no adapter yet; set sim.name: pickplace in params.yaml"
    )


def observation_dim(cfg: SimConfig) -> int:
    if cfg.name == "pickplace":
        return pickplace.OBS_DIM
    raise NotImplementedError(f"sim.name={cfg.name!r} has no adapter yet")


def action_dim(cfg: SimConfig) -> int:
    if cfg.name == "pickplace":
        return pickplace.ACT_DIM
    raise NotImplementedError(f"sim.name={cfg.name!r} has no adapter yet")
