"""Reading the dataset: ``DatasetReader`` opens the layout (info.json, the episodes table,
tasks) and reads episodes, frames and camera streams from it, at a cost that follows what is read.

Every reader starts from the episodes table: it says which data file holds an episode and where
(``dataset_from_index``, ``length``), so a slice of episodes opens only its files, and
``episode_columns`` only the columns asked for. Readers never take the writer lock and never
block: what they see is what the last committed episodes-table file names (data_files.py finds a
file a merge moved aside after this handle read the table). Camera streams are decoded by
timestamp, one ``VideoReader`` kept open per file (``VIDEO_READERS_KEPT``), so walking the
episodes in order decodes each video file once.
"""

from __future__ import annotations

import dataclasses
import json
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa

from components.config import EpisodesConfig
from components.episodes.data_files import DATA_PATH, read_data_file
from components.episodes.fingerprint import combine_fingerprints
from components.episodes.layout import (
    INFO_PATH,
    META_CONTENT_HASH,
    META_DATA_CHUNK,
    META_DATA_FILE,
    META_FROM,
    META_LENGTH,
    TASKS_PATH,
    VIDEO_PATH,
    file_keys,
    new_info,
    read_tasks,
    video_location_column,
)
from components.episodes.meta_files import read_episodes_table
from components.episodes.record import Episode
from components.episodes.schema import (
    ACTION,
    BOOKKEEPING_COLUMNS,
    EPISODE_ID,
    EPISODE_INDEX,
    INDEX,
    ROBOT_ID,
    STATE,
    TASK,
    TASK_INDEX,
    TIMESTAMP,
    list_column_to_numpy,
    table_to_episode,
    table_to_episodes,
)
from components.episodes.stats import parse_stats_column
from components.episodes.video import EpisodeSpan, VideoReader, episode_frames

VIDEO_READERS_KEPT = 8  # open video files a dataset keeps (camera_frames)


class DatasetReader:
    """A read handle on the episodes stored in the LeRobot v3 layout under ``root``."""

    def __init__(self, root: Path, cfg: EpisodesConfig) -> None:
        self.root = Path(root)
        self.cfg = cfg
        self._meta: pa.Table | None = None
        self._facts: tuple[pa.Table, int, bool] | None = None  # (_meta, its frames, in episode order)
        self._tasks: list[str] = []
        self._info: dict[str, Any] | None = None
        self._readers: dict[Path, VideoReader] = {}  # open video files, least recently used first
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
        info = json.loads(json.dumps(self._info or new_info(self.cfg)))
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
        return [self.root / DATA_PATH.format(chunk_index=c, file_index=f) for c, f in file_keys(self._meta)]

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

    def load_episodes(self, episode_indices: Sequence[int], cameras: bool | Sequence[str] = False) -> list[Episode]:
        """The listed episodes (``episode_index`` values) in the order listed; each data file that
        holds one of them is read once. For the few episodes a consumer needs whole.
        ``cameras``: with their camera frames decoded (``camera_frames``): True every camera's, a
        sequence of keys those cameras' only."""
        if cameras:
            keys = None if cameras is True else list(cameras)
            return [dataclasses.replace(ep, cameras=self.camera_frames(i, keys))
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


def consecutive_runs(count: int, joins: Callable[[int, int], bool]) -> list[list[int]]:
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
    return consecutive_runs(len(keys), lambda a, b: keys[a] == keys[b] and starts[b] == starts[a] + lengths[a])


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
