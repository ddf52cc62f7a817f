"""What is offered to the dataset and what an ingest reports: an ``IncomingEpisode`` (a table
plus where it came from, carried meta, videos and camera streams), read from a file by
``read_incoming`` (the per-file part of ingest, which flows fan out) and, once validated, a
``StagedEpisode`` (canonical frames + content hash, ``stage_batch`` / ``stage_one``); the
``IngestReport`` accounts for every input, and ``DatasetMismatchError`` refuses an import whose
fps or shapes differ from the stored episodes'."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa

from components.episodes.camera_files import episode_sidecars, without_camera_metadata
from components.episodes.fingerprint import table_fingerprints
from components.episodes.quarantine import QuarantinedFile, quarantine_file
from components.episodes.reader import consecutive_runs
from components.episodes.record import Episode
from components.episodes.rows import content_hash, episode_content_hash
from components.episodes.schema import CONTRACT_COLUMNS, episode_to_table, read_episode_file
from components.episodes.validation import (
    WHOLE_FILE,
    EpisodeValidationError,
    ValidatedBatch,
    check_upload_columns,
)
from components.episodes.video import EpisodeSpan
from components.episodes.video_validation import CameraStream


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
class StagedEpisode:
    incoming: IncomingEpisode
    episode: Episode
    table: pa.Table  # canonical: contract columns (fixed-size vectors) + extra frame columns
    content_hash: str
    cameras: Mapping[str, np.ndarray] = field(default_factory=dict)  # checked frames, to encode


@dataclass(frozen=True)
class EncodedCamera:
    """One camera key of an ingest: the video file its episodes went to and each one's span."""

    slot: tuple[int, int]  # (chunk_index, file_index)
    spans: dict[int, EpisodeSpan]  # position in the batch -> where that episode lies in the file
    feature: dict[str, Any]  # the info.json entry



def read_incoming(path: Path, quarantine_dir: Path) -> IncomingEpisode | QuarantinedFile:
    """Read one incoming episode file, with its cameras (the sidecar videos beside it:
    camera_files.py); an unreadable one goes to quarantine, sidecars and all, with its reason.

    Reading is the per-file part of ingest, so flows can fan it out (and cache it on the file's
    content) before one writer validates and stores the batch with ``ingest_tables``, which
    decodes and checks the sidecars (video_validation.py).
    """
    try:
        table = read_episode_file(path)
        cameras = episode_sidecars(path, table)
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
    return IncomingEpisode(table=without_camera_metadata(table), source=str(path), origin=Path(path), cameras=cameras)


def schema_runs(tables: list[pa.Table]) -> list[list[int]]:
    """Consecutive tables of one schema (validated together)."""
    return consecutive_runs(len(tables), lambda a, b: tables[b].schema.equals(tables[a].schema))



def stage_batch(items: list[IncomingEpisode], batch: ValidatedBatch) -> list[StagedEpisode]:
    """``stage_one`` for a batch validated together; the frames' fingerprints in one pass."""
    frames = table_fingerprints(batch.frames, batch.bounds)
    out = []
    for i, (item, episode) in enumerate(zip(items, batch.episodes)):
        canonical = batch.frames.slice(int(batch.bounds[i]), episode.length)
        out.append(StagedEpisode(item, episode, canonical, content_hash(frames[i], item.meta_extra)))
    return out



def stage_one(item: IncomingEpisode, episode: Episode, table: pa.Table) -> StagedEpisode:
    canonical = episode_to_table(dataclasses.replace(episode, extras={}))
    for name in table.column_names:
        if name not in CONTRACT_COLUMNS:
            canonical = canonical.append_column(table.schema.field(name), table.column(name))
    return StagedEpisode(item, episode, canonical, episode_content_hash(canonical, item.meta_extra))

