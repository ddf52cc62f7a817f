"""The simulated fleet and how a policy is judged: the simulator (``sim``, its pack task and cameras),
the collecting fleet (``fleet``), held-out evaluation (``evaluation``) and the demo (``demo``)."""

from __future__ import annotations

import math
from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from components.config.base import Section


class PackConfig(Section):
    """The built-in pack task's knobs (``sim.name: pack``, components/sim/pack.py): how hard the
    container is to hit and to push. Tuned only against the difficulty criteria of
    components/sim/README.md ("pack")."""

    container_radius: float = Field(default=0.06, gt=0)  # an object released within this of the container's centre is in it
    push_radius: float = Field(default=0.07, gt=0)  # a closed jaw this close to the container's centre pushes it
    goal_radius: float = Field(default=0.05, gt=0)  # the container must end within this of its goal (pack_retune)
    push_distance_min: float = Field(default=0.15, gt=0)  # the container's goal lies this far ...
    push_distance_max: float = Field(default=0.30, gt=0, le=0.35)  # ... to this far from its start
    push_angle_spread: float = Field(default=0.79, ge=0, le=math.pi)  # goal direction: +y +- this (radians)
    push_scatter: float = Field(default=0.1, ge=0)  # sideways drift std per unit pushed (uneven friction)
    spill_scale: float = Field(default=1.0, ge=0)  # spill chance per push step = robot's slip_rate x this x speed^2

    @field_validator("push_distance_max")
    @classmethod
    def _distances_ordered(cls, v: float, info: Any) -> float:
        low = info.data.get("push_distance_min", 0.0)
        if v < low:
            raise ValueError(f"sim.pack.push_distance_max={v} is below push_distance_min={low}: raise it")
        return v


class CameraConfig(Section):
    """The sims' RGB cameras (components/sim/camera.py): image size, what the gripper view spans, and
    how widely the robots' camera quirks spread (each robot draws its own within these, from its
    profile: components/sim/profile.py). Which views render is ``sim.cameras``."""

    width: int = Field(default=64, ge=8, multiple_of=2)  # even: the stored video is yuv420p
    height: int = Field(default=64, ge=8, multiple_of=2)
    gripper_view_half_width: float = Field(default=0.2, gt=0)  # the gripper view spans +- this around the jaw
    mount_offset_spread: float = Field(default=0.03, ge=0)  # camera shift in +- spread (workspace units)
    mount_rotation_spread: float = Field(default=0.06, ge=0)  # camera roll in +- spread (radians)
    exposure_spread: float = Field(default=0.25, ge=0, lt=1)  # brightness gain in 1 +- spread
    white_balance_spread: float = Field(default=0.1, ge=0, lt=1)  # per-channel gain in 1 +- spread
    pixel_noise_max: float = Field(default=8.0, ge=0)  # pixel noise std in [0, max] (of 255)
    drop_rate_max: float = Field(default=0.05, ge=0, lt=1)  # chance a frame is dropped (the last one repeats)
    mujoco_gl: Literal["osmesa", "egl", "glfw"] = "osmesa"  # Meta-World's offscreen GL (MUJOCO_GL)
    metaworld_scene_camera: str = "corner"  # Meta-World cameras for the scene / gripper views
    metaworld_gripper_camera: str = "gripperPOV"


class SimConfig(Section):
    """The built-in tasks (pick-place, pack) and their per-robot heterogeneity."""

    name: Literal["pickplace", "metaworld", "pack"] = "pickplace"
    task: str = "pick-place"
    max_steps: int = Field(default=120, gt=0)
    control_hz: float = Field(default=10.0, gt=0)
    # per-robot heterogeneity, drawn once from the robot id (each robot draws within these)
    gain_spread: float = Field(default=0.15, ge=0, lt=1)  # action gain in 1 +- spread
    bias_spread: float = Field(default=0.03, ge=0)  # action bias in +- spread (action units)
    obs_noise_max: float = Field(default=0.01, ge=0)  # position noise std in [0, max]
    placement_spread: float = Field(default=0.10, ge=0)  # object/goal region offset in +- spread
    grasp_miss_max: float = Field(default=0.06, ge=0, le=1)  # chance a well-aimed grasp misses
    slip_rate_max: float = Field(default=0.01, ge=0, le=1)  # per-step slip chance at full speed
    # which draw of quirks a robot id gets: a profile comes from (population_seed, robot id);
    # 0 = the original population (profiles hashed from the id alone, bit for bit as before)
    population_seed: int = Field(default=0, ge=0)
    # exploration of the executed policy (fleet collection only)
    gripper_flip_prob: float = Field(default=0.03, ge=0, le=1)
    gripper_sample_gain: float = Field(default=4.0, gt=0)  # p(close) = sigmoid(gain * command)
    motion_noise_std: float = Field(default=0.35, ge=0)  # Gaussian noise on executed motion commands
    pack: PackConfig = PackConfig()  # sim.name: pack only
    # RGB camera views every robot renders ("scene", "gripper"); () = none, state only (the default)
    cameras: tuple[Literal["scene", "gripper"], ...] = ()
    camera: CameraConfig = CameraConfig()


class FleetConfig(Section):
    """Who is in the fleet and how long each robot collects per round."""

    num_robots: int = 8
    robot_prefix: str = "robot"
    # robot roles (docs: DESIGN.md "Evaluation protocol"); a role is the id's prefix, so roles never overlap
    heldout_prefix: str = "heldout"  # the product gate's robots (the study settings were tuned on them)
    tuning_prefix: str = "tuning"  # the only robots any setting may be chosen on
    validation_prefix: str = "validation"  # robots for selection during training: never collect, never reported
    test_prefix: str = "test"  # reported only, never used for a decision; drawn fresh per study seed
    num_heldout_robots: int = 16
    steps_per_robot: int = 1200
    extra_robots: tuple[str, ...] = ()
    sample_gripper: bool = True  # explore while collecting: jaw sampled + sim.motion_noise_std
    # test robots of study seed s come from sim population seed test_population_base + s
    test_population_base: int = Field(default=1000, ge=1)

    @model_validator(mode="after")
    def _roles_are_disjoint(self) -> FleetConfig:
        prefixes = self.role_prefixes()
        if len(set(prefixes.values())) != len(prefixes):
            raise ValueError(f"fleet role prefixes must differ (robots of two roles would coincide): {prefixes}")
        return self

    def role_prefixes(self) -> dict[str, str]:
        """Role -> id prefix: collection robots, the gate's held-out robots, tuning, validation, test."""
        return {"fleet": self.robot_prefix, "heldout": self.heldout_prefix, "tuning": self.tuning_prefix,
                "validation": self.validation_prefix, "test": self.test_prefix}

    def robot_ids(self, count: int | None = None) -> list[str]:
        n = self.num_robots if count is None else count
        return [f"{self.robot_prefix}-{i:04d}" for i in range(n)]

    def heldout_ids(self, count: int | None = None) -> list[str]:
        n = self.num_heldout_robots if count is None else count
        return [f"{self.heldout_prefix}-{i:04d}" for i in range(n)]

    def tuning_ids(self, count: int) -> list[str]:
        return [f"{self.tuning_prefix}-{i:04d}" for i in range(count)]

    def validation_ids(self, count: int) -> list[str]:
        return [f"{self.validation_prefix}-{i:04d}" for i in range(count)]

    def test_ids(self, count: int) -> list[str]:
        return [f"{self.test_prefix}-{i:04d}" for i in range(count)]

    def test_population_seed(self, study_seed: int) -> int:
        """The sim population the test robots of ``study_seed`` come from: fresh per seed."""
        return self.test_population_base + study_seed


class EvaluationConfig(Section):
    """Held-out evaluation: robots never used for collection, seeded trials."""

    trials_per_task: int = Field(default=480, ge=1)  # at least this many trials per task...
    trials_per_robot: int = Field(default=8, ge=1)  # ...spread over the held-out robots (max of both)
    confidence: float = Field(default=0.95, gt=0, lt=1)
    sample_gripper: bool = False  # False: thresholded jaw (the deployed policy); True: sampled
    # seed-level comparisons (components/evaluation/intervals.py)
    bootstrap_resamples: int = Field(default=2000, ge=100)  # hierarchical bootstrap: seeds, then robots
    power: float = Field(default=0.8, gt=0, lt=1)  # seeds_needed: chance the paired interval excludes 0

    def trials_for(self, num_robots: int) -> int:
        """Trials per robot so that every task gets at least ``trials_per_task``."""
        if num_robots < 1:
            raise ValueError("evaluation needs at least one held-out robot (fleet.num_heldout_robots)")
        return max(self.trials_per_robot, -(-self.trials_per_task // num_robots))


class DemoConfig(Section):
    """The bootstrap + closed-loop rounds that `make demo` runs."""

    expert_robots: int = 4
    expert_episodes_per_robot: int = 30
    rounds: int = 3
