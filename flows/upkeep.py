"""`store-upkeep`: merge the dataset's small data files left by older versions
(``compact_dataset``), then compact the segment store, retrain its index as it grows, prune old
versions and restore the embed cursor's row count if it broke (``upkeep_store``); both in
``components.pipeline.ingest``.

Versions older than ``store.retain_versions_days`` go; tagged versions (lineage) stay. Runs on
``store.upkeep_cron`` when served (``deployment``), or by hand: ``fleetloop store-upkeep``.
"""

from __future__ import annotations

from prefect import flow, get_run_logger, task
from prefect.cache_policies import NO_CACHE

from components.config import Settings
from components.pipeline.ingest import compact_dataset, upkeep_store
from components.store.segment_store import UpkeepReport
from flows.runtime import flow_options, io_options, prepare_environment

DEPLOYMENT = "store-upkeep"


@task(name="dataset-compaction", cache_policy=NO_CACHE)
def compact_task(settings: Settings) -> int:
    return compact_dataset(settings)


@task(name="store-upkeep", cache_policy=NO_CACHE)
def upkeep_task(settings: Settings) -> UpkeepReport:
    return upkeep_store(settings)


@flow(name="store-upkeep")
def store_upkeep(settings: Settings | None = None) -> UpkeepReport:
    settings = prepare_environment(settings)
    compacted = compact_task.with_options(**io_options(settings))(settings)
    get_run_logger().info("dataset: the small data files of %d older episodes-table files merged", compacted)
    report = upkeep_task.with_options(**io_options(settings))(settings)
    get_run_logger().info(
        "store upkeep: %d -> %d versions, %.1f -> %.1f MiB, %d -> %d fragments, index %s; tags kept: %s",
        report.versions_before, report.versions_after, report.bytes_before / 2**20, report.bytes_after / 2**20,
        report.fragments_before, report.fragments_after,
        report.index_action, report.tags or "none",
    )
    return report


def run_upkeep(settings: Settings) -> UpkeepReport:
    return store_upkeep.with_options(**flow_options(settings))(settings)


def deployment(settings: Settings):
    """The scheduled deployment (add it to ``flows.schedules.deployments`` to serve it)."""
    return store_upkeep.to_deployment(name=DEPLOYMENT, cron=settings.store.upkeep_cron, tags=["fleetloop"])
