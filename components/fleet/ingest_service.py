"""The ingest service: robots upload finished episodes (Arrow IPC); stored exactly once.

    POST /v1/episodes (robot token, body = one episode as an Arrow IPC stream or Parquet, or with
      its camera streams: camera_wire.py's episode body, the Arrow IPC table and each camera's
      (T, H, W, 3) uint8 frames, told apart by its magic bytes)
      -> per-robot rate limit (429 + Retry-After) -> disk reserve (507 + Retry-After)
      -> read (size-capped, decoded-size-capped, buffers validated) -> same robot as the token?
      -> validated alone against the episode contract (contract columns only; camera streams as
         the file door checks them: one frame per row, the dataset's resolution) -> group commit:
         uploads arriving within ``commit_window_ms`` are stored by one
         ``EpisodeDataset.ingest_tables`` call; if that call fails, each upload is committed
         alone, so a bad member fails only itself
      <- 201 added | 200 duplicate (already stored, same content) | 4xx + {field, reason, fix}
         | 507 disk full (retry later) | 500 only for the one upload that could not be stored

Delivery is at-least-once (robots retry until they get an answer); storage is exactly-once
because the dataset dedupes by episode_id + content hash and commits atomically. A bad upload
goes to the bounded quarantine with its reason (``quarantined_as``; null when the cap is
reached) and the reason is returned; an upload naming another robot is refused (403) and nothing
of it is kept. ``/healthz`` is 503 while the disk is below ``min_free_bytes``, after a store
failed for lack of room (ENOSPC, EDQUOT, EFBIG) until a store succeeds again (``restart: false``
for both: a restart frees no room), or when the writer thread is dead (``restart: true``).
"""

from __future__ import annotations

import asyncio
import io
import logging
import queue
import threading
import time
import uuid
from collections.abc import Callable
from concurrent.futures import Future
from contextlib import asynccontextmanager
from dataclasses import dataclass

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.ipc as ipc
import pyarrow.parquet as pq
from fastapi import Depends, FastAPI, HTTPException, Request
from fastapi.responses import JSONResponse

from components.config import Settings
from components.episodes.dataset import EpisodeDataset, IncomingEpisode
from components.episodes.quarantine import QuarantinedFile
from components.episodes.record import CAMERA_KEY_PREFIX
from components.episodes.schema import PARQUET_MAGIC, ROBOT_ID
from components.episodes.validation import (
    WHOLE_FILE,
    EpisodeValidationError,
    check_upload_columns,
    validate_episode_table,
)
from components.episodes.video_validation import validate_camera_streams
from components.fleet.auth import ROBOT, SERVICE, Principal, TokenBook
from components.fleet.camera_wire import WireError, decode_episode, is_episode_body
from components.fleet.embedder import StoreEmbedder
from components.fleet.clients import EPISODES_PATH, STATS_PATH
from components.fleet.health import HealthProblem, disk_problem, is_no_space
from components.fleet.http_server import NO_API_DOCS, add_health, auth_dependency, http_error, read_body_limited
from components.fleet.quarantine_box import BoundedQuarantine
from components.fleet.rate_limit import UploadRateLimiter, retry_after_header

log = logging.getLogger(__name__)

# An upload may decode to at most this many times its wire size (guards compressed IPC bombs).
MAX_DECODE_RATIO = 16
UNREADABLE_FIX = "send one episode as an Arrow IPC stream (components.episodes.schema.episode_to_ipc) or Parquet"
DISK_FULL_RETRY_S = 30.0  # Retry-After on 507: freeing disk space is an operator's job


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


def read_episode_upload(data: bytes, max_decoded_bytes: int, source: str) -> tuple[pa.Table, dict[str, np.ndarray]]:
    """An upload -> its table and camera streams (camera_wire.py's episode body), or just its table
    (Arrow IPC / Parquet, no cameras); EpisodeValidationError naming the field otherwise."""
    if not is_episode_body(data):
        return read_upload(data, max_decoded_bytes, source), {}
    try:
        table_bytes, cameras = decode_episode(data)
    except WireError as exc:
        raise EpisodeValidationError(source, exc.field, exc.reason, exc.fix) from None
    for key in cameras:  # never a column's name: the dataset stores each key as a video feature
        if not key.startswith(CAMERA_KEY_PREFIX):
            raise EpisodeValidationError(source, key, "not a camera key",
                                         f"name each camera {CAMERA_KEY_PREFIX}<view> (episodes.record.camera_key)")
    return read_upload(table_bytes, max_decoded_bytes, source), cameras


def camera_resolutions(dataset: EpisodeDataset) -> dict[str, tuple[int, int]]:
    """(height, width) the dataset stores for each camera (what its info.json says)."""
    return {key: tuple(f["shape"][:2]) for key, f in dataset.features.items() if f.get("dtype") == "video"}


def claimed_robots(table: pa.Table) -> set[str] | None:
    """The robot ids an upload claims, or None when the column is missing or not text (validation judges)."""
    if ROBOT_ID not in table.column_names:
        return None
    try:
        return {v for v in pc.unique(table.column(ROBOT_ID).cast(pa.string())).to_pylist() if v is not None}
    except (pa.ArrowInvalid, pa.ArrowNotImplementedError, pa.ArrowTypeError):
        return None


def prevalidate(table: pa.Table, known: set[str], dataset: EpisodeDataset, source: str,
                cameras: dict[str, np.ndarray] | None = None) -> str:
    """Validate alone, before queueing (so one bad upload never fails a group commit); returns the id.

    The columns are judged as ``fleetloop ingest`` judges a file (``check_upload_columns``), the
    camera streams as its sidecars are (``validate_camera_streams``): one contract for both doors.
    """
    check_upload_columns(table, source)
    try:
        episode = validate_episode_table(table, known, dataset.state_dim, dataset.action_dim, source)
        if cameras:
            validate_camera_streams(cameras, episode, dataset.fps, camera_resolutions(dataset), source)
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

    status: str  # added | duplicate | rejected | no_space | failed
    episode_id: str
    error: EpisodeValidationError | None = None  # rejected: why
    quarantined: QuarantinedFile | None = None  # rejected: where its bytes are kept (None: not kept)
    reason: str = ""  # no_space | failed: what went wrong


@dataclass
class _Pending:
    incoming: IncomingEpisode
    episode_id: str
    future: Future
    data: bytes  # as uploaded: what quarantine keeps if the dataset refuses it


class GroupCommitWriter:
    """One writer thread; uploads queued within a short window are stored by one ingest call.

    The group call fails as a whole (the dataset commits atomically); then every member is
    committed alone, so a member that cannot be stored fails only itself.
    """

    def __init__(
        self, dataset: EpisodeDataset, known_robots: set[str], quarantine: BoundedQuarantine, window_s: float, max_items: int,
        on_stored: Callable[[], None] | None = None,
    ) -> None:
        self.dataset = dataset
        self.known_robots = known_robots
        self.quarantine = quarantine
        self.window_s = window_s
        self.max_items = max_items
        self.commits = 0
        self.on_stored = on_stored  # called after a commit that stored episodes (the store embedder)
        self.no_space: str | None = None  # why the last store failed for lack of room; cleared by the next store
        self._queue: queue.Queue[_Pending | None] = queue.Queue()
        self._thread = threading.Thread(target=self._run, name="group-commit", daemon=True)
        self._thread.start()

    def submit(self, incoming: IncomingEpisode, episode_id: str, data: bytes) -> Future:
        future: Future = Future()
        self._queue.put(_Pending(incoming, episode_id, future, data))
        return future

    def alive(self) -> bool:
        return self._thread.is_alive()

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
            outcomes = self._store(batch)
        except Exception as exc:  # noqa: BLE001 - the group failed as a whole: nothing of it was stored
            if is_no_space(exc):
                log.error("disk full: %d uploads not stored (%s)", len(batch), exc)
                outcomes = [StoreOutcome("no_space", p.episode_id, reason=str(exc)[:200]) for p in batch]
            elif len(batch) == 1:
                outcomes = [self._alone_failed(batch[0], exc)]
            else:
                log.warning("group commit of %d uploads failed (%s: %s); committing each alone", len(batch), type(exc).__name__, exc)
                outcomes = []
                for pending in batch:
                    try:
                        outcomes += self._store([pending])
                    except Exception as alone:  # noqa: BLE001 - this member, and only it, fails
                        outcomes.append(self._alone_failed(pending, alone))
        self._note_space(outcomes)
        for pending, outcome in zip(batch, outcomes):
            pending.future.set_result(outcome)

    def _note_space(self, outcomes: list[StoreOutcome]) -> None:
        """A store refused for lack of room makes the service degraded until a store succeeds:
        the free-space reserve alone misses a full quota or file-size limit."""
        if any(o.status in ("added", "duplicate") for o in outcomes):
            self.no_space = None
        elif any(o.status == "no_space" for o in outcomes):
            self.no_space = next(o.reason for o in outcomes if o.status == "no_space")

    def _store(self, batch: list[_Pending]) -> list[StoreOutcome]:
        """One atomic ingest call; raises if any member cannot be stored (nothing is then stored)."""
        report = self.dataset.ingest_tables([p.incoming for p in batch], self.known_robots, None)
        self.commits += 1
        added = set(report.added)
        if report.added:
            log.info("stored %d episodes (%d uploads in one commit)", len(report.added), len(batch))
            if self.on_stored is not None:
                self.on_stored()
        return [StoreOutcome("added" if p.episode_id in added else "duplicate", p.episode_id) for p in batch]

    def _alone_failed(self, pending: _Pending, exc: Exception) -> StoreOutcome:
        """Why one upload, committed alone, could not be stored."""
        if is_no_space(exc):
            return StoreOutcome("no_space", pending.episode_id, reason=str(exc)[:200])
        if isinstance(exc, EpisodeValidationError):  # e.g. this id already names other content
            log.warning("rejected %s: field %s: %s", pending.incoming.source, exc.field, exc.reason)
            kept = self.quarantine.keep(pending.data, _quarantine_name(pending.incoming.source), exc)
            return StoreOutcome("rejected", pending.episode_id, error=exc, quarantined=kept)
        log.error("could not store %s alone", pending.incoming.source, exc_info=exc)
        return StoreOutcome("failed", pending.episode_id, reason=f"{type(exc).__name__}: {str(exc)[:200]}")


def _quarantine_name(source: str) -> str:
    """``upload:<robot>:<id>`` -> ``upload-<robot>-<id>.bin``."""
    return source.replace(":", "-") + ".bin"


def _rejection(error: EpisodeValidationError, quarantined: QuarantinedFile | None, status: int) -> JSONResponse:
    """A 4xx naming the field, the reason and the fix; ``quarantined_as`` is null if not kept."""
    detail = {"field": error.field, "reason": error.reason, "fix": error.fix}
    detail["quarantined_as"] = quarantined.path.name if quarantined is not None else None
    return JSONResponse({"detail": detail}, status_code=status)


def _disk_full(reason: str) -> JSONResponse:
    detail = {"field": "disk", "reason": f"the dataset's disk is full: {reason}", "fix": "retry later; the operator must free disk space"}
    return JSONResponse({"detail": detail}, status_code=507, headers={"Retry-After": retry_after_header(DISK_FULL_RETRY_S)})


def create_ingest_app(settings: Settings, book: TokenBook) -> FastAPI:
    """The ingest service for ``settings.root``'s episode dataset."""
    cfg = settings.runtime
    paths = settings.paths
    dataset = EpisodeDataset(paths.episodes, settings.episodes)
    known = settings.known_robots()
    state: dict[str, GroupCommitWriter] = {}
    quarantine = BoundedQuarantine(paths.quarantine, cfg.quarantine_max_bytes)
    limiter = UploadRateLimiter(cfg.upload_rate_per_s, cfg.upload_burst)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        embedder = StoreEmbedder(settings, dataset) if cfg.ingest_embeds else None
        if embedder is not None:
            state["embedder"] = embedder
        state["writer"] = GroupCommitWriter(
            dataset, known, quarantine, cfg.commit_window_ms / 1000.0, cfg.commit_max_episodes,
            on_stored=embedder.notify if embedder is not None else None,
        )
        yield
        await asyncio.to_thread(state["writer"].close)
        if embedder is not None:
            await asyncio.to_thread(embedder.close)

    def problem() -> HealthProblem | None:
        writer = state.get("writer")
        if writer is not None and not writer.alive():
            return HealthProblem("the group-commit writer thread is dead", restart=True)
        embedder = state.get("embedder")
        if embedder is not None and not embedder.alive():
            return HealthProblem("the store-embedder thread is dead", restart=True)
        if writer is not None and writer.no_space is not None:
            return HealthProblem(f"the last store failed for lack of room: {writer.no_space}", restart=False)
        return disk_problem(paths.episodes, cfg.min_free_bytes)

    app = FastAPI(title="fleetloop ingest", lifespan=lifespan, **NO_API_DOCS)
    robot_only = auth_dependency(book, [ROBOT])
    service_only = auth_dependency(book, [SERVICE])
    add_health(app, lambda: {"service": "ingest"}, problem)

    def quarantine_upload(data: bytes, error: EpisodeValidationError, name: str) -> QuarantinedFile | None:
        return quarantine.keep(data, name, error)

    @app.post(EPISODES_PATH)
    async def upload(request: Request, principal: Principal = Depends(robot_only)) -> JSONResponse:
        wait_s = limiter.take(principal.name)
        if wait_s > 0:
            raise HTTPException(
                429, {"field": "rate", "reason": f"more than {cfg.upload_burst} uploads at once or {cfg.upload_rate_per_s}/s "
                      f"sustained from {principal.name}", "fix": "wait Retry-After seconds (runtime.upload_rate_per_s)"},
                headers={"Retry-After": retry_after_header(wait_s)},
            )
        full = await asyncio.to_thread(disk_problem, paths.episodes, cfg.min_free_bytes)
        if full is not None:
            return _disk_full(full.reason)
        data = await read_body_limited(request, cfg.max_upload_bytes)
        upload_id = uuid.uuid4().hex[:12]
        source = f"upload:{principal.name}:{upload_id}"
        name = _quarantine_name(source)
        try:
            table, cameras = await asyncio.to_thread(read_episode_upload, data, cfg.max_upload_bytes * MAX_DECODE_RATIO, source)
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
            episode_id = await asyncio.to_thread(prevalidate, table, {principal.name} & known, dataset, source, cameras)
        except EpisodeValidationError as error:
            kept = await asyncio.to_thread(quarantine_upload, data, error, name)
            log.warning("quarantined upload from %s: field %s: %s", principal.name, error.field, error.reason)
            return _rejection(error, kept, 422)
        incoming = IncomingEpisode(table=table, source=source, cameras=cameras)
        outcome: StoreOutcome = await asyncio.wrap_future(state["writer"].submit(incoming, episode_id, data))
        if outcome.status == "rejected" and outcome.error is not None:
            return _rejection(outcome.error, outcome.quarantined, 422)
        if outcome.status == "no_space":
            return _disk_full(outcome.reason)
        if outcome.status == "failed":
            raise http_error(500, "episode", f"could not be stored: {outcome.reason}", "retried by the robot; see the ingest log")
        status = 201 if outcome.status == "added" else 200
        return JSONResponse({"status": outcome.status, "episode_id": episode_id}, status_code=status)

    @app.get(STATS_PATH)
    async def stats(principal: Principal = Depends(service_only)) -> JSONResponse:
        await asyncio.to_thread(dataset.refresh)
        writer = state.get("writer")
        return JSONResponse(
            {"episodes": dataset.num_episodes, "robots": dataset.robots(), "commits": writer.commits if writer else 0,
             "embedder": state["embedder"].status() if "embedder" in state else None}
        )

    return app
