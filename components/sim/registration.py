"""The simulators under gymnasium ids, registered on ``import components.sim``:

    gym.make_vec("fleetloop/PickPlace-v0", num_envs=8)            # a fleet: robot-0000 .. robot-0007
    gym.make_vec("fleetloop/PickPlace-v0", num_envs=2, robot_ids=["robot-0003", "heldout-0001"])
    gym.make("fleetloop/PickPlace-v0", robot_id="robot-0003")     # one robot, a plain gymnasium.Env
    gym.make_vec("fleetloop/Pack-v0", num_envs=8)                 # the multi-stage pack task (pack.py)
    gym.make_vec("fleetloop/MetaWorldPickPlace-v0", num_envs=4)   # only where metaworld is installed

Each id builds what ``make_env`` builds: ``make_vec`` (its default ``vector_entry_point`` mode)
returns the numpy-vectorized fleet env, one sub-env per robot id; ``make`` returns ``OneRobotEnv``,
that fleet env with one robot, without autoreset (a finished episode's last observation is returned;
call ``reset()``). Keyword ``seed`` seeds the robots' streams (reset ``seed=`` reseeds); any other
keyword overrides a ``SimConfig`` field of params.yaml's ``sim:`` section (e.g. ``max_steps=60``).
``make_vec(..., vectorization_mode="sync")`` also works but gives ``num_envs`` copies of one robot.
"""

from __future__ import annotations

import importlib.util
from typing import Any, ClassVar

import gymnasium as gym
import numpy as np

from components.config import SimConfig, load_settings
from components.sim.factory import make_env

NAMESPACE = "fleetloop"
PICKPLACE_ID = f"{NAMESPACE}/PickPlace-v0"
PACK_ID = f"{NAMESPACE}/Pack-v0"
METAWORLD_ID = f"{NAMESPACE}/MetaWorldPickPlace-v0"
METAWORLD_SIM = {"name": "metaworld", "task": "pick-place-v3"}
PACK_SIM = {"name": "pack", "task": "pack"}
Observation = np.ndarray | dict[str, np.ndarray]  # the state, or a Dict of it and camera frames (sim.cameras)
DEFAULT_ROBOT_PREFIX = "robot"  # as FleetConfig.robot_ids names a fleet's robots
# per-env info entries of the vector env that describe the autoreset, not the episode
_AUTORESET_INFO = ("final_obs", "_final_obs")


def _sim_config(base: dict[str, Any], overrides: dict[str, Any]) -> SimConfig:
    """params.yaml's ``sim:`` section, then the id's simulator, then the caller's keywords (validated)."""
    return SimConfig(**{**load_settings().sim.model_dump(), **base, **overrides})


def _robot_ids(num_envs: int, robot_ids: list[str] | None) -> list[str]:
    if robot_ids is None:
        return [f"{DEFAULT_ROBOT_PREFIX}-{i:04d}" for i in range(num_envs)]
    if len(robot_ids) != num_envs:
        raise ValueError(
            f"robot_ids has {len(robot_ids)} ids but num_envs={num_envs}: pass num_envs=len(robot_ids)"
        )
    return list(robot_ids)


class OneRobotEnv(gym.Env):
    """One robot of a fleet env as a ``gymnasium.Env``: the same dynamics, quirks and seeded
    streams, so episode k equals episode k of that robot in the fleet env. Without a reset seed
    the robot's streams start from the constructor's ``seed``."""

    metadata: ClassVar[dict[str, Any]] = {"render_modes": []}

    def __init__(self, cfg: SimConfig, robot_id: str, seed: int = 0, render_mode: str | None = None) -> None:
        if render_mode is not None:
            raise ValueError(f"render_mode={render_mode!r}: the fleetloop sims do not render; pass render_mode=None")
        self.render_mode = None
        self.robot_id = robot_id
        self.fleet = make_env(cfg, [robot_id], seed)
        self.observation_space = self.fleet.single_observation_space
        self.action_space = self.fleet.single_action_space
        self._next_obs: Observation | None = None  # the fleet env's autoreset observation, kept for reset()

    def reset(self, *, seed: int | None = None, options: dict[str, Any] | None = None) -> tuple[Observation, dict[str, Any]]:
        super().reset(seed=seed)
        if seed is None and self._next_obs is not None:  # the fleet env already started the next episode
            obs, self._next_obs = self._next_obs, None
            return obs, {}  # reset's info is empty either way; step's carries stage, success, ...
        self._next_obs = None
        obs, _ = self.fleet.reset(seed=seed, options=options)
        return _first(obs), {}

    def step(self, action: np.ndarray) -> tuple[Observation, float, bool, bool, dict[str, Any]]:
        obs, reward, terminated, truncated, info = self.fleet.step(np.asarray(action, np.float32)[None])
        done = bool(terminated[0] or truncated[0])
        if done:
            self._next_obs = _first(obs)
            obs = info["final_obs"]
        return _first(obs), float(reward[0]), bool(terminated[0]), bool(truncated[0]), _one(info)

    def close(self) -> None:
        self.fleet.close()


def _first(obs: Observation) -> Observation:
    """The first (only) env's observation: its row of the state array, or of every Dict entry (cameras)."""
    if isinstance(obs, dict):
        return {k: v[0].copy() for k, v in obs.items()}
    return obs[0].copy()


def _one(info: dict[str, Any]) -> dict[str, Any]:
    """The first (only) env's entries of a vector env's info."""
    return {k: np.asarray(v)[0].item() for k, v in info.items() if k not in _AUTORESET_INFO}


def make_pickplace(robot_id: str = f"{DEFAULT_ROBOT_PREFIX}-0000", seed: int = 0, render_mode: str | None = None, **sim: Any) -> OneRobotEnv:
    return OneRobotEnv(_sim_config({}, sim), robot_id, seed, render_mode)


def make_pickplace_vec(num_envs: int = 1, robot_ids: list[str] | None = None, seed: int = 0, **sim: Any) -> gym.vector.VectorEnv:
    sim.pop("render_mode", None)
    return make_env(_sim_config({}, sim), _robot_ids(num_envs, robot_ids), seed)


def make_pack(robot_id: str = f"{DEFAULT_ROBOT_PREFIX}-0000", seed: int = 0, render_mode: str | None = None, **sim: Any) -> OneRobotEnv:
    return OneRobotEnv(_sim_config(PACK_SIM, sim), robot_id, seed, render_mode)


def make_pack_vec(num_envs: int = 1, robot_ids: list[str] | None = None, seed: int = 0, **sim: Any) -> gym.vector.VectorEnv:
    sim.pop("render_mode", None)
    return make_env(_sim_config(PACK_SIM, sim), _robot_ids(num_envs, robot_ids), seed)


def make_metaworld(robot_id: str = f"{DEFAULT_ROBOT_PREFIX}-0000", seed: int = 0, render_mode: str | None = None, **sim: Any) -> OneRobotEnv:
    return OneRobotEnv(_sim_config(METAWORLD_SIM, sim), robot_id, seed, render_mode)


def make_metaworld_vec(num_envs: int = 1, robot_ids: list[str] | None = None, seed: int = 0, **sim: Any) -> gym.vector.VectorEnv:
    sim.pop("render_mode", None)
    return make_env(_sim_config(METAWORLD_SIM, sim), _robot_ids(num_envs, robot_ids), seed)


def metaworld_available() -> bool:
    """Whether metaworld (and MuJoCo) are installed; found without importing them, as loading
    MuJoCo on every ``import components.sim`` would cost every user of the built-in task."""
    return all(importlib.util.find_spec(name) is not None for name in ("metaworld", "mujoco"))


def register_envs() -> tuple[str, ...]:
    """Register the ids (idempotent); returns those registered."""
    specs = [(PICKPLACE_ID, make_pickplace, make_pickplace_vec), (PACK_ID, make_pack, make_pack_vec)]
    if metaworld_available():
        specs.append((METAWORLD_ID, make_metaworld, make_metaworld_vec))
    for env_id, single, vector in specs:
        if env_id not in gym.registry:
            gym.register(
                id=env_id,
                entry_point=f"{__name__}:{single.__name__}",
                vector_entry_point=f"{__name__}:{vector.__name__}",
            )
    return tuple(env_id for env_id, _, _ in specs)
