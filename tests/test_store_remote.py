"""The segment store on S3 (``store.uri = s3://…``, a real S3 API server on loopback: moto's, from
tests/servers.py): the ingest path, every kind of search, tags and upkeep work there and answer
what the same ingest into a local store answers; nothing of the store is under the root; a store
that does not answer fails at open in one line naming it and the fix."""

from __future__ import annotations

import json
import threading
import time

import numpy as np
import pytest

from cli.main import main
from components.config import Settings, StoreConfig, load_settings
from components.pipeline.ingest import ingest_files
from components.pipeline.recipe import public_settings
from components.pipeline.workspace import Workspace
from components.store.location import SegmentStoreError
from components.store.segment_store import SearchResult, SegmentStore, table_exists
from tests.conftest import small_settings
from tests.servers import ARTIFACT_BUCKET, STORE_PREFIX, free_port, store_env
from tests.test_ingest import episode_files

PREFIX = STORE_PREFIX
EPISODES = 20
FRAMES = 64  # 15 segments each (window 8, stride 4): 300 rows, over IVF_PQ's 256-row minimum
K = 5
# k x refine_factor >= rows: the index's candidates are re-ranked exactly, so indexed hits equal exact ones
# vector_index_min_rows: LanceDB's own index on the object store, built as soon as it can be
STORE = {"index_min_rows": 256, "vector_index_min_rows": 256, "refine_factor": 64, "retain_versions_days": 0}


def _env(monkeypatch, s3_server, endpoint: str | None = None) -> str:
    """What tests.servers exports for the store (keys, AWS_ENDPOINT_URL, store.uri), with another
    endpoint if given; returns store.uri."""
    env = store_env(s3_server, PREFIX)
    env["AWS_ENDPOINT_URL"] = endpoint or env["AWS_ENDPOINT_URL"]
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    return env.pop("FLEETLOOP_STORE__URI")


def _object_bytes(s3_server, prefix: str) -> int:
    pages = s3_server.client().get_paginator("list_objects_v2").paginate(Bucket=ARTIFACT_BUCKET, Prefix=prefix)
    return sum(obj["Size"] for page in pages for obj in page.get("Contents", []))


def _searches(store: SegmentStore, queries: np.ndarray) -> dict[str, SearchResult]:
    """Few queries through LanceDB (its index, then flat) and many through the bulk scan."""
    few = queries[:3]
    assert len(queries) >= store.cfg.scan_min_queries > len(few)
    return {"indexed": store.search(few, K), "exact": store.search(few, K, exact=True),
            "scan": store.search(queries, K), "filtered": store.search(few, K, success=True, exact=True)}


def _same_hits(remote: SearchResult, local: SearchResult) -> None:
    assert remote.counts.tolist() == local.counts.tolist() and remote.counts.min() == K
    assert remote.segment_ids.tolist() == local.segment_ids.tolist()
    np.testing.assert_allclose(remote.distances, local.distances, rtol=1e-5)


def test_ingest_search_tags_and_upkeep_on_s3_answer_like_a_local_store(tmp_path, monkeypatch, s3_server):
    uri = _env(monkeypatch, s3_server)
    local = small_settings(tmp_path / "local", store=StoreConfig(**STORE))
    remote = small_settings(tmp_path / "remote", store=StoreConfig(uri=uri, **STORE))
    files = episode_files(local, tmp_path / "in", seed=7, count=EPISODES, frames=FRAMES)
    for settings in (local, remote):  # two ingests: two fragments, the second crosses index_min_rows
        ingest_files(settings, files[: EPISODES // 2], snapshot=False)
        ingest_files(settings, files[EPISODES // 2 :], snapshot=False)
    here, there = Workspace(local).store, Workspace(remote).store
    assert there.location.remote and there.uri == uri
    assert table_exists(there.location, remote.store.table) and not table_exists(there.location, "no-such-table")
    assert there.count() == here.count() == EPISODES * 15 and there.has_index()
    assert there.embed_cursor() == here.embed_cursor() is not None
    assert there.load_encoder().state_dict() == here.load_encoder().state_dict()

    queries = np.random.default_rng(0).standard_normal((there.cfg.scan_min_queries, there.dim)).astype(np.float32)
    local_hits = _searches(here, queries)
    remote_hits = _searches(there, queries)
    for kind, hits in remote_hits.items():
        _same_hits(hits, local_hits[kind])
    _same_hits(remote_hits["indexed"], remote_hits["exact"])

    # a re-ingest is a no-op there too (the cursor and the idempotency check read S3)
    version = there.version
    assert ingest_files(remote, files, snapshot=False).segments_upserted == 0
    assert Workspace(remote).store.version == version

    # tags and read-only views; upkeep compacts and prunes, its disk figures list the bucket
    there.tag("kept")
    view = there.checkout("kept")
    assert view.read_only and view.count() == there.count() and there.tags() == {"kept": version}
    there.untag("kept")  # a tag stops pruning from its version on
    report = Workspace(remote).store.upkeep()
    assert report.indexed and report.fragments_after < report.fragments_before
    assert report.versions_after == 1 < report.versions_before and report.tags == {}
    assert report.bytes_after == _object_bytes(s3_server, f"{PREFIX}/{local.store.table}.lance/") > 0
    _same_hits(Workspace(remote).store.search(queries[:3], K, exact=True), local_hits["exact"])

    assert not remote.paths.store.exists()  # nothing of the store under the root
    assert any(key.startswith(f"{PREFIX}/") for key in s3_server.keys(ARTIFACT_BUCKET, PREFIX))


def test_a_store_that_does_not_answer_fails_at_open_in_one_line_naming_it(tmp_path, monkeypatch, s3_server):
    endpoint = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    uri = _env(monkeypatch, s3_server, endpoint)
    settings: Settings = small_settings(tmp_path)
    with pytest.raises(SegmentStoreError) as raised:
        _ = Workspace(settings).store
    message = str(raised.value)
    assert message.startswith(f"segment store {uri} unreachable (endpoint {endpoint}): Connection refused; ")
    assert "\n" not in message and 'store.uri=""' in message and "AWS_ENDPOINT_URL" in message
    assert not settings.paths.store.exists()


def test_cli_names_the_unreachable_store_and_the_fix(tmp_path, monkeypatch, capsys, s3_server):
    endpoint = f"http://127.0.0.1:{free_port()}"
    uri = _env(monkeypatch, s3_server, endpoint)
    monkeypatch.setenv("FLEETLOOP_ROOT", str(tmp_path))
    assert main(["status"]) == 1
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 2, lines
    assert lines[0].startswith(f"error: segment store {uri} unreachable (endpoint {endpoint})")
    assert lines[1].startswith("fix: check AWS_ENDPOINT_URL")


def test_store_credentials_stay_out_of_settings_logs_and_params(tmp_path, monkeypatch):
    """Keys live in the environment only: a store URI carrying one is refused in params.yaml and
    redacted in what is logged; LanceDB gets timeouts and retries, never keys."""
    secret = "store-secret-key"
    (tmp_path / "params.yaml").write_text(f"store:\n  uri: s3://fleetloop:{secret}@bucket/segments\n")
    monkeypatch.setenv("FLEETLOOP_ROOT", str(tmp_path))
    with pytest.raises(ValueError, match="store.uri holds a password") as raised:
        load_settings()
    assert secret not in str(raised.value) and "FLEETLOOP_STORE__URI" in str(raised.value)

    (tmp_path / "params.yaml").write_text("{}\n")
    monkeypatch.setenv("FLEETLOOP_STORE__URI", f"s3://fleetloop:{secret}@bucket/segments")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", secret)
    monkeypatch.setenv("AWS_ENDPOINT_URL", "http://127.0.0.1:9000")
    settings = load_settings()
    logged = json.dumps(public_settings(settings))
    location = Workspace(settings).store_location
    assert secret not in logged + location.shown + json.dumps(location.options)
    assert location.shown == "s3://fleetloop:***@bucket/segments" and location.options["allow_http"] == "true"
    with pytest.raises(ValueError, match="store.uri 'bucket/segments'"):
        StoreConfig(uri="bucket/segments")


def _when(condition, then, poll_s: float = 0.01) -> threading.Thread:
    """Run ``then()`` on a thread as soon as ``condition()`` holds (polled)."""
    def watch() -> None:
        while not condition():
            time.sleep(poll_s)
        then()

    thread = threading.Thread(target=watch, daemon=True)
    thread.start()
    return thread


def test_a_store_lost_mid_flow_is_retried_fails_cleanly_and_the_next_run_completes(
        tmp_path, monkeypatch, s3_server, prefect_harness):
    """The ingest flow reaches S3 through a proxy that starts dropping every connection the moment
    the flow has committed the new episodes to the dataset: the store task retries
    (``ops.io_retries``), the flow fails, the store is still a valid table holding whole commits
    only, and the next run (store back) embeds exactly what the failed one left."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowRunFilter

    from components.config import OpsConfig
    from components.fleet.fault_proxy import DROP, PASS, FaultProxy
    from flows.ingest import ingest
    from flows.runtime import task_runner

    host, port = s3_server.endpoint.removeprefix("http://").split(":")
    proxy = FaultProxy(host, int(port)).start()
    uri = _env(monkeypatch, s3_server, endpoint=proxy.url)
    settings = small_settings(tmp_path / "root", store=StoreConfig(uri=uri + "-lost", **STORE, max_retries=0),
                              ops=OpsConfig(io_retries=2, retry_delays_s=(0.1,)))
    files = episode_files(settings, tmp_path / "in", seed=11, count=EPISODES, frames=FRAMES)
    run = ingest.with_options(task_runner=task_runner(settings))
    try:
        first = run(files[: EPISODES // 2], settings)
        _when(lambda: Workspace(settings).dataset.num_episodes == EPISODES, lambda: proxy.set_mode(DROP))
        state = run(files[EPISODES // 2 :], settings, return_state=True)
        assert state.is_failed(), state
        with get_client(sync_client=True) as client:
            tasks = client.read_task_runs(flow_run_filter=FlowRunFilter(id={"any_": [state.state_details.flow_run_id]}))
        failed = [t for t in tasks if t.state.is_failed()]
        assert failed and all(t.run_count == settings.ops.io_retries + 1 for t in failed), [
            (t.name, t.run_count, t.state.name) for t in tasks]
        assert Workspace(settings).dataset.num_episodes == EPISODES  # the dataset's commit stands

        proxy.set_mode(PASS)
        store = Workspace(settings).store
        stored = store.episode_ids()  # a valid table: the first run's commit, and the second's only if whole
        first_ids = set(Workspace(settings).dataset.episode_ids(0, first.added))  # the dataset keeps arrival order
        assert first.added == EPISODES // 2 and stored >= first_ids and store.count() == len(stored) * 15
        again = run([], settings)  # the next run: nothing new to store, the cursor finds what the store lacks
        store = Workspace(settings).store
        assert store.episode_ids() == set(Workspace(settings).dataset.episode_ids()) and len(store.episode_ids()) == EPISODES
        assert store.count() == EPISODES * 15 and again.segments_upserted == (EPISODES - len(stored)) * 15
        assert proxy.stats.dropped > 0  # the proxy really cut the store off
    finally:
        proxy.stop()
