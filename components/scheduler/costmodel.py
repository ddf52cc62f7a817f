"""Cost curves: per-op time as a function of batch size, fitted from profiles (best R² wins).

Four forms, as RLinf's auto-placement fits them, each fitted by least squares on a linearized
scale with numpy only:

* power        ``t = a · x^b``            (log t linear in log x)
* exponential  ``t = a · e^(b·x)``        (log t linear in x)
* log          ``t = a + b · ln x``
* quadratic    ``t = a + b·x + c·x²``

R² is computed on the original scale. With as many points as parameters a form fits exactly,
so ties go to the form with fewer parameters.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

FORMS = ("power", "exponential", "log", "quadratic")
_NPARAMS = {"power": 2, "exponential": 2, "log": 2, "quadratic": 3, "constant": 1}


@dataclass(frozen=True)
class CostCurve:
    """A fitted curve ``t(x)``; ``r2`` on the fitted points."""

    kind: str
    params: tuple[float, ...]
    r2: float
    n: int

    def __call__(self, x: float) -> float:
        a = self.params
        if self.kind == "power":
            y = a[0] * x ** a[1]
        elif self.kind == "exponential":
            y = a[0] * math.exp(min(a[1] * x, 50.0))
        elif self.kind == "log":
            y = a[0] + a[1] * math.log(max(x, 1e-12))
        elif self.kind == "quadratic":
            y = a[0] + a[1] * x + a[2] * x * x
        else:
            y = a[0]
        return max(float(y), 0.0)

    def describe(self) -> str:
        return f"{self.kind}({', '.join(f'{p:.3g}' for p in self.params)}) R²={self.r2:.3f}"


def _r2(y: np.ndarray, pred: np.ndarray) -> float:
    ss_res = float(np.sum((y - pred) ** 2))
    ss_tot = float(np.sum((y - y.mean()) ** 2))
    if ss_tot <= 0.0:
        return 1.0 if ss_res <= 1e-30 else 0.0
    return 1.0 - ss_res / ss_tot


def _fit_one(kind: str, x: np.ndarray, y: np.ndarray) -> CostCurve | None:
    n = len(x)
    if n < _NPARAMS[kind]:
        return None
    try:
        if kind == "power":
            if np.any(x <= 0) or np.any(y <= 0):
                return None
            b, loga = np.polyfit(np.log(x), np.log(y), 1)
            params: tuple[float, ...] = (math.exp(loga), b)
        elif kind == "exponential":
            if np.any(y <= 0):
                return None
            b, loga = np.polyfit(x, np.log(y), 1)
            params = (math.exp(loga), b)
        elif kind == "log":
            if np.any(x <= 0):
                return None
            b, a = np.polyfit(np.log(x), y, 1)
            params = (a, b)
        elif kind == "quadratic":
            c, b, a = np.polyfit(x, y, 2)
            params = (a, b, c)
        else:
            return None
    except (np.linalg.LinAlgError, ValueError):
        return None
    curve = CostCurve(kind, tuple(float(p) for p in params), 0.0, n)
    pred = np.array([curve(v) for v in x])
    return CostCurve(kind, curve.params, _r2(y, pred), n)


def fit_curve(sizes: Sequence[float], seconds: Sequence[float], forms: Sequence[str] = FORMS) -> CostCurve:
    """Best-R² curve through (size, seconds) samples; repeated sizes are reduced to medians."""
    if len(sizes) != len(seconds) or len(sizes) == 0:
        raise ValueError("fit_curve needs equally long, non-empty sizes and seconds")
    unknown = set(forms) - set(FORMS)
    if unknown:
        raise ValueError(f"unknown cost curve forms {sorted(unknown)}; scheduler.cost_curves must use {FORMS}")
    by_size: dict[float, list[float]] = {}
    for s, t in zip(sizes, seconds):
        by_size.setdefault(float(s), []).append(float(t))
    x = np.array(sorted(by_size))
    y = np.array([float(np.median(by_size[v])) for v in x])
    if len(x) == 1:
        return CostCurve("constant", (float(y[0]),), 1.0, 1)
    fits = [f for f in (_fit_one(k, x, y) for k in forms) if f is not None]
    if not fits:
        return CostCurve("constant", (float(np.median(y)),), 0.0, len(x))
    return max(fits, key=lambda f: (round(f.r2, 6), -_NPARAMS[f.kind]))


# ----------------------------------------------------------------------------- process IPC
@dataclass(frozen=True)
class IpcCost:
    """What crossing a process worker's pipe costs, measured (``fit_ipc``): each message
    ``latency_s + bytes · s_per_byte``, and how many bytes each op's result carries per row it
    processes (so a plan with other env-group sizes is priced too)."""

    latency_s: float
    s_per_byte: float
    out_bytes_per_row: dict[str, float]

    def message_s(self, nbytes: float) -> float:
        return self.latency_s + nbytes * self.s_per_byte

    def out_bytes(self, op: str, rows: float) -> float:
        return self.out_bytes_per_row.get(op, 0.0) * rows


def _median_slope(xs: np.ndarray, ys: np.ndarray) -> float:
    """Theil-Sen: the median slope over pairs of points. A least-squares line through a handful of
    (op, direction) medians followed one that waited for a busy core (a fit of latency 0 and
    0.53 us per byte where quiet runs gave 0.45 ms + 5.6 ns); the median slope does not."""
    slopes = [(ys[j] - ys[i]) / (xs[j] - xs[i]) for i in range(len(xs)) for j in range(i + 1, len(xs)) if xs[j] != xs[i]]
    return float(np.median(slopes)) if slopes else 0.0


def fit_ipc(samples: Sequence[tuple[str, str, int, float]], rows: dict[str, float]) -> IpcCost:
    """Fit ``seconds = latency + bytes · s_per_byte`` to measured pipe crossings
    ``(op, direction, bytes, seconds)``, one point per (op, direction) at its medians (a few
    crossings that waited for a busy core must not set the line); ``rows``: rows each op processed
    per call in the measured run."""
    groups: dict[tuple[str, str], list[tuple[int, float]]] = {}
    for op, direction, nbytes, seconds in samples:
        groups.setdefault((op, direction), []).append((nbytes, seconds))
    if not groups:
        raise ValueError("fit_ipc needs at least one measured pipe crossing (a run with a process worker)")
    pts = [(float(np.median([b for b, _ in v])), float(np.median([s for _, s in v]))) for v in groups.values()]
    xs, ys = np.array([p[0] for p in pts]), np.array([p[1] for p in pts])
    slope = max(_median_slope(xs, ys), 0.0)
    latency = max(float(np.median(ys - slope * xs)), 0.0)
    per_row = {op: float(np.median([b for b, _ in v])) / max(rows.get(op, 1.0), 1e-9)
               for (op, direction), v in groups.items() if direction == "out"}
    return IpcCost(latency, slope, per_row)
