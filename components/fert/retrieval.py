"""Retrieval: each failure-context window asks the segment store for similar *successful* windows.

    queries (failure-context windows, capped at fert.max_queries by a seeded subsample)
      --store.search(k=top_k, success=True, task=task)--> k nearest success segments each
      --drop matches beyond the max_distance_percentile-th percentile of retrieved distances-->
      Retrieved: one row per kept match (query window: failed episode + first frame; matched
      episode, robot, frames [start, end), distance)

Matches come from any robot of the fleet (not only the failing one). The store filters on
``success`` before ranking, and every row is checked again here: a failed episode's window is
never returned, so its actions are never imitated.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from components.config import FertConfig
from components.fert.divergence import FailureContext
from components.store.segment_store import SegmentStore

QUERY_SAMPLE_STREAM = 12  # salt for the generator that subsamples queries above max_queries


@dataclass(frozen=True)
class Retrieved:
    """Kept matches, one row each; distances in the store's metric (squared L2 for ``l2``)."""

    query: np.ndarray  # (M,) index of the query window that found the match
    query_episode_ids: np.ndarray  # (M,) the failed episode the query came from
    query_starts: np.ndarray  # (M,) first frame of that query window in its episode
    episode_ids: np.ndarray  # (M,) the successful episode matched
    robot_ids: np.ndarray  # (M,)
    starts: np.ndarray  # (M,) first frame of the matched segment
    ends: np.ndarray  # (M,) one past its last frame
    distances: np.ndarray  # (M,)
    metric: str
    num_queries: int
    cutoff: float  # matches farther than this were dropped
    dropped: int
    store_version: int

    def __len__(self) -> int:
        return int(self.distances.shape[0])

    def euclidean(self) -> np.ndarray:
        """Distances as plain (not squared) lengths, whatever the store's metric."""
        return np.sqrt(np.maximum(self.distances, 0.0)) if self.metric == "l2" else self.distances.astype(np.float64)


def query_windows(
    contexts: Sequence[FailureContext], max_queries: int, seed: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """All context windows as queries ``(Q, D)`` with their episode ids and first frames,
    subsampled to ``max_queries``."""
    if not contexts:
        return np.zeros((0, 0), dtype=np.float32), np.zeros(0, dtype=object), np.zeros(0, dtype=np.int64)
    vectors = np.concatenate([c.vectors for c in contexts]).astype(np.float32)
    owners = np.concatenate([np.full(len(c.vectors), c.episode_id, dtype=object) for c in contexts])
    starts = np.concatenate([np.asarray(c.starts, dtype=np.int64) for c in contexts])
    if len(vectors) > max_queries:
        keep = np.sort(np.random.default_rng([seed, QUERY_SAMPLE_STREAM]).choice(len(vectors), max_queries, replace=False))
        vectors, owners, starts = vectors[keep], owners[keep], starts[keep]
    return vectors, owners, starts


def retrieve(
    store: SegmentStore, contexts: Sequence[FailureContext], cfg: FertConfig, task: str, seed: int
) -> Retrieved:
    """Top-k success segments per failure-context window, beyond-threshold matches dropped."""
    queries, owners, query_starts = query_windows(contexts, cfg.max_queries, seed)
    if len(queries) == 0:
        return empty_retrieved(store, cutoff=float("nan"))
    hits = store.search(queries, k=cfg.top_k, success=True, task=task)
    valid = hits.valid
    if (hits.success[valid] == False).any():  # noqa: E712 - numpy bool array
        raise RuntimeError("segment store returned a failed episode for a success=True search; check the store filter")
    rows, cols = np.nonzero(valid)
    distances = hits.distances[rows, cols]
    if len(distances) == 0:
        return empty_retrieved(store, cutoff=float("nan"), num_queries=len(queries))
    cutoff = float(np.percentile(distances, cfg.max_distance_percentile))
    keep = distances <= cutoff
    rows, cols = rows[keep], cols[keep]
    return Retrieved(
        query=rows.astype(np.int64),
        query_episode_ids=owners[rows],
        query_starts=query_starts[rows],
        episode_ids=hits.episode_ids[rows, cols],
        robot_ids=hits.robot_ids[rows, cols],
        starts=hits.starts[rows, cols],
        ends=hits.ends[rows, cols],
        distances=distances[keep].astype(np.float64),
        metric=hits.metric,
        num_queries=len(queries),
        cutoff=cutoff,
        dropped=int((~keep).sum()),
        store_version=hits.version,
    )


def empty_retrieved(store: SegmentStore, cutoff: float, num_queries: int = 0) -> Retrieved:
    none = np.zeros(0, dtype=object)
    ints = np.zeros(0, dtype=np.int64)
    return Retrieved(
        ints, none, ints, none, none, ints, ints, np.zeros(0), store.cfg.metric, num_queries, cutoff, 0, store.version
    )
