"""Executing action chunks: re-planning and ACT's temporal ensembling, per env (numpy, no torch).

A chunk policy queried at step s predicts actions for steps s, s+1, ..., s+k-1. The executor queries
a new chunk every ``replan_every`` steps of an env's episode (and at its first step) and keeps the
chunks that still cover a future step. The action at step t is the weighted mean of every kept
chunk's prediction for t,

    a_t = sum_i w_i * chunk_i[t - s_i] / sum_i w_i,    w_i = exp(-m * i),   i = 0 the oldest chunk

(ACT, Zhao et al. 2023, "temporal ensembling"; ``m = policy.ensemble_decay``; m > 0 favours older
predictions as ACT does, m = 0 is a plain mean, m < 0 favours the newest). With ``replan_every``
= k exactly one chunk covers each step: the chunk runs open loop. Chunks never cross an episode:
``restart`` clears an env whose next observation is a new episode's first frame.
"""

from __future__ import annotations

import numpy as np


class ChunkEnsemble:
    """Per-env chunk buffer: ``due()`` -> envs to query, ``add(chunks, envs)``, ``act()`` -> (B, m)."""

    def __init__(self, chunk: int, replan_every: int, decay: float) -> None:
        if not 1 <= replan_every <= chunk:
            raise ValueError(f"policy.replan_every={replan_every} must lie in [1, policy.chunk_size={chunk}]")
        self.chunk, self.replan_every, self.decay = chunk, replan_every, decay
        self.slots = -(-chunk // replan_every)  # chunks that can cover one step at once
        self.chunks: np.ndarray | None = None  # (B, slots, k, m)
        self.starts: np.ndarray | None = None  # (B, slots) episode step each chunk was queried at; -1 = empty
        self.step: np.ndarray | None = None  # (B,) the env's step in its episode

    def restart(self, envs: np.ndarray) -> None:
        """Envs (bool mask or indices) whose next observation starts a new episode."""
        if self.step is not None and self.starts is not None:
            self.step[envs] = 0
            self.starts[envs] = -1

    def _fit(self, envs: int) -> None:
        if self.step is None or len(self.step) != envs:
            self.chunks, self.starts = None, np.full((envs, self.slots), -1, dtype=np.int64)
            self.step = np.zeros(envs, dtype=np.int64)

    def due(self, envs: int) -> np.ndarray:
        """(B,) bool: envs whose current step queries a new chunk (every ``replan_every`` steps)."""
        self._fit(envs)
        assert self.step is not None
        return self.step % self.replan_every == 0

    def add(self, chunks: np.ndarray, envs: np.ndarray) -> None:
        """Store ``chunks`` (len(envs), k, m), queried now, for ``envs`` (bool mask of the due envs)."""
        chunks = np.asarray(chunks, dtype=np.float32)
        assert self.step is not None and self.starts is not None
        if chunks.ndim != 3 or chunks.shape[1] != self.chunk:
            raise ValueError(f"expected chunks (B, {self.chunk}, m) (policy.chunk_size), got {chunks.shape}")
        if self.chunks is None or self.chunks.shape[-1] != chunks.shape[-1]:
            self.chunks = np.zeros((len(self.step), self.slots, self.chunk, chunks.shape[-1]), dtype=np.float32)
        rows = np.flatnonzero(envs)
        slot = (self.step[rows] // self.replan_every) % self.slots  # the slot of the chunk queried k steps ago
        self.chunks[rows, slot] = chunks
        self.starts[rows, slot] = self.step[rows]

    def act(self) -> np.ndarray:
        """(B, m) this step's ensembled action per env; advances every env by one step."""
        assert self.step is not None and self.starts is not None
        if self.chunks is None:
            raise RuntimeError("ChunkEnsemble.act before any chunk was added (query the due envs first)")
        offset = self.step[:, None] - self.starts  # (B, slots)
        covers = (self.starts >= 0) & (offset >= 0) & (offset < self.chunk)
        if not covers.any(axis=1).all():
            raise RuntimeError("an env has no chunk covering this step: query every env that due() names")
        older = (covers[:, None, :] & (self.starts[:, None, :] < self.starts[:, :, None])).sum(-1)  # (B, slots)
        weights = np.where(covers, np.exp(-self.decay * older), 0.0)
        picked = np.take_along_axis(self.chunks, np.clip(offset, 0, self.chunk - 1)[:, :, None, None], axis=2)[:, :, 0]
        action = (weights[:, :, None] * picked).sum(1) / weights.sum(1, keepdims=True)
        self.step += 1
        return action.astype(np.float32)
