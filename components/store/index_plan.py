"""IVF_PQ sizes that fit the table: sub-vectors that divide the vector width, partitions that fit the rows.

Product quantization splits each vector into ``num_sub_vectors`` equal slices, so the count must
divide the width. The width comes from the encoder (window × state dim: 8 × 11 = 88 for the
default simulator), not from the config, so ``store.index_sub_vectors`` is a preference: used as
is when it divides the width, otherwise replaced by the divisor that keeps its slice width
(``dim / preferred``) best among those giving ``MIN_DIMS_PER_SUB_VECTOR``–``MAX_DIMS_PER_SUB_VECTOR``
dims per slice (a PQ code of 8 bits over 4–16 dims is the usual trade between recall and code
size). 88 with 16 preferred (5.5 dims) → 22 sub-vectors of 4 dims; measured here, 8-dim slices
of the default sim's windows lost recall@10 that refine could not win back. A store never fails
to index because of its width.
"""

from __future__ import annotations

from dataclasses import dataclass

from components.config import StoreConfig

# IVF_PQ trains k-means on the rows present: below this it silently builds an empty index, and
# each partition wants about this many rows to train a centroid on.
IVF_PQ_MIN_ROWS = 256
MIN_DIMS_PER_SUB_VECTOR = 4
MAX_DIMS_PER_SUB_VECTOR = 16


@dataclass(frozen=True)
class IvfPqPlan:
    """The sizes an IVF_PQ index is built with, and whether the configured sub-vectors were kept."""

    partitions: int
    sub_vectors: int
    dim: int
    derived: bool  # True when store.index_sub_vectors did not divide dim and was replaced

    @property
    def dims_per_sub_vector(self) -> int:
        return self.dim // self.sub_vectors


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


def plan_ivf_pq(dim: int, rows: int, cfg: StoreConfig) -> IvfPqPlan:
    """Partitions: ``store.index_partitions``, fewer while the table has < 256 rows per partition."""
    sub_vectors = sub_vectors_for(dim, cfg.index_sub_vectors)
    partitions = max(1, min(cfg.index_partitions, rows // IVF_PQ_MIN_ROWS))
    return IvfPqPlan(partitions, sub_vectors, dim, derived=sub_vectors != cfg.index_sub_vectors)
