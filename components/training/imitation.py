"""What imitation trains on and what it returns: ``TrainingSet`` and ``TrainResult``.

BC, success-filtered BC and FERT differ only in *which* frames go in and with what sampling
weight; the one trainer (``trainer.py``, step in ``bc.py``) is the same for all of them.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from components.policy.normalizer import NormalizedPolicy
from components.policy.observation import ObservationLayout

ProgressFn = Callable[[int, int, float], None]  # (step, total_steps, loss)


@dataclass(frozen=True)
class TrainingSet:
    states: np.ndarray  # (N, n) float32
    actions: np.ndarray  # (N, m) float32
    weights: np.ndarray | None = None  # (N,) sampling weights, None = uniform
    # (N,) int64 each frame's index in its episode (episodes laid end to end): where a history
    # policy's windows start (policy/history.py); None = one continuous stream
    frame_in_episode: np.ndarray | None = None
    # camera key -> (N, H, W, 3) uint8: each frame's decoded camera image, for a vision policy
    # (policy/vision.py); None = a state-only training set
    images: dict[str, np.ndarray] | None = None

    def __post_init__(self) -> None:
        if self.states.ndim != 2 or self.actions.ndim != 2 or len(self.states) != len(self.actions):
            raise ValueError(
                f"training set: states {self.states.shape} and actions {self.actions.shape} must be "
                "(N, n) and (N, m) with the same N"
            )
        if len(self.states) == 0:
            raise ValueError("training set is empty: ingest episodes (or expert demos) before training")
        if self.weights is not None and (len(self.weights) != len(self.states) or (self.weights < 0).any()):
            raise ValueError("training set: weights must be (N,) and non-negative")
        positions = self.frame_in_episode
        if positions is not None and (positions.shape != (len(self.states),) or (positions < 0).any()):
            raise ValueError("training set: frame_in_episode must be (N,) non-negative frame indices")
        for key, frames in (self.images or {}).items():
            if frames.dtype != np.uint8 or frames.ndim != 4 or frames.shape[0] != len(self.states) or frames.shape[3] != 3:
                raise ValueError(f"training set: camera {key!r} frames {frames.shape} {frames.dtype} must be "
                                 f"(N={len(self.states)}, H, W, 3) uint8")

    @property
    def layout(self) -> ObservationLayout:
        """The observation a policy trained on this set sees: the state, then each camera (sorted keys)."""
        return ObservationLayout.of(int(self.states.shape[1]), self.images)


@dataclass
class TrainResult:
    policy: NormalizedPolicy
    losses: list[float] = field(default_factory=list)
    steps: int = 0
    seconds: float = 0.0
    device: str = "cpu"

    @property
    def final_loss(self) -> float:
        tail = self.losses[-20:]
        return float(np.mean(tail)) if tail else float("nan")
