"""`retrain`: ingest → train → evaluate on held-out robots → promote, each a subflow; then the failure
explorer (fert rounds); artifacts for the UI.

Between the subflows travel references (``components/pipeline/references.py``): the ingest's counts
and snapshot, the staged candidate, model URIs; models and records stay in their stores.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

from prefect import flow

from components.config import Settings
from components.pipeline import loop
from components.pipeline.promote import PromotionOutcome
from components.pipeline.references import load_candidate
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
    """``files``: episode files or folders of them (a fleet round passes its folder); None = all of datasets/incoming."""
    settings = prepare_environment(settings)
    options = {"task_runner": task_runner(settings), **flow_options(settings)}
    evaluate_flow = evaluate.with_options(**options)
    done = loop.retrain(files, run_name, settings, loop.RetrainSteps(
        ingest=ingest.with_options(**options), train=train.with_options(**flow_options(settings)),
        evaluate=lambda candidate, version, s: evaluate_flow(candidate.model_uri, version, s),
        promote=promote.with_options(**options)))
    ingested, candidate, report, promotion = done.ingested, done.outcome, done.report, done.promotion
    registry = Workspace(settings).registry
    run_url = f"http://127.0.0.1:{settings.ops.mlflow_port}/#/experiments/{registry.experiment_id}/runs/{promotion.candidate.run_id}"
    artifacts.retrain_summary(ingested, report, promotion, run_url, load_candidate(candidate).result.losses,
                              candidate.summary, done.seconds)
    artifacts.failure_tables(report)
    explained = explain_task.with_options(**io_options(settings))(settings, promotion.candidate.version)
    if explained is not None:
        artifacts.explanation(explained, run_url)
    if candidate.summary is None:
        return promotion
    return dataclasses.replace(promotion, training=candidate.summary)
