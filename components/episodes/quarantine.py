"""Move rejected episode files aside, each with a JSON reason file; nothing is dropped silently.

``quarantine/<name>`` holds the rejected bytes, ``quarantine/<name>.reason.json`` says why
(source, field, reason, fix, time). A second rejected file of the same name gets ``<stem>-1<ext>``,
``<stem>-2<ext>``, ...: an earlier quarantined file is never overwritten.
"""

from __future__ import annotations

import errno
import json
import os
import shutil
from dataclasses import asdict, dataclass
from datetime import datetime, timezone
from pathlib import Path

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

    def describe(self) -> str:
        return f"{self.source}: field '{self.field}': {self.reason}. Fix: {self.fix}"

    def __str__(self) -> str:
        return f"{self.path} ({self.describe()})"


def _claim_name(quarantine_dir: Path, name: str) -> Path:
    """Create an empty file with a free name (O_EXCL, so concurrent claims never collide)."""
    stem, ext = _split_name(name)
    for attempt in range(MAX_NAME_ATTEMPTS):
        candidate = quarantine_dir / (name if attempt == 0 else f"{stem}-{attempt}{ext}")
        reason = candidate.with_name(candidate.name + REASON_SUFFIX)
        if reason.exists():
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


def _write_reason(target: Path, error: EpisodeValidationError) -> QuarantinedFile:
    record = QuarantinedFile(
        path=target,
        reason_path=target.with_name(target.name + REASON_SUFFIX),
        source=error.source,
        field=error.field,
        reason=error.reason,
        fix=error.fix,
        time=datetime.now(timezone.utc).isoformat(),
    )
    body = {k: v for k, v in asdict(record).items() if k not in ("path", "reason_path")}
    body["file"] = target.name
    atomic_write_text(record.reason_path, json.dumps(body, indent=2))
    return record


def quarantine_file(path: Path, error: EpisodeValidationError, quarantine_dir: Path) -> QuarantinedFile:
    """Move ``path`` into ``quarantine_dir`` (never overwriting) and write its reason file."""
    quarantine_dir = Path(quarantine_dir)
    quarantine_dir.mkdir(parents=True, exist_ok=True)
    target = _claim_name(quarantine_dir, Path(path).name)
    try:
        os.replace(path, target)
    except OSError as exc:
        if exc.errno != errno.EXDEV:
            target.unlink(missing_ok=True)
            raise
        shutil.copyfile(path, target)
        os.unlink(path)
    return _write_reason(target, error)


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
