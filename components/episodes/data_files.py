"""The dataset's frame files, ``data/chunk-XXX/file-XXX.parquet``: reading them, and merging the
small ones each ingest writes into files of up to ``episodes.data_file_mb`` (LeRobot's
``data_files_size_in_mb``).

Each ingest writes one data file, so without merging the folder holds one file per ingest, and
everything that walks it grows with that count: DVC's ``dvc add`` stats, looks up and links every
file of the folder on every snapshot (0.38 s a batch at 1,000 files, 10M frames). When the writer
merges its newest episodes-table files (``meta_files.py``), it merges the data files those
episodes sit in too (``plan_data_merge``): a file only once (a merged file is marked in its schema
metadata, so a write is copied at most twice), in frame order, each merged file a contiguous
``index`` range, so readers locate an episode exactly as before. The merged episodes-table file
names the new files, and its appearance is the commit point.

The merged-away files are not deleted: they move to ``<dataset>/.superseded/`` (``supersede``),
which DVC ignores, and readers fall back to it (``read_data_file``), so a handle opened before
the merge — a trainer reading a training set — still finds every file it was told about. They
are removed ``episodes.superseded_retain_hours`` after they moved (``sweep``).
"""

from __future__ import annotations

import os
import re
import time
from dataclasses import dataclass
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from components.fsio import atomic_path

DATA_PATH = "data/chunk-{chunk_index:03d}/file-{file_index:03d}.parquet"
SUPERSEDED_DIR = ".superseded"  # inside the dataset folder; DVCIGNORE_LINES keeps DVC out of it
MERGED_KEY = b"fleetloop.merged_files"  # schema metadata of a merged file: how many it replaced
TMP_SUFFIX = ".tmp"
_NAME = re.compile(r"chunk-(\d+)/file-(\d+)\.parquet$")

Key = tuple[int, int]  # (chunk index, file index)


def data_path(root: Path, key: Key) -> Path:
    return Path(root) / DATA_PATH.format(chunk_index=key[0], file_index=key[1])


def superseded_path(root: Path, key: Key) -> Path:
    return Path(root) / SUPERSEDED_DIR / DATA_PATH.format(chunk_index=key[0], file_index=key[1])


def read_data_file(root: Path, key: Key, columns: list[str] | None = None) -> pa.Table:
    """One data file (``columns`` of it), from ``data/`` or, when a merge moved it after this
    handle read the episodes table, from ``.superseded/``."""
    try:
        return pq.read_table(data_path(root, key), columns=columns)
    except FileNotFoundError:
        pass
    try:
        return pq.read_table(superseded_path(root, key), columns=columns)
    except FileNotFoundError:
        raise FileNotFoundError(
            f"{data_path(root, key)} is missing (and not in {SUPERSEDED_DIR}/): it was merged away longer than "
            "episodes.superseded_retain_hours ago, or removed by hand; refresh() the dataset handle and read again"
        ) from None


@dataclass(frozen=True)
class DataFile:
    key: Key
    first_index: int  # the global frame index of its first row
    frames: int
    size: int  # bytes on disk
    merged: bool  # written by a merge (never merged again)


def describe(root: Path, key: Key, first_index: int, frames: int) -> DataFile:
    path = data_path(root, key)
    merged = MERGED_KEY in (pq.read_schema(path).metadata or {})
    return DataFile(key, first_index, frames, path.stat().st_size, merged)


def plan_data_merge(files: list[DataFile], max_bytes: int) -> list[list[DataFile]]:
    """Groups of two or more unmerged files to merge, each contiguous in frame order and at most
    ``max_bytes`` in all. A merged file, or a gap in the frame indexes, ends a group."""
    groups: list[list[DataFile]] = [[]]
    for item in sorted(files, key=lambda f: f.first_index):
        if item.merged or item.size >= max_bytes:
            groups.append([])
            continue
        current = groups[-1]
        if current and (
            current[-1].first_index + current[-1].frames != item.first_index
            or sum(f.size for f in current) + item.size > max_bytes
        ):
            groups.append(current := [])
        current.append(item)
    return [group for group in groups if len(group) >= 2]


def write_merged(root: Path, group: list[DataFile], key: Key, compression: str) -> None:
    """The group's rows, in frame order, as one new data file at ``key`` (temp + rename; no reader
    sees it until the episodes table names it)."""
    table = pa.concat_tables([pq.read_table(data_path(root, f.key)) for f in group], promote_options="permissive")
    metadata = {**(table.schema.metadata or {}), MERGED_KEY: str(len(group)).encode()}
    path = data_path(root, key)
    with atomic_path(path, tmp_name=path.name + TMP_SUFFIX) as tmp:
        pq.write_table(table.replace_schema_metadata(metadata), tmp, compression=compression)


def supersede(root: Path, keys: list[Key]) -> None:
    """Move merged-away files to ``.superseded/`` (same filesystem: a rename), stamped with the
    time they moved, which is what ``sweep`` ages them by."""
    for key in keys:
        target = superseded_path(root, key)
        target.parent.mkdir(parents=True, exist_ok=True)
        try:
            os.replace(data_path(root, key), target)
        except FileNotFoundError:  # moved by an earlier, interrupted merge
            continue
        os.utime(target)


def unreferenced(root: Path, referenced: set[Key], below: int, chunk_size: int) -> list[Key]:
    """Data files numbered below ``below`` that the episodes table no longer names: what a merge
    that died after its commit left in ``data/`` (a file at ``below`` or above is an ingest's
    uncommitted write, which the next ingest overwrites)."""
    found = []
    for path in (Path(root) / "data").glob("chunk-*/file-*.parquet"):
        match = _NAME.search(path.as_posix())
        if match is None:
            continue
        key = (int(match[1]), int(match[2]))
        if key not in referenced and key[0] * chunk_size + key[1] < below:
            found.append(key)
    return sorted(found)


def sweep(root: Path, retain_hours: float) -> int:
    """Remove superseded files that moved more than ``retain_hours`` ago; returns how many."""
    folder = Path(root) / SUPERSEDED_DIR
    cutoff = time.time() - retain_hours * 3600
    removed = 0
    for path in folder.glob("data/chunk-*/file-*.parquet"):
        try:
            if path.stat().st_mtime < cutoff:
                path.unlink()
                removed += 1
        except FileNotFoundError:
            continue
    return removed
