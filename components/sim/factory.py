"""``make_env``: the one place that turns a ``SimConfig`` into a vectorized fleet env.

Every env it returns is a ``gymnasium.vector.VectorEnv`` with one sub-env per robot id,
same-step autoreset, ``info["stage"]``/``info["stage_reached"]``/``info["success"]`` per env,
float32 observations of ``observation_dim(cfg)`` and actions of ``action_dim(cfg)``
(motion deltas and a jaw command in [-1, 1], > 0 = close). ``sim.name``: ``pickplace`` (the
built-in 2D task), ``pack`` (the built-in multi-stage task, components/sim/pack.py) or
``metaworld`` (Meta-World pick-place-v3 on MuJoCo, components/sim/metaworld.py).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
from gymnasium.vector import VectorEnv

from components.config import SimConfig
from components.sim import pack, pickplace
from components.sim.expert import ScriptedExpert
from components.sim.exploration import MotionNoise, SampledGripper, ThresholdedGripper
from components.sim.pack_expert import PackExpert

Policy = Callable[[np.ndarray], np.ndarray]
METAWORLD_OBS_DIM, METAWORLD_ACT_DIM = 39, 4  # = components.sim.metaworld.OBS_DIM / ACT_DIM


def make_env(cfg: SimConfig, robot_ids: list[str], seed: int) -> VectorEnv:
    """A vectorized env with one sub-env per robot, seeded by ``(seed, robot id)``."""
    if cfg.name == "pickplace":
        return pickplace.PickPlaceVecEnv(cfg, list(robot_ids), seed)
    if cfg.name == "pack":
        return pack.PackVecEnv(cfg, list(robot_ids), seed)
    if cfg.name == "metaworld":
        from components.sim import (
            metaworld,  # imported on demand: MuJoCo loads only when asked for
        )

        return metaworld.MetaWorldVecEnv(cfg, list(robot_ids), seed)
    raise NotImplementedError(
        f"sim.name={cfg.name!r} has no adapter yet; set sim.name: pickplace in params.yaml"
    )


def observation_dim(cfg: SimConfig) -> int:
    if cfg.name == "pickplace":
        return pickplace.OBS_DIM
    if cfg.name == "pack":
        return pack.OBS_DIM
    if cfg.name == "metaworld":
        return METAWORLD_OBS_DIM
    raise NotImplementedError(f"sim.name={cfg.name!r} has no adapter yet")


def action_dim(cfg: SimConfig) -> int:
    if cfg.name in ("pickplace", "pack"):
        return pickplace.ACT_DIM
    if cfg.name == "metaworld":
        return METAWORLD_ACT_DIM
    raise NotImplementedError(f"sim.name={cfg.name!r} has no adapter yet")


def stages(cfg: SimConfig) -> tuple[str, ...]:
    """The simulator's stage names: ``Episode.stage_reached`` indexes them."""
    return pack.STAGES if cfg.name == "pack" else pickplace.STAGES  # Meta-World reports pick-place's


@dataclass(frozen=True)
class WorkspaceView:
    """Where the bodies are in an observation, for top-down (x, y) pictures of an episode (the failure
    explorer). ``paths``: bodies drawn as trajectories, the end effector first; ``targets``: bodies
    drawn as markers where they are at the first frame; columns are indices into ``observation.state``."""

    paths: tuple[tuple[str, int, int], ...]
    targets: tuple[tuple[str, int, int], ...]
    bounds: tuple[float, float] | None  # the workspace's x and y limits; None = fit the data


def workspace_view(cfg: SimConfig) -> WorkspaceView:
    """The simulator's ``WorkspaceView`` (observation layouts: pickplace.OBS_FIELDS, pack.OBS_FIELDS,
    Meta-World's hand / object / goal)."""
    if cfg.name == "pickplace":
        col = pickplace.OBS_FIELDS.index
        return WorkspaceView((("gripper", col("gripper_x"), col("gripper_y")), ("object", col("object_x"), col("object_y"))),
                             (("goal", col("goal_x"), col("goal_y")),), (pickplace.WORKSPACE_LOW, pickplace.WORKSPACE_HIGH))
    if cfg.name == "pack":
        col = pack.OBS_FIELDS.index
        return WorkspaceView((("gripper", col("gripper_x"), col("gripper_y")), ("object", col("object_x"), col("object_y")),
                              ("container", col("container_x"), col("container_y"))),
                             (("goal", col("goal_x"), col("goal_y")),), (pickplace.WORKSPACE_LOW, pickplace.WORKSPACE_HIGH))
    if cfg.name == "metaworld":
        return WorkspaceView((("hand", 0, 1), ("object", 4, 5)), (("goal", 36, 37),), None)
    raise NotImplementedError(f"sim.name={cfg.name!r} has no workspace view yet")


def make_expert(cfg: SimConfig) -> Policy:
    """The simulator's scripted expert: ``obs (B, n) -> actions (B, m)``."""
    if cfg.name == "pickplace":
        return ScriptedExpert()
    if cfg.name == "pack":
        return PackExpert(cfg.pack)
    if cfg.name == "metaworld":
        from components.sim import metaworld

        return metaworld.MetaWorldExpert(cfg)
    raise NotImplementedError(f"sim.name={cfg.name!r} has no expert yet")


def make_exploration(cfg: SimConfig, policy: Policy, seed: int, motion: bool = True) -> Policy:
    """How the fleet executes a policy while collecting (the exploration that can find fixes): jaw
    sampled, and motion noise of ``sim.motion_noise_std`` unless ``motion=False`` (jaw-only, as the
    sampled-jaw evaluation runs it)."""
    gripper = pickplace.GRIPPER_ACTION
    if cfg.name == "metaworld":
        from components.sim import metaworld

        gripper = metaworld.GRIPPER_ACTION
    explored: Policy = SampledGripper(policy, cfg, seed, gripper_index=gripper)
    if motion and cfg.motion_noise_std > 0:
        explored = MotionNoise(explored, cfg.motion_noise_std, seed, gripper_index=gripper)
    return explored


def make_thresholded(cfg: SimConfig, policy: Policy) -> Policy:
    """How the deployed policy is executed (evaluation): jaw thresholded, no exploration."""
    if cfg.name == "metaworld":
        from components.sim import metaworld

        return ThresholdedGripper(policy, gripper_index=metaworld.GRIPPER_ACTION)
    return ThresholdedGripper(policy)
