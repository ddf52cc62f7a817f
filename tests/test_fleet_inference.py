"""Inference service over real HTTP with a real MLflow registry: batching, versions, hot swap, canary."""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import numpy as np
import pytest
import torch

from components.fleet.auth import issue_tokens
from components.registry.canary import rollout_fraction
from components.fleet.clients import InferenceClient
from components.fleet.layout import RuntimeLayout
from components.fleet.local import register_policy, running_service, service_url, with_free_ports
from components.policy.factory import make_policy
from components.registry.model_registry import PolicyRegistry
from tests.conftest import small_settings

ROBOTS = [f"robot-{i:04d}" for i in range(8)]
OBS_DIM, ACT_DIM = 11, 3
SWAP_TIMEOUT_S = 60.0


def _policy(seed: int):
    torch.manual_seed(seed)
    return make_policy(OBS_DIM, ACT_DIM, small_settings(".").policy)


@pytest.fixture(scope="module")
def fleet(tmp_path_factory):
    root = tmp_path_factory.mktemp("inference")
    settings = with_free_ports(
        small_settings(root), alias_poll_s=0.2, batch_window_ms=20.0, max_batch=16, canary_share=0.5
    )
    layout = RuntimeLayout.of(settings).ensure()
    tokens = issue_tokens(layout.token_file, ROBOTS)
    registry = PolicyRegistry(settings.paths.mlruns, settings.registry)
    registry.set_champion(register_policy(settings, _policy(0)))
    with running_service(settings, "inference") as proc:
        yield settings, tokens, registry, proc


def _client(fleet, robot: str) -> InferenceClient:
    settings, tokens, _, _ = fleet
    return InferenceClient(service_url(settings, "inference"), tokens.robots[robot], 30.0)


def _expected(registry: PolicyRegistry, version: int, obs: np.ndarray) -> np.ndarray:
    with torch.no_grad():
        return registry.load(version).eval()(torch.as_tensor(obs)).numpy()


def _wait_for_version(client: InferenceClient, obs: np.ndarray, version: int) -> None:
    deadline = time.monotonic() + SWAP_TIMEOUT_S
    while time.monotonic() < deadline:
        if client.act(obs).version == version:
            return
        time.sleep(0.1)
    raise AssertionError(f"service never switched to v{version}")


def test_act_reports_the_version_and_matches_the_registered_model(fleet):
    _, _, registry, _ = fleet
    obs = np.random.default_rng(0).normal(size=OBS_DIM).astype(np.float32)
    result = _client(fleet, ROBOTS[0]).act(obs)
    champion = registry.champion().version
    assert (result.version, result.alias) == (champion, "champion") and result.policy_version == f"v{champion}"
    np.testing.assert_allclose(result.action, _expected(registry, champion, obs[None])[0], rtol=1e-5, atol=1e-6)


def test_concurrent_requests_are_batched_and_batching_changes_no_result(fleet):
    settings, tokens, registry, _ = fleet
    obs = np.random.default_rng(1).normal(size=(16, OBS_DIM)).astype(np.float32)
    clients = [_client(fleet, ROBOTS[i % len(ROBOTS)]) for i in range(16)]
    barrier = threading.Barrier(16)

    def call(i: int):
        barrier.wait()
        return clients[i].act(obs[i])

    with ThreadPoolExecutor(16) as pool:
        results = list(pool.map(call, range(16)))
    version = results[0].version
    expected = _expected(registry, version, obs)
    for i, result in enumerate(results):
        np.testing.assert_allclose(result.action, expected[i], rtol=1e-5, atol=1e-5)
    stats = httpx.get(
        f"{service_url(settings, 'inference')}/v1/stats", headers={"Authorization": f"Bearer {tokens.service}"}
    ).json()
    assert stats["max_batch_seen"] > 1 and stats["requests"] >= 16
    # where a tail would go: every batch's forward pass is timed, the loop is probed, GC is watched
    assert stats["forward"]["count"] == stats["batches"] and stats["forward"]["max_ms"] >= stats["forward"]["p50_ms"] > 0
    assert stats["loop_lag"]["count"] > 0 and stats["loop_lag"]["p50_ms"] >= 0
    assert stats["gc_pauses"]["count"] >= 0 and set(stats["gc_pauses"]) >= {"p99_ms", "max_ms"}
    assert stats["gc_frozen_objects"] > 10_000  # runtime.gc_freeze (default): start-up's heap left out of collections


def test_hot_swap_when_the_champion_moves_without_failing_requests(fleet):
    settings, _, registry, _ = fleet
    client = _client(fleet, ROBOTS[1])
    obs = np.random.default_rng(2).normal(size=OBS_DIM).astype(np.float32)
    old = registry.champion().version
    seen: list[int] = []
    errors: list[Exception] = []
    stop = threading.Event()

    def hammer():
        mine = _client(fleet, ROBOTS[2])
        while not stop.is_set():
            try:
                seen.append(mine.act(obs).version)
            except Exception as exc:  # noqa: BLE001 - collected and asserted below
                errors.append(exc)

    thread = threading.Thread(target=hammer)
    thread.start()
    try:
        new = register_policy(settings, _policy(1))
        registry.set_champion(new)
        _wait_for_version(client, obs, new)
        time.sleep(0.3)
    finally:
        stop.set()
        thread.join()
    assert not errors
    assert seen and seen[-1] == new and set(seen) <= {old, new}
    first_new = seen.index(new)
    assert all(v == new for v in seen[first_new:])  # never back to the old model
    np.testing.assert_allclose(client.act(obs).action, _expected(registry, new, obs[None])[0], rtol=1e-5, atol=1e-6)


def test_canary_serves_its_share_of_robots_then_everyone_returns_to_champion(fleet):
    settings, _, registry, _ = fleet
    champion = registry.champion().version
    canary = register_policy(settings, _policy(2))
    registry.client.set_registered_model_alias(settings.registry.model_name, "canary", str(canary))
    obs = np.zeros(OBS_DIM, dtype=np.float32)
    canaries = [r for r in ROBOTS if rollout_fraction(r) < settings.runtime.canary_share]
    assert 0 < len(canaries) < len(ROBOTS)  # the hash splits this fleet (checked, not assumed)
    _wait_for_version(_client(fleet, canaries[0]), obs, canary)
    for robot in ROBOTS:
        result = _client(fleet, robot).act(obs)
        expected = (canary, "canary") if robot in canaries else (champion, "champion")
        assert (result.version, result.alias) == expected, robot
        assert _client(fleet, robot).policy()["alias"] == expected[1]
    registry.client.delete_registered_model_alias(settings.registry.model_name, "canary")
    _wait_for_version(_client(fleet, canaries[0]), obs, champion)


def test_bad_requests_and_scopes(fleet):
    settings, tokens, _, proc = fleet
    url = service_url(settings, "inference")
    robot = {"Authorization": f"Bearer {tokens.robots[ROBOTS[0]]}"}
    assert httpx.post(f"{url}/v1/act", json={"obs": [1.0, 2.0]}, headers=robot).status_code == 422
    nan_body = ('{"obs": [' + ", ".join(["NaN"] * OBS_DIM) + "]}").encode()
    nan = httpx.post(f"{url}/v1/act", content=nan_body, headers=robot)
    assert nan.status_code == 422 and "NaN" in nan.json()["detail"]["reason"]
    assert httpx.post(f"{url}/v1/act", content=b"{not json", headers=robot).status_code == 422
    assert httpx.post(f"{url}/v1/act", json={"obs": [0.0] * OBS_DIM}).status_code == 401
    assert httpx.get(f"{url}/v1/stats", headers=robot).status_code == 403
    assert proc.poll() is None


def test_bad_observations_get_a_422_naming_the_element_never_a_500_blaming_the_model(fleet):
    """Issue 20: observations the model cannot be asked about got a 500 "model produced a
    non-finite action"; /docs and /openapi.json answered without a token."""
    settings, tokens, _, proc = fleet
    url = service_url(settings, "inference")
    robot = {"Authorization": f"Bearer {tokens.robots[ROBOTS[0]]}"}
    cases = {
        '{"obs": [3e38, 3e38' + ", 0" * (OBS_DIM - 2) + "]}": "obs[0]",  # finite, absurd: inf inside the model
        '{"obs": [0, 1e39' + ", 0" * (OBS_DIM - 2) + "]}": "obs[1]",  # overflows float32
        '{"obs": [0, 0, -Infinity' + ", 0" * (OBS_DIM - 3) + "]}": "obs[2]",
        '{"obs": ["nan"' + ", 0" * (OBS_DIM - 1) + "]}": "obs[0]",  # a string numpy would parse
        '{"obs": [true' + ", 0" * (OBS_DIM - 1) + "]}": "obs[0]",
    }
    for body, field in cases.items():
        answer = httpx.post(f"{url}/v1/act", content=body.encode(), headers=robot, timeout=10.0)
        assert answer.status_code == 422, (body, answer.text)
        detail = answer.json()["detail"]
        assert detail["field"] == field and detail["reason"] and detail["fix"], detail
    for path in ("/docs", "/redoc", "/openapi.json"):
        assert httpx.get(f"{url}{path}", timeout=10.0).status_code in (401, 404), path
    assert proc.poll() is None
