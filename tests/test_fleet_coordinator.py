"""Coordinator rules (leases, restart backoff over a real crashing process) and the inference warm-restart cache."""

from __future__ import annotations

import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

import pytest
import torch
import uvicorn
from fastapi import HTTPException

from components.fleet.auth import ROBOT, SERVICE, SERVICE_NAME, Principal, TokenBook, issue_tokens, revoke_robot
from components.fleet.coordinator import Coordinator, create_coordinator_app, lease_verdict, restart_delay
from components.fleet.identity import cpu_seconds
from components.fleet.layout import RuntimeLayout
from components.fleet.inference_service import ModelCache, ModelSlots
from components.fleet.local import with_free_ports
from components.policy.factory import make_policy
from tests.conftest import small_settings


def test_a_robot_renews_only_its_own_lease(tmp_path):
    coordinator = Coordinator(with_free_ports(small_settings(tmp_path)))
    assert set(coordinator.members) == {"ingest", "inference", "trainer", "robot-0000", "robot-0001"}
    coordinator.heartbeat("robot-0000", Principal("robot-0000", ROBOT), {"episodes": 3})
    assert coordinator.members["robot-0000"].last_beat is not None
    with pytest.raises(HTTPException) as other:
        coordinator.heartbeat("robot-0001", Principal("robot-0000", ROBOT), {})
    assert other.value.status_code == 403 and coordinator.members["robot-0001"].last_beat is None
    coordinator.heartbeat("trainer", Principal(SERVICE_NAME, SERVICE), {"step": 5})
    with pytest.raises(HTTPException) as unknown:
        coordinator.heartbeat("robot-0099", Principal(SERVICE_NAME, SERVICE), {})
    assert unknown.value.status_code == 404
    assert coordinator.status()["members"]["robot-0000"]["info"] == {"episodes": 3}


def test_inference_cache_restores_the_last_served_models(tmp_path):
    cache = ModelCache(tmp_path / "cache")
    torch.manual_seed(0)
    policy = make_policy(11, 3, small_settings(tmp_path).policy).eval()
    cache.put(4, policy)
    cache.remember({"champion": 4, "canary": 9})  # v9 never cached: not restored, fetched later
    slots = ModelSlots()
    assert cache.warm_start(slots) == {"champion": 4}
    obs = torch.randn(2, 11)
    with torch.no_grad():
        assert torch.equal(slots.get("champion").policy(obs), policy(obs))
    (tmp_path / "cache" / "v4.pt").write_bytes(b"torn")
    assert ModelCache(tmp_path / "cache").warm_start(ModelSlots()) == {}


def test_restart_delay_doubles_per_failure_and_is_capped():
    assert [restart_delay(n, 0.5, 4.0) for n in range(6)] == [0.5, 1.0, 2.0, 4.0, 4.0, 4.0]
    assert restart_delay(3, 0.0, 4.0) == 0.0


def test_lease_verdict_tells_a_starved_member_from_a_hung_one():
    assert lease_verdict(0.9, 1.0, None, 4.0, 0.05) == "ok"
    assert lease_verdict(1.5, 1.0, 0.3, 4.0, 0.05) == "starved"  # silent, but using CPU
    assert lease_verdict(1.5, 1.0, 0.01, 4.0, 0.05) == "hung"  # silent and idle: deadlocked
    assert lease_verdict(1.5, 1.0, None, 4.0, 0.05) == "hung"  # gone, or no CPU reading
    assert lease_verdict(4.5, 1.0, 9.0, 4.0, 0.05) == "hung"  # busy but silent past factor leases


def test_a_member_silent_past_its_lease_is_restarted_only_when_it_uses_no_cpu(tmp_path):
    """The 96-robot chaos runs on a loaded host spiralled: members starved of CPU missed their
    leases, were all restarted at once, and the restarts starved the rest. A busy member is now
    given up to starved_lease_factor leases; an idle (deadlocked) one is still killed at its lease."""
    settings = with_free_ports(small_settings(tmp_path), lease_s=1.0, starved_lease_factor=3.0, starved_min_cpu_s=0.05)
    coordinator = Coordinator(settings)
    busy = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    idle = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    starved, hung = coordinator.members["robot-0000"], coordinator.members["robot-0001"]
    beat = time.monotonic()
    try:
        for member, proc in ((starved, busy), (hung, idle)):
            member.proc, member.last_beat, member.cpu_at_beat = proc, beat, cpu_seconds(proc.pid)
        deadline = time.monotonic() + 60.0  # bound only: the busy loop needs a few CPU ticks
        while cpu_seconds(busy.pid) - starved.cpu_at_beat < 0.2 and time.monotonic() < deadline:
            time.sleep(0.05)
        hung.cpu_at_beat = cpu_seconds(idle.pid)  # the interpreter's start-up is not progress
        with coordinator.lock:
            coordinator.check(starved, beat + 2.0)  # two leases silent, but using CPU
            coordinator.check(hung, beat + 2.0)  # two leases silent and idle
        assert busy.poll() is None and starved.restart_at is None and starved.starved == 1
        assert idle.poll() is not None and hung.restart_at is not None and hung.failures == 1
        with coordinator.lock:
            coordinator.check(starved, beat + 3.5)  # past starved_lease_factor leases: hung after all
        assert busy.poll() is not None and starved.restart_at is not None
    finally:
        for proc in (busy, idle):
            proc.kill()
            proc.wait()


def test_a_revoked_robot_is_restarted_with_capped_exponential_backoff_not_a_storm(tmp_path):
    """Issue 20: revoking a robot gave 13 restarts in 20 s (restart_backoff_s was read nowhere)."""
    settings = with_free_ports(small_settings(tmp_path), restart_backoff_s=0.05, restart_backoff_max_s=0.2, heartbeat_s=0.05)
    layout = RuntimeLayout.of(settings).ensure()
    issue_tokens(layout.token_file, settings.fleet.robot_ids())
    coordinator = Coordinator(settings)
    revoke_robot(layout.token_file, "robot-0000")  # revoked while the fleet runs: its process now exits at once
    robot = coordinator.members["robot-0000"]
    wanted = 5
    try:
        with coordinator.lock:
            coordinator._start(robot, "test")
        deadline = time.monotonic() + 120.0  # bound only (each start imports a fresh interpreter)
        while len(robot.delays) < wanted and time.monotonic() < deadline:
            with coordinator.lock:
                coordinator.check(robot, time.monotonic())
            time.sleep(0.02)
    finally:
        if robot.proc is not None and robot.proc.poll() is None:
            robot.proc.kill()
            robot.proc.wait()
    assert robot.delays[:wanted] == [0.05, 0.1, 0.2, 0.2, 0.2]  # doubling, then capped
    assert robot.last_exit not in (None, 0) and robot.failures >= wanted
    assert robot.restarts == len(robot.delays) - (robot.restart_at is not None)  # each restart waited its delay


@contextmanager
def coordinator_http(coordinator: Coordinator, book: TokenBook) -> Iterator[None]:
    """The coordinator's own HTTP app on loopback, without its lifespan (which would start the
    whole fleet): heartbeats reach the real auth + lease code, members start only when told."""
    cfg = coordinator.cfg
    app = create_coordinator_app(coordinator, book)
    server = uvicorn.Server(uvicorn.Config(app, host=cfg.host, port=cfg.coordinator_port, lifespan="off", log_config=None))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + 30.0
        while not server.started and time.monotonic() < deadline:
            time.sleep(0.02)
        yield
    finally:
        server.should_exit = True
        thread.join(timeout=10.0)


def test_a_robot_revoked_while_running_loses_its_lease_then_backs_off_never_a_storm(tmp_path):
    """Issue 20: revoking a *running* robot gave 13 restarts in 20 s. Its heartbeats now get 403, so
    its lease lapses (one kill), and every later start exits at once with doubling delays: the
    failure streak is never reset while it stays revoked."""
    settings = with_free_ports(
        small_settings(tmp_path), restart_backoff_s=0.05, restart_backoff_max_s=0.2, heartbeat_s=0.1, lease_s=1.0
    )
    layout = RuntimeLayout.of(settings).ensure()
    issue_tokens(layout.token_file, settings.fleet.robot_ids())
    coordinator = Coordinator(settings)
    robot = coordinator.members["robot-0000"]
    wanted = 4

    def tick_until(done, bound_s: float = 120.0) -> None:  # bound only (each start imports a fresh interpreter)
        deadline = time.monotonic() + bound_s
        while not done() and time.monotonic() < deadline:
            with coordinator.lock:
                coordinator.check(robot, time.monotonic())
            time.sleep(0.02)

    with coordinator_http(coordinator, TokenBook(layout.token_file)):
        try:
            with coordinator.lock:
                coordinator._start(robot, "test")
            tick_until(lambda: robot.last_beat is not None)  # running, and renewing its lease
            assert robot.last_beat is not None and robot.failures == 0
            revoke_robot(layout.token_file, "robot-0000")
            tick_until(lambda: len(robot.delays) >= wanted)
        finally:
            if robot.proc is not None and robot.proc.poll() is None:
                robot.proc.kill()
                robot.proc.wait()
    assert any("lease expired" in e for e in robot.events), robot.events  # the running agent was killed once
    assert robot.delays[:wanted] == [0.05, 0.1, 0.2, 0.2]  # doubling, then capped: no heartbeat reset the streak
    assert robot.failures >= wanted and robot.last_exit not in (None, 0)
