"""Timeline plots: a Gantt chart of ops per worker over a device-activity trace, before/after."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from components.scheduler.profiler import Timeline

_PALETTE = ("#4e79a7", "#f28e2b", "#e15759", "#76b7b2", "#59a14f", "#edc948", "#b07aa1", "#ff9da7",
            "#9c755f", "#bab0ac")


def plot_timelines(panels: Sequence[tuple[str, Timeline]], path: Path, capacity: float,
                   iterations: tuple[int, int] | None = None) -> Path:
    """One column per timeline: Gantt (rows = workers) above busy cores (sampled and from spans)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ops = sorted({s.op for _, tl in panels for s in tl.spans})
    color = {op: _PALETTE[k % len(_PALETTE)] for k, op in enumerate(ops)}
    fig, axes = plt.subplots(2, len(panels), figsize=(6.5 * len(panels), 6.0), squeeze=False,
                             gridspec_kw={"height_ratios": [2.2, 1.0]})
    for col, (title, tl) in enumerate(panels):
        spans = tl.spans
        if iterations is not None:
            spans = [s for s in spans if iterations[0] <= s.iteration <= iterations[1]]
        if not spans:
            continue
        t0 = min(s.start for s in spans)
        t1 = max(s.end for s in spans)
        workers = sorted({s.worker for s in spans})
        ax = axes[0][col]
        for s in spans:
            y = workers.index(s.worker)
            ax.barh(y, (s.end - s.start) * 1e3, left=(s.start - t0) * 1e3, height=0.7, color=color[s.op],
                    linewidth=0)
        ax.set_yticks(range(len(workers)), workers)
        ax.set_title(title, fontsize=10)
        ax.set_xlim(0, (t1 - t0) * 1e3)
        ax.invert_yaxis()
        act = axes[1][col]
        samples = [a for a in tl.activity if t0 <= a.t <= t1]
        if samples:
            ts = [(a.t - t0) * 1e3 for a in samples]
            act.plot(ts, _smooth([a.process_cores for a in samples]), lw=0.9, label="this process (sampled)")
            act.plot(ts, _smooth([a.machine_cores for a in samples]), lw=0.9, alpha=0.6,
                     label="whole machine (sampled)")
            if any(a.sm_activity is not None for a in samples):
                act.plot([(a.t - t0) * 1e3 for a in samples], [(a.sm_activity or 0) / 100 * capacity for a in samples],
                         lw=0.8, label="GPM SM activity (scaled)")
        pts = sorted({s.start for s in spans} | {s.end for s in spans})
        xs, ys = [], []
        for a, b in zip(pts, pts[1:]):
            busy = sum(min(max(s.threads, 1), capacity) for s in spans if s.start < b and s.end > a)
            xs += [(a - t0) * 1e3, (b - t0) * 1e3]
            ys += [min(busy, capacity * 2), min(busy, capacity * 2)]
        act.plot(xs, ys, lw=0.8, color="black", alpha=0.5, label="threads of running ops")
        act.axhline(capacity, color="grey", ls=":", lw=0.8)
        act.set_xlim(0, (t1 - t0) * 1e3)
        act.set_xlabel("ms")
        act.set_ylabel("busy cores")
        if col == 0:
            act.legend(fontsize=7, loc="upper right")
    handles = [plt.Rectangle((0, 0), 1, 1, color=color[o]) for o in ops]
    fig.legend(handles, ops, loc="lower center", ncol=min(len(ops), 10), fontsize=8)
    fig.tight_layout(rect=(0, 0.05, 1, 1))
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _smooth(xs: list[float], k: int = 3) -> list[float]:
    """Centered moving average over ``2k+1`` samples (/proc CPU times are coarse)."""
    out = []
    for i in range(len(xs)):
        window = xs[max(0, i - k): i + k + 1]
        out.append(sum(window) / len(window))
    return out
