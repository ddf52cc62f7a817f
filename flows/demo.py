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
    promoted: bool
    champion: int | None


def _row(label: str, robots: int, collected: steps.CollectResult, promotion: steps.PromotionOutcome, confidence: float) -> RoundRow:
    cand = promotion.candidate
    return RoundRow(
        label, robots, collected.episodes, collected.success_rate,
        str(wilson_interval(cand.successes, cand.trials, confidence)), promotion.decision.promote, promotion.champion_after,
    )


@flow(name="demo")
def demo(settings: Settings) -> list[RoundRow]:
    confidence = settings.evaluation.confidence
    demos, promotion = bootstrap(settings)
    rows = [_row("bootstrap (expert)", settings.demo.expert_robots, demos, promotion, confidence)]
    for round_index in range(1, settings.demo.rounds + 1):
        collected, promotion = fleet_round(settings, round_index)
        rows.append(_row(f"round {round_index}", settings.fleet.num_robots, collected, promotion, confidence))
    return rows
