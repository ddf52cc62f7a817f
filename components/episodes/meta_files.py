"""The episodes table as LeRobot v3 stores it: ``meta/episodes/chunk-XXX/file-XXX.parquet``.

Each ingest appends one new file holding only its episodes' rows, so writing the table costs
what the batch costs, not what is stored; the new file appearing (temp + ``os.replace``) is the
ingest's commit point. Readers take the union of the files in (chunk, file) order.

Reading every file on every open would make opening cost grow with the dataset, so a process
keeps what it has read (``read_episodes_table``): a later open reads only files it has not seen,
and rereads everything if a file it saw has changed or vanished (a replaced dataset).
"""

from __future__ import annotations

import re
import threading
from dataclasses import dataclass
from pathlib import Path

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


def _read(path: Path) -> pa.Table:
    # One read of the whole file: a writer may os.replace it between pyarrow's reads of a path.
    return pq.read_table(pa.BufferReader(path.read_bytes()))


_cache: dict[Path, tuple[tuple[MetaFile, ...], pa.Table]] = {}
_lock = threading.Lock()


def read_episodes_table(root: Path) -> pa.Table | None:
    """The union of the episodes-table files (None when there are none), reading only files
    this process has not read before."""
    key = Path(root).resolve()
    files = tuple(list_meta_files(key))
    if not files:
        return None
    with _lock:
        seen, table = _cache.get(key, ((), None))
    if table is None or files[: len(seen)] != seen:
        seen, parts = (), []
    else:
        parts = [table]
    parts += [_read(m.path) for m in files[len(seen) :]]
    table = parts[0] if len(parts) == 1 else pa.concat_tables(parts, promote_options="permissive")
    with _lock:
        _cache[key] = (files, table)
    return table
