"""Move rejected episode files aside, each with a JSON reason file; nothing is dropped silently.

``quarantine/<name>`` holds the rejected bytes, ``quarantine/<name>.reason.json`` says why
(source, field, reason, fix, time). A second rejected file of the same name gets ``<stem>-1<ext>``,
``<stem>-2<ext>``, ...: an earlier quarantined file is never overwritten. An episode file's camera
sidecars (camera_files.py) go with it, renamed after the name it gets (``<name stem>.<key>.mp4``),
so they stay its own; its one reason file covers them and lists them (``sidecars``).
"""

from __future__ import annotations

import errno
import json
import os
import shutil
from dataclasses import asdict, dataclass
from datetime import datetime, timezone
from pathlib import Path

from components.episodes.camera_files import found_sidecars, sidecar_path
from components.episodes.validation import EpisodeValidationError
from components.fsio import atomic_write_text

REASON_SUFFIX = ".reason.json"
MAX_NAME_ATTEMPTS = 100_000


@dataclass(frozen=True)
class QuarantinedFile:
    """One rejected input: where it now lies, and why."""

    path: Path
    reason_path: Path
    source: str
    field: str
    reason: str
    fix: str
    time: str
    sidecars: tuple[Path, ...] = ()  # the episode's camera videos, moved with it

    def describe(self) -> str:
        return f"{self.source}: field '{self.field}': {self.reason}. Fix: {self.fix}"

    def __str__(self) -> str:
        return f"{self.path} ({self.describe()})"


def _claim_name(quarantine_dir: Path, name: str, sidecar_keys: tuple[str, ...] = ()) -> Path:
    """Create an empty file with a free name (O_EXCL, so concurrent claims never collide), one
    whose reason file and sidecars (``sidecar_keys``) are free too."""
    stem, ext = _split_name(name)
    for attempt in range(MAX_NAME_ATTEMPTS):
        candidate = quarantine_dir / (name if attempt == 0 else f"{stem}-{attempt}{ext}")
        companions = [candidate.with_name(candidate.name + REASON_SUFFIX)]
        companions += [sidecar_path(candidate, key) for key in sidecar_keys]
        if any(p.exists() for p in companions):
            continue
        try:
            fd = os.open(candidate, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
        except FileExistsError:
            continue
        os.close(fd)
        return candidate
    raise RuntimeError(f"{quarantine_dir}: no free quarantine name for {name!r}; empty the folder")


def _split_name(name: str) -> tuple[str, str]:
    path = Path(name)
    return path.name[: len(path.name) - len(path.suffix)], path.suffix


def _write_reason(target: Path, error: EpisodeValidationError, sidecars: tuple[Path, ...] = ()) -> QuarantinedFile:
    record = QuarantinedFile(
        path=target,
        reason_path=target.with_name(target.name + REASON_SUFFIX),
        source=error.source,
        field=error.field,
        reason=error.reason,
        fix=error.fix,
        time=datetime.now(timezone.utc).isoformat(),
        sidecars=sidecars,
    )
    body = {k: v for k, v in asdict(record).items() if k not in ("path", "reason_path", "sidecars")}
    body["file"] = target.name
    if sidecars:
        body["sidecars"] = [p.name for p in sidecars]
    atomic_write_text(record.reason_path, json.dumps(body, indent=2))
    return record


def _move(src: Path, dst: Path) -> None:
    """Rename, or copy + unlink across filesystems."""
    try:
        os.replace(src, dst)
    except OSError as exc:
        if exc.errno != errno.EXDEV:
            raise
        shutil.copyfile(src, dst)
        os.unlink(src)


def quarantine_file(path: Path, error: EpisodeValidationError, quarantine_dir: Path) -> QuarantinedFile:
    """Move ``path`` and its camera sidecars into ``quarantine_dir`` (never overwriting) and
    write its reason file. The episode file moves first: a crash between leaves sidecars
    without their table, which ingest never reads as an episode."""
    quarantine_dir = Path(quarantine_dir)
    quarantine_dir.mkdir(parents=True, exist_ok=True)
    sidecars = found_sidecars(path)
    target = _claim_name(quarantine_dir, Path(path).name, tuple(sidecars))
    try:
        _move(path, target)
    except OSError:
        target.unlink(missing_ok=True)
        raise
    moved = []
    for key, src in sidecars.items():
        _move(src, sidecar_path(target, key))
        moved.append(sidecar_path(target, key))
    return _write_reason(target, error, tuple(moved))


def quarantine_bytes(
    data: bytes, name: str, error: EpisodeValidationError, quarantine_dir: Path
) -> QuarantinedFile:
    """Keep rejected bytes that never were a file (an HTTP upload, an in-memory episode)."""
    quarantine_dir = Path(quarantine_dir)
    quarantine_dir.mkdir(parents=True, exist_ok=True)
    target = _claim_name(quarantine_dir, name)
    target.write_bytes(data)
    return _write_reason(target, error)


def read_reason(path: Path) -> dict[str, str]:
    """The reason record of a quarantined file (``path`` is the file or its reason file)."""
    path = Path(path)
    if not path.name.endswith(REASON_SUFFIX):
        path = path.with_name(path.name + REASON_SUFFIX)
    return json.loads(path.read_text())
