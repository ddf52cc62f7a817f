"""A vision champion under a fleet's camera traffic (issue 47): 96 robots x 10 Hz, two 64x64 cameras.

Every robot sends its state and both cameras' frames at ``hz`` through the real client
(``InferenceClient.act(state, images)``: camera_wire.py's binary body over httpx keep-alive), one
thread per robot, spread over separate worker processes as robots are separate machines; the
real inference service process (loopback HTTP, per-robot tokens, an MLflow-registered
``policy.kind: vision`` champion at the config's default size) batches them dynamically. Paced,
not closed-loop: a robot asks every 1 / hz s (a slow answer delays its next ask, never bunches
them). Reports p50/p99 latency, achieved requests/s against the offered rate, the batches the
service formed, the CPU each side used, and the wire format's size and decode cost against a JSON
list of the same numbers.

    python -m benchmarks.vision_inference               # 96 robots, 10 Hz, 64x64, 20 s
    python -m benchmarks.vision_inference --quick       # 16 robots, 5 s (smoke)

Writes benchmarks/results/vision_inference.json and .png (``_quick`` with ``--quick``). The
clients and the service share this machine's cores: on 2 cores the clients' own CPU is part of
what is measured (``cpu_cores`` says how much each side used).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import statistics
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

from benchmarks.fleet_load import RESULTS, WARMUP_S, _service_stats
from components.config import FleetConfig, PolicyConfig, Settings, SimConfig
from components.fleet.auth import issue_tokens
from components.fleet.camera_wire import decode_obs, encode_obs
from components.fleet.layout import RuntimeLayout
from components.fleet.local import register_policy, running_service, service_url, with_free_ports

NAME = "vision_inference"
VIEWS = ("scene", "gripper")
TARGET_P99_MS = 100.0  # the issue's target, clients on the same machine
TIMEOUT_S = 5.0


def _camera_settings(root: Path, robots: int, size: int, window_ms: float, runtime: dict | None = None) -> Settings:
    sim = SimConfig(cameras=VIEWS)
    sim = sim.model_copy(update={"camera": sim.camera.model_copy(update={"width": size, "height": size})})
    base = Settings(root=root, device="cpu", fleet=FleetConfig(num_robots=robots), sim=sim, policy=PolicyConfig(kind="vision"))
    return with_free_ports(base, batch_window_ms=window_ms, max_batch=robots, **(runtime or {}))


def _register_vision_champion(settings: Settings) -> tuple[dict, object]:
    import torch

    from components.policy.factory import make_policy
    from components.policy.observation import configured_layout
    from components.registry.model_registry import PolicyRegistry
    from components.sim.factory import action_dim, observation_dim

    torch.manual_seed(0)
    state_dim = observation_dim(settings.sim)
    layout = configured_layout(state_dim, settings.policy, settings.sim)
    policy = make_policy(state_dim, action_dim(settings.sim), settings.policy, layout)
    PolicyRegistry(settings.paths.mlruns, settings.registry).set_champion(register_policy(settings, policy, run_name=NAME))
    return {"state_dim": state_dim, "cameras": {c.key: [c.height, c.width] for c in layout.cameras}, "obs_dim": layout.dim,
            "parameters": sum(p.numel() for p in policy.parameters())}, policy


def forward_cost(policy, obs_dim: int, threads: int, batches: tuple[int, ...] = (1, 16, 48, 96), repeats: int = 5) -> dict:
    """ms of one forward pass per request at each batch size, on ``threads`` torch threads (the
    service's ``runtime.torch_threads``): the compute a request costs the service, HTTP aside."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        cost = {}
        for batch in batches:
            obs = torch.rand(batch, obs_dim) * 255
            with torch.no_grad():
                policy(obs)
                begin = time.perf_counter()
                for _ in range(repeats):
                    policy(obs)
            cost[str(batch)] = (time.perf_counter() - begin) / repeats / batch * 1000.0
        return cost
    finally:
        torch.set_num_threads(before)


def _robot(client, state_dim: int, cameras: dict, hz: float, phase: float, times: tuple[float, float, float],
           out: list[tuple[float, float]], errors: list[str], seed: int) -> None:
    """One robot: every 1 / hz s from ``start + phase``, its state and frames -> one action."""
    start, warm_until, until = times
    rng = np.random.default_rng(seed)
    images = {key: rng.integers(0, 256, (h, w, 3), dtype=np.uint8) for key, (h, w) in cameras.items()}
    due = start + phase
    while due < until:
        time.sleep(max(0.0, due - time.time()))
        sent = time.time()
        try:
            client.act(rng.normal(size=state_dim).astype(np.float32), images)
            if sent >= warm_until:
                out.append((sent, time.time() - sent))
        except Exception as exc:  # noqa: BLE001 - counted and reported, the robot keeps its pace
            errors.append(type(exc).__name__)
        due = max(due + 1.0 / hz, time.time())  # late: ask at once, never in a burst


def _worker(job: tuple, ready, go, start_at, results) -> None:
    """A process of robots, one thread each (the real client, as a robot runs it): connects every
    client with one request, says ready, and starts at the shared start time."""
    from components.fleet.clients import InferenceClient

    url, tokens, state_dim, cameras, hz, seconds, first = job
    clients = [InferenceClient(url, token, TIMEOUT_S) for token in tokens]
    probe = {key: np.zeros((h, w, 3), np.uint8) for key, (h, w) in cameras.items()}
    for client in clients:  # keep-alive connections open, the service warm
        client.act(np.zeros(state_dim, np.float32), probe)
    ready.put(first)
    go.wait()
    start = start_at.value
    times = (start, start + WARMUP_S, start + WARMUP_S + seconds)
    out: list[tuple[float, float]] = []
    errors: list[str] = []
    phases = np.random.default_rng(first).uniform(0, 1.0 / hz, len(tokens))
    cpu = time.process_time()
    threads = [threading.Thread(target=_robot, args=(c, state_dim, cameras, hz, float(p), times, out, errors, first + i))
               for i, (c, p) in enumerate(zip(clients, phases))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    for client in clients:
        client.close()
    results.put({"samples": out, "errors": errors, "cpu_s": time.process_time() - cpu})


def _drive(url: str, tokens: list[str], model: dict, hz: float, seconds: float, processes: int,
           service_cpu: Callable[[], float]) -> tuple[list[dict], float]:
    """Every worker process up and connected, then all start at once (a spawned process importing
    on a busy machine can take seconds: a fixed start time would cut into the measured window)."""
    ctx = multiprocessing.get_context("spawn")
    ready, results, go, start_at = ctx.Queue(), ctx.Queue(), ctx.Event(), ctx.Value("d", 0.0)
    shares = [share for share in np.array_split(np.arange(len(tokens)), processes) if len(share)]
    workers = [ctx.Process(target=_worker, args=((url, [tokens[i] for i in share], model["state_dim"], model["cameras"], hz,
                                                  seconds, int(share[0])), ready, go, start_at, results))
               for share in shares]
    for worker in workers:
        worker.start()
    for _ in workers:
        ready.get(timeout=300)
    start_at.value = time.time() + 0.2
    go.set()
    cpu = service_cpu()
    out = [results.get(timeout=WARMUP_S + seconds + 120) for _ in workers]
    cpu = service_cpu() - cpu  # the service's CPU seconds over the paced run
    for worker in workers:
        worker.join()
    return out, cpu


def wire_sizes(model: dict, repeats: int = 50) -> dict:
    """One camera request's body: camera_wire's binary vs a JSON list of the same packed numbers."""
    rng = np.random.default_rng(0)
    state = rng.normal(size=model["state_dim"]).astype(np.float32)
    images = {k: rng.integers(0, 256, (h, w, 3), dtype=np.uint8) for k, (h, w) in model["cameras"].items()}
    binary = encode_obs(state, images)
    packed = np.concatenate([state, *(v.reshape(-1).astype(np.float32) for v in images.values())])
    as_json = json.dumps({"obs": packed.tolist()}).encode()

    def per_call_us(fn) -> float:
        begin = time.perf_counter()
        for _ in range(repeats):
            fn()
        return (time.perf_counter() - begin) / repeats * 1e6

    return {"binary_bytes": len(binary), "json_bytes": len(as_json),
            "binary_decode_us": per_call_us(lambda: decode_obs(binary)),
            "json_decode_us": per_call_us(lambda: np.asarray(json.loads(as_json)["obs"], dtype=np.float32)),
            "binary_encode_us": per_call_us(lambda: encode_obs(state, images)),
            "json_encode_us": per_call_us(lambda: json.dumps({"obs": packed.tolist()}))}


def _summary(results: list[dict], robots: int, hz: float, seconds: float) -> dict:
    samples = sorted(s for r in results for s in r["samples"])
    lat_ms = np.asarray([latency for _, latency in samples]) * 1000.0
    errors = [e for r in results for e in r["errors"]]
    if not len(lat_ms):
        return {"requests": 0, "errors": len(errors), "error_kinds": sorted(set(errors))}
    return {
        "requests": len(lat_ms), "errors": len(errors), "error_kinds": sorted(set(errors)),
        "offered_per_s": robots * hz, "achieved_per_s": len(lat_ms) / seconds,
        "p50_ms": float(np.percentile(lat_ms, 50)), "p90_ms": float(np.percentile(lat_ms, 90)),
        "p99_ms": float(np.percentile(lat_ms, 99)), "max_ms": float(lat_ms.max()), "mean_ms": float(lat_ms.mean()),
        "late_fraction": float(np.mean(lat_ms > 1000.0 / hz)),  # answers slower than the control period
        "client_cpu_s": float(sum(r["cpu_s"] for r in results)),
        "latency_ms_sample": [round(float(x), 2) for x in lat_ms[:: max(1, len(lat_ms) // 2000)]],
    }


def measure_inference(robots: int = 96, hz: float = 10.0, seconds: float = 20.0, size: int = 64,
                      processes: int | None = None, window_ms: float = 2.0, runtime: dict | None = None) -> dict:
    """Start the real service with a vision champion and drive it as ``robots`` camera robots at ``hz``."""
    import psutil

    processes = processes or max(1, min(os.cpu_count() or 1, robots))
    with tempfile.TemporaryDirectory(prefix="fleetloop-vision-inference-") as tmp:
        settings = _camera_settings(Path(tmp), robots, size, window_ms, runtime)
        robot_ids = settings.fleet.robot_ids()
        book = issue_tokens(RuntimeLayout.of(settings).ensure().token_file, robot_ids)
        print(f"[{NAME}] registering a vision champion ({size}x{size}, cameras {VIEWS}) ...", flush=True)
        model, policy = _register_vision_champion(settings)
        forward_ms = forward_cost(policy, model["obs_dim"], settings.runtime.torch_threads or 1)
        with running_service(settings, "inference") as proc:
            service = psutil.Process(proc.pid)
            print(f"[{NAME}] {robots} robots x {hz:g} Hz for {seconds:g}s (+{WARMUP_S:g}s warm-up), "
                  f"{processes} client processes ...", flush=True)
            results, service_cpu_s = _drive(service_url(settings, "inference"), [book.robots[r] for r in robot_ids], model,
                                            hz, seconds, processes, lambda: sum(service.cpu_times()[:2]))
            stats = _service_stats(settings, book.service)
    load = _summary(results, robots, hz, seconds)
    window_s = seconds + WARMUP_S  # the clients' paced run (their start-up CPU is not in client_cpu_s)
    return {
        "benchmark": NAME, "robots": robots, "hz": hz, "seconds": seconds, "size": size, "cameras": list(VIEWS),
        "client_processes": processes, "batch_window_ms": window_ms,
        "service_stack": {k: getattr(settings.runtime, k) for k in ("event_loop", "http_parser", "gc_freeze")},
        "model": model,
        "transport": "HTTP/1.1 keep-alive over loopback, camera_wire binary body, httpx InferenceClient per robot, "
                     "one thread per robot in separate processes, paced at hz",
        **load,
        "target_p99_ms": TARGET_P99_MS, "meets_target": bool(load.get("p99_ms", float("inf")) <= TARGET_P99_MS),
        "cpu_cores": {"service": service_cpu_s / window_s, "clients": load.get("client_cpu_s", 0.0) / window_s,
                      "machine": os.cpu_count()},
        "batches": {"mean": stats["mean_batch"], "max": stats["max_batch_seen"], "sizes": stats["batch_sizes"]},
        # the service's own view of the tail (components/fleet/loop_health.py): loop stalls, GC, forward passes
        "service_side": {k: stats[k] for k in ("loop_lag", "gc_pauses", "forward")},
        "wire": wire_sizes(model),
        "forward_ms_per_request": forward_ms,  # by batch size, one process, no HTTP
        "load_average_at_end": list(os.getloadavg()),
    }


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2, ax3) = plt.subplots(1, 3, figsize=(15, 4))
    lat = np.sort(np.asarray(result.get("latency_ms_sample", [])))
    if len(lat):
        ax1.plot(lat, np.arange(1, len(lat) + 1) / len(lat))
    ax1.axvline(result["target_p99_ms"], color="tab:red", linestyle="--", label=f"target p99 {result['target_p99_ms']:g} ms")
    ax1.axhline(0.99, color="gray", linewidth=0.5)
    ax1.set_xscale("log")
    ax1.set_xlabel("request latency (ms)")
    ax1.set_ylabel("fraction of requests")
    ax1.set_title(f"p50 {result.get('p50_ms', float('nan')):.1f} ms, p99 {result.get('p99_ms', float('nan')):.1f} ms")
    ax1.legend()
    sizes = {int(k): v for k, v in result["batches"]["sizes"].items()}
    ax2.bar(list(sizes), list(sizes.values()), width=0.8)
    ax2.set_xlabel("batch size")
    ax2.set_ylabel("batches")
    ax2.set_title(f"batches (mean {result['batches']['mean'] or 0:.1f}); "
                  f"{result.get('achieved_per_s', 0):.0f} of {result['robots'] * result['hz']:.0f} req/s")
    runs = sorted([result, *result.get("sweep", [])], key=lambda r: r["robots"])
    fleet = [r["robots"] for r in runs]
    ax3.plot(fleet, [r.get("p50_ms", np.nan) for r in runs], "o-", label="p50")
    ax3.plot(fleet, [r.get("p99_ms", np.nan) for r in runs], "o-", label="p99")
    ax3.axhline(result["target_p99_ms"], color="tab:red", linestyle="--", label="target p99")
    ax3.set_xlabel(f"robots at {result['hz']:g} Hz")
    ax3.set_ylabel("latency (ms)")
    ax3.set_yscale("log")
    ax3.set_title("latency by fleet size")
    ax3.legend()
    fig.suptitle(f"vision inference: {result['robots']} robots x {result['hz']:g} Hz, two {result['size']}x{result['size']} "
                 f"cameras, {result['cpu_cores']['machine']} cores shared with the clients")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


# --ab: each change to the serving stack against what it replaced, alternating runs side by side
AB = {
    "gc_freeze": {"off": {"gc_freeze": False}, "on": {"gc_freeze": True}},
    "stack": {"asyncio+h11": {"event_loop": "asyncio", "http_parser": "h11"},
              "uvloop+httptools": {"event_loop": "uvloop", "http_parser": "httptools"}},
}


def ab_runs(name: str, pairs: int, robots: int, hz: float, seconds: float, size: int, processes: int | None,
            window_ms: float) -> dict:
    """``pairs`` x (variant A, then B) of ``AB[name]``, alternating so load drifts hit both: per run
    p50/p99 and the service's longest GC pause and busy loop time; medians, and the p99 ratio A / B per pair."""
    keep = ("p50_ms", "p99_ms", "late_fraction", "achieved_per_s")
    runs: dict[str, list[dict]] = {label: [] for label in AB[name]}
    for pair in range(pairs):
        for label, runtime in AB[name].items():
            print(f"[{NAME}] {name}: {label}, pair {pair + 1} of {pairs}", flush=True)
            run = measure_inference(robots, hz, seconds, size, processes, window_ms, runtime=runtime)
            side = run["service_side"]
            runs[label].append({**{k: run[k] for k in keep}, "service_cores": run["cpu_cores"]["service"],
                                "gc_max_ms": side["gc_pauses"]["max_ms"], "loop_lag_total_ms": side["loop_lag"]["total_ms"]})
    a, b = AB[name]
    medians = {label: {k: statistics.median(r[k] for r in rs) for k in rs[0]} for label, rs in runs.items()}
    ratios = [x["p99_ms"] / y["p99_ms"] for x, y in zip(runs[a], runs[b], strict=True)]
    return {"variants": AB[name], "pairs": pairs, "runs": runs, "medians": medians,
            f"p99_{a}_over_{b}_per_pair": ratios, f"p99_{a}_over_{b}_median": statistics.median(ratios)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="16 robots, 5 s")
    parser.add_argument("--robots", type=int, default=96)
    parser.add_argument("--hz", type=float, default=10.0)
    parser.add_argument("--seconds", type=float, default=20.0)
    parser.add_argument("--size", type=int, default=64, help="camera width and height")
    parser.add_argument("--processes", type=int, default=None, help="client processes (default: the CPU count)")
    parser.add_argument("--window-ms", type=float, default=2.0, help="dynamic batching window")
    parser.add_argument("--sweep", default="", help="also these fleet sizes, e.g. 24,48 (where p99 crosses the target)")
    parser.add_argument("--ab", choices=sorted(AB), nargs="*", default=[],
                        help="also these serving-stack comparisons, --pairs alternating runs each (AB)")
    parser.add_argument("--pairs", type=int, default=3)
    args = parser.parse_args()
    robots, seconds = (16, 5.0) if args.quick else (args.robots, args.seconds)
    result = measure_inference(robots, args.hz, seconds, args.size, args.processes, args.window_ms)
    sweep = [measure_inference(int(n), args.hz, seconds, args.size, args.processes, args.window_ms)
             for n in args.sweep.split(",") if n.strip()]
    summary = ("robots", "achieved_per_s", "p50_ms", "p99_ms", "errors", "late_fraction", "cpu_cores", "batches")
    result["sweep"] = [{k: run.get(k) for k in summary} for run in sweep]
    result["ab"] = {name: ab_runs(name, args.pairs, robots, args.hz, seconds, args.size, args.processes, args.window_ms)
                    for name in args.ab}
    RESULTS.mkdir(parents=True, exist_ok=True)
    suffix = "_quick" if args.quick else ""
    (RESULTS / f"{NAME}{suffix}.json").write_text(json.dumps(result, indent=2))
    plot(result, RESULTS / f"{NAME}{suffix}.png")
    keys = ("achieved_per_s", "offered_per_s", "p50_ms", "p99_ms", "errors", "late_fraction", "cpu_cores", "wire",
            "forward_ms_per_request", "sweep")
    print(json.dumps({k: result.get(k) for k in keys}, indent=2))
    print(f"[{NAME}] wrote {RESULTS / f'{NAME}{suffix}.json'} and .png")


if __name__ == "__main__":
    main()
