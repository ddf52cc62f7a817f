"""Simulated fleets behind the gymnasium vector API: per-robot quirks, a scripted expert,
and collection of finished episodes; importing it registers ``fleetloop/PickPlace-v0``,
``fleetloop/Pack-v0`` (and ``fleetloop/MetaWorldPickPlace-v0`` where metaworld is installed). See README.md."""

from components.sim.collect import FleetCollection, Policy, collect, run_episodes
from components.sim.expert import ScriptedExpert
from components.sim.exploration import MotionNoise, SampledGripper, ThresholdedGripper
from components.sim.factory import action_dim, make_env, observation_dim
from components.sim.pack import PackVecEnv
from components.sim.pack_expert import PackExpert
from components.sim.pickplace import STAGES, PickPlaceVecEnv
from components.sim.profile import RobotProfile, stable_robot_hash
from components.sim.registration import (
    METAWORLD_ID,
    PACK_ID,
    PICKPLACE_ID,
    OneRobotEnv,
    register_envs,
)

register_envs()

__all__ = [
    "METAWORLD_ID",
    "PACK_ID",
    "PICKPLACE_ID",
    "STAGES",
    "FleetCollection",
    "MotionNoise",
    "OneRobotEnv",
    "PackExpert",
    "PackVecEnv",
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
    "register_envs",
    "run_episodes",
    "stable_robot_hash",
]
