"""End-to-end ingest throughput by batch shape: where the frames/s of ``ingest_files`` go.

    python -m benchmarks.ingest_shapes            # 4 episode lengths x 2 batch sizes, 3 timed batches each
    python -m benchmarks.ingest_shapes --quick    # 2 x 2 cells, 2 timed batches (under a minute)

The growth curve (``benchmarks/ingest.py``) runs one shape: 200 episodes of 50 frames a batch,
as issue 17 tried it. Its frames/s mixes three costs: what every batch pays whatever it holds
(DVC snapshot, LanceDB commit, metadata), what every episode pays (one file read, validated,
canonicalised and hashed; one episodes-table row), and what every frame pays (Parquet, windows,
encoder). This benchmark separates them on the same path: one fresh root per cell (episode
length x batch frames), the cells' batches interleaved round by round in a seeded order so host
drift falls on all of them alike, the first batch of each cell untimed (it initialises DVC and
fits the encoder). A least-squares fit over every timed batch,

    seconds = fixed + per_episode * episodes + per_frame * frames,

gives what a batch of any shape costs on this path. Every cell stays below
``store.index_min_rows`` segments, so the one-off first index build (a step of the growth curve,
reported there) falls in none of them.

Writes benchmarks/results/ingest_shapes.json and .png (``--name`` for another name).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from benchmarks.ingest import ingest_batch
from components.config import load_settings
from components.pipeline.workspace import Workspace
from components.store.windows import window_starts

RESULTS = Path(__file__).resolve().parent / "results"
NAME = "ingest_shapes"
TARGET_FRAMES_PER_S = 100_000  # issue 17, on 2 cores
ISSUE_SHAPE = (50, 10_000)  # (episode frames, batch frames) of the growth curve


@dataclass(frozen=True)
class Grid:
    episode_frames: tuple[int, ...]
    batch_frames: tuple[int, ...]
    timed_batches: int  # per cell, after one untimed batch
    seed: int = 17


FULL = Grid(episode_frames=(50, 100, 250, 1000), batch_frames=(10_000, 50_000), timed_batches=3)
QUICK = Grid(episode_frames=(50, 250), batch_frames=(5_000, 10_000), timed_batches=2)


@dataclass
class Cell:
    episode_frames: int
    batch_frames: int
    root: Path
    seconds: list[float]

    @property
    def episodes(self) -> int:
        return self.batch_frames // self.episode_frames


def check_below_index(grid: Grid, settings) -> None:
    """Refuse a grid whose largest cell would cross ``store.index_min_rows`` (its first index build
    would land in one timed batch); segments per episode as the store cuts them."""
    for frames in grid.episode_frames:
        per_episode = len(window_starts(frames, settings.store.window, settings.store.stride))
        for batch in grid.batch_frames:
            segments = (grid.timed_batches + 1) * (batch // frames) * per_episode
            if segments >= settings.store.index_min_rows:
                raise SystemExit(f"cell ({frames}-frame episodes, {batch:,}-frame batches) reaches {segments:,} "
                                 f"segments >= store.index_min_rows={settings.store.index_min_rows:,}: "
                                 f"use fewer --timed-batches or smaller --batch-frames")


def run_cells(grid: Grid, workdir: Path) -> list[Cell]:
    cells = [Cell(e, b, workdir / f"cell-{e}x{b}", []) for b in grid.batch_frames for e in grid.episode_frames]
    check_below_index(grid, load_settings(root=workdir / "probe"))
    rng = np.random.default_rng(grid.seed)
    for round_ in range(grid.timed_batches + 1):
        for i in rng.permutation(len(cells)):
            cell = cells[i]
            settings = load_settings(root=cell.root / "root")
            seconds = ingest_batch(settings, Workspace(settings), round_, cell.episodes, cell.root / "incoming",
                                   frames=cell.episode_frames)
            if round_:
                cell.seconds.append(seconds)
        print(f"round {round_ + 1}/{grid.timed_batches + 1}: " + ", ".join(
            f"{c.episode_frames}x{c.batch_frames // 1000}k {c.seconds[-1]:.2f}s" for c in cells if c.seconds),
            flush=True)
    return cells


def fit_costs(cells: list[Cell]) -> dict:
    """Least squares over every timed batch: seconds = fixed + per_episode * E + per_frame * F."""
    rows = [(1.0, c.episodes, c.batch_frames, s) for c in cells for s in c.seconds]
    design = np.array([r[:3] for r in rows], dtype=np.float64)
    seconds = np.array([r[3] for r in rows])
    coef, *_ = np.linalg.lstsq(design, seconds, rcond=None)
    predicted = design @ coef
    r2 = 1 - float(((seconds - predicted) ** 2).sum() / ((seconds - seconds.mean()) ** 2).sum())
    return {"fixed_s": float(coef[0]), "per_episode_ms": float(coef[1] * 1e3), "per_frame_us": float(coef[2] * 1e6),
            "r2": r2, "batches": len(rows)}


def predicted_frames_per_s(model: dict, episode_frames: float, batch_frames: float) -> float:
    seconds = (model["fixed_s"] + model["per_episode_ms"] / 1e3 * batch_frames / episode_frames
               + model["per_frame_us"] / 1e6 * batch_frames)
    return batch_frames / seconds


def summarize(cells: list[Cell], grid: Grid) -> dict:
    table = []
    for c in cells:
        median = statistics.median(c.seconds)
        table.append({"episode_frames": c.episode_frames, "batch_frames": c.batch_frames, "episodes": c.episodes,
                      "seconds": c.seconds, "median_s": median, "frames_per_s": c.batch_frames / median,
                      "episodes_per_s": c.episodes / median})
    model = fit_costs(cells)
    issue = next((t for t in table if (t["episode_frames"], t["batch_frames"]) == ISSUE_SHAPE), None)
    return {
        "cells": table,
        "model": model,
        "issue_shape": {"episode_frames": ISSUE_SHAPE[0], "batch_frames": ISSUE_SHAPE[1],
                        "frames_per_s": issue["frames_per_s"] if issue else None},
        "target_frames_per_s": TARGET_FRAMES_PER_S,
        "cells_meeting_target": [[t["episode_frames"], t["batch_frames"]] for t in table
                                 if t["frames_per_s"] >= TARGET_FRAMES_PER_S],
        # what the fit says no batch size reaches: frames/s as batches grow without bound
        "model_ceiling_frames_per_s": {str(e): 1 / (model["per_episode_ms"] / 1e3 / e + model["per_frame_us"] / 1e6)
                                       for e in grid.episode_frames},
    }


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    model, cells = result["model"], result["cells"]
    fig, ax = plt.subplots(figsize=(8.5, 4.8))
    lengths = np.geomspace(min(c["episode_frames"] for c in cells), max(c["episode_frames"] for c in cells), 60)
    for color, batch in zip(("#4c72b0", "#55a868", "#c44e52"), sorted({c["batch_frames"] for c in cells})):
        mine = [c for c in cells if c["batch_frames"] == batch]
        ax.plot([c["episode_frames"] for c in mine], [c["frames_per_s"] / 1e3 for c in mine], "o", color=color,
                label=f"{batch:,}-frame batches (median of {len(mine[0]['seconds'])})")
        for c in mine:
            ax.plot([c["episode_frames"]] * len(c["seconds"]), [batch / s / 1e3 for s in c["seconds"]], ".",
                    color=color, alpha=0.35, ms=4)
        ax.plot(lengths, [predicted_frames_per_s(model, e, batch) / 1e3 for e in lengths], "-", color=color, lw=1)
    ax.axhline(result["target_frames_per_s"] / 1e3, color="#888888", ls="--", lw=0.8, label="issue 17 target")
    ax.set(xscale="log", xlabel="frames per episode", ylabel="thousand frames / s (end to end)", ylim=(0, None),
           title=f"ingest_files by batch shape (lines: fit, fixed {model['fixed_s'] * 1e3:.0f} ms + "
                 f"{model['per_episode_ms']:.2f} ms/episode + {model['per_frame_us']:.2f} µs/frame, "
                 f"R² {model['r2']:.2f})")
    ax.title.set_fontsize(9)
    ax.legend(fontsize=8, loc="upper left")
    cores = result["machine"]["cores_used"]
    fig.text(0.99, 0.01, f"{cores} core(s) of a shared host", ha="right", fontsize=7, color="#666666")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="2 x 2 cells, 2 timed batches")
    parser.add_argument("--episode-frames", type=int, nargs="+", default=None)
    parser.add_argument("--batch-frames", type=int, nargs="+", default=None)
    parser.add_argument("--timed-batches", type=int, default=None, help="timed batches per cell")
    parser.add_argument("--workdir", type=Path, default=None, help="scratch dir (default: a temp dir)")
    parser.add_argument("--out", type=Path, default=RESULTS)
    parser.add_argument("--name", default=NAME)
    args = parser.parse_args()
    grid = QUICK if args.quick else FULL
    grid = Grid(episode_frames=tuple(args.episode_frames or grid.episode_frames),
                batch_frames=tuple(args.batch_frames or grid.batch_frames),
                timed_batches=args.timed_batches or grid.timed_batches, seed=grid.seed)
    start = time.perf_counter()
    load_start = os.getloadavg()
    with tempfile.TemporaryDirectory(prefix="ingest-shapes-") as tmp:
        workdir = args.workdir or Path(tmp)
        cells = run_cells(grid, workdir)
    result = {
        "benchmark": NAME,
        "grid": asdict(grid),
        "machine": {"cpus": os.cpu_count(), "cores_used": len(os.sched_getaffinity(0)),
                    "python": platform.python_version(), "load_avg_start": load_start, "load_avg_end": os.getloadavg()},
        **summarize(cells, grid),
        "wall_s": time.perf_counter() - start,
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"{args.name}.json").write_text(json.dumps(result, indent=1))
    plot(result, args.out / f"{args.name}.png")
    model = result["model"]
    print(f"fit over {model['batches']} batches: fixed {model['fixed_s'] * 1e3:.0f} ms + {model['per_episode_ms']:.2f} "
          f"ms/episode + {model['per_frame_us']:.2f} us/frame (R^2 {model['r2']:.3f})")
    for c in result["cells"]:
        print(f"  {c['episode_frames']:>5}-frame episodes, {c['batch_frames']:>6,}-frame batches: "
              f"{c['frames_per_s']:>9,.0f} frames/s ({c['median_s']:.3f} s)")
    print(f"wrote {args.out / args.name}.json and .png in {result['wall_s']:.0f}s")


if __name__ == "__main__":
    main()
