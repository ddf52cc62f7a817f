"""Episode files carry their camera streams: one mp4 per camera beside the table (camera_files.py),
written by the collect step, read by ingest, stored as video features; bad ones quarantined."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest

from components.config import CameraConfig, DemoConfig, Settings, SimConfig
from components.episodes.camera_files import CAMERAS_METADATA, found_sidecars, sidecar_path, without_camera_metadata
from components.episodes.incoming import read_incoming
from components.episodes.quarantine import QuarantinedFile, read_reason
from components.episodes.record import camera_key
from components.episodes.schema import read_episode_file
from components.episodes.encoder_process import encode_episodes
from components.episodes.video import read_all_frames
from components.pipeline.collect import collect_expert_demos, write_episodes
from components.pipeline.ingest import incoming_files, ingest_files
from components.pipeline.references import episode_files
from components.pipeline.workspace import Workspace
from components.sim.collect import run_episodes
from components.sim.factory import make_expert
from tests.conftest import small_settings

SCENE, GRIPPER = camera_key("scene"), camera_key("gripper")
CAMERAS = (SCENE, GRIPPER)
SIZE = 32
# Mean abs error (of 255) of a stored camera frame against the frame the sim rendered (noisy 32x32
# renders, AV1 at crf 30), measured over 24 episode-cameras: 6.8-8.8 (mean 7.6) through a file,
# which is encoded twice (the sidecar, then the store); the sidecar alone, like an in-memory
# episode's one encode, 6.5-7.5 (mean 6.9). Bound with margin; the other camera's frames are 32-36 off.
MAX_MEAN_ABS_ERROR = 11.0


def _settings(root: Path) -> Settings:
    """Expert demos of 2 robots x 2 episodes, both cameras on at SIZE x SIZE."""
    sim = SimConfig(max_steps=20, cameras=("scene", "gripper"), camera=CameraConfig(width=SIZE, height=SIZE))
    return small_settings(root, sim=sim, demo=DemoConfig(expert_robots=2, expert_episodes_per_robot=2))


def _episodes(settings: Settings, seed: int, count: int) -> list:
    robots = settings.fleet.robot_ids(2)
    return run_episodes(make_expert(settings.sim), robots, settings.sim, count, seed=seed, policy_version="expert")


def _stored_files(root: Path) -> dict[str, bytes]:
    """The dataset's data, video and episodes-table files (what an ingest must never rewrite)."""
    return {str(p.relative_to(root)): p.read_bytes() for folder in ("data", "videos", "meta/episodes")
            for p in sorted((root / folder).rglob("*")) if p.is_file()}


def test_collected_camera_episodes_are_ingested_with_their_frames(tmp_path: Path) -> None:
    settings = _settings(tmp_path)
    folder = settings.paths.incoming / "expert"
    demos = collect_expert_demos(settings, folder)
    episodes = _episodes(settings, settings.seed, settings.demo.expert_episodes_per_robot)  # the same, seeded
    for path, ep in zip(demos.files, episodes):
        assert path.name == f"{ep.robot_id}_{ep.episode_id}.parquet"
        assert found_sidecars(path) == {key: sidecar_path(path, key) for key in CAMERAS}
        assert sidecar_path(path, SCENE).name == f"{path.stem}.observation.images.scene.mp4"
        frames, times = read_all_frames(sidecar_path(path, GRIPPER))  # one episode, frame i at i / fps
        assert len(frames) == ep.length and times == pytest.approx(np.arange(ep.length) / settings.episodes.fps)
    # both folder expansions (a flow's folder, a scheduled run's datasets/incoming) take the tables only
    assert episode_files([folder]) == incoming_files(settings) == sorted(demos.files)

    result = ingest_files(settings, episode_files([folder]), snapshot=False)
    assert len(result.report.added) == len(episodes) and not result.report.quarantined
    dataset = Workspace(settings).dataset
    assert set(dataset.camera_keys) == set(CAMERAS)
    by_id = {ep.episode_id: ep for ep in episodes}
    errors = []
    for i, episode_id in enumerate(dataset.episode_ids()):
        back = dataset.camera_frames(i, CAMERAS)
        for key in CAMERAS:
            sent = by_id[episode_id].cameras[key]
            assert back[key].shape == sent.shape  # every frame, exactly
            errors.append(np.abs(back[key].astype(int) - sent).mean())
    print("mean abs error per episode and camera:", np.round(errors, 2))
    assert max(errors) < MAX_MEAN_ABS_ERROR, errors


def _bad_batch(settings: Settings, folder: Path) -> dict[str, Path]:
    """Four camera episodes, three of them broken in one way each: name -> episode file."""
    episodes = _episodes(settings, seed=11, count=2)
    files = dict(zip(("good", "missing", "garbage", "short"), write_episodes(episodes, folder, settings.episodes)))
    sidecar_path(files["missing"], GRIPPER).unlink()
    garbage = sidecar_path(files["garbage"], SCENE)
    garbage.write_bytes(garbage.read_bytes()[:200])  # truncated: the header, no frames
    short = episodes[list(files).index("short")]
    encode_episodes(sidecar_path(files["short"], SCENE), [short.cameras[SCENE][:-1]], settings.episodes.fps,
                    settings.episodes.video)
    return files


def test_bad_sidecars_quarantine_their_episode_and_nothing_stored_changes(tmp_path: Path) -> None:
    settings = _settings(tmp_path)
    first = write_episodes(_episodes(settings, seed=5, count=1), tmp_path / "first", settings.episodes)
    assert len(ingest_files(settings, first, snapshot=False).report.added) == 2
    root = settings.paths.episodes
    before = _stored_files(root)
    stored = Workspace(settings).dataset
    stored_frames = [stored.camera_frames(i) for i in range(2)]

    files = _bad_batch(settings, tmp_path / "batch")
    report = ingest_files(settings, list(files.values()), snapshot=False).report
    assert len(report.added) == 1 and report.frames_added > 0
    why = {Path(q.source).name: q for q in report.quarantined}
    assert set(why) == {files[name].name for name in ("missing", "garbage", "short")}
    expected = {"missing": (GRIPPER, "is missing"), "garbage": (SCENE, "is unreadable"), "short": (SCENE, "camera frames for")}
    for name, (key, words) in expected.items():
        q = why[files[name].name]
        assert q.field == key and words in q.reason and files[name].name in q.describe()
        assert not files[name].exists() and not found_sidecars(files[name])  # moved out, sidecars too
        assert {p.name for p in q.sidecars} == {sidecar_path(q.path, k).name for k in found_sidecars(q.path)}
        assert set(found_sidecars(q.path)) == set(CAMERAS) - ({GRIPPER} if name == "missing" else set())
        assert read_reason(q.path)["sidecars"] == [p.name for p in q.sidecars]
    assert files["good"].exists() and found_sidecars(files["good"])  # kept where it was, like any ingested file

    after = _stored_files(root)
    assert {k: v for k, v in after.items() if k in before} == before  # nothing stored was rewritten
    dataset = Workspace(settings).dataset
    assert dataset.num_episodes == 3 and set(dataset.camera_frames(2)) == set(CAMERAS)
    for i, frames in enumerate(stored_frames):
        for key, images in frames.items():
            np.testing.assert_array_equal(dataset.camera_frames(i)[key], images)


def test_a_sidecar_without_its_table_is_not_an_episode(tmp_path: Path) -> None:
    settings = _settings(tmp_path)
    folder = tmp_path / "in"
    path = write_episodes(_episodes(settings, seed=2, count=1)[:1], folder, settings.episodes)[0]
    path.unlink()  # the table is written last: a robot still uploading
    assert episode_files([folder]) == [] and len(found_sidecars(path)) == 2


def test_state_only_episodes_write_one_file_and_ingest_as_before(tmp_path: Path) -> None:
    settings = small_settings(tmp_path, sim=SimConfig(max_steps=20))
    demos = collect_expert_demos(settings, tmp_path / "demos")
    assert sorted(p.name for p in (tmp_path / "demos").iterdir()) == sorted(p.name for p in demos.files)
    assert json.loads(read_episode_file(demos.files[0]).schema.metadata[CAMERAS_METADATA]) == []
    result = ingest_files(settings, demos.files, snapshot=False)
    assert len(result.report.added) == demos.episodes and not result.report.quarantined
    dataset = Workspace(settings).dataset
    assert dataset.camera_keys == ()
    assert CAMERAS_METADATA not in (dataset.frames().schema.metadata or {})


def test_an_episode_file_without_the_cameras_entry_finds_its_sidecars(tmp_path: Path) -> None:
    """An uploader that writes no schema metadata: the sidecars beside the table are its cameras."""
    settings = _settings(tmp_path)
    path = write_episodes(_episodes(settings, seed=7, count=1)[:1], tmp_path / "in", settings.episodes)[0]
    pq.write_table(without_camera_metadata(read_episode_file(path)), path)
    report = ingest_files(settings, [path], snapshot=False).report
    assert len(report.added) == 1 and set(Workspace(settings).dataset.camera_frames(0)) == set(CAMERAS)


def test_a_cameras_entry_that_is_no_list_of_camera_keys_quarantines_the_file(tmp_path: Path) -> None:
    settings = _settings(tmp_path)
    path = write_episodes(_episodes(settings, seed=8, count=1)[:1], tmp_path / "in", settings.episodes)[0]
    table = read_episode_file(path)
    pq.write_table(table.replace_schema_metadata({CAMERAS_METADATA: b'["../../escape"]'}), path)
    q = read_incoming(path, settings.paths.quarantine)
    assert isinstance(q, QuarantinedFile) and "not a JSON list of camera keys" in q.reason and set(found_sidecars(q.path)) == set(CAMERAS)
