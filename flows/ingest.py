"""`ingest`: read files (fan-out in chunks, cached on content) → validate + store → DVC snapshot → embed (fan-out in chunks) → upsert."""

from __future__ import annotations

import hashlib
from pathlib import Path

from prefect import flow, get_run_logger, task, unmapped
from prefect.cache_policies import NO_CACHE

from components.config import Settings
from components.pipeline import ingest as step
from components.store.encoder import encoder_fingerprint
from flows.runtime import flow_options, io_options, prepare_environment, task_runner


def _files_key(context, parameters) -> str:
    """A chunk's read is cached on its files' paths and contents: a changed file is read again."""
    digest = hashlib.sha256()
    for path in map(Path, parameters["paths"]):
        digest.update(str(path.resolve()).encode())
        digest.update(hashlib.sha256(path.read_bytes()).digest() if path.exists() else b"missing")
    return f"read:{digest.hexdigest()}"


@task(name="read-episodes", cache_key_fn=_files_key, persist_result=True)
def read_task(settings: Settings, paths: list[Path]) -> list:
    return [step.read_file(settings, path) for path in paths]


@task(name="sync-dataset", cache_policy=NO_CACHE)
def sync_task(settings: Settings) -> step.SyncResult:
    """With a DVC remote, the dataset is brought to the remote's head first (another host may have ingested)."""
    return step.sync_to_head(settings)


@task(name="store-episodes", cache_policy=NO_CACHE)
def store_task(settings: Settings, items: list):
    return step.store_episodes(settings, items)


@task(name="dvc-snapshot", cache_policy=NO_CACHE)
def snapshot_task(settings: Settings, changed: bool):
    return step.take_snapshot(settings, changed)


def _embed_key(context, parameters) -> str:
    """Segment rows depend only on the episodes' content, the encoder and the window config."""
    settings, digest = parameters["settings"], hashlib.sha256()
    for episode in parameters["episodes"]:
        for array in (episode.states, episode.actions):
            digest.update(array.tobytes())
        fields = (episode.episode_id, episode.robot_id, episode.task, episode.success, episode.policy_version)
        digest.update(repr(fields).encode())
    digest.update(parameters["snapshot"].encode())
    digest.update(settings.store.model_dump_json().encode())
    return f"embed:{settings.root}:{digest.hexdigest()[:24]}:{encoder_fingerprint(parameters['encoder'])}"


@task(name="embed-episodes", cache_key_fn=_embed_key, persist_result=True)
def embed_task(settings: Settings, episodes: list, encoder, snapshot: str):
    return step.embed(settings, episodes, encoder, snapshot)


@task(name="plan-embedding", cache_policy=NO_CACHE)
def embed_plan_task(settings: Settings):
    """The store's encoder and the stored episodes past its embed cursor ((None, []) while the
    dataset is empty). A task, not flow code: a store that drops out is retried like every write."""
    if not step.Workspace(settings).dataset.num_episodes:
        return None, []
    return step.store_encoder(settings), step.episodes_to_embed(settings)


@task(name="upsert-segments", cache_policy=NO_CACHE)
def upsert_task(settings: Settings, rows: list, encoder):
    return step.upsert(settings, rows, encoder)


@task(name="store-version", cache_policy=NO_CACHE)
def store_version_task(settings: Settings) -> int:
    return step.Workspace(settings).store.version


@flow(name="ingest")
def ingest(files: list[Path] | None = None, settings: Settings | None = None) -> step.IngestResult:
    """Validate and store episode files; bad files go to quarantine, good ones are kept.

    Without ``files`` it takes everything under ``datasets/incoming`` (what a scheduled run
    does): files already stored are recognized as duplicates and change nothing.
    """
    settings = prepare_environment(settings)
    logger = get_run_logger()
    files = step.incoming_files(settings) if files is None else [Path(f) for f in files]
    io = io_options(settings)
    synced = sync_task.with_options(**io)(settings)
    if synced.action == "pulled":
        logger.info("dataset brought to the remote's head %s (%d episodes)", synced.snapshot, synced.episodes)
    reads = read_task.with_options(**io).map(unmapped(settings), step.read_groups(settings, files))
    items = [item for f in reads for item in f.result()]
    report = store_task.with_options(**io)(settings, items)
    snapshot = snapshot_task.with_options(**io)(settings, report.changed)
    encoder, new = embed_plan_task.with_options(**io)(settings)
    upserted = 0
    if encoder is not None:
        snap = snapshot.hash if snapshot else ""
        groups = step.embed_groups(settings, new)
        rows = [f.result() for f in embed_task.map(unmapped(settings), groups, unmapped(encoder), unmapped(snap))]
        result = upsert_task.with_options(**io)(settings, rows, encoder)
        upserted = (result.inserted + result.updated) if result else 0
    logger.info("%s; snapshot %s", report.summary(), snapshot.hash if snapshot else "-")
    for item in report.quarantined:
        logger.warning("quarantined %s: field %r: %s (fix: %s)", item.source, item.field, item.reason, item.fix)
    return step.IngestResult(report, snapshot, store_version_task.with_options(**io)(settings), upserted)


def run_ingest(files: list[Path], settings: Settings) -> step.IngestResult:
    return ingest.with_options(task_runner=task_runner(settings), **flow_options(settings))(files, settings)
