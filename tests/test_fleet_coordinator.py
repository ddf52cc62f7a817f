"""Coordinator rules and the inference warm-restart cache (no processes started here)."""

from __future__ import annotations

import pytest
import torch
from fastapi import HTTPException

from components.fleet.auth import ROBOT, SERVICE, SERVICE_NAME, Principal
from components.fleet.coordinator import Coordinator
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
