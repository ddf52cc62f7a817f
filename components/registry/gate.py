"""The promotion gate: a challenger replaces the champion only on a statistically sound margin.

One-sided two-proportion z-test, H0: p_challenger <= p_champion. The challenger is promoted iff
the p-value is below ``alpha``; an equal (or slightly better) model is refused, never promoted on
noise.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from statistics import NormalDist


@dataclass(frozen=True)
class GateDecision:
    promote: bool
    p_value: float
    z: float
    challenger_rate: float
    champion_rate: float
    alpha: float
    reason: str


def two_proportion_gate(
    challenger_successes: int,
    challenger_trials: int,
    champion_successes: int | None,
    champion_trials: int | None,
    alpha: float,
) -> GateDecision:
    """Decide promotion; with no champion yet, the first model is promoted."""
    if challenger_trials <= 0:
        raise ValueError("challenger has no evaluation trials: evaluate it before asking the gate")
    p1 = challenger_successes / challenger_trials
    if not champion_trials:
        return GateDecision(True, 0.0, math.inf, p1, float("nan"), alpha, "no champion yet")
    p2 = champion_successes / champion_trials
    pooled = (challenger_successes + champion_successes) / (challenger_trials + champion_trials)
    se = math.sqrt(pooled * (1 - pooled) * (1 / challenger_trials + 1 / champion_trials))
    if se == 0.0:
        # both at 0% or both at 100%: no evidence either way
        z, p_value = 0.0, 0.5 if p1 == p2 else (0.0 if p1 > p2 else 1.0)
    else:
        z = (p1 - p2) / se
        p_value = 1.0 - NormalDist().cdf(z)
    promote = p_value < alpha
    verdict = "better" if promote else "not significantly better"
    reason = f"challenger {100 * p1:.1f}% vs champion {100 * p2:.1f}%: z={z:.2f}, p={p_value:.4f} (alpha={alpha}) -> {verdict}"
    return GateDecision(promote, p_value, z, p1, p2, alpha, reason)
