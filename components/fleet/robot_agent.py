"""One robot (simulated here): act through the inference service, spool, upload, never lose an episode.

    wait until inference answers -> run one episode: obs -> POST /v1/act -> sampled gripper -> env
      (a history policy, ``policy.history`` > 1: the robot sends its episode's last frames instead)
      (a chunk policy: the service answers the next k actions; the robot executes them with temporal
       ensembling and asks again every ``policy.replan_every`` steps: ``RemotePolicy``)
      (inference times out mid-episode: hold a safe action, end the episode as interrupted)
      (cameras, ``sim.cameras``: the env returns the Dict observation; the robot asks GET /v1/policy
       which cameras the model serving it sees and sends their frames with the state in
       camera_wire.py's binary body -- none for a state model; a 409/422 on the cameras (the
       champion changed kind) makes it ask again and resend once. The episode keeps every
       camera's frames and is spooled and uploaded as camera_wire.py's episode body)
    -> spool it (write-ahead, fsync) -> the uploader thread sends pending episodes with retries
       and exponential backoff + jitter (at least the service's Retry-After on 429) until the
       ingest service says stored, or rejects it (4xx: set aside in rejected/ with the reason)
    an unreadable spool entry is set aside (unreadable/ + reason) and the uploader goes on; the
    lease is renewed only while the uploader thread lives, so a dead uploader gets the robot
    restarted

Episode k of a robot gets its id and starting layout from (seed, robot, spool epoch, k);
numbering resumes from the spool after a restart and a lost spool starts a new random epoch, so a
crashed or re-imaged robot neither loses finished episodes nor reuses an id for other content. With ``runtime.robot_episodes = N`` the agent
exits 0 once N episodes are finished *and* uploaded.
"""

from __future__ import annotations

import logging
import os
import threading
from dataclasses import dataclass

import numpy as np

from components.config import Settings
from components.episodes.record import Episode, camera_key, new_episode_id
from components.episodes.rows import camera_hash
from components.episodes.schema import episode_to_table, table_to_ipc
from components.fleet.camera_wire import encode_episode
from components.fleet.clients import (
    CoordinatorClient,
    HeartbeatThread,
    InferenceClient,
    InferenceUnavailable,
    IngestClient,
    ObservationRefused,
    UploadResult,
    base_url,
)
from components.fleet.layout import RuntimeLayout
from components.fleet.spool import Spool, content_hash
from components.policy.ensemble import ChunkEnsemble
from components.policy.history import FrameHistory
from components.policy.observation import sim_images
from components.sim.factory import action_dim, make_env, make_exploration
from components.sim.camera import STATE_KEY
from components.sim.pickplace import GRIPPER_ACTION
from components.sim.profile import stable_robot_hash

log = logging.getLogger(__name__)

EPISODE_STREAM = 11  # salt: per-episode seeds, apart from the sim's own streams
OPEN_JAW = -1.0
UNAVAILABLE_VERSION = "unavailable"


def split_observation(obs: np.ndarray | dict[str, np.ndarray]) -> tuple[np.ndarray, dict[str, np.ndarray]]:
    """An env observation -> the state (1, n) and its frames keyed as the dataset keys them ({} without cameras)."""
    if isinstance(obs, dict):
        return obs[STATE_KEY], sim_images(obs, STATE_KEY)
    return obs, {}


def episode_seed(seed: int, robot_id: str, index: int, epoch: int = 0) -> int:
    """Seed of a robot's k-th episode in a spool epoch: stable across processes and restarts."""
    return int(np.random.default_rng([seed, stable_robot_hash(robot_id), epoch, index, EPISODE_STREAM]).integers(2**31))


class RemotePolicy:
    """One episode's policy through the inference service: ``obs (1, n) -> action (1, m)``.

    Pushes every observation into the episode's window; asks the service when a decision is due:
    every step for a single-action policy, every ``policy.replan_every`` steps for a chunk policy,
    whose chunks run through ``ChunkEnsemble`` (a served chunk of another length -- a new champion
    -- restarts the ensemble). Between queries the robot needs no answer from the service.
    """

    def __init__(self, inference: InferenceClient, settings: Settings, cameras: dict | None = None) -> None:
        self.inference, self.cfg = inference, settings.policy
        self.frames = FrameHistory(settings.policy.frames())  # this episode's window (policy/history.py)
        self.ensemble: ChunkEnsemble | None = None
        self.versions: list[str] = []  # the version that answered each query
        self.cameras = dict(cameras or {})  # the cameras the serving model sees (GET /v1/policy)

    def __call__(self, obs: np.ndarray | dict[str, np.ndarray]) -> np.ndarray:
        state, images = split_observation(obs)
        window = self.frames.push(state)[0] if self.frames.history > 1 else state[0]
        if self.ensemble is not None and not self.ensemble.due(1)[0]:
            return self.ensemble.act()
        result = self._ask(window, images)
        self.versions.append(result.policy_version)
        if result.chunk is None:
            self.ensemble = None
            return result.action[None, :]
        k = len(result.chunk)
        if self.ensemble is None or self.ensemble.chunk != k:
            self.ensemble = ChunkEnsemble(k, min(self.cfg.replan_every, k), self.cfg.ensemble_decay)
            self.ensemble.due(1)  # a fresh buffer at this step
        self.ensemble.add(result.chunk[None], np.ones(1, dtype=bool))
        return self.ensemble.act()

    def _ask(self, window: np.ndarray, images: dict[str, np.ndarray]):
        try:
            return self.inference.act(window, self._frames_for(images))
        except ObservationRefused as exc:  # the served model changed kind or cameras: ask, resend once
            log.info("inference wants another observation (%s); asking which cameras", exc.detail.get("reason"))
            self.cameras = self.inference.cameras()
            return self.inference.act(window, self._frames_for(images))

    def _frames_for(self, images: dict[str, np.ndarray]) -> dict[str, np.ndarray] | None:
        """This step's frame of each camera the serving model sees; None for a state model."""
        if not self.cameras:
            return None
        return {key: images[key][0] for key in self.cameras if key in images}


def safe_action(act_dim: int, jaw: float) -> np.ndarray:
    """Stand still and keep the jaw as it is (dropping a held object is not safe)."""
    action = np.zeros(act_dim, dtype=np.float32)
    action[GRIPPER_ACTION] = jaw
    return action


class Backoff:
    """Exponential backoff with full jitter, seeded; ``reset`` after a success."""

    def __init__(self, initial_s: float, max_s: float, seed: int) -> None:
        self.initial_s, self.max_s = initial_s, max_s
        self.rng = np.random.default_rng(seed)
        self.attempt = 0

    def next_delay(self) -> float:
        ceiling = min(self.max_s, self.initial_s * 2**self.attempt)
        self.attempt += 1
        return float(self.rng.uniform(0.5 * ceiling, ceiling))

    def reset(self) -> None:
        self.attempt = 0


@dataclass
class RobotReport:
    robot_id: str
    episodes: int = 0  # finished by this process
    interrupted: int = 0
    uploaded: int = 0
    rejected: int = 0
    unreadable: int = 0


class Uploader:
    """Drains the spool in index order; a background thread in the robot process."""

    def __init__(self, spool: Spool, ingest: IngestClient, backoff: Backoff, report: RobotReport) -> None:
        self.spool = spool
        self.ingest = ingest
        self.backoff = backoff
        self.report = report
        self.wake = threading.Event()
        self.idle = threading.Event()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="uploader", daemon=True)

    def start(self) -> "Uploader":
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self.wake.set()
        self._thread.join(timeout=5.0)

    def alive(self) -> bool:
        """The upload thread runs (what the robot's lease renewal depends on)."""
        return self._thread.is_alive()

    def drain_once(self) -> bool:
        """Try every pending episode once; True when the spool is empty."""
        for item in self.spool.pending():
            if self._stop.is_set():
                return False
            try:
                data = item.path.read_bytes()
            except OSError as exc:
                reason = f"unreadable spool entry ({type(exc).__name__}: {exc})"
                kept = self.spool.set_aside_unreadable(item, reason)
                self.report.unreadable += 1
                log.error("episode %s: %s; set aside as %s, uploading the rest", item.episode_id, reason, kept)
                continue
            result: UploadResult = self.ingest.upload(data)
            if result.stored:
                self.spool.ack(item, result.status)
                self.report.uploaded += 1
                self.backoff.reset()
            elif result.status == "rejected":
                self.spool.reject(item, {"http_status": result.http_status, **result.detail})
                self.report.rejected += 1
                log.error("episode %s rejected (%s): %s", item.episode_id, result.http_status, result.detail.get("reason"))
            else:
                delay = max(self.backoff.next_delay(), result.retry_after_s)
                log.info("upload of %s deferred (%s %s); retry in %.2fs", item.episode_id, result.http_status, result.detail.get("reason", ""), delay)
                self._stop.wait(delay)
                return False
        return not self.spool.pending()

    def _run(self) -> None:
        while not self._stop.is_set():
            self.wake.clear()
            try:
                empty = self.drain_once()
            except Exception:  # noqa: BLE001 - one bad round must not end uploading; back off, go on
                delay = self.backoff.next_delay()
                log.exception("upload round failed; retrying in %.2fs", delay)
                self._stop.wait(delay)
                continue
            if empty:
                self.idle.set()
                self.wake.wait(timeout=1.0)
            else:
                self.idle.clear()


class RobotAgent:
    """Runs one robot's episodes against the services."""

    def __init__(self, settings: Settings, robot_id: str, inference: InferenceClient, spool: Spool) -> None:
        self.settings = settings
        self.robot_id = robot_id
        self.inference = inference
        self.spool = spool
        self.cfg = settings.runtime
        self.act_dim = action_dim(settings.sim)
        self.report = RobotReport(robot_id)
        self.policy_version = UNAVAILABLE_VERSION  # the version that chose the last episode's first action
        self.serving = UNAVAILABLE_VERSION  # the version that answered this robot's latest /v1/act
        self.cameras: dict[str, tuple[int, int]] = {}  # what the serving model sees (GET /v1/policy)

    def wait_for_inference(self, stop: threading.Event, obs_dim: int) -> bool:
        """Hold still until the inference service answers (True) or ``stop`` is set; learns which
        cameras the serving model sees, and waits while this robot renders not all of them."""
        backoff = Backoff(self.cfg.retry_initial_s, self.cfg.retry_max_s, stable_robot_hash(self.robot_id) % 2**31)
        while not stop.is_set():
            try:
                self.cameras = self.inference.cameras()
                if self._can_see(self.cameras):
                    probe = {key: np.zeros((h, w, 3), np.uint8) for key, (h, w) in self.cameras.items()}
                    self.serving = self.inference.act(np.zeros(obs_dim, dtype=np.float32), probe or None).policy_version
                    return True
            except InferenceUnavailable:
                pass
            stop.wait(backoff.next_delay())
        return False

    def _can_see(self, cameras: dict[str, tuple[int, int]]) -> bool:
        rendered = {camera_key(view) for view in self.settings.sim.cameras}
        if set(cameras) <= rendered:
            return True
        log.error("%s: the served model sees cameras %s, this robot renders %s; set sim.cameras to include them "
                  "(holding still until then)", self.robot_id, sorted(cameras), sorted(rendered))
        return False

    def run_episode(self, index: int) -> Episode:
        """One episode on the simulator; inference trouble ends it early as interrupted."""
        sim = self.settings.sim
        seed = episode_seed(self.settings.seed, self.robot_id, index, self.spool.epoch)
        env = make_env(sim, [self.robot_id], seed)
        remote = RemotePolicy(self.inference, self.settings, self.cameras)
        versions = remote.versions

        # explores as the pipeline's collection does (jaw sampled, sim.motion_noise_std on motion)
        policy = make_exploration(sim, remote, seed) if self.settings.fleet.sample_gripper else remote
        obs, _ = env.reset()
        states, actions = [], []
        frames: dict[str, list[np.ndarray]] = {}  # camera key -> one frame per row (sim.cameras)
        success = interrupted = False
        jaw = OPEN_JAW
        for _ in range(sim.max_steps):
            try:
                action = np.asarray(policy(obs), dtype=np.float32)
            except InferenceUnavailable as exc:
                log.warning("%s: inference unavailable (%s); holding a safe action, episode interrupted", self.robot_id, exc)
                _record(obs, states, frames)
                actions.append(safe_action(self.act_dim, jaw))
                interrupted = True
                break
            if versions:
                self.serving = versions[-1]  # the version that answered this robot's latest /v1/act
            _record(obs, states, frames)
            actions.append(action[0].copy())
            jaw = float(action[0, GRIPPER_ACTION])
            obs, _, terminated, truncated, info = env.step(action)
            if terminated[0] or truncated[0]:
                success = bool(info["success"][0])
                break
        env.close()
        if versions:
            self.policy_version = versions[0]
        length = len(states)
        return Episode(
            episode_id=new_episode_id(np.random.default_rng([seed, index, self.spool.epoch])),
            robot_id=self.robot_id,
            task=sim.task,
            states=np.stack(states).astype(np.float32),
            actions=np.stack(actions).astype(np.float32),
            timestamps=(np.arange(length, dtype=np.float64) / sim.control_hz).astype(np.float32),
            success=success and not interrupted,
            interrupted=interrupted,
            # the version that chose this episode's first action (what the canary gate counts)
            policy_version=versions[0] if versions else UNAVAILABLE_VERSION,
            cameras={key: np.stack(images) for key, images in frames.items()},
        )

    def finish(self, index: int, episode: Episode) -> None:
        """Write-ahead: the episode is durable locally before anyone tries to upload it; with its
        camera frames in the same spool entry (camera_wire.py's episode body), hashed as the
        dataset hashes them, so the ledger still names exactly what was stored."""
        table = episode_to_table(episode)
        data, digest = table_to_ipc(table), content_hash(table)
        if episode.cameras:
            data, digest = encode_episode(data, episode.cameras), camera_hash(digest, episode.cameras)
        self.spool.write(index, episode.episode_id, digest, data)
        self.report.episodes += 1
        self.report.interrupted += int(episode.interrupted)


def _record(obs: np.ndarray | dict[str, np.ndarray], states: list, frames: dict[str, list[np.ndarray]]) -> None:
    """One row of the episode: the state and every camera's frame of this step."""
    state, images = split_observation(obs)
    states.append(state[0].copy())
    for key, image in images.items():
        frames.setdefault(key, []).append(image[0].copy())


def run_robot(settings: Settings, robot_id: str, token: str, stop: threading.Event | None = None) -> int:
    """The robot process: episodes until ``robot_episodes`` are done and uploaded (or forever)."""
    cfg = settings.runtime
    stop = stop or threading.Event()
    layout = RuntimeLayout.of(settings)
    spool = Spool(layout.spool(robot_id))
    claim = spool.claim()  # one agent per spool, or SpoolBusy (exit 1: the coordinator backs off)
    inference = InferenceClient(cfg.robot_inference_url or base_url(cfg.host, cfg.inference_port), token, cfg.inference_timeout_s)
    ingest = IngestClient(cfg.robot_ingest_url or base_url(cfg.host, cfg.ingest_port), token, cfg.upload_timeout_s)
    agent = RobotAgent(settings, robot_id, inference, spool)
    jitter_seed = stable_robot_hash(robot_id) % 2**31
    uploader = Uploader(spool, ingest, Backoff(cfg.retry_initial_s, cfg.retry_max_s, jitter_seed), agent.report).start()
    coordinator = CoordinatorClient(base_url(cfg.host, cfg.coordinator_port), token, cfg.heartbeat_s * 2)

    def info() -> dict:
        return {"episodes": spool.next_index(), "pending": len(spool.pending()), "policy_version": agent.policy_version,
                "serving": agent.serving}

    # no lease renewal while the uploader is dead: the coordinator then restarts this robot
    heartbeat = HeartbeatThread(coordinator, robot_id, cfg.heartbeat_s, info, healthy=uploader.alive).start()
    from components.sim.factory import observation_dim

    obs_dim = observation_dim(settings.sim)
    try:
        index = spool.next_index()
        while not stop.is_set() and (cfg.robot_episodes == 0 or index < cfg.robot_episodes):
            if not agent.wait_for_inference(stop, obs_dim):
                break
            episode = agent.run_episode(index)
            agent.finish(index, episode)
            uploader.wake.set()
            index += 1
        while not stop.is_set() and spool.pending():  # finite run: done only when all is uploaded
            uploader.wake.set()
            stop.wait(cfg.heartbeat_s)
        log.info("%s done: %s", robot_id, agent.report)
        return 0
    finally:
        uploader.stop()
        heartbeat.stop()
        for client in (inference, ingest, coordinator):
            client.close()
        os.close(claim)
