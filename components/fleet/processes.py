"""Starting and stopping fleet processes: one OS process per service or robot, never a fork.

Each process is ``python -m components.fleet.serve ROLE --settings <state>/settings.json``: a
fresh interpreter (LanceDB and torch hate inherited state), its own session (so a signal to the
caller's process group does not reach it), its output appended to ``logs/<name>.log``. The
settings file holds the resolved configuration without secrets; tokens travel by the token file
or the inherited environment.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from urllib.parse import urlsplit
from pathlib import Path

import httpx

from components.config import Settings
from components.fleet.identity import PARENT_ENV
from components.fleet.layout import RuntimeLayout
from components.fsio import atomic_write_bytes

ROLES = ("ingest", "inference", "trainer", "robot", "coordinator")
POLL_S = 0.05


def write_settings(settings: Settings) -> Path:
    """The resolved settings for child processes. Secrets are left out: the token secret, and a
    tracking URI that carries a password (children inherit it from the environment it came from)."""
    layout = RuntimeLayout.of(settings).ensure()
    exclude: dict = {"runtime": {"tokens"}}
    if urlsplit(settings.registry.tracking_uri).password is not None:
        exclude["registry"] = {"tracking_uri"}
    body = settings.model_dump(mode="json", exclude=exclude)
    atomic_write_bytes(layout.settings_file, json.dumps(body, indent=2).encode())
    return layout.settings_file


def read_settings(path: Path) -> Settings:
    """Settings as a parent process resolved them (env still supplies ``runtime.tokens``)."""
    return Settings(**json.loads(Path(path).read_text()))


@dataclass(frozen=True)
class ProcessSpec:
    """What to run: a role and, for robots, which robot."""

    role: str
    name: str  # unique: the role for services, the robot id for robots

    def command(self, settings_file: Path) -> list[str]:
        if self.role not in ROLES:
            raise ValueError(f"unknown fleet role {self.role!r}; use one of {ROLES}")
        cmd = [sys.executable, "-m", "components.fleet.serve", self.role, "--settings", str(settings_file)]
        if self.role == "robot":
            cmd += ["--name", self.name]
        return cmd


def start_process(spec: ProcessSpec, settings_file: Path, log_dir: Path, parent_watch: bool = False) -> subprocess.Popen:
    """Start one fleet process in its own session, output appended to ``<log_dir>/<name>.log``.

    ``parent_watch``: the child dies with this process (the coordinator starts its members so);
    without it (the CLI starting a detached coordinator) the child outlives its starter.
    """
    log_dir.mkdir(parents=True, exist_ok=True)
    env = {k: v for k, v in os.environ.items() if k != PARENT_ENV}
    if parent_watch:
        env[PARENT_ENV] = str(os.getpid())
    with open(log_dir / f"{spec.name}.log", "ab") as log:
        return subprocess.Popen(
            spec.command(settings_file),
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
            cwd=str(Path(__file__).resolve().parents[2]),
            env=env,
        )


def stop_process(proc: subprocess.Popen, grace_s: float) -> int | None:
    """SIGTERM, then SIGKILL after ``grace_s``; returns the exit code."""
    if proc.poll() is None:
        try:
            proc.send_signal(signal.SIGTERM)
            proc.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        except ProcessLookupError:
            pass
    return proc.returncode


def kill_pid(pid: int) -> bool:
    """SIGKILL one process by id; False if it was already gone."""
    try:
        os.kill(pid, signal.SIGKILL)
        return True
    except ProcessLookupError:
        return False


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def wait_healthy(url: str, timeout_s: float, proc: subprocess.Popen | None = None, any_answer: bool = False) -> bool:
    """Poll ``url/healthz`` until it answers 200 (any HTTP answer if ``any_answer``); False on
    timeout or if ``proc`` exits."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            return False
        try:
            code = httpx.get(f"{url}/healthz", timeout=1.0).status_code
            if code == 200 or any_answer:
                return True
        except httpx.HTTPError:
            pass
        time.sleep(POLL_S)
    return False
