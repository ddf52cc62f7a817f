"""The episode dataset's DVC snapshots on an S3 remote (a real S3 API server on loopback): every
ingest pushes what the remote lacks; a registered model is rebuilt from the remote after the root's
DVC cache is lost; a remote that is down fails the ingest in one message before anything is stored.
The remote's dataset head lets two hosts take turns on one dataset, and catches them when they don't."""

from __future__ import annotations

import json
import shutil

import pytest
import yaml

from cli.main import main
from cli.reports import status_report
from components.config import EpisodesConfig
from components.episodes.dataset_head import (
    DatasetDivergedError,
    DatasetRemoteError,
    publish_head,
    read_head,
)
from components.episodes.snapshot import (
    SnapshotPushError,
    read_snapshot,
    snapshot_dataset,
)
from components.pipeline import steps
from components.pipeline.collect import collect_expert_demos
from components.pipeline.evaluate import evaluate_policy
from components.pipeline.ingest import (
    dvc_remote,
    ingest_files,
    read_file,
    store_episodes,
    sync_to_head,
)
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

    # the remote is down: the ingest fails in one message naming it, before storing anything
    down = settings.model_copy(update={"episodes": settings.episodes.model_copy(
        update={"dvc_remote_endpoint": f"http://127.0.0.1:{free_port()}"})})
    with pytest.raises(DatasetRemoteError, match=rf"dataset head on the DVC remote {remote} at http://127.0.0.1:\d+") as raised:
        ingest_files(down, demos[6:])
    assert "nothing local was changed" in str(raised.value)
    assert read_snapshot(settings.paths.episodes) == first and Workspace(settings).dataset.num_episodes == 6

    # an ingest that died after snapshotting, before its push: the root is ahead of the remote's head
    store_episodes(settings, [read_file(settings, f) for f in demos[6:]])
    second = snapshot_dataset(settings.root, settings.paths.episodes)
    assert second.hash != first.hash and s3_server.keys(ARTIFACT_BUCKET, PREFIX) == before
    assert read_head(dvc_remote(settings)).snapshot == first.hash
    assert ingest_files(settings, []).snapshot.hash == second.hash  # the next ingest pushes and publishes it
    assert len(_remote_keys(s3_server, second.hash)) > len(before)
    head = read_head(dvc_remote(settings))
    assert (head.snapshot, head.episodes, head.episodes_at(first.hash)) == (second.hash, len(demos), 6)

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


def test_two_roots_take_turns_on_one_dataset_through_the_remote_head(tmp_path):
    """Each ingest starts from the remote's head (pulled when another root moved it) and publishes
    its snapshot as the new head; a root whose own episodes and the head diverged is refused, with
    nothing overwritten on either side."""
    remote = str(tmp_path / "remote")  # a shared-path remote: the same code as s3:// (above), without a server
    host_a, host_b = (small_settings(tmp_path / name, episodes=EpisodesConfig(dvc_remote=remote)) for name in "ab")
    demos = collect_expert_demos(host_a, tmp_path / "demos").files
    first = ingest_files(host_a, demos[:4]).snapshot
    assert not host_b.paths.episodes.exists()

    second = ingest_files(host_b, demos[4:8]).snapshot  # pulls A's 4 episodes first, then adds its own
    assert Workspace(host_b).dataset.num_episodes == 8 and read_head(dvc_remote(host_b)).snapshot == second.hash
    third = ingest_files(host_a, demos[8:10]).snapshot  # fast-forwards to B's head, then adds
    ids_a = set(Workspace(host_a).dataset.episode_ids())
    assert len(ids_a) == 10 and set(Workspace(host_b).dataset.episode_ids()) < ids_a
    head = read_head(dvc_remote(host_a))
    assert [head.episodes_at(s.hash) for s in (first, second, third)] == [4, 8, 10]

    # B stores an episode without publishing it, while the head moved on: refused, nothing lost
    store_episodes(host_b, [read_file(host_b, demos[10])])
    with pytest.raises(DatasetDivergedError, match="two hosts ingested. Nothing was overwritten"):
        ingest_files(host_b, [])
    assert Workspace(host_b).dataset.num_episodes == 9 and read_head(dvc_remote(host_b)).snapshot == third.hash
    assert status_report(host_b, 0)["dataset_head"] == {"remote": remote, "snapshot": third.hash, "episodes": 10,
                                                      "this_root": "diverged"}
    stale = snapshot_dataset(host_b.root, host_b.paths.episodes)  # and a publish built on an old head is refused too
    with pytest.raises(DatasetDivergedError, match="another host ingests into the same dataset"):
        publish_head(host_b.paths.episodes, dvc_remote(host_b), stale.hash, 9)

    (tmp_path / "a" / "datasets" / "episodes.head.json").unlink()  # A loses its record of the head: still current
    assert sync_to_head(host_a).action == "current"


def test_a_failed_push_keeps_the_snapshot_unpublished_until_the_next_ingest(tmp_path):
    """The remote takes the head but not the data (its file area is broken): the ingest fails in one
    message, the episodes and their snapshot stay in the root, ahead of the head; the next ingest
    after the fix pushes and publishes them."""
    remote = tmp_path / "remote"
    settings = small_settings(tmp_path / "root", episodes=EpisodesConfig(dvc_remote=str(remote)))
    demos = collect_expert_demos(settings, tmp_path / "demos").files
    first = ingest_files(settings, demos[:4]).snapshot
    files = remote / "files"
    files.rename(remote / "files-aside")
    files.write_text("not a folder")
    with pytest.raises(SnapshotPushError, match=rf"could not be pushed to {remote} .*then ingest again"):
        ingest_files(settings, demos[4:8])
    assert Workspace(settings).dataset.num_episodes == 8 and read_head(dvc_remote(settings)).snapshot == first.hash
    assert sync_to_head(settings).action == "ahead"
    files.unlink()
    (remote / "files-aside").rename(files)
    assert ingest_files(settings, []).snapshot.hash == read_head(dvc_remote(settings)).snapshot != first.hash
