"""Observation history: the one rule for the frames a history policy sees, in training and on a robot.

    window(t) = [s_{t-H+1}, ..., s_{t-1}, s_t]   frames of t's own episode; before the episode's
                                                 first frame, the first frame is repeated

Training builds windows from stored episodes (``gather_windows``: concatenated episodes plus each
frame's position in its episode); a robot, an evaluation or a fleet rollout builds the same windows
online (``FrameHistory``: a per-env rolling buffer, restarted when an env starts a new episode).
Both apply the rule above, so a policy sees at deployment exactly what it was trained on
(``tests/test_moe_policy.py`` steps a buffer through episodes and compares).

A chunk policy (``policy.kind: chunk_transformer``) is trained on the next actions of the same
episode: ``chunk(t) = [a_t, ..., a_{t+k-1}]``, the targets past the episode's last frame masked
(``gather_chunks``), never taken from the next episode.

torch is imported only by the training helpers that use it: a robot agent (``FrameHistory``) is
numpy-only and starts without loading torch (seconds per process when a whole fleet starts).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from torch import Tensor


def frame_positions(lengths: list[int] | np.ndarray) -> np.ndarray:
    """(sum(lengths),) int64: each frame's index inside its episode, for episodes laid end to end."""
    lengths = np.asarray(lengths, dtype=np.int64)
    if lengths.size == 0:
        return np.zeros(0, dtype=np.int64)
    starts = np.repeat(np.cumsum(lengths) - lengths, lengths)
    return np.arange(int(lengths.sum()), dtype=np.int64) - starts


def history_rows(rows: Tensor, frame_in_episode: Tensor | None, history: int) -> Tensor:
    """Rows of each window, oldest first: ``rows`` (...) -> (..., history).

    ``frame_in_episode`` (N,) says how far back each row's episode starts; None means the rows are
    one continuous stream (synthetic data), clamped only at row 0.
    """
    import torch

    back = torch.arange(history - 1, -1, -1, dtype=torch.int64)  # H-1, ..., 0
    limit = rows if frame_in_episode is None else frame_in_episode[rows]
    return rows.unsqueeze(-1) - torch.minimum(back, limit.unsqueeze(-1))


def gather_windows(states: Tensor, frame_in_episode: Tensor | None, rows: Tensor, history: int) -> Tensor:
    """Model inputs for frame rows ``rows``: ``states[rows]`` (history 1) or windows (..., history, n)."""
    if history <= 1:
        return states[rows]
    return states[history_rows(rows, frame_in_episode, history)]


def chunk_rows(rows: Tensor, episode_end: Tensor | None, chunk: int, frames: int) -> tuple[Tensor, Tensor]:
    """Rows of each chunk's targets, ``rows`` (...) -> (..., chunk), and which are real (..., chunk) bool.

    Target j of row t is row t + j while t + j lies in t's episode; past the episode's end it is
    masked and points at the episode's last row (a finite placeholder, never the next episode).
    ``episode_end`` (N,) each row's episode's last row (``episode_last_rows``); None = one stream.
    """
    import torch

    ahead = rows.unsqueeze(-1) + torch.arange(chunk, dtype=torch.int64)
    last = torch.full_like(rows, frames - 1) if episode_end is None else episode_end[rows]
    real = ahead <= last.unsqueeze(-1)
    return torch.minimum(ahead, last.unsqueeze(-1)), real


def episode_last_rows(frame_in_episode: np.ndarray | None) -> np.ndarray | None:
    """(N,) int64: the last row of each row's episode (episodes laid end to end, positions restarting at 0)."""
    if frame_in_episode is None:
        return None
    positions = np.asarray(frame_in_episode, dtype=np.int64)
    starts = np.flatnonzero(positions == 0)
    if len(positions) and (len(starts) == 0 or starts[0] != 0):
        raise ValueError("frame_in_episode must start at 0: the first row is an episode's first frame")
    ends = np.append(starts[1:], len(positions)) - 1
    return np.repeat(ends, np.diff(np.append(starts, len(positions))))


def gather_chunks(actions: Tensor, episode_end: Tensor | None, rows: Tensor, chunk: int) -> tuple[Tensor, Tensor | None]:
    """Training targets for frame rows ``rows``: ``actions[rows]`` (chunk 1, no mask) or the next
    ``chunk`` actions of each row's episode (..., chunk, m) with their mask (..., chunk)."""
    if chunk <= 1:
        return actions[rows], None
    targets, real = chunk_rows(rows, episode_end, chunk, len(actions))
    return actions[targets], real


class FrameHistory:
    """Per-env rolling window of the last ``history`` observations (numpy, what a fleet loop holds).

    ``push(obs)`` appends this step's observations and returns the windows (B, H, n); an env marked
    by ``restart`` (or seen for the first time) refills its whole window with its next observation,
    which is the training rule for an episode's first frame.
    """

    def __init__(self, history: int) -> None:
        if history < 1:
            raise ValueError(f"policy.history={history} must be >= 1")
        self.history = history
        self.window: np.ndarray | None = None  # (B, H, n)
        self.fresh: np.ndarray | None = None  # (B,) bool: the next push starts a new episode

    def restart(self, envs: np.ndarray) -> None:
        """Envs (bool mask or indices) whose next observation is an episode's first frame."""
        if self.fresh is not None:
            self.fresh[envs] = True

    def push(self, obs: np.ndarray) -> np.ndarray:
        obs = np.asarray(obs, dtype=np.float32)
        if self.window is None or self.window.shape[0] != obs.shape[0] or self.window.shape[2] != obs.shape[1]:
            self.window = np.repeat(obs[:, None, :], self.history, axis=1)
            self.fresh = np.zeros(obs.shape[0], dtype=bool)
            return self.window.copy()
        assert self.fresh is not None
        self.window = np.roll(self.window, -1, axis=1)
        self.window[:, -1] = obs
        if self.fresh.any():
            self.window[self.fresh] = obs[self.fresh][:, None, :]
            self.fresh[:] = False
        return self.window.copy()


def fit_window(obs: np.ndarray, history: int) -> np.ndarray:
    """A robot's observation (n,) or window (h, n, oldest first) as a policy of ``history`` frames
    takes it: (n,) for history 1 (the newest frame), else (history, n) -- the newest ``history``
    frames, the oldest repeated in front when there are fewer (the episode-start rule)."""
    obs = np.asarray(obs, dtype=np.float32)
    frames = obs[None, :] if obs.ndim == 1 else obs
    if history <= 1:
        return frames[-1]
    frames = frames[-history:]
    pad = np.repeat(frames[:1], history - len(frames), axis=0)
    return np.concatenate([pad, frames])


def as_tensor_positions(frame_in_episode: np.ndarray | None) -> Tensor | None:
    import torch

    return None if frame_in_episode is None else torch.as_tensor(frame_in_episode, dtype=torch.int64)


def as_tensor_episode_ends(frame_in_episode: np.ndarray | None) -> Tensor | None:
    """``episode_last_rows`` as a tensor (the chunk targets' episode bounds), None for one stream."""
    import torch

    ends = episode_last_rows(frame_in_episode)
    return None if ends is None else torch.as_tensor(ends, dtype=torch.int64)
