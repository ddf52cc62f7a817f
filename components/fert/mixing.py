"""Batch mixing: three pools of success frames with configured shares of every batch.

Frames that loop removal left out (``FrameTable.imitated``, fert/revisits.py) are in no pool.

    demos      expert demonstrations, uniform              share fert.mix_demos
    successes  every successful episode (demos included),  share fert.mix_successes
               uniform
    retrieved  frames inside kept matches, drawn by w      share fert.mix_retrieved

A frame that belongs to several pools gets the sum of its pools' probabilities, so one weighted
draw with replacement (the trainer's sampler, ``training.bc.batch_indices``) realizes the mix exactly without copying
frames. Shares of empty pools (no demos, nothing retrieved) go to the others in proportion.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from components.config import FertConfig
from components.fert.priority import FrameTable, PriorityWeights
from components.training.imitation import TrainingSet


@dataclass(frozen=True)
class PoolShares:
    """The shares of a batch each pool actually gets (after dropping empty pools)."""

    demos: float
    successes: float
    retrieved: float
    demo_frames: int
    success_frames: int
    retrieved_frames: int


def pool_shares(cfg: FertConfig, demo_frames: int, success_frames: int, retrieved_frames: int) -> PoolShares:
    raw = np.array([cfg.mix_demos, cfg.mix_successes, cfg.mix_retrieved], dtype=np.float64)
    raw *= np.array([demo_frames, success_frames, retrieved_frames]) > 0
    if raw.sum() <= 0:
        raise ValueError(
            "fert.mix_demos/mix_successes/mix_retrieved give no weight to any non-empty pool; "
            "set mix_successes > 0"
        )
    share = raw / raw.sum()
    return PoolShares(*map(float, share), demo_frames, success_frames, retrieved_frames)


def sampling_probabilities(table: FrameTable, priority: PriorityWeights, shares: PoolShares) -> np.ndarray:
    """(N,) probability of drawing each frame, summing to 1 (module doc); 0 on frames loop
    removal left out (``table.drawable``)."""
    drawable = table.drawable
    p = np.where(drawable, shares.successes / drawable.sum(), 0.0)
    demos = table.is_demo & drawable
    if shares.demos > 0:
        p[demos] += shares.demos / demos.sum()
    if shares.retrieved > 0:
        w = np.where(priority.retrieved, priority.weights, 0.0)
        p += shares.retrieved * w / w.sum()
    return p / p.sum()


def mix_pools(table: FrameTable, priority: PriorityWeights, cfg: FertConfig) -> tuple[TrainingSet, PoolShares]:
    drawable = table.drawable
    shares = pool_shares(cfg, int((table.is_demo & drawable).sum()), int(drawable.sum()), priority.retrieved_frames)
    probabilities = sampling_probabilities(table, priority, shares)
    return table.training_set(probabilities), shares
