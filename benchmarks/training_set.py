"""Building the train task's training set as the dataset grows: the streaming reader against every
episode decoded into memory first (the train task's reader before it).

    python -m benchmarks.training_set            # 100k, 300k and 1M stored frames
    python -m benchmarks.training_set --quick    # 20k and 60k frames (about a minute)

One scratch root grows through ``components.pipeline.ingest.ingest_files`` (benchmarks/ingest.py's
synthetic episodes: 50 frames each, 75% successes, the default simulator's widths; params.yaml's
settings). At each size every (method, reader) builds once in a fresh process, so that its peak
memory is its own:

    streamed   ``steps.method_training_set(settings, DatasetCorpus(ws.dataset), store, None)``:
               what the train task's ``steps.training_set`` hands it (fert/corpus.py: the
               successes' frames column-wise, only the queried failures whole)
    in_memory  ``steps.method_training_set(settings, list(ws.dataset.episodes()), store, None)``:
               every stored episode decoded first, as the train task did before and as a caller
               that already holds episodes still does
    (the champion lookup ``training_set`` adds is left out of both: no champion here, and its
    first call starts MLflow, which is neither reader's cost)

Methods: ``filtered_bc`` (reads every success) and ``fert`` (also calibrates and retrieves for every
failure: no champion in the scratch root). Reported per cell: the build's wall time, the process's
RSS just before the build (imports, workspace) and its peak RSS during the build (VmHWM, reset
before it), and a digest of the training set;
``identical`` says whether both readers built the same bits. Both readers run side by side in one
run, alternating which goes first per size.

Writes benchmarks/results/training_set[_quick].json + .png; keys ``sizes[i].frames``,
``sizes[i].<method>.<reader>.{seconds, peak_rss_mb, rss_before_mb}``, ``sizes[i].<method>.identical``.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from benchmarks.ingest import EPISODE_FRAMES, ingest_batch
from components.config import Settings, load_settings

RESULTS = Path(__file__).resolve().parent / "results"
FULL_SIZES = (100_000, 300_000, 1_000_000)
QUICK_SIZES = (20_000, 60_000)
BATCH_FRAMES = 10_000
METHODS = ("filtered_bc", "fert")
READERS = ("streamed", "in_memory")


def settings_for(root: Path, method: str | None = None) -> Settings:
    settings = load_settings(root=root)
    if method is None:
        return settings
    return settings.model_copy(update={"train": settings.train.model_copy(update={"method": method})})


def grow_to(settings: Settings, frames: int, stored: int, scratch: Path) -> int:
    """Ingest batches until ``frames`` are stored; returns the frames stored."""
    from components.pipeline.workspace import Workspace

    per_batch = BATCH_FRAMES // EPISODE_FRAMES
    while stored < frames:
        batch = stored // BATCH_FRAMES
        seconds = ingest_batch(settings, Workspace(settings), batch, per_batch, scratch)
        stored += per_batch * EPISODE_FRAMES
        print(f"  ingested batch {batch + 1}: {stored:,} frames stored ({seconds:.1f}s)", flush=True)
    return stored


def build_in_child(root: Path, method: str, reader: str) -> dict:
    """One build in a fresh interpreter (``--child``): its own peak RSS."""
    out = subprocess.run([sys.executable, "-m", "benchmarks.training_set", "--child", str(root), method, reader],
                         capture_output=True, text=True, check=False)
    if out.returncode != 0:
        raise RuntimeError(f"{method}/{reader} build failed:\n{out.stderr[-2000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def child(root: Path, method: str, reader: str) -> None:
    """Build and print one JSON line: seconds, RSS before, peak RSS, digest of the training set."""
    from components.fert.corpus import DatasetCorpus
    from components.pipeline import steps
    from components.pipeline.workspace import Workspace

    settings = settings_for(root, method)
    ws = Workspace(settings)
    store = ws.store if method in steps.RETRIEVAL_METHODS else None
    before = _status_mb("VmRSS")
    Path("/proc/self/clear_refs").write_text("5")  # the peak (VmHWM) restarts from here
    t0 = time.perf_counter()
    episodes = DatasetCorpus(ws.dataset) if reader == "streamed" else list(ws.dataset.episodes())
    built = steps.method_training_set(settings, episodes, store, None)
    seconds = time.perf_counter() - t0
    print(json.dumps({"seconds": seconds, "rss_before_mb": before, "peak_rss_mb": _status_mb("VmHWM"),
                      "frames": len(built.data.states), "digest": _digest(built.data)}))


def _status_mb(field: str) -> float:
    """VmRSS / VmHWM of this process in MB. Not getrusage's ru_maxrss: that one survives exec and
    starts at the RSS of the process that forked this one."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(f"{field}:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def _digest(data) -> str:
    sha = hashlib.sha256()
    for array in (data.states, data.actions, data.weights, data.frame_in_episode):
        if array is not None:
            sha.update(np.ascontiguousarray(array).tobytes())
    return sha.hexdigest()[:16]


def run(sizes: tuple[int, ...], workdir: Path) -> dict:
    settings = settings_for(workdir / "root")
    rows, stored = [], 0
    for i, frames in enumerate(sizes):
        print(f"growing to {frames:,} frames", flush=True)
        stored = grow_to(settings, frames, stored, workdir / "incoming")
        row: dict = {"frames": stored}
        for method in METHODS:
            order = READERS if i % 2 == 0 else READERS[::-1]
            cell = {reader: build_in_child(settings.root, method, reader) for reader in order}
            cell["identical"] = cell["streamed"]["digest"] == cell["in_memory"]["digest"]
            row[method] = cell
            s, m = cell["streamed"], cell["in_memory"]
            print(f"  {method}: streamed {s['seconds']:.2f}s peak {s['peak_rss_mb']:.0f} MB | in memory "
                  f"{m['seconds']:.2f}s peak {m['peak_rss_mb']:.0f} MB | identical {cell['identical']}", flush=True)
        rows.append(row)
    return {"sizes": rows}


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    frames = [row["frames"] for row in result["sizes"]]
    for method, marker in zip(METHODS, ("o", "s"), strict=True):
        for reader, style in zip(READERS, ("-", "--"), strict=True):
            cells = [row[method][reader] for row in result["sizes"]]
            label = f"{method}, {reader.replace('_', ' ')}"
            axes[0].plot(frames, [c["peak_rss_mb"] - c["rss_before_mb"] for c in cells], style, marker=marker, label=label)
            axes[1].plot(frames, [c["seconds"] for c in cells], style, marker=marker, label=label)
    axes[0].set_ylabel("memory the build adds (peak RSS - RSS before), MB")
    axes[1].set_ylabel("build time, s")
    for ax in axes:
        ax.set_xlabel("stored frames")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle("Training set of the train task: streamed from the dataset vs every episode in memory")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="20k and 60k frames")
    parser.add_argument("--child", nargs=3, metavar=("ROOT", "METHOD", "READER"), help=argparse.SUPPRESS)
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    if args.child:
        child(Path(args.child[0]), args.child[1], args.child[2])
        return
    name = "training_set_quick" if args.quick else "training_set"
    workdir = Path(tempfile.mkdtemp(prefix="bench-training-set-"))
    started = time.perf_counter()
    try:
        result = {"benchmark": "training_set", "machine": {"cpus": os.cpu_count(), "python": platform.python_version(),
                                                           "load_avg_start": os.getloadavg()}}
        result.update(run(QUICK_SIZES if args.quick else FULL_SIZES, workdir))
        result["machine"]["load_avg_end"] = os.getloadavg()
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    result["wall_s"] = time.perf_counter() - started
    result["command"] = "python -m benchmarks.training_set" + (" --quick" if args.quick else "")
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"{name}.json").write_text(json.dumps(result, indent=2) + "\n")
    plot(result, args.out / f"{name}.png")
    print(f"wrote {args.out / name}.json and .png in {result['wall_s']:.0f}s")


if __name__ == "__main__":
    main()
