"""The process tests/test_ingest_kills.py kills: ingests batch after batch, retrying the batch it
was on after a restart, as a robot's uploader would. Imports nothing from the test harness, so it
starts as fast as the product does."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import numpy as np

from components.config import Settings
from components.episodes.record import Episode, new_episode_id
from components.episodes.schema import write_episode_file
from components.pipeline.ingest import ingest_files
from components.pipeline.workspace import Workspace

EPISODES_PER_BATCH = 12


def batch_episodes(settings: Settings, batch: int) -> list[Episode]:
    """The episodes of one batch, the same every time it is made (a retried upload)."""
    ws = Workspace(settings)
    rng = np.random.default_rng(1000 + batch)
    episodes = []
    for i in range(EPISODES_PER_BATCH):
        frames = int(rng.integers(6, 30))
        episodes.append(Episode(
            episode_id=new_episode_id(rng), robot_id=f"robot-{i % 2:04d}", task="pick-place",
            states=np.cumsum(rng.standard_normal((frames, ws.obs_dim)), axis=0).astype(np.float32),
            actions=rng.uniform(-1, 1, (frames, ws.act_dim)).astype(np.float32),
            timestamps=np.arange(frames, dtype=np.float32) / settings.episodes.fps,
            success=bool(rng.random() < 0.7),
        ))
    return episodes


def ingest_until_done(settings_json: str, progress: str, until: int) -> None:
    """Ingest the batch after the last one finished, and so on, up to batch ``until``."""
    settings = Settings.model_validate_json(settings_json)
    progress_file = Path(progress)
    while (batch := int(progress_file.read_text())) < until:
        folder = settings.root / "incoming" / f"batch-{batch:03d}"
        files = [write_episode_file(e, folder / f"{i:03d}.parquet") for i, e in enumerate(batch_episodes(settings, batch))]
        ingest_files(settings, files)
        tmp = progress_file.with_suffix(".tmp")
        tmp.write_text(str(batch + 1))
        os.replace(tmp, progress_file)


if __name__ == "__main__":
    print("ready", flush=True)  # imports done: the parent's kill clock starts here
    ingest_until_done(Path(sys.argv[1]).read_text(), sys.argv[2], int(sys.argv[3]))
