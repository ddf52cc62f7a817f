"""The episodes table as LeRobot v3 stores it: ``meta/episodes/chunk-XXX/file-XXX.parquet``.

Each ingest appends one new file holding only its episodes' rows, so writing the table costs
what the batch costs, not what is stored; the new file appearing (temp + ``os.replace``) is the
ingest's commit point. Readers take the union of the files in (chunk, file) order.

One file per ingest would make a process's first open read thousands of files (1,003 files and
8 s at 10M frames), so the writer merges the newest small files into one once there are
``episodes.meta_merge_files`` of them (``tail_to_merge``; LeRobot's writer likewise fills a file
up to a size): the merged file is written under a new, higher number, then the merged ones are
removed. A reader that comes between the two sees some episodes twice and keeps the newest
file's row (``dedupe_episodes``), so a merge that dies half-way loses nothing and changes nothing.

A process keeps what it has read, file by file (``read_episodes_table``): a later open reads
only files it has not seen (or that changed), so reopening costs a listing, not a reread; and
it keeps the last union, which an open after an ingest extends by the new file.
"""

from __future__ import annotations

import re
import threading
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

META_DIR = "meta/episodes"
META_FILE = META_DIR + "/chunk-{chunk_index:03d}/file-{file_index:03d}.parquet"
_NAME = re.compile(r"chunk-(\d+)/file-(\d+)\.parquet$")


@dataclass(frozen=True)
class MetaFile:
    chunk: int
    file: int
    path: Path
    size: int
    mtime_ns: int


def list_meta_files(root: Path) -> list[MetaFile]:
    """The committed episodes-table files under ``root``, in (chunk, file) order."""
    found = []
    for path in (root / META_DIR).glob("chunk-*/file-*.parquet"):
        match = _NAME.search(path.as_posix())
        if match is None:
            continue
        try:
            stat = path.stat()
        except FileNotFoundError:  # replaced between listing and stat: the next open sees it
            continue
        found.append(MetaFile(int(match[1]), int(match[2]), path, stat.st_size, stat.st_mtime_ns))
    return sorted(found, key=lambda m: (m.chunk, m.file))


def meta_file_path(root: Path, number: int, chunk_size: int) -> Path:
    chunk, file = divmod(number, chunk_size)
    return root / META_FILE.format(chunk_index=chunk, file_index=file)


def next_meta_number(files: list[MetaFile], chunk_size: int) -> int:
    return max((m.chunk * chunk_size + m.file for m in files), default=-1) + 1


def read_meta_file(path: Path) -> pa.Table:
    # One read of the whole file: a writer may os.replace it between pyarrow's reads of a path.
    return pq.read_table(pa.BufferReader(path.read_bytes()))


def tail_to_merge(files: list[MetaFile], merge_files: int, small_bytes: int) -> list[MetaFile]:
    """The newest run of files each under ``small_bytes``, when it holds at least ``merge_files``
    files (else []). Only a trailing run is merged, so the merged file, numbered after every
    other, keeps the union in episode order."""
    run: list[MetaFile] = []
    for meta in reversed(files):
        if meta.size >= small_bytes:
            break
        run.append(meta)
    return run[::-1] if len(run) >= merge_files else []


@dataclass
class _Seen:
    """What this process has read of one root: each file's table, and the last union returned."""

    tables: dict[Path, tuple[MetaFile, pa.Table]]
    union_files: tuple[MetaFile, ...] = ()
    union: pa.Table | None = None


_cache: dict[Path, _Seen] = {}
_lock = threading.Lock()


def read_episodes_table(root: Path, episode_index: str) -> pa.Table | None:
    """The union of the episodes-table files (None when there are none), each episode once,
    reading only files this process has not read before (or that changed since). When the files
    are the ones of the last call, or those plus newer ones (an ingest's commit), the last union
    is reused or extended, so the cost follows the new files, not the stored episodes."""
    key = Path(root).resolve()
    while True:
        files = tuple(list_meta_files(key))
        if not files:
            return None
        with _lock:
            seen = _cache.get(key) or _Seen({})
        if seen.union is not None and seen.union_files == files:
            return seen.union
        known = dict(seen.tables)  # a _Seen is never changed in place, only replaced under the lock
        extends = seen.union is not None and files[: len(seen.union_files)] == seen.union_files
        todo = files[len(seen.union_files):] if extends else files
        try:
            parts = [_cached_read(meta, known) for meta in todo]
        except FileNotFoundError:  # a writer's merge removed a listed file before it was read: list again
            continue
        table = _union([seen.union] + parts if extends else parts, episode_index)
        with _lock:
            _cache[key] = _Seen({m.path: known[m.path] for m in files}, files, table)
        return table


def _union(parts: list[pa.Table], episode_index: str) -> pa.Table:
    table = parts[0] if len(parts) == 1 else pa.concat_tables(parts, promote_options="permissive")
    return dedupe_episodes(table, episode_index)


def _cached_read(meta: MetaFile, known: dict[Path, tuple[MetaFile, pa.Table]]) -> pa.Table:
    """``meta``'s table: from ``known`` when that holds this very file, else read (and added)."""
    hit = known.get(meta.path)
    if hit is None or hit[0] != meta:
        known[meta.path] = (meta, read_meta_file(meta.path))
    return known[meta.path][1]


def dedupe_episodes(table: pa.Table, episode_index: str) -> pa.Table:
    """Each episode's row from the newest file that holds it (a merge interrupted before it removed
    the files it merged leaves two), in episode order."""
    index = table.column(episode_index).to_numpy()
    if index.size < 2 or bool((np.diff(index) > 0).all()):
        return table
    last = len(index) - 1 - np.unique(index[::-1], return_index=True)[1]  # sorted by episode_index
    return table.take(pa.array(last))
