"""What a training set is built from: the stored episodes, read only as far as a method needs them.

    infos          one EpisodeInfo per episode (id, robot, task, label, policy, length): the
                   episodes table alone, no frames read
    frames(ids)    states and actions of the listed episodes, concatenated: the frames imitated
    images(ids, k) their camera frames (key -> (N, H, W, 3) uint8), decoded: a vision policy's input
    load(ids)      whole episodes, for the few that are needed whole (the failures that query,
                   the successes that calibrate the divergence detector)

``DatasetCorpus`` reads a stored dataset through its streaming readers
(``EpisodeDataset.episode_columns`` / ``load_episodes``): building a training set decodes no
failed episode that does not query and holds no ``Episode`` per stored episode, so its memory is
the training set's frames; the train task, the fleet trainer and ``fleetloop reproduce`` build
from it. ``EpisodeList`` wraps episodes a caller already holds in memory (benchmarks, tests); both
give the same training set for the same episodes.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from components.episodes.dataset import EpisodeDataset
from components.episodes.layout import META_LENGTH, META_TASKS
from components.episodes.record import Episode
from components.episodes.schema import (
    ACTION,
    EPISODE_ID,
    EPISODE_INDEX,
    INTERRUPTED,
    POLICY_VERSION,
    ROBOT_ID,
    STATE,
    SUCCESS,
)


@dataclass(frozen=True)
class EpisodeInfo:
    """An episode's label and provenance, without its frames."""

    episode_id: str
    robot_id: str
    task: str
    success: bool
    interrupted: bool
    policy_version: str
    length: int


class Corpus(Protocol):
    infos: list[EpisodeInfo]

    def frames(self, ids: Sequence[str]) -> tuple[np.ndarray, np.ndarray]:
        """(states, actions) of the listed episodes, concatenated in the order listed (float32)."""
        ...

    def images(self, ids: Sequence[str], keys: Sequence[str]) -> dict[str, np.ndarray]:
        """Camera frames of the listed episodes, concatenated in the order listed, per key."""
        ...

    def load(self, ids: Sequence[str]) -> list[Episode]:
        """The listed episodes, whole, in the order listed."""
        ...


def _no_camera(episode_id: str, key: str, has: Sequence[str]) -> KeyError:
    return KeyError(f"episode {episode_id} has no camera {key!r} (it has {list(has) or 'none'}): a vision policy "
                    "(policy.kind: vision) trains on episodes collected with sim.cameras on; set policy.cameras "
                    "to cameras every episode has, or re-collect")


def info_of(episode: Episode) -> EpisodeInfo:
    return EpisodeInfo(episode.episode_id, episode.robot_id, episode.task, episode.success, episode.interrupted,
                       episode.policy_version, episode.length)


class EpisodeList:
    """Episodes already in memory, in the order given."""

    def __init__(self, episodes: Iterable[Episode]) -> None:
        self._episodes = {ep.episode_id: ep for ep in episodes}
        self.infos = [info_of(ep) for ep in self._episodes.values()]

    def frames(self, ids: Sequence[str]) -> tuple[np.ndarray, np.ndarray]:
        picked = self.load(ids)
        return (np.concatenate([ep.states for ep in picked]).astype(np.float32),
                np.concatenate([ep.actions for ep in picked]).astype(np.float32))

    def images(self, ids: Sequence[str], keys: Sequence[str]) -> dict[str, np.ndarray]:
        picked = self.load(ids)
        for ep in picked:
            for key in keys:
                if key not in ep.cameras:
                    raise _no_camera(ep.episode_id, key, list(ep.cameras))
        return {key: np.concatenate([ep.cameras[key] for ep in picked]) for key in keys}

    def load(self, ids: Sequence[str]) -> list[Episode]:
        return [self._episodes[i] for i in ids]


class DatasetCorpus:
    """A stored dataset's episodes by id (the train task's order, whatever order they arrived
    in), leaving out interrupted ones (a FATS robot stopped mid-episode: neither imitated nor
    queried); ``stop`` keeps only the first ``stop`` in dataset order (a pin of the fleet trainer)."""

    def __init__(self, dataset: EpisodeDataset, stop: int | None = None, cameras: bool = False) -> None:
        self.dataset = dataset
        self.cameras = cameras  # ``load`` decodes each episode's camera streams (a camera window encoder reads them)
        stored = episode_infos(dataset, 0, stop)
        self._index = {info.episode_id: index for index, info in stored}  # episode id -> episode_index
        self.infos = sorted((info for _, info in stored if not info.interrupted), key=lambda info: info.episode_id)

    def frames(self, ids: Sequence[str]) -> tuple[np.ndarray, np.ndarray]:
        columns = self.dataset.episode_columns([self._index[i] for i in ids], (STATE, ACTION))
        return columns[STATE], columns[ACTION]

    def images(self, ids: Sequence[str], keys: Sequence[str]) -> dict[str, np.ndarray]:
        """Decoded in dataset order (each video file read on from where it stood, no seek per
        episode), then laid out in the order listed."""
        decoded: dict[str, dict[str, np.ndarray]] = {}
        for episode_id in sorted(ids, key=lambda i: self._index[i]):
            frames = self.dataset.camera_frames(self._index[episode_id], keys)
            missing = [k for k in keys if k not in frames]
            if missing:
                raise _no_camera(episode_id, missing[0], list(frames))
            decoded[episode_id] = frames
        return {key: np.concatenate([decoded[i][key] for i in ids]) for key in keys}

    def load(self, ids: Sequence[str]) -> list[Episode]:
        return self.dataset.load_episodes([self._index[i] for i in ids], cameras=self.cameras) if ids else []


def episode_infos(dataset: EpisodeDataset, start: int = 0, stop: int | None = None) -> list[tuple[int, EpisodeInfo]]:
    """(episode_index, info) of the stored episodes ``start:stop`` in dataset order, from the
    episodes table alone: what a consumer following the ingest needs to know of each new one."""
    table = dataset.episode_rows(start, stop)
    if not table.num_rows:
        return []
    names = (EPISODE_INDEX, EPISODE_ID, ROBOT_ID, META_TASKS, SUCCESS, INTERRUPTED, POLICY_VERSION, META_LENGTH)
    rows = zip(*(table.column(name).to_pylist() for name in names), strict=True)
    return [(int(index), EpisodeInfo(eid, robot, tasks[0], bool(ok), bool(cut), version, int(length)))
            for index, eid, robot, tasks, ok, cut, version, length in rows]


def as_corpus(episodes: Corpus | Iterable[Episode]) -> Corpus:
    """A corpus as given, or episodes in memory wrapped as one (their order kept)."""
    return episodes if hasattr(episodes, "infos") else EpisodeList(episodes)  # type: ignore[return-value]
