"""The pipeline's steps as plain functions: collect → ingest → train → evaluate → promote.

Prefect flows wrap each step in a task (retries, caching, artifacts) and ``fleetloop stage NAME``
calls the same functions for ``dvc repro``, so both paths build the same thing.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

from components.config import Settings
from components.episodes.dataset import IngestReport
from components.episodes.record import Episode
from components.episodes.schema import write_episode_file
from components.episodes.snapshot import Snapshot, read_snapshot, snapshot_dataset
from components.evaluation.heldout import EvaluationReport, evaluate_heldout
from components.pipeline.workspace import Workspace
from components.policy.actor import PolicyActor
from components.policy.normalizer import NormalizedPolicy
from components.registry.gate import GateDecision
from components.registry.lineage import Lineage, git_commit, params_hash
from components.registry.model_registry import PolicyVersion
from components.sim.expert import ScriptedExpert
from components.sim.collect import Policy, collect, run_episodes
from components.sim.exploration import SampledGripper, ThresholdedGripper
from components.store.encoder import NormalizedStateEncoder
from components.store.windows import cut_windows
from components.training.imitation import ProgressFn, TrainingSet, TrainResult, train_imitation

EXPERT_VERSION = "expert"
Progress = Callable[[int, int], None]


# -- collect ---------------------------------------------------------------------------------
@dataclass(frozen=True)
class CollectResult:
    files: list[Path]
    episodes: int
    successes: int
    env_steps: int
    seconds: float
    policy_version: str

    @property
    def success_rate(self) -> float:
        return self.successes / self.episodes if self.episodes else float("nan")


def _write_episodes(episodes: list[Episode], out_dir: Path) -> list[Path]:
    out_dir.mkdir(parents=True, exist_ok=True)
    files = []
    for ep in episodes:
        path = out_dir / f"{ep.robot_id}_{ep.episode_id}.parquet"
        write_episode_file(ep, path)
        files.append(path)
    return files


def collect_expert_demos(settings: Settings, out_dir: Path) -> CollectResult:
    """Scripted-expert demonstrations from the first ``demo.expert_robots`` robots."""
    start = time.perf_counter()
    robots = settings.fleet.robot_ids(settings.demo.expert_robots)
    episodes = run_episodes(
        ScriptedExpert(), robots, settings.sim, settings.demo.expert_episodes_per_robot,
        seed=settings.seed, policy_version=EXPERT_VERSION,
    )
    files = _write_episodes(episodes, out_dir)
    steps = sum(ep.length for ep in episodes)
    return CollectResult(files, len(episodes), sum(ep.success for ep in episodes), steps, time.perf_counter() - start, EXPERT_VERSION)


def fleet_actor(settings: Settings, policy: NormalizedPolicy, seed: int, explore: bool) -> Policy:
    """The policy as the fleet executes it: gripper sampled when exploring, thresholded otherwise."""
    actor = PolicyActor(policy)
    if explore and settings.fleet.sample_gripper:
        return SampledGripper(actor, settings.sim, seed)
    return ThresholdedGripper(actor)


def collect_fleet(
    settings: Settings, policy: NormalizedPolicy, policy_version: str, out_dir: Path, round_index: int, num_robots: int | None = None
) -> CollectResult:
    """The fleet runs ``policy`` for a fixed time budget per robot; finished episodes are written out."""
    start = time.perf_counter()
    robots = settings.fleet.robot_ids(num_robots)
    seed = settings.seed * 1000 + round_index
    actor = fleet_actor(settings, policy, seed, explore=True)
    result = collect(actor, robots, settings.sim, settings.fleet.steps_per_robot, seed=seed, policy_version=policy_version)
    files = _write_episodes(result.episodes, out_dir)
    return CollectResult(
        files, len(result.episodes), sum(ep.success for ep in result.episodes), result.env_steps,
        time.perf_counter() - start, policy_version,
    )


# -- ingest ----------------------------------------------------------------------------------
@dataclass(frozen=True)
class IngestResult:
    report: IngestReport
    snapshot: Snapshot | None
    store_version: int
    segments_upserted: int


def ingest_files(settings: Settings, files: list[Path], progress: Progress | None = None, snapshot: bool = True) -> IngestResult:
    """Validate + store episode files, snapshot the dataset with DVC, embed new windows into LanceDB.

    The window encoder is fitted once, on the first ingest, and kept with the store: every
    later vector is made by the same encoder, so distances stay comparable.
    """
    ws = Workspace(settings)
    report = ws.dataset.ingest(files, settings.known_robots(), settings.paths.quarantine)
    snap = read_snapshot(settings.paths.episodes)
    if snapshot and (report.added or snap is None) and ws.dataset.num_episodes:
        snap = snapshot_dataset(settings.root, settings.paths.episodes)
    store = ws.store
    encoder = store.load_encoder()
    if encoder is None:
        new_episodes = list(ws.dataset.episodes())  # first ingest: fit on and embed everything
        if not new_episodes:
            return IngestResult(report, snap, store.version, 0)
        windows = np.concatenate([cut_windows(ep.states, settings.store.window, settings.store.stride).windows for ep in new_episodes])
        encoder = NormalizedStateEncoder(window=settings.store.window, state_dim=ws.obs_dim).fit(windows)
    else:
        added = set(report.added)
        new_episodes = [ep for ep in ws.dataset.episodes() if ep.episode_id in added]
    upserted = 0
    if new_episodes:
        upsert = store.upsert(new_episodes, encoder, snapshot=snap.hash if snap else "", on_progress=progress)
        upserted = upsert.inserted + upsert.updated
        store.ensure_index()
    return IngestResult(report, snap, store.version, upserted)


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
    )


def train_policy(settings: Settings, progress: ProgressFn | None = None) -> TrainOutcome:
    ws = Workspace(settings)
    data = training_set(settings, ws)
    result = train_imitation(data, settings.policy, settings.train, seed=settings.seed, device=settings.device, on_progress=progress)
    return TrainOutcome(result, current_lineage(settings, ws, len(data.states)), len(data.states))


# -- evaluate --------------------------------------------------------------------------------
def evaluate_policy(settings: Settings, policy: NormalizedPolicy, version: str) -> EvaluationReport:
    """Held-out robots, the same seeded trials for every model so comparisons are paired."""
    actor = fleet_actor(settings, policy, seed=settings.seed, explore=settings.evaluation.sample_gripper)
    return evaluate_heldout(actor, settings.fleet.heldout_ids(), settings.sim, settings.evaluation, seed=settings.seed + 7919, policy_version=version)


# -- promote ---------------------------------------------------------------------------------
@dataclass(frozen=True)
class PromotionOutcome:
    candidate: PolicyVersion
    decision: GateDecision
    champion_before: int | None
    champion_after: int | None
    champion_eval: dict | None = field(default=None)


def register_and_promote(
    settings: Settings, outcome: TrainOutcome, evaluation: EvaluationReport, run_name: str
) -> PromotionOutcome:
    """Log the run + model, then gate it against the champion re-evaluated on the same trials."""
    ws = Workspace(settings)
    registry = ws.registry
    champion = registry.champion()
    champion_eval = None
    if champion is not None:
        champion_eval = evaluate_policy(settings, registry.load(champion.version), f"v{champion.version}").to_dict()
    candidate = registry.log_candidate(
        outcome.result.policy,
        evaluation.to_dict(),
        outcome.lineage,
        params=settings.model_dump(mode="json", exclude={"root"}),
        metrics={"train_final_loss": outcome.result.final_loss, "train_seconds": outcome.result.seconds, "train_frames": outcome.frames},
        loss_curve=outcome.result.losses,
        run_name=run_name,
    )
    decision = registry.promote_if_better(
        candidate,
        champion_eval["successes"] if champion_eval else None,
        champion_eval["trials"] if champion_eval else None,
    )
    after = registry.champion()
    return PromotionOutcome(
        candidate, decision, champion.version if champion else None, after.version if after else None, champion_eval
    )


def outcome_summary(outcome: PromotionOutcome) -> dict:
    return {
        "candidate_version": outcome.candidate.version,
        "promoted": outcome.decision.promote,
        "reason": outcome.decision.reason,
        "champion_before": outcome.champion_before,
        "champion_after": outcome.champion_after,
        "gate": asdict(outcome.decision),
    }
