"""LeRobot-style feature statistics: per episode (episodes meta ``stats/<feature>/<stat>``
columns) and aggregated over the dataset (``meta/stats.json``).

The aggregate is computed from the per-episode stats alone (count-weighted mean, pooled
variance), so rewriting ``stats.json`` never needs to reread frames.
"""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from components.episodes.schema import list_column_to_numpy

STATS_PREFIX = "stats/"
STAT_NAMES: tuple[str, ...] = ("min", "max", "mean", "std", "count")


def stats_column(feature: str, stat: str) -> str:
    return f"{STATS_PREFIX}{feature}/{stat}"


def parse_stats_column(name: str) -> tuple[str, str] | None:
    """``stats/observation.state/mean`` → (``observation.state``, ``mean``); else None."""
    if not name.startswith(STATS_PREFIX):
        return None
    feature, _, stat = name[len(STATS_PREFIX) :].rpartition("/")
    return (feature, stat) if feature and stat in STAT_NAMES else None


def _is_list(t: pa.DataType) -> bool:
    return pa.types.is_list(t) or pa.types.is_large_list(t) or pa.types.is_fixed_size_list(t)


def is_numeric_type(t: pa.DataType) -> bool:
    while _is_list(t):
        t = t.value_type
    return pa.types.is_integer(t) or pa.types.is_floating(t) or pa.types.is_boolean(t)


def column_values(column: pa.ChunkedArray | pa.Array) -> np.ndarray | None:
    """Frame values as a (T, d) float64 array, or None if not a flat numeric feature."""
    arr = column.combine_chunks() if isinstance(column, pa.ChunkedArray) else column
    if arr.null_count or not is_numeric_type(arr.type):
        return None
    try:
        if _is_list(arr.type):
            if _is_list(arr.type.value_type) or arr.flatten().null_count:
                return None  # nested (e.g. image-shaped) or holes: not a flat feature
            values = list_column_to_numpy(arr)
        else:
            values = arr.to_numpy(zero_copy_only=False).reshape(-1, 1)
    except (ValueError, pa.ArrowInvalid):
        return None  # variable-length rows of different sizes
    return values.astype(np.float64)


def feature_stats(values: np.ndarray) -> dict[str, np.ndarray]:
    """min/max/mean/std over frames (axis 0), and the frame count: ``span_stats`` of one run."""
    return {name: stat[0] for name, stat in span_stats(values, np.array([len(values)])).items()}


def span_stats(values: np.ndarray, lengths: np.ndarray) -> dict[str, np.ndarray]:
    """min/max/mean/std and count of each run of ``lengths`` consecutive frames of ``values``
    (T, d), stacked over the runs (runs, d), without a Python loop over runs (ingest computes
    them for every episode of a batch). A run's figures depend only on its own frames, not on
    where it sits in ``values``: an episode's stats are the same whichever batch stored it.
    Every length must be positive."""
    lengths = np.asarray(lengths, dtype=np.int64)
    starts = np.concatenate([[0], np.cumsum(lengths)[:-1]])
    counts = lengths.reshape(-1, 1).astype(values.dtype)
    mean = np.add.reduceat(values, starts, axis=0) / counts
    deviation = values - np.repeat(mean, lengths, axis=0)
    return {
        "min": np.minimum.reduceat(values, starts, axis=0),
        "max": np.maximum.reduceat(values, starts, axis=0),
        "mean": mean,
        "std": np.sqrt(np.add.reduceat(deviation * deviation, starts, axis=0) / counts),
        "count": lengths.reshape(-1, 1),
    }


def aggregate_stats(stacked: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Combine one feature's per-episode stats, stacked over episodes (axis 0): count-weighted
    mean, pooled variance, min, max."""
    counts = stacked["count"].reshape(len(stacked["count"]), -1)[:, 0]
    total = counts.sum()
    means, stds = stacked["mean"], stacked["std"]
    weights = (counts / total).reshape((-1,) + (1,) * (means.ndim - 1))
    mean = (weights * means).sum(axis=0)
    variance = (weights * (stds**2 + (means - mean) ** 2)).sum(axis=0)
    return {
        "min": stacked["min"].min(axis=0),
        "max": stacked["max"].max(axis=0),
        "mean": mean,
        "std": np.sqrt(variance),
        "count": np.array([int(total)], dtype=np.int64),
    }


def _stacked(column: pa.ChunkedArray) -> np.ndarray | None:
    """A stats column (one equally shaped, possibly nested list per row) as (rows, *shape) float64;
    None if the rows' shapes differ or a value is missing."""
    arr = column.combine_chunks()
    rows, flat, shape = len(arr), arr, []
    while _is_list(flat.type):
        lengths = pc.list_value_length(flat).to_numpy(zero_copy_only=False)
        if len(lengths) and (lengths != lengths[0]).any():
            return None
        shape.append(int(lengths[0]) if len(lengths) else 0)
        flat = flat.flatten()
    if flat.null_count:
        return None
    return flat.to_numpy(zero_copy_only=False).astype(np.float64).reshape((rows, *shape))


def stats_from_episodes_meta(meta: pa.Table) -> dict[str, dict[str, list]]:
    """``meta/stats.json`` content from the ``stats/*`` columns of the episodes table.

    Column-wise (no per-episode Python objects): it is rewritten on every ingest, so its cost
    must stay small as the dataset grows. Episodes without a feature's stats are left out of it.
    """
    features: dict[str, set[str]] = {}
    for name in meta.column_names:
        parsed = parse_stats_column(name)
        if parsed:
            features.setdefault(parsed[0], set()).add(parsed[1])
    out: dict[str, dict[str, list]] = {}
    for feature in sorted(features):
        if set(STAT_NAMES) - features[feature]:
            continue
        columns = meta.select([stats_column(feature, stat) for stat in STAT_NAMES])
        mask = pc.is_valid(columns.column(0))
        for c in columns.columns[1:]:
            mask = pc.and_(mask, pc.is_valid(c))
        columns = columns.filter(mask)
        if columns.num_rows == 0:
            continue
        stacked = {stat: _stacked(columns.column(i)) for i, stat in enumerate(STAT_NAMES)}
        ragged = [stats_column(feature, stat) for stat, v in stacked.items() if v is None]
        if ragged:
            raise ValueError(
                f"episodes meta: {ragged[0]} has rows of different shapes or holes; every episode's "
                f"stats of {feature!r} must have the feature's shape (re-export the episodes' stats)"
            )
        out[feature] = {k: v.tolist() for k, v in aggregate_stats(stacked).items()}
    return out
