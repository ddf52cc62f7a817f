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


def _update(h: "hashlib._Hash", arr: pa.Array) -> None:
    t = arr.type
    if _is_list(t) and arr.null_count == 0:
        flat = arr.flatten()
        if pa.types.is_fixed_size_list(t):
            sizes = np.full(len(arr), t.list_size, dtype=np.int64)
        else:
            sizes = pc.list_value_length(arr).to_numpy(zero_copy_only=False).astype(np.int64)
        h.update(b"L")
        h.update(sizes.tobytes())
        _update(h, flat)
        return
    if (pa.types.is_integer(t) or pa.types.is_floating(t) or pa.types.is_boolean(t)) and not arr.null_count:
        h.update(str(t).encode())
        h.update(arr.to_numpy(zero_copy_only=False).tobytes())
        return
    h.update(b"J")
    h.update(json.dumps(arr.to_pylist(), default=str, sort_keys=True).encode())


def table_fingerprint(table: pa.Table, exclude: frozenset[str] = frozenset()) -> str:
    """Hash of every column's name and values (columns in name order)."""
    h = hashlib.new(HASH_NAME)
    for name in sorted(n for n in table.column_names if n not in exclude):
        h.update(name.encode() + b"\0")
        _update(h, table.column(name).combine_chunks())
    return h.hexdigest()


def combine_fingerprints(parts: list[str]) -> str:
    h = hashlib.new(HASH_NAME)
    for part in parts:
        h.update(part.encode() + b"\n")
    return h.hexdigest()
