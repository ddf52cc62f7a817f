"""Content hashes: what an episode *is*, independent of where or how it is stored.

Two tables with the same values hash the same whether a vector column is a fixed-size or a
variable-size list, whatever the chunking. Storage bookkeeping (episode/frame/task indices, file
locations, recomputed stats) is left out, so re-storing an episode never changes its hash.
"""

from __future__ import annotations

import hashlib
import json

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

HASH_NAME = "sha256"


def _is_list(t: pa.DataType) -> bool:
    return pa.types.is_list(t) or pa.types.is_large_list(t) or pa.types.is_fixed_size_list(t)


def table_fingerprint(table: pa.Table, exclude: frozenset[str] = frozenset()) -> str:
    """Hash of every column's name and values (columns in name order)."""
    kept = table.select([n for n in table.column_names if n not in exclude])
    return table_fingerprints(kept, np.array([0, kept.num_rows]))[0]


def table_fingerprints(table: pa.Table, bounds: np.ndarray) -> list[str]:
    """``table_fingerprint`` of each slice ``bounds[i]:bounds[i + 1]`` of ``table``: the same
    bytes hashed, with each column decoded once for the table instead of once per slice."""
    hashes = [hashlib.new(HASH_NAME) for _ in range(len(bounds) - 1)]
    for name in sorted(table.column_names):
        for h in hashes:
            h.update(name.encode() + b"\0")
        _update_slices(hashes, table.column(name).combine_chunks(), np.asarray(bounds, dtype=np.int64))
    return [h.hexdigest() for h in hashes]


def _update_slices(hashes: list, arr: pa.Array, bounds: np.ndarray) -> None:
    """Feed each slice ``arr[bounds[i]:bounds[i + 1]]`` to ``hashes[i]``: lists as their sizes
    then their values, numbers as their type and raw bytes, anything else (or anything holding a
    null) as JSON. The recipe every content hash is made of."""
    t = arr.type
    spans = list(zip(bounds[:-1].tolist(), bounds[1:].tolist()))
    if arr.null_count and len(spans) > 1:  # a slice may or may not hold a null: each takes its own branch
        for h, (a, b) in zip(hashes, spans):
            _update_slices([h], arr.slice(a, b - a), np.array([0, b - a]))
        return
    if _is_list(t) and not arr.null_count:
        if pa.types.is_fixed_size_list(t):
            sizes = np.full(len(arr), t.list_size, dtype=np.int64)
        else:
            sizes = pc.list_value_length(arr).to_numpy(zero_copy_only=False).astype(np.int64)
        for h, (a, b) in zip(hashes, spans):
            h.update(b"L")
            h.update(sizes[a:b].tobytes())
        flat_bounds = np.concatenate([[0], np.cumsum(sizes)])[bounds]
        _update_slices(hashes, arr.flatten(), flat_bounds)
        return
    if (pa.types.is_integer(t) or pa.types.is_floating(t) or pa.types.is_boolean(t)) and not arr.null_count:
        kind, values = str(t).encode(), arr.to_numpy(zero_copy_only=False)
        for h, (a, b) in zip(hashes, spans):
            h.update(kind)
            h.update(values[a:b].tobytes())
        return
    values = arr.to_pylist()
    for h, (a, b) in zip(hashes, spans):
        h.update(b"J")
        h.update(json.dumps(values[a:b], default=str, sort_keys=True).encode())


def combine_fingerprints(parts: list[str]) -> str:
    h = hashlib.new(HASH_NAME)
    for part in parts:
        h.update(part.encode() + b"\n")
    return h.hexdigest()
