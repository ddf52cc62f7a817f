"""`evaluate`: roll a model out on held-out robots, fanned out over robot groups, paired seeds.

Takes a model URI (a registered version or a staged candidate, ``components/pipeline/references.py``):
each rollout task loads the weights itself, so no model travels through Prefect.
"""

from __future__ import annotations

import hashlib

from prefect import flow, get_run_logger, task, unmapped

from components.config import Settings
from components.evaluation.heldout import EvaluationReport, Trial
from components.pipeline import evaluate as step
from components.pipeline.references import load_model, model_fingerprint
from flows.runtime import prepare_environment


def _rollout_key(context, parameters) -> str:
    """Same weights + same robots + same settings = the same episodes (seeded simulator)."""
    settings = parameters["settings"]
    return "rollout:" + ":".join([
        parameters["fingerprint"],
        ",".join(parameters["robot_ids"]),
        hashlib.sha256(settings.model_dump_json(exclude={"root"}).encode()).hexdigest()[:16],
        str(settings.root),
    ])


@task(name="heldout-rollouts", cache_key_fn=_rollout_key, persist_result=True)
def rollout_task(settings: Settings, model_uri: str, fingerprint: str, robot_ids: list[str], version: str) -> list[Trial]:
    return step.trials(settings, load_model(settings, model_uri), robot_ids, version)


@flow(name="evaluate")
def evaluate(model_uri: str, version: str, settings: Settings | None = None) -> EvaluationReport:
    settings = prepare_environment(settings)
    fingerprint = model_fingerprint(settings, model_uri)
    groups = step.robot_groups(settings)
    futures = rollout_task.map(unmapped(settings), unmapped(model_uri), unmapped(fingerprint), groups, unmapped(version))
    trials = [trial for future in futures for trial in future.result()]
    report = step.report(settings, trials, version)
    get_run_logger().info("%s: held-out success %s", version, report.overall)
    return report
