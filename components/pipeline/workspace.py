"""A workspace = one root's settings plus handles on its dataset, segment store and registry.

Everything on disk resolves from ``settings.root`` (one root), so a test or benchmark pointed at
a scratch folder never shares state with the repository's own data.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from pathlib import Path

import torch

from components.config import Paths, Settings
from components.episodes.dataset import EpisodeDataset
from components.registry.model_registry import PolicyRegistry
from components.sim.factory import action_dim, observation_dim
from components.store.encoder import NormalizedStateEncoder
from components.store.segment_store import SegmentStore

ENCODER_FILE = "segments.encoder.pt"


@dataclass
class Workspace:
    settings: Settings

    @property
    def paths(self) -> Paths:
        return self.settings.paths

    @property
    def obs_dim(self) -> int:
        return observation_dim(self.settings.sim)

    @property
    def act_dim(self) -> int:
        return action_dim(self.settings.sim)

    @cached_property
    def dataset(self) -> EpisodeDataset:
        return EpisodeDataset(self.paths.episodes, self.settings.episodes)

    @cached_property
    def registry(self) -> PolicyRegistry:
        return PolicyRegistry(self.paths.mlruns, self.settings.registry)

    @property
    def encoder_path(self) -> Path:
        return self.paths.datasets / ENCODER_FILE

    def load_encoder(self) -> NormalizedStateEncoder | None:
        if not self.encoder_path.exists():
            return None
        return NormalizedStateEncoder.from_state_dict(torch.load(self.encoder_path, weights_only=False))

    def save_encoder(self, encoder: NormalizedStateEncoder) -> None:
        self.encoder_path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.encoder_path.with_suffix(".tmp")
        torch.save(encoder.state_dict(), tmp)
        tmp.replace(self.encoder_path)

    def store(self, dim: int) -> SegmentStore:
        return SegmentStore.open(self.paths.store, self.settings.store, dim)
