"""Promote step: log + register the candidate, then gate it against the champion's paired evaluation."""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from components.config import Settings
from components.evaluation.heldout import EvaluationReport
from components.fert.retrieval_record import ARTIFACT as RETRIEVAL_ARTIFACT
from components.pipeline.recipe import (
    SETTINGS_ARTIFACT,
    keep_store_version,
    public_settings,
)
from components.pipeline.steps import TrainingSummary, TrainOutcome
from components.pipeline.workspace import Workspace
from components.policy.normalizer import NormalizedPolicy
from components.registry.canary import CanaryRollout  # the live half of the gate
from components.registry.gate import GateDecision
from components.registry.model_registry import PolicyVersion

CHAMPION_EVALUATION_ARTIFACT = "champion_evaluation.json"  # on the candidate's run, beside evaluation.json


@dataclass(frozen=True)
class PromotionOutcome:
    candidate: PolicyVersion
    decision: GateDecision
    champion_before: int | None
    champion_after: int | None
    champion_eval: dict | None = None
    canary: int | None = None  # the version now rolling out as canary (rollout: canary)
    training: TrainingSummary | None = None  # how the candidate was trained (method, plan, timings)


def register_candidate(settings: Settings, outcome: TrainOutcome, evaluation: EvaluationReport, run_name: str,
                       tags: dict[str, str] | None = None,
                       champion_evaluation: EvaluationReport | None = None) -> PolicyVersion:
    """One MLflow run (params, metrics, lineage, how it was trained, model) registered as a new version;
    ``tags`` (e.g. the fleet trainer's run and step) go on the run and the version with the lineage.
    What ``fleetloop reproduce`` needs is kept with it (``recipe.py``); ``champion_evaluation`` (the
    champion on the same trials, what the gate compares) too, for the failure explorer's before/after."""
    summary = outcome.summary
    metrics = {"train_final_loss": outcome.result.final_loss, "train_seconds": outcome.result.seconds,
               "train_frames": outcome.frames, **(summary.metrics() if summary else {})}
    with tempfile.TemporaryDirectory() as tmp:
        images = []
        for source, name in ((summary and summary.gantt_png, "schedule_gantt.png"),
                             (summary and summary.usage_png, "expert_usage.png")):
            if source and Path(source).exists():
                images.append(Path(tmp) / name)
                shutil.copyfile(source, images[-1])
        version = Workspace(settings).registry.log_candidate(
            outcome.result.policy,
            evaluation.to_dict(),
            outcome.lineage,
            params=public_settings(settings),
            metrics=metrics,
            loss_curve=outcome.result.losses,
            series=summary.series() if summary else None,
            run_name=run_name,
            tags={**(summary.tags() if summary else {}), **(tags or {})} or None,
            artifacts=images,
            dicts={**_run_dicts(outcome), SETTINGS_ARTIFACT: public_settings(settings),
                   **({CHAMPION_EVALUATION_ARTIFACT: champion_evaluation.to_dict()} if champion_evaluation else {})},
        )
    keep_store_version(settings, version.version, outcome.lineage)
    return version


def promote_candidate(outcome: TrainOutcome, evaluation: EvaluationReport, run_name: str, settings: Settings,
                      evaluate: Callable[[NormalizedPolicy, str, Settings], EvaluationReport]) -> PromotionOutcome:
    """The promote step in one process: the champion evaluated by ``evaluate`` on the candidate's
    trials (paired), the candidate registered, then gated. The promote flow runs the same as tasks."""
    registry = Workspace(settings).registry
    champion = registry.champion()
    champion_eval = evaluate(registry.load(champion.version), f"v{champion.version}", settings) if champion else None
    candidate = register_candidate(settings, outcome, evaluation, run_name, champion_evaluation=champion_eval)
    return gate_candidate(settings, candidate, champion_eval)


def _run_dicts(outcome: TrainOutcome) -> dict[str, dict]:
    """JSON files on the run: how it was trained, and (fert) what its retrieval used."""
    dicts = {}
    if outcome.summary is not None:
        dicts["training.json"] = {**outcome.summary.__dict__, "retrieved_segments": outcome.summary.retrieved_segments}
    if outcome.retrieval is not None:
        dicts[RETRIEVAL_ARTIFACT] = outcome.retrieval.to_dict()
    return dicts


def gate_candidate(settings: Settings, candidate: PolicyVersion, champion_eval: EvaluationReport | None) -> PromotionOutcome:
    """Move ``champion`` to the candidate only if the gate says it is better on the same trials."""
    ws = Workspace(settings)
    registry = ws.registry
    before = registry.champion()
    canary_rollout = settings.registry.rollout == "canary"
    decision = registry.promote_if_better(
        candidate,
        champion_eval.overall.successes if champion_eval else None,
        champion_eval.overall.trials if champion_eval else None,
        move_alias=not canary_rollout,
    )
    canary = None
    if decision.promote and canary_rollout:
        CanaryRollout(registry, ws.dataset, settings.runtime).start(candidate.version)
        canary = registry.aliases().get(settings.runtime.canary_alias)
    after = registry.champion()
    return PromotionOutcome(
        candidate, decision, before.version if before else None, after.version if after else None,
        champion_eval.to_dict() if champion_eval else None, canary,
    )
