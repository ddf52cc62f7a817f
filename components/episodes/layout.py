"""The dataset's LeRobot v3 bookkeeping: where each file lies, the columns LeRobot adds to data
files and to the episodes table, and the small metadata files (``meta/info.json``,
``meta/tasks.parquet``, ``meta/stats.json``).

```
meta/info.json                              features, fps, totals, path templates (``new_info``)
meta/tasks.parquet                          task string <-> task_index (``tasks_table``, ``read_tasks``)
meta/stats.json                             per-feature stats, pooled per ingest (``pooled_stats``)
meta/episodes/chunk-XXX/file-XXX.parquet    the episodes table (meta_files.py); ``META_*`` columns
data/chunk-XXX/file-XXX.parquet             frames (data_files.py); ``BOOKKEEPING_COLUMNS``
videos/<key>/chunk-XXX/file-XXX.mp4         camera streams (``VIDEO_PATH``, ``video_location_column``)
```

Every file is written under a temporary name and moved into place (``write_parquet``,
``write_bytes``, ``copy_file``), so a reader never sees half a file.
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from components.config import EpisodesConfig
from components.episodes.data_files import DATA_PATH, TMP_SUFFIX
from components.episodes.schema import (
    EPISODE_ID,
    EPISODE_INDEX,
    INTERRUPTED,
    POLICY_VERSION,
    ROBOT_ID,
    STATE,
    SUCCESS,
    TASK,
    TASK_INDEX,
)
from components.episodes.stats import STAT_NAMES, aggregate_stats, stats_from_episodes_meta
from components.fsio import atomic_path, atomic_write_bytes

INFO_PATH = "meta/info.json"
STATS_PATH = "meta/stats.json"
TASKS_PATH = "meta/tasks.parquet"
EPISODES_META_PATH = "meta/episodes/chunk-000/file-000.parquet"  # the first file (exports write one)
CHUNK_FILE_PATTERN = "chunk-{chunk_index:03d}/file-{file_index:03d}"
VIDEO_PATH = "videos/{video_key}/" + CHUNK_FILE_PATTERN + ".mp4"
# LeRobot's default, written to info.json for readers that expect it.
VIDEO_FILES_SIZE_IN_MB = 500

# Episodes-table columns (LeRobot v3) and ours.
META_TASKS = "tasks"
META_LENGTH = "length"
META_DATA_CHUNK = "data/chunk_index"
META_DATA_FILE = "data/file_index"
META_FROM = "dataset_from_index"
META_TO = "dataset_to_index"
META_META_CHUNK = "meta/episodes/chunk_index"
META_META_FILE = "meta/episodes/file_index"
META_CONTENT_HASH = "content_hash"
OWN_META_COLUMNS: frozenset[str] = frozenset(
    {
        EPISODE_INDEX,
        META_TASKS,
        META_LENGTH,
        META_DATA_CHUNK,
        META_DATA_FILE,
        META_FROM,
        META_TO,
        META_META_CHUNK,
        META_META_FILE,
        META_CONTENT_HASH,
        EPISODE_ID,
        ROBOT_ID,
        POLICY_VERSION,
        SUCCESS,
        INTERRUPTED,
    }
)
VIDEO_LOCATION = re.compile(r"^videos/(?P<key>.+)/(?P<what>chunk_index|file_index)$")

_ARROW_DTYPE_NAMES = {"float": "float32", "double": "float64", "halffloat": "float16"}


def video_location_column(key: str, what: str) -> str:
    """``videos/<key>/chunk_index`` or ``videos/<key>/file_index`` (LeRobot v3 episodes table)."""
    return f"videos/{key}/{what}"


def is_location_column(name: str) -> bool:
    """Episodes-table columns that say where something is stored, not what it is."""
    return name in OWN_META_COLUMNS or bool(VIDEO_LOCATION.match(name))


def file_keys(meta: pa.Table | None) -> list[tuple[int, int]]:
    """The (chunk, file) keys of the data files the episodes table ``meta`` references, in order."""
    if meta is None:
        return []
    chunks = meta.column(META_DATA_CHUNK).to_numpy()
    files = meta.column(META_DATA_FILE).to_numpy()
    pairs = np.unique(np.stack([chunks, files], axis=1), axis=0)
    return [(int(c), int(f)) for c, f in pairs]


def next_file_number(meta: pa.Table | None, chunk_size: int) -> int:
    """The number (chunk * chunk_size + file) of the next new data file."""
    if meta is None or meta.num_rows == 0:
        return 0
    chunks = meta.column(META_DATA_CHUNK).to_numpy()
    files = meta.column(META_DATA_FILE).to_numpy()
    return int((chunks * chunk_size + files).max()) + 1


def next_video_numbers(meta: pa.Table | None, chunk_size: int) -> dict[str, int]:
    """The number of the next new video file, per video key the episodes table names."""
    out: dict[str, int] = {}
    if meta is None:
        return out
    for name in meta.column_names:
        match = VIDEO_LOCATION.match(name)
        if not match or match["what"] != "chunk_index":
            continue
        key = match["key"]
        chunks = meta.column(name).to_pylist()
        files = meta.column(video_location_column(key, "file_index")).to_pylist()
        numbers = [c * chunk_size + f for c, f in zip(chunks, files) if c is not None and f is not None]
        out[key] = max(numbers) + 1 if numbers else 0
    return out


def infer_feature(arrow_type: pa.DataType, sample: Any = None) -> dict[str, Any]:
    """An info.json feature entry for a column we only know by its Arrow type."""
    shape = [1]
    value_type = arrow_type
    if pa.types.is_fixed_size_list(arrow_type):
        shape, value_type = [arrow_type.list_size], arrow_type.value_type
    elif pa.types.is_list(arrow_type) or pa.types.is_large_list(arrow_type):
        shape = [len(sample)] if isinstance(sample, list) else [1]
        value_type = arrow_type.value_type
    dtype = str(value_type)
    if pa.types.is_string(value_type) or pa.types.is_large_string(value_type):
        dtype = "string"
    return {"dtype": _ARROW_DTYPE_NAMES.get(dtype, dtype), "shape": shape, "names": None}


def new_info(cfg: EpisodesConfig, fps: float | None = None, robot_type: str | None = None) -> dict[str, Any]:
    """A fresh info.json: fps and robot type from the config unless an import brings its own."""
    fps = cfg.fps if fps is None else fps
    return {
        "codebase_version": cfg.codebase_version,
        "robot_type": robot_type or cfg.robot_type,
        "total_episodes": 0,
        "total_frames": 0,
        "total_tasks": 0,
        "chunks_size": cfg.chunk_size,
        "data_files_size_in_mb": int(cfg.data_file_mb) if float(cfg.data_file_mb).is_integer()
        else cfg.data_file_mb,
        "video_files_size_in_mb": VIDEO_FILES_SIZE_IN_MB,
        "fps": int(fps) if float(fps).is_integer() else fps,
        "splits": {"train": "0:0"},
        "data_path": DATA_PATH,
        "video_path": None,
        "features": {},
    }


def write_bytes(path: Path, data: bytes) -> None:
    atomic_write_bytes(path, data, tmp_name=path.name + TMP_SUFFIX)


def write_parquet(path: Path, table: pa.Table, compression: str) -> None:
    with atomic_path(path, tmp_name=path.name + TMP_SUFFIX) as tmp:
        pq.write_table(table, tmp, compression=compression)


def copy_file(src: Path, dst: Path) -> None:
    with atomic_path(dst, tmp_name=dst.name + TMP_SUFFIX) as tmp:
        shutil.copyfile(src, tmp)


def tasks_table(tasks: list[str]) -> pa.Table:
    """``meta/tasks.parquet`` as LeRobot writes it: a pandas frame indexed by ``task``."""
    pandas_meta = {
        "index_columns": [TASK],
        "column_indexes": [
            {"name": None, "field_name": None, "pandas_type": "unicode", "numpy_type": "object",
             "metadata": {"encoding": "UTF-8"}}
        ],
        "columns": [
            {"name": TASK_INDEX, "field_name": TASK_INDEX, "pandas_type": "int64",
             "numpy_type": "int64", "metadata": None},
            {"name": TASK, "field_name": TASK, "pandas_type": "unicode", "numpy_type": "object",
             "metadata": None},
        ],
        "creator": {"library": "pyarrow", "version": pa.__version__},
        "pandas_version": "2.2.0",
    }
    schema = pa.schema([(TASK_INDEX, pa.int64()), (TASK, pa.string())]).with_metadata(
        {b"pandas": json.dumps(pandas_meta).encode()}
    )
    return pa.Table.from_arrays(
        [pa.array(range(len(tasks)), pa.int64()), pa.array(tasks, pa.string())], schema=schema
    )


def read_tasks(path: Path) -> list[str]:
    """Task strings in task_index order, from a LeRobot ``tasks.parquet`` (index or column)."""
    table = pq.read_table(path)
    names = table.column_names
    text_col = TASK if TASK in names else next((n for n in names if n.startswith("__index_level_")), None)
    if text_col is None or TASK_INDEX not in names:
        raise ValueError(f"{path}: expected columns 'task' (or a pandas index) and 'task_index', got {names}")
    pairs = sorted(zip(table.column(TASK_INDEX).to_pylist(), table.column(text_col).to_pylist()))
    if [i for i, _ in pairs] != list(range(len(pairs))):
        raise ValueError(f"{path}: task_index must be 0..{len(pairs) - 1}")
    return [str(t) for _, t in pairs]


def pooled_stats(path: Path, added: pa.Table, frames_stored: int) -> dict[str, dict[str, list]] | None:
    """The stats.json at ``path`` pooled with the ``added`` episodes-table rows' stats (the
    dataset now holds ``frames_stored`` frames, theirs included); None when that file does not
    describe exactly the frames stored before them (its state count says how many)."""
    before = frames_stored - int(np.sum(added.column(META_LENGTH).to_numpy()))
    if before == 0:
        return stats_from_episodes_meta(added)
    if not path.exists():
        return None
    old = json.loads(path.read_text())
    if old.get(STATE, {}).get("count") != [before]:
        return None
    new = stats_from_episodes_meta(added)
    return {f: _pool(old.get(f), new.get(f)) for f in sorted(set(old) | set(new))}


def _pool(old: dict[str, list] | None, new: dict[str, list] | None) -> dict[str, list] | None:
    """One feature's stats over two disjoint sets of frames (either may be absent)."""
    if old is None or new is None:
        return old or new
    stacked = {stat: np.stack([np.asarray(old[stat], np.float64), np.asarray(new[stat], np.float64)])
               for stat in STAT_NAMES}
    return {k: v.tolist() for k, v in aggregate_stats(stacked).items()}
