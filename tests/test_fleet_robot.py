"""Robot agent: write-ahead spool, retries until stored, safe action + interrupted on inference timeout."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from components.episodes.dataset import EpisodeDataset
from components.episodes.schema import episode_to_table, table_to_ipc
from components.fleet.auth import issue_tokens
from components.fleet.clients import CoordinatorClient, HeartbeatThread, InferenceClient, IngestClient
from components.fleet.layout import RuntimeLayout
from components.fleet.local import register_policy, running_service, service_url, synthetic_episode, with_free_ports
from components.fleet.robot_agent import Backoff, RobotAgent, RobotReport, Uploader, run_robot, safe_action
from components.fleet.spool import Spool, SpoolBusy, content_hash
from components.policy.factory import make_policy
from components.registry.model_registry import PolicyRegistry
from components.sim.pickplace import GRIPPER_ACTION
from tests.conftest import small_settings

ROBOT = "robot-0000"


def _spooled(spool: Spool, index: int, seed: int):
    episode = synthetic_episode(ROBOT, seed=seed)
    table = episode_to_table(episode)
    return spool.write(index, episode.episode_id, content_hash(table), table_to_ipc(table))


def test_spool_survives_restarts_and_never_reuses_an_index(tmp_path: Path):
    spool = Spool(tmp_path / ROBOT)
    first, second, third = (_spooled(spool, i, seed=i) for i in range(3))
    spool.ack(first, "added")
    spool.reject(third, {"reason": "bad", "field": "x"})
    with open(spool.ledger_path, "a") as ledger:
        ledger.write('{"index": 9, "episode_id": "torn')  # a crash mid-line
    reopened = Spool(tmp_path / ROBOT)  # a restarted robot process
    assert [p.episode_id for p in reopened.pending()] == [second.episode_id]
    assert reopened.next_index() == 3
    assert set(reopened.finished()) == {first.episode_id, second.episode_id, third.episode_id}
    assert (reopened.rejected_dir / (third.name + ".reason.json")).exists()
    reopened.ack(second, "duplicate")
    reopened.ack(second, "duplicate")  # acked twice (crash between ledger and unlink): read once
    assert [e.episode_id for e in reopened.ledger()].count(second.episode_id) == 1


class _SilentServer:
    """Accepts connections and never answers: what a hung inference service looks like."""

    def __init__(self) -> None:
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(16)
        self.port = self.sock.getsockname()[1]
        self.conns: list[socket.socket] = []
        self._thread = threading.Thread(target=self._accept, daemon=True)
        self._thread.start()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            self.conns.append(conn)

    def close(self) -> None:
        for conn in self.conns:
            conn.close()
        self.sock.close()


def test_inference_timeout_holds_a_safe_action_and_marks_the_episode_interrupted(tmp_path: Path):
    settings = small_settings(tmp_path)
    server = _SilentServer()
    try:
        client = InferenceClient(f"http://127.0.0.1:{server.port}", "unused-token-000", timeout_s=0.2)
        agent = RobotAgent(settings, ROBOT, client, Spool(tmp_path / "spool"))
        episode = agent.run_episode(0)
    finally:
        server.close()
    assert episode.interrupted and not episode.success and episode.length == 1
    np.testing.assert_array_equal(episode.actions[0], safe_action(3, -1.0))
    assert episode.actions[0, GRIPPER_ACTION] == -1.0 and episode.policy_version == "unavailable"


@pytest.fixture(scope="module")
def services(tmp_path_factory):
    root = tmp_path_factory.mktemp("robot")
    settings = with_free_ports(small_settings(root), robot_episodes=3, retry_initial_s=0.05, retry_max_s=0.3)
    settings = settings.model_copy(update={"sim": settings.sim.model_copy(update={"max_steps": 25})})
    layout = RuntimeLayout.of(settings).ensure()
    tokens = issue_tokens(layout.token_file, [ROBOT])
    torch_policy = make_policy(11, 3, settings.policy)
    PolicyRegistry(settings.paths.mlruns, settings.registry).set_champion(register_policy(settings, torch_policy))
    return settings, tokens


def test_robot_spools_first_and_uploads_once_the_ingest_service_appears(services):
    settings, tokens = services
    stop = threading.Event()
    with running_service(settings, "inference"):
        result: dict = {}
        robot = threading.Thread(target=lambda: result.setdefault("rc", run_robot(settings, ROBOT, tokens.robots[ROBOT], stop)))
        robot.start()  # ingest is not up yet: episodes must wait in the spool
        spool = Spool(RuntimeLayout.of(settings).spool(ROBOT))
        deadline = time.monotonic() + 60
        while spool.next_index() < 2 and time.monotonic() < deadline:
            time.sleep(0.1)
        assert spool.pending(), "episodes should be spooled while ingest is down"
        with running_service(settings, "ingest"):
            robot.join(timeout=120)
            stop.set()
            robot.join()
    assert result.get("rc") == 0
    finished = spool.finished()
    assert len(finished) == 3 and not spool.pending()
    meta = EpisodeDataset(settings.paths.episodes, settings.episodes).episodes_meta()
    stored = dict(zip(meta.column("episode_id").to_pylist(), meta.column("content_hash").to_pylist()))
    assert stored == finished  # every finished episode stored once, byte-for-byte the same content
    assert set(meta.column("policy_version").to_pylist()) == {"v1"}


# ------------------------------------------------------------------ issue 20 invariants
def _drain(settings, tokens, spool: Spool) -> tuple[RobotReport, bool]:
    """Run an uploader against a live ingest service until the spool is empty (60 s at most);
    returns its report and whether the uploader thread was still alive at the end."""
    with running_service(settings, "ingest"):
        client = IngestClient(service_url(settings, "ingest"), tokens.robots[ROBOT], 10.0)
        report = RobotReport(ROBOT)
        uploader = Uploader(spool, client, Backoff(0.05, 0.3, 0), report).start()
        try:
            deadline = time.monotonic() + 60.0
            while spool.pending() and time.monotonic() < deadline:
                time.sleep(0.05)
            return report, uploader.alive()
        finally:
            uploader.stop()
            client.close()


def test_an_unreadable_spool_entry_is_set_aside_and_the_uploader_goes_on(services, tmp_path: Path):
    """Issue 20: one unreadable spool entry killed the uploader thread; the process kept
    heartbeating and later episodes were never uploaded."""
    settings, tokens = services
    spool = Spool(tmp_path / "spool")
    first = _spooled(spool, 0, seed=300)
    broken = spool.pending_dir / f"{1:08d}.{'0' * 8}-0000-4000-8000-{'0' * 12}.{'f' * 16}.arrow"
    broken.mkdir()  # reading it raises (IsADirectoryError), as an unreadable file would
    last = _spooled(spool, 2, seed=302)
    report, alive = _drain(settings, tokens, spool)
    assert alive  # still running: the robot keeps its lease
    assert not spool.pending() and report.uploaded == 2 and report.unreadable == 1
    assert {e.episode_id for e in spool.ledger()} == {first.episode_id, last.episode_id}
    aside = spool.unreadable_dir / broken.name
    assert aside.exists() and "unreadable" in json.loads(Path(str(aside) + ".reason.json").read_text())["reason"]


def test_a_robot_whose_spool_was_lost_never_reuses_an_episode_id(services, tmp_path: Path):
    """Issue 20: a re-imaged robot restarted numbering and reused ids: new episodes were rejected
    422 ("already stored with different content") and lost."""
    settings, tokens = services
    server = _SilentServer()  # inference never answers: short, interrupted episodes suffice here
    folder = tmp_path / "spool"
    try:
        ids = []
        for life in range(2):
            spool = Spool(folder)
            client = InferenceClient(f"http://127.0.0.1:{server.port}", "unused-token-000", timeout_s=0.2)
            agent = RobotAgent(settings, ROBOT, client, spool)
            episode = agent.run_episode(spool.next_index())
            agent.finish(spool.next_index(), episode)
            item = spool.pending()[0]
            ids.append((spool.epoch, item, item.path.read_bytes()))
            shutil.rmtree(folder)  # re-imaged: ledger, spool and epoch gone
    finally:
        server.close()
    (epoch_a, first, first_bytes), (epoch_b, second, second_bytes) = ids
    assert first.index == second.index == 0 and epoch_a != epoch_b
    assert first.episode_id != second.episode_id
    with running_service(settings, "ingest"):
        ingest = IngestClient(service_url(settings, "ingest"), tokens.robots[ROBOT], 10.0)
        results = [ingest.upload(data) for data in (first_bytes, second_bytes)]
        ingest.close()
    assert [(r.status, r.http_status) for r in results] == [("added", 201), ("added", 201)]  # nothing lost


def test_a_4xx_upload_is_set_aside_with_its_reason_not_retried_forever(services, tmp_path: Path):
    settings, tokens = services
    spool = Spool(tmp_path / "spool")
    garbage = spool.write(0, "00000000-0000-4000-8000-000000000000", "0" * 16, b"not an episode")
    good = _spooled(spool, 1, seed=400)
    report, _ = _drain(settings, tokens, spool)
    assert not spool.pending() and (report.uploaded, report.rejected) == (1, 1)
    reason = json.loads((spool.rejected_dir / (garbage.name + ".reason.json")).read_text())
    assert reason["http_status"] == 400 and reason["reason"] and good.episode_id in {e.episode_id for e in spool.ledger()}


def test_two_agents_can_never_share_one_spool(tmp_path: Path):
    """Issue 20: two agents per robot on one spool uploaded one id with two contents (83 lost)."""
    first = Spool(tmp_path / "spool").claim()
    try:
        with pytest.raises(SpoolBusy):
            Spool(tmp_path / "spool").claim()
        probe = subprocess.run(
            [sys.executable, "-c", "import sys; from components.fleet.spool import Spool, SpoolBusy\n"
             "try:\n    Spool(sys.argv[1]).claim()\nexcept SpoolBusy:\n    sys.exit(3)", str(tmp_path / "spool")],
            cwd=str(Path(__file__).resolve().parents[1]),
        )
        assert probe.returncode == 3  # another process is refused too
    finally:
        os.close(first)
    os.close(Spool(tmp_path / "spool").claim())  # free again once the holder let go


class _BeatCounter:
    """A real loopback HTTP server that counts heartbeat POSTs (what the coordinator receives)."""

    def __init__(self) -> None:
        import http.server

        counter = self
        self.beats = 0

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802 - http.server's naming
                self.rfile.read(int(self.headers.get("content-length", 0)))
                counter.beats += 1
                self.send_response(200)
                self.send_header("content-length", "2")
                self.end_headers()
                self.wfile.write(b"{}")

            def log_message(self, *args) -> None:
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self._thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self._thread.start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def test_a_robot_whose_uploader_died_stops_renewing_its_lease():
    """Issue 20: the uploader thread died and the process kept heartbeating, so the coordinator
    never restarted it. The lease is now renewed only while the uploader lives."""
    server = _BeatCounter()
    uploader_alive = threading.Event()
    uploader_alive.set()
    client = CoordinatorClient(server.url, "unused-token-000", 5.0)
    beat = HeartbeatThread(client, ROBOT, 0.02, healthy=uploader_alive.is_set).start()
    try:
        deadline = time.monotonic() + 30.0
        while server.beats < 3 and time.monotonic() < deadline:
            time.sleep(0.02)
        assert server.beats >= 3  # renewing while healthy
        uploader_alive.clear()  # the uploader thread is gone

        def skipped_at_least(n: int) -> None:
            deadline = time.monotonic() + 30.0
            while beat.skipped < n and time.monotonic() < deadline:
                time.sleep(0.01)
            assert beat.skipped >= n

        skipped_at_least(1)  # the thread has looked since: no beat is in flight any more
        before = server.beats
        skipped_at_least(11)  # ten more intervals: not one renewal
        assert server.beats == before
    finally:
        beat.stop()
        client.close()
        server.close()
