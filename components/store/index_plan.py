"""Vector index sizes that fit the table: which index, how many partitions, and its LanceDB config.

Two kinds (``store.index_type``):

- **IVF_HNSW_SQ**: k-means partitions, each an HNSW graph over 8-bit scalar-quantized
  vectors. A query walks ``hnsw_nprobes`` partitions' graphs (``hnsw_ef`` wide) instead of
  scoring every row of ``nprobes`` partitions, so it touches a few hundred vectors, not tens of
  thousands. Partitions grow with the table (``rows / hnsw_partition_rows``): a graph's search
  cost grows only with the log of its size, and fewer, larger partitions keep the probed share
  of the data (and recall) up.
- **IVF_PQ** (default; see docs/results.md for the two side by side at 1M): product quantization splits each vector into ``num_sub_vectors`` equal slices, so
  the count must divide the width. The width comes from the encoder (window × state dim: 8 × 11
  = 88 for the default simulator), not from the config, so ``store.index_sub_vectors`` is a
  preference: used as is when it divides the width, otherwise replaced by the divisor that keeps
  its slice width (``dim / preferred``) best among those giving ``MIN_DIMS_PER_SUB_VECTOR``–
  ``MAX_DIMS_PER_SUB_VECTOR`` dims per slice (a PQ code of 8 bits over 4–16 dims is the usual
  trade between recall and code size). 88 with 16 preferred (5.5 dims) → 22 sub-vectors of 4
  dims; measured here, 8-dim slices of the default sim's windows lost recall@10 that refine
  could not win back. A store never fails to index because of its width.

Either way an IVF partition wants ``IVF_MIN_ROWS`` rows to train a centroid on.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from lancedb.index import IvfHnswSq, IvfPq

from components.config import StoreConfig

# IVF trains k-means on the rows present: below this IVF_PQ silently builds an empty index, and
# each partition wants about this many rows to train a centroid on.
IVF_MIN_ROWS = 256
IVF_PQ_MIN_ROWS = IVF_MIN_ROWS  # the name older callers import
MIN_DIMS_PER_SUB_VECTOR = 4
MAX_DIMS_PER_SUB_VECTOR = 16


@dataclass(frozen=True)
class IvfPqPlan:
    """The sizes an IVF_PQ index is built with, and whether the configured sub-vectors were kept."""

    partitions: int
    sub_vectors: int
    dim: int
    derived: bool  # True when store.index_sub_vectors did not divide dim and was replaced
    max_iterations: int = 50  # k-means iterations of the partitions and codebooks (LanceDB's default)

    kind = "IVF_PQ"

    @property
    def dims_per_sub_vector(self) -> int:
        return self.dim // self.sub_vectors

    def index_config(self, metric: str) -> IvfPq:
        return IvfPq(distance_type=metric, num_partitions=self.partitions, num_sub_vectors=self.sub_vectors,
                     max_iterations=self.max_iterations)

    def describe(self) -> str:
        return f"IVF_PQ {self.partitions} partitions x {self.sub_vectors} sub-vectors"


@dataclass(frozen=True)
class IvfHnswSqPlan:
    """The sizes an IVF_HNSW_SQ index is built with."""

    partitions: int
    m: int  # graph edges per node
    ef_construction: int
    dim: int
    max_iterations: int = 50  # k-means iterations of the partitions (LanceDB's default)

    kind = "IVF_HNSW_SQ"

    def index_config(self, metric: str) -> IvfHnswSq:
        return IvfHnswSq(distance_type=metric, num_partitions=self.partitions, m=self.m,
                         ef_construction=self.ef_construction, max_iterations=self.max_iterations)

    def describe(self) -> str:
        return f"IVF_HNSW_SQ {self.partitions} partitions, m={self.m}, ef_construction={self.ef_construction}"


IndexPlan = IvfPqPlan | IvfHnswSqPlan


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def sub_vectors_for(dim: int, preferred: int) -> int:
    """``preferred`` if it divides ``dim``; else the divisor of ``dim`` giving 4–16 dims per
    sub-vector whose slice width is nearest to the preferred one (``dim / preferred``; ties:
    more sub-vectors, the finer code). A width with no such divisor (a prime) takes the divisor
    nearest to that slice width the same way."""
    if dim < 1 or preferred < 1:
        raise ValueError(f"vector dim and store.index_sub_vectors must be >= 1, got {dim} and {preferred}")
    if dim % preferred == 0:
        return preferred
    fitting = [
        d for d in divisors(dim) if MIN_DIMS_PER_SUB_VECTOR <= dim // d <= MAX_DIMS_PER_SUB_VECTOR
    ] or divisors(dim)
    width = dim / preferred
    return min(fitting, key=lambda d: (abs(dim / d - width), -d))


def trainable_partitions(wanted: int, rows: int) -> int:
    """``wanted``, fewer while the table has < ``IVF_MIN_ROWS`` rows per partition; at least 1."""
    return max(1, min(wanted, rows // IVF_MIN_ROWS))


def plan_ivf_pq(dim: int, rows: int, cfg: StoreConfig) -> IvfPqPlan:
    """Partitions: ``store.index_partitions``, fewer while the table has < 256 rows per partition."""
    sub_vectors = sub_vectors_for(dim, cfg.index_sub_vectors)
    partitions = trainable_partitions(cfg.index_partitions, rows)
    return IvfPqPlan(partitions, sub_vectors, dim, derived=sub_vectors != cfg.index_sub_vectors,
                     max_iterations=cfg.index_max_iterations)


def plan_ivf_hnsw_sq(dim: int, rows: int, cfg: StoreConfig) -> IvfHnswSqPlan:
    """Partitions: ``ceil(rows / store.hnsw_partition_rows)`` (trainable); graph sizes from the config."""
    partitions = trainable_partitions(math.ceil(rows / cfg.hnsw_partition_rows), rows)
    return IvfHnswSqPlan(partitions, cfg.hnsw_m, cfg.hnsw_ef_construction, dim, cfg.index_max_iterations)


def plan_index(dim: int, rows: int, cfg: StoreConfig) -> IndexPlan:
    """The index ``store.index_type`` asks for, sized for ``rows`` rows of width ``dim``."""
    planner = {"IVF_HNSW_SQ": plan_ivf_hnsw_sq, "IVF_PQ": plan_ivf_pq}[cfg.index_type]
    return planner(dim, rows, cfg)


@dataclass(frozen=True)
class SearchParams:
    """How a query walks an index: partitions probed, graph breadth (HNSW only), exact re-rank."""

    nprobes: int
    ef: int | None  # None: not a graph index
    refine_factor: int  # re-rank k × this candidates with exact distances; 0 = off


def search_params(index_type: str | None, k: int, cfg: StoreConfig) -> SearchParams:
    """The keys of the index the table *has* (``index_type``), not of ``store.index_type``: a store
    indexed before the type changed keeps its recall until upkeep rebuilds it. No index: flat,
    the values are unused."""
    if index_type == "IVF_HNSW_SQ":
        return SearchParams(cfg.hnsw_nprobes, max(cfg.hnsw_ef, k), cfg.hnsw_refine_factor)
    return SearchParams(cfg.nprobes, None, cfg.refine_factor)
