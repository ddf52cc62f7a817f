"""The vector index's build time and recall against its k-means iterations (``store.index_max_iterations``).

    python -m benchmarks.index_build                        # 1M segments; 5, 10, 20, 50 iterations
    python -m benchmarks.index_build --quick                # 100k segments; 10 and 50 iterations

The first index build runs inside one ingest (``ensure_index``, at ``store.index_min_rows``) and
every retrain inside upkeep, and LanceDB's k-means runs 50 iterations unless told otherwise.
This builds the product's index (``SegmentStore.rebuild_index``: ``store.index_type`` with
``index_plan``'s sizes) on one store, once per iteration count, in the order given and then
reversed (host drift falls on both ends alike), and after each build times single queries
through LanceDB's index (the resident copy off: above ``store.resident_max_rows`` this is the
product's path) against the exact answer. The store is the ingest benchmark's (one batch through
``ingest_files`` fits the encoder, then synthetic episodes are upserted); the queries come from
their own seed (20,000,003), which no setting was chosen on.

Writes benchmarks/results/index_build.json and .png (``--name`` for another name).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from dataclasses import asdict
from pathlib import Path

import numpy as np

from benchmarks.ingest import (
    QUICK,
    K,
    latency,
    recall,
    seed_store,
    synthetic_episodes,
    time_queries,
    top_up,
)
from components.config import load_settings
from components.pipeline.workspace import Workspace
from components.store import SegmentStore, episode_windows
from components.store.index_plan import search_params

RESULTS = Path(__file__).resolve().parent / "results"
NAME = "index_build"
QUERY_SEED = 20_000_003


def build_store(workdir: Path, segments: int) -> tuple[SegmentStore, object, Workspace]:
    settings = load_settings(root=workdir / "root")
    seed_store(QUICK, settings, workdir / "incoming")
    ws = Workspace(settings)
    store, encoder = ws.store, ws.store.load_encoder()
    top_up(store, encoder, ws, segments)
    store.optimize()  # compacted, as a nightly-upkept store is
    return store, encoder, ws


def held_out_queries(ws: Workspace, encoder, count: int) -> np.ndarray:
    cfg = ws.settings.store
    probe = synthetic_episodes(QUERY_SEED, count, ws.obs_dim, ws.act_dim)
    windows = np.concatenate([episode_windows(e, cfg.window, cfg.stride)[1] for e in probe])
    pick = np.random.default_rng(QUERY_SEED).choice(len(windows), count, replace=False)
    return encoder.encode(windows[np.sort(pick)])


def lancedb_handle(store: SegmentStore, **update) -> SegmentStore:
    """The same table with no resident copy: queries go to LanceDB (its index, or exact)."""
    return SegmentStore.open(store.location, store.cfg.model_copy(update={"resident_index": False, **update}), store.dim)


def measure(store: SegmentStore, iterations: list[int], queries: np.ndarray) -> list[dict]:
    _, _, truth = time_queries(lancedb_handle(store), queries, exact=True, success=None)
    rows = []
    for it in iterations + iterations[::-1]:
        handle = lancedb_handle(store, index_max_iterations=it)
        t0 = time.perf_counter()
        handle.rebuild_index()
        build_s = time.perf_counter() - t0
        seconds, cpu_seconds, found = time_queries(handle, queries, exact=False, success=None)
        rows.append({"max_iterations": it, "build_s": build_s, "recall_at_10": recall(found, truth),
                     "latency": asdict(latency(seconds, cpu_seconds)), "load_avg_after": os.getloadavg()})
        print(f"max_iterations={it}: built in {build_s:.1f}s, recall@10 {rows[-1]['recall_at_10']:.4f}, "
              f"p50 {rows[-1]['latency']['p50_ms']:.1f} ms", flush=True)
    return rows


def summarize(rows: list[dict]) -> dict:
    out = {}
    for it in sorted({r["max_iterations"] for r in rows}):
        mine = [r for r in rows if r["max_iterations"] == it]
        out[str(it)] = {"build_s_median": statistics.median(r["build_s"] for r in mine),
                        "recall_at_10_median": statistics.median(r["recall_at_10"] for r in mine),
                        "builds": len(mine)}
    return out


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    its = sorted(int(i) for i in result["by_iterations"])
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    for r in result["builds"]:
        left.plot(r["max_iterations"], r["build_s"], "o", color="#4c72b0", ms=5)
        right.plot(r["max_iterations"], r["recall_at_10"], "o", color="#c44e52", ms=5)
    left.plot(its, [result["by_iterations"][str(i)]["build_s_median"] for i in its], "-", color="#4c72b0")
    right.plot(its, [result["by_iterations"][str(i)]["recall_at_10_median"] for i in its], "-", color="#c44e52")
    left.set(xlabel="k-means iterations", ylabel="seconds per index build", ylim=(0, None),
             title=f"{result['index']} on {result['segments'] / 1e6:.1f}M segments")
    right.set(xlabel="k-means iterations", ylabel=f"recall@{K} (LanceDB index vs exact)",
              title=f"{result['queries']} held-out single queries")
    for ax in (left, right):
        ax.axvline(result["configured"], color="grey", lw=0.8, ls=":")
        ax.title.set_fontsize(10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="100k segments, 10 and 50 iterations, 50 queries")
    parser.add_argument("--segments", type=int, default=None, help="store size (default 1M)")
    parser.add_argument("--iterations", type=int, nargs="+", default=None, help="default 5 10 20 50")
    parser.add_argument("--queries", type=int, default=None, help="held-out single queries (default 300)")
    parser.add_argument("--workdir", type=Path, default=None, help="scratch dir (default: a temp dir)")
    parser.add_argument("--out", type=Path, default=RESULTS)
    parser.add_argument("--name", default=NAME)
    args = parser.parse_args()
    quick = {"segments": 100_000, "iterations": [10, 50], "queries": 50}
    full = {"segments": 1_000_000, "iterations": [5, 10, 20, 50], "queries": 300}
    for key, value in (quick if args.quick else full).items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    start, load_start = time.perf_counter(), os.getloadavg()
    with tempfile.TemporaryDirectory(prefix="index-build-") as tmp:
        store, encoder, ws = build_store(args.workdir or Path(tmp), args.segments)
        rows = measure(store, list(args.iterations), held_out_queries(ws, encoder, args.queries))
        result = {"benchmark": NAME, "segments": store.count(), "index": store.index_plan().describe(),
                  "search": asdict(search_params(store.index_type(), K, store.cfg)),
                  "queries": args.queries, "configured": ws.settings.store.index_max_iterations,
                  "builds": rows, "by_iterations": summarize(rows)}
    result.update({"machine": {"cpus": os.cpu_count(), "cores_used": len(os.sched_getaffinity(0)),
                               "load_avg_start": load_start, "load_avg_end": os.getloadavg()},
                   "wall_s": time.perf_counter() - start,
                   "command": "python -m benchmarks.index_build --segments {} --iterations {} --queries {}".format(
                       args.segments, " ".join(map(str, args.iterations)), args.queries)})
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"{args.name}.json").write_text(json.dumps(result, indent=1))
    plot(result, args.out / f"{args.name}.png")
    for it, row in result["by_iterations"].items():
        print(f"{it:>3} iterations: build {row['build_s_median']:.1f} s, recall@{K} {row['recall_at_10_median']:.4f}")
    print(f"wrote {args.out / args.name}.json and .png in {result['wall_s']:.0f}s")


if __name__ == "__main__":
    main()
