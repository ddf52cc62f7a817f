"""What a train step builds and hands on, below the step itself: the frames to imitate for
``train.method`` (``training_set``), the lineage of a model trained now, and the value objects a
training returns (``TrainOutcome`` with its ``TrainingSummary``).

Both trainers build on these: the single-process one (``steps.train_policy``) and the
expert-parallel one (``distributed.train_expert_parallel``), so neither imports the other's module.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from components.config import Settings
from components.episodes.record import Episode, camera_key
from components.episodes.snapshot import read_snapshot
from components.fert.corpus import DatasetCorpus, EpisodeList
from components.fert.methods import MethodTrainingSet, build_training_set
from components.fert.retrieval_record import RetrievalRecord
from components.pipeline.workspace import Workspace
from components.policy.moe import StepUsage
from components.registry.lineage import Lineage, git_commit, params_hash
from components.store.segment_store import SegmentStore
from components.training.checkpoint import state_digest
from components.training.expert_usage import plot_expert_usage, usage_record, usage_series
from components.training.imitation import TrainResult
from components.training.trainer import TrainRun


def training_set(settings: Settings, ws: Workspace) -> MethodTrainingSet:
    """Frames to imitate (and how often) for ``train.method`` from everything stored; see
    ``method_training_set``."""
    champion = ws.registry.champion() if settings.fert.failures_from == "champion" else None
    store = ws.store if settings.train.method in RETRIEVAL_METHODS else None
    return method_training_set(settings, DatasetCorpus(ws.dataset, cameras=reads_cameras(settings)), store, champion.version if champion else None)


RETRIEVAL_METHODS = ("fert", "fert_uniform")  # the methods that query the segment store


def method_training_set(settings: Settings, episodes: DatasetCorpus | Iterable[Episode], store: SegmentStore | None,
                        champion: int | None) -> MethodTrainingSet:
    """Frames to imitate (and how often) for ``train.method``; see components/fert/methods.py.

    bc: expert demos; filtered_bc: every success; fert / fert_uniform: every success, with the
    segments ``store`` retrieves for the failures of v``champion`` (``fert.failures_from``; every
    failure while there is no champion or it has not run yet) emphasized. Failed episodes' actions
    are never imitated; interrupted ones (a FATS robot stopped mid-episode) are neither imitated nor
    queried. The flow's train task and the fleet's async trainer both build through here; the
    train task hands it the stored dataset (``DatasetCorpus``), which reads only the successes'
    frames and the failures that query, never every episode whole.
    """
    method = settings.train.method
    # by id, not by arrival: the same stored episodes give the same training set (and model) on
    # every path, whatever order a flow, a dvc stage or the fleet's ingest stored them in
    # (DatasetCorpus orders them so itself)
    corpus = episodes if isinstance(episodes, DatasetCorpus) else EpisodeList(
        sorted((ep for ep in episodes if not ep.interrupted), key=lambda ep: ep.episode_id))
    if not any(info.success for info in corpus.infos):
        raise RuntimeError(
            f"no successful episodes to train on in {settings.paths.episodes}; run `fleetloop ingest` with expert demos first"
        )
    cameras = policy_camera_keys(settings)
    if method not in RETRIEVAL_METHODS:
        return build_training_set(method, corpus, settings.fert, cameras=cameras)
    encoder = store.load_encoder() if store is not None else None
    if store is None or encoder is None:
        raise RuntimeError(f"train.method={method!r} needs the segment store: run `fleetloop ingest` first "
                           f"({store.uri if store is not None else settings.paths.store})")
    failed = [info for info in corpus.infos if not info.success]
    if champion is not None:
        mine = [info for info in failed if info.policy_version == f"v{champion}"]
        failed = mine or failed  # the champion has not run on the fleet yet: every failure queries
    queries = corpus.load([info.episode_id for info in failed])
    return build_training_set(method, corpus, settings.fert, store, encoder, failed=queries, seed=settings.seed,
                              cameras=cameras)


def reads_cameras(settings: Settings) -> bool:
    """Whether FERT's window encoder reads camera frames (``fert.encoder: camera``): the failures
    that query and the successes that calibrate are then loaded with their camera streams."""
    return settings.fert.encoder == "camera"


def policy_camera_keys(settings: Settings) -> tuple[str, ...]:
    """Dataset keys of the cameras the configured policy sees (a vision policy's; () otherwise)."""
    return tuple(camera_key(view) for view in settings.policy.camera_views(tuple(settings.sim.cameras)))


@dataclass(frozen=True)
class TrainingSummary:
    """How a policy was trained: the method's training set and the schedule it ran under."""

    method: str
    fert: dict[str, Any]  # FertReport.to_dict(): queries, matches, retrieved frames, ...
    plan_name: str
    plan_text: str
    plan_requested: str  # scheduler.plan (auto | sequential | ...)
    plan_source: str  # fixed | measured | cache
    iterations: int
    iteration_s: list[float]
    median_iteration_s: float
    predicted_iteration_s: float | None
    sequential_iteration_s: float | None  # the sequential plan, measured when the plan was chosen
    speedup_vs_sequential: float | None
    stage_seconds: dict[str, float]
    validation: list[float]  # validation-robot success of each iteration's starting weights
    gantt_png: str | None = None  # the schedule's Gantt chart, written under <root>/artifacts/schedules
    # MoE: per-step expert token share and dropped-pair rate (training/expert_usage.py) and its plot
    expert_usage: dict[str, Any] | None = None
    usage_png: str | None = None

    @property
    def retrieved_segments(self) -> int:
        return int(self.fert.get("matches", 0))

    def tags(self) -> dict[str, str]:
        def fmt(x: float | None, spec: str) -> str:
            return "n/a" if x is None else format(x, spec)

        return {
            "fleetloop.method": self.method,
            "fleetloop.scheduler.plan": self.plan_name,
            "fleetloop.scheduler.plan_requested": self.plan_requested,
            "fleetloop.scheduler.plan_source": self.plan_source,
            "fleetloop.scheduler.speedup_vs_sequential": fmt(self.speedup_vs_sequential, ".3f"),
            "fleetloop.scheduler.iteration_ms": fmt(1e3 * self.median_iteration_s, ".1f"),
            "fleetloop.scheduler.predicted_iteration_ms": fmt(None if self.predicted_iteration_s is None
                                                              else 1e3 * self.predicted_iteration_s, ".1f"),
            "fleetloop.scheduler.sequential_iteration_ms": fmt(None if self.sequential_iteration_s is None
                                                               else 1e3 * self.sequential_iteration_s, ".1f"),
            "fleetloop.fert.retrieved_segments": str(self.retrieved_segments),
        }

    def metrics(self) -> dict[str, float]:
        out = {"train_iterations": float(self.iterations), "train_median_iteration_s": self.median_iteration_s}
        out.update({f"train_stage_s.{op}": s for op, s in self.stage_seconds.items()})
        if self.speedup_vs_sequential is not None:
            out["train_speedup_vs_sequential"] = self.speedup_vs_sequential
        if self.expert_usage is not None:
            out["moe_mean_dropped_rate"] = self.expert_usage["mean_dropped_rate"]
            out["moe_max_mean_share"] = max(self.expert_usage["mean_share"])
        return out

    def series(self) -> dict[str, list[float]]:
        """Per-step metrics (MLflow series): the MoE expert shares and dropped rate."""
        if self.expert_usage is None:
            return {}
        usage = [StepUsage(tuple(sh), d) for sh, d in zip(self.expert_usage["share"], self.expert_usage["dropped_rate"],
                                                          strict=True)]
        return usage_series(usage)


@dataclass
class TrainOutcome:
    result: TrainResult
    lineage: Lineage
    frames: int
    summary: TrainingSummary | None = None
    # fert methods: what the training set's retrieval used (logged as fert/retrieval.json; the
    # failure explorer renders from it, never retrieving again)
    retrieval: RetrievalRecord | None = None


TRAIN_TASK_RECIPE = "train-task"  # Lineage.recipe of train_policy's models: `fleetloop reproduce` rebuilds them


def current_lineage(settings: Settings, ws: Workspace, frames: int, champion: int | None = None,
                    recipe: str = "") -> Lineage:
    snapshot = read_snapshot(settings.paths.episodes)
    return Lineage(
        git_commit=git_commit(Path(__file__).parent),
        snapshot_hash=snapshot.hash if snapshot else "none",
        lancedb_version=ws.store.version,
        params_hash=params_hash(settings.model_dump(mode="json", exclude={"root"})),
        episodes=ws.dataset.num_episodes,
        frames=frames,
        episodes_per_robot=ws.dataset.robots(),
        champion_version=-1 if champion is None else champion,
        recipe=recipe,
        snapshot_remote=settings.episodes.dvc_remote if snapshot else "",
    )


def summarize(method: MethodTrainingSet, run: TrainRun, gantt_dir: Path | None = None) -> TrainingSummary:
    """What the MLflow run, the retrain artifact and the demo table show; small enough to travel as a
    flow parameter (the timeline itself stays behind: only its Gantt image is kept, in ``gantt_dir``)."""
    choice = run.choice
    summary = TrainingSummary(
        method=method.report.method, fert=method.report.to_dict(), plan_name=choice.plan.name,
        plan_text=choice.plan.describe(), plan_requested=choice.requested, plan_source=choice.source,
        iterations=len(run.iteration_s), iteration_s=list(run.iteration_s), median_iteration_s=run.median_iteration_s,
        predicted_iteration_s=choice.predicted_s, sequential_iteration_s=choice.sequential_s,
        speedup_vs_sequential=run.speedup_vs_sequential, stage_seconds=run.stage_seconds(),
        validation=list(run.validation),
    )
    if gantt_dir is not None:
        summary = with_usage_plot(summary, run.expert_usage, gantt_dir, state_digest(run.policy.state_dict()))
    if gantt_dir is None or not run.timeline.spans:
        return summary
    from components.scheduler.gantt import plot_timelines

    path = gantt_dir / f"train-{state_digest(run.policy.state_dict())[:16]}.png"
    last = min(3, max(s.iteration for s in run.timeline.spans))
    plot_timelines([(f"{summary.plan_name}: median {1e3 * summary.median_iteration_s:.0f} ms/iteration", run.timeline)],
                   path, float(os.cpu_count() or 1), (0, last))
    return dataclasses.replace(summary, gantt_png=str(path))


def with_usage_plot(summary: TrainingSummary, usage: list[StepUsage], out_dir: Path, digest: str) -> TrainingSummary:
    """``summary`` with the run's expert utilisation (record + PNG under ``out_dir``); unchanged without MoE."""
    record = usage_record(usage)
    if record is None:
        return summary
    path = plot_expert_usage(usage, out_dir / f"experts-{digest[:16]}.png")
    return dataclasses.replace(summary, expert_usage=record, usage_png=str(path))


def retrieval_record(settings: Settings, built: MethodTrainingSet) -> RetrievalRecord | None:
    """The record of what ``built``'s retrieval used (None for methods without retrieval)."""
    return RetrievalRecord.from_training_set(built, settings.seed, settings.store.window)
