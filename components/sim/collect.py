"""Run a policy on a simulated fleet and cut the stream into finished ``Episode``s.

    policy (obs batch -> action batch) + robot ids --> one vectorized env, auto-resetting
        --> Episodes: states = what the policy saw, actions = what it commanded,
            timestamps = frame / control_hz, success = the binary label, stage_reached

At the start and after every step the policy hears which envs begin a new episode
(``exploration.end_episodes``): the auto-reset gives those envs a new episode's first observation
next, which a policy with an observation history must not mix with older frames.

``collect`` gives every robot the same step budget (a fleet working a shift): episodes still
running when the budget ends are dropped, never returned half-done. ``run_episodes`` runs until
every robot has finished exactly N episodes (expert demos, evaluation trials).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from components.config import SimConfig
from components.episodes.record import STAGE_COLUMN, Episode, camera_key, new_episode_id
from components.sim.camera import STATE_KEY, camera_keys
from components.sim.exploration import end_episodes
from components.sim.factory import action_dim, make_env, observation_dim

Policy = Callable[[np.ndarray], np.ndarray]

# Salt for the episode-id stream, kept apart from the env's streams of the same seed.
EPISODE_ID_STREAM = 3


@dataclass(frozen=True)
class FleetCollection:
    """What one collection round produced."""

    episodes: list[Episode]  # finished episodes, in the order they finished
    env_steps: int  # env steps taken by all robots together (including dropped partial episodes)
    robot_ids: tuple[str, ...]

    @property
    def success_rate(self) -> float:
        return float(np.mean([e.success for e in self.episodes])) if self.episodes else 0.0


class _EpisodeRecorder:
    """Per-env buffers of the running episode; emits an ``Episode`` when an env finishes."""

    def __init__(self, cfg: SimConfig, robot_ids: list[str], seed: int, policy_version: str) -> None:
        b, t = len(robot_ids), cfg.max_steps
        self.cfg = cfg
        self.robot_ids = robot_ids
        self.policy_version = policy_version
        self.states = np.zeros((b, t, observation_dim(cfg)), dtype=np.float32)
        self.actions = np.zeros((b, t, action_dim(cfg)), dtype=np.float32)
        self.stages = np.zeros((b, t), dtype=np.int8)
        shape = (b, t, cfg.camera.height, cfg.camera.width, 3)
        self.frames = {view: np.zeros(shape, dtype=np.uint8) for view in camera_keys(cfg)}  # sim.cameras
        self.length = np.zeros(b, dtype=np.int64)
        self.id_rng = np.random.default_rng([seed, EPISODE_ID_STREAM])

    def record(self, obs: np.ndarray | dict[str, np.ndarray], actions: np.ndarray) -> None:
        rows = np.arange(len(self.robot_ids))
        for view, frames in self.frames.items():
            frames[rows, self.length] = obs[view]
        self.states[rows, self.length] = state_of(obs)
        self.actions[rows, self.length] = actions
        self.length += 1

    def record_stage(self, stage: np.ndarray) -> None:
        """The stage each env's last action led to (before any autoreset)."""
        self.stages[np.arange(len(self.robot_ids)), self.length - 1] = stage

    def finish(self, env_index: int, success: bool, stage_reached: int) -> Episode:
        n = int(self.length[env_index])
        self.length[env_index] = 0
        return Episode(
            episode_id=new_episode_id(self.id_rng),
            robot_id=self.robot_ids[env_index],
            task=self.cfg.task,
            states=self.states[env_index, :n].copy(),
            actions=self.actions[env_index, :n].copy(),
            timestamps=(np.arange(n, dtype=np.float64) / self.cfg.control_hz).astype(np.float32),
            success=bool(success),
            policy_version=self.policy_version,
            stage_reached=int(stage_reached),
            extras={STAGE_COLUMN: self.stages[env_index, :n].copy()},
            cameras={camera_key(view): frames[env_index, :n].copy() for view, frames in self.frames.items()},
        )


def state_of(obs: np.ndarray | dict[str, np.ndarray]) -> np.ndarray:
    """The state part of an observation: the array itself, or the Dict's state entry (sim.cameras)."""
    return obs[STATE_KEY] if isinstance(obs, dict) else obs


def _act(policy: Policy, obs: np.ndarray | dict[str, np.ndarray], num_envs: int, act_dim: int) -> np.ndarray:
    """The policy's actions; a policy sees the camera Dict only if it says so (``sees_cameras``),
    so every state policy runs unchanged on a sim with cameras (which records the frames)."""
    seen = obs if getattr(policy, "sees_cameras", False) else state_of(obs)
    actions = np.asarray(policy(seen), dtype=np.float32)
    if actions.shape != (num_envs, act_dim):
        raise ValueError(f"policy returned actions of shape {actions.shape}, expected {(num_envs, act_dim)}")
    return actions


def _check(robot_ids: list[str], count: int, name: str) -> None:
    if not robot_ids:
        raise ValueError("robot_ids is empty: pass at least one robot id")
    if count <= 0:
        raise ValueError(f"{name} must be positive, got {count}")


def collect(
    policy: Policy,
    robot_ids: list[str],
    cfg: SimConfig,
    steps_per_robot: int,
    seed: int,
    policy_version: str,
) -> FleetCollection:
    """Every robot runs ``steps_per_robot`` env steps; returns the episodes that finished."""
    _check(robot_ids, steps_per_robot, "steps_per_robot")
    env = make_env(cfg, robot_ids, seed)
    recorder = _EpisodeRecorder(cfg, robot_ids, seed, policy_version)
    obs, _ = env.reset()
    end_episodes(policy, np.ones(len(robot_ids), dtype=bool))  # a new loop: no window carries over
    episodes: list[Episode] = []
    for _ in range(steps_per_robot):
        actions = _act(policy, obs, env.num_envs, action_dim(cfg))
        recorder.record(obs, actions)
        obs, _, terminated, truncated, info = env.step(actions)
        recorder.record_stage(info["stage"])
        done = terminated | truncated
        end_episodes(policy, done)
        for i in np.flatnonzero(done):
            episodes.append(recorder.finish(i, info["success"][i], info["stage_reached"][i]))
    env.close()
    return FleetCollection(
        episodes=episodes, env_steps=steps_per_robot * len(robot_ids), robot_ids=tuple(robot_ids)
    )


def run_episodes(
    policy: Policy,
    robot_ids: list[str],
    cfg: SimConfig,
    episodes_per_robot: int,
    seed: int,
    policy_version: str,
) -> list[Episode]:
    """Exactly ``episodes_per_robot`` finished episodes per robot (the first ones each finished)."""
    _check(robot_ids, episodes_per_robot, "episodes_per_robot")
    env = make_env(cfg, robot_ids, seed)
    recorder = _EpisodeRecorder(cfg, robot_ids, seed, policy_version)
    obs, _ = env.reset()
    end_episodes(policy, np.ones(len(robot_ids), dtype=bool))  # a new loop: no window carries over
    finished = np.zeros(len(robot_ids), dtype=np.int64)
    episodes: list[Episode] = []
    while (finished < episodes_per_robot).any():
        actions = _act(policy, obs, env.num_envs, action_dim(cfg))
        recorder.record(obs, actions)
        obs, _, terminated, truncated, info = env.step(actions)
        recorder.record_stage(info["stage"])
        done = terminated | truncated
        end_episodes(policy, done)
        for i in np.flatnonzero(done):
            episode = recorder.finish(i, info["success"][i], info["stage_reached"][i])
            if finished[i] < episodes_per_robot:
                episodes.append(episode)
            finished[i] += 1
    env.close()
    return episodes
