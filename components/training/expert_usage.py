"""Expert utilisation of an MoE training run: per step, each expert's token share and the dropped rate.

    list[StepUsage] (one per optimizer step, ``policy/moe.step_usage``) ──► MLflow metric series
    (``moe_expert_share.e<i>``, ``moe_dropped_rate``) + a PNG (stacked shares over steps above the
    dropped-pair rate) + a JSON-able record for ``training.json``

A healthy run keeps shares near 1/E (the load-balancing loss) and the dropped rate small (the
capacity factor); a collapsed router shows as one band swallowing the plot.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from components.policy.moe import StepUsage

SHARE_METRIC = "moe_expert_share.e{}"
DROPPED_METRIC = "moe_dropped_rate"


def usage_series(usage: list[StepUsage]) -> dict[str, list[float]]:
    """Metric name -> one value per optimizer step."""
    if not usage:
        return {}
    experts = len(usage[0].share)
    series = {SHARE_METRIC.format(e): [u.share[e] for u in usage] for e in range(experts)}
    series[DROPPED_METRIC] = [u.dropped_rate for u in usage]
    return series


def usage_record(usage: list[StepUsage]) -> dict[str, Any] | None:
    """What ``training.json`` keeps: per-step shares and dropped rates, and their run means."""
    if not usage:
        return None
    experts = len(usage[0].share)
    steps = len(usage)
    return {
        "experts": experts, "steps": steps,
        "mean_share": [sum(u.share[e] for u in usage) / steps for e in range(experts)],
        "mean_dropped_rate": sum(u.dropped_rate for u in usage) / steps,
        "share": [list(u.share) for u in usage], "dropped_rate": [u.dropped_rate for u in usage],
    }


def plot_expert_usage(usage: list[StepUsage], path: Path, title: str = "") -> Path:
    """Stacked per-expert share of the routed pairs over steps, and the dropped-pair rate."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    series = usage_series(usage)
    steps = range(1, len(usage) + 1)
    experts = len(usage[0].share)
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(9, 6), sharex=True, height_ratios=(3, 1))
    top.stackplot(steps, [series[SHARE_METRIC.format(e)] for e in range(experts)],
                  labels=[f"expert {e}" for e in range(experts)])
    for e in range(1, experts):
        top.axhline(e / experts, color="k", lw=0.3, ls=":")
    top.set_ylim(0, 1)
    top.set_ylabel("share of routed (token, expert) pairs")
    top.set_title(title or f"expert utilisation ({experts} experts; dotted: uniform)")
    top.legend(fontsize=6, ncol=min(experts, 8), loc="upper center")
    bottom.plot(steps, series[DROPPED_METRIC], color="C3")
    bottom.set_ylabel("dropped rate")
    bottom.set_xlabel("optimizer step")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
