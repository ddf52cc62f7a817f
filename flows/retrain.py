"""`retrain`: ingest → train → evaluate on held-out robots → log to MLflow → gate → champion."""

from __future__ import annotations

from pathlib import Path

from prefect import flow, get_run_logger, task
from prefect.cache_policies import NO_CACHE
from prefect.artifacts import create_markdown_artifact, create_table_artifact

from components.config import Settings
from components.evaluation.heldout import EvaluationReport
from components.pipeline import steps


@task(name="ingest", retries=2, retry_delay_seconds=[2, 10], cache_policy=NO_CACHE)
def ingest_task(settings: Settings, files: list[Path]) -> steps.IngestResult:
    logger = get_run_logger()
    result = steps.ingest_files(settings, files)
    r = result.report
    logger.info(
        "ingested %d episodes (%d duplicates skipped, %d quarantined); snapshot %s; LanceDB v%d",
        len(r.added), len(r.duplicates), len(r.quarantined), result.snapshot.hash if result.snapshot else "-", result.store_version,
    )
    for item in r.quarantined:
        logger.warning("quarantined %s", item)
    return result


@task(name="train", cache_policy=NO_CACHE)
def train_task(settings: Settings) -> steps.TrainOutcome:
    logger = get_run_logger()

    def progress(step: int, total: int, loss: float) -> None:
        if step == total or step % (settings.train.log_every * 10) == 1:
            logger.info("step %d/%d loss %.4f", step, total, loss)

    outcome = steps.train_policy(settings, progress)
    logger.info("trained %s on %d frames in %.1fs (final loss %.4f)", settings.train.method, outcome.frames, outcome.result.seconds, outcome.result.final_loss)
    return outcome


@task(name="evaluate", cache_policy=NO_CACHE)
def evaluate_task(settings: Settings, outcome: steps.TrainOutcome) -> EvaluationReport:
    report = steps.evaluate_policy(settings, outcome.result.policy, "candidate")
    get_run_logger().info("held-out success %s", report.overall)
    return report


@task(name="promote", retries=2, retry_delay_seconds=[2, 10], cache_policy=NO_CACHE)
def promote_task(settings: Settings, outcome: steps.TrainOutcome, report: EvaluationReport, run_name: str) -> steps.PromotionOutcome:
    result = steps.register_and_promote(settings, outcome, report, run_name)
    get_run_logger().info("version %d: %s", result.candidate.version, result.decision.reason)
    return result


def _summary_markdown(ingest: steps.IngestResult, report: EvaluationReport, promotion: steps.PromotionOutcome) -> str:
    return "\n".join([
        "# fleetloop retrain",
        f"- held-out success: **{report.overall}**",
        f"- candidate: version {promotion.candidate.version} (run `{promotion.candidate.run_id}`)",
        f"- champion before → after: {promotion.champion_before} → {promotion.champion_after}",
        f"- gate: {promotion.decision.reason}",
        f"- dataset snapshot: `{ingest.snapshot.hash if ingest.snapshot else '-'}`, LanceDB version {ingest.store_version}",
        f"- ingest: {len(ingest.report.added)} new, {len(ingest.report.duplicates)} duplicates, {len(ingest.report.quarantined)} quarantined",
    ])


@flow(name="retrain", log_prints=True)
def retrain(settings: Settings, files: list[Path], run_name: str = "retrain") -> steps.PromotionOutcome:
    ingest = ingest_task(settings, files)
    outcome = train_task(settings, wait_for=[ingest])
    report = evaluate_task(settings, outcome)
    promotion = promote_task(settings, outcome, report, run_name)
    create_markdown_artifact(_summary_markdown(ingest, report, promotion), key="retrain-summary", description="retrain summary")
    rows = [
        {"robot": robot, "successes": p.successes, "trials": p.trials, "rate": round(p.rate, 3)}
        for robot, p in report.by_robot.items()
    ]
    rows += [{"robot": f"stage:{stage}", "successes": 0, "trials": count, "rate": 0.0} for stage, count in report.failures_by_stage.items()]
    create_table_artifact(rows, key="heldout-by-robot", description="held-out results by robot and failures by stage")
    return promotion
