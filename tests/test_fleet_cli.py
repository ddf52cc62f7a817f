"""`fleetloop fleet ...` end to end: tokens, revoke, up --detach, status, down (no process left)."""

from __future__ import annotations

import json
import stat
import time

from typer.testing import CliRunner

from components.fleet.auth import read_token_file
from components.fleet.layout import RuntimeLayout
from components.fleet.local import free_port
from components.fleet.processes import pid_alive
from components.config import load_settings
from cli.fleet import fleet_app

runner = CliRunner()


def _env(monkeypatch, root):
    monkeypatch.setenv("FLEETLOOP_ROOT", str(root))
    monkeypatch.setenv("FLEETLOOP_FLEET__NUM_ROBOTS", "2")
    monkeypatch.setenv("FLEETLOOP_DEVICE", "cpu")
    for key in ("INGEST_PORT", "INFERENCE_PORT", "COORDINATOR_PORT"):
        monkeypatch.setenv(f"FLEETLOOP_RUNTIME__{key}", str(free_port()))


def test_tokens_and_revoke_never_print_a_token(tmp_path, monkeypatch):
    _env(monkeypatch, tmp_path)
    issued = runner.invoke(fleet_app, ["tokens"])
    assert issued.exit_code == 0, issued.output
    path = RuntimeLayout.of(load_settings()).token_file
    book = read_token_file(path)
    assert set(book.robots) == {"robot-0000", "robot-0001"} and stat.S_IMODE(path.stat().st_mode) == 0o600
    assert not any(t in issued.output for t in [*book.robots.values(), book.service])
    assert (tmp_path / "fleet-runtime" / ".gitignore").read_text().strip().endswith("*")
    revoked = runner.invoke(fleet_app, ["revoke", "robot-0001"])
    assert revoked.exit_code == 0 and "robot-0001" not in read_token_file(path).robots
    assert runner.invoke(fleet_app, ["revoke", "robot-0042"]).exit_code == 1


def test_up_status_down_leaves_no_process(tmp_path, monkeypatch):
    _env(monkeypatch, tmp_path)
    started = runner.invoke(fleet_app, ["up", "--detach", "--episodes", "1"])
    assert started.exit_code == 0, started.output
    layout = RuntimeLayout.of(load_settings())
    pids: set[int] = set()
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            if layout.status_file.exists():
                members = json.loads(layout.status_file.read_text())["members"]
                pids = {m["pid"] for m in members.values() if m["pid"]}
                if len(pids) == 5:
                    break
            time.sleep(0.2)
        status = runner.invoke(fleet_app, ["status", "--json"])
        body = json.loads(status.output)
        assert body["coordinator_running"] and set(body["members"]) == {"ingest", "inference", "trainer", "robot-0000", "robot-0001"}
        pids.add(int(json.loads(layout.coordinator_pid_file.read_text())["pid"]))
        assert runner.invoke(fleet_app, ["up", "--detach"]).exit_code == 1  # already up
    finally:
        stopped = runner.invoke(fleet_app, ["down"])
    assert stopped.exit_code == 0, stopped.output
    time.sleep(0.5)
    assert len(pids) == 6 and not [p for p in pids if pid_alive(p) and _cmdline(p)]


def _cmdline(pid: int) -> bytes:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read()
    except OSError:
        return b""
