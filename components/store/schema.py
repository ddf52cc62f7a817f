"""The segment table's row contract: its columns, its Arrow schema, the metadata keys on its
vector field, and the SQL literals its filters are written with.

Row contract (DESIGN.md): ``segment_id`` = f"{episode_id}:{start}", ``episode_id``,
``robot_id``, ``task``, ``start``, ``end`` (exclusive frame), ``success``, ``vector``
(fixed_size_list<float32>[dim]), ``policy_version``, ``snapshot``.
"""

from __future__ import annotations

from collections.abc import Iterable

import pyarrow as pa

VECTOR = "vector"
# Metadata on the vector field: which encoder made the vectors (fingerprint + JSON state).
ENCODER_FINGERPRINT_KEY = "fleetloop:encoder_fingerprint"
ENCODER_STATE_KEY = "fleetloop:encoder_state"
ENCODER_STATE_MAX_BYTES = 1 << 20  # larger encoder states (learned nets) store only the fingerprint
# ... the rows the vector index was last built on (upkeep rebuilds it as the table grows) ...
INDEX_ROWS_KEY = "fleetloop:index_rows"
# ... and how far the dataset's episodes are embedded (see EmbedCursor).
EMBED_CURSOR_KEY = "fleetloop:embed_cursor"
# Columns compared to decide whether a row changed. ``snapshot`` is left out on purpose: it
# records the snapshot that last *changed* the row, so re-ingesting under a new snapshot is a no-op.
CONTENT_COLUMNS = ("episode_id", "robot_id", "task", "start", "end", "success", "policy_version")
RESULT_COLUMNS = ("segment_id", "episode_id", "robot_id", "start", "end", "success")


def segment_schema(dim: int) -> pa.Schema:
    """The Arrow schema of the segment table for vectors of length ``dim``."""
    return pa.schema(
        [
            pa.field("segment_id", pa.string(), nullable=False),
            pa.field("episode_id", pa.string(), nullable=False),
            pa.field("robot_id", pa.string(), nullable=False),
            pa.field("task", pa.string(), nullable=False),
            pa.field("start", pa.int64(), nullable=False),
            pa.field("end", pa.int64(), nullable=False),
            pa.field("success", pa.bool_(), nullable=False),
            pa.field(VECTOR, pa.list_(pa.float32(), dim), nullable=False),
            pa.field("policy_version", pa.string(), nullable=False),
            pa.field("snapshot", pa.string(), nullable=False),
        ]
    )


def sql_str(value: str) -> str:
    return "'" + value.replace("'", "''") + "'"


def sql_in(column: str, values: Iterable[str]) -> str:
    return f"{column} IN ({', '.join(sql_str(v) for v in values)})"
