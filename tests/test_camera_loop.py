"""The loop on cameras, as a user runs it: the README's camera demo command, verbatim, in a scratch
root at a small size (more env overrides beside it), then `fleetloop reproduce` of its last version.

Checked: every round's row is printed; the champion is a vision policy that sees both cameras; every
stored episode has its two camera streams as LeRobot video features (mp4 files, one span each); the
segment store embeds camera windows; the fine-tuned version rebuilds bit for bit from its lineage;
and `fleetloop explain` draws the failures' camera frames beside the frames they retrieved.
"""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from tests.test_dvc_repro import documented_commands

CAMERA_DEMO = next(c for c in documented_commands() if "FLEETLOOP_POLICY__KIND=vision" in c and c.endswith("demo"))
SMALL = {  # the demo's shape, cut to a test's size
    "FLEETLOOP_SIM__CAMERA__WIDTH": "32", "FLEETLOOP_SIM__CAMERA__HEIGHT": "32",
    "FLEETLOOP_POLICY__VISION_CHANNELS": "8", "FLEETLOOP_POLICY__VISION_FEATURE": "16",
    "FLEETLOOP_DEMO__EXPERT_ROBOTS": "2", "FLEETLOOP_DEMO__EXPERT_EPISODES_PER_ROBOT": "6", "FLEETLOOP_DEMO__ROUNDS": "1",
    "FLEETLOOP_FLEET__NUM_ROBOTS": "2", "FLEETLOOP_FLEET__NUM_HELDOUT_ROBOTS": "2", "FLEETLOOP_FLEET__STEPS_PER_ROBOT": "200",
    "FLEETLOOP_TRAIN__EPOCHS": "2", "FLEETLOOP_TRAIN__BATCH_SIZE": "64", "FLEETLOOP_TRAIN__STEPS_PER_ITERATION": "10",
    "FLEETLOOP_TRAIN__VALIDATION_ROBOTS": "1", "FLEETLOOP_EVALUATION__TRIALS_PER_ROBOT": "3",
    "FLEETLOOP_EVALUATION__TRIALS_PER_TASK": "6", "FLEETLOOP_SCHEDULER__PLAN": "sequential",
}
REPO = Path(__file__).resolve().parents[1]


def _run(cmd: str, env: dict[str, str]) -> str:
    proc = subprocess.run(["bash", "-c", cmd], cwd=REPO, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, f"{cmd} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return proc.stdout


@pytest.mark.slow
def test_the_camera_demo_runs_the_loop_on_pixels_and_its_versions_reproduce(tmp_path: Path) -> None:
    from components.episodes.record import camera_key
    from components.pipeline.ingest import store_encoder
    from components.pipeline.workspace import Workspace

    env = {**os.environ, **SMALL, "FLEETLOOP_ROOT": str(tmp_path)}
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env['PATH']}"
    out = _run(CAMERA_DEMO, env)
    assert "bootstrap" in out and "round 1" in out and "demo: 2 rounds; champion v1" in out

    env.update(shlex.split(word)[0].split("=", 1) for word in CAMERA_DEMO.split() if word.startswith("FLEETLOOP_"))
    settings = _settings(env)  # the root as the demo left it, read with the demo's settings
    ws = Workspace(settings)
    keys = {camera_key("scene"), camera_key("gripper")}
    champion = ws.registry.load("champion")
    assert champion.sees_cameras and set(champion.layout.keys) == keys
    dataset = ws.dataset
    assert set(dataset.camera_keys) == keys and dataset.num_episodes > 12
    lengths = [ep.length for ep in dataset.episodes()]
    for index in (0, dataset.num_episodes - 1):  # the first demo and the last fleet episode, decoded
        frames = dataset.camera_frames(index, sorted(keys))
        assert all(f.shape == (lengths[index], 32, 32, 3) for f in frames.values())
    assert list((tmp_path / "datasets" / "episodes" / "videos").rglob("*.mp4"))

    assert type(store_encoder(settings, ws)).__name__ == "CameraWindowEncoder"  # FERT retrieves on camera windows

    latest = max(v.version for v in ws.registry.versions())
    bin_dir = Path(sys.executable).parent
    report = json.loads(_run(f"{bin_dir}/fleetloop reproduce {latest} --json", env))
    assert report["matches"] is True and report["champion"] == 1  # v2 fine-tuned v1 on the fleet's camera data
    _run(f"{bin_dir}/fleetloop explain {latest} --out {tmp_path / 'explain'}", env)
    strips = list((tmp_path / "explain").rglob("frames/*.png"))
    assert strips, "the explorer drew no camera frames beside the failures"


def _settings(env: dict[str, str]):
    saved = dict(os.environ)
    os.environ.update(env)
    try:
        from components.config import load_settings

        return load_settings()
    finally:
        os.environ.clear()
        os.environ.update(saved)
