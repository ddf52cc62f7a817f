"""`promote`: register the candidate in MLflow, evaluate the champion on the same trials, gate."""

from __future__ import annotations

from prefect import flow, get_run_logger, task
from prefect.cache_policies import NO_CACHE

from components.config import Settings
from components.evaluation.heldout import EvaluationReport
from components.pipeline import promote as step
from components.pipeline.steps import TrainOutcome
from components.pipeline.workspace import Workspace
from flows.evaluate import evaluate
from flows.runtime import io_options, prepare_environment


@task(name="register-candidate", cache_policy=NO_CACHE)
def register_task(settings: Settings, outcome: TrainOutcome, report: EvaluationReport, run_name: str,
                  champion_eval: EvaluationReport | None):
    return step.register_candidate(settings, outcome, report, run_name, champion_evaluation=champion_eval)


@task(name="load-champion", cache_policy=NO_CACHE)
def load_champion_task(settings: Settings):
    registry = Workspace(settings).registry
    champion = registry.champion()
    return (champion, registry.load(champion.version)) if champion else (None, None)


@task(name="gate", cache_policy=NO_CACHE)
def gate_task(settings: Settings, candidate, champion_eval: EvaluationReport | None) -> step.PromotionOutcome:
    return step.gate_candidate(settings, candidate, champion_eval)


@flow(name="promote")
def promote(outcome: TrainOutcome, report: EvaluationReport, run_name: str = "retrain", settings: Settings | None = None) -> step.PromotionOutcome:
    settings = prepare_environment(settings)
    io = io_options(settings)
    champion, champion_policy = load_champion_task.with_options(**io)(settings)
    champion_eval = evaluate(champion_policy, f"v{champion.version}", settings) if champion else None
    candidate = register_task.with_options(**io)(settings, outcome, report, run_name, champion_eval)
    result = gate_task.with_options(**io)(settings, candidate, champion_eval)
    get_run_logger().info("version %d: %s", candidate.version, result.decision.reason)
    return result
