"""`evaluate`: roll a policy out on held-out robots, fanned out over robot groups, paired seeds."""

from __future__ import annotations

import hashlib

from prefect import flow, get_run_logger, task, unmapped

from components.config import Settings
from components.evaluation.heldout import EvaluationReport
from components.pipeline import evaluate as step
from components.policy.normalizer import NormalizedPolicy
from flows.runtime import policy_fingerprint, prepare_environment


def _rollout_key(context, parameters) -> str:
    """Same weights + same robots + same settings = the same episodes (seeded simulator)."""
    settings = parameters["settings"]
    return "rollout:" + ":".join([
        policy_fingerprint(parameters["policy"]),
        ",".join(parameters["robot_ids"]),
        hashlib.sha256(settings.model_dump_json(exclude={"root"}).encode()).hexdigest()[:16],
        str(settings.root),
    ])


@task(name="heldout-rollouts", cache_key_fn=_rollout_key, persist_result=True)
def rollout_task(settings: Settings, policy: NormalizedPolicy, robot_ids: list[str], version: str):
    return step.rollouts(settings, policy, robot_ids, version)


@flow(name="evaluate")
def evaluate(policy: NormalizedPolicy, version: str, settings: Settings | None = None) -> EvaluationReport:
    settings = prepare_environment(settings)
    groups = step.robot_groups(settings)
    futures = rollout_task.map(unmapped(settings), unmapped(policy), groups, unmapped(version))
    episodes = [ep for future in futures for ep in future.result()]
    report = step.report(settings, episodes, version)
    get_run_logger().info("%s: held-out success %s", version, report.overall)
    return report
