"""LanceDB segment store: episode window embeddings, idempotent upsert, filtered kNN, versions.

The names below load on first use (PEP 562): importing a light submodule such as
``components.store.location`` (the CLI does, for its error type) does not load LanceDB and torch.
"""

from importlib import import_module

_EXPORTS = {
    "NormalizedStateEncoder": "components.store.encoder",
    "WindowEncoder": "components.store.encoder",
    "encoder_fingerprint": "components.store.encoder",
    "encoder_from_state_dict": "components.store.encoder",
    "SearchResult": "components.store.segment_store",
    "SegmentStore": "components.store.segment_store",
    "UpsertReport": "components.store.segment_store",
    "segment_schema": "components.store.segment_store",
    "Windows": "components.store.windows",
    "cut_windows": "components.store.windows",
    "episode_windows": "components.store.windows",
    "window_count": "components.store.windows",
    "window_starts": "components.store.windows",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(import_module(_EXPORTS[name]), name)
    globals()[name] = value  # loaded once
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_EXPORTS})
