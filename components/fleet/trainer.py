"""The asynchronous fleet trainer: keeps learning from whatever the fleet has stored so far.

    poll the episode dataset -> episodes past the data cursor join the replay buffer
      (uninterrupted ones; the frames and weights to imitate come from the one training-set
       builder, ``components/fert`` with ``train.method`` — filtered BC unless the method is bc)
    -> ``steps_per_episode`` optimizer steps owed per new episode (replay ratio), each the one
       trainer's step (``training.bc.bc_step``) on the one sampler's batches (``batch_indices``,
       step s = row s % K of iteration s // K's draw, K = ``train.steps_per_iteration``), so on a
       fixed dataset it trains the weights the flow's train task trains
    -> every ``checkpoint_every`` steps an atomic checkpoint: weights, optimizer, RNGs, cursor,
       steps owed, the loss curve, the resume log and what was shipped
    -> between chunks, every ``candidate_every_steps`` steps or ``candidate_every_s`` seconds: a
       checkpoint becomes a candidate (``shipping.py``: evaluated, registered with lineage, gated,
       promoted or rolled out as a canary); RNGs are put back afterwards, so shipping never
       changes what is trained
    on start: resume from the newest checkpoint (buffer rebuilt from the first ``cursor``
    episodes, which never change: the dataset only appends), else start fresh.

A SIGKILL loses at most the steps since the last checkpoint; they are redone with the same RNG
state. ``state/trainer.json`` tells the coordinator (and people) where training stands.
"""

from __future__ import annotations

import copy
import json
import logging
import threading
import time
import uuid
from collections import Counter
from dataclasses import dataclass, field

import numpy as np
import torch

from components.config import Settings
from components.episodes.dataset import EpisodeDataset
from components.episodes.record import Episode
from components.fert.methods import build_training_set
from components.fleet.clients import CoordinatorClient, HeartbeatThread
from components.fleet.layout import RuntimeLayout
from components.fleet.shipping import CandidateShipper, ShippingState
from components.fsio import atomic_write_bytes
from components.policy.history import (
    as_tensor_positions,
    frame_positions,
    gather_windows,
)
from components.policy.normalizer import NormalizedPolicy
from components.sim.factory import action_dim, observation_dim
from components.training.bc import as_weights, batch_indices, bc_step, make_optimizer
from components.training.checkpoint import (
    TrainingCheckpoint,
    capture_rng,
    load_latest,
    restore_rng,
    save_checkpoint,
)
from components.training.determinism import seed_everything
from components.training.imitation import TrainingSet
from components.training.workflow import TrainSpec, initial_policy

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
        self._episodes: list[Episode] = []
        self._buffer: TrainingSet | None = None
        self._block: torch.Tensor | None = None
        self._block_key: tuple[int, int] | None = None
        self.shipping = ShippingState(run_id=uuid.uuid4().hex[:12], since=time.time())
        self.shipper = CandidateShipper(settings, self.shipping)
        self._checkpointed: tuple[int, float] | None = None  # (step, wall time) of the newest checkpoint

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
                self._episodes.append(episode)
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

    def _tensors(self) -> TrainingSet:
        """The buffer as the one training-set builder sees it (method from ``train.method``; FERT,
        trains as filtered BC here: the ingest service now embeds into the segment store, but the
        continuous trainer does not yet run FERT's divergence + retrieval per buffer rebuild)."""
        episodes = sorted(self._episodes, key=lambda ep: ep.episode_id)  # as steps.training_set orders them
        if self._buffer is None and not self.cfg.trainer_success_only:  # every uninterrupted episode, uniform
            self._buffer = TrainingSet(np.concatenate([e.states for e in episodes]).astype(np.float32),
                                       np.concatenate([e.actions for e in episodes]).astype(np.float32),
                                       frame_in_episode=frame_positions([e.length for e in episodes]))
        if self._buffer is None:
            self._buffer = build_training_set(self.method, episodes, self.settings.fert).data
        return self._buffer

    @property
    def method(self) -> str:
        """What the buffer imitates (the candidates' ``fleetloop.method`` tag)."""
        if not self.cfg.trainer_success_only:
            return "uninterrupted_bc"
        return "bc" if self.settings.train.method == "bc" else "filtered_bc"

    # -------------------------------------------------------------------------- model
    def _build(self, data: TrainingSet) -> None:
        spec = TrainSpec(data=data, policy=self.settings.policy, lr=self.settings.train.lr,
                         weight_decay=self.settings.train.weight_decay, batch_size=self.cfg.trainer_batch_size,
                         seed=self.settings.seed, total_steps=1, steps_per_iteration=self.settings.train.steps_per_iteration)
        self.policy = initial_policy(spec)  # normalizers fitted on the training set, as the flow's trainer does
        self.optimizer = make_optimizer(self.policy, self.settings.train.lr, self.settings.train.weight_decay)

    def ready(self) -> bool:
        return self.state.frames >= self.cfg.trainer_batch_size

    def _batch(self, data: TrainingSet, step: int) -> torch.Tensor:
        """Frame indices of optimizer step ``step`` (0-based): the one sampler's draw for its iteration."""
        k = self.settings.train.steps_per_iteration
        key = (step // k, len(data.states))
        if self._block_key != key:
            self._block = batch_indices(len(data.states), as_weights(data.weights), self.cfg.trainer_batch_size, k,
                                        self.settings.seed, step // k)
            self._block_key = key
        return self._block[step % k]

    def train(self, steps: int) -> None:
        """``steps`` optimizer steps on the buffer (fits the normalizers first if the model is new)."""
        data = self._tensors()
        if self.policy is None:
            self._build(data)
        assert self.policy is not None and self.optimizer is not None
        self.policy.train()
        states = torch.as_tensor(data.states)
        positions = as_tensor_positions(data.frame_in_episode)
        targets = self.policy.act_norm.normalize(torch.as_tensor(data.actions))
        for _ in range(steps):
            idx = self._batch(data, self.state.step)
            inputs = gather_windows(states, positions, idx, self.policy.history)
            loss = bc_step(self.policy, self.optimizer, inputs, targets[idx])
            self.state.step += 1
            self.state.owed = max(0, self.state.owed - 1)
            self.state.losses.append((self.state.step, loss))
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
                extra={"losses": [list(x) for x in s.losses], "resumes": list(s.resumes), "frames": s.frames,
                       "shipping": self.shipping.to_dict()},
            ),
            keep=self.cfg.checkpoints_kept,
        )
        self._checkpointed = (s.step, time.time())
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
        self._build(self._tensors())
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
        if "shipping" in ckpt.extra:  # the trainer run goes on: same run id, same shipping record
            self.shipping = ShippingState.from_dict(ckpt.extra["shipping"])
            self.shipper = CandidateShipper(self.settings, self.shipping)
        self._checkpointed = (ckpt.step, time.time())
        log.info("resumed from checkpoint step %d (cursor %d episodes)", ckpt.step, cursor)
        self.write_status()
        return True

    def write_status(self) -> None:
        s = self.state
        body = {
            "step": s.step, "cursor": s.cursor, "owed": s.owed, "frames": s.frames, "resumes": s.resumes,
            "last_loss": s.losses[-1][1] if s.losses else None, "time": time.time(),
            "candidates": self.shipping.to_dict(),
        }
        atomic_write_bytes(self.layout.state / STATUS_NAME, json.dumps(body).encode())

    # -------------------------------------------------------------------------- shipping
    def ship_if_due(self) -> bool:
        """Turn the current step into a candidate when one is due (``shipping.py``); True if shipped.

        The candidate is a checkpoint: one is written at this step first (unless it exists), and
        rewritten after the ship, so the checkpoint records it and a resume never ships it again.
        Runs inline between chunks; a failure is logged and retried after ``candidate_retry_s``.
        """
        now = time.time()
        if self.policy is None or not self.shipper.due(self.state.step, now):
            return False
        try:
            blocked = self.shipper.blocked_by()
        except Exception as exc:  # noqa: BLE001 - the registry is down: train on, retry later
            log.warning("cannot reach the registry to ship step %d (%s); retrying later", self.state.step, exc)
            self.shipper.defer(f"registry unreachable: {exc}"[:200], now)
            return False
        if blocked:
            self.shipper.defer(blocked, now)
            self.write_status()
            return False
        if self._checkpointed is None or self._checkpointed[0] != self.state.step:
            self.checkpoint()
        assert self._checkpointed is not None and self.policy is not None
        rng = capture_rng(self.generator)  # evaluation draws from its own seeds; keep ours untouched
        try:
            self.shipper.ship(
                copy.deepcopy(self.policy), self.state.step, self.state.cursor, self.state.frames,
                [loss for _, loss in self.state.losses], Counter(ep.robot_id for ep in self._episodes),
                self.method, started=self._checkpointed[1],
            )
        except Exception as exc:  # noqa: BLE001 - shipping must never stop training
            log.exception("shipping step %d failed; retrying in %.0fs", self.state.step, self.cfg.candidate_retry_s)
            self.shipper.defer(f"ship failed: {type(exc).__name__}: {exc}"[:200], time.time())
            self.write_status()
            return False
        finally:
            restore_rng(rng, self.generator)
            self.policy.train()
        self.checkpoint()  # same step, now recording the ship
        return True

    # -------------------------------------------------------------------------- loop
    def run(self, stop: threading.Event) -> None:
        """Consume and train until ``stop``, shipping candidates when due; idle (polling) when no
        steps are owed."""
        self.resume()
        reported = -1
        while not stop.is_set():
            self.consume()
            if self.ready() and self.state.owed > 0:
                self.train(min(TRAIN_CHUNK, self.state.owed))
                self.ship_if_due()
                continue
            if self.ship_if_due():
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
        coordinator, "trainer", cfg.heartbeat_s, lambda: {"step": trainer.state.step, "cursor": trainer.state.cursor, "candidates": trainer.shipping.shipped,
                 "last_candidate": trainer.shipping.last.version if trainer.shipping.last else None}
    ).start()
    try:
        trainer.run(stop)
    finally:
        heartbeat.stop()
        coordinator.close()
