"""``SearchResult``: k nearest segments per query as (Q, k) arrays, and how one is assembled
(empty, from LanceDB's hits, from a scan's or FAISS's positions, from batches in query order).
Shared by every engine that answers a search (search.py, resident.py)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pyarrow as pa


@dataclass(frozen=True)
class SearchResult:
    """k nearest segments per query, as (Q, k) arrays; a query with fewer hits is padded.

    Padding: ``segment_ids``/``episode_ids``/``robot_ids`` = "", ``starts``/``ends`` = -1,
    ``success`` = False, ``distances`` = inf. ``counts[q]`` is the number of real hits and
    ``valid`` masks them. Distances are in the store's metric (squared L2 for "l2").
    """

    segment_ids: np.ndarray  # (Q, k) object (str)
    episode_ids: np.ndarray  # (Q, k) object (str)
    robot_ids: np.ndarray  # (Q, k) object (str)
    starts: np.ndarray  # (Q, k) int64
    ends: np.ndarray  # (Q, k) int64
    success: np.ndarray  # (Q, k) bool
    distances: np.ndarray  # (Q, k) float32, ascending per row
    counts: np.ndarray  # (Q,) int64
    metric: str
    version: int  # table version the search read

    @property
    def valid(self) -> np.ndarray:
        return np.isfinite(self.distances)

    def __len__(self) -> int:
        return int(self.distances.shape[0])


def empty_result(n_queries: int, k: int, metric: str, version: int) -> SearchResult:
    return SearchResult(
        segment_ids=np.full((n_queries, k), "", dtype=object),
        episode_ids=np.full((n_queries, k), "", dtype=object),
        robot_ids=np.full((n_queries, k), "", dtype=object),
        starts=np.full((n_queries, k), -1, dtype=np.int64),
        ends=np.full((n_queries, k), -1, dtype=np.int64),
        success=np.zeros((n_queries, k), dtype=bool),
        distances=np.full((n_queries, k), np.inf, dtype=np.float32),
        counts=np.zeros(n_queries, dtype=np.int64),
        metric=metric,
        version=version,
    )


def concat_results(parts: list[SearchResult]) -> SearchResult:
    """Batches of one search, stacked in query order."""
    def stack(name: str) -> np.ndarray:
        return np.concatenate([getattr(p, name) for p in parts], axis=0)

    return SearchResult(
        segment_ids=stack("segment_ids"), episode_ids=stack("episode_ids"), robot_ids=stack("robot_ids"),
        starts=stack("starts"), ends=stack("ends"), success=stack("success"), distances=stack("distances"),
        counts=stack("counts"), metric=parts[0].metric, version=parts[0].version,
    )


def to_result(hits: pa.Table, n_queries: int, k: int, metric: str, version: int) -> SearchResult:
    result = empty_result(n_queries, k, metric, version)
    if hits.num_rows == 0:
        return result
    if "query_index" in hits.column_names:
        query = hits.column("query_index").to_numpy().astype(np.int64)
    else:
        query = np.zeros(hits.num_rows, dtype=np.int64)
    distance = hits.column("_distance").to_numpy().astype(np.float32)
    order = np.lexsort((distance, query))
    query, distance = query[order], distance[order]
    counts = np.bincount(query, minlength=n_queries)
    first = np.concatenate([[0], np.cumsum(counts)[:-1]])
    rank = np.arange(len(query)) - first[query]
    keep = rank < k
    q, r, o = query[keep], rank[keep], order[keep]
    place(result, q, r, hits.take(pa.array(o)), distance[keep])
    result.counts[:] = np.minimum(counts, k)
    return result


def place(result: SearchResult, q: np.ndarray, r: np.ndarray, rows: pa.Table, distances: np.ndarray) -> None:
    """Write hit ``i`` (``rows`` row i, ``distances[i]``) into ``result`` at query q[i], rank r[i]."""
    result.distances[q, r] = distances
    for name, target in (("segment_id", result.segment_ids), ("episode_id", result.episode_ids),
                         ("robot_id", result.robot_ids)):
        target[q, r] = np.asarray(rows.column(name).to_pylist(), dtype=object)
    result.starts[q, r] = rows.column("start").to_numpy()
    result.ends[q, r] = rows.column("end").to_numpy()
    result.success[q, r] = rows.column("success").to_numpy(zero_copy_only=False)
