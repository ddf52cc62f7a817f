"""`make demo`: bootstrap from scripted-expert demos, then a few fleet rounds on ``@champion``.

Each round is its own flow run (``bootstrap``, ``fleet_round``), so the Prefect UI shows them
one by one; the CLI drives the rounds and prints the per-round table.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from dataclasses import dataclass

from components.config import Settings
from components.evaluation.intervals import wilson_interval
from components.pipeline import loop
from components.pipeline.collect import CollectResult
from components.pipeline.promote import PromotionOutcome
from flows.fleet_round import bootstrap, fleet_round


@dataclass(frozen=True)
class RoundRow:
    round: str
    robots: int
    episodes: int
    collected_success: float
    heldout: str
    trials: int
    promoted: bool
    champion: int | None
    method: str = "-"
    plan: str = "-"
    iteration_ms: str = "-"  # measured median, and the sequential plan's when the plan was chosen
    retrieved: int = 0  # FERT: segments retrieved for the champion's failures


def _rate_with_ci(successes: int, trials: int, confidence: float) -> str:
    p = wilson_interval(successes, trials, confidence)
    return f"{100 * p.rate:.1f}% [{100 * p.low:.1f}, {100 * p.high:.1f}]"


def _row(label: str, robots: int, collected: CollectResult, promotion: PromotionOutcome, confidence: float) -> RoundRow:
    cand = promotion.candidate
    row = RoundRow(
        label, robots, collected.episodes, collected.success_rate,
        _rate_with_ci(cand.successes, cand.trials, confidence), cand.trials, promotion.decision.promote, promotion.champion_after,
    )
    t = promotion.training
    if t is None:
        return row
    seq = "" if t.sequential_iteration_s is None else f" vs {1e3 * t.sequential_iteration_s:.0f} seq"
    return dataclasses.replace(row, method=t.method, plan=f"{t.plan_name} ({t.plan_source})",
                               iteration_ms=f"{1e3 * t.median_iteration_s:.0f}{seq}", retrieved=t.retrieved_segments)


def run_demo(settings: Settings) -> Iterator[RoundRow]:
    """Yields one row per round as it finishes."""
    confidence = settings.evaluation.confidence
    rounds = loop.campaign(settings, settings.demo.rounds, bootstrap, lambda s, r: fleet_round(r, None, s))
    for r, collected, promotion in rounds:
        label, robots = ("bootstrap", settings.demo.expert_robots) if r == 0 else (f"round {r}", settings.fleet.num_robots)
        yield _row(label, robots, collected, promotion, confidence)
