"""The in-memory form of one episode: what simulators produce and the Arrow table holds.

One row per frame on disk; here the frame columns are numpy arrays and the episode-level
fields (``success``, ``interrupted``, ...) are scalars. Camera frames (``cameras``) are never
frame-table columns: the dataset stores them as LeRobot video features (video.py).
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field

import numpy as np

# The simulator's per-frame stage (the stage each frame's action led to), an extra column. The
# stage an episode reached is its running maximum, so ``stage_reached`` = this column's max.
STAGE_COLUMN = "stage"
# LeRobot's name for a camera feature: ``observation.images.<camera>`` (e.g. the sims' scene view)
CAMERA_KEY_PREFIX = "observation.images."


def camera_key(camera: str) -> str:
    """The feature key of a camera stream, as LeRobot names image and video features."""
    return CAMERA_KEY_PREFIX + camera


def reached_stage(stages: np.ndarray | None) -> int:
    """The furthest stage of a per-frame stage column; -1 (unknown) without one. A dataset that
    also holds episodes without the column reads it back as nulls (NaN) for those."""
    if stages is None:
        return -1
    known = np.asarray(stages, dtype=np.float64)
    known = known[np.isfinite(known)]
    return int(known.max()) if len(known) else -1


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
    # Diagnostics from the simulator (not part of the stored contract): the furthest stage reached
    # (-1: unknown). Stored as the per-frame ``STAGE_COLUMN`` extra; read back, it is that column's max.
    stage_reached: int = -1
    extras: dict[str, np.ndarray] = field(default_factory=dict)
    # camera streams: feature key (``camera_key``) -> (T, height, width, 3) uint8 frames, one per row
    cameras: dict[str, np.ndarray] = field(default_factory=dict)

    @property
    def length(self) -> int:
        return int(self.states.shape[0])

    @property
    def frame_index(self) -> np.ndarray:
        return np.arange(self.length, dtype=np.int64)


def new_episode_id(rng: np.random.Generator) -> str:
    """A uuid4 drawn from a seeded generator, so simulated fleets reproduce bit for bit."""
    return str(uuid.UUID(bytes=rng.bytes(16), version=4))
