"""The embed cursor's row count, side by side: one grown root, batches through ``ingest_files``
alternately with the segment store's ``episode_id`` lookup skipped (the product) and forced.

    python -m benchmarks.ingest_cursor --root W/root      # a root grown by benchmarks.ingest
    python -m benchmarks.ingest_cursor --quick            # grows a 500k-frame root first (minutes)

An upsert skips the lookup of its episodes while the table still has the rows the embed cursor
counted (``EmbedCursor.rows``); the lookup is a cold BTree query whose cost grows with the table.
Here both run on the same root, in one process, in alternating pairs (the order flipped every
pair), so the machine's drift cancels: "forced" is the product with ``_absent_at_rows`` returning
-1, i.e. the path before the cursor counted rows. The root first gets upkeep's recount
(``recount_embed_cursor``, timed): a root grown before this change has no row count. Each batch is
the growth benchmark's (``benchmarks.ingest.ingest_batch``: 200 × 50-frame episodes, DVC snapshot
included). Writes benchmarks/results/ingest_cursor.json + .png (``--name`` for another name).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from pathlib import Path

from benchmarks.ingest import EPISODE_FRAMES, RESULTS, ingest_batch
from components.config import load_settings
from components.pipeline import ingest
from components.pipeline.workspace import Workspace

NAME = "ingest_cursor"
BATCH_EPISODES = 200
SEED_OFFSET = 10_000_000  # batch seeds past any growth run's, so no episode repeats


def never_vouches(ws: Workspace, episode_ids: set[str]) -> int:
    """Stands in for ``ingest._absent_at_rows`` in "forced" batches: every upsert looks up."""
    return -1


def run_pairs(settings, pairs: int, scratch: Path) -> list[dict]:
    product = ingest._absent_at_rows
    rows = []
    try:
        for pair in range(pairs):
            order = ("cursor", "forced") if pair % 2 == 0 else ("forced", "cursor")
            for mode in order:
                ingest._absent_at_rows = never_vouches if mode == "forced" else product
                batch = SEED_OFFSET + len(rows)
                seconds = ingest_batch(settings, Workspace(settings), batch, BATCH_EPISODES, scratch)
                cursor = Workspace(settings).store.embed_cursor()
                rows.append({"pair": pair, "mode": mode, "seconds": seconds, "cursor_rows": cursor.rows})
            print(f"pair {pair + 1}/{pairs}: " + ", ".join(f"{r['mode']} {r['seconds']:.2f}s" for r in rows[-2:]),
                  flush=True)
    finally:
        ingest._absent_at_rows = product
    return rows


def summarize(rows: list[dict]) -> dict:
    by_mode = {m: [r["seconds"] for r in rows if r["mode"] == m] for m in ("cursor", "forced")}
    saved = [f["seconds"] - c["seconds"] for c, f in pairs_of(rows)]
    return {
        "cursor_median_s": statistics.median(by_mode["cursor"]),
        "forced_median_s": statistics.median(by_mode["forced"]),
        "paired_saving_median_s": statistics.median(saved),
        "forced_over_cursor": statistics.median(by_mode["forced"]) / statistics.median(by_mode["cursor"]),
        "pairs_cursor_faster": sum(s > 0 for s in saved),
        "pairs": len(saved),
    }


def pairs_of(rows: list[dict]) -> list[tuple[dict, dict]]:
    grouped: dict[int, dict[str, dict]] = {}
    for r in rows:
        grouped.setdefault(r["pair"], {})[r["mode"]] = r
    return [(g["cursor"], g["forced"]) for g in grouped.values() if len(g) == 2]


def grow_root(settings, frames: int, scratch: Path) -> None:
    batches = frames // (BATCH_EPISODES * EPISODE_FRAMES)
    for batch in range(batches):
        ingest_batch(settings, Workspace(settings), batch, BATCH_EPISODES, scratch)
        if batch % 10 == 0:
            print(f"growing: batch {batch + 1}/{batches}", flush=True)


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 3.5))
    for mode, color in (("cursor", "tab:blue"), ("forced", "tab:orange")):
        points = [(r["pair"], r["seconds"]) for r in result["batches"] if r["mode"] == mode]
        label = "lookup skipped (cursor rows)" if mode == "cursor" else "lookup forced (before)"
        ax.plot(*zip(*points, strict=True), "o-", color=color, label=label, ms=3)
    s = result["summary"]
    ax.set_title(f"{result['stored_frames']:,} frames stored: median {s['cursor_median_s']:.2f}s vs "
                 f"{s['forced_median_s']:.2f}s a batch (paired saving {s['paired_saving_median_s'] * 1000:.0f} ms)",
                 fontsize=9)
    ax.set_xlabel("pair (order flipped every pair)")
    ax.set_ylabel("seconds per 10k-frame batch")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--root", type=Path, default=None, help="a grown root (default: grow one in a temp dir)")
    parser.add_argument("--quick", action="store_true", help="without --root: grow 500k frames, 6 pairs")
    parser.add_argument("--frames", type=int, default=2_000_000, help="without --root: frames to grow first")
    parser.add_argument("--pairs", type=int, default=None, help="batch pairs (default 20; 6 with --quick)")
    parser.add_argument("--out", type=Path, default=RESULTS)
    parser.add_argument("--name", default=NAME)
    args = parser.parse_args()
    pairs = args.pairs or (6 if args.quick else 20)
    with tempfile.TemporaryDirectory(prefix="bench-cursor-") as tmp:
        root = args.root or Path(tmp) / "root"
        settings = load_settings(root=root)
        scratch = Path(tmp) / "incoming"
        if args.root is None:
            grow_root(settings, 500_000 if args.quick else args.frames, scratch)
        t0 = time.perf_counter()
        cursor = ingest.recount_embed_cursor(settings)
        recount_s = time.perf_counter() - t0
        if cursor is None or cursor.rows < 0:
            raise SystemExit(f"{root}: the segment store holds segments of episodes its dataset's embed cursor "
                             "does not cover (or has no cursor), so no row count can vouch for a batch; "
                             "use a root grown by benchmarks.ingest")
        ws = Workspace(settings)
        result = {
            "benchmark": NAME, "root": str(root), "cpus": os.cpu_count(), "load_avg_start": os.getloadavg(),
            "stored_frames": ws.dataset.num_frames, "segments": ws.store.count(),
            "recount": {"seconds": recount_s, "cursor_rows": cursor.rows},
        }
        result["batches"] = run_pairs(settings, pairs, scratch)
        result["summary"] = summarize(result["batches"])
        result["load_avg_end"] = os.getloadavg()
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"{args.name}.json").write_text(json.dumps(result, indent=1))
    plot(result, args.out / f"{args.name}.png")
    print(json.dumps(result["summary"], indent=1))


if __name__ == "__main__":
    main()
