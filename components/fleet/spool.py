"""A robot's write-ahead spool: every finished episode is on local disk before it is uploaded.

    finish episode k -> pending/<k>.<episode_id>.<content_hash>.arrow   (temp + fsync + rename)
    upload answered "stored" -> ledger.jsonl line (fsync) -> pending file removed
    upload answered 4xx      -> rejected/<file> + <file>.reason.json (kept for the operator)

A crash at any point loses nothing: a pending file is uploaded again (the ingest service dedupes
by id + content), a ledger line written twice is read once. ``next_index`` continues numbering
after a restart, so an episode id is never reused for different content.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

import pyarrow as pa

from components.episodes.dataset import episode_content_hash
from components.fleet.layout import atomic_write, fsync_dir

PENDING = "pending"
REJECTED = "rejected"
LEDGER = "ledger.jsonl"
SUFFIX = ".arrow"


def content_hash(table: pa.Table) -> str:
    """The hash the episode dataset stores for this episode (no carried meta): lets anyone check
    that what was stored is exactly what the robot finished."""
    return episode_content_hash(table)


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
        self.ledger_path = self.folder / LEDGER
        self.pending_dir.mkdir(parents=True, exist_ok=True)
        self.rejected_dir.mkdir(parents=True, exist_ok=True)

    def write(self, index: int, episode_id: str, content_hash: str, data: bytes) -> SpooledEpisode:
        """Durably keep one finished episode (the write-ahead step)."""
        path = self.pending_dir / f"{index:08d}.{episode_id}.{content_hash}{SUFFIX}"
        atomic_write(path, data)
        return SpooledEpisode(index, episode_id, content_hash, path)

    def pending(self) -> list[SpooledEpisode]:
        items = (_parse(p) for p in self.pending_dir.iterdir())
        return sorted((i for i in items if i is not None), key=lambda i: i.index)

    def _append_ledger(self, item: SpooledEpisode, outcome: str) -> None:
        line = json.dumps(
            {"index": item.index, "episode_id": item.episode_id, "content_hash": item.content_hash, "outcome": outcome}
        )
        with open(self.ledger_path, "a") as ledger:
            ledger.write(line + "\n")
            ledger.flush()
            os.fsync(ledger.fileno())

    def ack(self, item: SpooledEpisode, outcome: str) -> None:
        """The service stored it: record that, then drop the local copy."""
        self._append_ledger(item, outcome)
        item.path.unlink(missing_ok=True)
        fsync_dir(self.pending_dir)

    def reject(self, item: SpooledEpisode, detail: dict) -> Path:
        """The service refused it for good: keep it aside with the service's reason."""
        target = self.rejected_dir / item.name
        atomic_write(target.with_name(target.name + ".reason.json"), json.dumps(detail, indent=2).encode())
        os.replace(item.path, target)
        fsync_dir(self.rejected_dir)
        self._append_ledger(item, "rejected")
        return target

    def ledger(self) -> list[LedgerEntry]:
        """Ledger entries, first occurrence of each episode (a torn last line is ignored)."""
        if not self.ledger_path.exists():
            return []
        entries: dict[str, LedgerEntry] = {}
        for line in self.ledger_path.read_text().splitlines():
            try:
                raw = json.loads(line)
                entry = LedgerEntry(int(raw["index"]), str(raw["episode_id"]), str(raw["content_hash"]), str(raw["outcome"]))
            except (ValueError, KeyError, TypeError):
                continue
            entries.setdefault(entry.episode_id, entry)
        return list(entries.values())

    def finished(self) -> dict[str, str]:
        """Every episode this robot finished: episode_id -> content hash (pending, stored, rejected)."""
        done = {e.episode_id: e.content_hash for e in self.ledger()}
        done.update({p.episode_id: p.content_hash for p in self.pending()})
        for path in self.rejected_dir.glob(f"*{SUFFIX}"):
            item = _parse(path)
            if item is not None:
                done[item.episode_id] = item.content_hash
        return done

    def next_index(self) -> int:
        indices = [e.index for e in self.ledger()] + [p.index for p in self.pending()]
        indices += [i.index for i in (_parse(p) for p in self.rejected_dir.glob(f"*{SUFFIX}")) if i is not None]
        return max(indices) + 1 if indices else 0
