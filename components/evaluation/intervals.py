"""Confidence intervals for success rates."""

from __future__ import annotations

from dataclasses import dataclass
from statistics import NormalDist


@dataclass(frozen=True)
class Proportion:
    successes: int
    trials: int
    low: float
    high: float
    confidence: float

    @property
    def rate(self) -> float:
        return self.successes / self.trials if self.trials else float("nan")

    def __str__(self) -> str:
        return f"{100 * self.rate:.1f}% [{100 * self.low:.1f}, {100 * self.high:.1f}] (n={self.trials})"


def wilson_interval(successes: int, trials: int, confidence: float = 0.95) -> Proportion:
    """Wilson score interval: well-behaved near 0% and 100%, unlike the normal approximation."""
    if trials <= 0:
        return Proportion(successes, trials, 0.0, 1.0, confidence)
    if not 0 <= successes <= trials:
        raise ValueError(f"successes={successes} must lie in [0, trials={trials}]")
    z = NormalDist().inv_cdf(0.5 + confidence / 2)
    p = successes / trials
    denom = 1 + z * z / trials
    centre = (p + z * z / (2 * trials)) / denom
    half = z * ((p * (1 - p) / trials + z * z / (4 * trials * trials)) ** 0.5) / denom
    return Proportion(successes, trials, max(0.0, centre - half), min(1.0, centre + half), confidence)


@dataclass(frozen=True)
class Difference:
    """``a`` − ``b`` of two independent success rates, with its confidence interval."""

    a: Proportion
    b: Proportion
    low: float
    high: float

    @property
    def value(self) -> float:
        return self.a.rate - self.b.rate

    def __str__(self) -> str:
        return f"{100 * self.value:+.1f} pts [{100 * self.low:+.1f}, {100 * self.high:+.1f}]"


def difference_interval(a: Proportion, b: Proportion) -> Difference:
    """Newcombe's hybrid score interval for a difference of proportions, built from the two Wilson
    intervals (Newcombe 1998, method 10): it keeps Wilson's good behaviour near 0% and 100%."""
    if a.confidence != b.confidence:
        raise ValueError(f"both intervals need the same confidence level ({a.confidence} vs {b.confidence})")
    d = a.rate - b.rate
    low = d - ((a.rate - a.low) ** 2 + (b.high - b.rate) ** 2) ** 0.5
    high = d + ((a.high - a.rate) ** 2 + (b.rate - b.low) ** 2) ** 0.5
    return Difference(a, b, max(-1.0, low), min(1.0, high))
