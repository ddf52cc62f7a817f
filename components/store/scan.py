"""Exact k-nearest neighbours for many queries in one streaming pass over the table.

    queries (Q, D) + the table's filtered rows, streamed in batches of ``store.scan_rows``
      --per batch: distances of every query block by one matrix product (BLAS), top (k + k)
        candidates kept, their distances recomputed exactly as sum((q - v)^2) (or 1 - cos)-->
      running top-k per query, ties broken by row position --> (Q, k) distances + row positions

Why a scan of our own: FERT asks thousands of queries at once (every window of every failed
episode for the divergence, up to ``fert.max_queries`` for retrieval). Through LanceDB's IVF_PQ
index with the success prefilter that took minutes at 96 robots (336k segments, 1,164 queries:
85 s indexed, 23 s flat, 21 s scanned; ``benchmarks/ingest.py``'s bulk case). One pass that reads
each row once and scores every query against it with a matrix product costs one table read plus
Q x N x D multiply-adds, exact, with ties broken by row order, so its result does not depend on
the index's state. Below ``store.scan_min_queries`` queries the table read is not amortised and
LanceDB answers instead.

The matrix product's expansion (|q|^2 + |v|^2 - 2 q.v) loses low bits, so it only *preselects*;
the reported distances are recomputed directly, and ranking uses those.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np
import pyarrow as pa
import torch

RERANK_MARGIN = 1.0  # preselect k * (1 + margin) candidates per batch before the exact re-rank


@dataclass
class ScanHits:
    """(Q, k) exact distances (inf = no hit) and row positions in the scanned order (-1 = none)."""

    distances: np.ndarray
    positions: np.ndarray


def scan_nearest(batches: Iterable[pa.RecordBatch], vector_column: str, queries: np.ndarray, k: int,
                 metric: str, query_block: int, keep: Iterable[str] = ()) -> tuple[ScanHits, pa.Table | None]:
    """Exact top-``k`` of every query over the rows of ``batches``; also returns the ``keep``
    columns of every scanned row (positions index into it), or None when nothing was scanned."""
    q = torch.from_numpy(np.ascontiguousarray(queries, dtype=np.float32))
    if metric == "cosine":
        q = torch.nn.functional.normalize(q, dim=1)
    n_queries = q.shape[0]
    best_d = torch.full((n_queries, k), float("inf"))
    best_p = torch.full((n_queries, k), -1, dtype=torch.int64)
    kept: list[pa.RecordBatch] = []
    offset = 0
    for batch in batches:
        if batch.num_rows == 0:
            continue
        v = _batch_vectors(batch, vector_column, q.shape[1], metric)
        for a in range(0, n_queries, query_block):
            d, p = _batch_top(q[a : a + query_block], v, k, metric)
            best_d[a : a + query_block], best_p[a : a + query_block] = _merge(
                best_d[a : a + query_block], best_p[a : a + query_block], d, p + offset, k)
        kept.append(batch.select(list(keep)))
        offset += batch.num_rows
    table = pa.Table.from_batches(kept) if kept else None
    return ScanHits(best_d.numpy(), best_p.numpy()), table


def vectors_of(column: pa.ChunkedArray | pa.Array, dim: int) -> np.ndarray:
    """A fixed-size-list vector column as an (N, dim) array."""
    array = column.combine_chunks() if isinstance(column, pa.ChunkedArray) else column
    return array.flatten().to_numpy(zero_copy_only=False).reshape(-1, dim)


def _batch_vectors(batch: pa.RecordBatch, column: str, dim: int, metric: str) -> torch.Tensor:
    v = torch.from_numpy(np.array(vectors_of(batch.column(column), dim), dtype=np.float32))  # a writable copy
    return torch.nn.functional.normalize(v, dim=1) if metric == "cosine" else v


def _batch_top(q: torch.Tensor, v: torch.Tensor, k: int, metric: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Each query's ``k`` nearest rows of ``v`` (exact distances, sorted by distance then row)."""
    width = min(v.shape[0], int(k * (1 + RERANK_MARGIN)))
    score = q @ v.T  # (Qb, n)
    if metric == "cosine":
        approx = -score
    else:
        approx = (v * v).sum(1)[None, :] - 2 * score  # |q|^2 is the same for every row of a query
    cand = torch.topk(approx, width, dim=1, largest=False).indices.sort(dim=1).values  # row order: ties
    picked = v[cand]  # (Qb, width, D)
    if metric == "cosine":
        exact = 1.0 - (picked * q[:, None, :]).sum(-1)
    else:
        exact = ((picked - q[:, None, :]) ** 2).sum(-1)
    order = torch.sort(exact, dim=1, stable=True).indices[:, :k]
    return exact.gather(1, order), cand.gather(1, order)


def _merge(d0: torch.Tensor, p0: torch.Tensor, d1: torch.Tensor, p1: torch.Tensor, k: int
           ) -> tuple[torch.Tensor, torch.Tensor]:
    """The ``k`` best of two sorted candidate lists; every p1 lies after every real p0, so a stable
    sort keeps ties in row order."""
    d, p = torch.cat([d0, d1], dim=1), torch.cat([p0, p1], dim=1)
    order = torch.sort(d, dim=1, stable=True).indices[:, :k]
    return d.gather(1, order), p.gather(1, order)
