"""Train step: pick the frames to imitate for ``train.method`` and train (or fine-tune) a policy.

The other steps live beside this file (collect, ingest, evaluate, promote). Prefect flows wrap
each in a task (retries, caching, artifacts) and ``fleetloop stage NAME`` calls the same
functions for ``dvc repro``, so both paths build the same thing.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from components.config import Settings
from components.episodes.snapshot import read_snapshot
from components.pipeline.collect import EXPERT_VERSION
from components.pipeline.workspace import Workspace
from components.registry.lineage import Lineage, git_commit, params_hash
from components.training.imitation import ProgressFn, TrainingSet, TrainResult, train_imitation


# -- train -----------------------------------------------------------------------------------
def training_set(settings: Settings, ws: Workspace) -> TrainingSet:
    """Frames to imitate for ``train.method``: expert demos only (bc) or every success (filtered_bc)."""
    method = settings.train.method
    states, actions = [], []
    for ep in ws.dataset.episodes():
        if not ep.success:
            continue  # failed episodes' actions are never imitated
        if method == "bc" and ep.policy_version != EXPERT_VERSION:
            continue
        states.append(ep.states)
        actions.append(ep.actions)
    if not states:
        raise RuntimeError(
            f"no successful episodes to train on in {settings.paths.episodes}; run `fleetloop ingest` with expert demos first"
        )
    if method not in ("bc", "filtered_bc"):
        raise NotImplementedError(f"train.method={method!r} is provided by the FERT room; use bc or filtered_bc")
    return TrainingSet(np.concatenate(states).astype(np.float32), np.concatenate(actions).astype(np.float32))


@dataclass
class TrainOutcome:
    result: TrainResult
    lineage: Lineage
    frames: int


def current_lineage(settings: Settings, ws: Workspace, frames: int) -> Lineage:
    snapshot = read_snapshot(settings.paths.episodes)
    return Lineage(
        git_commit=git_commit(Path(__file__).parent),
        snapshot_hash=snapshot.hash if snapshot else "none",
        lancedb_version=ws.store.version,
        params_hash=params_hash(settings.model_dump(mode="json", exclude={"root"})),
        episodes=ws.dataset.num_episodes,
        frames=frames,
        episodes_per_robot=ws.dataset.robots(),
    )


def train_policy(settings: Settings, progress: ProgressFn | None = None) -> TrainOutcome:
    ws = Workspace(settings)
    data = training_set(settings, ws)
    result = train_imitation(data, settings.policy, settings.train, seed=settings.seed, device=settings.device, on_progress=progress)
    return TrainOutcome(result, current_lineage(settings, ws, len(data.states)), len(data.states))
