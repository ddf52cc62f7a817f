"""The rows an ingest writes, built from staged episodes: each episode's frames as a data-file
table (``data_table``), its episodes-table row (``meta_rows``) with per-episode stats
(``with_stats``) and camera locations (``camera_location``), and the content hashes that make a
re-sent episode a duplicate (``episode_content_hash``, ``camera_hash``). Pure functions of their
inputs: nothing here touches the disk."""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from typing import TYPE_CHECKING

import numpy as np
import pyarrow as pa

from components.episodes.fingerprint import combine_fingerprints, table_fingerprint
from components.episodes.layout import (
    META_CONTENT_HASH,
    META_DATA_CHUNK,
    META_DATA_FILE,
    META_FROM,
    META_LENGTH,
    META_META_CHUNK,
    META_META_FILE,
    META_TASKS,
    META_TO,
    is_location_column,
    video_location_column,
)
from components.episodes.schema import (
    ACTION,
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
    TASK_INDEX,
    TIMESTAMP,
)
from components.episodes.stats import STAT_NAMES, column_values, feature_stats, span_stats, stats_column
from components.episodes.video import EpisodeSpan

if TYPE_CHECKING:
    from components.episodes.incoming import StagedEpisode

EPISODE_LEVEL_STORED = (EPISODE_ID, ROBOT_ID, POLICY_VERSION, SUCCESS, INTERRUPTED)



def camera_location(key: str, slot: tuple[int, int], span: EpisodeSpan) -> dict[str, pa.Array]:
    """An episode's ``videos/<key>/*`` columns: its video file and its span in it (LeRobot v3)."""
    return {
        video_location_column(key, "chunk_index"): pa.array([slot[0]], pa.int64()),
        video_location_column(key, "file_index"): pa.array([slot[1]], pa.int64()),
        video_location_column(key, "from_timestamp"): pa.array([span.from_timestamp], pa.float64()),
        video_location_column(key, "to_timestamp"): pa.array([span.to_timestamp], pa.float64()),
    }


def camera_hash(content_hash: str, frames: Mapping[str, np.ndarray]) -> str:
    """An episode's content hash with its camera frames in it (as sent, before the lossy
    encoding), so a re-sent episode is a duplicate and a changed frame is not."""
    parts = [content_hash]
    for key, images in sorted(frames.items()):
        digest = hashlib.blake2b(np.ascontiguousarray(images).tobytes(), digest_size=16)
        parts.append(f"{key}:{images.shape}:{digest.hexdigest()}")
    return combine_fingerprints(parts)


def with_int_column(table: pa.Table, name: str, values: np.ndarray) -> pa.Table:
    return table.set_column(table.schema.get_field_index(name), name, pa.array(values, pa.int64()))


def episode_content_hash(canonical: pa.Table, meta: pa.Table | None = None) -> str:
    """The content hash the dataset stores for an episode: its canonical frames plus any carried
    meta (file locations excluded, so re-chunking never changes it). The one recipe: the fleet's
    spool quotes it so anyone can check that what was stored is exactly what the robot finished."""
    return content_hash(table_fingerprint(canonical), meta)


def content_hash(frames_fingerprint: str, meta: pa.Table | None) -> str:
    parts = [frames_fingerprint]
    if meta is not None and any(not is_location_column(n) for n in meta.column_names):
        locations = frozenset(n for n in meta.column_names if is_location_column(n))
        parts.append(table_fingerprint(meta, exclude=locations))
    return combine_fingerprints(parts)


def data_table(canonical: pa.Table, episode_index: int, first_frame: int, task_index: int) -> pa.Table:
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
    for name in EPISODE_LEVEL_STORED:
        columns[name] = canonical.column(name)
    for name in canonical.column_names:
        if name not in CONTRACT_COLUMNS:
            columns[name] = canonical.column(name)
    return pa.table(columns)


def meta_rows(
    new: list[StagedEpisode],
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


def with_stats(meta: pa.Table, data: pa.Table, lengths: list[int]) -> pa.Table:
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

