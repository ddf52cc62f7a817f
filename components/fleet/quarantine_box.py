"""The ingest service's quarantine: rejected upload bytes kept with their reason, within a size cap.

    keep(data, name, error) -> reason file first, then the bytes (each temp + fsync + rename,
                               mode 0644) -> QuarantinedFile
      over runtime.quarantine_max_bytes, or the disk refuses -> nothing kept (None) and the
      caller says so in its answer; the robot keeps its own copy in spool/<robot>/rejected/

A quarantined upload is never a 0-byte file and never lacks its reason file: a failed write leaves
nothing behind. The folder's size is measured once at start and then counted as files are added
(other writers, e.g. the batch ingest, are picked up at the next start).
"""

from __future__ import annotations

import json
import logging
import os
import threading
from datetime import datetime, timezone
from pathlib import Path

from components.episodes.quarantine import REASON_SUFFIX, QuarantinedFile
from components.episodes.validation import EpisodeValidationError
from components.fsio import atomic_write_bytes

log = logging.getLogger(__name__)

FILE_MODE = 0o644
MAX_NAME_ATTEMPTS = 1000  # upload names carry a random id: a clash is already rare


def folder_bytes(folder: Path) -> int:
    """Bytes held by the regular files directly in ``folder``."""
    if not folder.exists():
        return 0
    return sum(entry.stat().st_size for entry in os.scandir(folder) if entry.is_file(follow_symlinks=False))


class BoundedQuarantine:
    """Keeps rejected bytes + reason files in ``folder`` while the folder stays under ``max_bytes``."""

    def __init__(self, folder: Path, max_bytes: int) -> None:
        self.folder = Path(folder)
        self.max_bytes = max_bytes
        self.folder.mkdir(parents=True, exist_ok=True)
        self.used = folder_bytes(self.folder)
        self.refused = 0  # uploads not kept (cap or disk)
        self._lock = threading.Lock()

    def keep(self, data: bytes, name: str, error: EpisodeValidationError) -> QuarantinedFile | None:
        """Keep ``data`` under ``name`` with the reason; None when the cap or the disk says no."""
        record = {
            "source": error.source, "field": error.field, "reason": error.reason, "fix": error.fix,
            "time": datetime.now(timezone.utc).isoformat(), "file": name, "bytes": len(data),
        }
        body = json.dumps(record, indent=2).encode()
        with self._lock:
            if self.used + len(data) + len(body) > self.max_bytes:
                self.refused += 1
                log.warning(
                    "quarantine %s is at %d of %d bytes: %s (%d bytes) not kept (raise runtime.quarantine_max_bytes "
                    "or empty the folder)", self.folder, self.used, self.max_bytes, name, len(data),
                )
                return None
            target = reason_path = None
            try:
                target = self._free_name(name)
                reason_path = target.with_name(target.name + REASON_SUFFIX)
                atomic_write_bytes(reason_path, body, mode=FILE_MODE)
                atomic_write_bytes(target, data, mode=FILE_MODE)
            except OSError as exc:
                for path in (reason_path, target):
                    if path is not None:
                        path.unlink(missing_ok=True)
                self.refused += 1
                log.error("could not quarantine %s (%s): not kept", name, exc)
                return None
            self.used += len(data) + len(body)
        return QuarantinedFile(target, reason_path, error.source, error.field, error.reason, error.fix, record["time"])

    def _free_name(self, name: str) -> Path:
        """``name``, or ``<stem>-N<ext>`` if taken (never overwrite an earlier quarantined file)."""
        stem, ext = os.path.splitext(name)
        for attempt in range(MAX_NAME_ATTEMPTS):
            candidate = self.folder / (name if attempt == 0 else f"{stem}-{attempt}{ext}")
            if not candidate.exists() and not candidate.with_name(candidate.name + REASON_SUFFIX).exists():
                return candidate
        raise OSError(f"{self.folder}: no free quarantine name for {name!r} after {MAX_NAME_ATTEMPTS} tries; empty the folder")
