"""The dataset's head on its DVC remote, so that any host can work on the newest snapshot.

A DVC remote is content-addressed: it holds every pushed snapshot but not which one is current.
With ``episodes.dvc_remote`` set, the remote is where the episode dataset lives, and a root's
``datasets/episodes`` is a checkout of it (a cache: losing it loses nothing published):

    <remote>/fleetloop-head.json   {"snapshot": "<md5>.dir", "episodes": N, "history": [older heads]}

- ``publish_head`` (every ingest, after the push): the snapshot becomes the head. It refuses when
  the remote's head moved since this root last synced (another host ingested meanwhile).
- ``sync_dataset`` (before an ingest or a training reads the dataset): fast-forwards the root to
  the head, pulling the snapshot; a root ahead of the head (a push that failed) is left for the
  next ingest to publish; a root whose unpublished episodes and the head diverged is an error
  naming both snapshots and the fix, and nothing is overwritten.

``<root>/datasets/episodes.head.json`` records the head the root last synced or published (its
base). Losing it is safe: the head's history still says whether the local snapshot is older.
One host ingests at a time (as with the segment store); the checks above catch a second one.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path

from components.episodes.snapshot import (
    DvcRemote,
    pull_snapshot,
    read_snapshot,
    write_snapshot_file,
)
from components.fsio import atomic_write_bytes

HEAD_OBJECT = "fleetloop-head.json"


class DatasetRemoteError(RuntimeError):
    """The remote's head could not be read or written; nothing local was changed."""


class DatasetDivergedError(RuntimeError):
    """The root's dataset and the remote's head both moved; the message names the fix."""


@dataclass(frozen=True)
class DatasetHead:
    snapshot: str  # DVC md5 of the dataset folder ("...dir")
    episodes: int
    history: tuple[dict, ...] = field(default=())  # older heads, oldest first: {"snapshot", "episodes"}

    def episodes_at(self, snapshot: str) -> int | None:
        """Episodes in ``snapshot`` if it is this head or one before it, else None."""
        if snapshot == self.snapshot:
            return self.episodes
        return next((h["episodes"] for h in self.history if h["snapshot"] == snapshot), None)

    def advanced_to(self, snapshot: str, episodes: int) -> DatasetHead:
        return DatasetHead(snapshot, episodes, (*self.history, {"snapshot": self.snapshot, "episodes": self.episodes}))


@dataclass(frozen=True)
class SyncResult:
    action: str  # "none" (no remote or no head), "current", "pulled", "ahead" (root_state)
    snapshot: str  # the root's snapshot after the sync ("" = none)
    episodes: int


def _filesystem(remote: DvcRemote):
    """(fsspec filesystem, path of the head object) for an ``s3://`` or path remote."""
    if remote.url.startswith("s3://"):
        import s3fs

        client = {"endpoint_url": remote.endpoint} if remote.endpoint else {}
        return s3fs.S3FileSystem(client_kwargs=client, skip_instance_cache=True), f"{remote.url[5:].rstrip('/')}/{HEAD_OBJECT}"
    from fsspec.implementations.local import LocalFileSystem

    return LocalFileSystem(auto_mkdir=True), str(Path(remote.url) / HEAD_OBJECT)


def _remote_failed(remote: DvcRemote, what: str, exc: Exception) -> DatasetRemoteError:
    where = remote.url + (f" at {remote.endpoint}" if remote.endpoint else "")
    reason = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
    return DatasetRemoteError(
        f"could not {what} the dataset head on the DVC remote {where} ({reason}); nothing local was changed. Check "
        "episodes.dvc_remote / dvc_remote_endpoint and the keys (AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY), then run again"
    )


def read_head(remote: DvcRemote) -> DatasetHead | None:
    """The remote's head, or None before the first publish."""
    fs, path = _filesystem(remote)
    try:
        if not fs.exists(path):
            return None
        body = json.loads(fs.cat_file(path))
    except Exception as exc:
        raise _remote_failed(remote, "read", exc) from exc
    return DatasetHead(body["snapshot"], int(body["episodes"]), tuple(body.get("history", ())))


def _write_head(remote: DvcRemote, head: DatasetHead) -> None:
    fs, path = _filesystem(remote)
    try:
        fs.pipe_file(path, json.dumps(asdict(head), indent=1).encode())  # one PUT: readers see old or new
    except Exception as exc:
        raise _remote_failed(remote, "write", exc) from exc


def _base_file(folder: Path) -> Path:
    return folder.with_name(folder.name + ".head.json")


def read_base(folder: Path) -> str:
    """The head this root last synced or published ("" = none recorded)."""
    path = _base_file(folder)
    return json.loads(path.read_text())["snapshot"] if path.exists() else ""


def _write_base(folder: Path, snapshot: str) -> None:
    atomic_write_bytes(_base_file(folder), json.dumps({"snapshot": snapshot}).encode())


def publish_head(folder: Path, remote: DvcRemote, snapshot: str, episodes: int) -> DatasetHead:
    """Make ``snapshot`` (already pushed) the remote's head, if the head is still what this root built on."""
    head = read_head(remote)
    if head is not None and head.snapshot == snapshot:
        _write_base(folder, snapshot)
        return head
    base = read_base(folder)
    if head is not None and head.snapshot != base:
        raise DatasetDivergedError(
            f"the dataset head on {remote.url} moved to {head.snapshot} ({head.episodes} episodes) while this root "
            f"ingested on {base or 'no head'}: another host ingests into the same dataset. Snapshot {snapshot} is "
            f"pushed but not made the head; ingest on one host at a time (docs/deploy.md); `fleetloop status` shows the head"
        )
    new = DatasetHead(snapshot, episodes) if head is None else head.advanced_to(snapshot, episodes)
    _write_head(remote, new)
    _write_base(folder, snapshot)
    return new


def root_state(head: DatasetHead | None, folder: Path, local_episodes: int) -> str:
    """Where the root's dataset stands against the remote's head: "none" (no head yet),
    "current", "behind" (a clean checkout of an older head), "ahead" (its own snapshot, not yet
    published, on top of the head) or "diverged" (its own episodes, and the head moved past them).

    ``local_episodes``: episodes the root's dataset holds now, to tell a clean checkout of its
    snapshot from one with episodes stored after it (an ingest that died before snapshotting)."""
    local = read_snapshot(folder)
    local_hash = local.hash if local is not None else ""
    if head is None:
        return "none"
    if local_hash == head.snapshot:
        return "current"
    at_local = head.episodes_at(local_hash) if local_hash else 0
    if at_local is not None and at_local == local_episodes:
        return "behind"
    if local_hash and read_base(folder) == head.snapshot:
        return "ahead"
    return "diverged"


def sync_dataset(root: Path, folder: Path, remote: DvcRemote, local_episodes: int) -> SyncResult:
    """Bring the root's dataset to the remote's head: pull it when the root is behind, leave a root
    that is ahead for the next ingest to publish, refuse a diverged one (``root_state``)."""
    head = read_head(remote)
    state = root_state(head, folder, local_episodes)
    local = read_snapshot(folder)
    if state in ("none", "ahead"):
        return SyncResult(state, local.hash if local is not None else "", local_episodes)
    if state == "current":
        _write_base(folder, head.snapshot)
        return SyncResult("current", head.snapshot, local_episodes)
    if state == "behind":
        folder.parent.mkdir(parents=True, exist_ok=True)
        pull_snapshot(root, write_snapshot_file(folder, head.snapshot), remote, force=True)
        _write_base(folder, head.snapshot)
        return SyncResult("pulled", head.snapshot, head.episodes)
    raise DatasetDivergedError(
        f"{folder} ({local.hash if local is not None else 'no snapshot'}, {local_episodes} episodes) has episodes the "
        f"dataset head on {remote.url} ({head.snapshot}, {head.episodes} episodes) lacks, and the head moved past "
        f"them: two hosts ingested. Nothing was overwritten. Keep the head: move {folder} and {folder.name}.dvc aside "
        f"and run again (then re-ingest the files you still need); ingest on one host at a time (docs/deploy.md)"
    )
