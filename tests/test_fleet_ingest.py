"""Ingest service over real HTTP: idempotent storage, quarantine with readable reasons, fuzzing,
and the issue-20 invariants: a bad upload fails only itself, the quarantine is bounded, per-robot
rate limit, disk full -> 507 + unhealthy, no unauthenticated API docs."""

from __future__ import annotations

import dataclasses
import resource
import stat
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import numpy as np
import pyarrow as pa
import pytest
from hypothesis import HealthCheck, event, given, settings as hsettings, strategies as st

from components.episodes.dataset import EpisodeDataset
from components.episodes.quarantine import read_reason
from components.episodes.schema import episode_to_ipc, episode_to_table, table_to_ipc
from components.fleet.auth import issue_tokens
from components.fleet.clients import IngestClient
from components.fleet.layout import RuntimeLayout
from components.fleet.local import running_service, service_url, synthetic_episode, with_free_ports
from tests.conftest import small_settings

ROBOT = "robot-0000"
FUZZ_EXAMPLES = 100


@pytest.fixture(scope="module")
def fleet(tmp_path_factory):
    root = tmp_path_factory.mktemp("ingest")
    # the fuzz test sends 100 uploads from one robot at once: no rate limit here (tested below)
    settings = with_free_ports(
        small_settings(root), max_upload_bytes=256 * 1024, commit_window_ms=5.0, upload_rate_per_s=1e6, upload_burst=10**6
    )
    layout = RuntimeLayout.of(settings).ensure()
    tokens = issue_tokens(layout.token_file, [ROBOT, "robot-0001"])
    with running_service(settings, "ingest") as proc:
        yield settings, tokens, proc


def _dataset(settings) -> EpisodeDataset:
    return EpisodeDataset(settings.paths.episodes, settings.episodes)


def _client(fleet, robot: str = ROBOT) -> IngestClient:
    settings, tokens, _ = fleet
    return IngestClient(service_url(settings, "ingest"), tokens.robots[robot], 10.0)


def test_upload_is_stored_once_however_often_it_is_sent(fleet):
    settings, _, _ = fleet
    client = _client(fleet)
    episode = synthetic_episode(ROBOT, seed=1)
    before = _dataset(settings).num_episodes
    first = client.upload(episode_to_ipc(episode))
    again = client.upload(episode_to_ipc(episode))
    assert (first.status, first.http_status) == ("added", 201)
    assert (again.status, again.http_status) == ("duplicate", 200)
    ds = _dataset(settings)
    assert ds.num_episodes == before + 1
    stored = [ep for ep in ds.episodes() if ep.episode_id == episode.episode_id]
    assert len(stored) == 1 and np.array_equal(stored[0].actions, episode.actions)


def test_same_id_different_content_is_refused_with_reason(fleet):
    settings, _, _ = fleet
    client = _client(fleet)
    episode = synthetic_episode(ROBOT, seed=2)
    assert client.upload(episode_to_ipc(episode)).status == "added"
    tampered = dataclasses.replace(episode, actions=episode.actions + 0.5)
    result = client.upload(episode_to_ipc(tampered))
    assert result.status == "rejected" and result.http_status == 422
    assert result.detail["field"] == "episode_id" and "different content" in result.detail["reason"]
    stored = [ep for ep in _dataset(settings).episodes() if ep.episode_id == episode.episode_id]
    assert len(stored) == 1 and np.array_equal(stored[0].actions, episode.actions)


def test_invalid_episode_is_quarantined_with_a_reason_the_client_reads(fleet):
    settings, _, _ = fleet
    episode = synthetic_episode(ROBOT, seed=3)
    states = episode.states.copy()
    states[4, 2] = np.nan
    before = _dataset(settings).num_episodes
    result = _client(fleet).upload(episode_to_ipc(dataclasses.replace(episode, states=states)))
    assert result.http_status == 422 and result.detail["field"] == "observation.state"
    assert "NaN" in result.detail["reason"] and result.detail["fix"]
    kept = Path(settings.paths.quarantine) / result.detail["quarantined_as"]
    assert kept.exists() and read_reason(kept)["field"] == "observation.state"
    assert _dataset(settings).num_episodes == before


def test_unreadable_and_oversized_uploads_are_refused(fleet):
    settings, _, _ = fleet
    client = _client(fleet)
    before = _dataset(settings).num_episodes
    garbage = client.upload(b"this is not arrow")
    assert garbage.http_status == 400 and "unreadable" in garbage.detail["reason"]
    big = client.upload(b"\0" * (settings.runtime.max_upload_bytes + 1))
    assert big.http_status == 413 and "limit" in big.detail["reason"]
    assert _dataset(settings).num_episodes == before


# ---------------------------------------------------------------------------------- fuzzing
ARROW_EOS = b"\xff\xff\xff\xff\x00\x00\x00\x00"  # continuation marker + zero metadata length


def _mutations(episode) -> list:
    """Ways to break a valid episode table, each a function table -> bytes."""
    table = episode_to_table(episode)

    def drop(col):
        return lambda: table_to_ipc(table.drop_columns([col]))

    def replace(col, array):
        return lambda: table_to_ipc(table.set_column(table.schema.get_field_index(col), col, array))

    n = table.num_rows
    return [
        drop("action"),
        drop("episode_id"),
        replace("timestamp", pa.array(np.zeros(n, dtype=np.float32))),
        replace("frame_index", pa.array(np.arange(n, dtype=np.int64)[::-1].copy())),
        replace("episode_id", pa.array(["not-a-uuid"] * n)),
        replace("robot_id", pa.array(["robot-9999-unknown"] * n)),
        replace("success", pa.array(np.arange(n) % 2 == 0)),
        replace("action", pa.array(np.zeros(n, dtype=np.float64))),
        replace("timestamp", pa.array([None] * n, pa.float32())),
        lambda: table_to_ipc(table.slice(0, 0)),
    ]


@st.composite
def malformed_uploads(draw):
    kind = draw(st.sampled_from(["bytes", "truncated", "mutated", "flipped"]))
    # seeds apart from the other tests' (the id follows the seed): a mutated upload that still parses is
    # stored, and one with seed 102 made test_a_malformed_upload...'s honest seed-102 episode a conflict
    episode = synthetic_episode(ROBOT, seed=draw(st.integers(100_000, 110_000)), length=draw(st.integers(2, 16)))
    valid = episode_to_ipc(episode)
    if kind == "bytes":
        return kind, draw(st.binary(min_size=0, max_size=2048))
    if kind == "truncated":
        # cut inside the messages: the end-of-stream marker is optional in Arrow's IPC format,
        # so a stream cut only there is whole (and the same episode as ``valid``)
        assert valid.endswith(ARROW_EOS)
        return kind, valid[: draw(st.integers(0, len(valid) - len(ARROW_EOS) - 1))]
    if kind == "mutated":
        return kind, draw(st.sampled_from(_mutations(episode)))()
    # flipped: corrupt bytes inside a valid stream (headers, buffers, lengths)
    data = bytearray(valid)
    for _ in range(draw(st.integers(1, 8))):
        position = draw(st.integers(0, len(data) - 1))
        data[position] = draw(st.integers(0, 255))
    if bytes(data) == valid:
        data = data[:-1]
    return kind, bytes(data)


@hsettings(max_examples=FUZZ_EXAMPLES, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(upload=malformed_uploads())
def test_fuzzed_uploads_get_a_4xx_with_a_reason_and_store_nothing(fleet, upload):
    kind, body = upload
    settings, tokens, proc = fleet
    url = service_url(settings, "ingest")
    before = _dataset(settings).num_episodes
    response = httpx.post(
        f"{url}/v1/episodes", content=body, headers={"Authorization": f"Bearer {tokens.robots[ROBOT]}"}, timeout=30.0
    )
    event(f"{kind} -> {response.status_code}")
    # A flipped byte can land in padding or a float value and leave a valid episode: only then
    # may something be stored, and it must have passed validation like any other upload.
    flipped_but_valid = kind == "flipped" and response.status_code in (200, 201)
    if not flipped_but_valid:
        assert 400 <= response.status_code < 500, response.text
        detail = response.json()["detail"]
        assert detail["reason"] and detail["field"]
        assert _dataset(settings).num_episodes == before
    assert proc.poll() is None
    assert httpx.get(f"{url}/healthz", timeout=5.0).status_code == 200


# ------------------------------------------------------------------ issue 20 invariants
def _with_column(episode, name: str, array) -> bytes:
    return table_to_ipc(episode_to_table(episode).append_column(name, array))


def test_a_malformed_upload_fails_only_itself_never_its_group_commit(fleet):
    """Issue 20: an extra column, float32 in one upload and a 3-vector in another, gave 500 to every
    honest upload committed in the same group, and the episode never left the robot's spool."""
    settings, _, _ = fleet
    n = 12
    honest = [synthetic_episode(ROBOT, seed=100 + i, length=n) for i in range(4)]
    scalar = _with_column(synthetic_episode(ROBOT, seed=110, length=n), "extra", pa.array(np.ones(n, np.float32)))
    vector = _with_column(
        synthetic_episode(ROBOT, seed=111, length=n), "extra",
        pa.FixedSizeListArray.from_arrays(pa.array(np.ones(3 * n, np.float32)), 3),
    )
    bodies = [episode_to_ipc(e) for e in honest[:2]] + [scalar, vector] + [episode_to_ipc(e) for e in honest[2:]]
    barrier = threading.Barrier(len(bodies))
    results: list = [None] * len(bodies)

    def send(i: int) -> None:
        client = _client(fleet)
        barrier.wait()  # all at once: they share group commits
        results[i] = client.upload(bodies[i])
        client.close()

    threads = [threading.Thread(target=send, args=(i,)) for i in range(len(bodies))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    good = [results[i] for i in (0, 1, 4, 5)]
    assert [(r.status, r.http_status) for r in good] == [("added", 201)] * 4
    for bad in (results[2], results[3]):
        assert (bad.status, bad.http_status) == ("rejected", 422)  # a 4xx: the agent does not retry it
        assert bad.detail["field"] == "extra" and "contract" in bad.detail["reason"] and bad.detail["fix"]
    stored = {ep.episode_id for ep in _dataset(settings).episodes()}
    assert {e.episode_id for e in honest} <= stored


def test_one_conflicting_member_of_a_group_commit_fails_alone(tmp_path):
    """The writer's fallback: a group whose commit fails is committed member by member."""
    from components.episodes.dataset import IncomingEpisode
    from components.fleet.ingest_service import GroupCommitWriter
    from components.fleet.quarantine_box import BoundedQuarantine

    settings = small_settings(tmp_path)
    dataset = _dataset(settings)
    original = synthetic_episode(ROBOT, seed=5)
    dataset.ingest_tables([IncomingEpisode(episode_to_table(original), "first")], {ROBOT}, None)
    tampered = dataclasses.replace(original, actions=original.actions + 1.0)  # same id, other content
    honest = synthetic_episode(ROBOT, seed=6)
    writer = GroupCommitWriter(dataset, {ROBOT}, BoundedQuarantine(settings.paths.quarantine, 10**6), 5.0, 2)
    try:
        futures = [
            writer.submit(IncomingEpisode(episode_to_table(e), f"upload:{ROBOT}:{i}"), e.episode_id, episode_to_ipc(e))
            for i, e in enumerate((tampered, honest))
        ]
        outcomes = [f.result(timeout=60) for f in futures]
    finally:
        writer.close()
    assert [o.status for o in outcomes] == ["rejected", "added"]
    assert outcomes[0].error.field == "episode_id" and outcomes[0].quarantined.reason_path.exists()
    assert writer.commits >= 1 and honest.episode_id in {e.episode_id for e in _dataset(settings).episodes()}


def test_api_docs_and_openapi_need_a_token_or_do_not_exist(fleet):
    settings, _, _ = fleet
    url = service_url(settings, "ingest")
    for path in ("/docs", "/redoc", "/openapi.json"):
        assert httpx.get(f"{url}{path}", timeout=10.0).status_code in (401, 404), path


@pytest.fixture(scope="module")
def strict(tmp_path_factory):
    """An ingest service with a small quarantine cap and a tight per-robot rate limit."""
    root = tmp_path_factory.mktemp("ingest-strict")
    settings = with_free_ports(small_settings(root), quarantine_max_bytes=8 * 1024, upload_rate_per_s=0.01, upload_burst=3)
    layout = RuntimeLayout.of(settings).ensure()
    tokens = issue_tokens(layout.token_file, [ROBOT, "robot-0001"])
    with running_service(settings, "ingest") as proc:
        yield settings, tokens, proc


def test_quarantine_is_bounded_and_keeps_0644_files_each_with_a_reason(strict):
    settings, tokens, _ = strict
    client = IngestClient(service_url(settings, "ingest"), tokens.robots["robot-0001"], 10.0)
    first, second, third = (client.upload(bytes([65 + i]) * 3000) for i in range(3))
    client.close()
    assert [r.http_status for r in (first, second, third)] == [400, 400, 400]  # still told why
    assert all(r.detail["reason"] and r.detail["field"] for r in (first, second, third))
    assert first.detail["quarantined_as"] and second.detail["quarantined_as"]
    assert third.detail["quarantined_as"] is None  # cap reached: not kept (the robot keeps its own copy)
    folder = Path(settings.paths.quarantine)
    files = [p for p in folder.iterdir() if p.is_file()]
    assert sum(p.stat().st_size for p in files) <= settings.runtime.quarantine_max_bytes
    kept = [p for p in files if not p.name.endswith(".reason.json")]
    assert len(kept) == 2
    for path in kept:
        assert path.stat().st_size == 3000 and read_reason(path)["reason"]
        assert stat.S_IMODE(path.stat().st_mode) == 0o644
        assert stat.S_IMODE(Path(str(path) + ".reason.json").stat().st_mode) == 0o644


def test_a_robot_over_its_upload_rate_gets_429_with_retry_after_and_others_do_not(strict):
    settings, tokens, _ = strict
    url = service_url(settings, "ingest")
    headers = {"Authorization": f"Bearer {tokens.robots[ROBOT]}"}
    answers = [httpx.post(f"{url}/v1/episodes", content=episode_to_ipc(synthetic_episode(ROBOT, seed=200 + i)), headers=headers, timeout=30.0) for i in range(4)]
    assert [a.status_code for a in answers] == [201, 201, 201, 429]
    limited = answers[-1]
    assert int(limited.headers["retry-after"]) >= 1 and limited.json()["detail"]["field"] == "rate"
    assert IngestClient(url, tokens.robots[ROBOT], 10.0).upload(b"x").retry_after_s >= 1  # the agent sees it
    assert limited.json()["detail"]["fix"]


def test_disk_full_answers_507_with_a_reason_and_healthz_turns_unhealthy(tmp_path):
    settings = with_free_ports(small_settings(tmp_path), min_free_bytes=2**62)  # more than any disk has free
    layout = RuntimeLayout.of(settings).ensure()
    tokens = issue_tokens(layout.token_file, [ROBOT])
    with running_service(settings, "ingest", require_healthy=False):
        url = service_url(settings, "ingest")
        health = httpx.get(f"{url}/healthz", timeout=10.0)
        assert health.status_code == 503 and health.json()["restart"] is False
        assert "min_free_bytes" in health.json()["reason"]
        result = IngestClient(url, tokens.robots[ROBOT], 10.0).upload(episode_to_ipc(synthetic_episode(ROBOT, seed=9)))
        assert (result.status, result.http_status) == ("retry", 507)  # kept in the spool, retried later
        assert result.detail["field"] == "disk" and "full" in result.detail["reason"] and result.retry_after_s >= 1
    assert _dataset(settings).num_episodes == 0 and not list(Path(settings.paths.quarantine).glob("*"))


def _files(folder: Path) -> dict[str, int]:
    """Every file under ``folder`` with its size (what a failed store must leave unchanged)."""
    return {str(p.relative_to(folder)): p.stat().st_size for p in folder.rglob("*") if p.is_file()} if folder.exists() else {}


@contextmanager
def write_limit(pid: int, max_bytes: int) -> Iterator[None]:
    """A real "no room" in process ``pid``, without root: RLIMIT_FSIZE makes every write past
    ``max_bytes`` fail with EFBIG (Python ignores SIGXFSZ), as a full disk or quota fails it."""
    soft, hard = resource.prlimit(pid, resource.RLIMIT_FSIZE)
    resource.prlimit(pid, resource.RLIMIT_FSIZE, (max_bytes, hard))
    try:
        yield
    finally:
        resource.prlimit(pid, resource.RLIMIT_FSIZE, (soft, hard))


def test_a_store_that_runs_out_of_room_answers_507_keeps_nothing_half_written_and_recovers(tmp_path):
    """Issue 20: disk full gave plain 500 while /healthz stayed 200, and 0-byte quarantine files
    with no reason. The service's writes really fail here (EFBIG from its file-size limit)."""
    settings = with_free_ports(small_settings(tmp_path), min_free_bytes=0)  # no reserve: the write itself fails
    layout = RuntimeLayout.of(settings).ensure()
    tokens = issue_tokens(layout.token_file, [ROBOT])
    url = service_url(settings, "ingest")
    with running_service(settings, "ingest") as proc:
        client = IngestClient(url, tokens.robots[ROBOT], 30.0)
        assert client.upload(episode_to_ipc(synthetic_episode(ROBOT, seed=20))).http_status == 201
        stored_before = _files(settings.paths.episodes)
        episode = synthetic_episode(ROBOT, seed=21)
        with write_limit(proc.pid, 0):
            full = client.upload(episode_to_ipc(episode))
            health = httpx.get(f"{url}/healthz", timeout=10.0)
            garbage = client.upload(b"G" * 5000)  # its quarantine write fails too: nothing half-written
        assert (full.status, full.http_status) == ("retry", 507), full.detail
        assert full.detail["field"] == "disk" and "File too large" in full.detail["reason"] and full.retry_after_s >= 1
        assert health.status_code == 503 and health.json()["restart"] is False and "room" in health.json()["reason"]
        assert garbage.http_status == 400 and garbage.detail["quarantined_as"] is None
        assert _files(settings.paths.episodes) == stored_before  # no partial, temp or 0-byte file left
        leftovers = _files(settings.paths.quarantine)
        assert not [n for n, size in leftovers.items() if size == 0 or not n.endswith(".reason.json") and n + ".reason.json" not in leftovers]
        again = client.upload(episode_to_ipc(episode))  # room is back: what the robot's retry does
        healthy = httpx.get(f"{url}/healthz", timeout=10.0)
        client.close()
    assert (again.status, again.http_status) == ("added", 201)
    assert healthy.status_code == 200
    dataset = _dataset(settings)
    assert dataset.num_episodes == 2 and {e.episode_id for e in dataset.episodes()} >= {episode.episode_id}


def test_what_the_service_stores_reaches_the_segment_store_by_the_ingest_flows_own_path(fleet):
    """Uploads are embedded into the segment store in the background (``embed_pending``, the
    function ``ingest_files`` runs): every stored episode gets its windows, and the store's embed
    cursor reaches the end of the dataset."""
    import time

    from components.pipeline.workspace import Workspace
    from components.store import episode_windows

    settings, _, _ = fleet
    client = _client(fleet, "robot-0001")
    episodes = [synthetic_episode("robot-0001", seed=700 + i) for i in range(3)]
    assert all(client.upload(episode_to_ipc(ep)).status == "added" for ep in episodes)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        ws = Workspace(settings)
        cursor = ws.store.embed_cursor() if ws.store.count() else None
        if cursor is not None and cursor.episodes == ws.dataset.num_episodes:
            break
        time.sleep(0.5)
    ws = Workspace(settings)
    assert ws.store.embed_cursor().episodes == ws.dataset.num_episodes
    assert {ep.episode_id for ep in episodes} <= ws.store.episode_ids() == set(ws.dataset.episode_ids(0))
    for ep in episodes:
        windows = len(episode_windows(ep, settings.store.window, settings.store.stride)[0])
        assert ws.store.count(f"episode_id = '{ep.episode_id}'") == windows
    stats = httpx.get(service_url(settings, "ingest") + "/v1/stats",
                      headers={"Authorization": f"Bearer {fleet[1].service}"}, timeout=10).json()
    assert stats["embedder"]["segments"] >= 3 and stats["embedder"]["last_error"] is None
