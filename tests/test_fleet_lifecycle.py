"""Fleet lifecycle invariants over real processes: no member outlives its coordinator (SIGKILL
included), `fleet status` tells the truth, `fleet up` never starts a second set, `fleet down`
leaves nothing running and no pid file, and no command signals a process the fleet did not start.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import httpx
from typer.testing import CliRunner

from cli.fleet import fleet_app
from components.config import load_settings
from components.fleet.identity import ProcessIdentity, fleet_processes, read_pid_file
from components.fleet.layout import RuntimeLayout
from components.fleet.local import free_port, service_url
from components.fleet.processes import ProcessSpec, start_process, write_settings

runner = CliRunner()
MEMBERS = 5  # ingest, inference, trainer, 2 robots
WAIT_S = 90.0  # bound on every wait below (a loaded CI machine); never asserted on
POLL_S = 0.2


def _env(monkeypatch, root):
    monkeypatch.setenv("FLEETLOOP_ROOT", str(root))
    monkeypatch.setenv("FLEETLOOP_FLEET__NUM_ROBOTS", "2")
    monkeypatch.setenv("FLEETLOOP_DEVICE", "cpu")
    monkeypatch.setenv("FLEETLOOP_RUNTIME__STOP_GRACE_S", "3")
    for key in ("INGEST_PORT", "INFERENCE_PORT", "COORDINATOR_PORT"):
        monkeypatch.setenv(f"FLEETLOOP_RUNTIME__{key}", str(free_port()))


def _wait(predicate, timeout_s: float = WAIT_S) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(POLL_S)
    return predicate()


def _processes(layout: RuntimeLayout) -> list[ProcessIdentity]:
    return fleet_processes(layout.settings_file)


def _status() -> dict:
    result = runner.invoke(fleet_app, ["status", "--json"])
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout)


def test_no_member_outlives_a_sigkilled_coordinator_and_up_never_starts_a_second_set(tmp_path, monkeypatch):
    _env(monkeypatch, tmp_path)
    assert runner.invoke(fleet_app, ["up", "--detach"]).exit_code == 0
    layout = RuntimeLayout.of(load_settings())
    try:
        assert _wait(lambda: len(_processes(layout)) == MEMBERS + 1), _processes(layout)
        url = service_url(load_settings(), "coordinator")
        assert httpx.get(f"{url}/healthz", timeout=10.0).json()["ok"] is True
        for path in ("/docs", "/redoc", "/openapi.json"):  # no unauthenticated API surface
            assert httpx.get(f"{url}{path}", timeout=10.0).status_code in (401, 404), path
        coordinator = read_pid_file(layout.coordinator_pid_file, "coordinator")
        members = [p for p in _processes(layout) if p.pid != coordinator.pid]
        os.kill(coordinator.pid, signal.SIGKILL)
        assert _wait(lambda: not coordinator.running())
        # status tells the truth at once: the coordinator is down, whatever status.json last said
        assert _status()["coordinator_running"] is False
        # every member notices and stops by itself (parent death signal / parent watch)
        assert _wait(lambda: not any(m.running() for m in members)), [m for m in members if m.running()]
        assert _processes(layout) == []
        assert read_pid_file(layout.coordinator_pid_file) is None  # stale: reads as "not running"
        # a fresh `fleet up` works on the same root and ports: one set, not two
        assert runner.invoke(fleet_app, ["up", "--detach"]).exit_code == 0
        assert _wait(lambda: len(_processes(layout)) == MEMBERS + 1)
        assert runner.invoke(fleet_app, ["up", "--detach"]).exit_code == 1  # already up: refused
        # one set: a second one would stay; a member the coordinator restarts under load (old one still
        # exiting) is counted twice for a moment (seen once under load: 7 processes for 5 + 1)
        assert _wait(lambda: len(_processes(layout)) == MEMBERS + 1), _processes(layout)
    finally:
        stopped = runner.invoke(fleet_app, ["down"])
    assert stopped.exit_code == 0, stopped.output
    assert _processes(layout) == [] and not layout.coordinator_pid_file.exists()


def test_up_stops_orphans_of_a_dead_coordinator_and_status_reports_them(tmp_path, monkeypatch):
    _env(monkeypatch, tmp_path)
    settings = load_settings()
    layout = RuntimeLayout.of(settings).ensure()
    runner.invoke(fleet_app, ["tokens"])
    # a member left behind by a coordinator that never watched it (an older runtime, a bug)
    orphan = start_process(ProcessSpec("ingest", "ingest"), write_settings(settings), layout.logs)
    try:
        assert _wait(lambda: [p.pid for p in _processes(layout)] == [orphan.pid])
        layout.status_file.write_text(json.dumps({"members": {}, "served": {}}))
        status = _status()
        assert status["coordinator_running"] is False and status["orphans"] == [orphan.pid]
        started = runner.invoke(fleet_app, ["up", "--detach"])
        assert started.exit_code == 0, started.output
        assert orphan.poll() is not None  # stopped before the new set started
        assert _wait(lambda: len(_processes(layout)) == MEMBERS + 1)
    finally:
        stopped = runner.invoke(fleet_app, ["down"])
        if orphan.poll() is None:
            orphan.kill()
        orphan.wait()
    assert stopped.exit_code == 0, stopped.output
    assert _processes(layout) == []


def test_down_never_signals_a_process_a_stale_pid_file_names(tmp_path, monkeypatch):
    _env(monkeypatch, tmp_path)
    layout = RuntimeLayout.of(load_settings()).ensure()
    stranger = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    try:
        assert _wait(lambda: ProcessIdentity.of(stranger.pid) is not None)
        real = ProcessIdentity.of(stranger.pid)
        # its pid with another start time (pid reuse), then its exact identity (not a fleet process)
        for recorded in (ProcessIdentity(real.pid, real.start_time + 1, "python -m components.fleet.serve coordinator"), real):
            layout.coordinator_pid_file.write_text(json.dumps(recorded.to_dict()))
            result = runner.invoke(fleet_app, ["down"])
            assert result.exit_code == 0, result.output
            assert stranger.poll() is None, "fleet down signalled a process it did not start"
            assert not layout.coordinator_pid_file.exists()  # the stale file is cleaned up
    finally:
        stranger.kill()
        stranger.wait()
