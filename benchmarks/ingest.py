"""The product's ingest path as the data grows, and kNN on the segment store at scale.

    python -m benchmarks.ingest                      # 10M frames in 10k-frame batches, kNN at 1M
    python -m benchmarks.ingest --frames 2000000     # a shorter growth curve, same batches
    python -m benchmarks.ingest --quick              # 200k frames, kNN at 100k segments (minutes)
    python -m benchmarks.ingest --knn-only --knn-segments 1000000 --name ingest_knn   # kNN phase only
    python -m benchmarks.ingest --refit --name ingest_10m_step   # a stored run's growth.fit, PNG redrawn

1. **Growth**: one scratch root grown batch by batch through
   ``components.pipeline.ingest.ingest_files`` with params.yaml's settings, exactly what
   ``dvc repro`` and the flows run: read files → validate → Parquet (LeRobot v3) → DVC snapshot
   → embed (cursor) → upsert → index upkeep. Each batch is ``--batch-frames`` frames of
   synthetic episodes with the default simulator's widths (11-dim state, 3-dim action; windows
   8 × 11 = 88), written as one Parquet file per episode (untimed: that is the robot's side).
   Per batch: wall time, frames/s, disk bytes (dataset + DVC cache + store). Every
   ``--upkeep-every`` batches ``upkeep_store`` runs (compaction, index retrain, pruning, the
   embed cursor's row count), as the scheduled ``store-upkeep`` flow does; it is timed separately.
   ``--knn-only`` skips it: one batch through ``ingest_files`` (DVC, dataset, the encoder fitted
   and saved as the product does), then straight to phase 2.
2. **kNN**: the same store topped up with ``SegmentStore.upsert`` to ``--knn-segments``, its
   vector index built by ``ensure_index`` (``store.index_type``, timed) and upkept, then
   single-query k=10 latency through ``SegmentStore.search``, brute force vs the index with its
   configured search keys, with and without the success filter FERT uses; recall@10 against
   brute force with the same filter, on queries held out from the ones the settings were chosen
   on; and FERT's bulk shape (``fert.max_queries`` queries at once): the store's exact scan
   beside LanceDB's own search of the same list, flat and indexed.

Writes benchmarks/results/ingest.json and ingest.png (``--name`` for another name). The machine is shared: load averages are
recorded, and start/end figures are medians over ``WINDOW`` batches.
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

from components.config import Settings, load_settings
from components.episodes.record import Episode, new_episode_id
from components.episodes.schema import write_episode_file
from components.pipeline.ingest import (
    PhaseTimes,
    compact_dataset,
    ingest_files,
    upkeep_store,
)
from components.pipeline.workspace import Workspace
from components.store import SegmentStore, episode_windows
from components.store.index_plan import search_params

RESULTS = Path(__file__).resolve().parent / "results"
NAME = "ingest"

EPISODE_FRAMES = 50  # 200 episodes ≈ 10k frames per batch, as in issue 17
NUM_ROBOTS = 96
SUCCESS_RATE = 0.75
STEP_SCALE = 0.02  # per-frame random-walk step of the synthetic state
K = 10
WINDOW = 5  # batches in the start/end medians
SPIKE = 3.0  # batches slower than this many times the run's median (an index build or fold) stay out of the fit


@dataclass(frozen=True)
class Scale:
    frames: int  # frames grown through the ingest path
    batch_frames: int
    knn_segments: int  # store size for the kNN benchmark
    queries: int
    upkeep_every: int  # batches between upkeep_store calls (the store-upkeep flow)
    retain_days: float | None = None  # overrides store.retain_versions_days and episodes.superseded_retain_hours (0: steady state)
    knn_only: bool = False  # no growth curve: one ingest batch (fits the encoder), then the kNN phase


FULL = Scale(frames=10_000_000, batch_frames=10_000, knn_segments=1_000_000, queries=100, upkeep_every=100)
QUICK = Scale(frames=200_000, batch_frames=10_000, knn_segments=100_000, queries=40, upkeep_every=10)


@dataclass(frozen=True)
class Latency:
    p50_ms: float
    p99_ms: float
    mean_ms: float
    queries: int
    # CPU time of this process (all its threads, LanceDB's included) per query: what a query
    # costs, where wall time also holds the waits for a core on a shared host
    cpu_p50_ms: float | None = None
    cpu_p99_ms: float | None = None


def synthetic_episodes(seed: int, count: int, state_dim: int, action_dim: int,
                       frames: int = EPISODE_FRAMES) -> list[Episode]:
    """``count`` smooth random-walk episodes of ``frames`` frames from a seeded generator."""
    rng = np.random.default_rng(seed)
    starts = rng.uniform(-0.5, 0.5, (count, 1, state_dim))
    steps = rng.standard_normal((count, frames, state_dim)) * STEP_SCALE
    states = (starts + np.cumsum(steps, axis=1)).astype(np.float32)
    actions = rng.uniform(-1, 1, (count, frames, action_dim)).astype(np.float32)
    timestamps = np.arange(frames, dtype=np.float32) / 10.0
    robots = rng.integers(0, NUM_ROBOTS, count)
    success = rng.random(count) < SUCCESS_RATE
    return [
        Episode(
            episode_id=new_episode_id(rng), robot_id=f"robot-{robots[i]:04d}", task="pick-place",
            states=states[i], actions=actions[i], timestamps=timestamps, success=bool(success[i]),
        )
        for i in range(count)
    ]


def disk_bytes(*roots: Path) -> int:
    return sum(
        os.path.getsize(os.path.join(folder, name))
        for root in roots if root.exists()
        for folder, _, names in os.walk(root) for name in names
    )


def dataset_files(folder: Path) -> int:
    """Files a DVC snapshot of the dataset walks (``.superseded/`` is .dvcignore'd)."""
    return sum(1 for path in folder.rglob("*") if path.is_file() and ".superseded" not in path.parts)


def latency(seconds: list[float], cpu_seconds: list[float] | None = None) -> Latency:
    ms = np.asarray(seconds) * 1000
    cpu = None if cpu_seconds is None else np.asarray(cpu_seconds) * 1000
    return Latency(float(np.percentile(ms, 50)), float(np.percentile(ms, 99)), float(ms.mean()), len(ms),
                   None if cpu is None else float(np.percentile(cpu, 50)),
                   None if cpu is None else float(np.percentile(cpu, 99)))


def recall(found: np.ndarray, truth: np.ndarray) -> float:
    """Mean fraction of the true top-k ids (padding "" ignored) that ``found`` returned."""
    hits = [len(set(got) & (set(true) - {""})) / max(1, len(set(true) - {""})) for got, true in zip(found, truth)]
    return float(np.mean(hits))


def time_queries(store: SegmentStore, queries: np.ndarray, exact: bool, success: bool | None):
    store.search(queries[:1], k=K, exact=exact, success=success)  # warm caches
    seconds, cpu_seconds, ids = [], [], []
    for query in queries:
        c0, t0 = time.process_time(), time.perf_counter()
        hit = store.search(query[None], k=K, exact=exact, success=success)
        seconds.append(time.perf_counter() - t0)
        cpu_seconds.append(time.process_time() - c0)
        ids.append(hit.segment_ids[0])
    return seconds, cpu_seconds, np.stack(ids)


def ingest_batch(settings: Settings, ws: Workspace, batch: int, episodes: int, scratch: Path,
                 frames: int = EPISODE_FRAMES, times: PhaseTimes | None = None) -> float:
    """Write ``episodes`` synthetic episodes of ``frames`` frames (seed ``batch``) as files, ingest
    them through ``ingest_files`` and return its wall time (writing the files is the robot's
    side: untimed); ``times`` collects its phases' seconds."""
    folder = scratch / f"batch-{batch:05d}"
    files = [write_episode_file(e, folder / f"{i:04d}.parquet")
             for i, e in enumerate(synthetic_episodes(batch, episodes, ws.obs_dim, ws.act_dim, frames))]
    t0 = time.perf_counter()
    result = ingest_files(settings, files, times=times)
    seconds = time.perf_counter() - t0
    shutil.rmtree(folder)
    assert len(result.report.added) == episodes, result.report.summary()
    return seconds


def seed_store(scale: Scale, settings: Settings, scratch: Path) -> dict:
    """``--knn-only``: one batch through ingest_files (the encoder is fitted and saved the way
    the product does it), no growth curve; the kNN phase tops the store up from there."""
    episodes = max(1, scale.batch_frames // EPISODE_FRAMES)
    seconds = ingest_batch(settings, Workspace(settings), 0, episodes, scratch)
    return {"seed": {"episodes": episodes, "frames": episodes * EPISODE_FRAMES, "seconds": seconds}}


def grow(scale: Scale, settings: Settings, scratch: Path) -> dict:
    """Phase 1: the growth curve through ingest_files. The curve so far is kept beside the root
    after every batch (``growth-partial.json``), so a run stopped in a later phase resumes with
    ``--workdir``: the batches already in the root are not ingested again."""
    ws = Workspace(settings)
    per_batch = max(1, scale.batch_frames // EPISODE_FRAMES)
    batches = math.ceil(scale.frames / (per_batch * EPISODE_FRAMES))
    dirs = (settings.paths.episodes, settings.paths.store, settings.root / ".dvc" / "cache")
    partial = scratch.parent / "growth-partial.json"
    rows, upkeeps = resume_growth(partial, ws)
    resumed_after = len(rows)
    stored = rows[-1]["stored_frames"] if rows else 0
    for batch in range(len(rows), batches):
        seconds = ingest_batch(settings, ws, batch, per_batch, scratch)
        frames = per_batch * EPISODE_FRAMES
        stored += frames
        store = Workspace(settings).store
        rows.append({"batch": batch, "stored_frames": stored, "segments": store.count(), "seconds": seconds,
                     "frames_per_s": frames / seconds, "disk_bytes": disk_bytes(*dirs),
                     "dataset_files": dataset_files(settings.paths.episodes)})
        if (batch + 1) % scale.upkeep_every == 0:
            t0 = time.perf_counter()
            compact_dataset(settings)  # the store-upkeep flow's first task (a no-op on a root grown this way)
            report = upkeep_store(settings)
            upkeeps.append({"after_batch": batch, "stored_frames": stored, "seconds": time.perf_counter() - t0,
                            "store_bytes_before": report.bytes_before, "store_bytes_after": report.bytes_after,
                            "versions_before": report.versions_before, "versions_after": report.versions_after,
                            "index_built": report.index_built, "index_rebuilt": report.index_rebuilt,
                            "disk_bytes_after": disk_bytes(*dirs)})
        partial.write_text(json.dumps({"curve": rows, "upkeep": upkeeps}))
        if batch % 10 == 0 or batch == batches - 1:
            print(f"batch {batch + 1}/{batches}: {stored:,} frames stored, {rows[-1]['segments']:,} segments | "
                  f"{seconds:.2f}s = {frames / seconds:,.0f} frames/s | disk {rows[-1]['disk_bytes'] / 2**20:,.0f} MiB",
                  flush=True)
    seconds = [r["seconds"] for r in rows]
    # batch 1 also initialises DVC and fits the encoder: the start window begins at batch 2
    start = seconds[1 : 1 + WINDOW] if len(seconds) > WINDOW else seconds
    end = seconds[-WINDOW:]
    frames = per_batch * EPISODE_FRAMES
    return {
        "growth": {
            "batch_frames": frames,
            "episode_frames": EPISODE_FRAMES,
            "batches": len(rows),
            "stored_frames": stored,
            "first_batch_s": statistics.median(start),
            "last_batch_s": statistics.median(end),
            "last_over_first": statistics.median(end) / statistics.median(start),
            "very_first_batch_s": seconds[0],
            "median_batch_s": statistics.median(seconds),
            "max_batch_s": max(seconds),
            "bytes_per_frame_end": rows[-1]["disk_bytes"] / stored,
            "curve": rows,
            "upkeep": upkeeps,
            "resumed_after_batch": resumed_after,  # > 0: wall_s and the load averages cover the resumed run only
            "fit": growth_fit(rows),
        },
        "throughput": {
            "end_to_end_frames_per_s": frames / statistics.median(seconds),
            "start_frames_per_s": frames / statistics.median(start),
            "end_frames_per_s": frames / statistics.median(end),
            "whole_run_frames_per_s": stored / sum(seconds),
        },
    }


def growth_fit(rows: list[dict]) -> dict:
    """A Theil-Sen line through every batch's seconds against the frames stored after it (batch 1,
    which initialises DVC, and index builds/folds, > ``SPIKE`` x the median, left out): the time
    a batch gains per million stored frames, with its 95% interval, and the line's last/first
    ratio. Five-batch windows at each end move by +-30% with the host's load; the line uses
    every batch."""
    from scipy.stats import theilslopes

    x = np.array([r["stored_frames"] for r in rows[1:]], dtype=float) / 1e6
    y = np.array([r["seconds"] for r in rows[1:]])
    keep = y <= SPIKE * np.median(y)
    slope, intercept, low, high = theilslopes(y[keep], x[keep])
    first, last = intercept + slope * x[0], intercept + slope * x[-1]
    return {"slope_ms_per_million_frames": 1e3 * slope, "slope_95": [1e3 * low, 1e3 * high],
            "intercept_s": intercept, "fitted_first_s": first, "fitted_last_s": last,
            "fitted_last_over_first": last / first, "batches_fitted": int(keep.sum()),
            "batches_left_out": int((~keep).sum())}


def refit(path: Path) -> None:
    """``--refit NAME``: add ``growth.fit`` to a stored run's JSON from its curve, redraw its PNG."""
    result = json.loads(path.read_text())
    result["growth"]["fit"] = growth_fit(result["growth"]["curve"])
    path.write_text(json.dumps(result, indent=2) + "\n")
    plot(result, path.with_suffix(".png"))
    fit = result["growth"]["fit"]
    print(f"{path.name}: +{fit['slope_ms_per_million_frames']:.1f} ms per million frames "
          f"[{fit['slope_95'][0]:.1f}, {fit['slope_95'][1]:.1f}], fitted last/first {fit['fitted_last_over_first']:.3f}")


def resume_growth(partial: Path, ws: Workspace) -> tuple[list[dict], list[dict]]:
    """(curve rows, upkeeps) of a stopped run whose root holds exactly the frames its curve says;
    ([], []) for a new root. A root that moved past its curve cannot be resumed: refused."""
    if not partial.exists():
        return [], []
    kept = json.loads(partial.read_text())
    rows, stored = kept["curve"], ws.dataset.num_frames
    if not rows or rows[-1]["stored_frames"] != stored:
        raise SystemExit(f"{partial} describes {rows[-1]['stored_frames'] if rows else 0:,} frames but "
                         f"{ws.settings.root} holds {stored:,}: remove the --workdir folder to start afresh")
    print(f"resuming after batch {len(rows)} ({stored:,} frames stored)", flush=True)
    return rows, kept["upkeep"]


def top_up(store: SegmentStore, encoder, ws: Workspace, segments: int) -> float:
    """Upsert synthetic episodes (seeds from 1,000,000) until the store holds ``segments``;
    returns the seconds it took."""
    seed = 1_000_000
    sample = synthetic_episodes(0, 1, ws.obs_dim, ws.act_dim)[0]
    per_episode = len(episode_windows(sample, ws.settings.store.window, ws.settings.store.stride)[0])
    t0 = time.perf_counter()
    while store.count() < segments:
        need = math.ceil((segments - store.count()) / per_episode)
        store.upsert(synthetic_episodes(seed, min(4000, need), ws.obs_dim, ws.act_dim), encoder, snapshot="bench-top-up")
        seed += 1
    return time.perf_counter() - t0


def knn(scale: Scale, settings: Settings) -> dict:
    """Phase 2: top the store up to the kNN size, build its index and upkeep, then time queries.

    The top-up's fragments are compacted (``optimize``), the index is built by ``ensure_index``
    (timed alone: what a user's ingest or upkeep pays; below ``store.vector_index_min_rows`` the
    product builds no vector index, so ``rebuild_index`` builds one for LanceDB's row), then
    ``upkeep`` runs (timed). Queries come from their own seed (10,000,019): the index
    settings were chosen on other queries, so these are held out."""
    ws = Workspace(settings)
    store, encoder = ws.store, ws.store.load_encoder()
    top_up_s = top_up(store, encoder, ws, scale.knn_segments)
    segments = store.count()
    plan = store.index_plan()
    # compact the top-up's fragments first, as a nightly-upkept store is: compacting after the
    # build would also remap the new index (that is upkeep's cost, not the build's)
    t0 = time.perf_counter()
    store.optimize()
    compact_s = time.perf_counter() - t0
    load_before_build = os.getloadavg()
    t0 = time.perf_counter()
    built_by_ingest = store.ensure_index()
    if not built_by_ingest:  # below store.vector_index_min_rows the product builds none; LanceDB's row needs one
        store.rebuild_index()
    index_build_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    store.upkeep()
    upkeep_s = time.perf_counter() - t0
    params = search_params(store.index_type(), K, settings.store)
    print(f"kNN store: {segments:,} segments (top-up {top_up_s:.0f}s), {plan.describe()} built in "
          f"{index_build_s:.1f}s, upkeep {upkeep_s:.1f}s", flush=True)
    # the product's single-query path (store.resident_index) beside LanceDB's own, on one table
    lancedb_only = SegmentStore.open(store.location, settings.store.model_copy(update={"resident_index": False}),
                                     store.dim)
    resident = store.resident()  # None above store.resident_max_rows: LanceDB's index is the product's path then
    resident_info = None if resident is None else {
        "kind": resident.kind, "lists": getattr(resident.index, "nlist", 1), "nprobe": resident.nprobe,
        "encoding": settings.store.resident_encoding, "build_s": resident.build_s, "bytes": resident.nbytes}
    if resident is None:
        print(f"resident index: none ({segments:,} rows > store.resident_max_rows="
              f"{settings.store.resident_max_rows:,}); single queries go to LanceDB's index", flush=True)
    else:
        print(f"resident index: {resident.kind}, {resident_info['lists']} lists, built in {resident.build_s:.1f}s, "
              f"{resident.nbytes / 2**20:.0f} MiB", flush=True)

    probe = [e for e in synthetic_episodes(10_000_019, 4 * scale.queries, ws.obs_dim, ws.act_dim) if not e.success]
    windows = np.concatenate([episode_windows(e, settings.store.window, settings.store.stride)[1] for e in probe])
    pick = np.random.default_rng(1).choice(len(windows), scale.queries, replace=False)
    queries = encoder.encode(windows[np.sort(pick)])
    cases = []
    truth = {}
    index_name = (f"LanceDB {store.index_type()} nprobes={params.nprobes}" + (f" ef={params.ef}" if params.ef else "")
                  + f" refine={params.refine_factor}")
    paths = [("brute force", lancedb_only, True), (index_name, lancedb_only, False)]
    if resident is not None:
        paths.append((f"resident IVF{resident_info['lists']},{resident_info['encoding']} nprobe={resident.nprobe}"
                      if resident.kind == "ivf" else "resident flat", store, False))
    for name, searcher, exact in paths:
        for success in (None, True):
            seconds, cpu_seconds, ids = time_queries(searcher, queries, exact=exact, success=success)
            if exact:
                truth[success] = ids
            cases.append({"name": name + (" + success" if success else ""), "path": name.split()[0],
                          "index": not exact, "success_filter": bool(success), "latency": asdict(latency(seconds, cpu_seconds)),
                          "recall_at_10": 1.0 if exact else recall(ids, truth[success]),
                          "load_avg_after": os.getloadavg()})
    floor = lancedb_floor(ws, encoder, queries)
    for case in [*cases, floor]:
        print(f"{case['name']}: p50 {case['latency']['p50_ms']:.2f} ms, p99 {case['latency']['p99_ms']:.2f} ms "
              f"(CPU p50 {case['latency']['cpu_p50_ms']:.2f}, p99 {case['latency']['cpu_p99_ms']:.2f}), recall@10 {case['recall_at_10']:.3f} (load {case['load_avg_after'][0]:.1f})", flush=True)
    # the product's path (the resident index, else LanceDB's), then LanceDB's index; both unfiltered
    headline, lancedb_index = cases[4 if resident is not None else 2], cases[2]
    bulk = bulk_queries(store, encoder, settings, windows)
    return {
        "segments": segments, "k": K, "top_up_s": top_up_s, "compact_s": compact_s, "index_build_s": index_build_s,
        "index_built_by": "ingest (ensure_index)" if built_by_ingest else "this benchmark (rebuild_index), for LanceDB's row",
        "load_avg_before_build": load_before_build, "upkeep_s": upkeep_s,
        "index": {**asdict(plan), "type": plan.kind, "search": asdict(params)},
        "resident": resident_info, "product_path": headline["name"],
        "p50_ms": headline["latency"]["p50_ms"], "p99_ms": headline["latency"]["p99_ms"],
        "recall_at_10": headline["recall_at_10"],
        "lancedb_index": {"p50_ms": lancedb_index["latency"]["p50_ms"], "p99_ms": lancedb_index["latency"]["p99_ms"],
                          "recall_at_10": lancedb_index["recall_at_10"]},
        "lancedb_floor": floor,
        "cases": cases,
        "bulk": bulk,
    }


def lancedb_floor(ws: Workspace, encoder, queries: np.ndarray) -> dict:
    """LanceDB's own per-query cost with nothing to search: the same queries through
    ``SegmentStore.search`` (resident index off) on a ~100-row table, flat."""
    with tempfile.TemporaryDirectory() as folder:
        cfg = ws.settings.store.model_copy(update={"resident_index": False})
        tiny = SegmentStore.open(Path(folder) / "segments", cfg, encoder.dim)
        tiny.upsert(synthetic_episodes(20_000_003, 9, ws.obs_dim, ws.act_dim), encoder, snapshot="bench-floor")
        seconds, cpu_seconds, _ = time_queries(tiny, queries, exact=False, success=None)
        return {"name": f"LanceDB floor: {tiny.count()}-row table, flat", "rows": tiny.count(),
                "latency": asdict(latency(seconds, cpu_seconds)), "recall_at_10": 1.0, "load_avg_after": os.getloadavg()}


def bulk_queries(store: SegmentStore, encoder, settings: Settings, windows: np.ndarray) -> dict:
    """FERT's shape of search: ``fert.max_queries`` failure windows at once, k = ``fert.top_k``,
    success filter. The product path (``store.search``: one exact streaming pass) side by side with
    LanceDB's own search of the same query list, through the index and flat, in its bounded
    batches (``store.search_batch_queries``); all three in one run."""
    n = min(settings.fert.max_queries, len(windows))
    queries = encoder.encode(windows[np.random.default_rng(2).choice(len(windows), n, replace=False)])
    k, filters = settings.fert.top_k, store._filters(True, None, None, ())
    batch = settings.store.search_batch_queries

    def lancedb(exact: bool) -> tuple[float | None, np.ndarray | None, str | None]:
        """LanceDB's search of the list: (seconds, ids, None), or (None, None, its error): a
        baseline that fails is a figure too (at 2.4M rows its flat search ran out of file handles)."""
        t0 = time.perf_counter()
        try:
            parts = [store._search_batch(queries[i : i + batch], k, filters, exact, store.version)
                     for i in range(0, n, batch)]
        except (RuntimeError, OSError) as exc:
            return None, None, f"{type(exc).__name__}: {str(exc).splitlines()[0][:200]}"
        return time.perf_counter() - t0, np.concatenate([p.segment_ids for p in parts]), None

    t0 = time.perf_counter()
    scan = store.search(queries, k=k, success=True)
    scan_s = time.perf_counter() - t0
    flat_s, flat_ids, flat_error = lancedb(exact=True)
    index_s, index_ids, index_error = lancedb(exact=False)
    out = {"queries": n, "k": k, "scan_s": scan_s, "lancedb_flat_s": flat_s, "lancedb_index_s": index_s,
           "speedup_vs_lancedb_flat": flat_s / scan_s if flat_s else None,
           "speedup_vs_lancedb_index": index_s / scan_s if index_s else None,
           "scan_recall_vs_lancedb_flat": recall(scan.segment_ids, flat_ids) if flat_ids is not None else None,
           "lancedb_index_recall_vs_scan": recall(index_ids, scan.segment_ids) if index_ids is not None else None,
           "lancedb_flat_error": flat_error, "lancedb_index_error": index_error}

    def shown(seconds: float | None, error: str | None) -> str:
        return f"{seconds:.1f} s" if seconds is not None else f"failed ({error})"

    print(f"bulk ({n} queries, k={k}, success filter): scan {scan_s:.1f} s, LanceDB flat {shown(flat_s, flat_error)}, "
          f"LanceDB index {shown(index_s, index_error)}", flush=True)
    return out


def size_label(n: int) -> str:
    """The store size a kNN result is filed under: 1,000,008 segments -> "1M", 2,400,000 -> "2.4M"."""
    return f"{n / 1_000_000:.3g}M" if n >= 1_000_000 else f"{n / 1000:.3g}k"


def run(scale: Scale, workdir: Path) -> dict:
    load_start = os.getloadavg()
    settings = load_settings(root=workdir / "root")
    if scale.retain_days is not None:  # both retentions for readers of older state: store versions, merged-away data files
        store = settings.store.model_copy(update={"retain_versions_days": scale.retain_days})
        episodes = settings.episodes.model_copy(update={"superseded_retain_hours": scale.retain_days * 24})
        settings = settings.model_copy(update={"store": store, "episodes": episodes})
    result = {
        "benchmark": NAME,
        "scale": asdict(scale),
        "machine": {"cpus": os.cpu_count(), "python": platform.python_version(), "load_avg_start": load_start},
        "store_config": settings.store.model_dump(),
    }
    if scale.knn_only:
        result.update(seed_store(scale, settings, workdir / "incoming"))
    else:
        result.update(grow(scale, settings, workdir / "incoming"))
    found = knn(scale, settings)  # at --knn-segments, or at the grown store's size when that is larger
    result["knn"] = {size_label(found["segments"]): found}
    result["machine"]["load_avg_end"] = os.getloadavg()
    return result


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    if "growth" not in result:
        plot_knn(result, path, plt)
        return
    curve = result["growth"]["curve"]
    stored = np.array([r["stored_frames"] for r in curve]) / 1e6
    fig, (time_ax, rate_ax, disk_ax) = plt.subplots(1, 3, figsize=(16, 4.6))
    time_ax.plot(stored, [r["seconds"] for r in curve], ".", ms=3)
    for up in result["growth"]["upkeep"]:
        time_ax.axvline(up["stored_frames"] / 1e6, color="#dddddd", lw=0.8, zorder=0)
    fit = result["growth"].get("fit")
    if fit:
        ends = np.array([stored[1], stored[-1]])
        time_ax.plot(ends, fit["intercept_s"] + fit["slope_ms_per_million_frames"] / 1e3 * ends, "-", color="#c44e52",
                     label=f"Theil-Sen: +{fit['slope_ms_per_million_frames']:.1f} ms per M frames, "
                           f"last/first {fit['fitted_last_over_first']:.2f}x")
        time_ax.legend(fontsize=8, loc="upper right")
    time_ax.set(xlabel="stored frames (M)", ylabel="seconds per batch",
                title=f"ingest_files, {result['growth']['batch_frames']:,}-frame batches (grey: upkeep)")
    time_ax.set_ylim(bottom=0, top=min(time_ax.get_ylim()[1], 8 * result["growth"]["median_batch_s"]))
    rate_ax.plot(stored, [r["frames_per_s"] for r in curve], ".", ms=3, color="#55a868")
    rate_ax.set(xlabel="stored frames (M)", ylabel="frames / s", title="end-to-end throughput per batch")
    rate_ax.set_ylim(bottom=0)
    disk_ax.plot(stored, [r["disk_bytes"] / r["stored_frames"] for r in curve], ".", ms=3, color="#8172b2",
                 label="before upkeep")
    ups = result["growth"]["upkeep"]
    if ups:
        disk_ax.plot([u["stored_frames"] / 1e6 for u in ups], [u["disk_bytes_after"] / u["stored_frames"] for u in ups],
                     "o", color="#c44e52", label="after upkeep")
    disk_ax.set(xlabel="stored frames (M)", ylabel="disk bytes per stored frame",
                title="dataset + DVC cache + segment store")
    disk_ax.set_ylim(bottom=0)
    disk_ax.legend()
    (label, knn_result), = result["knn"].items()
    fig.suptitle(f"kNN at {knn_result['segments']:,} segments (store.search, one query): p50 {knn_result['p50_ms']:.1f} ms, "
                 f"p99 {knn_result['p99_ms']:.1f} ms, recall@10 {knn_result['recall_at_10']:.3f} "
                 f"({result['machine']['cpus']} shared cores)", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_knn(result: dict, path: Path, plt) -> None:
    """``--knn-only``: p50 and p99 per case (log scale), recall in the labels."""
    (label, knn_result), = result["knn"].items()
    cases = knn_result["cases"] + ([knn_result["lancedb_floor"]] if "lancedb_floor" in knn_result else [])
    fig, ax = plt.subplots(figsize=(10, 1.0 + 0.55 * len(cases)))
    y = np.arange(len(cases))
    ax.barh(y + 0.2, [c["latency"]["p50_ms"] for c in cases], 0.4, label="p50", color="#4c72b0")
    ax.barh(y - 0.2, [c["latency"]["p99_ms"] for c in cases], 0.4, label="p99", color="#c44e52")
    ax.set_yticks(y, [f"{c['name']}\nrecall@10 {c['recall_at_10']:.3f}" for c in cases], fontsize=8)
    ax.axvline(5, color="#888888", ls="--", lw=0.8, label="target p99 5 ms")
    ax.set(xscale="log", xlabel="ms per single query (k=10)")
    ax.invert_yaxis()
    ax.legend(loc="lower right")
    load = result["machine"]["load_avg_start"][0], result["machine"]["load_avg_end"][0]
    ax.set_title(f"kNN at {knn_result['segments']:,} segments, index built in {knn_result['index_build_s']:.0f} s "
                 f"({result['machine']['cpus']} shared cores, 1-min load {load[0]:.1f} -> {load[1]:.1f})", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="200k frames, kNN at 100k segments")
    parser.add_argument("--frames", type=int, default=None, help="frames to grow through ingest_files")
    parser.add_argument("--batch-frames", type=int, default=None, help="frames per ingest batch")
    parser.add_argument("--knn-segments", type=int, default=None, help="store size for the kNN phase")
    parser.add_argument("--upkeep-every", type=int, default=None, help="batches between store upkeeps")
    parser.add_argument("--retain-days", type=float, default=None,
                        help="store.retain_versions_days (and episodes.superseded_retain_hours, in days) for the "
                        "scratch root (0 shows disk after pruning)")
    parser.add_argument("--knn-only", action="store_true",
                        help="skip the growth curve: one ingest batch fits the encoder, then SegmentStore.upsert "
                             "tops the store up to --knn-segments (minutes instead of ~20 min at 1M)")
    parser.add_argument("--queries", type=int, default=None, help="single queries timed per kNN case")
    parser.add_argument("--workdir", type=Path, default=None, help="scratch dir (default: a temp dir)")
    parser.add_argument("--out", type=Path, default=RESULTS)
    parser.add_argument("--name", default=NAME, help="results file name (NAME.json, NAME.png)")
    parser.add_argument("--refit", action="store_true",
                        help="no run: add growth.fit to OUT/NAME.json from its curve and redraw NAME.png")
    args = parser.parse_args()
    if args.refit:
        refit(args.out / f"{args.name}.json")
        return
    base = QUICK if args.quick else FULL
    overrides = {"frames": args.frames, "batch_frames": args.batch_frames, "knn_segments": args.knn_segments,
                 "upkeep_every": args.upkeep_every, "retain_days": args.retain_days,
                 "knn_only": args.knn_only or None, "queries": args.queries}
    scale = Scale(**{**asdict(base), **{k: v for k, v in overrides.items() if v is not None}})
    workdir = Path(tempfile.mkdtemp(prefix="bench-ingest-")) if args.workdir is None else args.workdir
    workdir.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    try:
        result = run(scale, workdir)
    finally:
        if args.workdir is None:
            shutil.rmtree(workdir, ignore_errors=True)
    result["wall_s"] = time.perf_counter() - started
    overrides = "".join(f"{k}={v} " for k, v in sorted(os.environ.items()) if k.startswith("FLEETLOOP_"))
    result["command"] = overrides + "python -m benchmarks.ingest " + " ".join(
        f"--{k.replace('_', '-')}" + ("" if v is True else f" {v}")
        for k, v in asdict(scale).items()
        if v is not None and v is not False and not (scale.knn_only and k in ("frames", "upkeep_every"))
    )
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"{args.name}.json").write_text(json.dumps(result, indent=2) + "\n")
    plot(result, args.out / f"{args.name}.png")
    print(f"wrote {args.out / args.name}.json and .png in {result['wall_s']:.0f}s")


if __name__ == "__main__":
    main()
