"""A vision champion on the fleet (issue #47): camera requests to the real inference service
(camera_wire.py's binary body), the 409/422s that say how to fix a request, a robot with cameras
whose episodes reach the dataset with their frames, and a spooled camera episode that survives a kill."""

from __future__ import annotations

import json
import struct
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack

import httpx
import numpy as np
import pytest
import torch
from hypothesis import given, settings as hsettings, strategies as st

from components.config import PolicyConfig, SimConfig
from components.episodes.dataset import EpisodeDataset
from components.episodes.record import camera_key
from components.episodes.schema import episode_to_table, table_to_ipc
from components.fleet.auth import TokenBook, issue_tokens
from components.fleet.camera_wire import (
    EPISODE_MAGIC, OBS_MAGIC, OBS_TYPE, WireError, decode_episode, decode_obs, encode_episode, encode_obs,
)
from components.fleet.clients import IngestClient, InferenceClient, ObservationRefused
from components.fleet.inference_service import create_inference_app
from components.fleet.layout import RuntimeLayout
from components.fleet.local import register_policy, running_service, service_url, synthetic_episode, with_free_ports
from components.fleet.robot_agent import RobotAgent, run_robot
from components.fleet.spool import Spool
from components.policy.factory import make_policy
from components.policy.observation import configured_layout
from components.registry.model_registry import PolicyRegistry
from components.sim.factory import action_dim, observation_dim
from tests.conftest import small_settings

SIZE = 16
VISION = PolicyConfig(kind="vision", hidden=32, layers=2, vision_channels=4, vision_feature=8, augment_shift=2)
CAMERA_SIM = SimConfig(cameras=("scene", "gripper"), max_steps=12)
CAMERA_SIM = CAMERA_SIM.model_copy(update={"camera": CAMERA_SIM.camera.model_copy(update={"width": SIZE, "height": SIZE})})
KEYS = (camera_key("gripper"), camera_key("scene"))
STATE, ACTION = observation_dim(CAMERA_SIM), action_dim(CAMERA_SIM)
ROBOTS = ["robot-0000", "robot-0001"]
CLIENTS = 8


def _vision_policy():
    torch.manual_seed(0)
    return make_policy(STATE, ACTION, VISION, configured_layout(STATE, VISION, CAMERA_SIM)).eval()


def _obs(seed: int) -> tuple[np.ndarray, dict[str, np.ndarray]]:
    rng = np.random.default_rng(seed)
    return rng.normal(size=STATE).astype(np.float32), {k: rng.integers(0, 256, (SIZE, SIZE, 3), dtype=np.uint8) for k in KEYS}


def _direct(policy, states: np.ndarray, images: dict[str, np.ndarray]) -> np.ndarray:
    """The policy called in this process as the service calls it (one torch thread)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with torch.no_grad():
            return policy(torch.from_numpy(policy.layout.pack(states, images))).numpy()
    finally:
        torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def fleet(tmp_path_factory):
    root = tmp_path_factory.mktemp("vision-fleet")
    settings = with_free_ports(
        small_settings(root, sim=CAMERA_SIM, policy=VISION), batch_window_ms=30.0, max_batch=CLIENTS, robot_episodes=2,
        retry_initial_s=0.05, retry_max_s=0.3, commit_window_ms=5.0,
    )
    layout = RuntimeLayout.of(settings).ensure()
    tokens = issue_tokens(layout.token_file, ROBOTS)
    policy = _vision_policy()
    with ExitStack() as stack, ThreadPoolExecutor(1) as pool:
        # ingest starts while the champion is registered (MLflow): most of this module's time
        ingest = pool.submit(stack.enter_context, running_service(settings, "ingest"))
        while not layout.settings_file.exists() and not ingest.done():  # one writer of the settings file at a time
            time.sleep(0.05)
        PolicyRegistry(settings.paths.mlruns, settings.registry).set_champion(register_policy(settings, policy))
        stack.enter_context(running_service(settings, "inference"))
        ingest.result()
        yield settings, tokens, policy


def _client(fleet, robot: str = ROBOTS[0]) -> InferenceClient:
    settings, tokens, _ = fleet
    return InferenceClient(service_url(settings, "inference"), tokens.robots[robot], 30.0)


def _post(fleet, content: bytes, content_type: str = OBS_TYPE) -> httpx.Response:
    settings, tokens, _ = fleet
    return httpx.post(f"{service_url(settings, 'inference')}/v1/act", content=content, timeout=30.0,
                      headers={"Authorization": f"Bearer {tokens.robots[ROBOTS[0]]}", "Content-Type": content_type})


def test_a_camera_request_gets_the_policys_own_action_bit_for_bit(fleet):
    _, _, policy = fleet
    client = _client(fleet)
    assert client.cameras() == {key: (SIZE, SIZE) for key in KEYS}
    state, images = _obs(0)
    result = client.act(state, images)
    expected = _direct(policy, state[None], {k: v[None] for k, v in images.items()})[0]
    assert np.array_equal(result.action, expected) and result.alias == "champion"


def test_camera_requests_from_concurrent_robots_are_batched_without_changing_a_result(fleet):
    settings, tokens, policy = fleet
    observations = [_obs(10 + i) for i in range(CLIENTS)]
    clients = [_client(fleet, ROBOTS[i % 2]) for i in range(CLIENTS)]
    barrier = threading.Barrier(CLIENTS)

    def call(i: int):
        barrier.wait()
        return clients[i].act(*observations[i])

    with ThreadPoolExecutor(CLIENTS) as pool:
        results = list(pool.map(call, range(CLIENTS)))
    states = np.stack([o[0] for o in observations])
    expected = _direct(policy, states, {k: np.stack([o[1][k] for o in observations]) for k in KEYS})
    for i, result in enumerate(results):
        np.testing.assert_allclose(result.action, expected[i], rtol=1e-5, atol=1e-6)
    stats = httpx.get(f"{service_url(settings, 'inference')}/v1/stats",
                      headers={"Authorization": f"Bearer {tokens.service}"}).json()
    assert stats["max_batch_seen"] > 1


def _raw_body(header: dict, tail: bytes) -> bytes:
    head = json.dumps(header).encode()
    return OBS_MAGIC + struct.pack("<I", len(head)) + head + tail


def test_wrong_cameras_are_422s_naming_the_camera_and_the_fix(fleet):
    state, images = _obs(1)
    cases = {
        "missing": (encode_obs(state, {KEYS[0]: images[KEYS[0]]}), "cameras", "GET /v1/policy"),
        "renamed": (encode_obs(state, {KEYS[0]: images[KEYS[0]], "observation.images.wrist": images[KEYS[1]]}),
                    "cameras", "GET /v1/policy"),
        "shape": (encode_obs(state, {**images, KEYS[1]: np.zeros((SIZE, SIZE // 2, 3), np.uint8)}),
                  f"cameras[{KEYS[1]}].shape", "sim.camera.height"),
        "dtype": (_raw_body({"obs": state.tolist(), "cameras": [{"key": KEYS[0], "shape": [SIZE, SIZE, 3],
                                                                 "dtype": "float32"}]}, bytes(SIZE * SIZE * 12)),
                  f"cameras[{KEYS[0]}].dtype", "uint8"),
        "truncated": (encode_obs(state, images)[:-10], f"cameras[{KEYS[1]}].shape", "whole"),
        "trailing": (encode_obs(state, images) + b"xx", "body", "camera_wire"),
        "state": (encode_obs(np.zeros(STATE - 1, np.float32), images), "obs", "finite numbers"),
        "not camera": (b'{"obs": [1, 2]}', "body", "camera_wire"),
    }
    for name, (body, field, fix) in cases.items():
        response = _post(fleet, body)
        assert response.status_code == 422, (name, response.text)
        detail = response.json()["detail"]
        assert detail["field"] == field and fix in detail["fix"], (name, detail)


def test_a_state_request_to_a_vision_model_is_a_409_that_says_to_send_the_frames(fleet):
    state, _ = _obs(2)
    response = _post(fleet, json.dumps({"obs": state.tolist()}).encode(), "application/json")
    assert response.status_code == 409
    detail = response.json()["detail"]
    assert detail["field"] == "cameras" and OBS_TYPE in detail["fix"] and all(k in detail["reason"] for k in KEYS)
    with pytest.raises(ObservationRefused):
        _client(fleet).act(state)


def test_frames_to_a_state_model_are_a_409_that_says_to_send_the_state_alone(tmp_path):
    """In process (FastAPI's TestClient): the service serving a state policy, asked with frames."""
    from fastapi.testclient import TestClient

    settings = small_settings(tmp_path, sim=CAMERA_SIM)
    book_file = RuntimeLayout.of(settings).ensure().token_file
    tokens = issue_tokens(book_file, ROBOTS)
    torch.manual_seed(0)
    state_policy = make_policy(STATE, ACTION, settings.policy)
    app = create_inference_app(settings, TokenBook(book_file), lambda: {"champion": 1}, lambda version: state_policy)
    state, images = _obs(3)
    auth = {"Authorization": f"Bearer {tokens.robots[ROBOTS[0]]}"}
    with TestClient(app) as http:
        assert http.get("/v1/policy", headers=auth).json()["cameras"] == {}
        refused = http.post("/v1/act", content=encode_obs(state, images), headers={**auth, "Content-Type": OBS_TYPE})
        answered = http.post("/v1/act", json={"obs": state.tolist()}, headers=auth)
    assert refused.status_code == 409
    assert refused.json()["detail"]["field"] == "cameras" and '{"obs"' in refused.json()["detail"]["fix"]
    assert answered.status_code == 200 and answered.json()["version"] == 1


def test_a_robot_with_cameras_uploads_episodes_whose_frames_the_dataset_keeps(fleet):
    settings, tokens, _ = fleet
    robot = ROBOTS[1]
    stop = threading.Event()
    result: dict = {}
    thread = threading.Thread(target=lambda: result.setdefault("rc", run_robot(settings, robot, tokens.robots[robot], stop)))
    thread.start()
    thread.join(timeout=120)
    stop.set()
    thread.join()
    assert result.get("rc") == 0
    spool = Spool(RuntimeLayout.of(settings).spool(robot))
    finished = spool.finished()
    dataset = EpisodeDataset(settings.paths.episodes, settings.episodes)
    meta = dataset.episodes_meta()
    stored = dict(zip(meta.column("episode_id").to_pylist(), meta.column("content_hash").to_pylist()))
    assert len(finished) == 2 and not spool.pending()
    assert {k: stored[k] for k in finished} == finished  # stored once each, frames in the hash
    assert set(dataset.camera_keys) == set(KEYS)
    for index, (episode_id, length) in enumerate(zip(meta.column("episode_id").to_pylist(), meta.column("length").to_pylist())):
        if episode_id in finished:
            frames = dataset.camera_frames(index)
            assert {k: v.shape for k, v in frames.items()} == {k: (length, SIZE, SIZE, 3) for k in KEYS}
            assert all(v.std() > 0 for v in frames.values())  # rendered scenes, not blank frames


def _camera_episode(robot: str, seed: int, length: int = 6, frames: int | None = None):
    import dataclasses

    episode = synthetic_episode(robot, seed=seed, length=length)
    rng = np.random.default_rng(seed)
    cameras = {k: rng.integers(0, 256, (frames or length, SIZE, SIZE, 3), dtype=np.uint8) for k in KEYS}
    return dataclasses.replace(episode, cameras=cameras)


def test_a_spooled_camera_episode_survives_a_kill_and_a_bad_one_is_quarantined_with_its_reason(fleet, tmp_path):
    settings, tokens, _ = fleet
    robot = ROBOTS[0]
    episode = _camera_episode(robot, seed=40)
    agent = RobotAgent(settings, robot, _client(fleet, robot), Spool(tmp_path / "spool"))
    agent.finish(0, episode)
    del agent  # killed before uploading: a fresh process finds the entry whole
    (item,) = Spool(tmp_path / "spool").pending()
    table_bytes, frames = decode_episode(item.path.read_bytes())
    assert table_bytes == table_to_ipc(episode_to_table(episode))
    assert all(np.array_equal(frames[k], episode.cameras[k]) for k in KEYS)
    ingest = IngestClient(service_url(settings, "ingest"), tokens.robots[robot], 30.0)
    assert ingest.upload(item.path.read_bytes()).status == "added"
    assert ingest.upload(item.path.read_bytes()).status == "duplicate"
    stored = EpisodeDataset(settings.paths.episodes, settings.episodes).episodes_meta()
    assert dict(zip(stored.column("episode_id").to_pylist(), stored.column("content_hash").to_pylist()))[
        episode.episode_id] == item.content_hash

    bad = _camera_episode(robot, seed=41, frames=5)  # 5 frames for 6 rows
    rejected = ingest.upload(encode_episode(table_to_ipc(episode_to_table(bad)), bad.cameras))
    assert rejected.status == "rejected" and rejected.http_status == 422
    assert rejected.detail["field"] in KEYS and "5 camera frames for 6 table rows" in rejected.detail["reason"]
    assert rejected.detail["quarantined_as"] and rejected.detail["fix"]
    garbled = ingest.upload(encode_episode(b"not arrow", bad.cameras)[:-7])
    assert garbled.status == "rejected" and garbled.http_status == 400 and garbled.detail["quarantined_as"]
    renamed = ingest.upload(encode_episode(table_to_ipc(episode_to_table(bad)), {"observation.state": bad.cameras[KEYS[0]]}))
    assert renamed.status == "rejected" and renamed.detail["field"] == "observation.state"
    ingest.close()
    kept = {p.name for p in settings.paths.quarantine.rglob("*")}
    assert {rejected.detail["quarantined_as"], garbled.detail["quarantined_as"], renamed.detail["quarantined_as"]} <= kept


@hsettings(max_examples=200, deadline=None)
@given(st.binary(max_size=200), st.sampled_from([OBS_MAGIC, EPISODE_MAGIC]))
def test_the_wire_decoder_never_fails_but_with_a_wire_error(tail: bytes, magic: bytes):
    """Untrusted bytes after a valid magic: decoded, or refused with the field named (never a crash)."""
    for body in (magic + tail, magic + struct.pack("<I", len(tail)) + tail):
        try:
            (decode_obs if magic == OBS_MAGIC else decode_episode)(body)
        except WireError as exc:
            assert exc.field and exc.reason and exc.fix


_VALID = encode_obs(np.arange(3, dtype=np.float32), {KEYS[0]: np.zeros((2, 2, 3), np.uint8)})


@hsettings(max_examples=300, deadline=None)
@given(st.lists(st.tuples(st.integers(0, len(_VALID) - 1), st.integers(0, 255)), min_size=1, max_size=4),
       st.integers(0, len(_VALID)))
def test_a_mutated_camera_body_decodes_or_is_refused_with_the_field(edits, cut: int):
    body = bytearray(_VALID)
    for position, value in edits:
        body[position] = value
    try:
        decode_obs(bytes(body[:cut]) if cut < len(body) else bytes(body))
    except WireError as exc:
        assert exc.field and exc.reason and exc.fix
