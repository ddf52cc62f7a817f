"""Compute quotas: how much of the device each worker may use, and the slack-aware manager.

The quota is process level on a GPU — ``CUDA_MPS_ACTIVE_THREAD_PERCENTAGE`` in a client's
environment at launch caps its share of SMs under MPS and cannot change once the CUDA context
exists, so changing a quota means restarting that worker. On the CPU the quota is a thread count
(``torch.set_num_threads`` is per calling thread with the OpenMP backend, so each worker thread
sets its own) plus a process-wide BLAS limit (threadpoolctl) and optional core affinity.

``SlackQuotaManager``: at each fork/join of the measured timeline, slack = T_join − T_branch for
every branch; one quota unit moves from the branch with the most slack to the critical branch;
the change is kept only if a measured end-to-end iteration confirms it (greedy, step by step).
"""

from __future__ import annotations

import statistics
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch

MPS_ENV = "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"


def set_worker_threads(n: int) -> None:
    """Set the calling thread's intra-op thread count (thread-local with the OpenMP backend)."""
    if n < 1:
        raise ValueError(f"thread quota must be >= 1, got {n} (scheduler thread quotas)")
    if torch.get_num_threads() != n:
        torch.set_num_threads(n)


@contextmanager
def apply_blas_limit(threads: int | None) -> Iterator[None]:
    """Limit BLAS pools (OpenBLAS/MKL behind numpy) process-wide for the duration, if asked."""
    if threads is None:
        yield
        return
    try:
        from threadpoolctl import threadpool_limits
    except ImportError:  # threadpoolctl missing: numpy BLAS keeps its default
        yield
        return
    with threadpool_limits(limits=threads, user_api="blas"):
        yield


def mps_environment(percent_by_component: dict[str, int]) -> dict[str, str]:
    """Environment for a process worker under MPS: the smallest share its components ask for.

    An empty dict when no quota is asked (no GPU, or an unlimited worker).
    """
    if not percent_by_component:
        return {}
    bad = {c: p for c, p in percent_by_component.items() if not 1 <= p <= 100}
    if bad:
        raise ValueError(f"MPS percentages must be in 1..100, got {bad} (plan.gpu_percent)")
    return {MPS_ENV: str(min(percent_by_component.values()))}


@dataclass(frozen=True)
class Branch:
    """One branch between a fork and its join: the components on it and its measured time."""

    name: str
    components: tuple[str, ...]
    seconds: float


@dataclass(frozen=True)
class ForkJoin:
    """A fork/join region of the iteration with its branches."""

    name: str
    branches: tuple[Branch, ...]

    @property
    def join_s(self) -> float:
        return max(b.seconds for b in self.branches)

    def slack(self) -> dict[str, float]:
        """slack = T_join − T_branch per branch (0 on the critical branch)."""
        return {b.name: self.join_s - b.seconds for b in self.branches}

    def critical(self) -> Branch:
        return max(self.branches, key=lambda b: b.seconds)


@dataclass(frozen=True)
class QuotaStep:
    """One greedy step: the move tried, its measured effect, and whether it was kept."""

    region: str
    donor: str
    receiver: str
    quotas_before: dict[str, int]
    quotas_after: dict[str, int]
    before_s: float
    after_s: float
    kept: bool
    reason: str


@dataclass
class QuotaResult:
    quotas: dict[str, int]
    steps: list[QuotaStep] = field(default_factory=list)


class SlackQuotaManager:
    """Greedy slack-driven quota moves, each validated by a measured end-to-end iteration.

    ``measure(quotas) -> seconds`` runs the workload with the quotas (median of a few
    iterations); ``regions(quotas) -> list[ForkJoin]`` reads the fork/join branches from the
    latest measured timeline. ``total`` bounds the sum of quotas on a fork (the device size).
    """

    def __init__(self, measure: Callable[[dict[str, int]], float],
                 regions: Callable[[dict[str, int]], list[ForkJoin]],
                 total: int, min_quota: int = 1, accept_margin: float = 0.02, max_steps: int = 6) -> None:
        self.measure = measure
        self.regions = regions
        self.total = total
        self.min_quota = min_quota
        self.accept_margin = accept_margin
        self.max_steps = max_steps

    def optimize(self, quotas: dict[str, int]) -> QuotaResult:
        current = dict(quotas)
        best_s = self.measure(current)
        result = QuotaResult(current)
        tried: set[tuple[str, str, tuple[tuple[str, int], ...]]] = set()
        for _ in range(self.max_steps):
            move = self._next_move(current, tried)
            if move is None:
                break
            region, donor, receiver, proposal = move
            tried.add((donor, receiver, tuple(sorted(current.items()))))
            after = self.measure(proposal)
            kept = after < best_s * (1 - self.accept_margin)
            reason = (f"measured {after * 1e3:.1f} ms vs {best_s * 1e3:.1f} ms: "
                      + ("kept" if kept else f"rolled back (needs > {self.accept_margin:.0%} gain)"))
            result.steps.append(QuotaStep(region, donor, receiver, dict(current), dict(proposal), best_s, after,
                                          kept, reason))
            if kept:
                current, best_s = proposal, after
        result.quotas = current
        return result

    def _next_move(self, quotas: dict[str, int], tried: set) -> tuple[str, str, str, dict[str, int]] | None:
        for fj in sorted(self.regions(quotas), key=lambda r: -max(r.slack().values())):
            critical = fj.critical()
            slack = fj.slack()
            donors = sorted((b for b in fj.branches if b.name != critical.name), key=lambda b: -slack[b.name])
            for donor in donors:
                for dc in donor.components:
                    for rc in critical.components:
                        key = (dc, rc, tuple(sorted(quotas.items())))
                        if key in tried or quotas.get(dc, 1) <= self.min_quota:
                            continue
                        proposal = dict(quotas)
                        proposal[dc] = quotas.get(dc, 1) - 1
                        proposal[rc] = min(self.total, quotas.get(rc, 1) + 1)
                        if proposal == quotas:
                            continue
                        return fj.name, dc, rc, proposal
        return None


def median(xs: list[float]) -> float:
    return statistics.median(xs) if xs else float("nan")
