"""The asynchronous fleet trainer: keeps learning from whatever the fleet has stored so far.

    poll the episode dataset -> episodes past the data cursor join the replay buffer
      (successful, uninterrupted ones: filtered BC; or every uninterrupted one)
    -> ``steps_per_episode`` optimizer steps owed per new episode (replay ratio)
    -> every ``checkpoint_every`` steps an atomic checkpoint: weights, optimizer, RNGs, cursor,
       steps owed, the loss curve and the resume log
    on start: resume from the newest checkpoint (buffer rebuilt from the first ``cursor``
    episodes, which never change: the dataset only appends), else start fresh.

A SIGKILL loses at most the steps since the last checkpoint; they are redone with the same RNG
state. ``state/trainer.json`` tells the coordinator (and people) where training stands.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from dataclasses import dataclass, field

import numpy as np
import torch
from torch import nn

from components.config import Settings
from components.episodes.dataset import EpisodeDataset
from components.episodes.record import Episode
from components.fleet.clients import CoordinatorClient, HeartbeatThread
from components.fleet.layout import RuntimeLayout, atomic_write
from components.policy.factory import make_policy
from components.policy.normalizer import NormalizedPolicy
from components.sim.factory import action_dim, observation_dim
from components.training.checkpoint import TrainingCheckpoint, capture_rng, load_latest, restore_rng, save_checkpoint
from components.training.determinism import seed_everything

log = logging.getLogger(__name__)

STATUS_NAME = "trainer.json"
TRAIN_CHUNK = 10  # optimizer steps between looks at the stop flag / new data
REFRESH_ATTEMPTS = 3
LOSS_HISTORY = 20_000  # (step, loss) pairs kept in checkpoints; older ones are dropped


@dataclass
class TrainerState:
    step: int = 0
    cursor: int = 0  # dataset episodes consumed (episode_index order)
    owed: int = 0  # optimizer steps owed to consumed data
    frames: int = 0  # frames in the replay buffer
    losses: list[tuple[int, float]] = field(default_factory=list)
    resumes: list[int] = field(default_factory=list)  # step each resume started from


class FleetTrainer:
    """Replay buffer + policy + optimizer, checkpointed; one instance per trainer process."""

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.cfg = settings.runtime
        self.layout = RuntimeLayout.of(settings)
        self.dataset = EpisodeDataset(settings.paths.episodes, settings.episodes)
        self.obs_dim, self.act_dim = observation_dim(settings.sim), action_dim(settings.sim)
        self.generator = seed_everything(settings.seed)
        self.state = TrainerState()
        self.policy: NormalizedPolicy | None = None
        self.optimizer: torch.optim.Optimizer | None = None
        self._states: list[np.ndarray] = []
        self._actions: list[np.ndarray] = []
        self._buffer: tuple[torch.Tensor, torch.Tensor] | None = None

    # -------------------------------------------------------------------------- data
    def _keep(self, episode: Episode) -> bool:
        if episode.interrupted:
            return False
        return episode.success or not self.cfg.trainer_success_only

    def _read(self, start: int, stop: int | None) -> int:
        """Add dataset episodes [start, stop) to the buffer; returns how many were read."""
        read = 0
        for episode in self.dataset.episodes(start, stop):
            read += 1
            if self._keep(episode):
                self._states.append(episode.states)
                self._actions.append(episode.actions)
                self.state.frames += episode.length
        if read:
            self._buffer = None
        return read

    def consume(self) -> int:
        """New episodes since the cursor -> buffer; returns how many; steps become owed."""
        for attempt in range(REFRESH_ATTEMPTS):
            try:
                self.dataset.refresh()
                break
            except (OSError, ValueError) as exc:  # a read racing the ingest writer: try again
                log.warning("dataset refresh failed (%s); retrying", exc)
                time.sleep(self.cfg.trainer_poll_s * (attempt + 1))
        else:
            return 0
        if self.dataset.num_episodes <= self.state.cursor:
            return 0
        new = self._read(self.state.cursor, None)
        self.state.cursor += new
        self.state.owed += new * self.cfg.steps_per_episode
        return new

    def _tensors(self) -> tuple[torch.Tensor, torch.Tensor]:
        if self._buffer is None:
            self._buffer = (
                torch.as_tensor(np.concatenate(self._states), dtype=torch.float32),
                torch.as_tensor(np.concatenate(self._actions), dtype=torch.float32),
            )
        return self._buffer

    # -------------------------------------------------------------------------- model
    def _build(self) -> None:
        policy = make_policy(self.obs_dim, self.act_dim, self.settings.policy)
        self.policy = policy
        self.optimizer = torch.optim.AdamW(policy.parameters(), lr=self.settings.train.lr, weight_decay=self.settings.train.weight_decay)

    def ready(self) -> bool:
        return self.state.frames >= self.cfg.trainer_batch_size

    def train(self, steps: int) -> None:
        """``steps`` optimizer steps on the buffer (fits the normalizers first if the model is new)."""
        states, actions = self._tensors()
        if self.policy is None:
            self._build()
            assert self.policy is not None
            self.policy.obs_norm.fit(states)
            self.policy.act_norm.fit(actions)
        assert self.policy is not None and self.optimizer is not None
        self.policy.train()
        targets = self.policy.act_norm.normalize(actions)
        for _ in range(steps):
            idx = torch.randint(len(states), (self.cfg.trainer_batch_size,), generator=self.generator)
            loss = nn.functional.mse_loss(self.policy.forward_normalized(states[idx]), targets[idx]) + self.policy.aux_loss
            self.optimizer.zero_grad(set_to_none=True)
            loss.backward()
            self.optimizer.step()
            self.state.step += 1
            self.state.owed = max(0, self.state.owed - 1)
            self.state.losses.append((self.state.step, float(loss.detach())))
            if len(self.state.losses) > LOSS_HISTORY:
                del self.state.losses[: len(self.state.losses) - LOSS_HISTORY]
            if self.state.step % self.cfg.checkpoint_every == 0:
                self.checkpoint()

    # -------------------------------------------------------------------------- checkpoints
    def checkpoint(self) -> None:
        assert self.policy is not None and self.optimizer is not None
        s = self.state
        save_checkpoint(
            self.layout.checkpoints,
            TrainingCheckpoint(
                step=s.step,
                model=self.policy.state_dict(),
                optimizer=self.optimizer.state_dict(),
                rng=capture_rng(self.generator),
                cursor={"episodes": s.cursor, "owed": s.owed},
                extra={"losses": [list(x) for x in s.losses], "resumes": list(s.resumes), "frames": s.frames},
            ),
            keep=self.cfg.checkpoints_kept,
        )
        self.write_status()

    def resume(self) -> bool:
        """Continue from the newest checkpoint; False when there is none (fresh start)."""
        ckpt = load_latest(self.layout.checkpoints)
        if ckpt is None:
            return False
        self.dataset.refresh()
        cursor = int(ckpt.cursor["episodes"])
        if self._read(0, cursor) != cursor:
            raise RuntimeError(
                f"checkpoint step {ckpt.step} consumed {cursor} episodes but {self.settings.paths.episodes} has fewer; "
                f"it belongs to another dataset: move {self.layout.checkpoints} aside"
            )
        self._build()
        assert self.policy is not None and self.optimizer is not None
        self.policy.load_state_dict(ckpt.model)
        self.optimizer.load_state_dict(ckpt.optimizer)
        restore_rng(ckpt.rng, self.generator)
        self.state = TrainerState(
            step=ckpt.step,
            cursor=cursor,
            owed=int(ckpt.cursor.get("owed", 0)),
            frames=self.state.frames,
            losses=[(int(a), float(b)) for a, b in ckpt.extra.get("losses", [])],
            resumes=[*map(int, ckpt.extra.get("resumes", [])), ckpt.step],
        )
        log.info("resumed from checkpoint step %d (cursor %d episodes)", ckpt.step, cursor)
        self.write_status()
        return True

    def write_status(self) -> None:
        s = self.state
        body = {
            "step": s.step, "cursor": s.cursor, "owed": s.owed, "frames": s.frames, "resumes": s.resumes,
            "last_loss": s.losses[-1][1] if s.losses else None, "time": time.time(),
        }
        atomic_write(self.layout.state / STATUS_NAME, json.dumps(body).encode())

    # -------------------------------------------------------------------------- loop
    def run(self, stop: threading.Event) -> None:
        """Consume and train until ``stop``; idle (polling) when no steps are owed."""
        self.resume()
        reported = -1
        while not stop.is_set():
            self.consume()
            if self.ready() and self.state.owed > 0:
                self.train(min(TRAIN_CHUNK, self.state.owed))
                continue
            if self.state.step != reported:  # caught up: say so (checkpoints alone may lag)
                self.write_status()
                reported = self.state.step
            stop.wait(self.cfg.trainer_poll_s)


def run_trainer(settings: Settings, token: str, coordinator_url: str, stop: threading.Event | None = None) -> None:
    """The trainer process body: heartbeats + ``FleetTrainer.run``."""
    cfg = settings.runtime
    if cfg.torch_threads:
        torch.set_num_threads(cfg.torch_threads)
    stop = stop or threading.Event()
    trainer = FleetTrainer(settings)
    coordinator = CoordinatorClient(coordinator_url, token, cfg.heartbeat_s * 2)
    heartbeat = HeartbeatThread(
        coordinator, "trainer", cfg.heartbeat_s, lambda: {"step": trainer.state.step, "cursor": trainer.state.cursor}
    ).start()
    try:
        trainer.run(stop)
    finally:
        heartbeat.stop()
        coordinator.close()
