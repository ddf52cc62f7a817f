"""`ingest`: read files (fan-out, cached on content) → validate + store → DVC snapshot → embed (fan-out) → upsert."""

from __future__ import annotations

import hashlib
from pathlib import Path

from prefect import flow, get_run_logger, task, unmapped
from prefect.cache_policies import INPUTS, NO_CACHE, TASK_SOURCE

from components.config import Settings
from components.pipeline import ingest as step
from flows.runtime import io_options, prepare_environment, task_runner


def _file_key(context, parameters) -> str:
    """A file's read is cached on its path and content: a changed file is read again."""
    path = Path(parameters["path"])
    content = hashlib.sha256(path.read_bytes()).hexdigest() if path.exists() else "missing"
    return f"read:{path.resolve()}:{content}"


@task(name="read-episode", cache_key_fn=_file_key, persist_result=True)
def read_task(settings: Settings, path: Path):
    return step.read_file(settings, path)


@task(name="store-episodes", cache_policy=NO_CACHE)
def store_task(settings: Settings, items: list):
    return step.store_episodes(settings, items)


@task(name="dvc-snapshot", cache_policy=NO_CACHE)
def snapshot_task(settings: Settings, changed: bool):
    return step.take_snapshot(settings, changed)


@task(name="embed-episode", cache_policy=INPUTS + TASK_SOURCE, persist_result=True)
def embed_task(settings: Settings, episode, encoder, snapshot: str):
    return step.embed(settings, [episode], encoder, snapshot)


@task(name="upsert-segments", cache_policy=NO_CACHE)
def upsert_task(settings: Settings, rows: list, encoder):
    return step.upsert(settings, rows, encoder)


@flow(name="ingest")
def ingest(files: list[Path] | None = None, settings: Settings | None = None) -> step.IngestResult:
    """Validate and store episode files; bad files go to quarantine, good ones are kept."""
    settings = prepare_environment(settings)
    logger = get_run_logger()
    files = [Path(f) for f in (files or [])]
    io = io_options(settings)
    items = [f.result() for f in read_task.with_options(**io).map(unmapped(settings), files)]
    report = store_task.with_options(**io)(settings, items)
    snapshot = snapshot_task.with_options(**io)(settings, report.changed)
    encoder = step.store_encoder(settings) if step.Workspace(settings).dataset.num_episodes else None
    upserted = 0
    if encoder is not None:
        new = step.episodes_to_embed(settings)
        snap = snapshot.hash if snapshot else ""
        rows = [f.result() for f in embed_task.map(unmapped(settings), new, unmapped(encoder), unmapped(snap))]
        result = upsert_task.with_options(**io)(settings, rows, encoder)
        upserted = (result.inserted + result.updated) if result else 0
    logger.info("%s; snapshot %s", report.summary(), snapshot.hash if snapshot else "-")
    for item in report.quarantined:
        logger.warning("quarantined %s: field %r: %s (fix: %s)", item.source, item.field, item.reason, item.fix)
    return step.IngestResult(report, snapshot, step.Workspace(settings).store.version, upserted)


def run_ingest(files: list[Path], settings: Settings) -> step.IngestResult:
    return ingest.with_options(task_runner=task_runner(settings))(files, settings)
