"""Camera streams stored as LeRobot v3 video features: encode, read back by timestamp, validate."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import numpy as np
import pytest

from components.config import CameraConfig, EpisodesConfig, SimConfig, VideoConfig
from components.episodes.dataset import EpisodeDataset, IncomingEpisode
from components.episodes.encoder_process import encode_episodes
from components.episodes.record import Episode, camera_key
from components.episodes.schema import episode_to_table
from components.episodes.validation import EpisodeValidationError
from components.episodes.video import (
    FrameTimestampError,
    VideoReader,
    decode_frames,
    episode_frames,
    tolerance_s,
)
from components.sim.collect import run_episodes
from components.sim.factory import make_expert

SCENE, GRIPPER = camera_key("scene"), camera_key("gripper")
FPS = 10.0


def _flat(n: int, value: int, size: int = 32) -> np.ndarray:
    """n frames of one grey level each, value + i (smooth: the lossy codec keeps them close)."""
    levels = (value + np.arange(n)) % 256
    return np.broadcast_to(levels[:, None, None, None].astype(np.uint8), (n, size, size, 3)).copy()


@pytest.fixture(scope="module")
def camera_episodes() -> list[Episode]:
    cfg = SimConfig(max_steps=20, cameras=("scene", "gripper"), camera=CameraConfig(width=32, height=32))
    return run_episodes(make_expert(cfg), ["robot-0000", "robot-0001"], cfg, 2, seed=3, policy_version="expert")


def _dataset(root: Path, encode: str = "background") -> EpisodeDataset:
    return EpisodeDataset(root, EpisodesConfig(fps=FPS, video=VideoConfig(encode=encode)))


def _stored(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file() and p.name != ".fleetloop.lock"}


def test_tolerance_is_lerobots_rule() -> None:
    assert tolerance_s(10.0) == pytest.approx(0.1 - 1e-4) and tolerance_s(30.0) == pytest.approx(1 / 30 - 1e-4)


def test_several_episodes_per_file_read_back_by_timestamp(tmp_path: Path) -> None:
    streams = [_flat(12, 10), _flat(7, 120), _flat(20, 60)]
    path = tmp_path / "file-000.mp4"
    spans = encode_episodes(path, streams, FPS, VideoConfig())
    assert [(s.from_timestamp, s.to_timestamp) for s in spans] == [(0.0, 1.2), (1.2, 1.9), (1.9, 3.9)]
    with VideoReader(path) as reader:  # in order: each read goes on where the last one stopped
        in_order = [episode_frames(reader, span, np.arange(len(f)) / FPS, FPS) for f, span in zip(streams, spans)]
    for frames, span, back in zip(streams, spans, in_order):
        assert back.shape == frames.shape and back.dtype == np.uint8
        assert np.abs(back.astype(int) - frames).max() <= 3
        with VideoReader(path) as reader:  # alone: seeks to the keyframe before it
            np.testing.assert_array_equal(back, episode_frames(reader, span, np.arange(len(frames)) / FPS, FPS))
    with VideoReader(path) as reader:  # backwards, then forwards past a gap: seeks each time
        backwards = [episode_frames(reader, span, np.arange(len(f)) / FPS, FPS) for f, span in zip(streams[::-1], spans[::-1])]
        np.testing.assert_array_equal(episode_frames(reader, spans[2], np.arange(20) / FPS, FPS), in_order[2])
    for a, b in zip(backwards[::-1], in_order):
        np.testing.assert_array_equal(a, b)
    # the nearest frame within the tolerance, as LeRobot's reader gives it; none past it
    nearly = decode_frames(path, [1.2 + 0.04], tolerance_s(FPS))
    np.testing.assert_array_equal(nearly, decode_frames(path, [1.2], tolerance_s(FPS)))
    with pytest.raises(FrameTimestampError, match="no frame"):
        decode_frames(path, [3.9 + 0.1], tolerance_s(FPS))


def test_camera_episodes_are_stored_as_lerobot_video_features(tmp_path: Path, camera_episodes: list[Episode]) -> None:
    ds = _dataset(tmp_path)
    report = ds.add_episodes(camera_episodes)
    assert len(report.added) == len(camera_episodes) == 4
    info = json.loads((tmp_path / "meta/info.json").read_text())
    assert info["video_path"] == "videos/{video_key}/chunk-{chunk_index:03d}/file-{file_index:03d}.mp4"
    for key in (SCENE, GRIPPER):
        feature = info["features"][key]
        assert feature["dtype"] == "video" and feature["shape"] == [32, 32, 3]
        assert feature["names"] == ["height", "width", "channels"]
        assert feature["info"]["video.codec"] == "av1" and feature["info"]["video.pix_fmt"] == "yuv420p"
        assert feature["info"]["video.fps"] == 10 and feature["info"]["video.g"] == 2
        assert (tmp_path / f"videos/{key}/chunk-000/file-000.mp4").is_file()
        assert key not in ds.frames().column_names  # frames never in the frame table
    rows = ds.episode_index()
    starts = rows.column(f"videos/{SCENE}/from_timestamp").to_pylist()
    ends = rows.column(f"videos/{SCENE}/to_timestamp").to_pylist()
    lengths = rows.column("length").to_pylist()
    assert starts[0] == 0.0 and starts[1:] == pytest.approx(ends[:-1])  # back to back in one file
    assert np.subtract(ends, starts) == pytest.approx(np.asarray(lengths) / FPS)
    assert set(rows.column(f"videos/{SCENE}/file_index").to_pylist()) == {0}
    for i, episode in enumerate(ds.load_episodes(range(4), cameras=True)):
        np.testing.assert_array_equal(episode.states, camera_episodes[i].states)
        for key in (SCENE, GRIPPER):
            sent = camera_episodes[i].cameras[key].astype(int)
            assert episode.cameras[key].shape == sent.shape
            assert np.abs(episode.cameras[key].astype(int) - sent).mean() < 12  # lossy AV1 at crf 30, noisy pixels


def test_reingest_is_a_duplicate_and_the_next_ingest_a_new_file(tmp_path: Path, camera_episodes: list[Episode]) -> None:
    ds = _dataset(tmp_path)
    ds.add_episodes(camera_episodes[:2])
    before = _stored(tmp_path)
    again = ds.add_episodes(camera_episodes[:2])
    assert again.duplicates == tuple(e.episode_id for e in camera_episodes[:2]) and _stored(tmp_path) == before
    ds.add_episodes(camera_episodes[2:])
    assert (tmp_path / f"videos/{SCENE}/chunk-000/file-001.mp4").is_file()
    assert ds.episode_index().column(f"videos/{SCENE}/file_index").to_pylist() == [0, 0, 1, 1]
    changed = dataclasses.replace(camera_episodes[0], cameras={**camera_episodes[0].cameras,
                                                                SCENE: 255 - camera_episodes[0].cameras[SCENE]})
    with pytest.raises(EpisodeValidationError, match="different content"):
        ds.add_episodes([changed])


def test_inline_and_background_encoding_store_the_same(tmp_path: Path, camera_episodes: list[Episode]) -> None:
    inline, background = _dataset(tmp_path / "a", "inline"), _dataset(tmp_path / "b", "background")
    inline.add_episodes(camera_episodes)
    background.add_episodes(camera_episodes)
    assert inline.content_hash() == background.content_hash()
    assert inline.info()["features"] == background.info()["features"]
    for i in range(len(camera_episodes)):
        a, b = inline.camera_frames(i), background.camera_frames(i)
        for key in a:
            np.testing.assert_array_equal(a[key], b[key])


def test_state_episodes_beside_camera_ones(tmp_path: Path, camera_episodes: list[Episode]) -> None:
    ds = _dataset(tmp_path)
    plain = dataclasses.replace(camera_episodes[0], cameras={})
    ds.add_episodes([plain])
    assert ds.camera_keys == () and not (tmp_path / "videos").exists()
    ds.add_episodes(camera_episodes[1:])
    assert ds.camera_frames(0) == {} and set(ds.camera_frames(1)) == {SCENE, GRIPPER}


def _write_video(path: Path, frames: np.ndarray, fps: float) -> Path:
    encode_episodes(path, [frames], fps, VideoConfig())
    return path


def _bad_cases(tmp_path: Path, episode: Episode) -> dict[str, tuple[dict, str]]:
    n = episode.length
    good = episode.cameras[SCENE]
    garbage = tmp_path / "garbage.mp4"
    garbage.write_bytes(b"not a video at all" * 10)
    return {
        "frame count": ({SCENE: good[:-1]}, f"{n - 1} camera frames for {n} table rows"),
        "resolution": ({SCENE: np.zeros((n, 16, 16, 3), np.uint8)}, "the dataset stores 32x32"),
        "dtype": ({SCENE: good.astype(np.float32)}, f"({n}, 32, 32, 3) float32"),
        "missing video": ({SCENE: tmp_path / "nowhere.mp4"}, "is missing"),
        "unreadable video": ({SCENE: garbage}, "is unreadable"),
        "video frame count": ({SCENE: _write_video(tmp_path / "short.mp4", good[:-2], FPS)}, f"{n - 2} camera frames"),
        "video span": ({SCENE: _write_video(tmp_path / "slow.mp4", good, FPS / 2)}, "video spans"),
    }


def test_bad_camera_streams_are_quarantined_and_nothing_stored_changes(tmp_path: Path, camera_episodes: list[Episode]) -> None:
    root, quarantine = tmp_path / "ds", tmp_path / "quarantine"
    ds = _dataset(root)
    ds.add_episodes(camera_episodes[:1])
    before, digest = _stored(root), ds.content_hash()
    episode = camera_episodes[1]
    for name, (cameras, reason) in _bad_cases(tmp_path, episode).items():
        report = ds.ingest_tables([IncomingEpisode(episode_to_table(episode), f"bad-{name}", cameras=cameras)],
                                  None, quarantine)
        assert not report.added and len(report.quarantined) == 1, name
        assert reason in report.quarantined[0].reason, (name, report.quarantined[0].reason)
        assert report.quarantined[0].field == SCENE, name
        assert _stored(root) == before and ds.content_hash() == digest, name
    with pytest.raises(EpisodeValidationError, match="table rows"):  # no quarantine: raises, stores nothing
        ds.add_episodes([dataclasses.replace(episode, cameras={SCENE: episode.cameras[SCENE][:3]})])
    assert _stored(root) == before


def test_a_robots_video_file_is_accepted_and_stored_in_the_batch_file(tmp_path: Path, camera_episodes: list[Episode]) -> None:
    episode = camera_episodes[2]
    sent = _write_video(tmp_path / "robot.mp4", episode.cameras[SCENE], FPS)
    ds = _dataset(tmp_path / "ds")
    report = ds.ingest_tables([IncomingEpisode(episode_to_table(episode), "robot", cameras={SCENE: sent})], None, tmp_path / "q")
    assert len(report.added) == 1
    back = ds.camera_frames(0)[SCENE]
    assert back.shape == episode.cameras[SCENE].shape and np.abs(back.astype(int) - episode.cameras[SCENE]).mean() < 16


def test_camera_timestamps_must_be_at_the_camera_rate(tmp_path: Path, camera_episodes: list[Episode]) -> None:
    episode = camera_episodes[0]
    skewed = episode.timestamps.copy()
    skewed[3:] += 0.06  # frame 3 is now nearer to frame 4's time
    bad = dataclasses.replace(episode, timestamps=skewed)
    with pytest.raises(EpisodeValidationError, match="not at the camera rate"):
        _dataset(tmp_path).add_episodes([bad])


def test_camera_features_go_through_lerobot_export_and_import(tmp_path: Path, camera_episodes: list[Episode]) -> None:
    from components.episodes.lerobot import export_lerobot, import_lerobot

    ds = _dataset(tmp_path / "ours")
    ds.add_episodes(camera_episodes)
    export_lerobot(ds, tmp_path / "export")
    assert (tmp_path / f"export/videos/{SCENE}/chunk-000/file-000.mp4").is_file()
    back = _dataset(tmp_path / "back")
    import_lerobot(tmp_path / "export", back, robot_id="robot-0000")
    assert back.camera_keys == ds.camera_keys and back.num_episodes == ds.num_episodes
    assert back.info()["features"][SCENE] == ds.info()["features"][SCENE]
    for i in range(ds.num_episodes):
        ours, theirs = ds.camera_frames(i), back.camera_frames(i)
        for key in (SCENE, GRIPPER):
            np.testing.assert_array_equal(ours[key], theirs[key])


def test_a_failed_ingest_leaves_no_encoder_running_and_stores_nothing(tmp_path: Path, camera_episodes: list[Episode],
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    import components.episodes.dataset as dataset_module

    ds = _dataset(tmp_path / "ds")
    ds.add_episodes(camera_episodes[:1])
    before, digest = _stored(tmp_path / "ds"), ds.content_hash()

    def broken(*args: object, **kwargs: object) -> None:
        raise OSError("disk full")

    monkeypatch.setattr(dataset_module, "tasks_table", broken)  # fails after the encode started
    with pytest.raises(OSError, match="disk full"):
        ds.add_episodes(camera_episodes[1:])
    assert ds._encodings == []  # joined before the lock was released
    monkeypatch.undo()
    fresh = _dataset(tmp_path / "ds")  # what a reader sees: the first episode only
    assert fresh.num_episodes == 1 and fresh.content_hash() == digest
    assert {k: v for k, v in _stored(tmp_path / "ds").items() if k in before} == before
    assert len(fresh.add_episodes(camera_episodes[1:]).added) == 3  # the next ingest writes over the leftovers
    assert fresh.camera_frames(3)[SCENE].shape == camera_episodes[3].cameras[SCENE].shape
