"""`make ui`: the Prefect server and the MLflow UI, both on 127.0.0.1, over this root's stores."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
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


STOP_GRACE_S = 10.0  # how long a service gets to exit after SIGTERM before its whole group is killed
STOP_SIGNALS = (signal.SIGTERM, signal.SIGHUP)  # how systemd, docker and a closed terminal stop `fleetloop ui`


class _Stopped(Exception):
    """A stop signal arrived: unwind to the cleanup that stops the children."""


class _SpawnGuard:
    """While a service is being spawned, a stop signal is held back: raised inside ``Popen`` it
    would leave a started child that ``procs`` never learns of (found by SIGTERM during start-up)."""

    spawning = False
    pending: str | None = None


def _on_stop_signal(signum: int, _frame: object) -> None:
    name = signal.Signals(signum).name
    if _SpawnGuard.spawning:
        _SpawnGuard.pending = name
        return
    raise _Stopped(name)


def _spawn(start: Callable[[], subprocess.Popen], procs: list[subprocess.Popen]) -> None:
    """Start one service and record it before any stop signal that arrived meanwhile is acted on."""
    _SpawnGuard.spawning = True
    try:
        procs.append(start())
    finally:
        _SpawnGuard.spawning = False
    if _SpawnGuard.pending:
        raise _Stopped(_SpawnGuard.pending)


def _group_alive(pgid: int) -> bool:
    """Whether any live (non-zombie) process is left in process group ``pgid``."""
    proc = Path("/proc")
    if not proc.is_dir():  # not Linux: ask the kernel (counts zombies too, so this errs on waiting)
        try:
            os.killpg(pgid, 0)
            return True
        except (ProcessLookupError, PermissionError):
            return False
    for entry in proc.iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        fields = stat[stat.rindex(")") + 2:].split()  # after "pid (comm) ": state ppid pgrp ...
        if int(fields[2]) == pgid and fields[0] != "Z":
            return True
    return False


def _signal_group(pgid: int, sig: int) -> None:
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def stop_services(procs: list[subprocess.Popen], grace_s: float = STOP_GRACE_S) -> None:
    """Stop each service and everything it started. Each was started in its own session, so its
    process group holds it and its workers (Prefect's uvicorn, MLflow's server and job consumers):
    SIGTERM every group, wait up to ``grace_s`` for all of them to empty, then SIGKILL what is left."""
    for proc in procs:
        _signal_group(proc.pid, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    for proc in procs:
        try:
            proc.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            pass
    while any(_group_alive(proc.pid) for proc in procs) and time.monotonic() < deadline:
        time.sleep(0.1)
    for proc in procs:
        if proc.poll() is None or _group_alive(proc.pid):
            _signal_group(proc.pid, signal.SIGKILL)
    for proc in procs:
        proc.wait()


def run_uis(settings: Settings, console: Console) -> None:
    """Run both UIs until Ctrl-C, SIGTERM or SIGHUP, or until one of them exits; then stop both,
    with every process they started, and return (exit 0: a requested stop is a clean stop)."""
    previous = {sig: signal.signal(sig, _on_stop_signal) for sig in STOP_SIGNALS}
    procs: list[subprocess.Popen] = []
    _SpawnGuard.pending = None
    try:
        _spawn(lambda: start_prefect_server(settings), procs)
        _spawn(lambda: start_mlflow_ui(settings), procs)
        ok_p = _wait(f"http://{LOOPBACK}:{settings.ops.prefect_port}/api/health", 90)
        ok_m = _wait(f"http://{LOOPBACK}:{settings.ops.mlflow_port}/", 90)
        console.print(f"Prefect UI  http://{LOOPBACK}:{settings.ops.prefect_port}  {'up' if ok_p else 'NOT UP'}")
        console.print(f"MLflow UI   http://{LOOPBACK}:{settings.ops.mlflow_port}  {'up' if ok_m else 'NOT UP'}")
        console.print("runs of `make demo` started now appear in both; Ctrl-C (or SIGTERM) stops them")
        while all(proc.poll() is None for proc in procs):
            time.sleep(1.0)
        for name, proc in zip(("Prefect server", "MLflow UI"), procs):
            if proc.poll() is not None:
                console.print(f"{name} exited (code {proc.returncode}); stopping the other")
    except (KeyboardInterrupt, _Stopped) as stop:
        console.print(f"{stop or 'Ctrl-C'}: stopping the Prefect server and the MLflow UI")
    finally:
        previous[signal.SIGINT] = signal.getsignal(signal.SIGINT)
        for sig in previous:  # a second signal (or Ctrl-C) must not cut the cleanup short
            signal.signal(sig, signal.SIG_IGN)
        stop_services(procs)
        for sig, handler in previous.items():
            signal.signal(sig, handler)
