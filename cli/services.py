"""`make ui`: the Prefect server and the MLflow UI, both on 127.0.0.1, over this root's stores."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import httpx
from rich.console import Console

from components.config import Settings
from components.registry.tracking import tracking_uri

LOOPBACK = "127.0.0.1"


def _wait(url: str, seconds: float) -> bool:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        try:
            if httpx.get(url, timeout=1.0).status_code < 500:
                return True
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    return False


def start_prefect_server(settings: Settings, port: int | None = None) -> subprocess.Popen:
    port = port or settings.ops.prefect_port
    env = {
        **os.environ,
        "PREFECT_HOME": os.environ.get("PREFECT_HOME", str(settings.paths.prefect_home)),
        "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
        "PREFECT_UI_API_URL": f"http://{LOOPBACK}:{port}/api",
    }
    env.pop("PREFECT_API_URL", None)
    bin_dir = Path(sys.executable).parent
    return subprocess.Popen(
        [str(bin_dir / "prefect"), "server", "start", "--host", LOOPBACK, "--port", str(port)],
        env=env, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT, start_new_session=True,
    )


def start_mlflow_ui(settings: Settings, port: int | None = None) -> subprocess.Popen:
    port = port or settings.ops.mlflow_port
    settings.paths.mlruns.mkdir(parents=True, exist_ok=True)
    bin_dir = Path(sys.executable).parent
    return subprocess.Popen(
        [str(bin_dir / "mlflow"), "ui", "--backend-store-uri", tracking_uri(settings.paths.mlruns, settings.registry),
         "--default-artifact-root", (settings.paths.mlruns / "artifacts").resolve().as_uri(),
         "--host", LOOPBACK, "--port", str(port)],
        stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT, start_new_session=True,
    )


def run_uis(settings: Settings, console: Console) -> None:
    prefect = start_prefect_server(settings)
    mlflow = start_mlflow_ui(settings)
    try:
        ok_p = _wait(f"http://{LOOPBACK}:{settings.ops.prefect_port}/api/health", 90)
        ok_m = _wait(f"http://{LOOPBACK}:{settings.ops.mlflow_port}/", 90)
        console.print(f"Prefect UI  http://{LOOPBACK}:{settings.ops.prefect_port}  {'up' if ok_p else 'NOT UP'}")
        console.print(f"MLflow UI   http://{LOOPBACK}:{settings.ops.mlflow_port}  {'up' if ok_m else 'NOT UP'}")
        console.print("runs of `make demo` started now appear in both; Ctrl-C stops them")
        while prefect.poll() is None and mlflow.poll() is None:
            time.sleep(1.0)
    except KeyboardInterrupt:
        pass
    finally:
        for proc in (prefect, mlflow):
            proc.terminate()
        for proc in (prefect, mlflow):
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
