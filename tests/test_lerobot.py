"""LeRobot v3 import/export against a small dataset written by hand in the official layout."""

from __future__ import annotations

import json
import uuid
from pathlib import Path

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from components.config import EpisodesConfig
from components.episodes.dataset import DatasetMismatchError, EpisodeDataset
from components.episodes.lerobot import (
    IMPORT_POLICY_VERSION,
    LeRobotFormatError,
    export_lerobot,
    import_lerobot,
)

FPS = 10
LENGTHS = (4, 5, 3)
TASKS = ("pick the cube", "place the cube")
EPISODE_TASK = (0, 0, 1)
NEXT_SUCCESS = (True, False, True)  # reached on the last frame of episodes 0 and 2
STATE_DIM, ACTION_DIM, ENV_DIM = 3, 2, 2
VIDEO_KEY = "observation.images.top"
VIDEO_SHAPE = [3, 8, 8]
# episodes 0 and 1 share video file 0 (back to back), episode 2 is in file 1
VIDEO_SLOTS = ((0, 0.0), (0, 0.4), (1, 0.0))


def _write_lerobot_v3(
    root: Path, seed: int = 3, fps: int = FPS, tasks: tuple[str, ...] = TASKS,
    episode_task: tuple[int, ...] = EPISODE_TASK, robot_type: str = "so100", state_dim: int = STATE_DIM,
) -> dict[str, np.ndarray]:
    """A LeRobot v3 dataset as LeRobot writes it: two data files, a video feature, variable lists."""
    rng = np.random.default_rng(seed)
    states = [rng.normal(size=(n, state_dim)).astype(np.float32) for n in LENGTHS]
    actions = [rng.normal(size=(n, ACTION_DIM)).astype(np.float32) for n in LENGTHS]
    env = [rng.normal(size=(n, ENV_DIM)).astype(np.float32) for n in LENGTHS]
    starts = np.concatenate([[0], np.cumsum(LENGTHS)])

    def frames(episodes: list[int]) -> pa.Table:
        rows: dict[str, list] = {k: [] for k in (
            "observation.state", "action", "observation.environment_state", "next.reward",
            "next.success", "timestamp", "frame_index", "episode_index", "index", "task_index")}
        for e in episodes:
            for f in range(LENGTHS[e]):
                rows["observation.state"].append(states[e][f].tolist())
                rows["action"].append(actions[e][f].tolist())
                rows["observation.environment_state"].append(env[e][f].tolist())
                last = f == LENGTHS[e] - 1
                rows["next.reward"].append(1.0 if last and NEXT_SUCCESS[e] else 0.0)
                rows["next.success"].append(bool(last and NEXT_SUCCESS[e]))
                rows["timestamp"].append(f / fps)
                rows["frame_index"].append(f)
                rows["episode_index"].append(e)
                rows["index"].append(int(starts[e]) + f)
                rows["task_index"].append(episode_task[e])
        return pa.table({
            # variable-size lists (as `datasets.Sequence` without length writes them)
            "observation.state": pa.array(rows["observation.state"], pa.list_(pa.float32())),
            "action": pa.array(rows["action"], pa.list_(pa.float32(), ACTION_DIM)),
            "observation.environment_state": pa.array(rows["observation.environment_state"], pa.list_(pa.float32())),
            "next.reward": pa.array(rows["next.reward"], pa.float32()),
            "next.success": pa.array(rows["next.success"], pa.bool_()),
            "timestamp": pa.array(rows["timestamp"], pa.float32()),
            "frame_index": pa.array(rows["frame_index"], pa.int64()),
            "episode_index": pa.array(rows["episode_index"], pa.int64()),
            "index": pa.array(rows["index"], pa.int64()),
            "task_index": pa.array(rows["task_index"], pa.int64()),
        })

    (root / "data/chunk-000").mkdir(parents=True)
    pq.write_table(frames([0, 1]), root / "data/chunk-000/file-000.parquet")
    pq.write_table(frames([2]), root / "data/chunk-000/file-001.parquet")

    for number in (0, 1):
        video = root / f"videos/{VIDEO_KEY}/chunk-000/file-{number:03d}.mp4"
        video.parent.mkdir(parents=True, exist_ok=True)
        video.write_bytes(b"\x00\x00\x00\x18ftypmp42" + rng.bytes(64))  # never decoded

    episodes = {
        "episode_index": pa.array(range(3), pa.int64()),
        "tasks": pa.array([[tasks[t]] for t in episode_task], pa.list_(pa.string())),
        "length": pa.array(LENGTHS, pa.int64()),
        "data/chunk_index": pa.array([0, 0, 0], pa.int64()),
        "data/file_index": pa.array([0, 0, 1], pa.int64()),
        "dataset_from_index": pa.array(starts[:-1], pa.int64()),
        "dataset_to_index": pa.array(starts[1:], pa.int64()),
        f"videos/{VIDEO_KEY}/chunk_index": pa.array([0, 0, 0], pa.int64()),
        f"videos/{VIDEO_KEY}/file_index": pa.array([s[0] for s in VIDEO_SLOTS], pa.int64()),
        f"videos/{VIDEO_KEY}/from_timestamp": pa.array([s[1] for s in VIDEO_SLOTS], pa.float64()),
        f"videos/{VIDEO_KEY}/to_timestamp": pa.array(
            [s[1] + n / fps for s, n in zip(VIDEO_SLOTS, LENGTHS)], pa.float64()),
        "meta/episodes/chunk_index": pa.array([0, 0, 0], pa.int64()),
        "meta/episodes/file_index": pa.array([0, 0, 0], pa.int64()),
    }
    image_stat = [[[0.5]], [[0.4]], [[0.3]]]  # shape [3, 1, 1], as LeRobot stores image stats
    for stat in ("min", "max", "mean", "std"):
        episodes[f"stats/{VIDEO_KEY}/{stat}"] = pa.array([image_stat] * 3)
    episodes[f"stats/{VIDEO_KEY}/count"] = pa.array([[n] for n in LENGTHS], pa.list_(pa.int64()))
    episodes["stats/observation.state/mean"] = pa.array([s.mean(0).tolist() for s in states])
    (root / "meta/episodes/chunk-000").mkdir(parents=True)
    pq.write_table(pa.table(episodes), root / "meta/episodes/chunk-000/file-000.parquet")

    pd.DataFrame({"task_index": range(len(tasks))}, index=pd.Index(tasks, name="task")).to_parquet(
        root / "meta/tasks.parquet")
    features = {
        "observation.state": {"dtype": "float32", "shape": [state_dim], "names": [f"q{i}" for i in range(state_dim)]},
        "action": {"dtype": "float32", "shape": [ACTION_DIM], "names": ["vx", "vy"]},
        "observation.environment_state": {"dtype": "float32", "shape": [ENV_DIM], "names": None},
        VIDEO_KEY: {"dtype": "video", "shape": VIDEO_SHAPE, "names": ["channels", "height", "width"],
                    "info": {"video.fps": fps, "video.codec": "av1", "video.pix_fmt": "yuv420p"}},
        "next.reward": {"dtype": "float32", "shape": [1], "names": None},
        "next.success": {"dtype": "bool", "shape": [1], "names": None},
        "timestamp": {"dtype": "float32", "shape": [1], "names": None},
        "frame_index": {"dtype": "int64", "shape": [1], "names": None},
        "episode_index": {"dtype": "int64", "shape": [1], "names": None},
        "index": {"dtype": "int64", "shape": [1], "names": None},
        "task_index": {"dtype": "int64", "shape": [1], "names": None},
    }
    info = {
        "codebase_version": "v3.0", "robot_type": robot_type, "total_episodes": 3,
        "total_frames": int(sum(LENGTHS)), "total_tasks": len(tasks), "chunks_size": 1000,
        "data_files_size_in_mb": 100, "video_files_size_in_mb": 500, "fps": fps,
        "splits": {"train": "0:3"},
        "data_path": "data/chunk-{chunk_index:03d}/file-{file_index:03d}.parquet",
        "video_path": "videos/{video_key}/chunk-{chunk_index:03d}/file-{file_index:03d}.mp4",
        "features": features,
    }
    (root / "meta/info.json").write_text(json.dumps(info, indent=4))
    (root / "meta/stats.json").write_text(json.dumps({}))
    return {"states": states, "actions": actions, "env": env}


@pytest.fixture
def source(tmp_path: Path) -> tuple[Path, dict[str, np.ndarray]]:
    root = tmp_path / "lerobot_src"
    return root, _write_lerobot_v3(root)


def _dataset(path: Path) -> EpisodeDataset:
    return EpisodeDataset(path, EpisodesConfig())


def test_import_fills_our_fields_and_carries_extras(source, tmp_path):
    src, truth = source
    ds = _dataset(tmp_path / "episodes")
    result = import_lerobot(src, ds, robot_id="so100-lab")

    assert len(result.report.added) == 3 and not result.report.quarantined
    episodes = list(ds.episodes())
    for e, ep in enumerate(episodes):
        np.testing.assert_array_equal(ep.states, truth["states"][e])
        np.testing.assert_array_equal(ep.actions, truth["actions"][e])
        np.testing.assert_array_equal(ep.extras["observation.environment_state"], truth["env"][e])
        assert ep.task == TASKS[EPISODE_TASK[e]]
        assert ep.success is NEXT_SUCCESS[e]  # from next.success
        assert (ep.robot_id, ep.policy_version, ep.interrupted) == ("so100-lab", IMPORT_POLICY_VERSION, False)
        assert uuid.UUID(ep.episode_id).version == 4
    assert [m.episode_id for m in result.mapping] == [e.episode_id for e in episodes]
    assert set(result.mapping[0].filled) == {"episode_id", "robot_id", "policy_version", "interrupted"}
    mapping = json.loads(result.mapping_file.read_text())
    assert [m["source_episode_index"] for m in mapping["episodes"]] == [0, 1, 2]

    # video feature: declared in info.json, referenced from the episodes table, files copied whole
    info = ds.info()
    assert info["features"][VIDEO_KEY]["dtype"] == "video" and info["video_path"]
    meta = ds.episode_index()
    assert meta.column(f"videos/{VIDEO_KEY}/file_index").to_pylist() == [0, 0, 1]
    assert meta.column(f"videos/{VIDEO_KEY}/from_timestamp").to_pylist() == [s[1] for s in VIDEO_SLOTS]
    for number in (0, 1):
        rel = f"videos/{VIDEO_KEY}/chunk-000/file-{number:03d}.mp4"
        assert (ds.root / rel).read_bytes() == (src / rel).read_bytes()
    stats = json.loads((ds.root / "meta/stats.json").read_text())
    assert np.asarray(stats[VIDEO_KEY]["mean"]).shape == (3, 1, 1)  # carried image stats aggregated
    assert stats["observation.state"]["count"] == [sum(LENGTHS)]  # recomputed from frames


def test_reimport_is_a_no_op(source, tmp_path):
    src, _ = source
    ds = _dataset(tmp_path / "episodes")
    first = import_lerobot(src, ds, robot_id="so100-lab")
    before = ds.content_hash()
    again = import_lerobot(src, ds, robot_id="so100-lab")
    assert again.report.added == () and sorted(again.report.duplicates) == sorted(first.report.added)
    assert again.mapping_file is None and ds.content_hash() == before
    assert [m.episode_id for m in again.mapping] == [m.episode_id for m in first.mapping]


def test_import_export_import_round_trip(source, tmp_path):
    src, _ = source
    first = _dataset(tmp_path / "first")
    import_lerobot(src, first, robot_id="so100-lab")
    exported = export_lerobot(first, tmp_path / "exported")
    assert (exported.episodes, exported.frames, exported.video_files) == (3, sum(LENGTHS), 2)

    out = tmp_path / "exported"
    info = json.loads((out / "meta/info.json").read_text())
    assert info["codebase_version"] == "v3.0" and info["total_episodes"] == 3
    assert {"episode_id", "robot_id", "success", "next.reward", VIDEO_KEY} <= set(info["features"])
    data = pq.read_table(out / "data/chunk-000/file-000.parquet")
    assert {"observation.state", "action", "index", "task_index", "episode_id"} <= set(data.column_names)
    assert list(pd.read_parquet(out / "meta/tasks.parquet").index) == list(TASKS)

    second = _dataset(tmp_path / "second")
    result = import_lerobot(out, second, robot_id="someone-else")
    assert len(result.report.added) == 3
    assert all(m.filled == () for m in result.mapping)  # everything came from the export's columns

    a, b = list(first.episodes()), list(second.episodes())
    assert [e.episode_id for e in a] == [e.episode_id for e in b]
    for x, y in zip(a, b):
        np.testing.assert_array_equal(x.states, y.states)
        np.testing.assert_array_equal(x.actions, y.actions)
        np.testing.assert_array_equal(x.timestamps, y.timestamps)
        assert (x.robot_id, x.task, x.success, x.policy_version) == (y.robot_id, y.task, y.success, y.policy_version)
        assert sorted(x.extras) == sorted(y.extras)
    keep = [c for c in first.episode_index().column_names if c != "content_hash"]
    assert first.episode_index().select(keep).equals(second.episode_index().select(keep))
    assert first.content_hash() == second.content_hash()
    # importing the export back into the original dataset finds nothing new
    assert import_lerobot(out, first).report.added == ()


def test_import_rejects_other_versions_and_export_never_overwrites(source, tmp_path):
    src, _ = source
    info_path = src / "meta/info.json"
    info = json.loads(info_path.read_text())
    info_path.write_text(json.dumps({**info, "codebase_version": "v2.1"}))
    with pytest.raises(LeRobotFormatError, match="v2.1.*convert"):
        import_lerobot(src, _dataset(tmp_path / "episodes"))
    info_path.write_text(json.dumps({**info, "fps": None}))
    with pytest.raises(LeRobotFormatError, match="fps None.*Fix: set meta/info.json `fps`"):
        import_lerobot(src, _dataset(tmp_path / "episodes"))

    info_path.write_text(json.dumps(info))
    ds = _dataset(tmp_path / "episodes")
    import_lerobot(src, ds)
    occupied = tmp_path / "occupied"
    occupied.mkdir()
    (occupied / "keep.txt").write_text("mine")
    with pytest.raises(LeRobotFormatError, match="not empty"):
        export_lerobot(ds, occupied)
    assert (occupied / "keep.txt").read_text() == "mine"


def test_mixed_dataset_of_imports_and_fleet_episodes_round_trips(source, tmp_path):
    """Fleet episodes lack the imported extras and videos: export pads them, import drops the padding."""
    from components.episodes.record import Episode, new_episode_id

    src, _ = source
    first = _dataset(tmp_path / "first")
    import_lerobot(src, first, robot_id="so100-lab")
    rng = np.random.default_rng(11)
    fleet = [
        Episode(new_episode_id(rng), "robot-0000", "pick the cube",
                rng.normal(size=(6, STATE_DIM)).astype(np.float32),
                rng.normal(size=(6, ACTION_DIM)).astype(np.float32),
                np.arange(6, dtype=np.float32) / FPS, success=True, policy_version="v7")
        for _ in range(2)
    ]
    first.add_episodes(fleet)
    frames = first.frames()
    assert frames.num_rows == sum(LENGTHS) + 12
    assert frames.column("next.reward").null_count == 12  # fleet frames have no reward column

    export_lerobot(first, tmp_path / "exported")
    second = _dataset(tmp_path / "second")
    assert len(import_lerobot(tmp_path / "exported", second).report.added) == 5
    assert second.content_hash() == first.content_hash()
    assert [e.policy_version for e in second.episodes()][-2:] == ["v7", "v7"]


def test_empty_dataset_adopts_fps_robot_type_and_features(tmp_path):
    """Most LeRobot datasets are 30 fps: importing one into an empty root needs no setting."""
    src = tmp_path / "lerobot30"
    _write_lerobot_v3(src, fps=30, robot_type="koch")
    ds = _dataset(tmp_path / "episodes")
    assert ds.cfg.fps == FPS  # the configured default differs from the source's

    result = import_lerobot(src, ds, robot_id="koch-lab")

    assert len(result.report.added) == 3
    reopened = _dataset(tmp_path / "episodes")  # what is on disk, not the handle's memory
    info = reopened.info()
    assert (reopened.fps, info["fps"], info["robot_type"]) == (30.0, 30, "koch")
    assert info["features"]["observation.state"]["names"] == [f"q{i}" for i in range(STATE_DIM)]
    assert info["features"]["observation.state"]["dtype"] == "float32"
    assert info["features"]["action"]["names"] == ["vx", "vy"]
    assert info["features"]["next.reward"] == {"dtype": "float32", "shape": [1], "names": None}
    assert info["features"][VIDEO_KEY]["info"]["video.fps"] == 30
    assert reopened.frames().column("next.reward").to_pylist()[LENGTHS[0] - 1] == 1.0
    mapping = json.loads(result.mapping_file.read_text())
    assert (mapping["source_fps"], mapping["source_robot_type"]) == (30, "koch")

    exported = json.loads(
        (export_lerobot(reopened, tmp_path / "out").path / "meta/info.json").read_text())
    assert (exported["fps"], exported["robot_type"]) == (30, "koch")


def test_non_empty_dataset_refuses_another_fps_or_shape_and_keeps_what_it_has(source, tmp_path):
    src, _ = source
    ds = _dataset(tmp_path / "episodes")
    import_lerobot(src, ds, robot_id="so100-lab")
    before = (ds.content_hash(), (ds.root / "meta/info.json").read_bytes(), sorted(ds.root.rglob("*")))

    faster = tmp_path / "lerobot30"
    _write_lerobot_v3(faster, seed=5, fps=30)
    with pytest.raises(DatasetMismatchError, match=r"fps 30 differs from the dataset's 10\. Fix: import into an empty"):
        import_lerobot(faster, ds)
    wider = tmp_path / "wider"
    _write_lerobot_v3(wider, seed=6, state_dim=STATE_DIM + 1)
    with pytest.raises(DatasetMismatchError, match=r"observation\.state shape \[4\] differs from the dataset's \[3\]"):
        import_lerobot(wider, ds)

    ds.refresh()
    assert (ds.content_hash(), (ds.root / "meta/info.json").read_bytes(), sorted(ds.root.rglob("*"))) == before
    # same fps and shapes, another robot type: stored beside the others, the dataset's type kept
    other = tmp_path / "other-robot"
    _write_lerobot_v3(other, seed=7, robot_type="aloha")
    assert len(import_lerobot(other, ds, robot_id="aloha-lab").report.added) == 3
    assert ds.info()["robot_type"] == "so100" and ds.robots() == {"aloha-lab": 3, "so100-lab": 3}


def test_several_tasks_keep_their_strings_whatever_the_source_task_index(tmp_path):
    tasks = ("stack the blocks", "open the drawer", "wipe the table")
    episode_task = (2, 0, 2)  # task 1 is declared but unused; indices out of first-use order
    src = tmp_path / "multi"
    _write_lerobot_v3(src, tasks=tasks, episode_task=episode_task)
    ds = _dataset(tmp_path / "episodes")
    import_lerobot(src, ds)
    assert [ep.task for ep in ds.episodes()] == [tasks[t] for t in episode_task]
    assert sorted(ds.tasks) == sorted({tasks[t] for t in episode_task})
    frames = ds.frames()
    assert {"next.reward", "next.success", "observation.environment_state"} <= set(frames.column_names)


def test_an_info_json_left_by_a_crashed_first_ingest_is_not_a_dataset(tmp_path):
    """Before the first commit point nothing is stored: the import adopts its source's layout."""
    root = tmp_path / "episodes"
    (root / "meta").mkdir(parents=True)
    stale = {"fps": 10, "robot_type": "fleetloop", "chunks_size": 1000,
             "features": {"observation.state": {"dtype": "float32", "shape": [11], "names": None}}}
    (root / "meta/info.json").write_text(json.dumps(stale))
    src = tmp_path / "lerobot30"
    _write_lerobot_v3(src, fps=30)
    ds = _dataset(root)
    assert ds.num_episodes == 0 and ds.fps == 10.0

    assert len(import_lerobot(src, ds).report.added) == 3
    info = _dataset(root).info()
    assert (info["fps"], info["robot_type"]) == (30, "so100")
    assert info["features"]["observation.state"]["shape"] == [STATE_DIM]
