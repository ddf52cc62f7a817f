"""Cut an episode's state sequence into fixed-length, overlapping windows (segments).

A window of ``W`` frames starts every ``stride`` frames; if the last regular window does not
reach the final frame, one more window aligned to the end (start = T - W) is added, so every
frame belongs to at least one window and the moments just before an episode ends (where
failures show) are always covered.

Episodes shorter than ``W`` give exactly one window: the real frames are right-aligned and the
front is padded by repeating the first frame (the convention LeRobot uses for history before
the episode start). Its segment is ``start=0, end=T``.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

from components.episodes.record import Episode


@dataclass(frozen=True)
class Windows:
    """The windows of one episode: ``windows[i]`` covers frames ``starts[i] : ends[i]``."""

    starts: np.ndarray  # (N,) int64, first frame of each window
    ends: np.ndarray  # (N,) int64, one past the last real frame (start + W, or T when padded)
    windows: np.ndarray  # (N, W, n) float32

    def __len__(self) -> int:
        return int(self.starts.shape[0])


def window_count(length: int, window: int, stride: int) -> int:
    """``len(window_starts(length, window, stride))`` without building the array."""
    last = length - window
    if last <= 0:
        return 1
    return last // stride + 1 + (1 if last % stride else 0)


def window_starts(length: int, window: int, stride: int) -> np.ndarray:
    """Start frames for an episode of ``length`` frames (see the module docstring)."""
    if length < 1:
        raise ValueError(f"episode length must be >= 1 frame, got {length}")
    if window < 1 or stride < 1:
        raise ValueError(f"store.window and store.stride must be >= 1, got {window}, {stride}")
    last = length - window
    if last <= 0:
        return np.zeros(1, dtype=np.int64)
    starts = np.arange(0, last + 1, stride, dtype=np.int64)
    if starts[-1] != last:
        starts = np.append(starts, np.int64(last))
    return starts


def cut_windows(states: np.ndarray, window: int, stride: int) -> Windows:
    """Windows of ``states`` (T, n): a copy, float32, shape (N, window, n)."""
    states = np.asarray(states)
    if states.ndim != 2:
        raise ValueError(
            f"observation.state must be (T, n), got shape {states.shape}; reshape per frame"
        )
    length = states.shape[0]
    starts = window_starts(length, window, stride)
    if length < window:
        pad = np.repeat(states[:1], window - length, axis=0)
        padded = np.concatenate([pad, states], axis=0).astype(np.float32)
        return Windows(starts=starts, ends=np.array([length], dtype=np.int64), windows=padded[None])
    view = sliding_window_view(states, window, axis=0)  # (T - W + 1, n, W)
    windows = np.ascontiguousarray(view[starts].transpose(0, 2, 1), dtype=np.float32)
    return Windows(starts=starts, ends=starts + window, windows=windows)


def camera_windows(frames: np.ndarray, starts: np.ndarray, window: int) -> np.ndarray:
    """(T, H, W', 3) frames cut at ``starts`` (``window_starts``) as ``cut_windows`` cuts states:
    (N, window, H, W', 3); an episode shorter than ``window``: one window, the front padded with
    its first frame."""
    frames = np.asarray(frames)
    if len(frames) < window:
        pad = np.repeat(frames[:1], window - len(frames), axis=0)
        return np.concatenate([pad, frames])[None]
    index = np.asarray(starts, dtype=np.int64)[:, None] + np.arange(window)
    return frames[index]


def episode_windows(episode: Episode, window: int, stride: int) -> tuple[np.ndarray, np.ndarray]:
    """``(starts (N,), windows (N, W, n))`` of an episode's ``observation.state``."""
    cut = cut_windows(episode.states, window, stride)
    return cut.starts, cut.windows
