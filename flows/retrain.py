"""`retrain`: ingest → train → evaluate on held-out robots → promote, each a subflow; then the failure
explorer (fert rounds); artifacts for the UI."""

from __future__ import annotations

import dataclasses
from pathlib import Path

from prefect import flow

from components.config import Settings
from components.pipeline import loop
from components.pipeline.promote import PromotionOutcome
from components.pipeline.workspace import Workspace
from flows import artifacts
from flows.evaluate import evaluate
from flows.explain import explain_task
from flows.ingest import ingest
from flows.promote import promote
from flows.runtime import flow_options, io_options, prepare_environment, task_runner
from flows.train import train


@flow(name="retrain")
def retrain(files: list[Path] | None = None, run_name: str = "retrain", settings: Settings | None = None) -> PromotionOutcome:
    settings = prepare_environment(settings)
    options = {"task_runner": task_runner(settings), **flow_options(settings)}
    done = loop.retrain(files, run_name, settings, loop.RetrainSteps(
        ingest=ingest.with_options(**options), train=train.with_options(**flow_options(settings)),
        evaluate=evaluate.with_options(**options), promote=promote.with_options(**options)))
    ingested, outcome, report, promotion = done.ingested, done.outcome, done.report, done.promotion
    registry = Workspace(settings).registry
    run_url = f"http://127.0.0.1:{settings.ops.mlflow_port}/#/experiments/{registry.experiment_id}/runs/{promotion.candidate.run_id}"
    artifacts.retrain_summary(ingested, report, promotion, run_url, outcome.result.losses, outcome.summary, done.seconds)
    artifacts.failure_tables(report)
    explained = explain_task.with_options(**io_options(settings))(settings, promotion.candidate.version)
    if explained is not None:
        artifacts.explanation(explained, run_url)
    if outcome.summary is None:
        return promotion
    return dataclasses.replace(promotion, training=outcome.summary)
