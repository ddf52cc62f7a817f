"""Window encoders: (N, W, n) state windows -> (N, D) float32 vectors for the segment store.

The store only needs the ``WindowEncoder`` protocol, so a learned encoder can replace the
default without touching the store. An encoder's ``state_dict()`` is plain JSON-able data
(numbers, strings, lists) with a ``"kind"`` key, so it can be saved beside a model checkpoint or
in the store itself, and rebuilt with ``encoder_from_state_dict``.

An encoder may also read the windows' camera frames: one with a non-empty ``cameras`` attribute
(dataset keys, ``observation.images.<view>``) is called ``encode(windows, images=...)`` with each
key's frames cut into the same windows ((N, W, H, W', 3) uint8). ``encode_episodes`` is the one
place that decides, so the store and FERT's divergence detector embed the same way; encoders
without ``cameras`` are called exactly as before.

Default: ``NormalizedStateEncoder`` — per state dimension, subtract the mean and divide by the
standard deviation fitted on data, then flatten the window (D = W * n). Distances between
windows then weigh every state dimension equally instead of by its physical unit.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from typing import Any, ClassVar, Protocol, Self, runtime_checkable

import numpy as np

from components.episodes.record import Episode
from components.store.windows import Windows, camera_windows

# A dimension whose std is below this is (nearly) constant in the data: divide by 1 instead of
# blowing its noise up to unit scale.
STD_FLOOR = 1e-6


@runtime_checkable
class WindowEncoder(Protocol):
    """What the segment store needs from an encoder. Implementations must be deterministic."""

    kind: ClassVar[str]

    @property
    def dim(self) -> int:
        """Length D of the output vectors."""
        ...

    def fit(self, windows: np.ndarray) -> Self:
        """Fit on (N, W, n) windows; returns self."""
        ...

    def encode(self, windows: np.ndarray) -> np.ndarray:
        """(N, W, n) windows -> (N, D) float32. An encoder with ``cameras`` (see the module doc)
        also takes ``images``: key -> (N, W, H, W', 3) uint8, the same windows of each camera."""
        ...

    def state_dict(self) -> dict[str, Any]:
        """JSON-able state including ``"kind"``."""
        ...

    @classmethod
    def from_state_dict(cls, state: dict[str, Any]) -> Self:
        ...


class NormalizedStateEncoder:
    """Per-dimension z-score of every frame, then the window flattened (frame-major)."""

    kind: ClassVar[str] = "normalized_state"

    def __init__(self, window: int, state_dim: int | None = None) -> None:
        if window < 1:
            raise ValueError(f"window must be >= 1, got {window}")
        self.window = int(window)
        self.state_dim = state_dim
        self.mean: np.ndarray | None = None  # (n,) float32
        self.std: np.ndarray | None = None  # (n,) float32

    @property
    def fitted(self) -> bool:
        return self.mean is not None

    @property
    def dim(self) -> int:
        if self.state_dim is None:
            raise ValueError("NormalizedStateEncoder.dim is unknown before fit(); fit it first")
        return self.window * self.state_dim

    def _check(self, windows: np.ndarray, what: str) -> np.ndarray:
        windows = np.asarray(windows)
        if windows.ndim != 3 or windows.shape[1] != self.window:
            raise ValueError(
                f"{what}: expected windows of shape (N, {self.window}, n), got {windows.shape}; "
                f"cut them with store.window={self.window}"
            )
        if self.state_dim is not None and windows.shape[2] != self.state_dim:
            raise ValueError(
                f"{what}: state dim {windows.shape[2]} != the encoder's {self.state_dim}; "
                "use the encoder fitted on this robot's observation.state, or fit a new one"
            )
        if not np.isfinite(windows).all():
            raise ValueError(f"{what}: windows contain NaN/inf; validate episodes before encoding")
        return windows

    def fit(self, windows: np.ndarray) -> Self:
        windows = self._check(windows, "NormalizedStateEncoder.fit")
        if windows.shape[0] == 0:
            raise ValueError("NormalizedStateEncoder.fit: no windows to fit on")
        frames = windows.reshape(-1, windows.shape[2]).astype(np.float64)
        std = frames.std(axis=0)
        self.state_dim = int(windows.shape[2])
        self.mean = frames.mean(axis=0).astype(np.float32)
        self.std = np.where(std < STD_FLOOR, 1.0, std).astype(np.float32)
        return self

    def encode(self, windows: np.ndarray) -> np.ndarray:
        if self.mean is None or self.std is None:
            raise ValueError("NormalizedStateEncoder.encode before fit(); fit or load a state_dict")
        windows = self._check(windows, "NormalizedStateEncoder.encode")
        z = (windows.astype(np.float32) - self.mean) / self.std
        return np.ascontiguousarray(z.reshape(windows.shape[0], -1), dtype=np.float32)

    def state_dict(self) -> dict[str, Any]:
        if self.mean is None or self.std is None:
            raise ValueError("NormalizedStateEncoder.state_dict before fit(); nothing to save")
        return {
            "kind": self.kind,
            "window": self.window,
            "state_dim": self.state_dim,
            "mean": [float(x) for x in self.mean],
            "std": [float(x) for x in self.std],
        }

    @classmethod
    def from_state_dict(cls, state: dict[str, Any]) -> Self:
        if state.get("kind") != cls.kind:
            raise ValueError(f"state_dict kind {state.get('kind')!r} is not {cls.kind!r}")
        encoder = cls(window=int(state["window"]), state_dim=int(state["state_dim"]))
        encoder.mean = np.asarray(state["mean"], dtype=np.float32)
        encoder.std = np.asarray(state["std"], dtype=np.float32)
        if encoder.mean.shape != (encoder.state_dim,) or encoder.std.shape != (encoder.state_dim,):
            raise ValueError(
                f"state_dict mean/std must have state_dim={encoder.state_dim} entries, "
                f"got {encoder.mean.shape} and {encoder.std.shape}"
            )
        return encoder


ENCODERS: dict[str, type[WindowEncoder]] = {NormalizedStateEncoder.kind: NormalizedStateEncoder}


def encoder_cameras(encoder: WindowEncoder) -> tuple[str, ...]:
    """The camera keys an encoder reads (() for a state-only encoder)."""
    return tuple(getattr(encoder, "cameras", ()) or ())


def encode_episodes(encoder: WindowEncoder, episodes: Sequence[Episode], cuts: Sequence[Windows]) -> np.ndarray:
    """The vectors of every window of ``cuts`` (``cut_windows`` of each episode's states), in order.
    An encoder with ``cameras`` gets each episode's camera windows beside its state windows, one
    episode at a time (its frames are large); any other encoder gets one call, as it always did."""
    keys = encoder_cameras(encoder)
    if not keys:
        return np.asarray(encoder.encode(np.concatenate([c.windows for c in cuts], axis=0)))
    parts = []
    for ep, cut in zip(episodes, cuts, strict=True):
        missing = [k for k in keys if k not in ep.cameras]
        if missing:
            raise ValueError(
                f"episode {ep.episode_id} has no camera stream {missing[0]!r} (it has {sorted(ep.cameras) or 'none'}), "
                f"but the store's window encoder ({encoder.kind}) embeds camera windows of {list(keys)}: read "
                "episodes with their cameras (dataset.load_episodes(..., cameras=True)), collect with sim.cameras on, "
                "or use a state encoder (fert.encoder)"
            )
        window = cut.windows.shape[1]
        images = {k: camera_windows(ep.cameras[k], cut.starts, window) for k in keys}
        parts.append(np.asarray(encoder.encode(cut.windows, images=images)))  # type: ignore[call-arg]
    return np.concatenate(parts, axis=0)


def encoder_from_state_dict(state: dict[str, Any]) -> WindowEncoder:
    """Rebuild any registered encoder from its ``state_dict()``."""
    kind = state.get("kind")
    if kind not in ENCODERS:
        raise ValueError(f"unknown encoder kind {kind!r}; registered: {sorted(ENCODERS)}")
    return ENCODERS[kind].from_state_dict(state)


def encoder_fingerprint(encoder: WindowEncoder) -> str:
    """A short hash of the encoder's state: equal fingerprints embed windows identically."""
    blob = json.dumps(encoder.state_dict(), sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(blob.encode()).hexdigest()[:16]
