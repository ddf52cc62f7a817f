"""FERT and its baselines, top to bottom: which frames to imitate, and how often.

    bc            expert demos only, uniform
    filtered_bc   every successful episode (demos + fleet), uniform
    (every method that imitates the fleet first leaves out loop frames: fert/revisits.py)

    fert          1. calibrate the divergence detector on held-out successes
                  2. failure contexts: each failed episode from its divergence on
                  3. retrieve similar success windows from any robot (same task)
                  4. priority w per success frame; mix demos / successes / retrieved pools
    fert_uniform  fert with w = 1 on every retrieved frame (ablation of the weighting)

Failed episodes only ever provide *queries*; the frames returned are always from successes.
Fine-tuning from the champion is the trainer's job (``training.trainer.make_trainer(settings, data, init)``).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from components.config import FertConfig
from components.episodes.record import Episode
from components.fert.corpus import Corpus, as_corpus
from components.fert.divergence import (
    DivergenceThreshold,
    FailureContext,
    calibration_sample,
    failure_contexts,
    threshold_from_held_out,
)
from components.fert.mixing import PoolShares, mix_pools
from components.fert.priority import FrameTable, PriorityWeights, priority_weights
from components.fert.retrieval import Retrieved, empty_retrieved, retrieve
from components.store.encoder import WindowEncoder
from components.store.segment_store import SegmentStore
from components.training.imitation import TrainingSet

METHODS: tuple[str, ...] = ("bc", "filtered_bc", "fert", "fert_uniform")
# Episode.policy_version of expert demonstrations (components/episodes/record.py default)
DEMO_VERSION = "expert"


@dataclass(frozen=True)
class FertReport:
    """What a training set was built from; logged with the training run."""

    method: str
    frames: int  # distinct frames that can be drawn
    episodes: int  # successful episodes those frames come from
    removed_frames: int = 0  # success frames left out by loop removal (revisited later)
    failed_episodes: int = 0
    fallback_contexts: int = 0  # failures with no divergence found (last W steps used)
    threshold: DivergenceThreshold | None = None
    queries: int = 0
    matches: int = 0
    dropped_matches: int = 0
    matched_robots: int = 0  # distinct robots whose successes were retrieved
    retrieved_frames: int = 0
    retrieved_mass: float = 0.0  # share of draws that land on a retrieved frame
    shares: PoolShares | None = None
    sigma: float = 0.0
    store_version: int = -1
    seconds: float = 0.0
    divergence_steps: list[int] = field(default_factory=list)

    @property
    def fallback_rate(self) -> float:
        return self.fallback_contexts / self.failed_episodes if self.failed_episodes else 0.0

    def to_dict(self) -> dict:
        out = {k: v for k, v in self.__dict__.items() if k not in ("threshold", "shares", "divergence_steps")}
        out["fallback_rate"] = self.fallback_rate
        if self.threshold is not None:
            out["threshold"] = dict(self.threshold.__dict__)
        if self.shares is not None:
            out["shares"] = dict(self.shares.__dict__)
        return out


@dataclass(frozen=True)
class MethodTrainingSet:
    data: TrainingSet
    report: FertReport
    priority: PriorityWeights | None = None
    retrieved: Retrieved | None = None
    table: FrameTable | None = None
    contexts: tuple[FailureContext, ...] = ()  # fert methods: the failure contexts that queried


def build_training_set(
    method: str,
    episodes: Corpus | Sequence[Episode],
    cfg: FertConfig,
    store: SegmentStore | None = None,
    encoder: WindowEncoder | None = None,
    failed: Sequence[Episode] | None = None,
    seed: int = 0,
    cameras: Sequence[str] = (),
) -> MethodTrainingSet:
    """Frames and sampling weights for ``method``; ``episodes`` is everything ingested, in memory
    or as a corpus that reads only what is needed (fert/corpus.py: the successes' frames, and the
    failures and calibration successes whole).

    ``failed`` picks which failures query (default: every failed episode in ``episodes``);
    fert methods need the segment store the episodes were embedded into, and its encoder.
    ``cameras`` (dataset keys): the imitated frames' camera images come along (a vision policy);
    retrieval still matches on the stored windows.
    """
    if method not in METHODS:
        raise ValueError(f"train.method={method!r} is unknown; choose one of {METHODS}")
    start = time.perf_counter()
    corpus = as_corpus(episodes)
    if method == "bc":
        demos = [info for info in corpus.infos if info.policy_version == DEMO_VERSION]
        table = FrameTable.from_corpus(corpus, DEMO_VERSION, infos=demos, cameras=cameras)
        return MethodTrainingSet(table.training_set(), _plain_report(method, table, start))
    table = FrameTable.from_corpus(corpus, DEMO_VERSION, cfg.revisit_radius, cameras=cameras)
    if method == "filtered_bc":
        return MethodTrainingSet(table.uniform_set(), _plain_report(method, table, start))

    if store is None or encoder is None:
        raise ValueError(f"train.method={method!r} needs the segment store and its encoder (store.load_encoder())")
    if failed is None:
        failed = corpus.load([info.episode_id for info in corpus.infos if not info.success])
    failed = list(failed)
    successes = [info for info in corpus.infos if info.success]

    # 1-2. failure contexts, per task (the detector's bank and threshold are per task)
    contexts, thresholds = [], []
    for task in sorted({ep.task for ep in failed}):
        task_successes = [info.episode_id for info in successes if info.task == task]
        held_out = corpus.load([task_successes[i] for i in calibration_sample(len(task_successes), cfg, seed)])
        threshold = threshold_from_held_out(store, encoder, held_out, cfg)
        thresholds.append(threshold)
        contexts += failure_contexts(store, encoder, [ep for ep in failed if ep.task == task], threshold, cfg)

    # 3. retrieval (one call per task; matches from any robot of that task)
    parts = [retrieve(store, [c for c in contexts if c.task == task], cfg, task, seed) for task in sorted({c.task for c in contexts})]
    retrieved = _concat(parts, store)

    # 4. priority weights and the pool mix
    priority = priority_weights(table, retrieved, cfg.alpha, cfg.sigma, uniform=(method == "fert_uniform"),
                                lead=cfg.credit_lead)
    data, shares = mix_pools(table, priority, cfg)
    report = FertReport(
        method=method,
        frames=len(table) - table.removed_frames,
        episodes=len(table.episode_ids),
        removed_frames=table.removed_frames,
        failed_episodes=len(failed),
        fallback_contexts=sum(c.fallback for c in contexts),
        threshold=thresholds[0] if len(thresholds) == 1 else None,
        queries=retrieved.num_queries,
        matches=len(retrieved),
        dropped_matches=retrieved.dropped,
        matched_robots=len(set(retrieved.robot_ids.tolist())),
        retrieved_frames=priority.retrieved_frames,
        retrieved_mass=float(data.weights[priority.retrieved].sum()) if data.weights is not None else 0.0,
        shares=shares,
        sigma=priority.sigma,
        store_version=store.version,
        seconds=time.perf_counter() - start,
        divergence_steps=[c.divergence_step for c in contexts],
    )
    return MethodTrainingSet(data, report, priority, retrieved, table, tuple(contexts))


def _plain_report(method: str, table: FrameTable, start: float) -> FertReport:
    return FertReport(
        method, len(table) - table.removed_frames, len(table.episode_ids), table.removed_frames,
        seconds=time.perf_counter() - start,
    )


def _concat(parts: list[Retrieved], store: SegmentStore) -> Retrieved:
    if not parts:
        return empty_retrieved(store, cutoff=float("nan"))
    if len(parts) == 1:
        return parts[0]
    offsets = np.cumsum([0] + [p.num_queries for p in parts[:-1]])
    return Retrieved(
        query=np.concatenate([p.query + o for p, o in zip(parts, offsets, strict=True)]),
        query_episode_ids=np.concatenate([p.query_episode_ids for p in parts]),
        query_starts=np.concatenate([p.query_starts for p in parts]),
        episode_ids=np.concatenate([p.episode_ids for p in parts]),
        robot_ids=np.concatenate([p.robot_ids for p in parts]),
        starts=np.concatenate([p.starts for p in parts]),
        ends=np.concatenate([p.ends for p in parts]),
        distances=np.concatenate([p.distances for p in parts]),
        metric=parts[0].metric,
        num_queries=sum(p.num_queries for p in parts),
        cutoff=float(max(p.cutoff for p in parts)),
        dropped=sum(p.dropped for p in parts),
        store_version=store.version,
    )
