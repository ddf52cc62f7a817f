"""Flow-side plumbing: settings + Prefect environment, task runners, per-task options from config."""

from __future__ import annotations

import hashlib
import os
from typing import Any

import httpx
import torch
from prefect.task_runners import ThreadPoolTaskRunner

from components.config import Settings, load_settings


def prepare_environment(settings: Settings | None = None) -> Settings:
    """Load settings; point Prefect at ``<root>/.prefect`` and at a running local server if any.

    ``make ui`` starts a Prefect server on ``ops.prefect_port``: when one answers there, runs are
    recorded in it (and show in its UI); otherwise Prefect starts a temporary one per process.
    """
    settings = settings or load_settings()
    home = settings.paths.prefect_home
    os.environ.setdefault("PREFECT_HOME", str(home))
    os.environ.setdefault("PREFECT_RESULTS_LOCAL_STORAGE_PATH", str(home / "storage"))
    os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
    if "PREFECT_API_URL" not in os.environ:
        api = f"http://127.0.0.1:{settings.ops.prefect_port}/api"
        if _healthy(api):
            os.environ["PREFECT_API_URL"] = api
    return settings


def _healthy(api: str) -> bool:
    try:
        return httpx.get(f"{api}/health", timeout=0.5).status_code == 200
    except httpx.HTTPError:
        return False


def task_runner(settings: Settings) -> Any:
    """Prefect's thread pool by default; a Dask cluster (prefect-dask) when an address is set."""
    if settings.ops.dask_address:
        from prefect_dask import DaskTaskRunner

        return DaskTaskRunner(address=settings.ops.dask_address)
    return ThreadPoolTaskRunner(max_workers=settings.ops.max_workers)


def io_options(settings: Settings) -> dict[str, Any]:
    """Retries with backoff and a timeout, for tasks that touch disk, databases or the network."""
    return {
        "retries": settings.ops.io_retries,
        "retry_delay_seconds": list(settings.ops.retry_delays_s),
        "timeout_seconds": settings.ops.task_timeout_s,
    }


def compute_options(settings: Settings) -> dict[str, Any]:
    return {"timeout_seconds": settings.ops.task_timeout_s}


def policy_fingerprint(policy: torch.nn.Module) -> str:
    """Content hash of a model's weights: a safe cache key for work that depends only on them."""
    digest = hashlib.sha256()
    for name, tensor in sorted(policy.state_dict().items()):
        digest.update(name.encode())
        digest.update(tensor.detach().cpu().contiguous().numpy().tobytes())
    return digest.hexdigest()[:16]
