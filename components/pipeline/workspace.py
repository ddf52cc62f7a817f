"""A workspace = one root's settings plus handles on its dataset, segment store and registry.

Everything on disk resolves from ``settings.root`` (one root), so a test or benchmark pointed at
a scratch folder never shares state with the repository's own data; a store configured by URI
(``store.uri``, ``registry.tracking_uri``) lives where its URI says instead.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from components.config import Paths, Settings
from components.episodes.dataset import EpisodeDataset
from components.registry.model_registry import PolicyRegistry
from components.sim.factory import action_dim, observation_dim
from components.store.location import StoreLocation, store_location
from components.store.segment_store import Consistency, SegmentStore


@dataclass
class Workspace:
    settings: Settings
    # "step": the store handle of one step (an ingest), reading the version it opened at plus its
    # own writes; "strong" (long-lived handles): every call sees other processes' writes
    store_consistency: Consistency = "strong"

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
    def embedding_dim(self) -> int:
        """The configured encoder's dim: the learned code (``fert.encoder: learned`` or ``camera``)
        or, by default, a flattened window of normalized states."""
        if self.settings.fert.encoder in ("learned", "camera"):
            return self.settings.fert.learned_dim
        return self.settings.store.window * self.obs_dim

    @property
    def store_location(self) -> StoreLocation:
        """``store.uri`` (an object store; endpoint and keys from the environment) or the local
        default ``<root>/datasets/segments.lance``."""
        return store_location(self.paths.store, self.settings.store)

    @cached_property
    def store(self) -> SegmentStore:
        """The segment store; it keeps the encoder that made its vectors (``store.load_encoder()``)."""
        return SegmentStore.open(self.store_location, self.settings.store, self.embedding_dim, self.store_consistency)
