"""Ingest step: read files → validate + store (one writer) → DVC snapshot → embed → upsert.

Each phase is its own function so a flow can fan out the per-file parts (reading, embedding)
and cache them on content, while the writes (dataset, snapshot, store) stay single-writer.
``ingest_files`` runs the phases in order for callers without an orchestrator (``dvc repro``).
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa

from components.config import Settings
from components.episodes.dataset import IncomingEpisode, IngestReport, read_incoming
from components.episodes.dataset_head import SyncResult, publish_head, sync_dataset
from components.episodes.quarantine import QuarantinedFile
from components.episodes.record import Episode, camera_key
from components.episodes.snapshot import (
    DvcRemote,
    Snapshot,
    push_snapshot,
    read_snapshot,
    snapshot_dataset,
)
from components.fert.camera_encoder import CameraWindowEncoder, pick_successes
from components.fert.corpus import episode_infos
from components.fert.encoder import ActionPredictiveEncoder
from components.pipeline.workspace import Workspace
from components.store.encoder import NormalizedStateEncoder, WindowEncoder, encoder_cameras
from components.store.segment_store import EmbedCursor, UpkeepReport, UpsertReport
from components.store.windows import cut_windows

Progress = Callable[[int, int], None]


@dataclass(frozen=True)
class IngestResult:
    report: IngestReport
    snapshot: Snapshot | None
    store_version: int
    segments_upserted: int


EPISODE_SUFFIXES = (".parquet", ".arrow", ".arrows")


class PhaseTimes(dict[str, float]):
    """Wall seconds per ingest phase (sync, read, store, snapshot, plan, embed, upsert, index), summed
    over calls: pass one to ``ingest_files`` to see where a batch's time went
    (``benchmarks/ingest_fresh_vs_grown.py`` compares a grown root's phases with a fresh one's)."""

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        start = time.perf_counter()
        try:
            yield
        finally:
            self[name] = self.get(name, 0.0) + time.perf_counter() - start


def step_workspace(settings: Settings) -> Workspace:
    """The handles of one ingest step: its store handle reads the version it opened at plus its
    own writes, and writes on the latest (``SegmentStore.open``'s ``consistency="step"``), so the
    step's many metadata reads skip LanceDB's latest-version lookup, whose cost grows with the
    versions kept."""
    return Workspace(settings, store_consistency="step")


def incoming_files(settings: Settings) -> list[Path]:
    """Every episode file waiting under ``datasets/incoming`` (sorted, so runs are reproducible)."""
    root = settings.paths.incoming
    return sorted(p for p in root.rglob("*") if p.suffix in EPISODE_SUFFIXES) if root.exists() else []


def read_groups(settings: Settings, files: list[Path]) -> list[list[Path]]:
    """The files of one fan-out read task each: ``ops.ingest_files_per_task`` at a time (one task
    per file cost the ingest flow ~20x: each task run writes its state and result)."""
    return _groups(files, settings.ops.ingest_files_per_task)


def embed_groups(settings: Settings, episodes: list[Episode]) -> list[list[Episode]]:
    """The episodes of one fan-out embed task each: ``ops.embed_episodes_per_task`` at a time."""
    return _groups(episodes, settings.ops.embed_episodes_per_task)


def _groups(items: list, size: int) -> list[list]:
    return [items[i : i + size] for i in range(0, len(items), size)]


def read_file(settings: Settings, path: Path) -> IncomingEpisode | QuarantinedFile:
    return read_incoming(Path(path), settings.paths.quarantine)


def store_episodes(
    settings: Settings, items: list[IncomingEpisode | QuarantinedFile], ws: Workspace | None = None
) -> IngestReport:
    """Validate and append the readable files; bad ones go to quarantine, good ones are kept.

    ``ws``: handles already open in this process (``ingest_files`` opens one set for all phases;
    a flow's tasks, possibly in other processes, each open their own)."""
    import dataclasses

    incoming = [i for i in items if isinstance(i, IncomingEpisode)]
    unreadable = tuple(i for i in items if not isinstance(i, IncomingEpisode))
    report = (ws or step_workspace(settings)).dataset.ingest_tables(incoming, settings.known_robots(), settings.paths.quarantine)
    return dataclasses.replace(report, quarantined=unreadable + report.quarantined)


def sync_to_head(settings: Settings) -> SyncResult:
    """With ``episodes.dvc_remote``: the root's dataset brought to the remote's head (pulled when
    another host ingested since), before anything reads or appends to it (dataset_head.py)."""
    if not settings.episodes.dvc_remote:
        return SyncResult("none", "", 0)
    episodes = Workspace(settings).dataset.num_episodes
    return sync_dataset(settings.root, settings.paths.episodes, dvc_remote(settings), episodes)


def take_snapshot(settings: Settings, changed: bool, ws: Workspace | None = None) -> Snapshot | None:
    """A DVC snapshot when the data changed (or none exists yet); otherwise the last one. With
    ``episodes.dvc_remote`` it is pushed and made the remote's head (every time: a push or publish
    that failed before is completed)."""
    ws = ws or step_workspace(settings)
    last = read_snapshot(settings.paths.episodes)
    if (changed or last is None) and ws.dataset.num_episodes:
        last = snapshot_dataset(settings.root, settings.paths.episodes)
    if last is not None and settings.episodes.dvc_remote:
        remote = dvc_remote(settings)
        push_snapshot(settings.root, last, remote)
        publish_head(settings.paths.episodes, remote, last.hash, ws.dataset.num_episodes)
    return last


def dvc_remote(settings: Settings) -> DvcRemote:
    return DvcRemote(settings.episodes.dvc_remote, settings.episodes.dvc_remote_endpoint)


def store_encoder(settings: Settings, ws: Workspace | None = None) -> WindowEncoder:
    """The encoder that made the store's vectors; fitted on the whole dataset the first time."""
    ws = ws or step_workspace(settings)
    encoder = ws.store.load_encoder()
    if encoder is not None:
        return encoder
    cfg = settings.store
    episodes = list(ws.dataset.episodes())
    if not episodes:
        raise RuntimeError(f"cannot fit the window encoder: {settings.paths.episodes} holds no episodes yet")
    if settings.fert.encoder == "camera":
        return _fit_camera_encoder(settings, ws)
    if settings.fert.encoder == "learned":
        if not any(ep.success for ep in episodes):
            raise RuntimeError(
                f"fert.encoder=learned needs successful episodes to learn from, and {settings.paths.episodes} has "
                "none; ingest expert demos first or use fert.encoder=normalized_state"
            )
        fert = settings.fert
        return ActionPredictiveEncoder.from_successes(
            episodes, cfg.window, cfg.stride, fert.learned_dim, fert.learned_epochs, settings.seed
        )
    windows = [cut_windows(ep.states, cfg.window, cfg.stride).windows for ep in episodes]
    return NormalizedStateEncoder(window=cfg.window, state_dim=ws.obs_dim).fit(np.concatenate(windows))


def camera_keys_for_encoder(settings: Settings, ws: Workspace) -> tuple[str, ...]:
    """The dataset camera keys ``fert.encoder: camera`` embeds (``fert.camera_views``, or every stream
    the dataset stores); a clear error when the dataset stores none of them."""
    stored = tuple(ws.dataset.camera_keys)
    wanted = tuple(camera_key(v) for v in settings.fert.camera_views) or stored
    missing = [k for k in wanted if k not in stored]
    if not wanted or missing:
        raise RuntimeError(
            f"fert.encoder=camera embeds camera windows, but {settings.paths.episodes} stores "
            f"{'no camera streams' if not stored else 'no ' + repr(missing[0]) + ' stream (it has ' + str(list(stored)) + ')'}: "
            "collect with sim.cameras (e.g. [scene, gripper]) so episodes carry their frames, set fert.camera_views "
            "to stored views, or choose fert.encoder=learned / normalized_state"
        )
    return wanted


def _fit_camera_encoder(settings: Settings, ws: Workspace) -> WindowEncoder:
    """``CameraWindowEncoder`` on the stored successes' camera windows: episodes read (and their
    frames decoded) a few at a time, up to ``fert.camera_max_windows`` windows (a seeded pick of
    whole episodes above that)."""
    keys = camera_keys_for_encoder(settings, ws)
    cfg, fert = settings.store, settings.fert
    successes = [(index, info) for index, info in episode_infos(ws.dataset) if info.success]
    if not successes:
        raise RuntimeError(
            f"fert.encoder=camera needs successful episodes to learn from, and {settings.paths.episodes} has "
            "none; ingest expert demos first or use fert.encoder=normalized_state"
        )
    picked = pick_successes([info.length for _, info in successes], cfg.window, cfg.stride,
                            fert.camera_max_windows, settings.seed)
    indices = [successes[i][0] for i in picked]
    return CameraWindowEncoder.from_successes(
        _with_cameras(ws, indices, keys), cfg.window, cfg.stride, keys, fert.learned_dim, fert.learned_epochs,
        settings.seed, size=fert.camera_size, frames=fert.camera_frames, channels=fert.camera_channels,
        use_state=fert.camera_state,
    )


def _with_cameras(ws: Workspace, indices: list[int], keys: tuple[str, ...], chunk: int = 32) -> Iterator[Episode]:
    """The listed stored episodes with the ``keys`` camera frames decoded, read ``chunk`` at a time."""
    for at in range(0, len(indices), chunk):
        part = indices[at : at + chunk]
        yield from ws.dataset.load_episodes(part, cameras=keys)


def _embedded_cameras(settings: Settings, ws: Workspace) -> tuple[str, ...]:
    """Camera keys the store's encoder reads: the stored encoder's, or (a first ingest, nothing
    stored yet) those ``fert.encoder: camera`` will fit on; () for a state encoder."""
    stored = ws.store.load_encoder()
    if stored is not None:
        return encoder_cameras(stored)
    return camera_keys_for_encoder(settings, ws) if settings.fert.encoder == "camera" else ()



def episodes_to_embed(settings: Settings, ws: Workspace | None = None) -> list[Episode]:
    """Stored episodes that have no segments yet: those after the store's embed cursor.

    Reads only the episodes after the cursor, so its cost follows the batch, not the dataset.
    The cursor moves only after an upsert (``upsert``), so an ingest that died between storing
    and upserting is completed by the next one. Without a cursor that matches this dataset (a
    store written before cursors, or a replaced dataset) it compares every stored episode with
    the store once; the next upsert records the cursor.
    """
    ws = ws or step_workspace(settings)
    start = _cursor_start(ws, ws.store.embed_cursor())
    if start is not None:
        new = list(enumerate(ws.dataset.episodes(start=start), start))
    else:
        embedded = ws.store.episode_ids()
        new = [(i, ep) for i, ep in enumerate(ws.dataset.episodes()) if ep.episode_id not in embedded]
    keys = _embedded_cameras(settings, ws) if new else ()
    if keys:  # a camera encoder embeds their camera windows: decoded here, each episode's own streams
        return [dataclasses.replace(ep, cameras=ws.dataset.camera_frames(i, keys)) for i, ep in new]
    return [ep for _, ep in new]


def _cursor_start(ws: Workspace, cursor: EmbedCursor | None) -> int | None:
    """Where embedding resumes, if the store's ``cursor`` (as the caller read it: read once per
    step, each read is a LanceDB metadata call) describes this dataset; else None."""
    if cursor is None or cursor.episodes > ws.dataset.num_episodes:
        return None
    if cursor.episodes and ws.dataset.episode_ids(cursor.episodes - 1, cursor.episodes) != [cursor.last_episode_id]:
        return None
    return cursor.episodes


def advance_embed_cursor(
    settings: Settings, upserted_ids: set[str], report: UpsertReport | None = None, ws: Workspace | None = None
) -> EmbedCursor | None:
    """Move the cursor over the stored episodes that now have segments: those just upserted
    (and, while no cursor matches, those the store already holds), up to the first gap.

    With the upsert's ``report`` it also records ``EmbedCursor.rows`` (see ``_covered_rows``)."""
    ws = ws or step_workspace(settings)
    before = ws.store.embed_cursor()
    start = _cursor_start(ws, before)
    known = upserted_ids if start is not None else upserted_ids | ws.store.episode_ids()
    ids = ws.dataset.episode_ids(start or 0)
    covered = np.fromiter((i in known for i in ids), dtype=bool, count=len(ids))
    gap = int(np.argmin(covered)) if not covered.all() else len(ids)
    if gap == 0:
        return before if start is not None else None
    rows = _covered_rows(before if start is not None else None, report, upserted_ids <= set(ids[:gap]))
    cursor = EmbedCursor(episodes=(start or 0) + gap, last_episode_id=ids[gap - 1], rows=rows)
    ws.store.set_embed_cursor(cursor)
    return cursor


def _covered_rows(before: EmbedCursor | None, report: UpsertReport | None, upserted_covered: bool) -> int:
    """The row count at which every stored segment belongs to the new cursor's episodes, or -1.

    By induction, on counts the upsert read under the store's write lock: before the write, the
    rows not of this batch's episodes were exactly the old cursor's ``rows`` (for a store without a
    cursor: none), and the new cursor covers this batch. An ingest that died between its upsert
    and its cursor is caught up this way too (its rows are the next batch's lookup hits); another
    writer's rows break the chain: -1, and later upserts look their rows up, as before."""
    if report is None or report.rows_before < 0 or not upserted_covered:
        return -1
    held_before = before.rows if before is not None else 0
    return report.rows_after if report.rows_before - report.stored_before == held_before else -1


def recount_embed_cursor(settings: Settings) -> EmbedCursor | None:
    """Restore ``EmbedCursor.rows`` where the chain broke (a writer the cursor did not know, or a
    store from before cursors counted rows), so upserts skip their lookup again: one scan of the
    store's episode ids, run by upkeep (``upkeep_store``)."""
    ws = step_workspace(settings)

    def covered(cursor: EmbedCursor) -> set[str]:
        if _cursor_start(ws, ws.store.embed_cursor()) != cursor.episodes:
            return set()  # the cursor describes another dataset: nothing is covered
        return set(ws.dataset.episode_ids(0, cursor.episodes))

    return ws.store.recount_embed_cursor(covered)


def compact_dataset(settings: Settings) -> int:
    """The dataset's half of upkeep: merge the small data files episodes-table files written before
    data files were merged still name (``EpisodeDataset.compact_data_files``; nothing to do on a
    root grown since). Holds the dataset's writer lock meanwhile. Returns the files rewritten."""
    return Workspace(settings).dataset.compact_data_files()


def upkeep_store(settings: Settings) -> UpkeepReport:
    """The scheduled store upkeep (``store-upkeep`` flow): compaction, index retrain and version
    pruning (``SegmentStore.upkeep``), then the embed cursor's row count restored if it broke."""
    report = Workspace(settings).store.upkeep()
    recount_embed_cursor(settings)
    return report


def embed(
    settings: Settings, episodes: list[Episode], encoder: WindowEncoder, snapshot: str, ws: Workspace | None = None
) -> pa.Table:
    return (ws or step_workspace(settings)).store.segment_rows(episodes, encoder, snapshot)


def upsert(
    settings: Settings, rows: list[pa.Table], encoder: WindowEncoder, ws: Workspace | None = None,
    times: PhaseTimes | None = None,
) -> UpsertReport | None:
    """Merge the rows, move the embed cursor over their episodes, keep the index up (build or fold)."""
    ws, times = ws or step_workspace(settings), PhaseTimes() if times is None else times
    if not rows:
        advance_embed_cursor(settings, set(), ws=ws)  # records a first cursor for a store that lacks one
        return None
    with times.phase("upsert"):
        table = pa.concat_tables(rows)
        upserted = set(table.column("episode_id").unique().to_pylist())
        report = ws.store.upsert_rows(table, encoder, absent_at_rows=_absent_at_rows(ws, upserted))
        advance_embed_cursor(settings, upserted, report, ws=ws)
    with times.phase("index"):
        ws.store.ensure_index()
    return report


def _absent_at_rows(ws: Workspace, episode_ids: set[str]) -> int:
    """The cursor's ``rows`` when all these episodes come after it (then, at that count, the
    store holds none of them); -1 otherwise."""
    cursor = ws.store.embed_cursor()
    start = _cursor_start(ws, cursor)
    if start is None or cursor is None or cursor.rows < 0:
        return -1
    return cursor.rows if episode_ids <= set(ws.dataset.episode_ids(start)) else -1


def embed_pending(
    settings: Settings, snapshot: str = "", ws: Workspace | None = None, times: PhaseTimes | None = None
) -> int:
    """The store's half of ingest: embed the stored episodes past the embed cursor and upsert
    them (index kept up); returns the segments written. ``ingest_files`` and the fleet's ingest
    service (``components/fleet/embedder.py``) both run it; crash-safe through the cursor."""
    ws, times = ws or step_workspace(settings), PhaseTimes() if times is None else times
    with times.phase("plan"):
        encoder = store_encoder(settings, ws)
        new = episodes_to_embed(settings, ws)
    with times.phase("embed"):
        rows = [embed(settings, new, encoder, snapshot, ws)] if new else []
    upserted = upsert(settings, rows, encoder, ws, times)
    return (upserted.inserted + upserted.updated) if upserted else 0


def ingest_files(
    settings: Settings, files: list[Path], snapshot: bool = True, times: PhaseTimes | None = None
) -> IngestResult:
    """All phases in order, in this process (``snapshot=False``: no DVC, so no remote head either),
    on one set of handles opened after the sync (a pull replaces the dataset's files). ``times``
    collects each phase's seconds."""
    times = PhaseTimes() if times is None else times
    if snapshot:
        with times.phase("sync"):
            sync_to_head(settings)
    ws = step_workspace(settings)
    with times.phase("read"):
        items = [read_file(settings, f) for f in files]
    with times.phase("store"):
        report = store_episodes(settings, items, ws)
    with times.phase("snapshot"):
        snap = take_snapshot(settings, bool(report.added), ws) if snapshot else None
    count = embed_pending(settings, snap.hash if snap else "", ws, times)
    return IngestResult(report, snap, ws.store.version, count)
