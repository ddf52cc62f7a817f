"""An episode file's camera streams: one mp4 per camera beside the table, as a robot uploads them.

    <folder>/<stem>.parquet                   the episode's frame table (or .arrow / .arrows)
    <folder>/<stem>.<camera key>.mp4          that episode's frames of one camera, frame i at i / fps,
                                              e.g. robot-0001_<uuid>.observation.images.scene.mp4

Which cameras an episode has: the table names them in its schema metadata (``CAMERAS_METADATA``,
a JSON list, ``[]`` for a state-only episode), so a sidecar that never arrived is told from a
camera the episode does not have (validation quarantines it: "video file ... is missing"). A
table without that entry (an uploader that writes no metadata) has the sidecars found beside it,
``<stem>.observation.images.*.mp4``: a folder listing, paid only by such files (a listing per
file of a 10k-file folder would make reading it quadratic).

The writer encodes the sidecars first and renames the table into place last, so a reader that
sees a table sees its videos whole. A sidecar without its table is never read as an episode
(ingest expands a folder by the table suffixes only) and is left where it is: with the table
written last, that is an upload still under way, which a later ingest takes whole.
"""

from __future__ import annotations

import glob
import json
from collections.abc import Iterable
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from components.config import EpisodesConfig
from components.episodes.record import CAMERA_KEY_PREFIX, Episode
from components.episodes.encoder_process import encode_episodes
from components.fsio import atomic_path

SIDECAR_SUFFIX = ".mp4"
CAMERAS_METADATA = b"fleetloop.cameras"  # the table's schema metadata: JSON list of its camera keys


def is_sidecar_key(key: str) -> bool:
    """A camera key a sidecar may carry: ``observation.images.<camera>``, one file name (so
    every sidecar is found by ``found_sidecars``, e.g. to go to quarantine with its table)."""
    return key.startswith(CAMERA_KEY_PREFIX) and len(key) > len(CAMERA_KEY_PREFIX) and "/" not in key


def sidecar_path(episode_path: Path, key: str) -> Path:
    """Where camera ``key`` of the episode file ``episode_path`` lies: ``<stem>.<key>.mp4``."""
    episode_path = Path(episode_path)
    return episode_path.with_name(f"{episode_path.stem}.{key}{SIDECAR_SUFFIX}")


def found_sidecars(episode_path: Path) -> dict[str, Path]:
    """The sidecars present beside ``episode_path`` (``<stem>.observation.images.*.mp4``), by key."""
    episode_path = Path(episode_path)
    prefix = f"{episode_path.stem}."
    pattern = glob.escape(prefix) + glob.escape(CAMERA_KEY_PREFIX) + "*" + SIDECAR_SUFFIX
    return {p.name[len(prefix) : -len(SIDECAR_SUFFIX)]: p for p in sorted(episode_path.parent.glob(pattern))}


def declared_cameras(table: pa.Table) -> tuple[str, ...] | None:
    """The camera keys a table's schema metadata names; None without the entry. Raises
    ``ValueError`` when the entry is not a JSON list of strings."""
    raw = (table.schema.metadata or {}).get(CAMERAS_METADATA)
    if raw is None:
        return None
    try:
        keys = json.loads(raw)
    except ValueError:
        keys = None
    if not isinstance(keys, list) or not all(isinstance(k, str) and is_sidecar_key(k) for k in keys):
        raise ValueError(f"schema metadata {CAMERAS_METADATA.decode()} is {raw[:80]!r}, not a JSON list of "
                         f"camera keys ({CAMERA_KEY_PREFIX}<camera>)")
    return tuple(keys)


def without_camera_metadata(table: pa.Table) -> pa.Table:
    """The table without the cameras entry: it describes the upload, not the frames stored."""
    metadata = {k: v for k, v in (table.schema.metadata or {}).items() if k != CAMERAS_METADATA}
    return table.replace_schema_metadata(metadata or None)


def episode_sidecars(episode_path: Path, table: pa.Table) -> dict[str, Path]:
    """Each camera of an episode file: the declared ones at their sidecar paths, present or not
    (a missing one fails validation); without a declaration, the sidecars found beside it."""
    declared = declared_cameras(table)
    if declared is None:
        return found_sidecars(episode_path)
    return {key: sidecar_path(episode_path, key) for key in declared}


def with_camera_metadata(table: pa.Table, keys: Iterable[str]) -> pa.Table:
    """``table`` naming its camera ``keys`` (none: ``[]``) in its schema metadata."""
    entry = json.dumps(sorted(keys)).encode()
    return table.replace_schema_metadata({**(table.schema.metadata or {}), CAMERAS_METADATA: entry})


def write_sidecars(ep: Episode, episode_path: Path, cfg: EpisodesConfig) -> list[Path]:
    """Encode each of ``ep.cameras`` into its sidecar (one episode, frame i at i / ``cfg.fps``,
    ``cfg.video``'s encoder settings), each renamed into place whole."""
    paths = []
    for key, frames in sorted(ep.cameras.items()):
        if not is_sidecar_key(key):
            raise ValueError(f"episode {ep.episode_id}: camera key {key!r} is not {CAMERA_KEY_PREFIX}<camera>")
        path = sidecar_path(episode_path, key)
        with atomic_path(path, durable=False) as tmp:
            encode_episodes(tmp, [frames], cfg.fps, cfg.video)
        paths.append(path)
    return paths


def write_table_last(table: pa.Table, path: Path) -> Path:
    """The table renamed into place whole, after its sidecars. Not fsynced: the rename orders what
    a concurrent reader sees; the files are a collection's output, not the dataset's commit."""
    with atomic_path(path, durable=False) as tmp:
        pq.write_table(table, tmp)
    return Path(path)
