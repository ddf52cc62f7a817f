"""The episode dataset on disk, in the LeRobot v3 layout, plus our episode-level columns.

```
root/
  meta/info.json                              features, fps, totals, path templates
  meta/episodes/chunk-XXX/file-XXX.parquet    one row per episode; one new file per ingest (its commit point;
                                              the newest small ones are merged: meta_files.py)
  meta/tasks.parquet                          task string <-> task_index
  meta/stats.json                             per-feature min/max/mean/std/count
  data/chunk-XXX/file-XXX.parquet             frames; one new file per ingest that adds episodes
  videos/<key>/chunk-XXX/file-XXX.mp4         camera streams: encoded on ingest (video.py), several
                                              episodes per file, or carried whole from LeRobot imports
```

Writes are ordered so a crash loses nothing already stored: new data/video files first (new
names, temp + ``os.replace``), then tasks, info and stats, and last the ingest's own episodes-table
file (meta_files.py), whose appearance is the single commit point. Files not referenced by the
episodes table are invisible and simply overwritten by the next ingest; totals and stats are
re-derived from the episodes table on open if they disagree with it. One writer at a time (an
``flock`` on ``root/.fleetloop.lock``). Every write costs what the batch costs: only the new
episodes' rows are written, stats.json is pooled from the last one plus the batch, and a process
rereads only the episodes-table files it has not seen.
"""

from __future__ import annotations

import dataclasses
import fcntl
import hashlib
import json
import re
import shutil
from collections import Counter
from collections.abc import Callable, Iterator, Mapping, Sequence, Set
from concurrent.futures import Future, ThreadPoolExecutor, wait
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from components.config import EpisodesConfig
from components.episodes.data_files import (
    DATA_PATH,
    TMP_SUFFIX,
    describe,
    plan_data_merge,
    read_data_file,
    supersede,
    sweep,
    unreferenced,
    write_merged,
)
from components.episodes.fingerprint import (
    combine_fingerprints,
    table_fingerprint,
    table_fingerprints,
)
from components.episodes.meta_files import (
    MetaFile,
    dedupe_episodes,
    list_meta_files,
    meta_file_path,
    next_meta_number,
    read_episodes_table,
    read_meta_file,
    tail_to_merge,
)
from components.episodes.quarantine import (
    QuarantinedFile,
    quarantine_bytes,
    quarantine_file,
)
from components.episodes.record import Episode
from components.episodes.schema import (  # noqa: F401 - the bookkeeping names are re-exported
    ACTION,
    BOOKKEEPING_COLUMNS,
    CONTRACT_COLUMNS,
    EPISODE_ID,
    EPISODE_INDEX,
    FRAME_INDEX,
    INDEX,
    INTERRUPTED,
    POLICY_VERSION,
    ROBOT_ID,
    STATE,
    SUCCESS,
    TASK,
    TASK_INDEX,
    TIMESTAMP,
    episode_to_table,
    list_column_to_numpy,
    read_episode_file,
    table_to_episode,
    table_to_episodes,
)
from components.episodes.stats import (
    STAT_NAMES,
    aggregate_stats,
    column_values,
    feature_stats,
    parse_stats_column,
    span_stats,
    stats_column,
    stats_from_episodes_meta,
)
from components.episodes.validation import (
    WHOLE_FILE,
    EpisodeValidationError,
    ValidatedBatch,
    check_upload_columns,
    validate_episode_batch,
    validate_episode_table,
)
from components.episodes.video import (
    EpisodeSpan,
    VideoReader,
    encode_episodes,
    episode_frames,
    video_feature,
    video_info,
)
from components.episodes.video_validation import CameraStream, validate_camera_streams
from components.fsio import atomic_path, atomic_write_bytes

INFO_PATH = "meta/info.json"
STATS_PATH = "meta/stats.json"
TASKS_PATH = "meta/tasks.parquet"
EPISODES_META_PATH = "meta/episodes/chunk-000/file-000.parquet"  # the first file (exports write one)
CHUNK_FILE_PATTERN = "chunk-{chunk_index:03d}/file-{file_index:03d}"
VIDEO_PATH = "videos/{video_key}/" + CHUNK_FILE_PATTERN + ".mp4"
LOCK_NAME = ".fleetloop.lock"
FPS_TOLERANCE = 1e-6  # fps are compared as floats (info.json may hold 30 or 30.0)
# LeRobot's default, written to info.json for readers that expect it.
VIDEO_FILES_SIZE_IN_MB = 500
VIDEO_READERS_KEPT = 8  # open video files a dataset keeps (camera_frames)

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
_VIDEO_LOCATION = re.compile(r"^videos/(?P<key>.+)/(?P<what>chunk_index|file_index)$")

_EPISODE_LEVEL_STORED = (EPISODE_ID, ROBOT_ID, POLICY_VERSION, SUCCESS, INTERRUPTED)
_ARROW_DTYPE_NAMES = {"float": "float32", "double": "float64", "halffloat": "float16"}


def video_location_column(key: str, what: str) -> str:
    """``videos/<key>/chunk_index`` or ``videos/<key>/file_index`` (LeRobot v3 episodes table)."""
    return f"videos/{key}/{what}"


def is_location_column(name: str) -> bool:
    """Episodes-table columns that say where something is stored, not what it is."""
    return name in OWN_META_COLUMNS or bool(_VIDEO_LOCATION.match(name))


@dataclass(frozen=True)
class IngestReport:
    """What one ingest did. Every input is accounted for: added, duplicate or quarantined."""

    added: tuple[str, ...] = ()
    duplicates: tuple[str, ...] = ()
    quarantined: tuple[QuarantinedFile, ...] = ()
    frames_added: int = 0
    data_file: Path | None = None

    @property
    def changed(self) -> bool:
        return bool(self.added)

    def summary(self) -> str:
        return (
            f"{len(self.added)} added ({self.frames_added} frames), "
            f"{len(self.duplicates)} duplicates skipped, {len(self.quarantined)} quarantined"
        )


class DatasetMismatchError(ValueError):
    """An import whose dataset-level layout (fps, state/action shape) differs from the stored
    episodes'. One line: the dataset, the field, both values and the fix."""

    def __init__(self, root: Path, field_name: str, ours: Any, theirs: Any, fix: str) -> None:
        self.root, self.field, self.ours, self.theirs, self.fix = Path(root), field_name, ours, theirs, fix
        super().__init__(f"{root}: {field_name} {theirs} differs from the dataset's {ours}. Fix: {fix}")


@dataclass(frozen=True)
class SourceLayout:
    """Dataset-level properties an import brings (a LeRobot ``info.json``): an empty dataset
    adopts them, a non-empty one refuses a different fps or state/action shape. A different
    ``robot_type`` is kept out of a non-empty dataset's info.json (its episodes keep their
    ``robot_id``) rather than refused, as fleet and imported episodes may share a dataset."""

    fps: float
    robot_type: str | None = None
    shapes: Mapping[str, tuple[int, ...]] = field(default_factory=dict)  # STATE / ACTION only


MISMATCH_FIX = "import into an empty dataset root (set FLEETLOOP_ROOT to a new folder), which adopts the source's {what}"


@dataclass(frozen=True)
class IncomingEpisode:
    """One episode offered to the dataset, before validation.

    ``origin`` is the file it came from (moved to quarantine if rejected); ``None`` for bytes or
    in-memory episodes (their table is written to quarantine instead). ``meta_extra`` is one row
    of carried episode-level meta (e.g. LeRobot ``videos/<key>/from_timestamp``); ``videos`` maps
    a video key to the source mp4 file holding this episode's frames (carried whole, imports);
    ``features`` gives the info.json entries of extra columns and videos. ``cameras`` maps a
    camera key to this episode's frames (uint8 (T, H, W, 3), or a video file of one episode):
    validated against the table (video_validation.py) and encoded on store (video.py).
    """

    table: pa.Table
    source: str
    origin: Path | None = None
    meta_extra: pa.Table | None = None
    videos: Mapping[str, Path] = field(default_factory=dict)
    features: Mapping[str, dict[str, Any]] = field(default_factory=dict)
    cameras: Mapping[str, CameraStream] = field(default_factory=dict)


@dataclass(frozen=True)
class _Staged:
    incoming: IncomingEpisode
    episode: Episode
    table: pa.Table  # canonical: contract columns (fixed-size vectors) + extra frame columns
    content_hash: str
    cameras: Mapping[str, np.ndarray] = field(default_factory=dict)  # checked frames, to encode


@dataclass(frozen=True)
class _EncodedCamera:
    """One camera key of an ingest: the video file its episodes went to and each one's span."""

    slot: tuple[int, int]  # (chunk_index, file_index)
    spans: dict[int, EpisodeSpan]  # position in the batch -> where that episode lies in the file
    feature: dict[str, Any]  # the info.json entry


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


def _atomic_write_bytes(path: Path, data: bytes) -> None:
    atomic_write_bytes(path, data, tmp_name=path.name + TMP_SUFFIX)


def _atomic_write_parquet(path: Path, table: pa.Table, compression: str) -> None:
    with atomic_path(path, tmp_name=path.name + TMP_SUFFIX) as tmp:
        pq.write_table(table, tmp, compression=compression)


def _atomic_copy(src: Path, dst: Path) -> None:
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


class EpisodeDataset:
    """Episodes stored in the LeRobot v3 layout under ``root``; ingest is validated and idempotent."""

    def __init__(self, root: Path, cfg: EpisodesConfig) -> None:
        self.root = Path(root)
        self.cfg = cfg
        self._meta: pa.Table | None = None
        self._facts: tuple[pa.Table, int, bool] | None = None  # (_meta, its frames, in episode order)
        self._tasks: list[str] = []
        self._info: dict[str, Any] | None = None
        self._readers: dict[Path, VideoReader] = {}  # open video files, least recently used first
        self._encodings: list[Future] = []  # background video encodes of the ingest under way
        self._timestamps: tuple[tuple[int, int], np.ndarray, np.ndarray] | None = None  # last data file's
        self._rows_of: tuple[pa.Table, dict[int, int]] | None = None  # episode_index -> row of _meta
        self._load()

    # ---------------------------------------------------------------- reading the layout

    def _load(self) -> None:
        info_path = self.root / INFO_PATH
        self._info = json.loads(info_path.read_text()) if info_path.exists() else None
        self._meta = read_episodes_table(self.root, EPISODE_INDEX)
        tasks_path = self.root / TASKS_PATH
        self._tasks = read_tasks(tasks_path) if tasks_path.exists() else []

    def refresh(self) -> None:
        """Re-read the layout: a long-lived handle sees what other writers committed since."""
        self._load()

    def _derived_meta_stale(self) -> bool:
        """True after a crash between the commit point and the info/stats rewrite."""
        return (
            self._meta is not None
            and self._info is not None
            and (
                self._info.get("total_episodes") != self._meta.num_rows
                or self._info.get("total_frames") != self.num_frames
            )
        )

    @property
    def fps(self) -> float:
        return float(self._info["fps"]) if self._info else self.cfg.fps

    @property
    def chunk_size(self) -> int:
        return int(self._info["chunks_size"]) if self._info else self.cfg.chunk_size

    @property
    def features(self) -> dict[str, dict[str, Any]]:
        return dict(self._info["features"]) if self._info else {}

    @property
    def state_dim(self) -> int | None:
        feature = self.features.get(STATE)
        return int(feature["shape"][0]) if feature else None

    @property
    def action_dim(self) -> int | None:
        feature = self.features.get(ACTION)
        return int(feature["shape"][0]) if feature else None

    @property
    def num_episodes(self) -> int:
        return 0 if self._meta is None else self._meta.num_rows

    @property
    def num_frames(self) -> int:
        if self._meta is None or self._meta.num_rows == 0:
            return 0
        return self._meta_facts()[0]

    def _meta_facts(self) -> tuple[int, bool]:
        """(frames stored, whether the episodes table is in episode_index order), worked out once
        per episodes table: each is a pass over every stored episode, and an ingest asks often."""
        assert self._meta is not None
        if self._facts is None or self._facts[0] is not self._meta:
            index = self._meta.column(EPISODE_INDEX).to_numpy()
            frames = int(np.sum(self._meta.column(META_LENGTH).to_numpy()))
            self._facts = (self._meta, frames, bool((np.diff(index) > 0).all()))
        return self._facts[1], self._facts[2]

    @property
    def tasks(self) -> list[str]:
        return list(self._tasks)

    def info(self) -> dict[str, Any]:
        """``meta/info.json`` content, totals derived from the episodes table."""
        info = json.loads(json.dumps(self._info or self._new_info()))
        info.update(
            total_episodes=self.num_episodes,
            total_frames=self.num_frames,
            total_tasks=len(self._tasks),
            splits={"train": f"0:{self.num_episodes}"},
        )
        return info

    def episodes_meta(self) -> pa.Table | None:
        """The full episodes table as stored (with per-episode ``stats/*`` columns)."""
        return self._meta

    def episode_index(self) -> pa.Table:
        """One row per episode: LeRobot episodes columns + ours (stats columns left out)."""
        if self._meta is None:
            return pa.table({EPISODE_INDEX: pa.array([], pa.int64()), EPISODE_ID: pa.array([], pa.string())})
        keep = [n for n in self._meta.column_names if parse_stats_column(n) is None]
        return self._meta.select(keep)

    def episode_ids(self, start: int = 0, stop: int | None = None) -> list[str]:
        """Episode ids in episode_index order (a slice of it), from the episodes table alone."""
        if self._meta is None:
            return []
        return self.episode_rows(start, stop).column(EPISODE_ID).to_pylist()

    def episode_rows(self, start: int = 0, stop: int | None = None) -> pa.Table:
        """Rows ``start:stop`` of the episodes table in episode_index order: a zero-copy slice,
        as the table is stored in that order (a take on a table of another origin). What a
        consumer following the ingest reads of the new episodes, at a cost that does not grow
        with the episodes before ``start``."""
        if self._meta is None:
            return self.episode_index()
        picked = range(self._meta.num_rows)[start:stop]
        if self._meta_facts()[1]:
            return self._meta.slice(picked.start, len(picked))
        index = self._meta.column(EPISODE_INDEX).to_numpy()
        return self._meta.take(pa.array(np.argsort(index, kind="stable")[start:stop], pa.int64()))

    def robots(self) -> dict[str, int]:
        """Episodes per robot id."""
        if self._meta is None:
            return {}
        return dict(sorted(Counter(self._meta.column(ROBOT_ID).to_pylist()).items()))

    def content_hash(self) -> str:
        """A stable hash of everything stored: episode ids and their content hashes, in order."""
        if self._meta is None:
            return combine_fingerprints([])
        ids = self._meta.column(EPISODE_ID).to_pylist()
        hashes = self._meta.column(META_CONTENT_HASH).to_pylist()
        return combine_fingerprints([f"{i}:{h}" for i, h in zip(ids, hashes)])

    def data_files(self) -> list[Path]:
        """The data files the episodes table references, in order."""
        return [self.root / DATA_PATH.format(chunk_index=c, file_index=f) for c, f in self._file_keys()]

    def _file_keys(self) -> list[tuple[int, int]]:
        if self._meta is None:
            return []
        chunks = self._meta.column(META_DATA_CHUNK).to_numpy()
        files = self._meta.column(META_DATA_FILE).to_numpy()
        pairs = np.unique(np.stack([chunks, files], axis=1), axis=0)
        return [(int(c), int(f)) for c, f in pairs]

    def _with_task(self, table: pa.Table) -> pa.Table:
        task_index = table.column(TASK_INDEX).to_numpy()
        names = np.asarray(self._tasks, dtype=object)
        return table.append_column(TASK, pa.array(names[task_index] if len(task_index) else [], pa.string()))

    def frames(self, start: int = 0, stop: int | None = None) -> pa.Table:
        """Stored frames (LeRobot columns, ours, extras) with the ``task`` string joined in: all
        of them, or those of episodes ``start:stop`` in episode_index order."""
        tables = list(self.frame_batches(start, stop))
        if not tables:
            return pa.table({})
        return pa.concat_tables(tables, promote_options="permissive")

    def frame_batches(self, start: int = 0, stop: int | None = None) -> Iterator[pa.Table]:
        """The frames of episodes ``start:stop`` (episode_index order), one table per data file,
        reading only the files that hold them: a streaming reader whose cost follows the slice.

        A consumer that follows the ingest keeps a cursor (the number of episodes it has seen)
        and reads ``frame_batches(start=cursor)``; ``episodes(start=cursor)`` does the same per
        episode.
        """
        if self._meta is None:
            return
        meta = self.episode_rows(start, stop)
        if meta.num_rows == 0:
            return
        keys = list(zip(meta.column(META_DATA_CHUNK).to_pylist(), meta.column(META_DATA_FILE).to_pylist()))
        wanted = set(meta.column(EPISODE_INDEX).to_pylist())
        for key in dict.fromkeys(keys):  # files in the order their episodes come
            table = read_data_file(self.root, key)
            index = table.column(EPISODE_INDEX).to_numpy()
            keep = np.isin(index, np.fromiter(wanted, dtype=np.int64, count=len(wanted)))
            yield self._with_task(table if keep.all() else table.filter(pa.array(keep)))

    def episodes(self, start: int = 0, stop: int | None = None) -> Iterator[Episode]:
        """Stored episodes in episode_index order; ``start``/``stop`` pick a slice of that order
        without reading or decoding the episodes before it (a consumer following the ingest)."""
        if self._meta is None:
            return
        meta = self.episode_rows(start, stop)
        keys = list(zip(meta.column(META_DATA_CHUNK).to_pylist(), meta.column(META_DATA_FILE).to_pylist()))
        starts = meta.column(META_FROM).to_pylist()
        lengths = meta.column(META_LENGTH).to_pylist()
        loaded: tuple[tuple[int, int], pa.Table] | None = None
        for run in _adjacent_runs(keys, starts, lengths):
            if loaded is None or loaded[0] != keys[run[0]]:
                loaded = (keys[run[0]], read_data_file(self.root, keys[run[0]]))
            data = loaded[1]
            first_index = data.column(INDEX)[0].as_py()
            rows = data.slice(starts[run[0]] - first_index, sum(lengths[i] for i in run))
            rows = self._with_task(rows).drop_columns(list(BOOKKEEPING_COLUMNS))
            yield from table_to_episodes(rows, [lengths[i] for i in run])

    def episode_columns(self, episode_indices: Sequence[int], columns: Sequence[str]) -> dict[str, np.ndarray]:
        """Frame ``columns`` of the listed episodes (``episode_index`` values), concatenated in the
        order listed, as float32 arrays ((T, d) for list columns, as ``Episode`` holds them).

        Each data file holding one of them is read once, and only these columns of it: what a
        training set is built from, without decoding whole episodes or holding more than one
        file besides the result.
        """
        spans = self._spans(episode_indices)
        bounds = np.concatenate([[0], np.cumsum([span.length for span in spans])]).astype(np.int64)
        out: dict[str, np.ndarray] = {}
        for key, wanted in _spans_by_file(spans):
            table = read_data_file(self.root, key, [INDEX, *columns])
            first = table.column(INDEX)[0].as_py()
            for name in columns:
                values = _float32_frames(table.column(name))
                if name not in out:
                    out[name] = np.empty((int(bounds[-1]), *values.shape[1:]), np.float32)
                for order, span in wanted:
                    rows = values[span.start - first : span.start - first + span.length]
                    out[name][bounds[order] : bounds[order + 1]] = rows
        return out

    @property
    def camera_keys(self) -> tuple[str, ...]:
        """The features stored as video (camera streams), in info.json order."""
        return tuple(k for k, f in self.features.items() if f.get("dtype") == "video")

    def camera_frames(self, episode_index: int, keys: Sequence[str] | None = None) -> dict[str, np.ndarray]:
        """An episode's camera frames, (T, H, W, 3) uint8 per key (default: every camera it has),
        decoded at its table's timestamps as LeRobot reads them (video.py: from_timestamp +
        timestamp, nearest frame within 1 / fps - 1e-4 s)."""
        row = self._spans_rows([episode_index])
        timestamps = self._episode_timestamps(row)
        out: dict[str, np.ndarray] = {}
        for key in self.camera_keys if keys is None else keys:
            location = [video_location_column(key, w) for w in ("chunk_index", "file_index", "from_timestamp")]
            if any(name not in row.column_names for name in location):
                if keys is None:
                    continue
                raise KeyError(f"{self.root}: no camera {key!r} (cameras: {list(self.camera_keys)})")
            chunk, file, start = (row.column(name)[0].as_py() for name in location)
            if chunk is None:  # this episode has no stream for that camera
                continue
            path = self.root / VIDEO_PATH.format(video_key=key, chunk_index=chunk, file_index=file)
            span = EpisodeSpan(float(start), float(start) + len(timestamps) / self.fps)
            out[key] = episode_frames(self._video_reader(path), span, timestamps, self.fps)
        return out

    def _episode_timestamps(self, row: pa.Table) -> np.ndarray:
        """An episode's ``timestamp`` column (its episodes-table ``row``); the last data file's
        column is kept, so walking a file's episodes reads it once."""
        key = (row.column(META_DATA_CHUNK)[0].as_py(), row.column(META_DATA_FILE)[0].as_py())
        if self._timestamps is None or self._timestamps[0] != key:
            table = read_data_file(self.root, key, [INDEX, TIMESTAMP])
            self._timestamps = (key, table.column(INDEX).to_numpy(), table.column(TIMESTAMP).to_numpy())
        _, index, times = self._timestamps
        start = int(row.column(META_FROM)[0].as_py()) - int(index[0])
        return times[start : start + int(row.column(META_LENGTH)[0].as_py())]

    def _video_reader(self, path: Path) -> VideoReader:
        """An open reader per video file, the most recently used ``VIDEO_READERS_KEPT`` kept (one
        per camera is what walking the episodes in order needs)."""
        reader = self._readers.pop(path, None) or VideoReader(path)
        self._readers[path] = reader
        while len(self._readers) > VIDEO_READERS_KEPT:
            self._readers.pop(next(iter(self._readers))).close()
        return reader

    def load_episodes(self, episode_indices: Sequence[int], cameras: bool = False) -> list[Episode]:
        """The listed episodes (``episode_index`` values) in the order listed; each data file that
        holds one of them is read once. For the few episodes a consumer needs whole.
        ``cameras``: with their camera frames decoded (``camera_frames``)."""
        if cameras:
            return [dataclasses.replace(ep, cameras=self.camera_frames(i))
                    for i, ep in zip(episode_indices, self.load_episodes(episode_indices))]
        spans = self._spans(episode_indices)
        out: list[Episode | None] = [None] * len(spans)
        for key, wanted in _spans_by_file(spans):
            table = read_data_file(self.root, key)
            first = table.column(INDEX)[0].as_py()
            for order, span in wanted:
                rows = table.slice(span.start - first, span.length)
                out[order] = table_to_episode(self._with_task(rows).drop_columns(list(BOOKKEEPING_COLUMNS)))
        return [episode for episode in out if episode is not None]

    def _spans_rows(self, episode_indices: Sequence[int]) -> pa.Table:
        """The episodes-table rows of the listed episodes, in the order listed."""
        if not len(episode_indices):
            raise ValueError("no episodes listed to read")
        if self._meta is None:
            raise KeyError(f"episode_index {list(episode_indices)[:5]} not in {self.root}: it holds no episodes")
        if self._rows_of is None or self._rows_of[0] is not self._meta:
            self._rows_of = (self._meta, {int(i): row for row, i in enumerate(self._meta.column(EPISODE_INDEX).to_numpy())})
        where = self._rows_of[1]
        missing = [int(i) for i in episode_indices if int(i) not in where]
        if missing:
            raise KeyError(f"episode_index {missing[:5]} not in {self.root} (refresh() after another writer's ingest?)")
        return self._meta.take(pa.array([where[int(i)] for i in episode_indices], pa.int64()))

    def _spans(self, episode_indices: Sequence[int]) -> list[_Span]:
        rows = self._spans_rows(episode_indices)
        return [
            _Span((chunk, file), start, length)
            for chunk, file, start, length in zip(
                rows.column(META_DATA_CHUNK).to_pylist(), rows.column(META_DATA_FILE).to_pylist(),
                rows.column(META_FROM).to_pylist(), rows.column(META_LENGTH).to_pylist(), strict=True,
            )
        ]

    # ---------------------------------------------------------------- ingest

    @contextmanager
    def _writer(self) -> Iterator[None]:
        self.root.mkdir(parents=True, exist_ok=True)
        with open(self.root / LOCK_NAME, "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            try:
                self._load()  # another writer may have committed since we last looked
                if self._derived_meta_stale():
                    self._write_derived_meta()
                yield
            finally:
                for encoding in self._encodings:  # an ingest that failed midway: no encoder outlives the lock
                    wait([encoding])
                self._encodings = []
                fcntl.flock(lock, fcntl.LOCK_UN)

    def ingest(
        self, paths: list[Path], known_robots: Set[str] | None, quarantine_dir: Path
    ) -> IngestReport:
        """Validate and store episode files (Parquet or Arrow IPC stream, one episode each).

        Bad files move to ``quarantine_dir`` with a reason file; the good ones of the batch are
        still stored. Episodes already stored with identical content are skipped.
        """
        incoming: list[IncomingEpisode] = []
        quarantined: list[QuarantinedFile] = []
        for path in map(Path, paths):
            item = read_incoming(path, quarantine_dir)
            (incoming if isinstance(item, IncomingEpisode) else quarantined).append(item)
        report = self.ingest_tables(incoming, known_robots, quarantine_dir)
        return dataclasses.replace(report, quarantined=tuple(quarantined) + report.quarantined)

    def add_episodes(
        self,
        episodes: list[Episode],
        known_robots: Set[str] | None = None,
        quarantine_dir: Path | None = None,
    ) -> IngestReport:
        """Store in-memory episodes, validated like files. Without ``quarantine_dir`` a bad
        episode raises ``EpisodeValidationError`` and nothing is stored."""
        incoming = []
        for ep in episodes:
            source = f"episode {ep.episode_id}"
            try:
                table = episode_to_table(ep)
            except (ValueError, pa.ArrowInvalid) as exc:
                raise EpisodeValidationError(
                    source, WHOLE_FILE, str(exc), "give states/actions as (frames, dim) float32 arrays"
                ) from exc
            incoming.append(IncomingEpisode(table=table, source=source, cameras=ep.cameras))
        return self.ingest_tables(incoming, known_robots, quarantine_dir)

    def ingest_tables(
        self,
        incoming: list[IncomingEpisode],
        known_robots: Set[str] | None,
        quarantine_dir: Path | None,
        layout: SourceLayout | None = None,
    ) -> IngestReport:
        """The one ingest path: validate, dedupe by episode_id + content, store in one new file.

        ``layout`` (imports): checked under the writer lock, so "empty" cannot change between
        the check and the store; raises ``DatasetMismatchError`` before anything is written.
        """
        with self._writer():
            base_info = self._adopt(layout)
            staged, quarantined = self._stage(incoming, known_robots, quarantine_dir, fresh=base_info is not None)
            stored = self._stored_hashes([item.episode.episode_id for item in staged])
            new: list[_Staged] = []
            duplicates: list[str] = []
            for item in staged:
                episode_id = item.episode.episode_id
                known = stored.get(episode_id)
                if known is None:
                    stored[episode_id] = item.content_hash
                    new.append(item)
                elif known == item.content_hash:
                    duplicates.append(episode_id)
                else:
                    error = EpisodeValidationError(
                        item.incoming.source,
                        EPISODE_ID,
                        f"episode {episode_id} is already stored with different content",
                        "give a re-recorded or edited episode a new uuid4 episode_id",
                    )
                    quarantined.append(self._reject(item.incoming, error, quarantine_dir))
            if not new:
                return IngestReport(duplicates=tuple(duplicates), quarantined=tuple(quarantined))
            data_file = self._store(new, base_info)
            return IngestReport(
                added=tuple(s.episode.episode_id for s in new),
                duplicates=tuple(duplicates),
                quarantined=tuple(quarantined),
                frames_added=sum(s.episode.length for s in new),
                data_file=data_file,
            )

    def _adopt(self, layout: SourceLayout | None) -> dict[str, Any] | None:
        """The info.json an empty dataset starts from when ``layout`` is given (fps, robot type
        and state/action shapes of the source); for a non-empty one, None after checking that
        the layout matches what is stored."""
        if layout is None:
            return None
        if self.num_episodes == 0:  # a crashed first ingest may have left an info.json: start afresh
            return self._new_info(fps=layout.fps, robot_type=layout.robot_type)
        if abs(layout.fps - self.fps) > FPS_TOLERANCE:
            raise DatasetMismatchError(
                self.root, "fps", f"{self.fps:g}", f"{layout.fps:g}",
                MISMATCH_FIX.format(what="fps") + f", or resample the source to {self.fps:g} fps",
            )
        stored = {STATE: self.state_dim, ACTION: self.action_dim}
        for name, shape in sorted(layout.shapes.items()):
            ours = stored.get(name)
            if ours is not None and tuple(shape) != (ours,):
                raise DatasetMismatchError(
                    self.root, f"{name} shape", [ours], list(shape), MISMATCH_FIX.format(what=f"{name} shape"),
                )
        return None

    def _stage(
        self,
        incoming: list[IncomingEpisode],
        known_robots: Set[str] | None,
        quarantine_dir: Path | None,
        fresh: bool = False,
    ) -> tuple[list[_Staged], list[QuarantinedFile]]:
        """Validate; ``fresh``: the batch starts a new info.json, so no stored shapes apply."""
        state_dim, action_dim = (None, None) if fresh else (self.state_dim, self.action_dim)
        staged: list[_Staged] = []
        errors: list[tuple[IncomingEpisode, EpisodeValidationError]] = []
        tables = [i.table.drop_columns([c for c in BOOKKEEPING_COLUMNS if c in i.table.column_names]) for i in incoming]
        for run in _schema_runs(tables):
            batch = validate_episode_batch([tables[i] for i in run], known_robots, state_dim, action_dim)
            if batch is not None:  # all of them pass: checked and canonicalised together
                staged.extend(_stage_batch([incoming[i] for i in run], batch))
                state_dim, action_dim = batch.episodes[0].states.shape[1], batch.episodes[0].actions.shape[1]
                continue
            for i in run:  # one by one, so each rejection names its own file and field
                try:
                    episode = validate_episode_table(tables[i], known_robots, state_dim, action_dim, incoming[i].source)
                except EpisodeValidationError as error:
                    errors.append((incoming[i], error))
                    continue
                state_dim, action_dim = episode.states.shape[1], episode.actions.shape[1]
                staged.append(_stage_one(incoming[i], episode, tables[i]))
        staged = self._with_cameras(staged, errors, fresh)
        if errors and quarantine_dir is None:
            raise errors[0][1]
        return staged, [self._reject(item, error, quarantine_dir) for item, error in errors]

    def _with_cameras(self, staged: list[_Staged], errors: list[tuple[IncomingEpisode, EpisodeValidationError]],
                      fresh: bool) -> list[_Staged]:
        """The staged episodes with their camera frames checked (video_validation.py) and in their
        content hash; those that fail join ``errors``. The dataset's resolution per camera is
        that of its info.json, else the batch's first episode with that camera."""
        resolutions = {} if fresh else {k: tuple(f["shape"][:2]) for k, f in self.features.items() if f.get("dtype") == "video"}
        kept: list[_Staged] = []
        for item in staged:
            if not item.incoming.cameras:
                kept.append(item)
                continue
            try:
                frames = validate_camera_streams(item.incoming.cameras, item.episode, self.fps, resolutions, item.incoming.source)
            except EpisodeValidationError as error:
                errors.append((item.incoming, error))
                continue
            for key, images in frames.items():
                resolutions.setdefault(key, tuple(images.shape[1:3]))
            kept.append(dataclasses.replace(item, cameras=frames, content_hash=_camera_hash(item.content_hash, frames)))
        return kept

    @staticmethod
    def _reject(
        item: IncomingEpisode, error: EpisodeValidationError, quarantine_dir: Path | None
    ) -> QuarantinedFile:
        if quarantine_dir is None:
            raise error
        if item.origin is not None:
            return quarantine_file(item.origin, error, quarantine_dir)
        sink = pa.BufferOutputStream()
        pq.write_table(item.table, sink)
        name = re.sub(r"[^A-Za-z0-9._-]", "_", item.source) + ".parquet"
        return quarantine_bytes(sink.getvalue().to_pybytes(), name, error, quarantine_dir)

    def _stored_hashes(self, episode_ids: list[str]) -> dict[str, str]:
        """Content hashes of those of ``episode_ids`` already stored (one vectorised lookup)."""
        if self._meta is None or not episode_ids:
            return {}
        wanted = pa.array(episode_ids, pa.string())
        mask = pc.is_in(self._meta.column(EPISODE_ID), value_set=wanted)
        found = self._meta.select([EPISODE_ID, META_CONTENT_HASH]).filter(mask)
        return dict(zip(found.column(EPISODE_ID).to_pylist(), found.column(META_CONTENT_HASH).to_pylist()))

    def _next_file_number(self) -> int:
        if self._meta is None or self._meta.num_rows == 0:
            return 0
        chunks = self._meta.column(META_DATA_CHUNK).to_numpy()
        files = self._meta.column(META_DATA_FILE).to_numpy()
        return int((chunks * self.chunk_size + files).max()) + 1

    def _next_video_numbers(self) -> dict[str, int]:
        out: dict[str, int] = {}
        if self._meta is None:
            return out
        for name in self._meta.column_names:
            match = _VIDEO_LOCATION.match(name)
            if not match or match["what"] != "chunk_index":
                continue
            key = match["key"]
            chunks = self._meta.column(name).to_pylist()
            files = self._meta.column(video_location_column(key, "file_index")).to_pylist()
            numbers = [c * self.chunk_size + f for c, f in zip(chunks, files) if c is not None and f is not None]
            out[key] = max(numbers) + 1 if numbers else 0
        return out

    def _store(self, new: list[_Staged], base_info: dict[str, Any] | None = None) -> Path:
        """Write one data file (+ copied videos), then tasks, info, stats, and commit the meta.
        ``base_info``: the info.json an empty dataset adopts from an import's source."""
        info = base_info or self._info or self._new_info()
        chunk_size = int(info["chunks_size"])
        data_chunk, data_file = divmod(self._next_file_number(), chunk_size)
        next_video = self._next_video_numbers()
        encoding = self._start_encoding(new, next_video, chunk_size, float(info["fps"]))
        video_slots: dict[tuple[str, Path], tuple[int, int]] = {}
        tasks = list(self._tasks)
        task_of = {t: i for i, t in enumerate(tasks)}
        episode_index, frame_index = self.num_episodes, self.num_frames
        meta_number = next_meta_number(list_meta_files(self.root), chunk_size)
        meta_chunk, meta_file = divmod(meta_number, chunk_size)
        features = dict(info["features"])
        data_tables: list[pa.Table] = []
        extra_rows: list[dict[str, pa.Array]] = []  # carried meta and video locations, per episode
        for item in new:
            ep = item.episode
            if ep.task not in task_of:
                task_of[ep.task] = len(tasks)
                tasks.append(ep.task)
            data = _data_table(item.table, episode_index, frame_index, task_of[ep.task])
            for name in data.column_names:
                if name not in features:
                    features[name] = dict(
                        item.incoming.features.get(name)
                        or infer_feature(data.schema.field(name).type, data.column(name)[0].as_py())
                    )
            extras: dict[str, pa.Array] = {}
            if item.incoming.meta_extra is not None:
                for name in item.incoming.meta_extra.column_names:
                    if name not in OWN_META_COLUMNS and not is_location_column(name):
                        extras[name] = item.incoming.meta_extra.column(name).combine_chunks()
            for key, src in sorted(item.incoming.videos.items()):
                slot = video_slots.get((key, Path(src)))
                if slot is None:
                    number = next_video.get(key, 0)
                    next_video[key] = number + 1
                    slot = divmod(number, chunk_size)
                    video_slots[(key, Path(src))] = slot
                    features.setdefault(key, dict(item.incoming.features.get(key) or {"dtype": "video"}))
                extras[video_location_column(key, "chunk_index")] = pa.array([slot[0]], pa.int64())
                extras[video_location_column(key, "file_index")] = pa.array([slot[1]], pa.int64())
            extra_rows.append(extras)
            data_tables.append(data)
            episode_index += 1
            frame_index += ep.length

        path = self.root / DATA_PATH.format(chunk_index=data_chunk, file_index=data_file)
        written = pa.concat_tables(data_tables, promote_options="permissive")
        _atomic_write_parquet(path, written, self.cfg.compression)
        for (key, src), (chunk, number) in sorted(video_slots.items()):
            _atomic_copy(src, self.root / VIDEO_PATH.format(video_key=key, chunk_index=chunk, file_index=number))
        _atomic_write_parquet(self.root / TASKS_PATH, tasks_table(tasks), self.cfg.compression)
        for key, encoded in encoding.result().items():  # the videos are written before the commit
            features[key] = encoded.feature
            for position, span in encoded.spans.items():
                extra_rows[position].update(_camera_location(key, encoded.slot, span))
        lengths = [t.num_rows for t in data_tables]
        added = _meta_rows(new, lengths, self.num_episodes, self.num_frames, (data_chunk, data_file),
                           (meta_chunk, meta_file), extra_rows)
        added = _with_stats(added, written, lengths)
        previous = [self._meta] if self._meta is not None else []
        self._info = {**info, "features": features}
        if video_slots or any(item.cameras for item in new):
            self._info["video_path"] = VIDEO_PATH
        self._tasks = tasks
        self._meta = pa.concat_tables(previous + [added], promote_options="permissive")
        self._write_derived_meta(added)
        _atomic_write_parquet(meta_file_path(self.root, meta_number, chunk_size), added, self.cfg.compression)  # commit
        self._merge_meta_tail()
        return path

    def _start_encoding(self, new: list[_Staged], next_video: dict[str, int], chunk_size: int,
                        fps: float) -> Future[dict[str, _EncodedCamera]]:
        """Encode the batch's camera streams, one new video file per camera key holding all its
        episodes (their numbers taken from ``next_video``). ``episodes.video.encode``:
        "background" encodes in a thread while the data file and tasks are written (the caller
        joins before the commit); "inline" encodes now."""
        keys = sorted({key for item in new for key in item.cameras})
        slots = {}
        for key in keys:
            slots[key] = divmod(next_video.get(key, 0), chunk_size)
            next_video[key] = next_video.get(key, 0) + 1

        def job() -> dict[str, _EncodedCamera]:
            return {key: self._encode_camera(key, new, slots[key], chunk_size, fps) for key in keys}

        if not keys or self.cfg.video.encode == "inline":
            done: Future[dict[str, _EncodedCamera]] = Future()
            done.set_result(job())
            return done
        pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="video-encode")
        try:
            future = pool.submit(job)
            self._encodings.append(future)
            return future
        finally:
            pool.shutdown(wait=False)  # the one job runs on; its future is joined before the commit

    def _encode_camera(self, key: str, new: list[_Staged], slot: tuple[int, int], chunk_size: int,
                       fps: float) -> _EncodedCamera:
        positions = [i for i, item in enumerate(new) if key in item.cameras]
        path = self.root / VIDEO_PATH.format(video_key=key, chunk_index=slot[0], file_index=slot[1])
        with atomic_path(path, tmp_name=path.name + TMP_SUFFIX) as tmp:
            spans = encode_episodes(tmp, [new[i].cameras[key] for i in positions], fps, self.cfg.video)
            info = video_info(tmp, self.cfg.video)
        height, width = new[positions[0]].cameras[key].shape[1:3]
        return _EncodedCamera(slot, dict(zip(positions, spans)), video_feature(int(height), int(width), info))

    def _merge_meta_tail(self) -> None:
        """The newest small episodes-table files merged into one, under a new number, then removed
        (meta_files.py: why, and why a merge that dies half-way changes nothing); the small data
        files their episodes sit in are merged with them (data_files.py). Writer only."""
        files = list_meta_files(self.root)
        run = tail_to_merge(files, self.cfg.meta_merge_files, int(self.cfg.meta_file_mb * 2**20))
        if run:
            self._merge_meta_run(run, files)

    def compact_data_files(self) -> int:
        """Merge the small data files that older episodes-table files still name: a root grown
        before data files were merged with the episodes table keeps one data file per ingest (a
        DVC snapshot walks each). Each such episodes-table file is rewritten as a merge of one,
        the same commit protocol as the tail's; episodes and their frames are unchanged. Returns
        how many episodes-table files were rewritten."""
        rewritten = 0
        with self._writer():
            for meta in list_meta_files(self.root):
                rewritten += self._merge_meta_run([meta], list_meta_files(self.root), only_with_data=True)
        return rewritten

    def _merge_meta_run(self, run: list[MetaFile], files: list[MetaFile], only_with_data: bool = False) -> bool:
        """``run``'s rows (and the data files only they name) as one new episodes-table file, then
        the run removed and the merged-away data files moved aside. ``only_with_data``: nothing
        is written unless some data files merge. Returns whether anything was written."""
        chunk_size = self.chunk_size
        number = next_meta_number(files, chunk_size)
        chunk, file = divmod(number, chunk_size)
        rows = pa.concat_tables([read_meta_file(m.path) for m in run], promote_options="permissive")
        rows, merged_away = self._merge_data_files(dedupe_episodes(rows, EPISODE_INDEX).combine_chunks())
        if only_with_data and not merged_away:
            return False
        for name, value in ((META_META_CHUNK, chunk), (META_META_FILE, file)):
            rows = _with_int_column(rows, name, np.full(rows.num_rows, value, dtype=np.int64))
        _atomic_write_parquet(meta_file_path(self.root, number, chunk_size), rows, self.cfg.compression)  # commit
        for meta in run:
            meta.path.unlink(missing_ok=True)
        self._meta = read_episodes_table(self.root, EPISODE_INDEX)
        below = self._next_file_number()
        leftovers = unreferenced(self.root, set(self._file_keys()), below, chunk_size)  # of a merge that died
        supersede(self.root, sorted(set(merged_away) | set(leftovers)))
        sweep(self.root, self.cfg.superseded_retain_hours)
        return True

    def _merge_data_files(self, rows: pa.Table) -> tuple[pa.Table, list[tuple[int, int]]]:
        """``rows`` (episodes-table rows about to be merged) pointing at merged data files, and the
        keys of the files merged away. Only files that no episode outside ``rows`` names are
        merged, so the new episodes-table file is the one place that has to change."""
        assert self._meta is not None
        keys = np.stack([rows.column(META_DATA_CHUNK).to_numpy(), rows.column(META_DATA_FILE).to_numpy()], axis=1)
        everywhere = np.stack([self._meta.column(META_DATA_CHUNK).to_numpy(),
                               self._meta.column(META_DATA_FILE).to_numpy()], axis=1)
        starts, lengths = rows.column(META_FROM).to_numpy(), rows.column(META_LENGTH).to_numpy()
        candidates = []
        for key in np.unique(keys, axis=0):
            mine = (keys == key).all(axis=1)
            if int(mine.sum()) != int((everywhere == key).all(axis=1).sum()):
                continue
            first = int(starts[mine].min())
            frames = int((starts[mine] + lengths[mine]).max()) - first
            candidates.append(describe(self.root, (int(key[0]), int(key[1])), first, frames))
        groups = plan_data_merge(candidates, int(self.cfg.data_file_mb * 2**20))
        chunks, files = keys[:, 0].copy(), keys[:, 1].copy()
        number = self._next_file_number()
        merged_away: list[tuple[int, int]] = []
        for offset, group in enumerate(groups):
            new_key = divmod(number + offset, self.chunk_size)
            write_merged(self.root, group, new_key, self.cfg.compression)
            for old in group:
                moved = (keys == np.array(old.key)).all(axis=1)
                chunks[moved], files[moved] = new_key
                merged_away.append(old.key)
        rows = _with_int_column(rows, META_DATA_CHUNK, chunks)
        return _with_int_column(rows, META_DATA_FILE, files), merged_away

    def _pooled_stats(self, added: pa.Table) -> dict[str, dict[str, list]] | None:
        """The last stats.json pooled with the added episodes' stats; None when that file does
        not describe exactly the frames stored before them (its state count says how many)."""
        path = self.root / STATS_PATH
        before = self.num_frames - int(np.sum(added.column(META_LENGTH).to_numpy()))
        if before == 0:
            return stats_from_episodes_meta(added)
        if not path.exists():
            return None
        old = json.loads(path.read_text())
        if old.get(STATE, {}).get("count") != [before]:
            return None
        new = stats_from_episodes_meta(added)
        return {f: _pool(old.get(f), new.get(f)) for f in sorted(set(old) | set(new))}

    def _new_info(self, fps: float | None = None, robot_type: str | None = None) -> dict[str, Any]:
        """A fresh info.json: fps and robot type from the config unless an import brings its own."""
        fps = self.cfg.fps if fps is None else fps
        return {
            "codebase_version": self.cfg.codebase_version,
            "robot_type": robot_type or self.cfg.robot_type,
            "total_episodes": 0,
            "total_frames": 0,
            "total_tasks": 0,
            "chunks_size": self.cfg.chunk_size,
            "data_files_size_in_mb": int(self.cfg.data_file_mb) if float(self.cfg.data_file_mb).is_integer()
            else self.cfg.data_file_mb,
            "video_files_size_in_mb": VIDEO_FILES_SIZE_IN_MB,
            "fps": int(fps) if float(fps).is_integer() else fps,
            "splits": {"train": "0:0"},
            "data_path": DATA_PATH,
            "video_path": None,
            "features": {},
        }

    def _write_derived_meta(self, added: pa.Table | None = None) -> None:
        """info.json totals and stats.json, both derived from the episodes table: stats pooled
        from the last stats.json and the ``added`` rows when that file matches what was stored
        before them, else recomputed from every episode (after a crash, on repair)."""
        assert self._info is not None and self._meta is not None
        self._info = self.info()
        stats = self._pooled_stats(added) if added is not None else None
        if stats is None:
            stats = stats_from_episodes_meta(self._meta)
        _atomic_write_bytes(self.root / STATS_PATH, json.dumps(stats, indent=4).encode())
        _atomic_write_bytes(self.root / INFO_PATH, json.dumps(self._info, indent=4).encode())


def _camera_location(key: str, slot: tuple[int, int], span: EpisodeSpan) -> dict[str, pa.Array]:
    """An episode's ``videos/<key>/*`` columns: its video file and its span in it (LeRobot v3)."""
    return {
        video_location_column(key, "chunk_index"): pa.array([slot[0]], pa.int64()),
        video_location_column(key, "file_index"): pa.array([slot[1]], pa.int64()),
        video_location_column(key, "from_timestamp"): pa.array([span.from_timestamp], pa.float64()),
        video_location_column(key, "to_timestamp"): pa.array([span.to_timestamp], pa.float64()),
    }


def _camera_hash(content_hash: str, frames: Mapping[str, np.ndarray]) -> str:
    """An episode's content hash with its camera frames in it (as sent, before the lossy
    encoding), so a re-sent episode is a duplicate and a changed frame is not."""
    parts = [content_hash]
    for key, images in sorted(frames.items()):
        digest = hashlib.blake2b(np.ascontiguousarray(images).tobytes(), digest_size=16)
        parts.append(f"{key}:{images.shape}:{digest.hexdigest()}")
    return combine_fingerprints(parts)


def _with_int_column(table: pa.Table, name: str, values: np.ndarray) -> pa.Table:
    return table.set_column(table.schema.get_field_index(name), name, pa.array(values, pa.int64()))


def _pool(old: dict[str, list] | None, new: dict[str, list] | None) -> dict[str, list] | None:
    """One feature's stats over two disjoint sets of frames (either may be absent)."""
    if old is None or new is None:
        return old or new
    stacked = {stat: np.stack([np.asarray(old[stat], np.float64), np.asarray(new[stat], np.float64)])
               for stat in STAT_NAMES}
    return {k: v.tolist() for k, v in aggregate_stats(stacked).items()}


def _consecutive_runs(count: int, joins: Callable[[int, int], bool]) -> list[list[int]]:
    """Positions 0..count-1 grouped into runs of consecutive ones, position i joining the run of
    i - 1 when ``joins(i - 1, i)``."""
    runs: list[list[int]] = []
    for i in range(count):
        if runs and joins(i - 1, i):
            runs[-1].append(i)
        else:
            runs.append([i])
    return runs


def _adjacent_runs(keys: list[tuple[int, int]], starts: list[int], lengths: list[int]) -> list[list[int]]:
    """Consecutive episodes that lie back to back in one data file (same file, each starting
    where the one before ends): each run is decoded at once."""
    return _consecutive_runs(len(keys), lambda a, b: keys[a] == keys[b] and starts[b] == starts[a] + lengths[a])


def read_incoming(path: Path, quarantine_dir: Path) -> IncomingEpisode | QuarantinedFile:
    """Read one incoming episode file; an unreadable one goes to quarantine with its reason.

    Reading is the per-file part of ingest, so flows can fan it out (and cache it on the file's
    content) before one writer validates and stores the batch with ``ingest_tables``.
    """
    try:
        table = read_episode_file(path)
    except (ValueError, pa.ArrowInvalid) as exc:
        error = EpisodeValidationError(
            str(path), WHOLE_FILE, f"unreadable ({exc})",
            "send one Parquet file or Arrow IPC stream per episode",
        )
        return quarantine_file(path, error, quarantine_dir)
    try:
        check_upload_columns(table, str(path))
    except EpisodeValidationError as error:
        return quarantine_file(path, error, quarantine_dir)
    return IncomingEpisode(table=table, source=str(path), origin=Path(path))


def _schema_runs(tables: list[pa.Table]) -> list[list[int]]:
    """Consecutive tables of one schema (validated together)."""
    return _consecutive_runs(len(tables), lambda a, b: tables[b].schema.equals(tables[a].schema))


def _stage_batch(items: list[IncomingEpisode], batch: ValidatedBatch) -> list[_Staged]:
    """``_stage_one`` for a batch validated together; the frames' fingerprints in one pass."""
    frames = table_fingerprints(batch.frames, batch.bounds)
    out = []
    for i, (item, episode) in enumerate(zip(items, batch.episodes)):
        canonical = batch.frames.slice(int(batch.bounds[i]), episode.length)
        out.append(_Staged(item, episode, canonical, _content_hash(frames[i], item.meta_extra)))
    return out


def _stage_one(item: IncomingEpisode, episode: Episode, table: pa.Table) -> _Staged:
    canonical = episode_to_table(dataclasses.replace(episode, extras={}))
    for name in table.column_names:
        if name not in CONTRACT_COLUMNS:
            canonical = canonical.append_column(table.schema.field(name), table.column(name))
    return _Staged(item, episode, canonical, episode_content_hash(canonical, item.meta_extra))


def episode_content_hash(canonical: pa.Table, meta: pa.Table | None = None) -> str:
    """The content hash the dataset stores for an episode: its canonical frames plus any carried
    meta (file locations excluded, so re-chunking never changes it). The one recipe: the fleet's
    spool quotes it so anyone can check that what was stored is exactly what the robot finished."""
    return _content_hash(table_fingerprint(canonical), meta)


def _content_hash(frames_fingerprint: str, meta: pa.Table | None) -> str:
    parts = [frames_fingerprint]
    if meta is not None and any(not is_location_column(n) for n in meta.column_names):
        locations = frozenset(n for n in meta.column_names if is_location_column(n))
        parts.append(table_fingerprint(meta, exclude=locations))
    return combine_fingerprints(parts)


def _data_table(canonical: pa.Table, episode_index: int, first_frame: int, task_index: int) -> pa.Table:
    """A data-file slice in LeRobot column order: vectors, time, indices, ours, extras."""
    length = canonical.num_rows
    columns: dict[str, pa.Array | pa.ChunkedArray] = {
        STATE: canonical.column(STATE),
        ACTION: canonical.column(ACTION),
        TIMESTAMP: canonical.column(TIMESTAMP),
        FRAME_INDEX: canonical.column(FRAME_INDEX),
        EPISODE_INDEX: pa.array(np.full(length, episode_index, dtype=np.int64)),
        INDEX: pa.array(np.arange(first_frame, first_frame + length, dtype=np.int64)),
        TASK_INDEX: pa.array(np.full(length, task_index, dtype=np.int64)),
    }
    for name in _EPISODE_LEVEL_STORED:
        columns[name] = canonical.column(name)
    for name in canonical.column_names:
        if name not in CONTRACT_COLUMNS:
            columns[name] = canonical.column(name)
    return pa.table(columns)


def _meta_rows(
    new: list[_Staged],
    lengths: list[int],
    first_episode: int,
    first_frame: int,
    data_file: tuple[int, int],
    meta_file: tuple[int, int],
    extra_rows: list[dict[str, pa.Array]],
) -> pa.Table:
    """The episodes-table rows of a stored batch, built column by column (one chunk per column),
    then each episode's carried meta and video locations (null where an episode has none)."""
    count = len(new)
    frames = np.asarray(lengths, dtype=np.int64)
    ends = first_frame + np.cumsum(frames)
    episodes = [item.episode for item in new]
    columns: dict[str, pa.Array] = {
        EPISODE_INDEX: pa.array(np.arange(first_episode, first_episode + count, dtype=np.int64)),
        META_TASKS: pa.array([[ep.task] for ep in episodes], pa.list_(pa.string())),
        META_LENGTH: pa.array(frames),
        META_DATA_CHUNK: pa.array(np.full(count, data_file[0], dtype=np.int64)),
        META_DATA_FILE: pa.array(np.full(count, data_file[1], dtype=np.int64)),
        META_FROM: pa.array(ends - frames),
        META_TO: pa.array(ends),
        META_META_CHUNK: pa.array(np.full(count, meta_file[0], dtype=np.int64)),
        META_META_FILE: pa.array(np.full(count, meta_file[1], dtype=np.int64)),
        EPISODE_ID: pa.array([ep.episode_id for ep in episodes], pa.string()),
        ROBOT_ID: pa.array([ep.robot_id for ep in episodes], pa.string()),
        POLICY_VERSION: pa.array([ep.policy_version for ep in episodes], pa.string()),
        SUCCESS: pa.array([ep.success for ep in episodes], pa.bool_()),
        INTERRUPTED: pa.array([ep.interrupted for ep in episodes], pa.bool_()),
        META_CONTENT_HASH: pa.array([item.content_hash for item in new], pa.string()),
    }
    names = list(dict.fromkeys(name for extras in extra_rows for name in extras))
    for name in names:
        types = [extras[name].type for extras in extra_rows if name in extras]
        kind = pa.unify_schemas([pa.schema([(name, t)]) for t in types], promote_options="permissive").field(name).type
        columns[name] = pa.concat_arrays(
            [extras[name].cast(kind) if name in extras else pa.nulls(1, kind) for extras in extra_rows]
        )
    return pa.table(columns)


def _with_stats(meta: pa.Table, data: pa.Table, lengths: list[int]) -> pa.Table:
    """``meta`` (one row per episode) with the ``stats/<feature>/<stat>`` columns of every flat
    numeric frame feature of ``data`` (the episodes' frames, in order, ``lengths`` rows each),
    placed after the content hash. A feature an episode lacks (or holds unevenly) is null there.

    One pass per feature for the whole batch (``span_stats``): each episode's figures are those of
    its own frames, whichever batch stored it."""
    lengths = np.asarray(lengths, dtype=np.int64)
    position = meta.column_names.index(META_CONTENT_HASH) + 1
    for name in data.column_names:
        if name in (SUCCESS, INTERRUPTED):
            continue
        values = column_values(data.column(name))
        # one pass for the batch when the whole column is flat numeric, else episode by episode
        stacked = span_stats(values, lengths) if values is not None and values.size else None
        per_episode = None if stacked is not None else _episode_stats(data.column(name), lengths)
        if per_episode is not None and all(stats is None for stats in per_episode):
            continue
        for stat in STAT_NAMES:
            item, column = pa.int64() if stat == "count" else pa.float64(), stats_column(name, stat)
            carried = [None] * meta.num_rows  # an import's own stats of this feature: kept where we have none
            if column in meta.column_names:
                if stacked is None:  # with stacked figures every episode has its own
                    carried = meta.column(column).to_pylist()
                meta = meta.remove_column(meta.column_names.index(column))  # it sat after ours: position holds
            if stacked is not None:  # every episode has its own figures
                array = _rows_as_lists(stacked[stat], item)
            else:
                array = pa.array([carried[i] if stats is None else stats[stat] for i, stats in enumerate(per_episode)],
                                 pa.list_(item))
            meta = meta.add_column(position, column, array)
            position += 1
    return meta


def _rows_as_lists(rows: np.ndarray, item: pa.DataType) -> pa.ListArray:
    """(runs, d) → a list<item> array of runs rows of d values (no Python lists in between)."""
    runs, width = rows.shape
    offsets = pa.array(np.arange(0, runs * width + 1, width, dtype=np.int32))
    return pa.ListArray.from_arrays(offsets, pa.array(np.ascontiguousarray(rows).reshape(-1), item))


def _episode_stats(column: pa.ChunkedArray, lengths: np.ndarray) -> list[dict[str, list] | None]:
    """Each episode's stats of one column (``lengths`` frames each, in order) as stored, one by
    one: lists per stat; None where the episode has no flat numbers."""
    out: list[dict[str, list] | None] = []
    for start, length in zip(np.cumsum(lengths) - lengths, lengths):
        mine = column_values(column.slice(int(start), int(length)))
        out.append({k: v.tolist() for k, v in feature_stats(mine).items()} if mine is not None and mine.size else None)
    return out


@dataclass(frozen=True)
class _Span:
    """Where one episode's frames are: its data file and its first global frame index."""

    key: tuple[int, int]  # (chunk, file) of the data file
    start: int
    length: int


def _spans_by_file(spans: list[_Span]) -> list[tuple[tuple[int, int], list[tuple[int, _Span]]]]:
    """(data file, [(position in the request, span), ...]) in the order files are first needed."""
    files: dict[tuple[int, int], list[tuple[int, _Span]]] = {}
    for order, span in enumerate(spans):
        files.setdefault(span.key, []).append((order, span))
    return list(files.items())


def _float32_frames(column: pa.ChunkedArray) -> np.ndarray:
    """A frame column as ``table_to_episode`` decodes it: list columns (T, d), scalars (T,)."""
    if pa.types.is_list(column.type) or pa.types.is_fixed_size_list(column.type) or pa.types.is_large_list(column.type):
        return list_column_to_numpy(column).astype(np.float32, copy=False)
    return column.to_numpy().astype(np.float32, copy=False)
