"""Simulated fleets behind the gymnasium vector API: per-robot quirks, a scripted expert,
and collection of finished episodes. See README.md."""

from components.sim.collect import FleetCollection, Policy, collect, run_episodes
from components.sim.expert import ScriptedExpert
from components.sim.exploration import MotionNoise, SampledGripper, ThresholdedGripper
from components.sim.factory import action_dim, make_env, observation_dim
from components.sim.pickplace import STAGES, PickPlaceVecEnv
from components.sim.profile import RobotProfile, stable_robot_hash

__all__ = [
    "STAGES",
    "FleetCollection",
    "MotionNoise",
    "PickPlaceVecEnv",
    "Policy",
    "RobotProfile",
    "SampledGripper",
    "ScriptedExpert",
    "ThresholdedGripper",
    "action_dim",
    "collect",
    "make_env",
    "observation_dim",
    "run_episodes",
    "stable_robot_hash",
]
