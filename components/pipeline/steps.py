"""Train step: pick the frames to imitate for ``train.method`` and train (or fine-tune) a policy.

The other steps live beside this file (collect, ingest, evaluate, promote). Prefect flows wrap
each in a task (retries, caching, artifacts) and ``fleetloop stage NAME`` calls the same
functions for ``dvc repro``, so both paths build the same thing.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from components.config import Settings
from components.episodes.snapshot import read_snapshot
from components.fert.methods import build_training_set
from components.pipeline.workspace import Workspace
from components.registry.lineage import Lineage, git_commit, params_hash
from components.training.imitation import ProgressFn, TrainingSet, TrainResult, train_imitation


# -- train -----------------------------------------------------------------------------------
def training_set(settings: Settings, ws: Workspace) -> TrainingSet:
    """Frames to imitate (and how often) for ``train.method``; see components/fert/methods.py.

    bc: expert demos; filtered_bc: every success; fert / fert_uniform: every success, with the
    segments retrieved for the champion's failures (``fert.failures_from``) emphasized. Failed
    episodes' actions are never imitated.
    """
    method = settings.train.method
    episodes = list(ws.dataset.episodes())
    if not any(ep.success for ep in episodes):
        raise RuntimeError(
            f"no successful episodes to train on in {settings.paths.episodes}; run `fleetloop ingest` with expert demos first"
        )
    if method in ("bc", "filtered_bc"):
        return build_training_set(method, episodes, settings.fert).data
    encoder = ws.store.load_encoder()
    if encoder is None:
        raise RuntimeError(f"train.method={method!r} needs the segment store: run `fleetloop ingest` first ({settings.paths.store})")
    failed = [ep for ep in episodes if not ep.success]
    champion = ws.registry.champion() if settings.fert.failures_from == "champion" else None
    if champion is not None:
        mine = [ep for ep in failed if ep.policy_version == f"v{champion.version}"]
        failed = mine or failed  # the champion has not run on the fleet yet: every failure queries
    return build_training_set(method, episodes, settings.fert, ws.store, encoder, failed=failed, seed=settings.seed).data


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
    """Train on ``training_set``; fine-tunes the champion when there is one (bootstrap otherwise)."""
    ws = Workspace(settings)
    data = training_set(settings, ws)
    champion = ws.registry.load("champion") if ws.registry.champion() is not None else None
    result = train_imitation(
        data, settings.policy, settings.train, seed=settings.seed, device=settings.device,
        init_policy=champion, on_progress=progress,
    )
    return TrainOutcome(result, current_lineage(settings, ws, len(data.states)), len(data.states))
