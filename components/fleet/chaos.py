"""Chaos run: a whole fleet on loopback while a seeded scheduler SIGKILLs its processes.

    fleet up (coordinator + ingest + inference + trainer + R robots, N episodes each)
    -> after the first episodes are stored, kill targets at random gaps (seeded): robots, the
       inference service, the ingest service, the trainer (once it has a checkpoint), the
       coordinator (its members must stop by themselves; the runner then does what an operator's
       `fleet up` or a service manager does: stops any member that outlived it, starts a new one)
    -> wait until every robot finished and uploaded, and the trainer resumed and went on
    -> fleet down; then audit, from disk only:
         finished   = every episode any robot spooled (ledger + pending + rejected)
         stored     = the episode dataset; duplicated = ids stored more than once
         lost       = finished but not stored; corrupted = stored content hash != finished hash,
                      or a stored episode that no longer validates
         trainer    = resumes (from which checkpoint step), the loss curve around each resume

Everything is bounded: a fixed number of kills, a wall-clock timeout, and every process started
is stopped (and checked gone) before the report is returned.
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import asdict, dataclass, field

import httpx
import numpy as np

from components.config import FleetConfig, Settings
from components.fleet.auth import SERVICE, issue_tokens, token_for
from components.fleet.clients import CoordinatorClient
from components.fleet.layout import RuntimeLayout
from components.fleet.local import register_policy, service_url, with_free_ports
from components.fleet.identity import fleet_processes, stop_verified, wait_gone
from components.fleet.processes import ProcessSpec, kill_pid, start_process, stop_process, wait_healthy, write_settings
from components.fleet.spool import Spool
from components.fleet.trainer import STATUS_NAME

log = logging.getLogger(__name__)

TARGETS = ("robot", "inference", "ingest", "trainer", "coordinator")
POLL_S = 0.25
LOSS_WINDOW = 5  # steps averaged before/after a resume in the report


@dataclass(frozen=True)
class ChaosPlan:
    robots: int = 4
    episodes_per_robot: int = 30  # enough that data still arrives after the last kill on a quiet machine
    kills: tuple[str, ...] = ("robot", "inference", "robot", "coordinator", "ingest", "trainer")  # robots finish first
    min_gap_s: float = 1.0
    max_gap_s: float = 2.5
    seed: int = 0
    timeout_s: float = 150.0


@dataclass(frozen=True)
class Fault:
    at_s: float  # seconds after the fleet came up
    target: str  # member name
    pid: int


@dataclass
class ChaosReport:
    robots: int
    episodes_per_robot: int
    finished: int = 0
    stored: int = 0
    duplicated: int = 0
    lost: int = 0
    corrupted: int = 0
    interrupted: int = 0
    faults: list[Fault] = field(default_factory=list)
    restarts: dict[str, int] = field(default_factory=dict)
    trainer_steps: int = 0
    trainer_resumes: list[int] = field(default_factory=list)
    loss_around_resumes: list[dict] = field(default_factory=list)
    loss_steps_contiguous: bool = False
    completed: bool = False  # every robot finished before the timeout
    leaked_pids: list[int] = field(default_factory=list)
    outlived_coordinator: int = 0  # members still running stop_grace_s * 2 after a coordinator SIGKILL
    seconds: float = 0.0

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=2)


def chaos_settings(base: Settings, plan: ChaosPlan, **runtime: object) -> Settings:
    """A small, fast fleet on free loopback ports (short episodes, frequent checkpoints)."""
    defaults = dict(
        robot_episodes=plan.episodes_per_robot, checkpoint_every=10, steps_per_episode=4, trainer_batch_size=32,
        trainer_success_only=False, heartbeat_s=0.25, lease_s=4.0, startup_grace_s=90.0, alias_poll_s=0.5,
        inference_timeout_s=1.0, retry_initial_s=0.05, retry_max_s=0.5, stop_grace_s=3.0, canary_share=0.0,
    )
    defaults.update(runtime)
    settings = with_free_ports(base, **defaults)
    fleet = FleetConfig(**{**base.fleet.model_dump(), "num_robots": plan.robots})
    return settings.model_copy(update={"fleet": fleet})


def ensure_champion(settings: Settings) -> int:
    """A champion for the fleet to run: the registry's, else a freshly initialized policy."""
    import torch

    from components.policy.factory import make_policy
    from components.registry.model_registry import PolicyRegistry
    from components.sim.factory import action_dim, observation_dim

    registry = PolicyRegistry(settings.paths.mlruns, settings.registry)
    champion = registry.champion()
    if champion is not None:
        return champion.version
    torch.manual_seed(settings.seed)
    policy = make_policy(observation_dim(settings.sim), action_dim(settings.sim), settings.policy)
    version = register_policy(settings, policy, run_name="chaos-initial")
    registry.set_champion(version)
    return version


def _trainer_status(layout: RuntimeLayout) -> dict:
    path = layout.state / STATUS_NAME
    try:
        return json.loads(path.read_text())
    except (FileNotFoundError, ValueError):
        return {}


def audit(settings: Settings, report: ChaosReport) -> ChaosReport:
    """Count finished / stored / duplicated / lost / corrupted from what is on disk."""
    from components.episodes.dataset import EpisodeDataset
    from components.episodes.schema import episode_to_table
    from components.episodes.validation import validate_episode_table
    from components.training.checkpoint import load_latest

    layout = RuntimeLayout.of(settings)
    finished: dict[str, str] = {}
    for robot in settings.fleet.robot_ids():
        finished.update(Spool(layout.spool(robot)).finished())
    dataset = EpisodeDataset(settings.paths.episodes, settings.episodes)
    meta = dataset.episodes_meta()
    ids = meta.column("episode_id").to_pylist() if meta is not None else []
    hashes = meta.column("content_hash").to_pylist() if meta is not None else []
    stored = dict(zip(ids, hashes))
    corrupted = {i for i, h in stored.items() if i in finished and finished[i] != h}
    for episode in dataset.episodes():  # every stored episode must still read back and validate
        try:
            validate_episode_table(episode_to_table(episode), None, None, None, f"stored {episode.episode_id}")
        except ValueError:
            corrupted.add(episode.episode_id)
    report.finished = len(finished)
    report.stored = len(set(ids))
    report.duplicated = len(ids) - len(set(ids))
    report.lost = len(set(finished) - set(stored))
    report.corrupted = len(corrupted)
    report.interrupted = int(np.sum(meta.column("interrupted").to_numpy(zero_copy_only=False))) if meta is not None else 0

    ckpt = load_latest(layout.checkpoints)
    if ckpt is not None:
        losses = [(int(s), float(v)) for s, v in ckpt.extra.get("losses", [])]
        steps = [s for s, _ in losses]
        report.trainer_steps = ckpt.step
        report.trainer_resumes = [int(r) for r in ckpt.extra.get("resumes", [])]
        report.loss_steps_contiguous = steps == list(range(1, len(steps) + 1))
        by_step = dict(losses)
        for resume in report.trainer_resumes:
            before = [by_step[s] for s in range(max(1, resume - LOSS_WINDOW + 1), resume + 1) if s in by_step]
            after = [by_step[s] for s in range(resume + 1, resume + LOSS_WINDOW + 1) if s in by_step]
            first = [by_step[s] for s in range(1, LOSS_WINDOW + 1) if s in by_step]
            report.loss_around_resumes.append(
                {
                    "resume_step": resume,
                    "first_steps_mean": float(np.mean(first)) if first else None,
                    "before_mean": float(np.mean(before)) if before else None,
                    "after_mean": float(np.mean(after)) if after else None,
                }
            )
    return report


def run_chaos(settings: Settings, plan: ChaosPlan) -> ChaosReport:
    """Run the fleet under the kill schedule, stop everything, audit; never leaves a process behind."""
    layout = RuntimeLayout.of(settings).ensure()
    issue_tokens(layout.token_file, settings.fleet.robot_ids())
    ensure_champion(settings)
    settings_file = write_settings(settings)
    rng = np.random.default_rng(plan.seed)
    report = ChaosReport(plan.robots, plan.episodes_per_robot)
    service_token = token_for(SERVICE, layout.token_file, settings.runtime.tokens)
    grace = settings.runtime.stop_grace_s
    url = service_url(settings, "coordinator")

    def start_coordinator():
        proc = start_process(ProcessSpec("coordinator", "coordinator"), settings_file, layout.logs)
        if not wait_healthy(url, plan.timeout_s, proc):
            stop_process(proc, grace)
            raise RuntimeError(f"coordinator did not start; see {layout.logs / 'coordinator.log'}")
        return proc

    client = CoordinatorClient(url, service_token, 5.0)
    start = time.monotonic()
    deadline = start + plan.timeout_s
    carried: dict[str, int] = {}  # restarts counted by coordinators since killed (+1: the next one started them)
    coordinator_restarts = 0
    coordinator = start_coordinator()
    try:
        def status() -> dict:
            while True:  # bounded: a coordinator being replaced answers again within the deadline
                try:
                    return client.status()
                except httpx.HTTPError:
                    if time.monotonic() > deadline:
                        raise
                    time.sleep(POLL_S)

        def restarts() -> dict[str, int]:
            now = {n: m["restarts"] for n, m in status()["members"].items()}
            total = {n: now.get(n, 0) + carried.get(n, 0) for n in {*now, *carried}}
            return {n: c for n, c in total.items() if c} | ({"coordinator": coordinator_restarts} if coordinator_restarts else {})

        def stored_episodes() -> int:
            robots = status()["members"]
            return sum(int(m["info"].get("episodes", 0)) - int(m["info"].get("pending", 0)) for m in robots.values() if m["role"] == "robot")

        while stored_episodes() < plan.robots and time.monotonic() < deadline:
            time.sleep(POLL_S)  # the fleet is up and uploading before the first fault
        fleet_up = time.monotonic()
        for target in plan.kills:
            time.sleep(float(rng.uniform(plan.min_gap_s, plan.max_gap_s)))
            if target == "trainer":
                while _trainer_status(layout).get("step", 0) < settings.runtime.checkpoint_every and time.monotonic() < deadline:
                    time.sleep(POLL_S)  # "resumed from a checkpoint" needs one to exist
            members = status()["members"]
            if target == "coordinator":
                for name, member in members.items():
                    carried[name] = carried.get(name, 0) + member["restarts"] + 1
                pid = coordinator.pid
                kill_pid(pid)
                coordinator.wait()
                report.faults.append(Fault(round(time.monotonic() - fleet_up, 2), "coordinator", pid))
                log.info("chaos: SIGKILL coordinator (pid %d)", pid)
                outlived = wait_gone(fleet_processes(settings_file), grace * 2, POLL_S)
                report.outlived_coordinator += len(outlived)
                stop_verified(outlived, grace, POLL_S)  # what `fleet up` does with orphans
                coordinator = start_coordinator()
                coordinator_restarts += 1
                continue
            if target == "robot":
                running = sorted(n for n, m in members.items() if m["role"] == "robot" and m["alive"] and not m["done"])
                if not running:
                    log.warning("no robot left running to kill; skipped")
                    continue
                name = str(rng.choice(running))
            else:
                name = target
            pid = members[name]["pid"]
            if pid and kill_pid(pid):
                report.faults.append(Fault(round(time.monotonic() - fleet_up, 2), name, pid))
                log.info("chaos: SIGKILL %s (pid %d)", name, pid)
        while time.monotonic() < deadline:
            body = status()
            if body["robots_done"] == body["robots"]:
                report.completed = True
                break
            time.sleep(POLL_S)
        killed_trainer = any(f.target == "trainer" for f in report.faults)
        while killed_trainer and time.monotonic() < deadline:
            trainer = _trainer_status(layout)
            resumes = trainer.get("resumes", [])
            if resumes and trainer.get("step", 0) > resumes[-1] and trainer.get("owed", 1) == 0:
                break  # resumed, continued, and caught up with the data
            time.sleep(POLL_S)
        killed = {f.target for f in report.faults}
        while time.monotonic() < deadline:  # a kill just before the robots finished: give the restart time
            if all(restarts().get(t, 0) >= 1 for t in killed):
                break
            time.sleep(POLL_S)
        report.restarts = restarts()
    finally:
        client.close()
        stop_process(coordinator, grace * 4)
        # everything this root still runs is a leak (found by command line, stopped verified)
        leaked = wait_gone(fleet_processes(settings_file), grace, POLL_S)
        report.leaked_pids = sorted(p.pid for p in leaked)
        stop_verified(leaked, grace, POLL_S)
    report.seconds = round(time.monotonic() - start, 1)
    return audit(settings, report)
