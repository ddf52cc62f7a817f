"""A grown root's ingest batches beside a fresh root's, alternating in one process on one core.

    python -m benchmarks.ingest_fresh_vs_grown --root W/root            # W: a growth run's --workdir
    python -m benchmarks.ingest_fresh_vs_grown --root W/root --pairs 16

The growth curve (``benchmarks/ingest.py``) compares its last batches with its first, measured
half an hour apart on a shared host. This puts the two side by side: batch after batch through
``ingest_files``, alternately into a fresh root (its batches 2, 3, ...; the first, which
initialises DVC and fits the encoder, and one warm-up batch of the grown root are untimed) and
into the grown root, the order flipped every pair. Each batch's time is also split by phase
(``ingest_files``' own ``PhaseTimes``: read, store, snapshot, plan, embed, upsert, index), so a
difference between the roots is pinned to the phase that holds it. Every fresh batch stays below
``store.index_min_rows`` (the refusal says so otherwise). Writes
benchmarks/results/ingest_fresh_vs_grown.json and .png (``--name`` for another name).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from pathlib import Path

from benchmarks.ingest import EPISODE_FRAMES, ingest_batch
from components.config import load_settings
from components.pipeline.ingest import PhaseTimes
from components.pipeline.workspace import Workspace
from components.store.windows import window_starts

RESULTS = Path(__file__).resolve().parent / "results"
NAME = "ingest_fresh_vs_grown"
EPISODES = 200  # a 10k-frame batch, as the growth curve's
GROWN_SEED = 50_000_000  # + the root's episode count: seeds no growth run (nor an earlier run of this) used


def run(grown_root: Path, pairs: int, scratch: Path) -> dict:
    grown, fresh = load_settings(root=grown_root), load_settings(root=scratch / "root")
    segments_per_batch = EPISODES * len(window_starts(EPISODE_FRAMES, fresh.store.window, fresh.store.stride))
    if (pairs + 1) * segments_per_batch >= fresh.store.index_min_rows:
        raise SystemExit(f"{pairs} pairs would take the fresh root past store.index_min_rows="
                         f"{fresh.store.index_min_rows:,} segments: use fewer --pairs")
    stored = Workspace(grown).dataset.num_frames
    seed0 = GROWN_SEED + Workspace(grown).dataset.num_episodes
    ingest_batch(fresh, Workspace(fresh), 0, EPISODES, scratch / "incoming")  # DVC init, encoder fit
    ingest_batch(grown, Workspace(grown), seed0, EPISODES, scratch / "incoming")  # warm its caches
    seconds: dict[str, list[float]] = {"fresh": [], "grown": []}
    phases: dict[str, list[PhaseTimes]] = {"fresh": [], "grown": []}
    for i in range(pairs):
        order = ("fresh", "grown") if i % 2 == 0 else ("grown", "fresh")
        for arm in order:
            settings, seed = (fresh, 1 + i) if arm == "fresh" else (grown, seed0 + 1 + i)
            phases[arm].append(PhaseTimes())
            seconds[arm].append(ingest_batch(settings, Workspace(settings), seed, EPISODES, scratch / "incoming",
                                             times=phases[arm][-1]))
        print(f"pair {i + 1}/{pairs}: fresh {seconds['fresh'][-1]:.3f}s, grown {seconds['grown'][-1]:.3f}s", flush=True)
    paired = [g / f for f, g in zip(seconds["fresh"], seconds["grown"])]
    return {
        "grown_root_frames": stored, "pairs": pairs, "batch_frames": EPISODES * EPISODE_FRAMES, "seconds": seconds,
        "fresh_median_s": statistics.median(seconds["fresh"]), "grown_median_s": statistics.median(seconds["grown"]),
        "grown_over_fresh": statistics.median(seconds["grown"]) / statistics.median(seconds["fresh"]),
        "paired_ratio_median": statistics.median(paired), "grown_slower_pairs": sum(r > 1 for r in paired),
        "phases": phase_medians(phases),
    }


def phase_medians(phases: dict[str, list[PhaseTimes]]) -> dict[str, dict[str, float]]:
    """Per phase: each root's median seconds and the median of the paired differences (grown -
    fresh), in the order ingest_files runs them."""
    names = list(dict.fromkeys(name for arm in phases.values() for times in arm for name in times))
    out = {}
    for name in names:
        fresh = [t.get(name, 0.0) for t in phases["fresh"]]
        grown = [t.get(name, 0.0) for t in phases["grown"]]
        out[name] = {"fresh_median_s": statistics.median(fresh), "grown_median_s": statistics.median(grown),
                     "paired_difference_median_s": statistics.median(g - f for f, g in zip(fresh, grown))}
    return out


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax, bars) = plt.subplots(1, 2, figsize=(13, 4.2), gridspec_kw={"width_ratios": [3, 2]})
    for arm, color in (("fresh", "#4c72b0"), ("grown", "#c44e52")):
        values = result["seconds"][arm]
        ax.plot(range(1, 1 + len(values)), values, "o-",
                color=color, ms=4, lw=0.8,
                label=f"{arm} root (median {result[arm + '_median_s']:.3f} s)" if arm == "fresh" else
                f"grown root, {result['grown_root_frames'] / 1e6:.1f}M frames (median {result['grown_median_s']:.3f} s)")
    ax.set(xlabel="pair (the fresh root's batch number - 1)", ylabel="seconds per 10k-frame batch", ylim=(0, None),
           title=f"ingest_files side by side: grown / fresh {result['grown_over_fresh']:.2f}x (medians), "
                 f"paired median {result['paired_ratio_median']:.2f}x")
    ax.title.set_fontsize(10)
    ax.legend(fontsize=8)
    plot_phases(bars, result.get("phases", {}))
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_phases(ax, phases: dict[str, dict[str, float]]) -> None:
    """Each phase's median seconds, fresh beside grown."""
    import numpy as np

    names = list(phases)
    y = np.arange(len(names))
    for offset, arm, color in ((-0.2, "fresh", "#4c72b0"), (0.2, "grown", "#c44e52")):
        ax.barh(y + offset, [1e3 * phases[n][f"{arm}_median_s"] for n in names], 0.4, color=color, label=arm)
    ax.set_yticks(y, names)
    ax.invert_yaxis()
    ax.set(xlabel="median ms per batch", title="by phase (ingest_files' PhaseTimes)")
    ax.title.set_fontsize(10)
    ax.legend(fontsize=8)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--root", type=Path, required=True, help="a grown root (a growth run's WORKDIR/root)")
    parser.add_argument("--pairs", type=int, default=16)
    parser.add_argument("--out", type=Path, default=RESULTS)
    parser.add_argument("--name", default=NAME)
    args = parser.parse_args()
    if not (args.root / "datasets").exists():
        raise SystemExit(f"{args.root}: no datasets/ folder; pass the root a growth run grew "
                         f"(python -m benchmarks.ingest --workdir W ... grows W/root)")
    start, load_start = time.perf_counter(), os.getloadavg()
    with tempfile.TemporaryDirectory(prefix="fresh-vs-grown-") as tmp:
        result = run(args.root, args.pairs, Path(tmp))
    result.update({"benchmark": NAME, "machine": {"cpus": os.cpu_count(), "cores_used": len(os.sched_getaffinity(0)),
                   "load_avg_start": load_start, "load_avg_end": os.getloadavg()},
                   "wall_s": time.perf_counter() - start})
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"{args.name}.json").write_text(json.dumps(result, indent=1))
    plot(result, args.out / f"{args.name}.png")
    print(f"fresh median {result['fresh_median_s']:.3f}s, grown {result['grown_median_s']:.3f}s: "
          f"{result['grown_over_fresh']:.2f}x (paired median {result['paired_ratio_median']:.2f}x, grown slower in "
          f"{result['grown_slower_pairs']}/{result['pairs']}); wrote {args.out / args.name}.json and .png")
    for name, phase in result["phases"].items():
        print(f"  {name:>8}: fresh {1e3 * phase['fresh_median_s']:7.1f} ms, grown {1e3 * phase['grown_median_s']:7.1f} ms, "
              f"paired difference {1e3 * phase['paired_difference_median_s']:+7.1f} ms")


if __name__ == "__main__":
    main()
