"""Cameras in the loop, first part (issue 47): render, store and decode camera streams on 2 cores.

    python -m benchmarks.vision            # 16 robots x 4 episodes a sim, 5 repeats
    python -m benchmarks.vision --quick    # 4 robots x 2 episodes, 3 repeats (a minute)

Measured side by side in one run, repeats interleaved, medians quoted:

* **render**: ms per camera frame of the built-in sims (pick-place, pack; scene + gripper views at
  ``sim.camera`` size) = (step time with cameras - without) / frames rendered, and Meta-World's
  MuJoCo offscreen render where it is installed (a few steps: it is slow in software GL);
* **ingest**: ``EpisodeDataset.add_episodes`` of the same camera episodes with the video encoded
  inline vs in a background thread joined before the commit (``episodes.video.encode``), and the
  same episodes without cameras (the hot path's floor if encoding left it altogether), frames/s;
* **encode**: one camera's streams of the batch encoded in the calling thread vs through the child
  encoder process every store encode goes through (``episodes/encoder_process.py``: a deadline,
  because SVT-AV1 can deadlock); the ingest's ``cpu_over_wall`` counts this process only, so the
  child's encoding no longer shows there;
* **bytes on disk per 1k frames**: the stored mp4s vs the raw uint8 arrays;
* **decode**: frames/s of our reader (``EpisodeDataset.camera_frames``: by timestamp, LeRobot's
  tolerance rule) vs PyAV reading the same files straight through; torchcodec where it loads
  beside this torch (its PyPI wheel is a CUDA build: the reason is recorded when it does not).

Writes benchmarks/results/vision.json and .png (``--name`` for another name).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import statistics
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import av
import numpy as np

from components.config import EpisodesConfig, SimConfig, VideoConfig, load_settings
from components.episodes.dataset import EpisodeDataset
from components.episodes.encoder_process import encode_episodes
from components.episodes.record import Episode, camera_key
from components.episodes.video import encode_here
from components.sim.collect import run_episodes
from components.sim.factory import make_env, make_expert

RESULTS = Path(__file__).resolve().parent / "results"
NAME = "vision"
VIEWS = ("scene", "gripper")


@dataclass(frozen=True)
class Plan:
    robots: int
    episodes_per_robot: int
    repeats: int
    render_steps: int
    metaworld_steps: int
    seed: int = 47


FULL = Plan(robots=16, episodes_per_robot=4, repeats=5, render_steps=60, metaworld_steps=6)
QUICK = Plan(robots=4, episodes_per_robot=2, repeats=3, render_steps=20, metaworld_steps=3)


def _median(values: list[float]) -> float:
    return float(statistics.median(values))


def _sim(base: SimConfig, name: str, cameras: tuple[str, ...]) -> SimConfig:
    task = {"pickplace": "pick-place", "pack": "pack", "metaworld": "pick-place-v3"}[name]
    return base.model_copy(update={"name": name, "task": task, "cameras": cameras})


def _step_seconds(cfg: SimConfig, robots: list[str], steps: int, seed: int) -> float:
    """Seconds per fleet step under the scripted expert (reset excluded)."""
    env = make_env(cfg, robots, seed)
    expert = make_expert(cfg)
    obs, _ = env.reset()
    start = time.perf_counter()
    for _ in range(steps):
        state = obs["state"] if isinstance(obs, dict) else obs
        obs, *_ = env.step(expert(state))
    seconds = (time.perf_counter() - start) / steps
    env.close()
    return seconds


def measure_render(base: SimConfig, plan: Plan) -> dict:
    """ms per rendered frame, from the step time with and without cameras, interleaved."""
    robots = [f"robot-{i:04d}" for i in range(plan.robots)]
    out = {}
    for name in ("pickplace", "pack"):
        on, off = [], []
        for _ in range(plan.repeats):
            off.append(_step_seconds(_sim(base, name, ()), robots, plan.render_steps, plan.seed))
            on.append(_step_seconds(_sim(base, name, VIEWS), robots, plan.render_steps, plan.seed))
        frames = len(robots) * len(VIEWS)
        out[name] = {"step_ms_without": 1e3 * _median(off), "step_ms_with": 1e3 * _median(on),
                     "render_ms_per_frame": 1e3 * (_median(on) - _median(off)) / frames,
                     "robots": len(robots), "views": list(VIEWS)}
    out["metaworld"] = measure_metaworld_render(base, plan)
    return out


def measure_metaworld_render(base: SimConfig, plan: Plan) -> dict:
    os.environ.setdefault("MUJOCO_GL", base.camera.mujoco_gl)  # before MuJoCo is first imported
    try:
        import metaworld  # noqa: F401
    except ImportError as exc:
        return {"skipped": f"metaworld not installed ({exc})"}
    robots = ["robot-0000", "robot-0001"]
    try:
        on = [_step_seconds(_sim(base, "metaworld", VIEWS), robots, plan.metaworld_steps, plan.seed) for _ in range(2)]
        off = [_step_seconds(_sim(base, "metaworld", ()), robots, plan.metaworld_steps, plan.seed) for _ in range(2)]
    except (RuntimeError, OSError, ImportError, ValueError) as exc:  # no GL here: say why, keep the rest
        return {"skipped": f"{type(exc).__name__}: {exc}"}
    frames = len(robots) * len(VIEWS)
    return {"step_ms_without": 1e3 * _median(off), "step_ms_with": 1e3 * _median(on),
            "render_ms_per_frame": 1e3 * (_median(on) - _median(off)) / frames, "robots": len(robots),
            "views": list(VIEWS), "mujoco_gl": base.camera.mujoco_gl}


def collect_camera_episodes(base: SimConfig, plan: Plan) -> list[Episode]:
    cfg = _sim(base, "pickplace", VIEWS)
    robots = [f"robot-{i:04d}" for i in range(plan.robots)]
    return run_episodes(make_expert(cfg), robots, cfg, plan.episodes_per_robot, plan.seed, "expert")


def measure_ingest(episodes: list[Episode], episodes_cfg: EpisodesConfig, plan: Plan, workdir: Path) -> tuple[dict, Path]:
    """frames/s of add_episodes, inline vs background encoding vs no cameras, interleaved; the
    last background root is kept for the decode part."""
    frames = sum(e.length for e in episodes)
    plain = [dataclasses.replace(e, cameras={}) for e in episodes]
    modes = {"inline": (episodes, "inline"), "background": (episodes, "background"), "state_only": (plain, "inline")}
    seconds: dict[str, list[float]] = {m: [] for m in modes}
    cpu: dict[str, list[float]] = {m: [] for m in modes}  # process CPU seconds: the encoder's threads show here
    kept = workdir / "decode-root"
    EpisodeDataset(workdir / "warm-up", episodes_cfg).add_episodes(episodes[:2])  # untimed: the encoder's first start
    for repeat in range(plan.repeats):
        for mode, (batch, encode) in modes.items():
            root = workdir / f"{mode}-{repeat}"
            ds = EpisodeDataset(root, episodes_cfg.model_copy(update={"video": VideoConfig(encode=encode)}))
            start, cpu_start = time.perf_counter(), _cpu_seconds()
            ds.add_episodes(batch)
            seconds[mode].append(time.perf_counter() - start)
            cpu[mode].append(_cpu_seconds() - cpu_start)
            if mode == "background" and repeat == plan.repeats - 1:
                root.rename(kept)
    out = {m: {"seconds": _median(s), "frames_per_s": frames / _median(s), "cpu_over_wall": _median(cpu[m]) / _median(s),
               "all_seconds": s} for m, s in seconds.items()}
    out["frames"] = frames
    out["camera_frames"] = frames * len(episodes[0].cameras)
    out["background_over_inline"] = out["background"]["frames_per_s"] / out["inline"]["frames_per_s"]
    # what the hot path would cost with the encoding moved out of it altogether (committed before
    # the videos exist: not what the store does), and what the encoding itself costs
    out["encode_seconds"] = out["inline"]["seconds"] - out["state_only"]["seconds"]
    return out, kept


def measure_encode(episodes: list[Episode], episodes_cfg: EpisodesConfig, plan: Plan, workdir: Path) -> dict:
    """Seconds to encode one camera's streams of the batch (what one ingest file holds): in the
    calling thread (``video.encode_here``) vs through the child encoder process the store uses
    (``encoder_process.encode_episodes``: the deadline that a deadlocked SVT-AV1 needs), interleaved."""
    streams = [e.cameras[camera_key(VIEWS[0])] for e in episodes]
    ways = {"in_thread": encode_here, "child_process": encode_episodes}
    seconds: dict[str, list[float]] = {w: [] for w in ways}
    encode_episodes(workdir / "encode-warm-up.mp4", streams[:2], episodes_cfg.fps, episodes_cfg.video)  # the child's start
    for repeat in range(plan.repeats):
        for way, encode in ways.items():
            start = time.perf_counter()
            encode(workdir / f"encode-{way}-{repeat}.mp4", streams, episodes_cfg.fps, episodes_cfg.video)
            seconds[way].append(time.perf_counter() - start)
    out = {w: {"seconds": _median(s), "all_seconds": s} for w, s in seconds.items()}
    out["frames"] = sum(len(s) for s in streams)
    out["child_over_thread"] = out["child_process"]["seconds"] / out["in_thread"]["seconds"]
    return out


def _cpu_seconds() -> float:
    times = os.times()
    return times.user + times.system


def measure_bytes(root: Path, episodes: list[Episode]) -> dict:
    frames = sum(e.length for e in episodes)
    out = {}
    for key in episodes[0].cameras:
        video = sum(p.stat().st_size for p in (root / "videos" / key).rglob("*.mp4"))
        raw = sum(e.cameras[key].nbytes for e in episodes)
        out[key] = {"video_bytes_per_1k_frames": 1e3 * video / frames, "raw_bytes_per_1k_frames": 1e3 * raw / frames,
                    "raw_over_video": raw / video}
    return out


def _pyav_read_all(path: Path) -> int:
    with av.open(str(path)) as container:
        stream = container.streams.video[0]
        stream.thread_type = "AUTO"
        return sum(1 for frame in container.decode(stream) if frame.to_ndarray(format="rgb24") is not None)


# checked 2026-12-05: PyPI's torchcodec 0.17.0 declares no torch pin and installs beside torch 2.13.0+cpu,
# but its libraries link CUDA's libnvrtc.so.13 and fail to load here; the CPU build is on PyTorch's index
TORCHCODEC_NOTE = "torchcodec 0.17.0 (PyPI) is a CUDA build: OSError libnvrtc.so.13 beside torch 2.13.0+cpu"


def _torchcodec_reader() -> tuple[object | None, str]:
    try:
        from torchcodec.decoders import VideoDecoder
    except ModuleNotFoundError:
        return None, f"not installed ({TORCHCODEC_NOTE})"
    except (ImportError, OSError, RuntimeError) as exc:  # a wheel built for another torch / CUDA
        return None, f"{type(exc).__name__}: {str(exc).splitlines()[0][:200]}"
    return VideoDecoder, "ok"


def measure_decode(root: Path, plan: Plan) -> dict:
    ds = EpisodeDataset(root, load_settings().episodes)
    files = sorted(root.glob("videos/*/chunk-*/file-*.mp4"))
    decoder, torchcodec_status = _torchcodec_reader()
    seconds: dict[str, list[float]] = {"ours": [], "pyav": []}
    if decoder is not None:
        seconds["torchcodec"] = []
    counts: dict[str, int] = {}
    for _ in range(plan.repeats):
        start = time.perf_counter()
        counts["ours"] = sum(len(f) for i in range(ds.num_episodes) for f in ds.camera_frames(i).values())
        seconds["ours"].append(time.perf_counter() - start)
        start = time.perf_counter()
        counts["pyav"] = sum(_pyav_read_all(p) for p in files)
        seconds["pyav"].append(time.perf_counter() - start)
        if decoder is not None:
            start = time.perf_counter()
            counts["torchcodec"] = sum(len(decoder(str(p))[:]) for p in files)
            seconds["torchcodec"].append(time.perf_counter() - start)
    out = {name: {"frames": counts[name], "seconds": _median(s), "frames_per_s": counts[name] / _median(s)}
           for name, s in seconds.items()}
    out["torchcodec_status"] = torchcodec_status
    out["ours_over_pyav"] = out["ours"]["frames_per_s"] / out["pyav"]["frames_per_s"]
    return out


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 4, figsize=(17, 4))
    decode = {k: v["frames_per_s"] for k, v in result["decode"].items() if isinstance(v, dict)}
    axes[0].bar(list(decode), list(decode.values()), color="tab:blue")
    axes[0].set(title="decode (frames/s, median)", ylabel="frames/s")
    ingest = {k: result["ingest"][k]["frames_per_s"] for k in ("inline", "background", "state_only")}
    axes[1].bar(list(ingest), list(ingest.values()), color=["tab:orange", "tab:green", "tab:gray"])
    axes[1].set(title="ingest add_episodes (frames/s)")
    keys = list(result["bytes"])
    x = np.arange(len(keys))
    axes[2].bar(x - 0.2, [result["bytes"][k]["video_bytes_per_1k_frames"] for k in keys], 0.4, label="mp4 (AV1)")
    axes[2].bar(x + 0.2, [result["bytes"][k]["raw_bytes_per_1k_frames"] for k in keys], 0.4, label="raw uint8")
    axes[2].set(title="bytes on disk per 1k frames", yscale="log", xticks=x, xticklabels=[k.split(".")[-1] for k in keys])
    axes[2].legend()
    render = {k: v["render_ms_per_frame"] for k, v in result["render"].items() if "render_ms_per_frame" in v}
    axes[3].bar(list(render), list(render.values()), color="tab:purple")
    axes[3].set(title="render (ms/frame)", yscale="log")
    fig.suptitle(f"cameras on 2 cores: {result['plan']['robots']} robots, {result['camera']['width']}x"
                 f"{result['camera']['height']}, commit {result.get('commit', '?')}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--name", default=NAME)
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    plan = QUICK if args.quick else FULL
    settings = load_settings()
    began = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        episodes = collect_camera_episodes(settings.sim, plan)
        ingest, kept = measure_ingest(episodes, settings.episodes, plan, Path(tmp))
        result = {
            "plan": dataclasses.asdict(plan),
            "camera": settings.sim.camera.model_dump(),
            "video": settings.episodes.video.model_dump(),
            "episodes": len(episodes),
            "render": measure_render(settings.sim, plan),
            "ingest": ingest,
            "encode": measure_encode(episodes, settings.episodes, plan, Path(tmp)),
            "bytes": measure_bytes(kept, episodes),
            "decode": measure_decode(kept, plan),
        }
    result.update(machine=platform.processor() or platform.machine(), python=platform.python_version(),
                  pyav=av.__version__, wall_s=time.perf_counter() - began)
    try:
        import subprocess

        result["commit"] = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=False).stdout.strip()
    except OSError:
        pass
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"{args.name}.json").write_text(json.dumps(result, indent=1))
    plot(result, args.out / f"{args.name}.png")
    print(json.dumps({k: result[k] for k in ("render", "bytes")}, indent=1))
    print(json.dumps({k: {m: v for m, v in result[k].items() if m != "all_seconds"} if isinstance(result[k], dict) else result[k]
                      for k in ("ingest", "encode", "decode")}, indent=1, default=str))
    print(f"wrote {args.out / args.name}.json and .png in {result['wall_s']:.0f}s")


if __name__ == "__main__":
    main()
