"""`make demo`: bootstrap from scripted-expert demos, then a few fleet rounds on ``@champion``.

Each round is its own flow run (``bootstrap``, ``fleet_round``), so the Prefect UI shows them
one by one; the CLI drives the rounds and prints the per-round table.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

from components.config import Settings
from components.evaluation.intervals import wilson_interval
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


def _rate_with_ci(successes: int, trials: int, confidence: float) -> str:
    p = wilson_interval(successes, trials, confidence)
    return f"{100 * p.rate:.1f}% [{100 * p.low:.1f}, {100 * p.high:.1f}]"


def _row(label: str, robots: int, collected: CollectResult, promotion: PromotionOutcome, confidence: float) -> RoundRow:
    cand = promotion.candidate
    return RoundRow(
        label, robots, collected.episodes, collected.success_rate,
        _rate_with_ci(cand.successes, cand.trials, confidence), cand.trials, promotion.decision.promote, promotion.champion_after,
    )


def run_demo(settings: Settings) -> Iterator[RoundRow]:
    """Yields one row per round as it finishes."""
    confidence = settings.evaluation.confidence
    demos, promotion = bootstrap(settings)
    yield _row("bootstrap", settings.demo.expert_robots, demos, promotion, confidence)
    for round_index in range(1, settings.demo.rounds + 1):
        collected, promotion = fleet_round(round_index, None, settings)
        yield _row(f"round {round_index}", settings.fleet.num_robots, collected, promotion, confidence)
