"""LanceDB segment store: episode window embeddings, idempotent upsert, filtered kNN, versions."""

from components.store.encoder import (
    NormalizedStateEncoder,
    WindowEncoder,
    encoder_fingerprint,
    encoder_from_state_dict,
)
from components.store.segment_store import SearchResult, SegmentStore, UpsertReport, segment_schema
from components.store.windows import Windows, cut_windows, episode_windows, window_starts

__all__ = [
    "NormalizedStateEncoder",
    "SearchResult",
    "SegmentStore",
    "UpsertReport",
    "WindowEncoder",
    "Windows",
    "cut_windows",
    "encoder_fingerprint",
    "episode_windows",
    "encoder_from_state_dict",
    "segment_schema",
    "window_starts",
]
