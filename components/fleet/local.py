"""A fleet on this machine, for tests, benchmarks and the chaos run: free ports, process lifetimes,
and a registry seeded with a model so the inference service has something to serve.
"""

from __future__ import annotations

import socket
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager

from components.config import Settings
from components.fleet.clients import base_url
from components.fleet.layout import RuntimeLayout
from components.fleet.processes import ProcessSpec, start_process, stop_process, wait_healthy, write_settings

LOOPBACK = "127.0.0.1"
START_TIMEOUT_S = 120.0


def free_port(host: str = LOOPBACK) -> int:
    """A port nobody listens on right now (the OS picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


def with_free_ports(settings: Settings, **runtime: object) -> Settings:
    """``settings`` with loopback, fresh free ports for every service, and runtime overrides."""
    fields = settings.runtime.model_dump(exclude={"tokens"})
    fields.update(host=LOOPBACK, inference_port=free_port(), ingest_port=free_port(), coordinator_port=free_port())
    fields.update(runtime)
    return settings.model_copy(update={"runtime": type(settings.runtime)(**fields, tokens=settings.runtime.tokens)})


def service_url(settings: Settings, role: str) -> str:
    cfg = settings.runtime
    port = {"ingest": cfg.ingest_port, "inference": cfg.inference_port, "coordinator": cfg.coordinator_port}[role]
    return base_url(cfg.host, port)


@contextmanager
def running_service(
    settings: Settings, role: str, timeout_s: float = START_TIMEOUT_S, require_healthy: bool = True
) -> Iterator[subprocess.Popen]:
    """Start one HTTP service process, wait until healthy (or, if not ``require_healthy``, until
    ``/healthz`` answers at all), stop it (and only it) on exit."""
    settings_file = write_settings(settings)
    layout = RuntimeLayout.of(settings)
    proc = start_process(ProcessSpec(role, role), settings_file, layout.logs)
    try:
        if not wait_healthy(service_url(settings, role), timeout_s, proc, any_answer=not require_healthy):
            log_tail = (layout.logs / f"{role}.log").read_text()[-3000:] if (layout.logs / f"{role}.log").exists() else ""
            raise RuntimeError(f"{role} service did not become healthy in {timeout_s}s; log tail:\n{log_tail}")
        yield proc
    finally:
        stop_process(proc, settings.runtime.stop_grace_s)


def register_policy(settings: Settings, policy: object, successes: int = 0, trials: int = 1, run_name: str = "fleet-seed") -> int:
    """Log ``policy`` to the registry as a new version (synthetic evaluation); returns the version."""
    from components.registry.lineage import Lineage
    from components.registry.model_registry import PolicyRegistry

    registry = PolicyRegistry(settings.paths.mlruns, settings.registry)
    rate = successes / trials if trials else 0.0
    evaluation = {"success_rate": rate, "ci_low": rate, "ci_high": rate, "successes": successes, "trials": trials}
    lineage = Lineage(git_commit="", snapshot_hash="", lancedb_version=-1, params_hash="", episodes=0, frames=0)
    version = registry.log_candidate(policy, evaluation, lineage, {}, {}, [], run_name)  # type: ignore[arg-type]
    return version.version


def synthetic_episode(robot_id: str, seed: int, length: int = 12, obs_dim: int = 11, act_dim: int = 3, success: bool = True):
    """A small valid episode (seeded) for exercising the services without a simulator."""
    import numpy as np

    from components.episodes.record import Episode, new_episode_id

    rng = np.random.default_rng(seed)
    return Episode(
        episode_id=new_episode_id(rng),
        robot_id=robot_id,
        task="pick-place",
        states=rng.normal(size=(length, obs_dim)).astype(np.float32),
        actions=rng.uniform(-1, 1, size=(length, act_dim)).astype(np.float32),
        timestamps=(np.arange(length) / 10.0).astype(np.float32),
        success=success,
        policy_version="v1",
    )
