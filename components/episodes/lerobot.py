"""LeRobot v3 datasets in and out: ``import_lerobot`` and ``export_lerobot``.

Import reads a LeRobot v3 folder (``meta/info.json``, ``meta/episodes``, ``meta/tasks.parquet``,
``data/``, ``videos/``) episode by episode and offers each to ``EpisodeDataset.ingest_tables``,
so it is validated, deduplicated and stored like any fleet upload. Fields LeRobot lacks are
filled (and the mapping recorded): ``episode_id`` (a uuid4 derived deterministically from robot,
source episode index and content, so re-importing is a no-op), ``robot_id`` (a parameter),
``policy_version`` (``lerobot-import``), ``success`` (``success`` / ``next.success`` column, else a
parameter) and ``interrupted`` (False). Every other frame column is carried untouched; video
features stay mp4 files, copied whole and referenced from the episodes table, never decoded.

Export writes the dataset back as a LeRobot v3 folder, our columns included, so export →
import reproduces episode ids, states, actions and meta.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import uuid
from collections.abc import Set
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from components.episodes.data_files import DATA_PATH
from components.episodes.dataset import EpisodeDataset, IncomingEpisode, IngestReport, SourceLayout
from components.episodes.fingerprint import table_fingerprint
from components.episodes.layout import (
    EPISODES_META_PATH,
    INFO_PATH,
    OWN_META_COLUMNS,
    STATS_PATH,
    TASKS_PATH,
    VIDEO_PATH,
    read_tasks,
    video_location_column,
)
from components.episodes.schema import (
    ACTION,
    BOOKKEEPING_COLUMNS,
    EPISODE_ID,
    EPISODE_INDEX,
    FRAME_INDEX,
    INTERRUPTED,
    POLICY_VERSION,
    ROBOT_ID,
    STATE,
    SUCCESS,
    TASK,
    TASK_INDEX,
    TIMESTAMP,
)
from components.episodes.stats import parse_stats_column, stats_from_episodes_meta
from components.fsio import atomic_write_text

IMPORT_POLICY_VERSION = "lerobot-import"
DEFAULT_IMPORT_ROBOT = "lerobot-import"
NEXT_SUCCESS = "next.success"
SUPPORTED_MAJOR_VERSION = 3
ID_NAMESPACE = b"fleetloop/lerobot-import/v1"
IMPORTS_DIR = "meta/imports"
VIDEO_DTYPE = "video"
# columns import casts to the contract's types: their info.json entries must say so
STORED_DTYPES = {STATE: "float32", ACTION: "float32", TIMESTAMP: "float32", FRAME_INDEX: "int64"}


class LeRobotFormatError(ValueError):
    """A source folder that is not a LeRobot v3 dataset we can read. One line: path, reason, fix."""

    def __init__(self, path: Path, reason: str, fix: str) -> None:
        self.path, self.reason, self.fix = Path(path), reason, fix
        super().__init__(f"{path}: {reason}. Fix: {fix}")


@dataclass(frozen=True)
class EpisodeMapping:
    """One source episode and the id it has in our dataset; ``filled`` names defaulted fields."""

    source_episode_index: int
    episode_id: str
    filled: tuple[str, ...]


@dataclass(frozen=True)
class LeRobotImport:
    source: Path
    report: IngestReport
    mapping: tuple[EpisodeMapping, ...]
    mapping_file: Path | None

    def __str__(self) -> str:
        return f"import {self.source}: {self.report.summary()}"


@dataclass(frozen=True)
class LeRobotExport:
    path: Path
    episodes: int
    frames: int
    data_files: int
    video_files: int

    def __str__(self) -> str:
        return (
            f"export {self.path}: {self.episodes} episodes, {self.frames} frames, "
            f"{self.data_files} data files, {self.video_files} video files"
        )


# ------------------------------------------------------------------------------------ import


def _read_info(src: Path) -> dict[str, Any]:
    path = src / INFO_PATH
    if not path.exists():
        raise LeRobotFormatError(src, "no meta/info.json", "point at the LeRobot dataset root (meta/ and data/ inside)")
    info = json.loads(path.read_text())
    version = str(info.get("codebase_version", ""))
    try:
        major = int(version.lstrip("v").split(".")[0])
    except ValueError:
        major = -1
    if major != SUPPORTED_MAJOR_VERSION:
        raise LeRobotFormatError(
            path,
            f"codebase_version {version!r} is not v3.x",
            "convert it first with LeRobot's convert_dataset_v21_to_v30 script",
        )
    features = info.get("features", {})
    for name in (STATE, ACTION):
        if name not in features:
            raise LeRobotFormatError(path, f"no {name!r} feature", f"only datasets with {STATE} and {ACTION} can be imported")
    if not isinstance(info.get("fps"), (int, float)) or info["fps"] <= 0:
        raise LeRobotFormatError(path, f"fps {info.get('fps')!r} is not a positive number", "set meta/info.json `fps` to the recording rate")
    return info


def _source_layout(info: dict[str, Any]) -> SourceLayout:
    """What an empty dataset adopts from the source (and a non-empty one must match)."""
    shapes = {name: tuple(int(d) for d in info["features"][name].get("shape", ())) for name in (STATE, ACTION)}
    return SourceLayout(fps=float(info["fps"]), robot_type=info.get("robot_type") or None, shapes=shapes)


def _stored_features(features: dict[str, dict[str, Any]], keep: Set[str]) -> dict[str, dict[str, Any]]:
    """The source's info.json entries (names, video info, ...) of the features we store, with the
    dtype of the columns import casts."""
    out = {}
    for name, feature in features.items():
        if name in keep:
            out[name] = {**feature, "dtype": STORED_DTYPES[name]} if name in STORED_DTYPES else dict(feature)
    return out


def _as_float32_vectors(column: pa.ChunkedArray) -> pa.ChunkedArray:
    t = column.type
    if pa.types.is_fixed_size_list(t):
        return column.cast(pa.list_(pa.float32(), t.list_size))
    if pa.types.is_list(t) or pa.types.is_large_list(t):
        return column.cast(pa.list_(pa.float32()))
    return column


def _derived_episode_id(robot_id: str, source_index: int, rows: pa.Table) -> str:
    """A uuid4 from robot, source index and content: the same source always maps to the same id."""
    digest = hashlib.sha256(
        ID_NAMESPACE
        + f"\0{robot_id}\0{source_index}\0".encode()
        + table_fingerprint(rows.select([STATE, ACTION, TIMESTAMP])).encode()
    ).digest()
    return str(uuid.UUID(bytes=digest[:16], version=4))


def _episode_table(
    rows: pa.Table, task: str, source_index: int, robot_id: str, success: bool
) -> tuple[pa.Table, tuple[str, ...]]:
    """LeRobot frame rows of one episode → our episode table, and the fields we had to fill."""
    length = rows.num_rows
    names = rows.column_names
    filled: list[str] = []
    columns: dict[str, pa.ChunkedArray | pa.Array] = {}
    columns[STATE] = _as_float32_vectors(rows.column(STATE))
    columns[ACTION] = _as_float32_vectors(rows.column(ACTION))
    columns[TIMESTAMP] = rows.column(TIMESTAMP).cast(pa.float32())
    columns[FRAME_INDEX] = rows.column(FRAME_INDEX).cast(pa.int64())
    columns[TASK] = pa.array([task] * length, pa.string())
    robot = rows.column(ROBOT_ID)[0].as_py() if ROBOT_ID in names else None
    if robot is None:
        robot = robot_id
        filled.append(ROBOT_ID)
    columns[ROBOT_ID] = rows.column(ROBOT_ID) if ROBOT_ID in names else pa.array([robot] * length, pa.string())
    if EPISODE_ID in names:
        columns[EPISODE_ID] = rows.column(EPISODE_ID)
    else:
        columns[EPISODE_ID] = pa.array([_derived_episode_id(robot, source_index, rows)] * length, pa.string())
        filled.append(EPISODE_ID)
    if POLICY_VERSION in names:
        columns[POLICY_VERSION] = rows.column(POLICY_VERSION)
    else:
        columns[POLICY_VERSION] = pa.array([IMPORT_POLICY_VERSION] * length, pa.string())
        filled.append(POLICY_VERSION)
    if SUCCESS in names:
        columns[SUCCESS] = rows.column(SUCCESS)
    else:
        if NEXT_SUCCESS in names:
            value = bool(pc.any(rows.column(NEXT_SUCCESS).cast(pa.bool_())).as_py())
        else:
            value = success
            filled.append(SUCCESS)
        columns[SUCCESS] = pa.array([value] * length, pa.bool_())
    if INTERRUPTED in names:
        columns[INTERRUPTED] = rows.column(INTERRUPTED)
    else:
        columns[INTERRUPTED] = pa.array([False] * length, pa.bool_())
        filled.append(INTERRUPTED)
    for name in names:
        column = rows.column(name)
        # all-null: the padding export adds where an episode lacks a feature other episodes have
        if name not in columns and name not in BOOKKEEPING_COLUMNS and column.null_count < length:
            columns[name] = column
    return pa.table(columns), tuple(filled)


def _meta_extra(meta_row: pa.Table, data_columns: set[str]) -> pa.Table:
    """Episode-level meta to carry: video references and stats of features not in data files."""
    keep = []
    for name in meta_row.column_names:
        if name in OWN_META_COLUMNS or meta_row.column(name).null_count == meta_row.num_rows:
            continue
        parsed = parse_stats_column(name)
        if parsed is not None and parsed[0] in data_columns:
            continue  # recomputed on store
        keep.append(name)
    return meta_row.select(keep)


def import_lerobot(
    src_dir: Path,
    dataset: EpisodeDataset,
    robot_id: str = DEFAULT_IMPORT_ROBOT,
    success: bool = False,
    known_robots: Set[str] | None = None,
    quarantine_dir: Path | None = None,
) -> LeRobotImport:
    """Import every episode of the LeRobot v3 dataset at ``src_dir`` into ``dataset``.

    ``robot_id`` and ``success`` fill episodes that carry no such column. ``known_robots=None``
    accepts any robot id. A bad episode goes to ``quarantine_dir`` (or raises when it is None).
    An empty ``dataset`` adopts the source's fps, robot type and feature entries; a non-empty one
    refuses a different fps or state/action shape (``DatasetMismatchError``, nothing written).
    """
    src = Path(src_dir)
    info = _read_info(src)
    features: dict[str, dict[str, Any]] = info["features"]
    video_keys = sorted(k for k, f in features.items() if f.get("dtype") == VIDEO_DTYPE)
    tasks = read_tasks(src / TASKS_PATH)
    meta_files = sorted((src / "meta" / "episodes").glob("*/*.parquet"))
    if not meta_files:
        raise LeRobotFormatError(src, "no meta/episodes/chunk-*/file-*.parquet", "write the episodes table (LeRobot v3)")
    meta = pa.concat_tables([pq.read_table(p) for p in meta_files], promote_options="permissive")
    meta = meta.sort_by(EPISODE_INDEX)
    data_path = info.get("data_path", DATA_PATH)
    video_path = info.get("video_path") or VIDEO_PATH

    incoming: list[IncomingEpisode] = []
    mapping: list[EpisodeMapping] = []
    loaded: dict[tuple[int, int], pa.Table] = {}
    for row_index in range(meta.num_rows):
        row = meta.slice(row_index, 1)
        source_index = int(row.column(EPISODE_INDEX)[0].as_py())
        key = (int(row.column("data/chunk_index")[0].as_py()), int(row.column("data/file_index")[0].as_py()))
        if key not in loaded:
            path = src / data_path.format(chunk_index=key[0], file_index=key[1])
            if not path.exists():
                raise LeRobotFormatError(path, "data file referenced by meta/episodes is missing", "restore the file or re-download the dataset")
            loaded[key] = pq.read_table(path)
        data = loaded[key]
        rows = data.filter(pc.equal(data.column(EPISODE_INDEX), source_index))
        source = f"{src}#episode_{source_index}"
        task_indices = pc.unique(rows.column(TASK_INDEX)).to_pylist() if rows.num_rows else [0]
        if len(task_indices) != 1:
            raise LeRobotFormatError(
                src, f"episode {source_index} has {len(task_indices)} tasks", "split multi-task episodes into one task each"
            )
        table, filled = _episode_table(rows, tasks[task_indices[0]], source_index, robot_id, success)
        videos = {}
        for video_key in video_keys:
            if video_location_column(video_key, "file_index") not in row.column_names:
                continue
            chunk = row.column(video_location_column(video_key, "chunk_index"))[0].as_py()
            number = row.column(video_location_column(video_key, "file_index"))[0].as_py()
            if chunk is None or number is None:
                continue  # this episode has no frames in that video feature
            video = src / video_path.format(video_key=video_key, chunk_index=chunk, file_index=number)
            if not video.exists():
                raise LeRobotFormatError(video, f"video of episode {source_index} is missing", "restore the videos/ folder")
            videos[video_key] = video
        extra_features = _stored_features(features, set(table.column_names) | set(videos))
        incoming.append(
            IncomingEpisode(
                table=table,
                source=source,
                meta_extra=_meta_extra(row, set(data.column_names)),
                videos=videos,
                features=extra_features,
            )
        )
        mapping.append(EpisodeMapping(source_index, table.column(EPISODE_ID)[0].as_py(), filled))

    report = dataset.ingest_tables(incoming, known_robots, quarantine_dir, layout=_source_layout(info))
    mapping_file = _write_mapping(dataset, src, info, robot_id, mapping) if report.added else None
    return LeRobotImport(src, report, tuple(mapping), mapping_file)


def _write_mapping(
    dataset: EpisodeDataset, src: Path, info: dict[str, Any], robot_id: str, mapping: list[EpisodeMapping]
) -> Path:
    body = {
        "source": str(src.resolve()),
        "source_fps": info["fps"],
        "source_robot_type": info.get("robot_type"),
        "robot_id": robot_id,
        "policy_version": IMPORT_POLICY_VERSION,
        "episodes": [
            {"source_episode_index": m.source_episode_index, "episode_id": m.episode_id, "filled": list(m.filled)}
            for m in mapping
        ],
    }
    text = json.dumps(body, indent=2)
    path = dataset.root / IMPORTS_DIR / f"lerobot-{hashlib.sha256(text.encode()).hexdigest()[:16]}.json"
    atomic_write_text(path, text)
    return path


# ------------------------------------------------------------------------------------ export


def _conform(table: pa.Table, schema: pa.Schema) -> pa.Table:
    """Add the columns other data files have (as nulls) so every file shares one schema."""
    columns = [
        table.column(f.name).cast(f.type) if f.name in table.column_names else pa.nulls(table.num_rows, f.type)
        for f in schema
    ]
    return pa.Table.from_arrays(columns, schema=schema)


def export_lerobot(dataset: EpisodeDataset, dst_dir: Path) -> LeRobotExport:
    """Write ``dataset`` as a LeRobot v3 folder at ``dst_dir`` (which must not exist or be empty).

    Written to a sibling temp folder first and renamed into place, so a crash leaves no
    half-written export.
    """
    dst = Path(dst_dir)
    if dst.exists() and any(dst.iterdir()):
        raise LeRobotFormatError(dst, "export folder is not empty", "choose a new folder (export never overwrites)")
    meta = dataset.episodes_meta()
    if meta is None:
        raise LeRobotFormatError(dataset.root, "the episode dataset is empty", "ingest episodes before exporting")
    tmp = dst.with_name(dst.name + ".export-tmp")
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir(parents=True)

    files = dataset.data_files()
    schema = pa.unify_schemas([pq.read_schema(p) for p in files], promote_options="permissive")
    schema = schema.remove_metadata()
    for path in files:
        out = tmp / path.relative_to(dataset.root)
        out.parent.mkdir(parents=True, exist_ok=True)
        pq.write_table(_conform(pq.read_table(path), schema), out, compression=dataset.cfg.compression)

    videos = set()
    for name in meta.column_names:
        if name.startswith("videos/") and name.endswith("/chunk_index"):
            key = name[len("videos/") : -len("/chunk_index")]
            chunks = meta.column(name).to_pylist()
            numbers = meta.column(video_location_column(key, "file_index")).to_pylist()
            videos |= {(key, c, f) for c, f in zip(chunks, numbers) if c is not None and f is not None}
    for key, chunk, number in sorted(videos):
        rel = VIDEO_PATH.format(video_key=key, chunk_index=chunk, file_index=number)
        (tmp / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(dataset.root / rel, tmp / rel)

    # the export's episodes table is one file: every row says so
    for column in ("meta/episodes/chunk_index", "meta/episodes/file_index"):
        if column in meta.column_names:
            meta = meta.set_column(meta.column_names.index(column), column, pa.array([0] * meta.num_rows, pa.int64()))
    (tmp / EPISODES_META_PATH).parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(meta, tmp / EPISODES_META_PATH, compression=dataset.cfg.compression)
    shutil.copyfile(dataset.root / TASKS_PATH, tmp / TASKS_PATH)
    (tmp / STATS_PATH).write_text(json.dumps(stats_from_episodes_meta(meta), indent=4))
    (tmp / INFO_PATH).write_text(json.dumps(dataset.info(), indent=4))
    if dst.exists():
        dst.rmdir()
    os.replace(tmp, dst)
    return LeRobotExport(dst, dataset.num_episodes, dataset.num_frames, len(files), len(videos))


__all__ = [
    "EpisodeMapping",
    "LeRobotExport",
    "LeRobotFormatError",
    "LeRobotImport",
    "export_lerobot",
    "import_lerobot",
]
