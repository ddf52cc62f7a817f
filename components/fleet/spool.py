"""A robot's write-ahead spool: every finished episode is on local disk before it is uploaded.

    finish episode k -> pending/<k>.<episode_id>.<content_hash>.arrow   (temp + fsync + rename)
                        (an episode with cameras: camera_wire.py's episode body, its table and
                         frames in one file, so they are durable and uploaded together)
    upload answered "stored" -> ledger.jsonl line (fsync; when it was spooled and acked) -> pending file removed
    upload answered 4xx      -> rejected/<file> + <file>.reason.json (kept for the operator)
    pending file unreadable  -> unreadable/<file> + <file>.reason.json (kept; the uploader goes on)

A crash at any point loses nothing: a pending file is uploaded again (the ingest service dedupes
by id + content), a ledger line written twice is read once. ``next_index`` continues numbering
after a restart. Episode ids are drawn from the spool's random ``epoch`` (``epoch`` file, made
once per spool), so a robot whose local state was lost (re-imaged) starts a new epoch and never
reuses an id that already names stored content.
"""

from __future__ import annotations

import fcntl
import json
import os
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

import pyarrow as pa

from components.episodes.rows import episode_content_hash
from components.fsio import atomic_write_bytes, fsync_dir

PENDING = "pending"
REJECTED = "rejected"
UNREADABLE = "unreadable"
EPOCH = "epoch"
AGENT_LOCK = "agent.lock"
REASON_SUFFIX = ".reason.json"
EPOCH_BITS = 63
LEDGER = "ledger.jsonl"
SUFFIX = ".arrow"


def content_hash(table: pa.Table) -> str:
    """The hash the episode dataset stores for this episode (no carried meta): lets anyone check
    that what was stored is exactly what the robot finished."""
    return episode_content_hash(table)


class SpoolBusy(RuntimeError):
    """Another live process is this spool's agent."""


@dataclass(frozen=True)
class SpooledEpisode:
    index: int
    episode_id: str
    content_hash: str
    path: Path

    @property
    def name(self) -> str:
        return self.path.name


@dataclass(frozen=True)
class LedgerEntry:
    index: int
    episode_id: str
    content_hash: str
    outcome: str  # added | duplicate | rejected
    finished_at: float | None = None  # wall clock: the episode was spooled (older ledgers: None)
    acked_at: float | None = None  # wall clock: the service's answer was recorded


def _time(value: object) -> float | None:
    return float(value) if isinstance(value, (int, float)) else None


def _parse(path: Path) -> SpooledEpisode | None:
    parts = path.name[: -len(SUFFIX)].split(".") if path.name.endswith(SUFFIX) else []
    if len(parts) != 3 or not parts[0].isdigit():
        return None
    return SpooledEpisode(int(parts[0]), parts[1], parts[2], path)


class Spool:
    """One robot's spool folder."""

    def __init__(self, folder: Path) -> None:
        self.folder = Path(folder)
        self.pending_dir = self.folder / PENDING
        self.rejected_dir = self.folder / REJECTED
        self.unreadable_dir = self.folder / UNREADABLE
        self.ledger_path = self.folder / LEDGER
        for folder in (self.pending_dir, self.rejected_dir, self.unreadable_dir):
            folder.mkdir(parents=True, exist_ok=True)
        self.epoch = self._epoch()

    def _epoch(self) -> int:
        """This spool's random epoch: made once, read ever after (a lost spool gets a new one)."""
        path = self.folder / EPOCH
        try:
            return int(path.read_text().strip())
        except FileNotFoundError:
            pass
        except ValueError:
            raise ValueError(f"{path}: not an integer epoch; restore it from a backup, or delete it to start a new epoch") from None
        # create-if-absent, atomically: a full temp file hard-linked into place (first one wins)
        tmp = path.with_name(f".{EPOCH}.{uuid.uuid4().hex}.tmp")
        atomic_write_bytes(tmp, str(uuid.uuid4().int >> (128 - EPOCH_BITS)).encode())
        try:
            os.link(tmp, path)
            fsync_dir(self.folder)
        except FileExistsError:
            pass
        finally:
            tmp.unlink(missing_ok=True)
        return int(path.read_text().strip())

    def claim(self) -> int:
        """Become this spool's only agent (an flock held until the process ends), or raise.

        Two agents on one spool would number episodes alike and upload one id with two contents.
        """
        fd = os.open(self.folder / AGENT_LOCK, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise SpoolBusy(f"{self.folder}: another agent runs on this spool; one agent per robot (`fleetloop fleet status`)") from None
        return fd

    def write(self, index: int, episode_id: str, content_hash: str, data: bytes) -> SpooledEpisode:
        """Durably keep one finished episode (the write-ahead step)."""
        path = self.pending_dir / f"{index:08d}.{episode_id}.{content_hash}{SUFFIX}"
        atomic_write_bytes(path, data)
        return SpooledEpisode(index, episode_id, content_hash, path)

    def pending(self) -> list[SpooledEpisode]:
        items = (_parse(p) for p in self.pending_dir.iterdir())
        return sorted((i for i in items if i is not None), key=lambda i: i.index)

    def _append_ledger(self, item: SpooledEpisode, outcome: str, finished_at: float | None = None) -> None:
        line = json.dumps(
            {"index": item.index, "episode_id": item.episode_id, "content_hash": item.content_hash, "outcome": outcome,
             "finished_at": finished_at, "acked_at": time.time()}
        )
        with open(self.ledger_path, "a") as ledger:
            ledger.write(line + "\n")
            ledger.flush()
            os.fsync(ledger.fileno())

    def ack(self, item: SpooledEpisode, outcome: str) -> None:
        """The service stored it: record that (with when it was spooled: the pending file's mtime,
        which the rename into pending/ kept), then drop the local copy."""
        try:
            finished_at: float | None = item.path.stat().st_mtime
        except OSError:
            finished_at = None
        self._append_ledger(item, outcome, finished_at)
        item.path.unlink(missing_ok=True)
        fsync_dir(self.pending_dir)

    def reject(self, item: SpooledEpisode, detail: dict) -> Path:
        """The service refused it for good: keep it aside with the service's reason."""
        target = self.rejected_dir / item.name
        atomic_write_bytes(target.with_name(target.name + REASON_SUFFIX), json.dumps(detail, indent=2).encode())
        os.replace(item.path, target)
        fsync_dir(self.rejected_dir)
        self._append_ledger(item, "rejected")
        return target

    def set_aside_unreadable(self, item: SpooledEpisode, reason: str) -> Path:
        """A pending entry that cannot be read: keep it (and why) out of the upload queue."""
        target = self.unreadable_dir / item.name
        atomic_write_bytes(target.with_name(target.name + REASON_SUFFIX), json.dumps({"reason": reason}, indent=2).encode())
        os.replace(item.path, target)
        fsync_dir(self.unreadable_dir)
        return target

    def ledger(self) -> list[LedgerEntry]:
        """Ledger entries, first occurrence of each episode (a torn last line is ignored)."""
        if not self.ledger_path.exists():
            return []
        entries: dict[str, LedgerEntry] = {}
        for line in self.ledger_path.read_text().splitlines():
            try:
                raw = json.loads(line)
                entry = LedgerEntry(
                    int(raw["index"]), str(raw["episode_id"]), str(raw["content_hash"]), str(raw["outcome"]),
                    _time(raw.get("finished_at")), _time(raw.get("acked_at")),
                )
            except (ValueError, KeyError, TypeError):
                continue
            entries.setdefault(entry.episode_id, entry)
        return list(entries.values())

    def finished(self) -> dict[str, str]:
        """Every episode this robot finished: episode_id -> content hash (pending, stored, rejected)."""
        done = {e.episode_id: e.content_hash for e in self.ledger()}
        done.update({p.episode_id: p.content_hash for p in self.pending()})
        for item in self._set_aside():
            done[item.episode_id] = item.content_hash
        return done

    def _set_aside(self) -> list[SpooledEpisode]:
        paths = [*self.rejected_dir.glob(f"*{SUFFIX}"), *self.unreadable_dir.glob(f"*{SUFFIX}")]
        return [i for i in (_parse(p) for p in paths) if i is not None]

    def next_index(self) -> int:
        indices = [e.index for e in self.ledger()] + [p.index for p in self.pending()]
        indices += [i.index for i in self._set_aside()]
        return max(indices) + 1 if indices else 0
