"""The ingest service: robots upload finished episodes (Arrow IPC); stored exactly once.

    POST /v1/episodes (robot token, body = one episode as an Arrow IPC stream or Parquet)
      -> read (size-capped, decoded-size-capped, buffers validated) -> same robot as the token?
      -> validated against the episode contract -> group commit: uploads arriving within
         ``commit_window_ms`` are stored by one ``EpisodeDataset.ingest_tables`` call
      <- 201 added | 200 duplicate (already stored, same content) | 4xx + {field, reason, fix}

Delivery is at-least-once (robots retry until they get an answer); storage is exactly-once
because the dataset dedupes by episode_id + content hash and commits atomically. A bad upload
goes to quarantine with its reason and the reason is returned; an upload naming another robot is
refused (403) and nothing of it is kept.
"""

from __future__ import annotations

import asyncio
import io
import logging
import queue
import threading
import time
import uuid
from concurrent.futures import Future
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.ipc as ipc
import pyarrow.parquet as pq
from fastapi import Depends, FastAPI, Request
from fastapi.responses import JSONResponse

from components.config import Settings
from components.episodes.dataset import EpisodeDataset, IncomingEpisode
from components.episodes.quarantine import QuarantinedFile, quarantine_bytes
from components.episodes.schema import EPISODE_ID, PARQUET_MAGIC, ROBOT_ID
from components.episodes.validation import WHOLE_FILE, EpisodeValidationError, validate_episode_table
from components.fleet.auth import ROBOT, SERVICE, Principal, TokenBook
from components.fleet.clients import EPISODES_PATH, STATS_PATH
from components.fleet.http_server import add_health, auth_dependency, http_error, read_body_limited

log = logging.getLogger(__name__)

# An upload may decode to at most this many times its wire size (guards compressed IPC bombs).
MAX_DECODE_RATIO = 16
UNREADABLE_FIX = "send one episode as an Arrow IPC stream (components.episodes.schema.episode_to_ipc) or Parquet"


def read_upload(data: bytes, max_decoded_bytes: int, source: str) -> pa.Table:
    """Untrusted bytes -> a fully validated Arrow table, or EpisodeValidationError (never a crash)."""
    if not data:
        raise EpisodeValidationError(source, WHOLE_FILE, "empty upload", UNREADABLE_FIX)
    try:
        if data[:4] == PARQUET_MAGIC:
            parquet = pq.ParquetFile(io.BytesIO(data))
            meta = parquet.metadata
            decoded = sum(meta.row_group(i).total_byte_size for i in range(meta.num_row_groups))
            if decoded > max_decoded_bytes:
                raise EpisodeValidationError(
                    source, WHOLE_FILE, f"decodes to {decoded} bytes (limit {max_decoded_bytes})", "upload one episode per request"
                )
            table = parquet.read()
        else:
            reader = ipc.open_stream(pa.py_buffer(data))
            batches, decoded = [], 0
            for batch in reader:
                batch.validate(full=True)
                decoded += batch.nbytes
                if decoded > max_decoded_bytes:
                    raise EpisodeValidationError(
                        source, WHOLE_FILE, f"decodes to more than {max_decoded_bytes} bytes", "upload one episode per request"
                    )
                batches.append(batch)
            table = pa.Table.from_batches(batches, schema=reader.schema)
        table.validate(full=True)
        return table
    except EpisodeValidationError:
        raise
    except Exception as exc:  # noqa: BLE001 - any failure to parse untrusted bytes is the sender's error
        raise EpisodeValidationError(source, WHOLE_FILE, f"unreadable ({type(exc).__name__}: {str(exc)[:200]})", UNREADABLE_FIX) from None


def claimed_robots(table: pa.Table) -> set[str] | None:
    """The robot ids an upload claims, or None when the column is missing or not text (validation judges)."""
    if ROBOT_ID not in table.column_names:
        return None
    try:
        return {v for v in pc.unique(table.column(ROBOT_ID).cast(pa.string())).to_pylist() if v is not None}
    except (pa.ArrowInvalid, pa.ArrowNotImplementedError, pa.ArrowTypeError):
        return None


def prevalidate(table: pa.Table, known: set[str], dataset: EpisodeDataset, source: str) -> str:
    """Validate before queueing (so one bad upload never fails a group commit); returns the episode id."""
    try:
        episode = validate_episode_table(table, known, dataset.state_dim, dataset.action_dim, source)
    except EpisodeValidationError:
        raise
    except Exception as exc:  # noqa: BLE001 - a table odd enough to trip the validator is still a 4xx
        raise EpisodeValidationError(
            source, WHOLE_FILE, f"could not be validated ({type(exc).__name__}: {str(exc)[:200]})",
            "write the columns with the types in components/episodes/README.md",
        ) from None
    return episode.episode_id


@dataclass(frozen=True)
class StoreOutcome:
    """What happened to one upload."""

    status: str  # added | duplicate | quarantined
    episode_id: str
    quarantined: QuarantinedFile | None = None


@dataclass
class _Pending:
    incoming: IncomingEpisode
    episode_id: str
    future: Future


class GroupCommitWriter:
    """One writer thread; uploads queued within a short window are stored by one ingest call."""

    def __init__(
        self, dataset: EpisodeDataset, known_robots: set[str], quarantine_dir: Path, window_s: float, max_items: int
    ) -> None:
        self.dataset = dataset
        self.known_robots = known_robots
        self.quarantine_dir = quarantine_dir
        self.window_s = window_s
        self.max_items = max_items
        self.commits = 0
        self._queue: queue.Queue[_Pending | None] = queue.Queue()
        self._thread = threading.Thread(target=self._run, name="group-commit", daemon=True)
        self._thread.start()

    def submit(self, incoming: IncomingEpisode, episode_id: str) -> Future:
        future: Future = Future()
        self._queue.put(_Pending(incoming, episode_id, future))
        return future

    def close(self) -> None:
        """Store what is queued, then stop."""
        self._queue.put(None)
        self._thread.join()

    def _run(self) -> None:
        while True:
            first = self._queue.get()
            if first is None:
                return
            batch, stop = [first], False
            deadline = time.monotonic() + self.window_s
            while len(batch) < self.max_items:
                remaining = deadline - time.monotonic()
                try:
                    item = self._queue.get(timeout=max(remaining, 0.0)) if remaining > 0 else self._queue.get_nowait()
                except queue.Empty:
                    break
                if item is None:
                    stop = True
                    break
                batch.append(item)
            self._commit(batch)
            if stop:
                return

    def _commit(self, batch: list[_Pending]) -> None:
        try:
            report = self.dataset.ingest_tables([p.incoming for p in batch], self.known_robots, self.quarantine_dir)
        except Exception as exc:  # noqa: BLE001 - answered as 500 to every waiting upload; robots retry
            log.exception("group commit of %d uploads failed", len(batch))
            for pending in batch:
                pending.future.set_exception(exc)
            return
        self.commits += 1
        rejected = {q.source: q for q in report.quarantined}
        added = set(report.added)
        for pending in batch:
            bad = rejected.get(pending.incoming.source)
            if bad is not None:
                outcome = StoreOutcome("quarantined", pending.episode_id, bad)
            elif pending.episode_id in added:
                outcome = StoreOutcome("added", pending.episode_id)
            else:
                outcome = StoreOutcome("duplicate", pending.episode_id)
            pending.future.set_result(outcome)
        if report.added:
            log.info("stored %d episodes (%d uploads in one commit)", len(report.added), len(batch))


def _rejection(error: EpisodeValidationError, quarantined: QuarantinedFile | None, status: int) -> JSONResponse:
    detail = {"field": error.field, "reason": error.reason, "fix": error.fix}
    if quarantined is not None:
        detail["quarantined_as"] = quarantined.path.name
    return JSONResponse({"detail": detail}, status_code=status)


def create_ingest_app(settings: Settings, book: TokenBook) -> FastAPI:
    """The ingest service for ``settings.root``'s episode dataset."""
    cfg = settings.runtime
    paths = settings.paths
    dataset = EpisodeDataset(paths.episodes, settings.episodes)
    known = settings.known_robots()
    state: dict[str, GroupCommitWriter] = {}

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        state["writer"] = GroupCommitWriter(
            dataset, known, paths.quarantine, cfg.commit_window_ms / 1000.0, cfg.commit_max_episodes
        )
        yield
        await asyncio.to_thread(state["writer"].close)

    app = FastAPI(title="fleetloop ingest", lifespan=lifespan)
    robot_only = auth_dependency(book, [ROBOT])
    service_only = auth_dependency(book, [SERVICE])
    add_health(app, lambda: {"service": "ingest"})

    def quarantine_upload(data: bytes, error: EpisodeValidationError, name: str) -> QuarantinedFile:
        return quarantine_bytes(data, name, error, paths.quarantine)

    @app.post(EPISODES_PATH)
    async def upload(request: Request, principal: Principal = Depends(robot_only)) -> JSONResponse:
        data = await read_body_limited(request, cfg.max_upload_bytes)
        upload_id = uuid.uuid4().hex[:12]
        source = f"upload:{principal.name}:{upload_id}"
        name = f"upload-{principal.name}-{upload_id}.bin"
        try:
            table = await asyncio.to_thread(read_upload, data, cfg.max_upload_bytes * MAX_DECODE_RATIO, source)
        except EpisodeValidationError as error:
            kept = await asyncio.to_thread(quarantine_upload, data, error, name)
            log.warning("quarantined unreadable upload from %s: %s", principal.name, error.reason)
            return _rejection(error, kept, 400)
        claimed = claimed_robots(table)
        if claimed is not None and claimed - {principal.name}:
            log.warning("refused upload from %s claiming robot(s) %s", principal.name, sorted(claimed)[:4])
            raise http_error(
                403, ROBOT_ID, f"robot {principal.name!r} may upload only its own episodes",
                "upload with the token of the robot that recorded the episode",
            )
        try:
            episode_id = await asyncio.to_thread(prevalidate, table, {principal.name} & known, dataset, source)
        except EpisodeValidationError as error:
            kept = await asyncio.to_thread(quarantine_upload, data, error, name)
            log.warning("quarantined upload from %s: field %s: %s", principal.name, error.field, error.reason)
            return _rejection(error, kept, 422)
        incoming = IncomingEpisode(table=table, source=source)
        outcome: StoreOutcome = await asyncio.wrap_future(state["writer"].submit(incoming, episode_id))
        if outcome.status == "quarantined" and outcome.quarantined is not None:
            q = outcome.quarantined
            error = EpisodeValidationError(q.source, q.field, q.reason, q.fix)
            return _rejection(error, q, 422)
        status = 201 if outcome.status == "added" else 200
        return JSONResponse({"status": outcome.status, "episode_id": episode_id}, status_code=status)

    @app.get(STATS_PATH)
    async def stats(principal: Principal = Depends(service_only)) -> JSONResponse:
        await asyncio.to_thread(dataset.refresh)
        writer = state.get("writer")
        return JSONResponse(
            {"episodes": dataset.num_episodes, "robots": dataset.robots(), "commits": writer.commits if writer else 0}
        )

    return app
