"""Failure context: where a failed episode left the behaviour that succeeds.

The *bank* is every success window in the segment store (any robot, same task). For a window,
``nearest_success_distance`` is its distance to the closest bank window from another episode.

1. Calibrate on held-out successful episodes (never part of the threshold they are tested on):
   half of them give the success-to-success distances, whose ``percentile``-th percentile is the
   threshold; the other half measure the false-fire rate (the share of successes in which the
   detector would fire). With a p-th percentile threshold, (100 - p)% of success windows exceed
   it by construction, so ``consecutive`` is raised until the false-fire rate is at most
   ``max_false_fire`` (FERT-NOTES item 4).
2. A failed episode diverges at the first window that starts a run of ``consecutive`` windows all
   beyond the threshold; its failure context is that window and every later one. If no run is
   found, the context falls back to the windows covering the last ``fallback_steps`` steps.

Distances are in the store's metric (squared L2 for ``l2``), the same units as the threshold.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from components.config import FertConfig, StoreConfig
from components.episodes.record import Episode
from components.store.encoder import WindowEncoder, encode_episodes
from components.store.segment_store import SegmentStore
from components.store.windows import cut_windows

CALIBRATION_STREAM = 11  # salt for the generator that picks calibration episodes
MIN_SUCCESSES = 4  # two held out for calibration (threshold + false-fire), two in the bank


@dataclass(frozen=True)
class DivergenceThreshold:
    """The calibrated detector: distance threshold, run length, and how often successes fire."""

    distance: float  # in the store's metric
    percentile: float
    consecutive: int
    false_fire_rate: float  # share of held-out successes on which the detector fires
    calibration_episodes: int  # successes used (threshold half + false-fire half)


@dataclass(frozen=True)
class FailureContext:
    """The windows of one failed episode from its divergence on: the retrieval queries."""

    episode_id: str
    robot_id: str
    task: str
    divergence_step: int  # first frame of the context
    fallback: bool  # True: no divergence found, the last ``fallback_steps`` steps were used
    starts: np.ndarray  # (n,) window starts in the context
    vectors: np.ndarray  # (n, D) their embeddings
    distances: np.ndarray  # (n,) nearest-success distances of the context windows


def first_divergence(distances: np.ndarray, threshold: float, consecutive: int) -> int | None:
    """Index of the first window starting a run of ``consecutive`` windows beyond ``threshold``."""
    if consecutive < 1:
        raise ValueError(f"fert.consecutive must be >= 1, got {consecutive}")
    run = 0
    for i, beyond in enumerate(np.asarray(distances) > threshold):
        run = run + 1 if beyond else 0
        if run == consecutive:
            return i - consecutive + 1
    return None


def nearest_success_distance(
    store: SegmentStore, vectors: np.ndarray, task: str, exclude_episode_ids: Sequence[str] = ()
) -> np.ndarray:
    """(N,) distance from each vector to its nearest success window in the store (bank)."""
    if len(vectors) == 0:
        return np.zeros(0, dtype=np.float32)
    hits = store.search(vectors, k=1, success=True, task=task, exclude_episode_ids=exclude_episode_ids, exact=True)
    return hits.distances[:, 0]


def _episode_vectors(
    episode: Episode, encoder: WindowEncoder, store_cfg: StoreConfig
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    cut = cut_windows(episode.states, store_cfg.window, store_cfg.stride)
    return cut.starts, cut.ends, encode_episodes(encoder, [episode], [cut])  # camera windows too, if it reads them


def calibrate_threshold(
    store: SegmentStore,
    encoder: WindowEncoder,
    successes: Sequence[Episode],
    cfg: FertConfig,
    seed: int,
) -> DivergenceThreshold:
    """Threshold and run length from held-out successful episodes (see the module doc)."""
    chosen = [successes[i] for i in calibration_sample(len(successes), cfg, seed)]
    return threshold_from_held_out(store, encoder, chosen, cfg)


def calibration_sample(successes: int, cfg: FertConfig, seed: int) -> np.ndarray:
    """Positions (ascending) of the successes held out to calibrate, of ``successes`` in all; the
    rest stay in the bank. A caller that reads episodes lazily loads only these."""
    if successes < MIN_SUCCESSES:
        raise ValueError(
            f"divergence calibration needs >= {MIN_SUCCESSES} successful episodes (half stay in the bank); "
            "ingest more demos or fleet episodes"
        )
    rng = np.random.default_rng([seed, CALIBRATION_STREAM])
    count = min(cfg.calibration_episodes, successes // 2)  # the other half is the bank
    return np.sort(rng.choice(successes, size=count, replace=False))


def threshold_from_held_out(
    store: SegmentStore, encoder: WindowEncoder, chosen: Sequence[Episode], cfg: FertConfig
) -> DivergenceThreshold:
    """The threshold and run length from the held-out successes ``calibration_sample`` chose."""
    held_out = [ep.episode_id for ep in chosen]  # the bank never contains a calibration episode
    half = len(chosen) // 2
    threshold_eps, false_fire_eps = chosen[:half], chosen[half:]
    task = chosen[0].task

    vectors = [_episode_vectors(ep, encoder, store.cfg)[2] for ep in chosen]
    distances = nearest_success_distance(store, np.concatenate(vectors), task, held_out)
    split = np.cumsum([len(v) for v in vectors])[:-1]
    per_episode = np.split(distances, split)

    reference = np.concatenate(per_episode[:half])
    threshold = float(np.percentile(reference[np.isfinite(reference)], cfg.percentile))
    tested = per_episode[half:]

    def false_fire(k: int) -> float:
        return float(np.mean([first_divergence(d, threshold, k) is not None for d in tested]))

    consecutive = cfg.consecutive
    if cfg.calibrate:
        while false_fire(consecutive) > cfg.max_false_fire and consecutive < cfg.max_consecutive:
            consecutive += 1
    return DivergenceThreshold(threshold, cfg.percentile, consecutive, false_fire(consecutive), len(threshold_eps) + len(false_fire_eps))


def failure_contexts(
    store: SegmentStore,
    encoder: WindowEncoder,
    failed: Sequence[Episode],
    threshold: DivergenceThreshold,
    cfg: FertConfig,
) -> list[FailureContext]:
    """One ``FailureContext`` per failed episode (successful episodes are refused)."""
    if not failed:
        return []
    cut = [_episode_vectors(ep, encoder, store.cfg) for ep in failed]
    for ep in failed:
        if ep.success:
            raise ValueError(f"episode {ep.episode_id!r} succeeded; failure contexts come from failed episodes only")
    tasks = {ep.task for ep in failed}
    distances: dict[str, np.ndarray] = {}
    for task in sorted(tasks):
        mine = [i for i, ep in enumerate(failed) if ep.task == task]
        d = nearest_success_distance(store, np.concatenate([cut[i][2] for i in mine]), task)
        for i, part in zip(mine, np.split(d, np.cumsum([len(cut[i][2]) for i in mine])[:-1]), strict=True):
            distances[failed[i].episode_id] = part

    contexts = []
    for ep, (starts, ends, vectors) in zip(failed, cut, strict=True):
        d = distances[ep.episode_id]
        first = first_divergence(d, threshold.distance, threshold.consecutive)
        if first is None:
            # the last W steps: every window that ends inside them
            keep = ends > ep.length - cfg.fallback_steps
            first_step = max(0, ep.length - cfg.fallback_steps)
        else:
            keep = np.arange(len(starts)) >= first
            first_step = int(starts[first])
        contexts.append(
            FailureContext(
                episode_id=ep.episode_id,
                robot_id=ep.robot_id,
                task=ep.task,
                divergence_step=first_step,
                fallback=first is None,
                starts=starts[keep],
                vectors=vectors[keep],
                distances=d[keep],
            )
        )
    return contexts
