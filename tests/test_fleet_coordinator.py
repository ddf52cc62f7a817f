"""Coordinator rules (leases, restart backoff over a real crashing process) and the inference warm-restart cache."""

from __future__ import annotations

import time

import pytest
import torch
from fastapi import HTTPException

from components.fleet.auth import ROBOT, SERVICE, SERVICE_NAME, Principal, issue_tokens, revoke_robot
from components.fleet.coordinator import Coordinator, restart_delay
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
