"""`fleetloop ui` under a real SIGTERM (how systemd and docker stop it): the Prefect server and the
MLflow UI stop with it, and with them every process they started (Prefect's uvicorn, MLflow's
server and job consumers); `fleetloop ui` exits 0 and both ports are free again.

A real `fleetloop ui` subprocess on loopback, on free ports, over a temporary root. Its process
tree is read from /proc (pid + start time, so a reused pid is not mistaken for a survivor).
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from cli.services import STOP_GRACE_S
from tests.servers import LOOPBACK, free_port

pytestmark = pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="reads the process tree from /proc")

FLEETLOOP = Path(sys.executable).parent / "fleetloop"
START_S = 240.0  # both UIs migrate fresh databases first: slow on a busy 2-core machine
EXIT_S = 2 * STOP_GRACE_S + 10.0  # the product's own grace for each group, and some; past this it hung
GONE_S = 10.0  # after exit: reparented workers still have to be reaped by init
POLL_S = 0.25


def _stat(pid: int) -> tuple[str, int, int, int] | None:
    """(state, ppid, pgrp, start time) of a process, or None when it is gone."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = text[text.rindex(")") + 2:].split()
    return fields[0], int(fields[1]), int(fields[2]), int(fields[19])


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def _descendants(root: int) -> dict[int, int]:
    """pid -> start time of every live process below ``root``."""
    children: dict[int, list[int]] = {}
    starts: dict[int, int] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and (st := _stat(int(entry.name))) and st[0] != "Z":
            children.setdefault(st[1], []).append(int(entry.name))
            starts[int(entry.name)] = st[3]
    found: dict[int, int] = {}
    todo = [root]
    while todo:
        for kid in children.get(todo.pop(), []):
            found[kid] = starts[kid]
            todo.append(kid)
    return found


def _alive(procs: dict[int, int]) -> dict[int, str]:
    """Those of ``procs`` (pid -> start time) still running, as pid -> command line."""
    left = {}
    for pid, start in procs.items():
        st = _stat(pid)
        if st is not None and st[0] != "Z" and st[3] == start:
            left[pid] = _cmdline(pid)
    return left


def _group_members(groups: set[int]) -> dict[int, str]:
    """Live processes in any of the process groups ``groups``, as pid -> command line."""
    found = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and (st := _stat(int(entry.name))) and st[0] != "Z" and st[2] in groups:
            found[int(entry.name)] = _cmdline(int(entry.name))
    return found


def _listening(port: int) -> bool:
    with socket.socket() as sock:
        return sock.connect_ex((LOOPBACK, port)) == 0


def _up(url: str) -> bool:
    try:
        return httpx.get(url, timeout=2.0).status_code < 500
    except httpx.HTTPError:
        return False


def _start_ui(root: Path) -> tuple[subprocess.Popen, int, int]:
    prefect_port, mlflow_port = free_port(), free_port()
    env = {**os.environ, "FLEETLOOP_ROOT": str(root), "PREFECT_HOME": str(root / ".prefect"),
           "FLEETLOOP_OPS__PREFECT_PORT": str(prefect_port), "FLEETLOOP_OPS__MLFLOW_PORT": str(mlflow_port)}
    env.pop("PREFECT_API_URL", None)
    env.pop("PREFECT_RESULTS_LOCAL_STORAGE_PATH", None)
    proc = subprocess.Popen([str(FLEETLOOP), "ui"], env=env, cwd=root, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    return proc, prefect_port, mlflow_port


def _poll(what: str, done, proc: subprocess.Popen, seconds: float) -> None:
    deadline = time.monotonic() + seconds
    while not done():
        if proc.poll() is not None:
            out = proc.stdout.read()
            pytest.fail(f"`fleetloop ui` exited (code {proc.returncode}) while waiting for {what}:\n{out}")
        if time.monotonic() > deadline:
            proc.kill()
            pytest.fail(f"{what} not within {seconds:.0f} s")
        time.sleep(POLL_S)


def _sigterm_and_check(proc: subprocess.Popen, tree: dict[int, int], ports: tuple[int, ...]) -> str:
    """SIGTERM `fleetloop ui`; it must exit 0 with no process of ``tree`` left, nothing left in the
    services' process groups (which also holds workers forked after ``tree`` was read) and ``ports`` free."""
    groups = {st[2] for pid in tree if (st := _stat(pid))} - {os.getpgrp()}
    assert groups, "the services run in process groups of their own"
    proc.send_signal(signal.SIGTERM)
    try:
        out, _ = proc.communicate(timeout=EXIT_S)
    except subprocess.TimeoutExpired:
        proc.kill()
        left = {**_alive(tree), **_group_members(groups)}
        for pid in left:
            os.kill(pid, signal.SIGKILL)
        pytest.fail(f"`fleetloop ui` still running {EXIT_S:.0f} s after SIGTERM; its processes left: {left}")
    deadline = time.monotonic() + GONE_S
    while (_alive(tree) or _group_members(groups)) and time.monotonic() < deadline:
        time.sleep(POLL_S)
    left = {**_alive(tree), **_group_members(groups)}
    for pid in left:  # do not leak them into the rest of the session, then fail
        os.kill(pid, signal.SIGKILL)
    assert not left, f"processes left after `fleetloop ui` exited on SIGTERM: {left}"
    assert proc.returncode == 0, f"`fleetloop ui` exited {proc.returncode} on SIGTERM, not 0:\n{out}"
    assert "SIGTERM: stopping" in out, out
    for port in ports:
        assert not _listening(port), f"port {port} still listens after `fleetloop ui` exited"
    return out


@pytest.mark.slow  # both servers start for real: ~30 s on the 2-core machine
def test_sigterm_stops_both_uis_and_everything_they_started(tmp_path):
    proc, prefect_port, mlflow_port = _start_ui(tmp_path)
    _poll("both UIs to answer",
          lambda: _up(f"http://{LOOPBACK}:{prefect_port}/api/health") and _up(f"http://{LOOPBACK}:{mlflow_port}/"),
          proc, START_S)
    _poll("the services' workers", lambda: len(_descendants(proc.pid)) > 2, proc, START_S)
    tree = _descendants(proc.pid)
    commands = [_cmdline(pid) for pid in tree]
    assert any("prefect server start" in c for c in commands), commands
    assert any("mlflow ui" in c for c in commands), commands
    # the services' own workers are in the tree too: the test covers grandchildren, not just children
    assert any(_stat(pid) and _stat(pid)[1] != proc.pid for pid in tree), commands

    _sigterm_and_check(proc, tree, (prefect_port, mlflow_port))


def test_sigterm_while_starting_stops_both(tmp_path):
    """docker stop right after docker start: SIGTERM before either UI answers still stops both."""
    proc, prefect_port, mlflow_port = _start_ui(tmp_path)

    def both_spawned() -> bool:
        commands = [_cmdline(pid) for pid in _descendants(proc.pid)]
        return any("prefect server start" in c for c in commands) and any("mlflow ui" in c for c in commands)

    _poll("both services to be spawned", both_spawned, proc, START_S)
    tree = _descendants(proc.pid)
    _sigterm_and_check(proc, tree, (prefect_port, mlflow_port))


def test_a_stop_signal_during_a_spawn_waits_until_the_child_is_recorded():
    """The start-up race: SIGTERM arriving inside Popen must not lose the child it just started."""
    from cli import services

    procs: list[subprocess.Popen] = []

    def start_and_get_stopped() -> subprocess.Popen:
        child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"], start_new_session=True)
        os.kill(os.getpid(), signal.SIGTERM)  # delivered here, before Popen's caller can record it
        return child

    previous = signal.signal(signal.SIGTERM, services._on_stop_signal)
    try:
        with pytest.raises(services._Stopped, match="SIGTERM"):
            services._spawn(start_and_get_stopped, procs)
    finally:
        signal.signal(signal.SIGTERM, previous)
        services.stop_services(procs, grace_s=5.0)
    assert len(procs) == 1 and procs[0].returncode is not None  # recorded, then stopped by the cleanup
