"""Priority: how strongly each success frame answers the fleet's failures.

For every frame f of a successful episode,

    w_f = 1 + alpha * sum over retrieved matches (q, segment) crediting f of exp(-d_q^2 / (2 sigma^2))

where d_q is the match's (plain, not squared) distance and sigma defaults to the median
retrieved distance. A match on frames [start, end) credits [start + lead, end + lead) of its
episode (``fert.credit_lead``): inside the matched window the success took much the steps the
failure took; what it did differently is what it did next. A frame no failure resembles keeps
w = 1; frames that answer many close queries weigh more. ``uniform=True`` gives every retrieved
frame w = 1 (the FERT-uniform ablation: same pools, no similarity weighting).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from components.episodes.record import Episode
from components.fert.corpus import Corpus, EpisodeInfo, EpisodeList
from components.fert.retrieval import Retrieved
from components.fert.revisits import imitated_frames
from components.policy.history import frame_positions
from components.training.imitation import TrainingSet


@dataclass(frozen=True)
class FrameTable:
    """Successful episodes' frames, concatenated; ``offsets[episode_id]`` is an episode's first row."""

    states: np.ndarray  # (N, n) float32
    actions: np.ndarray  # (N, m) float32
    episode_ids: list[str]
    offsets: dict[str, int]
    lengths: dict[str, int]
    is_demo: np.ndarray  # (N,) bool: frame of an expert demonstration
    imitated: np.ndarray | None = None  # (N,) bool: may be drawn (loop removal, fert/revisits.py); None = all
    images: dict[str, np.ndarray] | None = None  # camera key -> (N, H, W, 3) uint8, for a vision policy

    @property
    def frame_in_episode(self) -> np.ndarray:
        """(N,) each frame's index in its episode (a history policy's windows stop there)."""
        return frame_positions([self.lengths[e] for e in self.episode_ids])

    def training_set(self, weights: np.ndarray | None = None) -> TrainingSet:
        """The frames with sampling ``weights`` (None = uniform) and their episode positions."""
        return TrainingSet(self.states, self.actions, weights, self.frame_in_episode, self.images)

    @classmethod
    def from_episodes(cls, episodes: Sequence[Episode], demo_version: str, revisit_radius: float = 0.0,
                      cameras: Sequence[str] = ()) -> FrameTable:
        """Frames of the *successful* ones of ``episodes`` (see ``from_corpus``)."""
        return cls.from_corpus(EpisodeList(episodes), demo_version, revisit_radius, cameras=cameras)

    @classmethod
    def from_corpus(cls, corpus: Corpus, demo_version: str, revisit_radius: float = 0.0,
                    infos: Sequence[EpisodeInfo] | None = None, cameras: Sequence[str] = ()) -> FrameTable:
        """Frames of the *successful* episodes only (of ``infos``, default every one in
        ``corpus``); failed episodes are never imitated. Only these frames are read.

        ``revisit_radius > 0`` marks frames the episode later comes back to as not imitated.
        ``cameras`` (dataset keys): their frames are decoded too, for a vision policy.
        """
        kept = [info for info in (corpus.infos if infos is None else infos) if info.success]
        if not kept:
            raise ValueError("no successful episodes: FERT imitates successes only; ingest expert demos first")
        ids = [info.episode_id for info in kept]
        lengths = np.array([info.length for info in kept], dtype=np.int64)
        starts = np.concatenate([[0], np.cumsum(lengths)[:-1]]).astype(np.int64)
        states, actions = corpus.frames(ids)
        per_episode = np.split(states, starts[1:])
        return cls(
            states=states,
            actions=actions,
            episode_ids=ids,
            offsets={i: int(s) for i, s in zip(ids, starts, strict=True)},
            lengths={info.episode_id: info.length for info in kept},
            is_demo=np.repeat(np.array([info.policy_version == demo_version for info in kept], dtype=bool), lengths),
            imitated=imitated_frames(per_episode, revisit_radius) if revisit_radius > 0 else None,
            images=corpus.images(ids, cameras) if cameras else None,
        )

    def __len__(self) -> int:
        return int(self.states.shape[0])

    @property
    def drawable(self) -> np.ndarray:
        """(N,) bool: frames a training batch may draw."""
        return np.ones(len(self), dtype=bool) if self.imitated is None else self.imitated

    @property
    def removed_frames(self) -> int:
        """Frames left out by loop removal."""
        return 0 if self.imitated is None else int((~self.imitated).sum())

    def uniform_set(self) -> TrainingSet:
        """Every drawable frame with the same probability (BC, success-filtered BC)."""
        if self.imitated is None:
            return self.training_set()
        return self.training_set(self.imitated / self.imitated.sum())


@dataclass(frozen=True)
class PriorityWeights:
    weights: np.ndarray  # (N,) w_f >= 1 for every frame of the table
    retrieved: np.ndarray  # (N,) bool: frame lies in at least one kept match (and loop removal kept it)
    sigma: float
    alpha: float
    uniform: bool

    @property
    def retrieved_frames(self) -> int:
        return int(self.retrieved.sum())


def resolve_sigma(retrieved: Retrieved, sigma: float) -> float:
    """``sigma`` as configured, or the median retrieved (plain) distance when it is 0."""
    if sigma > 0:
        return float(sigma)
    lengths = retrieved.euclidean()
    median = float(np.median(lengths)) if len(lengths) else 1.0
    return median if median > 0 else 1.0


def priority_weights(
    table: FrameTable, retrieved: Retrieved, alpha: float, sigma: float = 0.0, uniform: bool = False, lead: int = 0
) -> PriorityWeights:
    """Per-frame weights (module doc). Matches on episodes missing from ``table`` raise.

    ``lead`` moves each match's credited frames that many steps later in its episode (clipped at its end).
    """
    n = len(table)
    sigma = resolve_sigma(retrieved, sigma)
    if len(retrieved) == 0:
        return PriorityWeights(np.ones(n), np.zeros(n, dtype=bool), sigma, alpha, uniform)
    missing = {e for e in retrieved.episode_ids if e not in table.offsets}
    if missing:
        raise ValueError(
            f"{len(missing)} retrieved episodes (e.g. {sorted(missing)[0]!r}) are not among the successful "
            "episodes given; pass the same dataset the segment store was built from"
        )
    offset = np.array([table.offsets[e] for e in retrieved.episode_ids], dtype=np.int64)
    length = np.array([table.lengths[e] for e in retrieved.episode_ids], dtype=np.int64)
    first = offset + np.clip(retrieved.starts + lead, 0, length)
    last = offset + np.clip(retrieved.ends + lead, 0, length)  # exclusive
    d = retrieved.euclidean()
    kernel = np.exp(-(d**2) / (2.0 * sigma**2))

    # add each match's kernel to its frame range with a difference array, then prefix-sum
    contribution = np.zeros(n + 1)
    np.add.at(contribution, first, kernel)
    np.add.at(contribution, last, -kernel)
    coverage = np.zeros(n + 1, dtype=np.int64)
    np.add.at(coverage, first, 1)
    np.add.at(coverage, last, -1)
    hit = (np.cumsum(coverage)[:n] > 0) & table.drawable  # frames loop removal left out are never retrieved
    if uniform:
        weights = np.ones(n)
    else:
        weights = 1.0 + alpha * np.maximum(np.cumsum(contribution)[:n], 0.0)
    return PriorityWeights(weights, hit, sigma, alpha, uniform)
