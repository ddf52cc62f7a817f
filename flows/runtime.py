"""Flow-side plumbing: settings + Prefect environment, task runners, per-task options from config.

``prepare_environment`` must run before Prefect is imported: Prefect reads its settings from the
environment once, at import. So this module imports Prefect (and torch) only inside functions.
"""

from __future__ import annotations

import hashlib
import inspect
import json
import os
from collections.abc import Callable
from typing import Any

import httpx

from components.config import OpsConfig, Settings, load_settings


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
    # a cold temporary server migrates its database first: give busy laptops time
    os.environ.setdefault("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "120")
    if "PREFECT_API_URL" not in os.environ:
        api = f"http://127.0.0.1:{settings.ops.prefect_port}/api"
        if _healthy(api):
            os.environ["PREFECT_API_URL"] = api
    return settings


def _healthy(api: str) -> bool:
    try:
        return httpx.get(f"{api}/health", timeout=2.0).status_code == 200
    except httpx.HTTPError:
        return False


def task_runner(settings: Settings) -> Any:
    """The fan-out engine ``ops.engine`` names (``OpsConfig.fan_out_engine``): Prefect's thread
    pool, a Dask cluster (prefect-dask) or a Ray cluster (prefect-ray). The tasks are the same."""
    return _RUNNERS[settings.ops.fan_out_engine](settings.ops)


def _thread_pool(ops: OpsConfig) -> Any:
    from prefect.task_runners import ThreadPoolTaskRunner

    return ThreadPoolTaskRunner(max_workers=ops.max_workers)


def _dask(ops: OpsConfig) -> Any:
    from prefect_dask import DaskTaskRunner

    return DaskTaskRunner(address=ops.dask_address)


def _ray(ops: OpsConfig) -> Any:
    """A Ray cluster: joined at ``ops.ray_address``, or a local one this flow run starts and stops.

    A local cluster's workers are children of this process: they inherit its environment
    (PYTHONPATH, PREFECT_*) and Ray puts the driver's working directory on their ``sys.path``, so
    they import fleetloop as the driver does; no ``runtime_env`` is needed. A joined cluster's
    workers import it from their own node's install (docs/operations.md). A flow whose Ray is
    already up (a parent flow's runner started it) runs on that one: prefect-ray reuses it.
    """
    from prefect_ray import RayTaskRunner

    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")  # no usage reports from a fleet's runs
    if not ops.ray_address:
        local = {"num_cpus": ops.max_workers, "include_dashboard": False}
        if ops.ray_object_store_mb:
            local["object_store_memory"] = ops.ray_object_store_mb * 2**20
        return RayTaskRunner(address="local", init_kwargs=local)  # "local": never join a stray cluster
    if ops.ray_address == "auto":
        # prefect-ray turns address "auto" into a bare ray.init(), which starts a local cluster when
        # it finds none; ray.init(address="auto") fails instead, as joining should
        return RayTaskRunner(init_kwargs={"address": "auto"})
    return RayTaskRunner(address=ops.ray_address)


_RUNNERS: dict[str, Callable[[OpsConfig], Any]] = {"threads": _thread_pool, "dask": _dask, "ray": _ray}


def io_options(settings: Settings) -> dict[str, Any]:
    """Retries with backoff, for tasks that touch disk, databases or the network."""
    return {"retries": settings.ops.io_retries, "retry_delay_seconds": list(settings.ops.retry_delays_s)}


def flow_options(settings: Settings) -> dict[str, Any]:
    """A wall-clock limit per flow run (flows run in the main thread, where a timeout can interrupt)."""
    return {"timeout_seconds": settings.ops.flow_timeout_s}


def settings_cache_key(
    *sections: str, depends: Callable[[Settings], tuple[str, ...]] | None = None,
) -> Callable[[Any, dict[str, Any]], str]:
    """A Prefect cache key over the task's source, its other inputs and only the named settings.

    Keying on the whole Settings would make, say, a change of learning rate invalidate cached
    data collection; keying on what the task reads keeps the cache both safe and useful.
    ``depends(settings)`` adds the sections only some configurations read (e.g. the scheduler's,
    read only when training runs through it).
    """

    def key(context: Any, parameters: dict[str, Any]) -> str:
        settings: Settings = parameters["settings"]
        digest = hashlib.sha256(inspect.getsource(context.task.fn).encode())
        digest.update(str(settings.root).encode())
        for name in (*sections, *(depends(settings) if depends else ())):
            digest.update(json.dumps(settings.model_dump(mode="json", include={name}), sort_keys=True).encode())
        for name, value in sorted(parameters.items()):
            if name != "settings":
                digest.update(f"{name}={value!r}".encode())
        return f"{context.task.name}:{digest.hexdigest()[:24]}"

    return key
