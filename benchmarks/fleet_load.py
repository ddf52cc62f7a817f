"""Inference service under a fleet's load: dynamic batching vs batch size 1, side by side.

96 simulated robots (one sim env each, closed loop: observe -> POST /v1/act -> step) run against
the real inference service process (loopback HTTP, per-robot tokens, MLflow-registered MLP
champion), once with dynamic batching (``batch_window_ms``, ``max_batch`` = fleet size) and once
with ``max_batch = 1``. Reports throughput (actions/s) and p50/p99 request latency, the mean
batch the service formed, and the ratios.

    python -m benchmarks.fleet_load            # 96 robots, 15 s per mode
    python -m benchmarks.fleet_load --quick    # 16 robots, 3 s per mode (smoke)

Writes benchmarks/results/fleet_load.json and fleet_load.png. The client and the service share
this machine's cores, so absolute numbers are this machine's; the ratio is the point.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import tempfile
import time
from pathlib import Path

import httpx
import numpy as np

from components.config import FleetConfig, Settings, SimConfig
from components.fleet.auth import issue_tokens
from components.fleet.layout import RuntimeLayout
from components.fleet.local import register_policy, running_service, service_url, with_free_ports

RESULTS = Path(__file__).resolve().parent / "results"
NAME = "fleet_load"
WARMUP_S = 2.0


class _KeepAliveClient:
    """A minimal HTTP/1.1 keep-alive client on asyncio streams.

    httpx costs ~1-2 ms of client CPU per request; with 96 robots in one process that, not the
    service, was the bottleneck. Real robots are separate machines, so the load generator must
    be cheap: one pre-built header block, one socket per robot.
    """

    def __init__(self, host: str, port: int, token: str) -> None:
        self.host, self.port = host, port
        self.head = (
            f"POST /v1/act HTTP/1.1\r\nHost: {host}\r\nAuthorization: Bearer {token}\r\n"
            "Content-Type: application/json\r\nContent-Length: "
        ).encode()
        self.reader: asyncio.StreamReader | None = None
        self.writer: asyncio.StreamWriter | None = None

    async def act(self, obs: list[float]) -> dict:
        if self.writer is None:
            self.reader, self.writer = await asyncio.open_connection(self.host, self.port)
        body = json.dumps({"obs": obs}).encode()
        self.writer.write(self.head + str(len(body)).encode() + b"\r\n\r\n" + body)
        assert self.reader is not None
        header = await self.reader.readuntil(b"\r\n\r\n")
        status = int(header.split(b" ", 2)[1])
        length = 0
        for line in header.split(b"\r\n"):
            if line.lower().startswith(b"content-length:"):
                length = int(line.split(b":", 1)[1])
        payload = await self.reader.readexactly(length)
        if status != 200:
            raise RuntimeError(f"HTTP {status}: {payload[:200]!r}")
        return json.loads(payload)

    async def close(self) -> None:
        if self.writer is not None:
            self.writer.close()


async def _robot(robot_id: str, token: str, url: str, sim: SimConfig, seed: int, until: float, warm_until: float, out: list[float]) -> int:
    from components.sim.factory import make_env

    env = make_env(sim, [robot_id], seed)
    obs, _ = env.reset()
    host, port = url.removeprefix("http://").split(":")
    client = _KeepAliveClient(host, int(port), token)
    done = 0
    try:
        while time.perf_counter() < until:
            start = time.perf_counter()
            body = await client.act(obs[0].tolist())
            latency = time.perf_counter() - start
            action = np.asarray(body["action"], dtype=np.float32)[None, :]
            obs, *_ = env.step(np.clip(action, -1.0, 1.0))
            if start >= warm_until:
                out.append(latency)
                done += 1
    finally:
        await client.close()
    return done


async def _load(settings: Settings, tokens: dict[str, str], robots: list[str], seconds: float) -> dict:
    url = service_url(settings, "inference")
    latencies: list[float] = []
    warm_until = time.perf_counter() + WARMUP_S
    until = warm_until + seconds
    counts = await asyncio.gather(
        *(_robot(r, tokens[r], url, settings.sim, i, until, warm_until, latencies) for i, r in enumerate(robots))
    )
    lat_ms = np.asarray(latencies) * 1000.0
    return {
        "requests": int(sum(counts)),
        "throughput_per_s": float(sum(counts) / seconds),
        "p50_ms": float(np.percentile(lat_ms, 50)),
        "p99_ms": float(np.percentile(lat_ms, 99)),
        "mean_ms": float(lat_ms.mean()),
    }


def _service_stats(settings: Settings, service_token: str) -> dict:
    response = httpx.get(f"{service_url(settings, 'inference')}/v1/stats", headers={"Authorization": f"Bearer {service_token}"})
    response.raise_for_status()
    return response.json()


def run(num_robots: int, seconds: float, window_ms: float, root: Path) -> dict:
    import torch

    from components.policy.factory import make_policy
    from components.registry.model_registry import PolicyRegistry

    base = Settings(root=root, device="cpu", fleet=FleetConfig(num_robots=num_robots))
    robots = base.fleet.robot_ids()
    layout = RuntimeLayout.of(base).ensure()
    book = issue_tokens(layout.token_file, robots)
    print(f"[fleet_load] registering an MLP champion in {root} ...", flush=True)
    torch.manual_seed(0)
    policy = make_policy(11, 3, base.policy)
    PolicyRegistry(base.paths.mlruns, base.registry).set_champion(register_policy(base, policy, run_name="fleet-load"))
    modes = {
        "dynamic_batching": {"batch_window_ms": window_ms, "max_batch": num_robots},
        "batch_size_1": {"batch_window_ms": 0.0, "max_batch": 1},
    }
    results: dict[str, dict] = {}
    for mode, runtime in modes.items():
        settings = with_free_ports(base, **runtime)
        print(f"[fleet_load] {mode}: starting the inference service ({runtime}) ...", flush=True)
        with running_service(settings, "inference"):
            print(f"[fleet_load] {mode}: {num_robots} robots for {seconds:.0f}s (+{WARMUP_S:.0f}s warm-up) ...", flush=True)
            load = asyncio.run(_load(settings, book.robots, robots, seconds))
            stats = _service_stats(settings, book.service)
        load["mean_batch"] = stats["mean_batch"]
        load["max_batch_seen"] = stats["max_batch_seen"]
        load["settings"] = runtime
        results[mode] = load
        print(
            f"[fleet_load] {mode}: {load['throughput_per_s']:.0f} actions/s, p50 {load['p50_ms']:.1f} ms, "
            f"p99 {load['p99_ms']:.1f} ms, mean batch {load['mean_batch']:.1f}",
            flush=True,
        )
    dyn, one = results["dynamic_batching"], results["batch_size_1"]
    return {
        "benchmark": NAME,
        "robots": num_robots,
        "seconds_per_mode": seconds,
        "policy": {"kind": base.policy.kind, "hidden": base.policy.hidden, "layers": base.policy.layers},
        "transport": "HTTP/1.1 keep-alive over loopback, JSON, one connection per robot, closed loop (observe, act, step)",
        "cpu_count": os.cpu_count(),
        "load_average_at_end": list(os.getloadavg()),
        "modes": results,
        "ratios": {
            "throughput_dynamic_over_batch1": dyn["throughput_per_s"] / one["throughput_per_s"],
            "p50_batch1_over_dynamic": one["p50_ms"] / dyn["p50_ms"],
            "p99_batch1_over_dynamic": one["p99_ms"] / dyn["p99_ms"],
        },
    }


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    modes = list(result["modes"])
    labels = [m.replace("_", " ") for m in modes]
    data = result["modes"]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 4))
    ax1.bar(labels, [data[m]["throughput_per_s"] for m in modes], color=["tab:blue", "tab:gray"])
    ax1.set_ylabel("actions / s")
    ax1.set_title(f"throughput, {result['robots']} robots (x{result['ratios']['throughput_dynamic_over_batch1']:.2f})")
    x = np.arange(len(modes))
    ax2.bar(x - 0.2, [data[m]["p50_ms"] for m in modes], 0.4, label="p50")
    ax2.bar(x + 0.2, [data[m]["p99_ms"] for m in modes], 0.4, label="p99")
    ax2.set_xticks(x, labels)
    ax2.set_ylabel("request latency (ms)")
    ax2.set_title("latency")
    ax2.legend()
    fig.suptitle("inference service: dynamic batching vs batch size 1 (loopback HTTP)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="16 robots, 3 s per mode")
    parser.add_argument("--robots", type=int, default=96)
    parser.add_argument("--seconds", type=float, default=15.0)
    parser.add_argument("--window-ms", type=float, default=2.0, help="dynamic batching window")
    args = parser.parse_args()
    robots, seconds = (16, 3.0) if args.quick else (args.robots, args.seconds)
    with tempfile.TemporaryDirectory(prefix="fleetloop-fleet-load-") as tmp:
        result = run(robots, seconds, args.window_ms, Path(tmp))
    RESULTS.mkdir(parents=True, exist_ok=True)
    suffix = "_quick" if args.quick else ""
    (RESULTS / f"{NAME}{suffix}.json").write_text(json.dumps(result, indent=2))
    plot(result, RESULTS / f"{NAME}{suffix}.png")
    print(json.dumps(result["ratios"], indent=2))
    print(f"[fleet_load] wrote {RESULTS / f'{NAME}{suffix}.json'} and .png")


if __name__ == "__main__":
    main()
