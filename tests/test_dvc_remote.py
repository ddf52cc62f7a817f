"""The episode dataset's DVC snapshots on an S3 remote (a real S3 API server on loopback): every
ingest pushes what the remote lacks; a registered model is rebuilt from the remote after the root's
DVC cache is lost; a remote that is down fails the ingest in one message, with the episodes kept."""

from __future__ import annotations

import json
import shutil

import pytest
import yaml

from cli.main import main
from components.config import EpisodesConfig
from components.episodes.snapshot import SnapshotPushError, read_snapshot
from components.pipeline import steps
from components.pipeline.collect import collect_expert_demos
from components.pipeline.evaluate import evaluate_policy
from components.pipeline.ingest import ingest_files
from components.pipeline.promote import register_candidate
from components.pipeline.recipe import public_settings
from components.pipeline.workspace import Workspace
from tests.conftest import small_settings
from tests.servers import ARTIFACT_BUCKET, free_port

PREFIX = "fleetloop-dvc"


def _remote_keys(s3_server, snapshot_hash: str) -> list[str]:
    """The remote's objects, and the snapshot's directory listing among them (DVC 3 layout)."""
    keys = s3_server.keys(ARTIFACT_BUCKET, PREFIX)
    assert f"{PREFIX}/files/md5/{snapshot_hash[:2]}/{snapshot_hash[2:]}" in keys, keys
    return keys


def test_snapshots_are_pushed_and_a_lost_cache_is_rebuilt_from_the_remote(tmp_path, monkeypatch, capsys, s3_server):
    for key, value in s3_server.env.items():
        monkeypatch.setenv(key, value)
    root = tmp_path / "root"
    remote = f"s3://{ARTIFACT_BUCKET}/{PREFIX}"
    settings = small_settings(root, episodes=EpisodesConfig(dvc_remote=remote, dvc_remote_endpoint=s3_server.endpoint))
    demos = collect_expert_demos(settings, tmp_path / "demos").files
    ingest_files(settings, demos[:6])
    first = read_snapshot(settings.paths.episodes)
    before = _remote_keys(s3_server, first.hash)

    # the remote is down: the ingest fails in one message naming it; the episodes are stored and snapshotted
    down = settings.model_copy(update={"episodes": settings.episodes.model_copy(
        update={"dvc_remote_endpoint": f"http://127.0.0.1:{free_port()}"})})
    with pytest.raises(SnapshotPushError, match=rf"could not be pushed to {remote} at http://127.0.0.1:\d+") as raised:
        ingest_files(down, demos[6:])
    assert "ingest again" in str(raised.value)
    second = read_snapshot(settings.paths.episodes)
    assert second.hash != first.hash and Workspace(settings).dataset.num_episodes == len(demos)
    assert s3_server.keys(ARTIFACT_BUCKET, PREFIX) == before  # nothing of it reached the remote
    ingest_files(settings, [])  # the remote is back: the next ingest pushes what it lacks
    assert len(_remote_keys(s3_server, second.hash)) > len(before)

    outcome = steps.train_policy(settings)
    assert outcome.lineage.snapshot_remote == remote and outcome.lineage.snapshot_hash == second.hash
    report = evaluate_policy(settings, outcome.result.policy, "candidate")
    version = register_candidate(settings, outcome, report, "remote-snapshot").version

    (root / "params.yaml").write_text(yaml.safe_dump(public_settings(settings)))
    monkeypatch.setenv("FLEETLOOP_ROOT", str(root))
    assert main(["lineage", str(version), "--json"]) == 0
    lineage = json.loads(capsys.readouterr().out)
    assert lineage["dvc_remote"] == remote and f"fleetloop reproduce {version}" in lineage["restore"]

    shutil.rmtree(root / ".dvc" / "cache")  # lose local state: only the remote has the data's history
    assert main(["reproduce", str(version), "--json", "--scratch", str(tmp_path / "scratch")]) == 0
    rebuilt = json.loads(capsys.readouterr().out)
    assert rebuilt["matches"] and rebuilt["episodes"] == len(demos)
    assert (tmp_path / "scratch" / ".dvc" / "cache").exists()  # pulled into the scratch root's own cache
