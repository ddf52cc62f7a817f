"""The store-upkeep flow on a real store grown through the ingest path (real Prefect, LanceDB)."""

from __future__ import annotations

from components.pipeline.ingest import ingest_files
from components.pipeline.workspace import Workspace
from tests.conftest import small_settings
from tests.test_ingest import episode_files


def test_store_upkeep_flow_compacts_and_keeps_what_lineage_tagged(tmp_path, prefect_harness):
    from flows.upkeep import store_upkeep

    settings = small_settings(tmp_path, store=small_settings(tmp_path).store.model_copy(update={"retain_versions_days": 0}))
    # grown the way an older version grew roots: episodes-table files merged, data files never
    older = settings.model_copy(update={"episodes": settings.episodes.model_copy(update={"meta_merge_files": 2, "data_file_mb": 1e-6})})
    for seed in range(4):  # four ingests: four fragments, a dozen versions, four data files
        ingest_files(older, episode_files(settings, tmp_path / "in", seed=seed, count=3), snapshot=False)
    store = Workspace(settings).store
    tagged = store.tag("run-1")
    rows, ids = store.count(), store.episode_ids()
    dataset = Workspace(settings).dataset
    digest, data_files = dataset.content_hash(), len(dataset.data_files())

    report = store_upkeep(settings)
    dataset = Workspace(settings).dataset
    assert data_files == 4 and len(dataset.data_files()) < data_files  # the small data files merged
    assert dataset.content_hash() == digest and {e.episode_id for e in dataset.episodes()} == ids
    assert report.fragments_before == 4 and report.fragments_after == 1
    assert report.tags == {"run-1": tagged}
    store = Workspace(settings).store
    assert store.count() == rows and store.episode_ids() == ids
    assert store.checkout("run-1").count() == rows  # the tagged version still reads back
    # below store.vector_index_min_rows: no vector index yet, and upkeep says so
    assert not report.index_built and not report.indexed and not store.has_index()


def test_cli_store_upkeep_reports_json(tmp_path, monkeypatch, capsys, prefect_harness):
    import json

    from cli.main import main

    monkeypatch.setenv("FLEETLOOP_ROOT", str(tmp_path))
    settings = small_settings(tmp_path)
    ingest_files(settings, episode_files(settings, tmp_path / "in", seed=0, count=3), snapshot=False)
    ingest_files(settings, episode_files(settings, tmp_path / "in", seed=1, count=3), snapshot=False)
    assert main(["store-upkeep", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["fragments"] == "2 -> 1" and out["index"] == "none yet (below store.vector_index_min_rows)" and out["tags_kept"] == {}
    assert out["lancedb_version"] == Workspace(settings).store.version
