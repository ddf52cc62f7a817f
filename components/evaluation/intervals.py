"""Confidence intervals for success rates and for differences between methods.

Trial level (one cell, pooled trials): ``wilson_interval``, ``difference_interval`` (Newcombe).
Seed level (method comparisons, seeds as the unit of replication): ``paired_seed_interval``,
``hierarchical_bootstrap`` (seeds, then robots), and ``seeds_needed`` (sample size at the
observed variance); ``welch_seed_interval`` for two studies whose seeds are not paired.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from statistics import NormalDist

import numpy as np
from scipy.stats import t as student_t


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


# ------------------------------------------------------------------------------- seed level
# Seeds are the unit of replication of a method comparison (DESIGN.md, evaluation protocol): each
# seed redraws demos, fleet luck, training noise and the test robots, so trials of one seed are not
# independent of each other and pooling them overstates the evidence.
@dataclass(frozen=True)
class SeedDifference:
    """Mean over seeds of the per-seed difference ``a − b``, with a paired t-interval."""

    differences: tuple[float, ...]  # per seed
    mean: float
    sd: float  # sample standard deviation of the per-seed differences (0 with one seed)
    low: float
    high: float
    confidence: float

    @property
    def seeds(self) -> int:
        return len(self.differences)

    def __str__(self) -> str:
        return f"{100 * self.mean:+.1f} pts [{100 * self.low:+.1f}, {100 * self.high:+.1f}] ({self.seeds} seeds, paired)"


def paired_seed_interval(a: Sequence[float], b: Sequence[float], confidence: float = 0.95) -> SeedDifference:
    """Student-t interval of the mean per-seed difference ``a[i] − b[i]`` (seed ``i`` of both
    methods shares demos, bootstrap and test robots: paired). One seed has no spread: (-inf, inf)."""
    if len(a) != len(b) or not a:
        raise ValueError(f"paired seeds need the same, non-zero number of seeds for both methods ({len(a)} vs {len(b)})")
    d = np.asarray(a, dtype=float) - np.asarray(b, dtype=float)
    mean = float(d.mean())
    if len(d) < 2:
        return SeedDifference(tuple(d.tolist()), mean, 0.0, -math.inf, math.inf, confidence)
    sd = float(d.std(ddof=1))
    half = float(student_t.ppf(0.5 + confidence / 2, len(d) - 1)) * sd / math.sqrt(len(d))
    return SeedDifference(tuple(d.tolist()), mean, sd, mean - half, mean + half, confidence)


@dataclass(frozen=True)
class TwoSampleDifference:
    """``mean(a) − mean(b)`` of two unpaired samples of per-seed rates, with Welch's t-interval."""

    mean: float
    low: float
    high: float
    seeds: tuple[int, int]
    confidence: float


def welch_seed_interval(a: Sequence[float], b: Sequence[float], confidence: float = 0.95) -> TwoSampleDifference:
    """Welch's t-interval of ``mean(a) − mean(b)`` for per-seed rates of two studies that share no
    seeds (e.g. the camera study against the state study): unequal variances, Welch-Satterthwaite
    degrees of freedom. Fewer than two seeds on a side: (-inf, inf)."""
    x, y = np.asarray(a, dtype=float), np.asarray(b, dtype=float)
    if not len(x) or not len(y):
        raise ValueError("welch_seed_interval needs at least one seed on each side")
    mean = float(x.mean() - y.mean())
    if len(x) < 2 or len(y) < 2:
        return TwoSampleDifference(mean, -math.inf, math.inf, (len(x), len(y)), confidence)
    va, vb = x.var(ddof=1) / len(x), y.var(ddof=1) / len(y)
    se = math.sqrt(va + vb)
    if se == 0.0:
        return TwoSampleDifference(mean, mean, mean, (len(x), len(y)), confidence)
    df = (va + vb) ** 2 / (va ** 2 / (len(x) - 1) + vb ** 2 / (len(y) - 1))
    half = float(student_t.ppf(0.5 + confidence / 2, df)) * se
    return TwoSampleDifference(mean, mean - half, mean + half, (len(x), len(y)), confidence)


@dataclass(frozen=True)
class SeedRobotOutcomes:
    """One seed of one method: successes per test robot, the same robots and trials for every method."""

    successes: tuple[int, ...]  # per robot, in a fixed robot order
    trials_per_robot: int


def hierarchical_bootstrap(
    a: Sequence[SeedRobotOutcomes],
    b: Sequence[SeedRobotOutcomes],
    resamples: int,
    seed: int,
    confidence: float = 0.95,
) -> tuple[float, float]:
    """Percentile interval of the mean difference ``a − b`` resampling seeds, then robots within
    each drawn seed (both methods keep the same draw: paired). Deterministic for a ``seed``.

    The two levels are the two sources of variance a new study would redraw: which seeds (training
    luck, demos, test population) and which robots of a seed's test population."""
    if len(a) != len(b) or not a:
        raise ValueError(f"paired seeds need the same, non-zero number of seeds for both methods ({len(a)} vs {len(b)})")
    for x, y in zip(a, b, strict=True):
        if len(x.successes) != len(y.successes) or x.trials_per_robot != y.trials_per_robot:
            raise ValueError("both methods of a seed must be evaluated on the same robots with the same trials")
    rng = np.random.default_rng(seed)
    stats = np.empty(resamples)
    for k in range(resamples):
        seeds = rng.integers(0, len(a), size=len(a))
        gaps = []
        for s in seeds:
            robots = rng.integers(0, len(a[s].successes), size=len(a[s].successes))
            pa = np.asarray(a[s].successes)[robots].sum() / (len(robots) * a[s].trials_per_robot)
            pb = np.asarray(b[s].successes)[robots].sum() / (len(robots) * b[s].trials_per_robot)
            gaps.append(pa - pb)
        stats[k] = np.mean(gaps)
    tail = (1 - confidence) / 2
    return float(np.quantile(stats, tail)), float(np.quantile(stats, 1 - tail))


def seeds_needed(sd: float, effect: float, confidence: float = 0.95, power: float = 0.8, max_seeds: int = 10_000) -> int | None:
    """Seeds for a paired t-interval to exclude 0 with probability ``power`` when the true mean
    difference is ``effect`` and the per-seed differences have standard deviation ``sd``:
    the smallest n with ``(t_{1-α/2, n-1} + t_{power, n-1}) · sd / √n ≤ effect``.
    None when no number of seeds will do (``effect`` ≤ 0) or more than ``max_seeds`` are needed."""
    if effect <= 0:
        return None
    if sd <= 0:
        return 2  # no spread: the smallest design with an interval at all
    for n in range(2, max_seeds + 1):
        df = n - 1
        if (student_t.ppf(0.5 + confidence / 2, df) + student_t.ppf(power, df)) * sd / math.sqrt(n) <= effect:
            return n
    return None
