"""LeRobot round trip, with LeRobot's own API on LeRobot's own Python (`make compat`; not in CI).

1. LeRobot writes a dataset (``LeRobotDataset.create`` / ``add_frame`` / ``save_episode`` /
   ``finalize``): 30 fps, two tasks, ``next.reward`` and ``next.success``, one camera stored as a
   video feature. The episodes are the simulator's scripted-expert runs, so training has something
   to learn.
2. ``fleetloop import-lerobot`` takes it into an empty root, ``fleetloop retrain`` trains on it,
   ``fleetloop export-lerobot`` writes it back (each as a user runs it: the venv's console script).
3. LeRobot's ``LeRobotDataset`` opens the export; its ``DataLoader`` iterates with
   ``delta_timestamps``; the states, actions and rewards equal what LeRobot wrote, and the camera
   frames equal what fleetloop decodes from its own copy.

Exits 0 and prints one ``round trip: ...`` line when every check holds; raises otherwise.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from lerobot.datasets.lerobot_dataset import LeRobotDataset

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from components.config import load_settings  # noqa: E402
from components.pipeline.workspace import Workspace  # noqa: E402
from components.sim import ScriptedExpert, collect, observation_dim  # noqa: E402

FPS = 30
TASKS = ("pick the cube and place it at the goal", "put the cube on the goal")
CAMERA = "observation.images.top"
IMAGE_HW = (32, 32)
ROBOTS = 4
STEPS_PER_ROBOT = 240
ACTION_WINDOW = [0.0, 1 / FPS, 2 / FPS]  # delta_timestamps: an action chunk of 3, as ACT reads one
CAMERA_WINDOW = [-1 / FPS, 0.0]  # the previous and the current picture (one delta would be squeezed)
FLEETLOOP = Path(sys.executable).parent / "fleetloop"


def camera_frames(states: np.ndarray) -> np.ndarray:
    """A picture that follows the state (T, H, W, 3) uint8: smooth, so the codec keeps it close."""
    height, width = IMAGE_HW
    ys, xs = np.mgrid[0:height, 0:width] / max(height, width)
    rows = []
    for state in states:
        phase = float(state[0] + state[1])
        red = 0.5 + 0.5 * np.sin(6 * xs + phase)
        green = 0.5 + 0.5 * np.cos(6 * ys - phase)
        blue = np.full_like(xs, 0.5 + 0.25 * np.tanh(float(state[2])))
        rows.append(np.stack([red, green, blue], axis=-1))
    return (np.stack(rows) * 255).round().astype(np.uint8)


def write_with_lerobot(root: Path, episodes: list) -> list[dict[str, np.ndarray]]:
    """LeRobot writes the dataset; returns what it was given, per episode (its order)."""
    features = {
        "observation.state": {"dtype": "float32", "shape": (episodes[0].states.shape[1],), "names": None},
        "action": {"dtype": "float32", "shape": (episodes[0].actions.shape[1],), "names": None},
        "next.reward": {"dtype": "float32", "shape": (1,), "names": None},
        "next.success": {"dtype": "bool", "shape": (1,), "names": None},
        CAMERA: {"dtype": "video", "shape": (*IMAGE_HW, 3), "names": ["height", "width", "channels"]},
    }
    dataset = LeRobotDataset.create("fleetloop/compat-source", fps=FPS, features=features, root=root,
                                    robot_type="pickplace", use_videos=True)
    written = []
    for number, episode in enumerate(episodes):
        images = camera_frames(episode.states)
        last = episode.length - 1
        reward = np.array([1.0 if (t == last and episode.success) else 0.0 for t in range(episode.length)], np.float32)
        for t in range(episode.length):
            dataset.add_frame({
                "observation.state": episode.states[t], "action": episode.actions[t],
                "next.reward": reward[t:t + 1], "next.success": np.array([reward[t] > 0]),
                CAMERA: images[t], "task": TASKS[number % 2],
            })
        dataset.save_episode()
        written.append({"state": episode.states, "action": episode.actions, "reward": reward,
                        "images": images, "task": TASKS[number % 2]})
    dataset.finalize()
    return written


def fleetloop(env: dict[str, str], *args: str) -> dict:
    """One CLI command as a user runs it, its --json report parsed."""
    started = time.perf_counter()
    done = subprocess.run([str(FLEETLOOP), *args, "--json"], env=env, capture_output=True, text=True, cwd=env["FLEETLOOP_ROOT"])
    if done.returncode != 0:
        raise SystemExit(f"fleetloop {' '.join(args)} failed ({done.returncode}):\n{done.stdout}\n{done.stderr}")
    report = last_json(done.stdout)
    print(f"fleetloop {args[0]}: {time.perf_counter() - started:.0f} s {json.dumps(report)[:300]}", flush=True)
    return report


def last_json(stdout: str) -> dict:
    """The --json report: the last JSON object that ends the output (flow logs may come first)."""
    lines = stdout.rstrip().splitlines()
    for start in range(len(lines) - 1, -1, -1):
        if lines[start].startswith("{"):
            try:
                return json.loads("\n".join(lines[start:]))
            except json.JSONDecodeError:
                continue
    raise SystemExit(f"no JSON report in the output:\n{stdout[-3000:]}")


def check_export(export: Path, written: list[dict[str, np.ndarray]], ours: dict[int, np.ndarray]) -> int:
    """LeRobot reads the export; everything it yields equals what was written. Returns items seen."""
    dataset = LeRobotDataset("fleetloop/compat-export", root=export,
                             delta_timestamps={"action": ACTION_WINDOW, CAMERA: CAMERA_WINDOW})
    assert dataset.fps == FPS and dataset.num_episodes == len(written), (dataset.fps, dataset.num_episodes)
    assert set(dataset.meta.tasks.index) == set(TASKS), dataset.meta.tasks
    by_first_state = {w["state"][0].tobytes(): w for w in written}
    loader = torch.utils.data.DataLoader(dataset, batch_size=32, shuffle=False, num_workers=0)
    seen = 0
    for batch in loader:
        for i in range(len(batch["index"])):
            episode, frame = int(batch["episode_index"][i]), int(batch["frame_index"][i])
            source = by_first_state[ours[episode].tobytes()]
            np.testing.assert_array_equal(batch["observation.state"][i].numpy(), source["state"][frame])
            window = np.minimum(np.arange(3) + frame, len(source["action"]) - 1)  # LeRobot pads with the last
            np.testing.assert_array_equal(batch["action"][i].numpy(), source["action"][window])
            assert float(batch["next.reward"][i]) == float(source["reward"][frame])
            assert batch["task"][i] == source["task"], (batch["task"][i], source["task"])
            assert bool(batch[f"{CAMERA}_is_pad"][i, 0]) == (frame == 0)
            decoded = batch[CAMERA][i, 1].numpy().transpose(1, 2, 0) * 255  # (C, H, W) in [0, 1]
            error = np.abs(decoded - source["images"][frame].astype(np.float32)).mean()
            assert error < 8.0, f"episode {episode} frame {frame}: mean error {error:.1f}/255 after the codec"
            seen += 1
    assert seen == sum(len(w["state"]) for w in written), seen
    return seen


def check_camera_matches_ours(dataset, export: Path) -> None:
    """fleetloop's decode of its copy and LeRobot's decode of the export give the same frames."""
    theirs = LeRobotDataset("fleetloop/compat-export", root=export)
    for episode in range(dataset.num_episodes):
        frames = dataset.camera_frames(episode, [CAMERA])[CAMERA]
        start = int(theirs.meta.episodes[episode]["dataset_from_index"])
        for t in (0, len(frames) - 1):
            decoded = (theirs[start + t][CAMERA].numpy().transpose(1, 2, 0) * 255).round()
            assert np.abs(decoded - frames[t].astype(np.float32)).max() <= 1.0, (episode, t)


def main() -> None:
    started = time.perf_counter()
    work = Path(tempfile.mkdtemp(prefix="fleetloop-compat-"))
    root = work / "root"
    root.mkdir()
    shutil.copy(REPO / "params.yaml", root / "params.yaml")
    env = {**os.environ, "FLEETLOOP_ROOT": str(root)}
    os.environ["FLEETLOOP_ROOT"] = str(root)
    settings = load_settings()
    assert observation_dim(settings.sim) > 0
    robots = [f"so100-{i:02d}" for i in range(ROBOTS)]
    episodes = collect(ScriptedExpert(), robots, settings.sim, STEPS_PER_ROBOT, seed=0, policy_version="teleop").episodes
    written = write_with_lerobot(work / "lerobot-source", episodes)
    print(f"LeRobot wrote {len(written)} episodes, {sum(len(w['state']) for w in written)} frames at {FPS} fps", flush=True)

    imported = fleetloop(env, "import-lerobot", str(work / "lerobot-source"), "--robot-id", "so100-lab")
    assert (imported["added"], imported["quarantined"], imported["fps"]) == (len(written), [], float(FPS)), imported
    trained = fleetloop(env, "retrain")
    assert trained["version"], trained
    exported = fleetloop(env, "export-lerobot", str(work / "export"))
    assert exported["episodes"] == len(written), exported

    ours = Workspace(settings).dataset
    first_states = {e: ours.episode_columns([e], ["observation.state"])["observation.state"][0] for e in range(ours.num_episodes)}
    seen = check_export(work / "export", written, first_states)
    check_camera_matches_ours(ours, work / "export")
    shutil.rmtree(work)
    print(f"round trip: LeRobot wrote {len(written)} episodes -> fleetloop imported, retrained (model version "
          f"{trained['version']}), exported -> LeRobot's DataLoader read {seen} frames with delta_timestamps, "
          f"all equal; {time.perf_counter() - started:.0f} s")


if __name__ == "__main__":
    main()
