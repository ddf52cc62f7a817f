"""`ingest`: read files (fan-out in chunks) → validate + store → DVC snapshot → embed (fan-out in chunks) → upsert."""

from __future__ import annotations

from pathlib import Path

from prefect import flow, get_run_logger, task, unmapped
from prefect.cache_policies import NO_CACHE

from components.config import Settings
from components.pipeline import ingest as step
from components.pipeline.references import IngestSummary, episode_files
from flows.runtime import flow_options, io_options, prepare_environment, task_runner


@task(name="read-episodes", cache_policy=NO_CACHE)
def read_task(settings: Settings, paths: list[Path]) -> list:
    """Not cached: its result is the episodes themselves, and Prefect would persist them. Storing a
    file already stored is a duplicate that changes nothing."""
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


@task(name="embed-episodes", cache_policy=NO_CACHE)
def embed_task(settings: Settings, episodes: list, encoder, snapshot: str):
    """Not cached (its result is segment rows with vectors); only episodes past the embed cursor come here."""
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
def ingest(files: list[Path] | None = None, settings: Settings | None = None) -> IngestSummary:
    """Validate and store episode files; bad files go to quarantine, good ones are kept.

    ``files`` are episode files or folders of them (a fleet round passes its folder). Without
    ``files`` it takes everything under ``datasets/incoming`` (what a scheduled run does): files
    already stored are recognized as duplicates and change nothing. Returns counts and references.
    """
    settings = prepare_environment(settings)
    logger = get_run_logger()
    files = step.incoming_files(settings) if files is None else episode_files(files)
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
    result = step.IngestResult(report, snapshot, store_version_task.with_options(**io)(settings), upserted)
    return IngestSummary.of(result)


def run_ingest(files: list[Path], settings: Settings) -> IngestSummary:
    return ingest.with_options(task_runner=task_runner(settings), **flow_options(settings))(files, settings)
