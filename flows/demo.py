"""`make demo`: bootstrap from scripted-expert demos, then a few fleet rounds on ``@champion``."""

from __future__ import annotations

from dataclasses import dataclass

from prefect import flow

from components.config import Settings
from components.evaluation.intervals import wilson_interval
from components.pipeline import steps
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


def _row(label: str, robots: int, collected: steps.CollectResult, promotion: steps.PromotionOutcome, confidence: float) -> RoundRow:
    cand = promotion.candidate
    return RoundRow(
        label, robots, collected.episodes, collected.success_rate,
        _rate_with_ci(cand.successes, cand.trials, confidence), cand.trials, promotion.decision.promote, promotion.champion_after,
    )


def _rate_with_ci(successes: int, trials: int, confidence: float) -> str:
    p = wilson_interval(successes, trials, confidence)
    return f"{100 * p.rate:.1f}% [{100 * p.low:.1f}, {100 * p.high:.1f}]"


@flow(name="demo")
def demo(settings: Settings) -> list[RoundRow]:
    confidence = settings.evaluation.confidence
    demos, promotion = bootstrap(settings)
    rows = [_row("bootstrap", settings.demo.expert_robots, demos, promotion, confidence)]
    for round_index in range(1, settings.demo.rounds + 1):
        collected, promotion = fleet_round(settings, round_index)
        rows.append(_row(f"round {round_index}", settings.fleet.num_robots, collected, promotion, confidence))
    return rows
