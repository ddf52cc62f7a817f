"""Loop removal: frames of a success that the same episode later comes back to are not imitated.

An exploring fleet's successes contain loops: the robot hovers over the goal with the jaw closed
for a few frames before the one frame that releases, or closes too early, misses, re-opens and
comes back to where it was. Imitating every frame teaches the detour as often as the way out:
at the hovering state the labels are k × "keep closed" and 1 × "open", so the deployed
(thresholded) policy learns to hover for ever, and more fleet data teaches it more firmly.

A frame whose state the episode is still near later was, in hindsight, a detour: the episode
left that state and came back, or never left it. Only the *last* visit's action is what led on
to the success, so only it is imitated. Distances are measured on states scaled by the
per-dimension std of all success frames, and "near" is ``radius`` times the median distance
between consecutive success frames: a simulator whose robots move little per step (Meta-World's
39-dim observation moves ~0.3 std per step, the built-in task ~0.65) gets a proportionally smaller
neighbourhood, so one setting fits both. Nothing here looks at the simulator's internals: it
needs only the logged states of successful episodes.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

MIN_SCALE = 1e-6  # a constant state dimension does not divide by zero


def state_scale(states: np.ndarray) -> np.ndarray:
    """Per-dimension std of ``states`` (N, n), the unit of ``radius``."""
    return np.maximum(states.std(axis=0), MIN_SCALE)


def revisited(states: np.ndarray, radius: float, scale: np.ndarray) -> np.ndarray:
    """(T,) bool: frame t's state lies within ``radius`` of a later frame's state (same episode)."""
    z = np.asarray(states, dtype=np.float64) / scale
    sq = (z * z).sum(axis=1)
    d2 = sq[:, None] + sq[None, :] - 2.0 * (z @ z.T)  # squared distances, all pairs
    later = np.triu(np.ones_like(d2, dtype=bool), k=1)
    return (later & (d2 < radius * radius)).any(axis=1)


def median_step(episode_states: Sequence[np.ndarray], scale: np.ndarray) -> float:
    """Median distance between consecutive frames (scaled states) over all episodes."""
    steps = [np.linalg.norm(np.diff(s / scale, axis=0), axis=1) for s in episode_states if len(s) > 1]
    step = float(np.median(np.concatenate(steps))) if steps else 0.0
    return step if step > 0 else 1.0


def imitated_frames(episode_states: Sequence[np.ndarray], radius: float) -> np.ndarray:
    """(sum T,) bool over the concatenated episodes: True = imitate (not a revisited frame).

    ``radius`` is in units of the median step (module doc).
    """
    if radius < 0:
        raise ValueError(f"fert.revisit_radius={radius} must be >= 0 (0 = imitate every frame)")
    total = sum(len(s) for s in episode_states)
    if radius == 0 or total == 0:
        return np.ones(total, dtype=bool)
    scale = state_scale(np.concatenate(episode_states))
    near = radius * median_step(episode_states, scale)
    return ~np.concatenate([revisited(s, near, scale) for s in episode_states])
