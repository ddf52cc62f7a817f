"""A learned window encoder, trained on the fleet's own successful windows (no downloads).

Raw normalized states weigh every dimension equally, so absolute object/goal placement dominates
the distance (FERT-NOTES item 3). This encoder learns which state features decide *what the
robot does*: an MLP maps a z-scored window to a ``dim``-sized code from which a linear head must
predict the window's actions (successful windows only: their actions are the ones worth
imitating). Windows are then close when they call for similar actions, wherever they lie.

    (N, W, n) windows --z-score--> flatten --Linear+tanh--> hidden --Linear--> code (N, dim)
                                                                              --Linear--> actions (N, W*m)  [training only]

``fit(windows)`` alone (no actions at hand) predicts the window's frame-to-frame state changes
instead. Training is seeded and on CPU; ``encode`` is plain numpy on the stored weights, so the
store can rebuild it from ``state_dict()`` (JSON) and embeddings are bit-identical everywhere.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, ClassVar, Self

import numpy as np
import torch
from torch import nn

from components.episodes.record import Episode
from components.store.encoder import ENCODERS, STD_FLOOR
from components.store.windows import cut_windows

HIDDEN = 64
LEARNING_RATE = 3e-3
BATCH = 256


class ActionPredictiveEncoder:
    """Window -> code trained to predict the window's actions (see the module doc)."""

    kind: ClassVar[str] = "action_predictive"

    def __init__(self, window: int, state_dim: int | None = None, dim: int = 16, epochs: int = 20, seed: int = 0) -> None:
        if window < 1 or dim < 1 or epochs < 1:
            raise ValueError(f"window, dim and epochs must be >= 1, got {window}, {dim}, {epochs}")
        self.window, self.state_dim, self.code_dim, self.epochs, self.seed = window, state_dim, dim, epochs, seed
        self.mean: np.ndarray | None = None
        self.std: np.ndarray | None = None
        self.w1: np.ndarray | None = None  # (W*n, HIDDEN)
        self.b1: np.ndarray | None = None
        self.w2: np.ndarray | None = None  # (HIDDEN, dim)
        self.b2: np.ndarray | None = None

    @property
    def dim(self) -> int:
        return self.code_dim

    def _check(self, windows: np.ndarray, what: str) -> np.ndarray:
        windows = np.asarray(windows, dtype=np.float32)
        if windows.ndim != 3 or windows.shape[1] != self.window:
            raise ValueError(f"{what}: expected windows (N, {self.window}, n), got {windows.shape}")
        if self.state_dim is not None and windows.shape[2] != self.state_dim:
            raise ValueError(f"{what}: state dim {windows.shape[2]} != the encoder's {self.state_dim}")
        if not np.isfinite(windows).all():
            raise ValueError(f"{what}: windows contain NaN/inf")
        return windows

    @classmethod
    def from_successes(
        cls, episodes: Sequence[Episode], window: int, stride: int, dim: int, epochs: int, seed: int
    ) -> ActionPredictiveEncoder:
        """Fitted on the successful episodes' windows and their actions (what a store's first ingest does)."""
        successes = [ep for ep in episodes if ep.success]
        if not successes:
            raise ValueError("the learned window encoder needs successful episodes to learn from; ingest expert demos first")
        windows = np.concatenate([cut_windows(ep.states, window, stride).windows for ep in successes])
        actions = np.concatenate([cut_windows(ep.actions, window, stride).windows for ep in successes])
        return cls(window, windows.shape[2], dim, epochs, seed).fit_supervised(windows, actions)

    def fit(self, windows: np.ndarray) -> Self:
        """Without actions: predict the window's frame-to-frame state changes."""
        windows = self._check(windows, "ActionPredictiveEncoder.fit")
        return self.fit_supervised(windows, np.diff(windows, axis=1))

    def fit_supervised(self, windows: np.ndarray, targets: np.ndarray) -> Self:
        """Train on (N, W, n) success windows and their (N, W, m) actions."""
        windows = self._check(windows, "ActionPredictiveEncoder.fit_supervised")
        if len(windows) == 0 or len(targets) != len(windows):
            raise ValueError(f"need as many target rows as windows (> 0), got {len(targets)} for {len(windows)}")
        self.state_dim = int(windows.shape[2])
        frames = windows.reshape(-1, self.state_dim).astype(np.float64)
        std = frames.std(axis=0)
        self.mean = frames.mean(axis=0).astype(np.float32)
        self.std = np.where(std < STD_FLOOR, 1.0, std).astype(np.float32)
        x = torch.as_tensor(self._inputs(windows))
        y = torch.as_tensor(np.asarray(targets, dtype=np.float32).reshape(len(windows), -1))
        y = (y - y.mean(0)) / y.std(0).clamp_min(STD_FLOOR)

        generator = torch.Generator().manual_seed(self.seed)
        torch.manual_seed(self.seed)
        encoder = nn.Sequential(nn.Linear(x.shape[1], HIDDEN), nn.Tanh(), nn.Linear(HIDDEN, self.code_dim))
        head = nn.Linear(self.code_dim, y.shape[1])
        optimizer = torch.optim.Adam([*encoder.parameters(), *head.parameters()], lr=LEARNING_RATE)
        steps = max(1, len(x) // BATCH) * self.epochs
        for _ in range(steps):
            idx = torch.randint(len(x), (min(BATCH, len(x)),), generator=generator)
            loss = nn.functional.mse_loss(head(encoder(x[idx])), y[idx])
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
        self.w1 = encoder[0].weight.detach().numpy().T.copy()
        self.b1 = encoder[0].bias.detach().numpy().copy()
        self.w2 = encoder[2].weight.detach().numpy().T.copy()
        self.b2 = encoder[2].bias.detach().numpy().copy()
        return self

    def _inputs(self, windows: np.ndarray) -> np.ndarray:
        z = (windows.astype(np.float32) - self.mean) / self.std
        return np.ascontiguousarray(z.reshape(len(windows), -1), dtype=np.float32)

    def encode(self, windows: np.ndarray) -> np.ndarray:
        if self.w1 is None:
            raise ValueError("ActionPredictiveEncoder.encode before fit(); fit it or load a state_dict")
        x = self._inputs(self._check(windows, "ActionPredictiveEncoder.encode"))
        return (np.tanh(x @ self.w1 + self.b1) @ self.w2 + self.b2).astype(np.float32)

    def state_dict(self) -> dict[str, Any]:
        if self.w1 is None:
            raise ValueError("ActionPredictiveEncoder.state_dict before fit(); nothing to save")
        arrays = {k: getattr(self, k).tolist() for k in ("mean", "std", "w1", "b1", "w2", "b2")}
        return {"kind": self.kind, "window": self.window, "state_dim": self.state_dim, "dim": self.code_dim,
                "epochs": self.epochs, "seed": self.seed, **arrays}

    @classmethod
    def from_state_dict(cls, state: dict[str, Any]) -> Self:
        if state.get("kind") != cls.kind:
            raise ValueError(f"state_dict kind {state.get('kind')!r} is not {cls.kind!r}")
        encoder = cls(int(state["window"]), int(state["state_dim"]), int(state["dim"]), int(state["epochs"]), int(state["seed"]))
        for key in ("mean", "std", "w1", "b1", "w2", "b2"):
            setattr(encoder, key, np.asarray(state[key], dtype=np.float32))
        return encoder


# The store rebuilds encoders by kind (store.load_encoder()); make this one known to it.
ENCODERS.setdefault(ActionPredictiveEncoder.kind, ActionPredictiveEncoder)
