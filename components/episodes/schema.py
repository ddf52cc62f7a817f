"""The Arrow form of one episode: LeRobot v3 frame columns plus our episode-level columns.

One row per frame. ``observation.state`` and ``action`` are ``fixed_size_list<float32>``;
readers also accept variable-size lists (older LeRobot files). Episode-level fields
(``episode_id``, ``robot_id``, ``task``, ``policy_version``, ``success``, ``interrupted``) are
constant columns. Beside them an episode may carry the ``OPTIONAL_COLUMNS`` (each with its one
type) and LeRobot's ``BOOKKEEPING_COLUMNS``; a file with any other column is refused at both doors
(``validation.check_upload_columns``). A LeRobot import carries the source's other features too.
An episode file names its cameras in its schema metadata; their videos lie beside it (camera_files.py).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.ipc as ipc
import pyarrow.parquet as pq

from components.config import EpisodesConfig
from components.episodes.camera_files import with_camera_metadata, write_sidecars, write_table_last
from components.episodes.record import STAGE_COLUMN, Episode, reached_stage

EPISODE_ID = "episode_id"
ROBOT_ID = "robot_id"
TASK = "task"
FRAME_INDEX = "frame_index"
TIMESTAMP = "timestamp"
STATE = "observation.state"
ACTION = "action"
POLICY_VERSION = "policy_version"
SUCCESS = "success"
INTERRUPTED = "interrupted"

# Constant per episode: one value repeated on every frame.
EPISODE_LEVEL_COLUMNS: tuple[str, ...] = (
    EPISODE_ID,
    ROBOT_ID,
    TASK,
    POLICY_VERSION,
    SUCCESS,
    INTERRUPTED,
)
FRAME_COLUMNS: tuple[str, ...] = (FRAME_INDEX, TIMESTAMP, STATE, ACTION)
CONTRACT_COLUMNS: tuple[str, ...] = (
    EPISODE_ID,
    ROBOT_ID,
    TASK,
    FRAME_INDEX,
    TIMESTAMP,
    STATE,
    ACTION,
    POLICY_VERSION,
    SUCCESS,
    INTERRUPTED,
)
VECTOR_COLUMNS: tuple[str, ...] = (STATE, ACTION)

# LeRobot bookkeeping columns of data files: storage positions, reassigned on every store.
EPISODE_INDEX = "episode_index"
INDEX = "index"
TASK_INDEX = "task_index"
BOOKKEEPING_COLUMNS: tuple[str, ...] = (EPISODE_INDEX, INDEX, TASK_INDEX)
# Frame columns an episode file may carry beside the contract, each with the one Arrow type family
# it has everywhere (so episodes stored together never disagree on a column): LeRobot's per-step
# signals and the simulators' per-frame stage. Any other column is refused (one contract, two doors).
OPTIONAL_COLUMNS: dict[str, str] = {
    "next.reward": "float",
    "next.done": "bool",
    "next.success": "bool",
    STAGE_COLUMN: "integer",
}

PARQUET_MAGIC = b"PAR1"


def episode_schema(state_dim: int, action_dim: int) -> pa.Schema:
    """The canonical schema of one episode table (contract columns only)."""
    return pa.schema(
        [
            pa.field(EPISODE_ID, pa.string(), nullable=False),
            pa.field(ROBOT_ID, pa.string(), nullable=False),
            pa.field(TASK, pa.string(), nullable=False),
            pa.field(FRAME_INDEX, pa.int64(), nullable=False),
            pa.field(TIMESTAMP, pa.float32(), nullable=False),
            pa.field(STATE, pa.list_(pa.float32(), state_dim), nullable=False),
            pa.field(ACTION, pa.list_(pa.float32(), action_dim), nullable=False),
            pa.field(POLICY_VERSION, pa.string(), nullable=False),
            pa.field(SUCCESS, pa.bool_(), nullable=False),
            pa.field(INTERRUPTED, pa.bool_(), nullable=False),
        ]
    )


def vectors_to_arrow(values: np.ndarray) -> pa.FixedSizeListArray:
    """(T, d) float32 → fixed_size_list<float32>[d]."""
    values = np.ascontiguousarray(values, dtype=np.float32)
    if values.ndim != 2:
        raise ValueError(f"expected a (frames, dim) array, got shape {values.shape}")
    return pa.FixedSizeListArray.from_arrays(pa.array(values.reshape(-1)), values.shape[1])


def list_column_to_numpy(column: pa.ChunkedArray | pa.Array) -> np.ndarray:
    """A list column of equal-length rows (fixed or variable size) → (T, d) array."""
    arr = column.combine_chunks() if isinstance(column, pa.ChunkedArray) else column
    rows = len(arr)
    if pa.types.is_fixed_size_list(arr.type):
        flat = arr.flatten().to_numpy(zero_copy_only=False)
        return flat.reshape(rows, arr.type.list_size)
    lengths = pc.list_value_length(arr).to_numpy(zero_copy_only=False)
    if rows and (lengths != lengths[0]).any():
        raise ValueError("list rows have different lengths")
    flat = arr.flatten().to_numpy(zero_copy_only=False)
    return flat.reshape(rows, int(lengths[0]) if rows else 0)


def _extra_to_arrow(name: str, values: np.ndarray, length: int) -> pa.Array:
    if values.shape[:1] != (length,):
        raise ValueError(f"extra column {name!r}: expected {length} rows, got shape {values.shape}")
    if values.ndim == 1:
        return pa.array(values)
    if values.ndim == 2 and values.dtype != object:
        return pa.FixedSizeListArray.from_arrays(pa.array(values.reshape(-1)), values.shape[1])
    return pa.array(list(values))


def episode_to_table(ep: Episode) -> pa.Table:
    """An in-memory episode → its canonical Arrow table (extras become extra columns)."""
    length = ep.length
    states = np.asarray(ep.states, dtype=np.float32)
    actions = np.asarray(ep.actions, dtype=np.float32)
    schema = episode_schema(states.shape[1], actions.shape[1])
    columns = [
        pa.array([ep.episode_id] * length, pa.string()),
        pa.array([ep.robot_id] * length, pa.string()),
        pa.array([ep.task] * length, pa.string()),
        pa.array(ep.frame_index, pa.int64()),
        pa.array(np.asarray(ep.timestamps, dtype=np.float32), pa.float32()),
        vectors_to_arrow(states),
        vectors_to_arrow(actions),
        pa.array([ep.policy_version] * length, pa.string()),
        pa.array(np.full(length, bool(ep.success)), pa.bool_()),
        pa.array(np.full(length, bool(ep.interrupted)), pa.bool_()),
    ]
    table = pa.Table.from_arrays(columns, schema=schema)
    for name in sorted(ep.extras):
        table = table.append_column(name, _extra_to_arrow(name, np.asarray(ep.extras[name]), length))
    return table


def canonical_frames(table: pa.Table, states: np.ndarray, actions: np.ndarray) -> pa.Table:
    """Validated frames (one episode or several back to back) in the canonical layout: what
    ``episode_to_table`` gives each episode (contract columns, fixed-size vectors), then the
    table's other columns in its order. ``states``/``actions``: the vector columns as (T, d)."""
    schema = episode_schema(states.shape[1], actions.shape[1])
    columns = []
    for field in schema:
        if field.name == STATE:
            columns.append(vectors_to_arrow(states))
        elif field.name == ACTION:
            columns.append(vectors_to_arrow(actions))
        else:
            columns.append(table.column(field.name).cast(field.type))
    canonical = pa.Table.from_arrays(columns, schema=schema)
    for name in table.column_names:
        if name not in CONTRACT_COLUMNS:
            canonical = canonical.append_column(table.schema.field(name), table.column(name))
    return canonical


def _extra_to_numpy(column: pa.ChunkedArray) -> np.ndarray:
    arr = column.combine_chunks()
    if pa.types.is_list(arr.type) or pa.types.is_large_list(arr.type) or pa.types.is_fixed_size_list(
        arr.type
    ):
        try:
            return list_column_to_numpy(arr)
        except (ValueError, pa.ArrowInvalid):
            return np.array(arr.to_pylist(), dtype=object)
    try:
        return arr.to_numpy(zero_copy_only=False)
    except (pa.ArrowInvalid, NotImplementedError):
        return np.array(arr.to_pylist(), dtype=object)


def table_to_episode(table: pa.Table) -> Episode:
    """An episode table (already validated) → Episode; non-contract columns go to ``extras``."""
    return table_to_episodes(table, [table.num_rows])[0]


def table_to_episodes(table: pa.Table, lengths: list[int]) -> list[Episode]:
    """Episodes stored back to back in ``table`` (``lengths`` frames each, in row order) →
    the same Episodes ``table_to_episode`` gives for each slice, decoded column by column over
    the whole table: one conversion per column instead of one per episode and column (what a
    reader of many short episodes pays). Arrays are views into the table's columns."""
    bounds = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
    if bounds[-1] != table.num_rows:
        raise ValueError(f"episode lengths sum to {bounds[-1]}, the table has {table.num_rows} rows")
    starts = pa.array(bounds[:-1])
    first = {name: table.column(name).take(starts).to_pylist() for name in EPISODE_LEVEL_COLUMNS}
    states = list_column_to_numpy(table.column(STATE)).astype(np.float32, copy=False)
    actions = list_column_to_numpy(table.column(ACTION)).astype(np.float32, copy=False)
    timestamps = table.column(TIMESTAMP).to_numpy().astype(np.float32, copy=False)
    extras = [name for name in table.column_names if name not in CONTRACT_COLUMNS]
    whole = {name: _whole_extra(table.column(name)) for name in extras}
    out = []
    for i, (a, b) in enumerate(zip(bounds[:-1].tolist(), bounds[1:].tolist())):
        mine = {name: values[a:b] if values is not None else _extra_to_numpy(table.column(name).slice(a, b - a))
                for name, values in whole.items()}
        out.append(Episode(
            episode_id=str(first[EPISODE_ID][i]), robot_id=str(first[ROBOT_ID][i]), task=str(first[TASK][i]),
            states=states[a:b], actions=actions[a:b], timestamps=timestamps[a:b],
            success=bool(first[SUCCESS][i]), interrupted=bool(first[INTERRUPTED][i]),
            policy_version=str(first[POLICY_VERSION][i]), stage_reached=reached_stage(mine.get(STAGE_COLUMN)),
            extras=mine,
        ))
    return out


def _whole_extra(column: pa.ChunkedArray) -> np.ndarray | None:
    """An extra column decoded once for the whole table, when slicing that decoding gives what
    each episode's own decoding would: numeric scalars or fixed-width vectors without nulls. None
    otherwise (nulls, strings, ragged lists decode per episode)."""
    t = column.type
    if column.null_count:
        return None
    if pa.types.is_integer(t) or pa.types.is_floating(t) or pa.types.is_boolean(t):
        return column.combine_chunks().to_numpy(zero_copy_only=False)
    if pa.types.is_fixed_size_list(t) and (pa.types.is_integer(t.value_type) or pa.types.is_floating(t.value_type)):
        arr = column.combine_chunks()
        if arr.flatten().null_count == 0:
            return list_column_to_numpy(arr)
    return None


def write_episode_file(ep: Episode, path: Path, cfg: EpisodesConfig | None = None) -> Path:
    """Write one episode as one Parquet file (one row per frame), naming its cameras in the
    schema metadata; its camera streams, if any, go first into one mp4 each beside it, encoded
    at ``cfg.fps`` with ``cfg.video`` (camera_files.py). The table is renamed into place last."""
    if ep.cameras and cfg is None:
        raise ValueError(f"episode {ep.episode_id} has cameras {sorted(ep.cameras)}: pass the dataset's "
                         "EpisodesConfig (settings.episodes: fps, video) to write them beside its table")
    if ep.cameras:
        write_sidecars(ep, path, cfg)
    return write_table_last(with_camera_metadata(episode_to_table(ep), ep.cameras), path)


def episode_to_ipc(ep: Episode) -> bytes:
    """One episode as Arrow IPC stream bytes, the form the ingest service receives."""
    return table_to_ipc(episode_to_table(ep))


def table_to_ipc(table: pa.Table) -> bytes:
    sink = pa.BufferOutputStream()
    with ipc.new_stream(sink, table.schema) as writer:
        writer.write_table(table)
    return sink.getvalue().to_pybytes()


def read_episode_bytes(data: bytes) -> pa.Table:
    """Parquet bytes or Arrow IPC stream bytes → table. Raises ``ValueError`` if neither."""
    if data[:4] == PARQUET_MAGIC:
        try:  # ParquetFile, not read_table: no dataset discovery, ~5x less per small file; one
            # episode's columns decode faster in this thread than handed to Arrow's pool (~0.3 vs 0.4 ms)
            return pq.ParquetFile(pa.BufferReader(data)).read(use_threads=False)
        except OSError as exc:  # damaged pages (e.g. corrupt snappy data) raise OSError, not ArrowInvalid
            raise ValueError(f"a damaged Parquet file ({exc})") from exc
    try:
        return ipc.open_stream(pa.py_buffer(data)).read_all()
    except (pa.ArrowInvalid, OSError) as exc:
        raise ValueError(f"not a Parquet file nor an Arrow IPC stream ({exc})") from exc


def read_episode_file(path: Path) -> pa.Table:
    """One incoming episode file (Parquet or Arrow IPC stream) → table."""
    return read_episode_bytes(Path(path).read_bytes())
