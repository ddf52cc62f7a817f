"""Ingest throughput (Parquet episode dataset + LanceDB segment store) and kNN latency at scale.

    python -m benchmarks.ingest            # 1M frames ingested, store grown to 1M segments
    python -m benchmarks.ingest --quick    # 50k frames, 50k segments (smoke run, ~1 min)

Synthetic episodes of realistic size (120 frames x 10-dim state, 4-dim action, 96 robots, ~75%
success; smooth random-walk trajectories around a per-episode start) go through the same code
the pipeline uses:

1. Parquet: ``EpisodeDataset.add_episodes`` (validation, dedupe, LeRobot v3 files), and side by
   side the bare ``episode_to_table`` + ``pq.write_table`` path (the floor without validation).
2. LanceDB: ``SegmentStore.upsert`` (windows W=8 stride 4 -> NormalizedStateEncoder, D = 80
   -> idempotency check -> merge_insert), with the store config from params.yaml.
3. The store keeps growing (upsert only) to the target segment count; then single-query kNN
   latency (k=10) brute force (``exact=True``) vs IVF_PQ (built by ``ensure_index``), with and
   without the success filter FERT uses, recall@10 of the index against brute force, and the
   per-query time of one batched call.

Writes benchmarks/results/ingest.json and ingest.png. Figures are medians over the chunks or
queries of one run; the machine is shared, so the load average is recorded at start and end.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import shutil
import statistics
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from components.config import StoreConfig, load_settings
from components.episodes.dataset import EpisodeDataset
from components.episodes.record import Episode, new_episode_id
from components.episodes.schema import episode_to_table
from components.store import NormalizedStateEncoder, SegmentStore, episode_windows

RESULTS = Path(__file__).resolve().parent / "results"
NAME = "ingest"

EPISODE_FRAMES = 120
STATE_DIM = 10
ACTION_DIM = 4
NUM_ROBOTS = 96
SUCCESS_RATE = 0.75
STEP_SCALE = 0.02  # per-frame random-walk step of the synthetic state
K = 10


@dataclass(frozen=True)
class Scale:
    frames: int  # frames ingested into Parquet + LanceDB
    segments: int  # store size for the query benchmark
    chunk_episodes: int  # episodes per ingest call
    queries: int  # single queries timed per configuration


FULL = Scale(frames=1_000_000, segments=1_000_000, chunk_episodes=2000, queries=100)
QUICK = Scale(frames=50_000, segments=50_000, chunk_episodes=200, queries=40)


@dataclass(frozen=True)
class Latency:
    p50_ms: float
    p99_ms: float
    mean_ms: float
    queries: int


@dataclass(frozen=True)
class QueryCase:
    name: str
    index: bool
    success_filter: bool
    nprobes: int | None
    refine_factor: int | None
    latency: Latency
    recall_at_10: float | None  # vs brute force with the same filter


def synthetic_episodes(seed: int, count: int) -> list[Episode]:
    """``count`` episodes from a seeded generator (see the module docstring)."""
    rng = np.random.default_rng(seed)
    starts = rng.uniform(-0.5, 0.5, (count, 1, STATE_DIM))
    steps = rng.standard_normal((count, EPISODE_FRAMES, STATE_DIM)) * STEP_SCALE
    states = (starts + np.cumsum(steps, axis=1)).astype(np.float32)
    actions = rng.uniform(-1, 1, (count, EPISODE_FRAMES, ACTION_DIM)).astype(np.float32)
    timestamps = np.arange(EPISODE_FRAMES, dtype=np.float32) / 10.0
    robots = rng.integers(0, NUM_ROBOTS, count)
    success = rng.random(count) < SUCCESS_RATE
    return [
        Episode(
            episode_id=new_episode_id(rng),
            robot_id=f"robot-{robots[i]:04d}",
            task="pick-place",
            states=states[i],
            actions=actions[i],
            timestamps=timestamps,
            success=bool(success[i]),
        )
        for i in range(count)
    ]


def latency(seconds: list[float]) -> Latency:
    ms = np.asarray(seconds) * 1000
    return Latency(
        p50_ms=float(np.percentile(ms, 50)),
        p99_ms=float(np.percentile(ms, 99)),
        mean_ms=float(ms.mean()),
        queries=len(ms),
    )


def time_queries(
    store: SegmentStore, queries: np.ndarray, exact: bool, success: bool | None
) -> tuple[list[float], np.ndarray]:
    store.search(queries[:1], k=K, exact=exact, success=success)  # warm caches
    seconds, ids = [], []
    for query in queries:
        t0 = time.perf_counter()
        hit = store.search(query[None], k=K, exact=exact, success=success)
        seconds.append(time.perf_counter() - t0)
        ids.append(hit.segment_ids[0])
    return seconds, np.stack(ids)


def recall(found: np.ndarray, truth: np.ndarray) -> float:
    """Mean fraction of the true top-k ids (padding "" ignored) that ``found`` returned."""
    hits = []
    for got, true in zip(found, truth, strict=True):
        expected = set(true) - {""}
        hits.append(len(set(got) & expected) / max(1, len(expected)))
    return float(np.mean(hits))


def run(scale: Scale, workdir: Path, cfg: StoreConfig) -> dict:
    load_start = os.getloadavg()
    dataset = EpisodeDataset(workdir / "episodes", load_settings().episodes)
    raw_dir = workdir / "raw_parquet"
    raw_dir.mkdir(parents=True)

    first = synthetic_episodes(seed=0, count=scale.chunk_episodes)
    t0 = time.perf_counter()
    encoder = NormalizedStateEncoder(cfg.window).fit(
        np.concatenate([episode_windows(e, cfg.window, cfg.stride)[1] for e in first])
    )
    fit_s = time.perf_counter() - t0
    store = SegmentStore.open(workdir / "segments.lance", cfg, encoder.dim)
    print(f"encoder: D={encoder.dim} (W={cfg.window} x state {STATE_DIM}), fit {fit_s:.2f}s")

    # -- 1. ingest: Parquet (dataset and bare) + LanceDB, chunk by chunk ----------------------
    total_episodes = math.ceil(scale.frames / EPISODE_FRAMES)
    n_chunks = math.ceil(total_episodes / scale.chunk_episodes)
    rates: dict[str, list[float]] = {"parquet_dataset": [], "parquet_bare": [], "lancedb_upsert": []}
    totals = dict.fromkeys(rates, 0.0)
    frames = 0
    for chunk in range(n_chunks):
        count = min(scale.chunk_episodes, total_episodes - chunk * scale.chunk_episodes)
        episodes = first[:count] if chunk == 0 else synthetic_episodes(seed=chunk, count=count)
        n = sum(e.length for e in episodes)

        t0 = time.perf_counter()
        table = pa.concat_tables([episode_to_table(e) for e in episodes])
        pq.write_table(table, raw_dir / f"file-{chunk:03d}.parquet")
        bare = time.perf_counter() - t0

        t0 = time.perf_counter()
        report = dataset.add_episodes(episodes)
        parquet = time.perf_counter() - t0
        assert len(report.added) == len(episodes), report.summary()

        t0 = time.perf_counter()
        upsert = store.upsert(episodes, encoder, snapshot=f"bench-{chunk}")
        lance = time.perf_counter() - t0
        assert upsert.inserted == upsert.segments

        for key, seconds in (("parquet_dataset", parquet), ("parquet_bare", bare), ("lancedb_upsert", lance)):
            rates[key].append(n / seconds)
            totals[key] += seconds
        frames += n
        print(
            f"ingest {chunk + 1}/{n_chunks}: {frames:,} frames | dataset {n / parquet:,.0f} f/s, "
            f"bare parquet {n / bare:,.0f} f/s, lancedb {n / lance:,.0f} f/s "
            f"({upsert.segments:,} segments) | store {store.count():,}",
            flush=True,
        )
    ingest_segments = store.count()

    # idempotency at scale: re-upserting the last chunk commits nothing
    t0 = time.perf_counter()
    again = store.upsert(episodes, encoder, snapshot="bench-again")
    noop_s = time.perf_counter() - t0
    assert not again.changed and again.version_after == again.version_before

    # -- 2. grow the store to the query scale (upsert only) ----------------------------------
    grow_rates: list[float] = []
    chunk = n_chunks
    while store.count() < scale.segments:
        per_episode = len(episode_windows(first[0], cfg.window, cfg.stride)[0])
        need = math.ceil((scale.segments - store.count()) / per_episode)
        episodes = synthetic_episodes(seed=chunk, count=min(scale.chunk_episodes, need))
        t0 = time.perf_counter()
        upsert = store.upsert(episodes, encoder, snapshot=f"bench-{chunk}")
        grow_rates.append(upsert.segments / (time.perf_counter() - t0))
        chunk += 1
        print(
            f"grow: store {store.count():,}/{scale.segments:,} segments, {grow_rates[-1]:,.0f} seg/s",
            flush=True,
        )
    segments = store.count()

    # -- 3. kNN: brute force vs IVF_PQ ----------------------------------------------------------
    probe = [e for e in synthetic_episodes(seed=10_000_019, count=4 * scale.queries) if not e.success]
    windows = np.concatenate([episode_windows(e, cfg.window, cfg.stride)[1] for e in probe])
    pick = np.random.default_rng(1).choice(len(windows), scale.queries, replace=False)
    queries = encoder.encode(windows[np.sort(pick)])
    cases: list[QueryCase] = []
    truth: dict[bool, np.ndarray] = {}
    for success in (None, True):
        seconds, ids = time_queries(store, queries, exact=True, success=success)
        truth[success is True] = ids
        cases.append(QueryCase(f"brute force{' + success' if success else ''}", False, success is True,
                               None, None, latency(seconds), 1.0))
        done = cases[-1].latency
        print(f"{cases[-1].name}: p50 {done.p50_ms:.1f} ms, p99 {done.p99_ms:.1f} ms", flush=True)
    t0 = time.perf_counter()
    assert store.ensure_index(), "store below index_min_rows"
    build_s = time.perf_counter() - t0
    print(
        f"index build (IVF_PQ {cfg.index_partitions} partitions x {cfg.index_sub_vectors} "
        f"sub-vectors, + scalar): {build_s:.1f}s",
        flush=True,
    )
    for refine in (cfg.refine_factor, 0):
        view_cfg = cfg.model_copy(update={"refine_factor": refine})
        view = SegmentStore.open(workdir / "segments.lance", view_cfg, encoder.dim)
        for success in (None, True):
            seconds, ids = time_queries(view, queries, exact=False, success=success)
            name = f"IVF_PQ nprobes={cfg.nprobes} refine={refine}{' + success' if success else ''}"
            cases.append(QueryCase(name, True, success is True, cfg.nprobes, refine, latency(seconds),
                                   recall(ids, truth[success is True])))
            print(f"{name}: p50 {cases[-1].latency.p50_ms:.2f} ms, p99 {cases[-1].latency.p99_ms:.2f} ms, "
                  f"recall@10 {cases[-1].recall_at_10:.3f}")
    batched = {}
    for exact in (True, False):
        store.search(queries[:2], k=K, exact=exact)
        t0 = time.perf_counter()
        store.search(queries, k=K, exact=exact)
        batched["brute_force" if exact else "ivf_pq"] = (time.perf_counter() - t0) * 1000 / len(queries)
    print(f"one batched call of {len(queries)} queries, per query: brute {batched['brute_force']:.1f} ms, "
          f"IVF_PQ {batched['ivf_pq']:.2f} ms")

    lance_s, parquet_s = totals["lancedb_upsert"], totals["parquet_dataset"]
    brute, indexed = cases[0].latency, cases[2].latency
    return {
        "benchmark": NAME,
        "scale": asdict(scale),
        "machine": {"cpus": os.cpu_count(), "python": platform.python_version(),
                    "load_avg_start": load_start, "load_avg_end": os.getloadavg()},
        "episode": {"frames": EPISODE_FRAMES, "state_dim": STATE_DIM, "action_dim": ACTION_DIM,
                    "robots": NUM_ROBOTS, "success_rate": SUCCESS_RATE},
        "store_config": cfg.model_dump(),
        "vector_dim": encoder.dim,
        "ingest": {
            "frames": frames,
            "segments": ingest_segments,
            "median_frames_per_s": {k: statistics.median(v) for k, v in rates.items()},
            "total_s": totals,
            "overall_frames_per_s": frames / (parquet_s + lance_s),
            "lancedb_segments_per_s": ingest_segments / lance_s,
            "noop_reupsert_s": noop_s,
            "encoder_fit_s": fit_s,
        },
        "grow": {
            "segments": segments,
            "median_segments_per_s": statistics.median(grow_rates) if grow_rates else None,
        },
        "query": {
            "segments": segments,
            "k": K,
            "index_build_s": build_s,
            "cases": [asdict(c) for c in cases],
            "batched_per_query_ms": batched,
            "speedup_p50_index_vs_brute": brute.p50_ms / indexed.p50_ms,
        },
    }


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(13, 4.8))
    rates = result["ingest"]["median_frames_per_s"]
    labels = [
        "bare Parquet\nwrite", "EpisodeDataset\n(Parquet)", "SegmentStore\nupsert", "EpisodeDataset\n+ upsert"
    ]
    values = [rates["parquet_bare"], rates["parquet_dataset"], rates["lancedb_upsert"],
              result["ingest"]["overall_frames_per_s"]]
    bars = left.bar(labels, values, color=["#bbbbbb", "#4c72b0", "#55a868", "#8172b2"])
    left.bar_label(bars, [f"{v:,.0f}" for v in values], fontsize=8)
    left.set_ylabel("frames / s (median over chunks; last bar: whole run)")
    cores = result["machine"]["cpus"]
    left.set_title(f"ingest of {result['ingest']['frames']:,} frames ({cores} shared cores)")

    cases = result["query"]["cases"]
    x = np.arange(len(cases))
    p50 = [c["latency"]["p50_ms"] for c in cases]
    p99 = [c["latency"]["p99_ms"] for c in cases]
    right.bar(x - 0.2, p50, 0.4, label="p50")
    right.bar(x + 0.2, p99, 0.4, label="p99")
    right.set_yscale("log")
    names = [
        ("IVF_PQ\nrefine " + str(c["refine_factor"]) if c["index"] else "brute\nforce")
        + ("\n+ success" if c["success_filter"] else "")
        for c in cases
    ]
    right.set_xticks(x, names, fontsize=8)
    for i, c in enumerate(cases):
        if c["index"]:
            right.annotate(f"R@10={c['recall_at_10']:.2f}", (i, p99[i]), ha="center", va="bottom", fontsize=7)
    right.set_ylabel("single-query latency, ms (log)")
    nprobes = result["store_config"]["nprobes"]
    right.set_title(
        f"kNN k={result['query']['k']} at {result['query']['segments']:,} segments, "
        f"D={result['vector_dim']}, nprobes={nprobes}"
    )
    right.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="50k frames / 50k segments smoke run")
    parser.add_argument("--workdir", type=Path, default=None, help="scratch dir (default: a temp dir)")
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    scale = QUICK if args.quick else FULL
    cfg = load_settings().store
    if scale.segments < cfg.index_min_rows:
        raise SystemExit(f"--quick target {scale.segments} < store.index_min_rows {cfg.index_min_rows}")
    workdir = Path(tempfile.mkdtemp(prefix="bench-ingest-")) if args.workdir is None else args.workdir
    workdir.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    try:
        result = run(scale, workdir, cfg)
    finally:
        if args.workdir is None:
            shutil.rmtree(workdir, ignore_errors=True)
    result["wall_s"] = time.perf_counter() - started
    result["command"] = "python -m benchmarks.ingest" + (" --quick" if args.quick else "")
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"{NAME}.json").write_text(json.dumps(result, indent=2) + "\n")
    plot(result, args.out / f"{NAME}.png")
    print(f"wrote {args.out / NAME}.json and .png in {result['wall_s']:.0f}s")


if __name__ == "__main__":
    main()
