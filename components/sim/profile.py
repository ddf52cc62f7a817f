"""Per-robot persistent heterogeneity: every (population seed, robot id) always maps to the same quirks.

A robot's profile is drawn from a generator seeded by a stable hash of its id (blake2b, never
Python's salted ``hash``) and ``cfg.population_seed``, so ``RobotProfile.from_id("robot-0003", cfg)``
is identical in every process, on every machine, in every run. Population seed 0 seeds the
generator with the id alone, exactly as before populations existed (every committed figure and
test stays bit for bit); any other seed adds itself to the seed sequence and draws a new population
under the same ids. Unit draws are scaled by the config spreads afterwards, so widening a spread
stretches each robot's quirk without reshuffling which robot has which.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import numpy as np

from components.config import CameraConfig, SimConfig

# Salt for the profile stream, so a robot's profile never coincides with any episode stream.
PROFILE_STREAM = 0x5EED_0F11
# Salt for the camera quirks: their own stream, so adding cameras leaves every other quirk as it was.
CAMERA_PROFILE_STREAM = 0xCA3E_0F11
# Nominal object and goal region centres in the unit workspace; each robot shifts both.
OBJECT_CENTER = (0.30, 0.50)
GOAL_CENTER = (0.70, 0.50)


def stable_robot_hash(robot_id: str) -> int:
    """A 64-bit integer from the robot id that is the same in every process."""
    if not robot_id:
        raise ValueError("robot_id must be a non-empty string")
    return int.from_bytes(hashlib.blake2b(robot_id.encode("utf-8"), digest_size=8).digest(), "little")


def profile_seed(robot_id: str, population_seed: int = 0) -> list[int]:
    """The seed sequence of a robot's profile; population 0 is the id alone (the original robots)."""
    if population_seed < 0:
        raise ValueError(f"population_seed={population_seed} must be >= 0 (sim.population_seed)")
    words = [PROFILE_STREAM, stable_robot_hash(robot_id)]
    return words if population_seed == 0 else [*words, population_seed]


@dataclass(frozen=True)
class CameraQuirks:
    """One robot's cameras: where they are mounted and how they expose, per view (scene, gripper)."""

    mount_offset: np.ndarray  # (2 views, 2) shift of the view's centre, workspace units
    mount_rotation: np.ndarray  # (2 views,) roll of the view, radians
    exposure: float  # brightness gain
    white_balance: np.ndarray  # (3,) per-channel gain (r, g, b)
    pixel_noise: float  # std of Gaussian pixel noise (of 255)
    drop_rate: float  # chance per frame that the camera delivers nothing new (the last frame repeats)

    @classmethod
    def from_id(cls, robot_id: str, cfg: CameraConfig, population_seed: int = 0) -> CameraQuirks:
        words = profile_seed(robot_id, population_seed)
        rng = np.random.default_rng([CAMERA_PROFILE_STREAM, *words[1:]])
        unit = rng.uniform(-1.0, 1.0, size=10)
        frac = rng.uniform(0.0, 1.0, size=2)
        return cls(
            mount_offset=cfg.mount_offset_spread * unit[0:4].reshape(2, 2),
            mount_rotation=cfg.mount_rotation_spread * unit[4:6],
            exposure=float(1.0 + cfg.exposure_spread * unit[6]),
            white_balance=1.0 + cfg.white_balance_spread * np.array([unit[7], unit[8], unit[9]]),
            pixel_noise=float(cfg.pixel_noise_max * frac[0]),
            drop_rate=float(cfg.drop_rate_max * frac[1]),
        )


@dataclass(frozen=True)
class RobotProfile:
    """One robot's quirks: how it executes commands, how it senses, where its objects lie."""

    robot_id: str
    action_gain: np.ndarray  # (2,) multiplies commanded motion per axis
    action_bias: np.ndarray  # (2,) added to commanded motion (action units)
    obs_noise: float  # std of Gaussian noise on every sensed position
    object_center: np.ndarray  # (2,) centre of this robot's object placement region
    goal_center: np.ndarray  # (2,) centre of this robot's goal region
    grasp_miss: float  # chance that a well-aimed grasp still misses
    slip_rate: float  # per-step chance of dropping the object when carrying at full speed
    camera: CameraQuirks  # how its cameras see (used only when sim.cameras names views)

    @classmethod
    def from_id(cls, robot_id: str, cfg: SimConfig) -> RobotProfile:
        rng = np.random.default_rng(profile_seed(robot_id, cfg.population_seed))
        unit = rng.uniform(-1.0, 1.0, size=8)
        frac = rng.uniform(0.0, 1.0, size=3)
        return cls(
            robot_id=robot_id,
            action_gain=1.0 + cfg.gain_spread * unit[0:2],
            action_bias=cfg.bias_spread * unit[2:4],
            obs_noise=float(cfg.obs_noise_max * frac[0]),
            object_center=np.asarray(OBJECT_CENTER) + cfg.placement_spread * unit[4:6],
            goal_center=np.asarray(GOAL_CENTER) + cfg.placement_spread * unit[6:8],
            grasp_miss=float(cfg.grasp_miss_max * frac[1]),
            slip_rate=float(cfg.slip_rate_max * frac[2]),
            camera=CameraQuirks.from_id(robot_id, cfg.camera, cfg.population_seed),
        )


def check_robot_ids(robot_ids: list[str]) -> None:
    """A fleet env is one sub-env per robot: at least one id, no repeats."""
    if not robot_ids:
        raise ValueError("robot_ids is empty: pass at least one robot id")
    if len(set(robot_ids)) != len(robot_ids):
        raise ValueError(f"robot_ids has duplicates: {robot_ids}; each env is one robot")
