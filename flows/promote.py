"""`promote`: register the staged candidate in MLflow, evaluate the champion on the same trials, gate.

It takes a reference to the candidate (``CandidateRef``) and the candidate's held-out report; the
model and its retrieval record are loaded from the staged file by the task that registers them.
"""

from __future__ import annotations

from prefect import flow, get_run_logger, task
from prefect.cache_policies import NO_CACHE

from components.config import Settings
from components.evaluation.heldout import EvaluationReport
from components.pipeline import promote as step
from components.pipeline.references import CandidateRef, load_candidate
from components.pipeline.workspace import Workspace
from components.registry.model_registry import PolicyVersion
from flows.evaluate import evaluate
from flows.runtime import io_options, prepare_environment


@task(name="register-candidate", cache_policy=NO_CACHE)
def register_task(settings: Settings, candidate: CandidateRef, report: EvaluationReport, run_name: str,
                  champion_eval: EvaluationReport | None) -> PolicyVersion:
    return step.register_candidate(settings, load_candidate(candidate), report, run_name,
                                   champion_evaluation=champion_eval)


@task(name="champion", cache_policy=NO_CACHE)
def champion_task(settings: Settings) -> PolicyVersion | None:
    return Workspace(settings).registry.champion()


@task(name="gate", cache_policy=NO_CACHE)
def gate_task(settings: Settings, candidate: PolicyVersion, champion_eval: EvaluationReport | None) -> step.PromotionOutcome:
    return step.gate_candidate(settings, candidate, champion_eval)


@flow(name="promote")
def promote(candidate: CandidateRef, report: EvaluationReport, run_name: str = "retrain",
            settings: Settings | None = None) -> step.PromotionOutcome:
    settings = prepare_environment(settings)
    io = io_options(settings)
    champion = champion_task.with_options(**io)(settings)
    champion_eval = evaluate(champion.uri, f"v{champion.version}", settings) if champion else None
    version = register_task.with_options(**io)(settings, candidate, report, run_name, champion_eval)
    result = gate_task.with_options(**io)(settings, version, champion_eval)
    get_run_logger().info("version %d: %s", version.version, result.decision.reason)
    return result
