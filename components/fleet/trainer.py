"""The asynchronous fleet trainer: keeps learning from whatever the fleet has stored so far.

    poll the episode dataset -> episodes past the data cursor join the replay buffer
      (uninterrupted ones; noted from the episodes table, their frames read only when a training
      set is built: fert/corpus.py); the frames and weights to imitate come from the flow's own builder
      (``pipeline.steps.method_training_set``, ``train.method``: FERT by default), rebuilt by the
      rule of ``training_set.py`` — for FERT from a pinned segment store version, so it replays
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
    episodes, which never change: the dataset only appends, and the training set from the
    checkpoint's pin), else start fresh.

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

import torch

from components.config import Settings
from components.episodes.dataset import EpisodeDataset
from components.fert.corpus import DatasetCorpus, EpisodeInfo, episode_infos
from components.fert.methods import MethodTrainingSet
from components.fert.retrieval_record import RetrievalRecord
from components.fleet.clients import CoordinatorClient, HeartbeatThread
from components.fleet.layout import RuntimeLayout
from components.fleet.shipping import CandidateShipper, ShippingState
from components.fleet.training_set import BuildPin, StorePins, describe
from components.fsio import atomic_write_bytes
from components.pipeline.steps import RETRIEVAL_METHODS, method_training_set
from components.policy.history import (
    as_tensor_episode_ends,
    as_tensor_positions,
    frame_positions,
    gather_chunks,
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


def refuse_recipes_it_cannot_honour(settings: Settings) -> None:
    """The asynchronous trainer has no run length for a cosine rate to span, and samples its own
    batches: refuse the one trainer's recipe knobs it cannot honour, rather than ignore them."""
    train = settings.train
    if train.lr_schedule != "constant" or train.state_noise > 0:
        raise ValueError(f"train.lr_schedule={train.lr_schedule!r}, train.state_noise={train.state_noise}: the fleet "
                         "runtime's trainer (FATS) trains without a run length or input jitter; fix: set "
                         "train.lr_schedule: constant and train.state_noise: 0 in params.yaml for fleetloop fleet runs")


class FleetTrainer:
    """Replay buffer + policy + optimizer, checkpointed; one instance per trainer process."""

    def __init__(self, settings: Settings) -> None:
        refuse_recipes_it_cannot_honour(settings)
        self.settings = settings
        self.cfg = settings.runtime
        self.layout = RuntimeLayout.of(settings)
        self.dataset = EpisodeDataset(settings.paths.episodes, settings.episodes)
        self.obs_dim, self.act_dim = observation_dim(settings.sim), action_dim(settings.sim)
        self.generator = seed_everything(settings.seed)
        self.state = TrainerState()
        self.policy: NormalizedPolicy | None = None
        self.optimizer: torch.optim.Optimizer | None = None
        self._ids: list[str] = []  # every consumed dataset episode, in dataset order
        self._kept: list[tuple[int, EpisodeInfo]] = []  # (dataset position, info) of those kept (no frames)
        self._buffer: TrainingSet | None = None
        self._built: MethodTrainingSet | None = None
        self._pin: BuildPin | None = None  # what _buffer was built from
        self._build_record: dict | None = None
        self.pins = StorePins(settings)
        self._block: torch.Tensor | None = None
        self._block_key: tuple | None = None
        self.shipping = ShippingState(run_id=uuid.uuid4().hex[:12], since=time.time())
        self.shipper = CandidateShipper(settings, self.shipping)
        self._checkpointed: tuple[int, float] | None = None  # (step, wall time) of the newest checkpoint

    # -------------------------------------------------------------------------- data
    @property
    def retrieves(self) -> bool:
        """FERT methods: failures query the segment store (so they are kept, and builds are pinned)."""
        return self.cfg.trainer_success_only and self.settings.train.method in RETRIEVAL_METHODS

    def _keep(self, episode: EpisodeInfo) -> bool:
        if episode.interrupted:
            return False
        return episode.success or self.retrieves or not self.cfg.trainer_success_only

    def _read(self, start: int, stop: int | None) -> int:
        """Note dataset episodes [start, stop) from the episodes table (their frames are read when
        a training set is built, fert/corpus.py); returns how many were read."""
        read = 0
        for position, (_, episode) in enumerate(episode_infos(self.dataset, start, stop), start=start):
            read += 1
            self._ids.append(episode.episode_id)
            if self._keep(episode):
                self._kept.append((position, episode))
                self.state.frames += episode.length
        if read and not self.retrieves:
            self._buffer = None  # rebuilt from everything on the next step
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
        new = self._read(self.state.cursor, None) if self.dataset.num_episodes > self.state.cursor else 0
        self.state.cursor += new
        self.state.owed += new * self.cfg.steps_per_episode
        if self.retrieves:  # the store may have caught up even when the dataset did not grow
            self.update_training_set()
        return new

    def update_training_set(self) -> bool:
        """FERT methods: rebuild from a new pin when one is due (``training_set.py``); True if rebuilt.
        A build that fails (e.g. a store caught mid-write) is logged; training goes on on the last one."""
        pin = self.pins.next_pin(self._ids, self._pin)
        if pin is None:
            return False
        try:
            self._rebuild(pin)
        except (RuntimeError, ValueError) as exc:
            self.pins.waiting = f"build at store v{pin.store_version} failed: {exc}"[:300]
            log.warning("%s; training on the last training set", self.pins.waiting)
            return False
        self.pins.keep(pin, self.cfg.checkpoints_kept + 1)
        return True

    def _rebuild(self, pin: BuildPin) -> None:
        """The training set of ``pin``: its first episodes, the store at its version, its champion."""
        episodes = DatasetCorpus(self.dataset, stop=pin.episodes)
        rng = capture_rng(self.generator)  # building draws from its own seeds; keep ours untouched
        try:
            built = method_training_set(self.settings, episodes, self.pins.view(pin), pin.champion)
        finally:
            restore_rng(rng, self.generator)
        self._use(built, pin)
        log.info("training set rebuilt from %d episodes, store v%d: %d frames, %d matches (%.1fs)",
                 pin.episodes, pin.store_version, len(built.data.states), built.report.matches, built.report.seconds)

    def _use(self, built: MethodTrainingSet, pin: BuildPin) -> None:
        self._built, self._buffer, self._pin = built, built.data, pin
        self._build_record = describe(built, pin, self.state.step)

    def describe_training_set(self) -> str:
        """One line for ``fleet status``: what the trainer imitates, and from what (or why it waits)."""
        pin = self._pin
        if pin is None:
            return f"{self.method}: {self.pins.waiting or 'no data yet'}"
        store = f", store v{pin.store_version}" if pin.store_version >= 0 else ""
        waiting = f" (next: {self.pins.waiting})" if self.pins.waiting else ""
        return f"{self.method} on {pin.episodes} episodes{store}{waiting}"

    def _tensors(self) -> TrainingSet:
        """The training set: FERT's last pinned build, or (other methods) every kept episode."""
        if self._buffer is not None:
            return self._buffer
        if self.retrieves:
            raise RuntimeError(f"no FERT training set yet ({self.pins.waiting or 'none built'})")
        consumed = len(self._ids)  # the cursor, also while resume() is still restoring it
        pin = BuildPin(consumed)
        episodes = DatasetCorpus(self.dataset, stop=consumed)  # by id, uninterrupted
        if not self.cfg.trainer_success_only:  # every uninterrupted episode, uniform
            states, actions = episodes.frames([info.episode_id for info in episodes.infos])
            self._buffer = TrainingSet(states, actions, frame_in_episode=frame_positions([i.length for i in episodes.infos]))
            self._pin = pin
        else:
            self._use(method_training_set(self.settings, episodes, None, None), pin)
        return self._buffer

    @property
    def method(self) -> str:
        """What the buffer imitates (the candidates' ``fleetloop.method`` tag)."""
        return self.settings.train.method if self.cfg.trainer_success_only else "uninterrupted_bc"

    # -------------------------------------------------------------------------- model
    def _build(self, data: TrainingSet) -> None:
        spec = TrainSpec(data=data, policy=self.settings.policy, lr=self.settings.train.lr,
                         weight_decay=self.settings.train.weight_decay, batch_size=self.cfg.trainer_batch_size,
                         seed=self.settings.seed, total_steps=1, steps_per_iteration=self.settings.train.steps_per_iteration)
        self.policy = initial_policy(spec)  # normalizers fitted on the training set, as the flow's trainer does
        self.optimizer = make_optimizer(self.policy, self.settings.train.lr, self.settings.train.weight_decay)

    def ready(self) -> bool:
        if self.retrieves:
            return self._buffer is not None and len(self._buffer.states) >= self.cfg.trainer_batch_size
        return self.state.frames >= self.cfg.trainer_batch_size

    def _batch(self, data: TrainingSet, step: int) -> torch.Tensor:
        """Frame indices of optimizer step ``step`` (0-based): the one sampler's draw for its iteration."""
        k = self.settings.train.steps_per_iteration
        key = (step // k, self._pin, len(data.states))
        if self._block_key != key:
            self._block = batch_indices(len(data.states), as_weights(data.weights), self.cfg.trainer_batch_size, k,
                                        self.settings.seed, step // k)
            self._block_key = key
        return self._block[step % k]

    def train(self, steps: int) -> None:
        """``steps`` optimizer steps on the buffer (fits the normalizers first if the model is new).

        Runs at ``runtime.torch_threads`` intra-op threads whoever calls it: a MoE step's sums
        differ in the last bit between thread counts, and the flow's trainer runs at one thread."""
        if self.cfg.torch_threads and torch.get_num_threads() != self.cfg.torch_threads:
            torch.set_num_threads(self.cfg.torch_threads)
        data = self._tensors()
        if self.policy is None:
            self._build(data)
        assert self.policy is not None and self.optimizer is not None
        self.policy.train()
        states = torch.as_tensor(data.states)
        positions = as_tensor_positions(data.frame_in_episode)
        targets = self.policy.act_norm.normalize(torch.as_tensor(data.actions))
        ends = as_tensor_episode_ends(data.frame_in_episode) if self.policy.chunk > 1 else None  # chunk targets' bounds
        for _ in range(steps):
            idx = self._batch(data, self.state.step)
            inputs = gather_windows(states, positions, idx, self.policy.history)
            chunk, mask = gather_chunks(targets, ends, idx, self.policy.chunk)
            loss = bc_step(self.policy, self.optimizer, inputs, chunk, mask=mask)
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
                       "shipping": self.shipping.to_dict(), "pin": self._pin.to_dict() if self._pin else None},
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
        pin = ckpt.extra.get("pin")
        if self.retrieves:
            if pin is None:
                raise RuntimeError(f"checkpoint step {ckpt.step} has no training-set pin (written for another "
                                   f"train.method); move {self.layout.checkpoints} aside to start fresh")
            self._rebuild(BuildPin.from_dict(pin))
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
            "candidates": self.shipping.to_dict(), "training_set": self._build_record, "waiting": self.pins.waiting,
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
                copy.deepcopy(self.policy), self.state.step, self.state.cursor, len(self._tensors().states),
                [loss for _, loss in self.state.losses], Counter(info.robot_id for _, info in self._kept),
                self.method, started=self._checkpointed[1], **self._provenance(),
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

    def _provenance(self) -> dict:
        """What the candidate's lineage adds for a pinned build: the store version its retrieval
        read, and the record the failure explorer renders (``fleetloop explain``)."""
        if self._built is None or self._pin is None or self._pin.store_version < 0:
            return {}
        record = RetrievalRecord.from_training_set(self._built, self.settings.seed, self.settings.store.window)
        return {"store_version": self._pin.store_version, "retrieval": record}

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
                 "last_candidate": trainer.shipping.last.version if trainer.shipping.last else None,
                 "training_set": trainer.describe_training_set()}
    ).start()
    try:
        trainer.run(stop)
    finally:
        heartbeat.stop()
        coordinator.close()
