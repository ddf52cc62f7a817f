"""The loop's order, one home: what a retrain, a bootstrap and a fleet round run, in which order,
on what, and what they return.

- retrain: ingest the files -> train (fine-tunes @champion) -> evaluate the candidate -> promote;
- bootstrap: the scripted expert's demos -> retrain;
- fleet round: the fleet runs @champion for a fixed time per robot -> retrain on what it did.

*Who* runs each step is the caller's: the Prefect flows pass their subflows and tasks (retries,
caching, fan-out, the UI), a study or a test passes the plain step functions (``plain_retrain_steps``,
``plain_fleet_steps``). So a benchmark that runs rounds runs the rounds the flows run.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any, Generic, TypeVar

from components.config import Settings
from components.evaluation.heldout import EvaluationReport
from components.pipeline import collect, promote
from components.pipeline.evaluate import evaluate_policy
from components.pipeline.ingest import IngestResult, incoming_files, ingest_files
from components.pipeline.promote import PromotionOutcome
from components.pipeline.steps import TrainOutcome, train_policy
from components.pipeline.workspace import Workspace
from components.policy.normalizer import NormalizedPolicy

Evaluate = Callable[[NormalizedPolicy, str, Settings], EvaluationReport]
Retrained = TypeVar("Retrained")  # what a retrain returns to the fleet loop: the flow's outcome, or a Retrain
# what train hands to evaluate and promote: a TrainOutcome in one process, a reference to the
# staged candidate between flows (components/pipeline/references.py: Prefect records it)
Trained = TypeVar("Trained")


@dataclass(frozen=True)
class RetrainSteps(Generic[Trained]):
    """A retrain's four steps, with the flows' signatures (settings last)."""

    ingest: Callable[[list[Path] | None, Settings], Any]  # None: all of datasets/incoming; -> what it did
    train: Callable[[Settings], Trained]
    evaluate: Callable[[Trained, str, Settings], EvaluationReport]  # (candidate, label, settings): its held-out report
    promote: Callable[[Trained, EvaluationReport, str, Settings], PromotionOutcome]
    # the settings train, evaluate and promote run with, from the root as ingested (a study sets a
    # round's epochs from the frames stored); the registered params are these
    configure: Callable[[Settings], Settings] = lambda settings: settings  # the flows: as given


@dataclass(frozen=True)
class Retrain:
    """Everything one retrain produced."""

    ingested: Any  # IngestResult in one process (IngestSummary from the flow), None when no files
    outcome: Any  # what train returned: TrainOutcome, or the flow's CandidateRef
    report: EvaluationReport  # the candidate on the held-out (gate) robots
    promotion: PromotionOutcome
    seconds: dict[str, float]  # wall seconds per step: ingest, train, evaluate, promote


def retrain(files: list[Path] | None, run_name: str, settings: Settings, steps: RetrainSteps[Any]) -> Retrain:
    seconds: dict[str, float] = {}
    with _timed(seconds, "ingest"):
        ingested = steps.ingest(files, settings)
        settings = steps.configure(settings)
    with _timed(seconds, "train"):
        outcome = steps.train(settings)
    with _timed(seconds, "evaluate"):
        report = steps.evaluate(outcome, "candidate", settings)
    with _timed(seconds, "promote"):
        promotion = steps.promote(outcome, report, run_name, settings)
    return Retrain(ingested, outcome, report, promotion, seconds)


@contextmanager
def _timed(seconds: dict[str, float], step: str) -> Iterator[None]:
    start = time.perf_counter()
    yield
    seconds[step] = time.perf_counter() - start


@dataclass(frozen=True)
class FleetSteps(Generic[Retrained]):
    """The fleet loop's steps: demos, a round's collection, and a retrain on the collected files."""

    collect_expert: Callable[[Settings], collect.CollectResult]
    collect_round: Callable[[Settings, int, int, int | None], collect.CollectResult]  # round, champion version, robots
    retrain: Callable[[list[Path], str, Settings], Retrained]  # (files, run name, settings)


def bootstrap(settings: Settings, steps: FleetSteps[Retrained]) -> tuple[collect.CollectResult, Retrained]:
    """Scripted-expert demos -> the first champion."""
    demos = steps.collect_expert(settings)
    return demos, steps.retrain(demos.files, "bootstrap", settings)


def fleet_round(settings: Settings, round_index: int, num_robots: int | None,
                steps: FleetSteps[Retrained]) -> tuple[collect.CollectResult, Retrained]:
    """``round_index`` seeds the fleet; ``num_robots`` None = ``fleet.num_robots``."""
    champion = Workspace(settings).registry.champion()
    if champion is None:
        raise RuntimeError("no champion to run on the fleet: bootstrap first with `fleetloop retrain --bootstrap`")
    collected = steps.collect_round(settings, round_index, champion.version, num_robots)
    return collected, steps.retrain(collected.files, f"round-{round_index}", settings)


def stored_data_round(settings: Settings, round_index: int, steps: FleetSteps[Retrained],
                      label: str = "round") -> tuple[None, Retrained]:
    """A round without the fleet: a retrain on what the store already holds (no new files), through
    the gate. A study's demos-only baseline, or more training of the bootstrap's policy on its demos."""
    return None, steps.retrain([], f"{label}-{round_index}", settings)


def campaign(settings: Settings, rounds: int, first: Callable[[Settings], tuple[collect.CollectResult, Retrained]],
             round_: Callable[[Settings, int], tuple[collect.CollectResult | None, Retrained]],
             ) -> Iterator[tuple[int, collect.CollectResult | None, Retrained]]:
    """The loop over rounds: ``first`` (a bootstrap) as round 0, then rounds 1..``rounds``
    (``round_(settings, r)``, r seeds the fleet), each yielded as it finishes. The demo passes the
    flows (one flow run per round), a study the loop's functions over its plain steps."""
    yield (0, *first(settings))
    for r in range(1, rounds + 1):
        yield (r, *round_(settings, r))


# ----------------------------------------------------------------------------- the plain steps
def ingest_or_skip(files: list[Path] | None, settings: Settings, snapshot: bool = True) -> IngestResult | None:
    """``ingest_files`` in this process (None: every file under ``datasets/incoming``, as the flow);
    no files, nothing to do (a demos-only round)."""
    files = incoming_files(settings) if files is None else files
    return ingest_files(settings, files, snapshot=snapshot) if files else None


def plain_retrain_steps(snapshot: bool = True, evaluate: Evaluate | None = None,
                        configure: Callable[[Settings], Settings] | None = None) -> RetrainSteps[TrainOutcome]:
    """Every step in this process. ``snapshot=False`` skips the DVC snapshot (lineage without a
    snapshot hash: nothing to reproduce from, the same models); ``evaluate`` replaces the held-out
    evaluation of candidate and champion alike (a study reuses a champion's report)."""
    evaluate = evaluate or (lambda policy, version, settings: evaluate_policy(settings, policy, version))
    return RetrainSteps(
        ingest=partial(ingest_or_skip, snapshot=snapshot),
        train=train_policy,
        evaluate=lambda outcome, version, settings: evaluate(outcome.result.policy, version, settings),
        promote=partial(promote.promote_candidate, evaluate=evaluate),
        configure=configure or RetrainSteps.configure,
    )


def plain_fleet_steps(retrain_steps: RetrainSteps[TrainOutcome]) -> FleetSteps[Retrain]:
    return FleetSteps(collect.collect_expert, collect.collect_round, partial(retrain, steps=retrain_steps))
