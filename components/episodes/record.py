"""The in-memory form of one episode: what simulators produce and the Arrow table holds.

One row per frame on disk; here the frame columns are numpy arrays and the episode-level
fields (``success``, ``interrupted``, ...) are scalars.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field

import numpy as np


@dataclass(frozen=True, eq=False)
class Episode:
    episode_id: str
    robot_id: str
    task: str
    states: np.ndarray  # (T, n) float32: observation.state
    actions: np.ndarray  # (T, m) float32: action
    timestamps: np.ndarray  # (T,) float32: seconds from episode start
    success: bool  # the operator's binary label
    interrupted: bool = False
    policy_version: str = "expert"
    # Diagnostics from the simulator (not part of the stored contract): the last stage reached.
    stage_reached: int = -1
    extras: dict[str, np.ndarray] = field(default_factory=dict)

    @property
    def length(self) -> int:
        return int(self.states.shape[0])

    @property
    def frame_index(self) -> np.ndarray:
        return np.arange(self.length, dtype=np.int64)


def new_episode_id(rng: np.random.Generator) -> str:
    """A uuid4 drawn from a seeded generator, so simulated fleets reproduce bit for bit."""
    return str(uuid.UUID(bytes=rng.bytes(16), version=4))
